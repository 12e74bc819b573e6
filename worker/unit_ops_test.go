package worker_test

// Unit tests of bootstrap, purge, failure recording and the in-process coordinator, on
// mocks (no database): which stream lock each operation takes and releases, what it asks
// the Store to do, and what it leaves to do next.

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/worker"
)

// ---------------------------------------------------------------------------------------
// Bootstrap.

// A bootstrap takes the stream lock with reason bootstrap, has the Store write the
// snapshot, releases the lock after it, and leaves an apply of the pair to do next.
func TestUnitBootstrapTakesTheLockAndFollowsWithApply(t *testing.T) {
	t.Parallel()
	for _, wrote := range []bool{true, false} {
		t.Run(map[bool]string{true: "snapshot written", false: "nothing to snapshot"}[wrote], func(t *testing.T) {
			t.Parallel()
			f := newUFix(t, true, nil)
			p := uPair(t)
			f.store.BootstrapFunc = func(context.Context, worker.Pair) (bool, error) { return wrote, nil }

			rep := f.w.RunBootstrap(context.Background(), p)

			f.acquired(p, locker.ReasonBootstrap)
			require.Len(t, f.store.BootstrapCalls(), 1)
			assert.Equal(t, p, f.store.BootstrapCalls()[0].P)
			assert.Equal(t, 1, f.releasedOnce(p).writes, "the lock is released after the snapshot is written")
			assert.Equal(t, uJobs("apply", p), rep.Next, "the queued events are applied next")
			assert.Empty(t, f.store.MarkFailedCalls())
			f.settled()
		})
	}
}

// The bootstrap proceeds without the lock (it writes a snapshot of a model and position
// read together, so it is correct whoever else works on the pair).
func TestUnitBootstrapProceedsWithoutTheLock(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		noLocker bool
		err      error
	}{
		{"refused", false, nil},
		{"locker error", false, errors.New("locker unavailable")},
		{"no locker", true, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newUFix(t, !tc.noLocker, nil)
			p := uPair(t)
			if f.locker != nil {
				f.locker.TryAcquireFunc = func(context.Context, uuid.UUID, string, uuid.UUID, locker.Reason) (bool, error) {
					return false, tc.err
				}
			}

			rep := f.w.RunBootstrap(context.Background(), p)

			if f.locker != nil {
				f.acquired(p, locker.ReasonBootstrap)
				assert.Empty(t, f.locker.ReleaseCalls(), "a lock not taken is not released")
			}
			assert.Len(t, f.store.BootstrapCalls(), 1, "the snapshot is written anyway")
			assert.Equal(t, uJobs("apply", p), rep.Next)
			assert.Empty(t, f.store.MarkFailedCalls(), "a refused lock is not a failure")
		})
	}
}

// A bootstrap whose Store write fails is recorded as the pair's failure; no apply follows
// (the pair backs off), and the lock is released.
func TestUnitBootstrapErrorIsRecorded(t *testing.T) {
	t.Parallel()
	f := newUFix(t, true, nil)
	p := uPair(t)
	f.store.BootstrapFunc = func(context.Context, worker.Pair) (bool, error) {
		return false, errors.New("model is at event x but the cursor is at y")
	}

	rep := f.w.RunBootstrap(context.Background(), p)

	f.failed(p, "bootstrap", "model is at event x")
	assert.Empty(t, rep.Next, "no apply: the pair backs off")
	f.releasedOnce(p)
	f.settled()
}

// ---------------------------------------------------------------------------------------
// Purge.

// Bad input is refused before any lock or Store call, with an error wrapping
// locker.ErrInvalidArgument.
func TestUnitPurgeRefusesBadInput(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name        string
		stream      uuid.UUID
		perspective string
		msg         string
	}{
		{"nil stream", uuid.Nil, utName, "stream ID"},
		{"empty perspective", uuid.New(), "", "perspective name is empty"},
		{"unknown perspective", uuid.New(), "no-such-perspective", "no-such-perspective"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newUFix(t, true, nil)

			err := f.w.Purge(context.Background(), tc.stream, tc.perspective)

			require.ErrorIs(t, err, locker.ErrInvalidArgument)
			assert.Contains(t, err.Error(), tc.msg)
			f.noLockTaken()
			assert.Empty(t, f.store.PurgeCalls())
			f.settled()
		})
	}
}

// With a locker, Purge takes the stream lock with reason purge, has the Store purge fenced
// by this instance's lock, and releases the lock after; without one, the Store purges
// unfenced.
func TestUnitPurgeUnderTheStreamLock(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		noLocker bool
		storeErr error
	}{
		{"purged", false, nil},
		{"no locker", true, nil},
		{"store fails", false, errors.New("disk full")},
		{"fenced: lock lost", false, worker.ErrLockLost},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newUFix(t, !tc.noLocker, nil)
			p := uPair(t)
			f.store.PurgeFunc = func(context.Context, worker.Pair, uuid.UUID) error { return tc.storeErr }

			err := f.w.Purge(context.Background(), p.Stream, p.Perspective)

			if tc.storeErr != nil {
				require.ErrorIs(t, err, tc.storeErr)
			} else {
				require.NoError(t, err)
			}
			calls := f.store.PurgeCalls()
			require.Len(t, calls, 1)
			assert.Equal(t, p, calls[0].P)
			if tc.noLocker {
				assert.Equal(t, uuid.Nil, calls[0].Holder, "no locker: unfenced")
			} else {
				assert.Equal(t, f.instance, calls[0].Holder, "fenced by this instance's lock")
				f.acquired(p, locker.ReasonPurge)
				assert.Equal(t, 1, f.releasedOnce(p).writes, "released after the purge")
			}
			assert.Empty(t, f.store.MarkFailedCalls(), "Purge reports to its caller")
			f.settled()
		})
	}
}

// Purge needs the lock: refused, it returns ErrLocked and purges nothing.
func TestUnitPurgeRefusedWithoutTheLock(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		err    error
		locked bool
	}{
		{"held by another instance", nil, true},
		{"locker error", errors.New("locker unavailable"), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newUFix(t, true, nil)
			p := uPair(t)
			f.locker.TryAcquireFunc = func(context.Context, uuid.UUID, string, uuid.UUID, locker.Reason) (bool, error) {
				return false, tc.err
			}

			err := f.w.Purge(context.Background(), p.Stream, p.Perspective)

			require.Error(t, err)
			assert.Equal(t, tc.locked, errors.Is(err, worker.ErrLocked), "ErrLocked only when another instance holds it: %v", err)
			if tc.err != nil {
				assert.ErrorIs(t, err, tc.err)
			}
			f.acquired(p, locker.ReasonPurge)
			assert.Empty(t, f.store.PurgeCalls(), "nothing purged without the lock")
			assert.Empty(t, f.locker.ReleaseCalls(), "a lock not taken is not released")
			f.settled()
		})
	}
}

// ---------------------------------------------------------------------------------------
// The in-process coordinator: one operation at a time per pair.

// A Purge of a pair whose apply is running waits for it: it neither takes the stream lock
// nor purges until the apply has ended. Another pair is not held up meanwhile.
func TestUnitPurgeWaitsForTheApplyOfItsPair(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		f := newUFix(t, true, nil)
		p, other := uPair(t), uPair(t)
		otherEvs := uEvents(t, other.Stream, 1)
		f.set(uState(t, p, uEvents(t, p.Stream, 2), 0), uState(t, other, otherEvs, 0))
		var mu sync.Mutex
		var order []string
		note := func(s string) { mu.Lock(); order = append(order, s); mu.Unlock() }
		entered, gate := make(chan struct{}), make(chan struct{})
		f.store.ApplyFunc = func(ctx context.Context, req worker.ApplyRequest, decide func([]worker.PairState) []worker.PairWrite) ([]worker.Pair, error) {
			if req.Pairs[0] == p {
				close(entered)
				<-gate // a slow apply
				defer note("apply ended")
			}
			return f.apply(ctx, req, decide)
		}
		f.store.PurgeFunc = func(context.Context, worker.Pair, uuid.UUID) error { note("purge"); return nil }

		applied := make(chan struct{})
		go func() { defer close(applied); f.w.ProcessPair(context.Background(), p.Stream, p.Perspective) }()
		<-entered
		purged := make(chan error, 1)
		go func() { purged <- f.w.Purge(context.Background(), p.Stream, p.Perspective) }()
		synctest.Wait() // the purge is blocked

		assert.Empty(t, f.store.PurgeCalls(), "no purge while the apply of its pair runs")
		assert.Empty(t, f.locker.TryAcquireCalls(), "nor a stream lock taken")
		assert.Equal(t, 1, f.w.CoordinatorSize(), "one entry, held by the apply and awaited by the purge")
		f.w.RunApply(context.Background(), other)
		uFolded(t, f.write(other), otherEvs, 0, 1) // another pair goes on

		close(gate)
		<-applied
		require.NoError(t, <-purged)
		assert.Equal(t, []string{"apply ended", "purge"}, order)
		f.releasedOnce(p)
		f.settled()
	})
}

// A job finds a pair held by a Purge busy and leaves it (the next claim skips it) without
// waiting; its other pairs are applied.
func TestUnitApplySkipsAPairAPurgeHolds(t *testing.T) {
	t.Parallel()
	f := newUFix(t, false, nil)
	held, free := uPair(t), uPair(t)
	freeEvs := uEvents(t, free.Stream, 2)
	f.set(uState(t, held, uEvents(t, held.Stream, 2), 0), uState(t, free, freeEvs, 0))
	entered, gate := make(chan struct{}), make(chan struct{})
	f.store.PurgeFunc = func(context.Context, worker.Pair, uuid.UUID) error {
		close(entered)
		<-gate
		return nil
	}
	purged := make(chan error, 1)
	go func() { purged <- f.w.Purge(context.Background(), held.Stream, held.Perspective) }()
	<-entered

	rep := f.w.RunApply(context.Background(), held, free)
	bootRep := f.w.RunBootstrap(context.Background(), held)

	close(gate)
	require.NoError(t, <-purged)
	assert.Equal(t, []worker.Pair{held}, rep.Busy, "reported busy")
	assert.Equal(t, [][]worker.Pair{{free}}, f.applyCalls(), "the held pair is not in the transaction")
	uFolded(t, f.write(free), freeEvs, 0, 2)
	assert.Equal(t, []worker.Pair{held}, bootRep.Busy, "every kind of job leaves it")
	assert.Empty(t, f.store.BootstrapCalls())
	assert.Empty(t, bootRep.Next)
	f.settled()
}

// ---------------------------------------------------------------------------------------
// Follow-ups, one after the other as the loop runs them.

// A pair that needs a bootstrap is bootstrapped, then applied; a pair with a late event is
// rewound. The group's transaction has ended before either starts.
func TestUnitProcessPairRunsItsFollowUps(t *testing.T) {
	t.Parallel()
	t.Run("bootstrap, then apply", func(t *testing.T) {
		t.Parallel()
		f := newUFix(t, true, func(c *worker.Config) { c.Snapshots.EveryNEvents = 3 })
		p := uPair(t)
		evs := uEvents(t, p.Stream, 4)
		f.set(uState(t, p, evs, 3)) // a model of 3 events, no snapshot
		f.store.BootstrapFunc = func(context.Context, worker.Pair) (bool, error) {
			require.Len(t, f.store.ApplyCalls(), 1, "the bootstrap runs after the first transaction")
			st := uState(t, p, evs, 3)
			st.SinceSnapshot, st.Snapshots = 0, []uuid.UUID{evs[2].ID}
			f.set(st)
			return true, nil
		}

		f.w.ProcessPair(context.Background(), p.Stream, p.Perspective)

		assert.Len(t, f.store.ApplyCalls(), 2)
		assert.Len(t, f.store.BootstrapCalls(), 1)
		f.acquired(p, locker.ReasonBootstrap)
		f.releasedOnce(p)
		wr := f.write(p)
		uFolded(t, wr, evs, 3, 4)
		assert.Equal(t, 1, wr.SinceSnapshot)
		f.settled()
	})
	t.Run("rewind", func(t *testing.T) {
		t.Parallel()
		f := newUFix(t, true, nil)
		sc := f.late()
		f.set(uLateState(t, sc))

		f.w.ProcessPair(context.Background(), sc.p.Stream, sc.p.Perspective)

		assert.Len(t, f.store.ApplyCalls(), 1)
		assert.Empty(t, f.allWrites(), "the late pair is not written by the normal path")
		f.acquired(sc.p, locker.ReasonRewind)
		assert.Equal(t, uSeq(1, 6), utDecode(t, f.commit().Write.Model))
		f.releasedOnce(sc.p)
		f.settled()
	})
}

// ---------------------------------------------------------------------------------------
// Failure recording.

// A failure that cannot be recorded is logged with both errors; the job still ends.
func TestUnitFailureThatCannotBeRecordedIsLogged(t *testing.T) {
	t.Parallel()
	f := newUFix(t, false, nil)
	p := uPair(t)
	f.set(uState(t, p, uEvents(t, p.Stream, 1), 0))
	f.applyErr = func([]worker.Pair) error { return errors.New("connection reset") }
	f.store.MarkFailedFunc = func(context.Context, worker.Pair, worker.Failure, func(int) worker.FailureAction) (worker.FailureAction, error) {
		return "", errors.New("still down")
	}

	f.w.RunApply(context.Background(), p)

	f.failed(p, "connection reset")
	logs := f.logs.String()
	assert.Contains(t, logs, "recording failure failed")
	assert.Contains(t, logs, "still down")
	f.settled()
}

// MarkFailed runs on a context of its own: a failure is recorded even when the job's
// context ends right after it (and never on one already ended: see the shutdown cases).
func TestUnitFailureIsRecordedWithABoundedContext(t *testing.T) {
	t.Parallel()
	f := newUFix(t, false, nil)
	p := uPair(t)
	f.set(uState(t, p, uEvents(t, p.Stream, 1), 0))
	f.applyErr = func([]worker.Pair) error { return errors.New("connection reset") }
	var live, bounded atomic.Bool
	f.store.MarkFailedFunc = func(ctx context.Context, _ worker.Pair, _ worker.Failure, _ func(int) worker.FailureAction) (worker.FailureAction, error) {
		_, hasDeadline := ctx.Deadline()
		live.Store(ctx.Err() == nil)
		bounded.Store(hasDeadline)
		return worker.FailureRetry, nil
	}

	f.w.RunApply(context.Background(), p)

	f.failed(p, "connection reset")
	assert.True(t, live.Load())
	assert.True(t, bounded.Load(), "recording a failure never hangs the job")
}

// ---------------------------------------------------------------------------------------
// The loop: the follow-ups of a group take free slots.

// The rewinds the apply jobs leave behind run side by side in free Concurrency slots, and
// one after the other when there is a single slot.
func TestUnitLoopRunsFollowUpsInFreeSlots(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		concurrency int
		side        int32 // rewinds replaying at once
	}{
		{4, 3}, // three groups of one pair, then three rewinds in three slots
		{1, 1}, // one group of three pairs, then three rewinds in its slot
	} {
		t.Run(fmt.Sprintf("concurrency %d", tc.concurrency), func(t *testing.T) {
			t.Parallel()
			synctest.Test(t, func(t *testing.T) {
				f := newUFix(t, true, func(c *worker.Config) { c.Concurrency, c.PollOnly = tc.concurrency, true })
				late := map[uuid.UUID]uLate{}
				var pairs []worker.Pair
				for range 3 {
					sc := f.late()
					late[sc.p.Stream] = sc
					pairs = append(pairs, sc.p)
					f.set(uLateState(t, sc))
				}
				var claimed atomic.Bool
				f.store.RegisterFunc = func(context.Context, string, int) ([]worker.Build, error) { return utBuilds(), nil }
				f.store.BuildsFunc = func(context.Context, []string) ([]worker.Build, error) { return utBuilds(), nil }
				f.store.StatusFunc = func(context.Context) ([]worker.BuildStatus, error) { return nil, nil }
				f.store.CleanupFunc = func(context.Context, []string, time.Duration, int, worker.LeaderLease) (bool, error) {
					return false, nil
				}
				f.store.ClaimFunc = func(context.Context, worker.ClaimRequest) (worker.Claimed, error) {
					if claimed.Swap(true) {
						return worker.Claimed{}, nil
					}
					return worker.Claimed{Pairs: pairs}, nil
				}
				f.store.RewindStartFunc = func(_ context.Context, p worker.Pair) (worker.RewindStart, error) {
					return late[p.Stream].rs, nil
				}
				gate := make(chan struct{})
				var replaying, most atomic.Int32
				f.store.ReplayFunc = func(_ context.Context, k worker.Pair, after, upto uuid.UUID, limit int) ([]worker.Event, error) {
					stream := k.Stream
					n := replaying.Add(1)
					defer replaying.Add(-1)
					for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
					}
					<-gate
					return uServe(late[stream].evs, after, upto, limit), nil
				}
				require.NoError(t, f.w.Start(context.Background()))

				synctest.Wait() // every rewind that could start waits at the gate
				inFlight := replaying.Load()
				close(gate)
				synctest.Wait() // the rest have run: the loop waits for its next poll
				require.NoError(t, f.w.Stop(context.Background()))

				assert.Equal(t, tc.side, inFlight)
				assert.Equal(t, tc.side, most.Load())
				var committed []worker.Pair
				for _, c := range f.store.RewindCommitCalls() {
					committed = append(committed, c.C.Write.Pair)
					assert.Equal(t, uSeq(1, 6), utDecode(t, c.C.Write.Model))
				}
				assert.ElementsMatch(t, pairs, committed, "each pair rewound once")
				assert.Len(t, f.locker.ReleaseCalls(), 3, "every stream lock released")
				assert.Empty(t, f.store.MarkFailedCalls())
			})
		})
	}
}
