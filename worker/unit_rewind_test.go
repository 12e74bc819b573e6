package worker_test

// Unit tests of the rewind's decisions, on mocks (no database): where the replay starts,
// what it commits, which snapshots it keeps, and that its stream lock is taken and released
// once however it ends. The Store's side (the fencing check, which rows a commit writes and
// deletes) is SQL, tested on PostgreSQL.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"syscall"
	"testing"
	"testing/synctest"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/worker"
)

// rewindOver makes the Store's RewindStart return rs, and its Replay serve the stream evs:
// the events in (after, upto], in ID order, at most limit.
func (f *uFix) rewindOver(rs worker.RewindStart, evs []worker.Event) {
	f.store.RewindStartFunc = func(context.Context, worker.Pair) (worker.RewindStart, error) { return rs, nil }
	f.store.ReplayFunc = func(_ context.Context, _ worker.Pair, after, upto uuid.UUID, limit int) ([]worker.Event, error) {
		return uServe(evs, after, upto, limit), nil
	}
}

// uServe is what Store.Replay returns of the stream evs: its events in (after, upto], in
// ID order, at most limit.
func uServe(evs []worker.Event, after, upto uuid.UUID, limit int) []worker.Event {
	var page []worker.Event
	for _, ev := range evs {
		if uLess(after, ev.ID) && !uLess(upto, ev.ID) && len(page) < limit {
			page = append(page, ev)
		}
	}
	return page
}

// commit is the one RewindCommit made.
func (f *uFix) commit() worker.RewindCommit {
	f.t.Helper()
	calls := f.store.RewindCommitCalls()
	require.Len(f.t, calls, 1, "one commit")
	return calls[0].C
}

// uLate is the late-event scenario: a stream of 6 events; the pair applied 1, 2, 4 and 5
// (cursor at 5, version 7) when 3 arrived late; 3 and 6 are queued. It has snapshots at 1
// and 2, both before the late event.
type uLate struct {
	p   worker.Pair
	evs []worker.Event
	ids []uuid.UUID
	rs  worker.RewindStart
}

func (f *uFix) late() uLate {
	p := uPair(f.t)
	evs := uEvents(f.t, p.Stream, 6)
	ids := uIDs(evs)
	sc := uLate{p: p, evs: evs, ids: ids, rs: worker.RewindStart{
		Version:     7,
		LastEventID: uValid(ids[4]),
		Queued:      []uuid.UUID{ids[2], ids[5]},
		From:        &worker.Snapshot{EventID: ids[1], Model: uModel(f.t, uSeq(1, 2))},
		Snapshots:   []uuid.UUID{ids[1], ids[0]},
	}}
	f.rewindOver(sc.rs, evs)
	return sc
}

// uLateState is the late pair as the normal path reads it: cursor at 5, a snapshot at 2,
// events 3 and 6 queued.
func uLateState(t testing.TB, sc uLate) worker.PairState {
	return worker.PairState{Pair: sc.p, LastEventID: uValid(sc.ids[4]), SinceSnapshot: 2, Snapshots: []uuid.UUID{sc.ids[1]},
		Events: []worker.Event{sc.evs[2], sc.evs[5]}, Model: uModel(t, []int{1, 2, 4, 5}), ModelAt: sc.ids[4]}
}

// The rewind restores the newest snapshot before the late event, replays only what follows
// it, up to the newest queued event, and commits the fold of every event with the queued
// events it covered, fenced by the version it started from and (with a locker) by its lock.
func TestUnitRewindFromTheSnapshotBeforeTheLateEvent(t *testing.T) {
	t.Parallel()
	for _, withLocker := range []bool{true, false} {
		t.Run(fmt.Sprintf("locker %v", withLocker), func(t *testing.T) {
			t.Parallel()
			f := newUFix(t, withLocker, nil)
			sc := f.late()

			rep := f.w.RunRewind(context.Background(), sc.p)

			require.Len(t, f.store.RewindStartCalls(), 1)
			assert.Equal(t, sc.p, f.store.RewindStartCalls()[0].P)
			rp := f.store.ReplayCalls()
			require.Len(t, rp, 1)
			assert.Equal(t, sc.p.Stream, rp[0].P.Stream)
			assert.Equal(t, sc.ids[1], rp[0].After, "replay starts right after the restored snapshot")
			assert.Equal(t, sc.ids[5], rp[0].Upto, "and runs up to the newest queued event (newer than the cursor)")
			assert.Equal(t, 500, rp[0].Limit, "in pages of 500")
			assert.Equal(t, []int{3, 4, 5, 6}, f.appliedNs(), "only the events after the snapshot are applied")

			c := f.commit()
			assert.Equal(t, sc.p, c.Write.Pair)
			assert.Equal(t, uSeq(1, 6), utDecode(t, c.Write.Model), "the model is the fold of every event, in ID order")
			assert.Equal(t, []uuid.UUID{sc.ids[2], sc.ids[5]}, c.Write.Applied, "exactly the queued events")
			assert.Equal(t, sc.ids[5], c.Write.LastEventID)
			assert.Equal(t, 4, c.Write.SinceSnapshot, "events since the restored snapshot")
			assert.Empty(t, c.Write.Snapshots, "EveryNEvents (100) not reached")
			assert.Empty(t, c.Write.DropSnapshots)
			assert.Empty(t, c.Write.Failure)
			assert.Equal(t, int64(7), c.Version, "fenced by the version it started from")
			assert.Equal(t, sc.ids[2], c.DropFrom, "the snapshots from the late event on are invalid")
			if withLocker {
				assert.Equal(t, f.instance, c.Holder, "fenced by this instance's lock")
				f.acquired(sc.p, locker.ReasonRewind)
				assert.Equal(t, 1, f.releasedOnce(sc.p).writes, "the lock is released after the commit")
			} else {
				assert.Equal(t, uuid.Nil, c.Holder, "no locker: fenced by the version only")
			}
			assert.Empty(t, rep.Next)
			assert.Empty(t, rep.Contended)
			assert.Empty(t, f.store.MarkFailedCalls())
			assert.Contains(t, f.logs.String(), "rewind completed")
			f.settled()
		})
	}
}

// Without a snapshot before the late event, or with snapshots disabled, the rewind
// replays the stream from its start.
func TestUnitRewindFromTheStartWithoutAUsableSnapshot(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		disabled bool
		from     bool
	}{
		{"no snapshot before the late event", false, false},
		{"snapshots disabled", true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newUFix(t, true, func(c *worker.Config) { c.Snapshots.Disabled = tc.disabled })
			sc := f.late()
			if !tc.from {
				sc.rs.From, sc.rs.Snapshots = nil, nil
			}
			f.rewindOver(sc.rs, sc.evs)

			f.w.RunRewind(context.Background(), sc.p)

			rp := f.store.ReplayCalls()
			require.Len(t, rp, 1)
			assert.Equal(t, uuid.Nil, rp[0].After, "replay from the start")
			assert.Equal(t, uSeq(1, 6), f.appliedNs())
			c := f.commit()
			assert.Equal(t, uSeq(1, 6), utDecode(t, c.Write.Model))
			assert.Equal(t, []uuid.UUID{sc.ids[2], sc.ids[5]}, c.Write.Applied)
			assert.Equal(t, 6, c.Write.SinceSnapshot)
			assert.Empty(t, c.Write.Snapshots)
			assert.Empty(t, f.store.MarkFailedCalls())
		})
	}
}

// A long stream is replayed in pages of 500, each after the last event of the one before;
// the snapshots taken on the way follow the retention across pages. The cursor, beyond the
// newest queued event, bounds the replay and is where the commit leaves it.
func TestUnitRewindReplaysLongStreamInPages(t *testing.T) {
	t.Parallel()
	f := newUFix(t, true, func(c *worker.Config) {
		c.Snapshots = worker.SnapshotOptions{EveryNEvents: 100, MaxPerStream: 3}
	})
	p := uPair(t)
	const n = 1200
	evs := uEvents(t, p.Stream, n)
	ids := uIDs(evs)
	f.rewindOver(worker.RewindStart{Version: 3, LastEventID: uValid(ids[n-1]), Queued: []uuid.UUID{ids[1]}}, evs)

	f.w.RunRewind(context.Background(), p)

	var after []uuid.UUID
	for _, c := range f.store.ReplayCalls() {
		after = append(after, c.After)
		assert.Equal(t, ids[n-1], c.Upto, "up to the cursor")
		assert.Equal(t, 500, c.Limit)
	}
	assert.Equal(t, []uuid.UUID{uuid.Nil, ids[499], ids[999]}, after, "three pages, each after the last event read")
	c := f.commit()
	assert.Equal(t, uSeq(1, n), utDecode(t, c.Write.Model), "every event folded once, in ID order")
	assert.Equal(t, []uuid.UUID{ids[1]}, c.Write.Applied)
	assert.Equal(t, ids[n-1], c.Write.LastEventID, "the cursor, newer than every queued event")
	// Snapshots due at 100, 200, … 1200: MaxPerStream 3 keeps the newest two and the oldest.
	var due []uuid.UUID
	for i := n - 1; i >= 99; i -= 100 {
		due = append(due, ids[i])
	}
	dropped := worker.SnapshotsToDrop(due, 3)
	assert.Equal(t, due[2:len(due)-1], dropped, "the retention rule")
	uSnapshotsOf(t, c.Write.Snapshots, evs, 99, 1099, 1199)
	assert.Empty(t, c.Write.DropSnapshots)
	assert.Zero(t, c.Write.SinceSnapshot)
}

// The commit deletes exactly the queued events the replay covered: a queued ID the stream
// did not return is not in Applied (its row stays queued).
func TestUnitRewindCommitsOnlyTheQueuedEventsItReplayed(t *testing.T) {
	t.Parallel()
	f := newUFix(t, true, nil)
	sc := f.late()
	missing := sc.ids[3] // queued, but not served by the replay
	served := slices.DeleteFunc(slices.Clone(sc.evs), func(ev worker.Event) bool { return ev.ID == missing })
	sc.rs.Queued = []uuid.UUID{sc.ids[2], missing, sc.ids[5]}
	f.rewindOver(sc.rs, served)

	f.w.RunRewind(context.Background(), sc.p)

	c := f.commit()
	assert.Equal(t, []uuid.UUID{sc.ids[2], sc.ids[5]}, c.Write.Applied)
	assert.Equal(t, []int{1, 2, 3, 5, 6}, utDecode(t, c.Write.Model))
}

// The snapshots a replay takes follow the retention, with the pair's snapshots before the
// late event (RewindStart.Snapshots).
func TestUnitRewindSnapshotsFollowTheRetention(t *testing.T) {
	t.Parallel()
	// 10 events; cursor at 9; 4 (late) and 10 queued; snapshots at 1 and 3 before 4.
	// Restored from 3, the replay of 4-10 takes snapshots at 5, 7 and 9 (EveryNEvents 2).
	for _, tc := range []struct {
		max   int
		store []int // new snapshots stored (events, oldest first)
		drop  []int // existing ones deleted (newest first)
	}{
		{1, []int{9}, []int{3, 1}},
		{2, []int{9}, []int{3}},
		{3, []int{7, 9}, []int{3}},
		{5, []int{5, 7, 9}, nil},
	} {
		t.Run(fmt.Sprintf("MaxPerStream %d", tc.max), func(t *testing.T) {
			t.Parallel()
			f := newUFix(t, true, func(c *worker.Config) {
				c.Snapshots = worker.SnapshotOptions{EveryNEvents: 2, MaxPerStream: tc.max}
			})
			p := uPair(t)
			evs := uEvents(t, p.Stream, 10)
			ids := uIDs(evs)
			existing := []uuid.UUID{ids[2], ids[0]}
			f.rewindOver(worker.RewindStart{
				Version: 1, LastEventID: uValid(ids[8]), Queued: []uuid.UUID{ids[3], ids[9]},
				From: &worker.Snapshot{EventID: ids[2], Model: uModel(t, uSeq(1, 3))}, Snapshots: existing,
			}, evs)

			f.w.RunRewind(context.Background(), p)

			at, wantDrop := uRetention(t, ids, tc.store, tc.drop)
			uByRule(t, ids, []int{5, 7, 9}, []int{3, 1}, tc.max, tc.store, tc.drop)

			c := f.commit()
			assert.Equal(t, uSeq(1, 10), utDecode(t, c.Write.Model))
			uSnapshotsOf(t, c.Write.Snapshots, evs, at...)
			assert.Equal(t, wantDrop, c.Write.DropSnapshots)
			assert.Equal(t, 1, c.Write.SinceSnapshot, "one event (10) since the snapshot at 9")
			assert.Equal(t, ids[3], c.DropFrom)
		})
	}
}

// However the rewind ends, its stream lock is released exactly once, with a fresh live
// context; a failure is recorded for a retry with backoff, except a shutdown and a commit
// refused because the cursor moved (the next cycle retries at once).
func TestUnitRewindEndsReleaseTheLockOnce(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		noLocker bool
		setup    func(f *uFix, sc uLate, cancel context.CancelFunc)
		commit   bool   // RewindCommit was called
		failure  string // the cause recorded (empty: none)
	}{
		{"commit fails", false, func(f *uFix, _ uLate, _ context.CancelFunc) {
			f.store.RewindCommitFunc = func(context.Context, worker.RewindCommit) error { return errors.New("disk full") }
		}, true, "disk full"},
		{"commit fenced: lock lost", false, func(f *uFix, _ uLate, _ context.CancelFunc) {
			f.store.RewindCommitFunc = func(context.Context, worker.RewindCommit) error { return worker.ErrLockLost }
		}, true, worker.ErrLockLost.Error()},
		{"commit fenced: cursor moved", false, func(f *uFix, _ uLate, _ context.CancelFunc) {
			f.store.RewindCommitFunc = func(context.Context, worker.RewindCommit) error { return worker.ErrCursorMoved }
		}, true, ""},
		{"commit fenced: cursor moved, no locker", true, func(f *uFix, _ uLate, _ context.CancelFunc) {
			f.store.RewindCommitFunc = func(context.Context, worker.RewindCommit) error { return worker.ErrCursorMoved }
		}, true, ""},
		{"replay fails", false, func(f *uFix, _ uLate, _ context.CancelFunc) {
			f.store.ReplayFunc = func(context.Context, worker.Pair, uuid.UUID, uuid.UUID, int) ([]worker.Event, error) {
				return nil, errors.New("replay exploded: disk on fire")
			}
		}, false, "disk on fire"},
		{"replay panics", false, func(f *uFix, _ uLate, _ context.CancelFunc) {
			f.store.ReplayFunc = func(context.Context, worker.Pair, uuid.UUID, uuid.UUID, int) ([]worker.Event, error) {
				panic("driver bug")
			}
		}, false, "driver bug"},
		{"Apply panics during the replay", false, func(f *uFix, _ uLate, _ context.CancelFunc) {
			f.setHook(func(n int) error {
				if n == 4 {
					panic("perspective bug")
				}
				return nil
			})
		}, false, "perspective bug"},
		{"Apply fails during the replay", false, func(f *uFix, _ uLate, _ context.CancelFunc) {
			f.setHook(func(n int) error {
				if n == 4 {
					return errors.New("bad event four")
				}
				return nil
			})
		}, false, "bad event four"},
		{"RewindStart fails", false, func(f *uFix, _ uLate, _ context.CancelFunc) {
			f.store.RewindStartFunc = func(context.Context, worker.Pair) (worker.RewindStart, error) {
				return worker.RewindStart{}, errors.New("cursor unreadable")
			}
		}, false, "cursor unreadable"},
		{"shutdown during the replay", false, func(f *uFix, sc uLate, cancel context.CancelFunc) {
			replay := f.store.ReplayFunc
			f.store.ReplayFunc = func(ctx context.Context, s worker.Pair, after, upto uuid.UUID, limit int) ([]worker.Event, error) {
				page, err := replay(ctx, s, after, upto, limit)
				cancel()
				return page, err
			}
		}, false, ""},
		{"nothing queued any more", false, func(f *uFix, sc uLate, _ context.CancelFunc) {
			sc.rs.Queued = nil
			f.rewindOver(sc.rs, sc.evs)
		}, false, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newUFix(t, !tc.noLocker, nil)
			sc := f.late()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			tc.setup(f, sc, cancel)

			rep := f.w.RunRewind(ctx, sc.p)

			assert.Equal(t, tc.commit, len(f.store.RewindCommitCalls()) == 1, "commit attempted")
			if tc.failure == "" {
				assert.Empty(t, f.store.MarkFailedCalls(), "not recorded as a failure")
			} else {
				f.failed(sc.p, tc.failure)
				assert.Contains(t, f.logs.String(), tc.failure, "the failure is logged")
			}
			if !tc.noLocker {
				f.acquired(sc.p, locker.ReasonRewind)
				f.releasedOnce(sc.p)
			}
			assert.Empty(t, rep.Contended)
			assert.Empty(t, rep.Next)
			f.settled()
		})
	}
}

// The lock refused: the rewind does nothing and reports the pair contended (its rows stay
// queued, a later cycle retries); that is no failure. A locker error is one.
func TestUnitRewindLockRefusedDoesNothing(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name      string
		err       error
		contended bool
	}{
		{"refused", nil, true},
		{"locker error", errors.New("locker unavailable"), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newUFix(t, true, nil)
			sc := f.late()
			f.locker.TryAcquireFunc = func(context.Context, uuid.UUID, string, uuid.UUID, locker.Reason) (bool, error) {
				return false, tc.err
			}

			rep := f.w.RunRewind(context.Background(), sc.p)

			f.acquired(sc.p, locker.ReasonRewind)
			assert.Empty(t, f.store.RewindStartCalls(), "nothing read without the lock")
			assert.Empty(t, f.store.ReplayCalls())
			assert.Empty(t, f.store.RewindCommitCalls())
			assert.Empty(t, f.locker.ReleaseCalls(), "a lock not taken is not released")
			if tc.contended {
				assert.Equal(t, []worker.Pair{sc.p}, rep.Contended)
				assert.Empty(t, f.store.MarkFailedCalls(), "a refused lock is not a failure")
			} else {
				assert.Empty(t, rep.Contended)
				f.failed(sc.p, "locker unavailable")
			}
			f.settled()
		})
	}
}

// A keepalive that finds the lock lost (a renewal says so, or renewals fail until the
// lease may have run out) cancels the rewind at once: nothing is committed, the lock is
// released, and the loss is recorded for a retry with backoff.
func TestUnitRewindLostLockCancelsIt(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		renew func() (bool, error)
		after time.Duration // when the replay is cancelled
	}{
		{"a renewal reports the lock lost", func() (bool, error) { return false, nil }, 500 * time.Millisecond},
		{"renewals fail until the lease runs out", func() (bool, error) { return false, errors.New("db down") },
			2*time.Second - 2*time.Second/10},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			synctest.Test(t, func(t *testing.T) {
				f := newUFix(t, true, func(c *worker.Config) {
					c.LockOptions = locker.Options{LockTimeout: 2 * time.Second, KeepAliveInterval: 500 * time.Millisecond}
				})
				sc := f.late()
				f.locker.RenewFunc = func(context.Context, uuid.UUID, string, uuid.UUID) (bool, error) { return tc.renew() }
				var waited time.Duration
				var cause error
				f.store.ReplayFunc = func(ctx context.Context, _ worker.Pair, _, _ uuid.UUID, _ int) ([]worker.Event, error) {
					start := time.Now()
					select { // a slow replay
					case <-ctx.Done():
					case <-time.After(time.Minute):
					}
					waited, cause = time.Since(start), context.Cause(ctx)
					return nil, ctx.Err()
				}

				f.w.RunRewind(context.Background(), sc.p)

				assert.Equal(t, tc.after, waited, "cancelled as soon as the lock is known lost")
				assert.ErrorIs(t, cause, worker.ErrLockLost)
				assert.Empty(t, f.store.RewindCommitCalls(), "nothing committed after the lock is lost")
				f.failed(sc.p, worker.ErrLockLost.Error())
				f.releasedOnce(sc.p)
				f.settled()
			})
		})
	}
}

// An acquire that a lost connection or its context's end cut off may have committed, so its
// lock is released (not left to lapse); one that never reached a server, or that the
// database refused, is not.
func TestUnitRewindLockAcquireCutOffIsReleased(t *testing.T) {
	_, connectErr := pgconn.Connect(context.Background(), "postgres://127.0.0.1:1/none?connect_timeout=5")
	var ce *pgconn.ConnectError
	require.ErrorAs(t, connectErr, &ce)
	for _, tc := range []struct {
		name     string
		err      error
		cancel   bool // the operation's context ends while the acquire runs
		releases int
	}{
		{"cut off after it was sent", &net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET}, false, 1},
		{"cut off by its context", context.Canceled, true, 1},
		{"no connection could be made", connectErr, false, 0},
		{"refused by the database", errors.New("permission denied for table wh_perspective_cursors"), false, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				f := newUFix(t, true, nil)
				sc := f.late()
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				f.locker.TryAcquireFunc = func(context.Context, uuid.UUID, string, uuid.UUID, locker.Reason) (bool, error) {
					if tc.cancel {
						cancel()
					}
					return false, fmt.Errorf("acquire: %w", tc.err)
				}
				f.w.RunRewind(ctx, sc.p)
				require.Len(t, f.locker.TryAcquireCalls(), 1)
				releases := f.locker.ReleaseCalls()
				require.Len(t, releases, tc.releases, "Release calls")
				for _, c := range releases {
					assert.Equal(t, sc.p, worker.Pair{Stream: c.StreamID, Perspective: c.PerspectiveName})
					assert.Equal(t, f.instance, c.InstanceID, "fenced by this instance")
				}
				assert.Empty(t, f.store.RewindCommitCalls(), "nothing replayed without the lock")
			})
		})
	}
}

// A stream lock's release that a lost connection fails is sent again every 100ms within the
// release's 5s bound, so that another instance need not wait for the lock to lapse: released
// once the database answers; still failing at the bound, left to lapse (warned). A release
// refused otherwise is not sent again.
func TestUnitRewindLockReleaseRetriedWhileTheDatabaseIsAway(t *testing.T) {
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
	for _, tc := range []struct {
		name     string
		failures int   // releases that fail before one succeeds
		err      error // their error
		calls    int   // Release calls
		lapses   bool  // warned: the lock is left to lapse
	}{
		{"the database answers after 3 tries", 3, refused, 4, false},
		{"away past the bound", 1000, refused, 50, true}, // at 0, 100ms, …, 4.9s
		{"refused by the database", 1000, errors.New("permission denied for table wh_perspective_cursors"), 1, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				f := newUFix(t, true, nil)
				sc := f.late()
				var n int
				var at []time.Duration
				start := time.Now()
				f.locker.ReleaseFunc = func(context.Context, uuid.UUID, string, uuid.UUID) error {
					at = append(at, time.Since(start))
					if n++; n <= tc.failures {
						return fmt.Errorf("release: %w", tc.err)
					}
					return nil
				}
				f.w.RunRewind(context.Background(), sc.p)
				require.Equal(t, tc.calls, len(f.locker.ReleaseCalls()), "Release calls")
				for i := 1; i < len(at); i++ {
					assert.Equal(t, 100*time.Millisecond, at[i]-at[i-1], "release %d: 100ms after the one before", i+1)
				}
				assert.Equal(t, tc.lapses, strings.Contains(f.logs.String(), "stream lock release failed; it will expire"), "warned")
				assert.Len(t, f.store.RewindCommitCalls(), 1, "the rewind committed first")
			})
		})
	}
}
