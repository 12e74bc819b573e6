package worker_test

// Stop, graceful then hard, on the mocks inside a testing/synctest bubble: the worker's
// own loop claims a pair whose rewind runs while Stop is called.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"testing/synctest"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/mocks"
	"github.com/perspectives-go/perspectives/worker"
)

// stopFixture runs a worker whose first claim returns one pair that needs a rewind; the
// rewind's replay blocks until replayDone is closed (ignoring cancellation when stubborn),
// or returns when its context ends.
type stopFixture struct {
	w            *worker.Worker
	store        *mocks.StoreMock
	locker       *mocks.LockerMock
	pair         worker.Pair
	replaying    chan struct{} // closed when the replay has started
	replayDone   chan struct{} // close to let the replay return
	replayCtxErr atomic.Value  // the replay's ctx error when it returned
}

func newStopFixture(t *testing.T, stubborn bool) *stopFixture {
	f := &stopFixture{
		pair:       worker.Pair{Stream: uuid.New(), Perspective: utName},
		replaying:  make(chan struct{}),
		replayDone: make(chan struct{}),
	}
	ev := worker.Event{ID: uuid.Must(uuid.NewV7()), StreamID: f.pair.Stream, Type: "n", Data: json.RawMessage(`{"n":1}`)}
	var claimed atomic.Bool
	f.store = utLoopStore()
	f.store.ClaimFunc = func(ctx context.Context, req worker.ClaimRequest) (worker.Claimed, error) {
		if claimed.Swap(true) {
			return worker.Claimed{}, nil
		}
		return worker.Claimed{Pairs: []worker.Pair{f.pair}}, nil
	}
	f.store.ApplyFunc = func(ctx context.Context, req worker.ApplyRequest, decide func([]worker.PairState) []worker.PairWrite) ([]worker.Pair, error) {
		// The event is at the cursor: a rewind.
		writes := decide([]worker.PairState{{Pair: f.pair, LastEventID: uuid.NullUUID{UUID: ev.ID, Valid: true},
			SinceSnapshot: 1, Snapshots: []uuid.UUID{ev.ID}, Events: []worker.Event{ev}, Model: json.RawMessage(`{"seq":[1]}`), ModelAt: ev.ID}})
		assert.Empty(t, writes, "a pair that needs a rewind is not written") // not require: a job goroutine
		return nil, nil
	}
	f.store.RewindStartFunc = func(ctx context.Context, p worker.Pair) (worker.RewindStart, error) {
		return worker.RewindStart{Version: 1, LastEventID: uuid.NullUUID{UUID: ev.ID, Valid: true}, Queued: []uuid.UUID{ev.ID}}, nil
	}
	f.store.ReplayFunc = func(ctx context.Context, k worker.Pair, after, upto uuid.UUID, limit int) ([]worker.Event, error) {
		close(f.replaying)
		if stubborn {
			<-f.replayDone
		} else {
			select {
			case <-f.replayDone:
			case <-ctx.Done():
			}
		}
		f.replayCtxErr.Store(errString(ctx.Err()))
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return []worker.Event{ev}, nil
	}
	f.store.RewindCommitFunc = func(context.Context, worker.RewindCommit) error { return nil }
	f.store.MarkFailedFunc = func(context.Context, worker.Pair, worker.Failure, func(int) worker.FailureAction) (worker.FailureAction, error) {
		return worker.FailureRetry, nil
	}
	f.locker = &mocks.LockerMock{
		TryAcquireFunc: func(context.Context, uuid.UUID, string, uuid.UUID, locker.Reason) (bool, error) { return true, nil },
		RenewFunc:      func(context.Context, uuid.UUID, string, uuid.UUID) (bool, error) { return true, nil },
		ReleaseFunc:    func(context.Context, uuid.UUID, string, uuid.UUID) error { return nil },
	}
	w, err := worker.NewWithStore(f.store, worker.Config{
		Perspectives: []worker.Perspective{utPerspective(utName, nil)},
		Locker:       f.locker,
		PollOnly:     true,
		Logger:       utLogger(&utLogBuf{}),
	})
	require.NoError(t, err)
	f.w = w
	require.NoError(t, w.Start(context.Background()))
	<-f.replaying
	return f
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// Stop lets the running rewind finish while its context lasts: nothing is cancelled, the
// rewind commits, and its own release is the only one.
func TestUnitStopIsGracefulUntilItsContextEnds(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newStopFixture(t, false)
		stopped := make(chan error, 1)
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			stopped <- f.w.Stop(ctx)
		}()
		synctest.Wait() // Stop has stopped the loop's claiming and waits for the rewind
		claims := len(f.store.ClaimCalls())
		time.Sleep(30 * time.Second)
		synctest.Wait()
		select {
		case <-stopped:
			t.Fatal("Stop returned while the rewind was still running")
		default:
		}
		assert.Empty(t, f.locker.ReleaseCalls(), "no lock is released while its operation runs")
		close(f.replayDone)
		require.NoError(t, <-stopped)
		assert.Equal(t, "", f.replayCtxErr.Load(), "the rewind was not cancelled")
		assert.Len(t, f.store.RewindCommitCalls(), 1, "the rewind committed")
		assert.Len(t, f.locker.ReleaseCalls(), 1, "the rewind released its lock, once")
		assert.Len(t, f.store.ClaimCalls(), claims, "no claim after Stop")
		require.NoError(t, f.w.Stop(context.Background()), "Stop is idempotent")
	})
}

// When Stop's context ends first, the operations are cancelled: the rewind ends without
// committing, and releases its own lock.
func TestUnitStopCancelsOperationsWhenItsContextEnds(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newStopFixture(t, false)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		err := f.w.Stop(ctx)
		require.ErrorIs(t, err, context.DeadlineExceeded)
		assert.Equal(t, context.Canceled.Error(), f.replayCtxErr.Load(), "the rewind's context was cancelled")
		assert.Empty(t, f.store.RewindCommitCalls(), "a cancelled rewind commits nothing")
		assert.Empty(t, f.store.MarkFailedCalls(), "a shutdown is not a failure")
		require.Len(t, f.locker.ReleaseCalls(), 1, "the rewind released its lock")
	})
}

// An operation that ignores cancellation keeps its lock: Stop returns without releasing
// it, and the operation releases it when it ends.
func TestUnitStopNeverReleasesTheLockOfARunningOperation(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newStopFixture(t, true)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		start := time.Now()
		err := f.w.Stop(ctx)
		require.ErrorIs(t, err, context.DeadlineExceeded)
		assert.Equal(t, 15*time.Second, time.Since(start), "Stop waits 5s after cancelling, then gives up")
		assert.Empty(t, f.locker.ReleaseCalls(), "the lock of a running operation is not released")
		close(f.replayDone)
		synctest.Wait()
		assert.Len(t, f.locker.ReleaseCalls(), 1, "the operation released its lock when it ended")
	})
}

// utStartPollOnly starts a worker of the unit perspective on store, polling only (no
// LISTEN), with its log kept quiet; the test stops it.
func utStartPollOnly(t *testing.T, store *mocks.StoreMock) *worker.Worker {
	t.Helper()
	w, err := worker.NewWithStore(store, worker.Config{
		Perspectives: []worker.Perspective{utPerspective(utName, nil)},
		PollOnly:     true,
		Logger:       utLogger(&utLogBuf{}),
	})
	require.NoError(t, err)
	require.NoError(t, w.Start(context.Background()))
	return w
}

// utStopWhileBlocked starts a polling worker on store, waits until one of its store calls
// blocks (blocked closed), calls Stop, checks that Stop waits for that call, then lets the
// call return (closes release) and returns Stop's error. Inside a synctest bubble.
func utStopWhileBlocked(t *testing.T, store *mocks.StoreMock, blocked <-chan struct{}, release chan struct{}) error {
	t.Helper()
	w := utStartPollOnly(t, store)
	<-blocked
	stopped := make(chan error, 1)
	go func() { stopped <- w.Stop(context.Background()) }()
	synctest.Wait()
	select {
	case err := <-stopped:
		close(release)
		t.Fatalf("Stop returned (%v) while its store call was under way", err)
	default:
	}
	close(release)
	return <-stopped
}

// Stop while the loop's claim is under way lets the claim finish, uncancelled, and runs
// what it claimed before it returns. A cancelled query would cost its pooled connection, and
// pgx would send the server a cancel request, which PgBouncer before 1.21 can exit on.
func TestUnitStopLetsTheClaimUnderWayFinish(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		p := worker.Pair{Stream: uuid.New(), Perspective: utBuilds()[0].Key}
		ev := worker.Event{ID: uuid.Must(uuid.NewV7()), StreamID: p.Stream, Type: "n", Data: json.RawMessage(`{"n":1}`)}
		claiming, release := make(chan struct{}), make(chan struct{})
		var (
			n           atomic.Int32
			claimCtxErr atomic.Value
		)
		store := utLoopStore()
		store.ClaimFunc = func(ctx context.Context, req worker.ClaimRequest) (worker.Claimed, error) {
			if n.Add(1) > 1 {
				return worker.Claimed{}, nil
			}
			close(claiming)
			select {
			case <-release:
			case <-ctx.Done():
			}
			claimCtxErr.Store(errString(ctx.Err()))
			if ctx.Err() != nil {
				return worker.Claimed{}, ctx.Err()
			}
			return worker.Claimed{Pairs: []worker.Pair{p}}, nil
		}
		store.ApplyFunc = func(ctx context.Context, req worker.ApplyRequest, decide func([]worker.PairState) []worker.PairWrite) ([]worker.Pair, error) {
			writes := decide([]worker.PairState{{Pair: p, Events: []worker.Event{ev}, Model: json.RawMessage(`{"seq":[]}`)}})
			assert.Len(t, writes, 1) // not require: a job goroutine
			return nil, ctx.Err()
		}
		require.NoError(t, utStopWhileBlocked(t, store, claiming, release))
		assert.Equal(t, "", claimCtxErr.Load(), "the claim under way was not cancelled")
		assert.Len(t, store.ApplyCalls(), 1, "what it claimed was applied before Stop returned")
		assert.Len(t, store.ClaimCalls(), 1, "no claim after Stop")
	})
}

// Stop while the loop reads the builds lets the read finish, and then starts nothing: not
// the jobs the read would queue (here a cleanup), not a claim.
func TestUnitStopDuringTheBuildsReadStartsNothingAfter(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		reading, release := make(chan struct{}), make(chan struct{})
		var (
			n          atomic.Int32
			readCtxErr atomic.Value
		)
		store := utLoopStore()
		store.BuildsFunc = func(ctx context.Context, _ []string) ([]worker.Build, error) {
			if n.Add(1) == 1 {
				close(reading)
				select {
				case <-release:
				case <-ctx.Done():
				}
				readCtxErr.Store(errString(ctx.Err()))
			}
			return utBuilds(), ctx.Err()
		}
		store.ClaimFunc = func(context.Context, worker.ClaimRequest) (worker.Claimed, error) {
			return worker.Claimed{}, nil
		}
		require.NoError(t, utStopWhileBlocked(t, store, reading, release))
		assert.Equal(t, "", readCtxErr.Load(), "the read under way was not cancelled")
		assert.Empty(t, store.ClaimCalls(), "no claim after Stop")
		assert.Empty(t, store.CleanupCalls(), "no job the read queued was started after Stop")
	})
}

// The context the listener's subscribing statements run under outlasts the listener's by
// its grace, and ends at once when cancelled.
func TestUnitGraceAfterOutlastsItsParentByTheGrace(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		parent, cancelParent := context.WithCancel(context.Background())
		ctx, cancel := worker.GraceAfter(parent, 2*time.Second)
		defer cancel()
		start := time.Now()
		cancelParent()
		synctest.Wait()
		require.NoError(t, ctx.Err(), "not ended with its parent")
		<-ctx.Done()
		assert.Equal(t, 2*time.Second, time.Since(start), "ended the grace after its parent")

		parent, cancelParent = context.WithCancel(context.Background())
		defer cancelParent()
		ctx, cancel = worker.GraceAfter(parent, 2*time.Second)
		cancel()
		require.ErrorIs(t, ctx.Err(), context.Canceled, "cancel ends it at once")
		synctest.Wait() // and nothing of it is left running (the bubble would not end)
	})
}

// A pair job releases its pairs' leases when it ends, but not a pair a follow-up keeps: that
// one is released when its follow-up (a rewind) ends. A pair found held by another
// transaction is released due again after a short wait, the others at their oldest event.
func TestUnitJobsReleaseTheirPairsAfterTheirFollowUps(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		key := utBuilds()[0].Key
		late, done, busy := worker.Pair{Stream: uuid.New(), Perspective: key}, worker.Pair{Stream: uuid.New(), Perspective: key},
			worker.Pair{Stream: uuid.New(), Perspective: key}
		ev := worker.Event{ID: uuid.Must(uuid.NewV7()), StreamID: late.Stream, Type: "n", Data: json.RawMessage(`{"n":1}`)}
		var (
			mu       sync.Mutex
			releases []worker.ReleaseRequest
			rewound  bool // when the late pair's rewind ran, releases so far
			before   int
			claimed  atomic.Bool
		)
		store := utLoopStore()
		store.ClaimFunc = func(ctx context.Context, req worker.ClaimRequest) (worker.Claimed, error) {
			if claimed.Swap(true) {
				return worker.Claimed{}, nil
			}
			return worker.Claimed{Pairs: []worker.Pair{late, done, busy}}, nil
		}
		store.ApplyFunc = func(ctx context.Context, req worker.ApplyRequest, decide func([]worker.PairState) []worker.PairWrite) ([]worker.Pair, error) {
			decide([]worker.PairState{
				{Pair: late, LastEventID: uuid.NullUUID{UUID: ev.ID, Valid: true}, Events: []worker.Event{ev},
					Model: json.RawMessage(`{"seq":[1]}`), ModelAt: ev.ID, Snapshots: []uuid.UUID{ev.ID}},
				{Pair: done, Events: []worker.Event{{ID: uuid.Must(uuid.NewV7()), StreamID: done.Stream, Type: "n", Data: json.RawMessage(`{"n":1}`)}}},
			})
			return []worker.Pair{busy}, nil
		}
		store.RewindStartFunc = func(ctx context.Context, p worker.Pair) (worker.RewindStart, error) {
			mu.Lock()
			rewound, before = true, len(releases)
			mu.Unlock()
			return worker.RewindStart{Version: 1, LastEventID: uuid.NullUUID{UUID: ev.ID, Valid: true}, Queued: []uuid.UUID{ev.ID}}, nil
		}
		store.ReplayFunc = func(context.Context, worker.Pair, uuid.UUID, uuid.UUID, int) ([]worker.Event, error) {
			return []worker.Event{ev}, nil
		}
		store.RewindCommitFunc = func(context.Context, worker.RewindCommit) error { return nil }
		store.ReleaseFunc = func(_ context.Context, req worker.ReleaseRequest) error {
			mu.Lock()
			defer mu.Unlock()
			releases = append(releases, req)
			return nil
		}
		w, err := worker.NewWithStore(store, worker.Config{
			Perspectives: []worker.Perspective{utPerspective(utName, nil)},
			PollOnly:     true,
			PollInterval: time.Minute,
			Concurrency:  1,
			Logger:       utLogger(&utLogBuf{}),
		})
		require.NoError(t, err)
		require.NoError(t, w.Start(context.Background()))
		time.Sleep(time.Second)
		synctest.Wait()
		require.NoError(t, w.Stop(context.Background()))

		mu.Lock()
		defer mu.Unlock()
		require.True(t, rewound)
		require.Len(t, releases, 2, "the group's job, then the rewind")
		require.Equal(t, 1, before, "the group's pairs were released before the rewind ran")
		require.ElementsMatch(t, []worker.Pair{done, busy}, releases[0].Pairs, "not the pair its rewind keeps")
		require.Equal(t, map[worker.Pair]time.Duration{busy: 100 * time.Millisecond}, releases[0].Later,
			"the busy pair waits a moment; the other is due at its oldest event")
		require.Equal(t, []worker.Pair{late}, releases[1].Pairs)
		require.Empty(t, releases[1].Later)
		for _, r := range releases {
			require.Equal(t, w.InstanceID(), r.Instance)
		}
	})
}

// The loop claims again when the next pair the last claim saw waiting becomes due (a
// backoff ending), not a whole PollInterval later.
func TestUnitLoopClaimsWhenTheNextPairBecomesDue(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		t0 := time.Now()
		var (
			mu     sync.Mutex
			claims []time.Duration
		)
		store := utLoopStore()
		store.ClaimFunc = func(ctx context.Context, req worker.ClaimRequest) (worker.Claimed, error) {
			mu.Lock()
			defer mu.Unlock()
			claims = append(claims, time.Since(t0))
			if len(claims) == 1 {
				return worker.Claimed{NextDue: t0.Add(3 * time.Second)}, nil
			}
			return worker.Claimed{}, nil
		}
		w, err := worker.NewWithStore(store, worker.Config{
			Perspectives: []worker.Perspective{utPerspective(utName, nil)},
			PollOnly:     true,
			PollInterval: time.Minute,
			Logger:       utLogger(&utLogBuf{}),
		})
		require.NoError(t, err)
		require.NoError(t, w.Start(context.Background()))
		time.Sleep(10 * time.Second)
		synctest.Wait()
		require.NoError(t, w.Stop(context.Background()))
		mu.Lock()
		defer mu.Unlock()
		require.Equal(t, []time.Duration{0, 3 * time.Second}, claims, "at start, then when the pair is due; the poll is a minute away")
	})
}

// Stop while a pair's full batch is applied: the batch commits, and the lease its next batch
// would have kept is released before Stop returns, so that another instance can take the
// pair at once rather than after the lease lapses.
func TestUnitStopReleasesTheLeaseAFollowUpKept(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		p := worker.Pair{Stream: uuid.New(), Perspective: utBuilds()[0].Key}
		evs := make([]worker.Event, worker.DefaultBatchSize)
		for i := range evs {
			evs[i] = worker.Event{ID: uuid.Must(uuid.NewV7()), StreamID: p.Stream, Type: "n", Data: json.RawMessage(`{"n":1}`)}
		}
		applying, release := make(chan struct{}), make(chan struct{})
		var n atomic.Int32
		store := utLoopStore()
		store.ClaimFunc = func(ctx context.Context, req worker.ClaimRequest) (worker.Claimed, error) {
			if n.Add(1) > 1 {
				return worker.Claimed{}, nil
			}
			return worker.Claimed{Pairs: []worker.Pair{p}}, nil
		}
		store.ApplyFunc = func(ctx context.Context, req worker.ApplyRequest, decide func([]worker.PairState) []worker.PairWrite) ([]worker.Pair, error) {
			close(applying)
			<-release
			writes := decide([]worker.PairState{{Pair: p, Events: evs}})
			assert.Len(t, writes, 1) // not require: a job goroutine
			return nil, nil
		}
		require.NoError(t, utStopWhileBlocked(t, store, applying, release))
		assert.Len(t, store.ApplyCalls(), 1, "the next batch is not started after Stop")
		releases := store.ReleaseCalls()
		require.Len(t, releases, 1, "the lease kept for the next batch is released")
		assert.Equal(t, []worker.Pair{p}, releases[0].Req.Pairs)
		assert.Empty(t, store.LeasedCalls(), "no claim failed: the pairs this instance leases are not read")
	})
}

// A job whose release an outage cut off: once a claim shows the database answering, the loop
// reads the pairs this instance leases (the lease still lasts: its pair is among them) and
// releases them, then claims again at once, since the pair may be due. After an outage
// longer than the lease, the read finds it lapsed and releases nothing; a release that
// failed otherwise than by a lost connection is not followed by a read (it would fail again).
func TestUnitAReleaseAnOutageCutOffIsReleasedOnceTheDatabaseAnswers(t *testing.T) {
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
	// The claims during the outage cannot connect: they leave nothing unknown themselves.
	_, connectErr := pgconn.Connect(context.Background(), "postgres://127.0.0.1:1/none?connect_timeout=5")
	var ce *pgconn.ConnectError
	require.ErrorAs(t, connectErr, &ce)
	for _, tc := range []struct {
		name       string
		outage     time.Duration
		releaseErr error
		read       bool // the leases are read
		again      bool // and the pair released
	}{
		{"outage of 3s", 3050 * time.Millisecond, refused, true, true}, // off the 100ms grid of its claims
		{"outage of 20s, the lease still lasts", 20 * time.Second, refused, true, true},
		{"outage past the lease", 35 * time.Second, refused, true, false},
		{"release timed out (a server that stopped answering)", 3050 * time.Millisecond, fmt.Errorf("timeout: %w", context.DeadlineExceeded), true, true},
		{"release refused by the database", 3050 * time.Millisecond, &pgconn.PgError{Code: "XX000", Message: "internal error"}, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				p := worker.Pair{Stream: uuid.New(), Perspective: utBuilds()[0].Key}
				ev := worker.Event{ID: uuid.Must(uuid.NewV7()), StreamID: p.Stream, Type: "n", Data: json.RawMessage(`{"n":1}`)}
				var down atomic.Bool
				var mu sync.Mutex
				var calls []string // the store's calls in order: "claim", "claim-failed", "leased", "release", "release-failed"
				note := func(s string) { mu.Lock(); calls = append(calls, s); mu.Unlock() }
				var claimed, released atomic.Bool
				var claimedAt time.Time
				store := utLoopStore()
				store.ClaimFunc = func(ctx context.Context, req worker.ClaimRequest) (worker.Claimed, error) {
					if down.Load() {
						note("claim-failed")
						return worker.Claimed{}, connectErr
					}
					note("claim")
					if claimed.Swap(true) {
						return worker.Claimed{}, nil
					}
					claimedAt = time.Now()
					return worker.Claimed{Pairs: []worker.Pair{p}}, nil
				}
				store.ApplyFunc = func(ctx context.Context, req worker.ApplyRequest, decide func([]worker.PairState) []worker.PairWrite) ([]worker.Pair, error) {
					// not require: a job goroutine
					assert.Len(t, decide([]worker.PairState{{Pair: p, Events: []worker.Event{ev}}}), 1)
					down.Store(true) // the server goes once the commit is acknowledged
					return nil, nil
				}
				store.ReleaseFunc = func(ctx context.Context, req worker.ReleaseRequest) error {
					if down.Load() {
						note("release-failed")
						return tc.releaseErr
					}
					note("release")
					released.Store(true)
					return nil
				}
				store.LeasedFunc = func(context.Context, uuid.UUID) ([]worker.Pair, error) {
					note("leased")
					if released.Load() || time.Since(claimedAt) >= locker.DefaultLockTimeout {
						return nil, nil // released, or the lease lapsed
					}
					return []worker.Pair{p}, nil
				}
				w := utStartPollOnly(t, store)
				defer func() { require.NoError(t, w.Stop(context.Background())) }()
				synctest.Wait()
				time.Sleep(tc.outage)
				down.Store(false)
				// The loop claims every 100ms while the database is away; the poll after the
				// first claim that answers would come a PollInterval (1s) later.
				time.Sleep(500 * time.Millisecond)
				synctest.Wait()

				mu.Lock()
				defer mu.Unlock()
				require.Equal(t, []string{"claim", "release-failed"}, calls[:2], "the job's release failed")
				rest := slices.DeleteFunc(slices.Clone(calls[2:]), func(s string) bool { return s == "claim-failed" })
				switch {
				case !tc.read:
					assert.Equal(t, []string{"claim"}, rest, "claims resume; nothing is read or released")
				case !tc.again:
					assert.Equal(t, []string{"claim", "leased"}, rest, "the lapsed lease is not released")
				default:
					require.GreaterOrEqual(t, len(rest), 4, "claims resume: %v", rest)
					assert.Equal(t, []string{"claim", "leased", "release", "claim"}, rest[:4],
						"the first claim that answers is followed by the read, the release, then a claim at once")
					releases := store.ReleaseCalls()
					require.Len(t, releases, 2)
					assert.Equal(t, []worker.Pair{p}, releases[1].Req.Pairs)
					assert.Equal(t, w.InstanceID(), releases[1].Req.Instance)
				}
			})
		})
	}
}

// utOutageStore is a loop store on which the database is away while down is set: every
// claim and release fails with a refused connection. Its first claim leases p, its later
// ones nothing; Leased returns p until a release succeeds.
func utOutageStore(p worker.Pair, down *atomic.Bool) *mocks.StoreMock {
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
	var claimed, released atomic.Bool
	store := utLoopStore()
	store.ClaimFunc = func(ctx context.Context, req worker.ClaimRequest) (worker.Claimed, error) {
		if down.Load() {
			return worker.Claimed{}, refused
		}
		if claimed.Swap(true) {
			return worker.Claimed{}, nil
		}
		return worker.Claimed{Pairs: []worker.Pair{p}}, nil
	}
	store.ReleaseFunc = func(ctx context.Context, req worker.ReleaseRequest) error {
		if down.Load() {
			return refused
		}
		released.Store(true)
		return nil
	}
	store.LeasedFunc = func(context.Context, uuid.UUID) ([]worker.Pair, error) {
		if released.Load() {
			return nil, nil
		}
		return []worker.Pair{p}, nil
	}
	return store
}

// Stop releases a lease whose release an outage cut off, in its one release statement at
// the end of the loop, when the database answers again before a claim could: the pair is
// not left to wait for its lease to lapse. The job's own release gave the busy pair its
// wait; Stop's, seconds later, makes it due at once.
func TestUnitStopReleasesALeaseAnOutageCutOff(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		p := worker.Pair{Stream: uuid.New(), Perspective: utBuilds()[0].Key}
		var down atomic.Bool
		store := utOutageStore(p, &down)
		store.ApplyFunc = func(ctx context.Context, req worker.ApplyRequest, decide func([]worker.PairState) []worker.PairWrite) ([]worker.Pair, error) {
			down.Store(true) // the server goes as the transaction finds p held by another
			return []worker.Pair{p}, nil
		}
		w := utStartPollOnly(t, store)
		time.Sleep(2050 * time.Millisecond) // off the 100ms grid of the claims during the outage
		down.Store(false)
		claims := len(store.ClaimCalls())
		require.NoError(t, w.Stop(context.Background()))
		assert.Len(t, store.ClaimCalls(), claims, "no claim between the database's return and Stop")
		assert.Len(t, store.LeasedCalls(), 1, "Stop read the leases")
		releases := store.ReleaseCalls()
		require.Len(t, releases, 2, "the release the outage failed, and Stop's")
		for i, r := range releases {
			assert.Equal(t, []worker.Pair{p}, r.Req.Pairs, "release %d", i)
		}
		assert.Equal(t, map[worker.Pair]time.Duration{p: 100 * time.Millisecond}, releases[0].Req.Later,
			"the job's release: the busy pair is due after busyWait")
		assert.Empty(t, releases[1].Req.Later, "Stop's: due at once")
	})
}

// A release that failed may yet have committed: when a claim leases the pair here again, the
// look at this instance's leases that the failure calls for finds the pair, held by the new
// job, and does not release it, which would end that job's lease while it runs. The claim
// comes before the loop takes the first job's report (the failed release returns only once
// the pair is claimed again), or after it: the claim the report makes the loop send (the
// applies end between two polls, so no timer's claim comes first).
func TestUnitALeaseClaimedAgainIsNotReleasedAfterAnOutage(t *testing.T) {
	for _, beforeReport := range []bool{true, false} {
		t.Run(fmt.Sprintf("claimed again before the report: %v", beforeReport), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				p := worker.Pair{Stream: uuid.New(), Perspective: utBuilds()[0].Key}
				ev := worker.Event{ID: uuid.Must(uuid.NewV7()), StreamID: p.Stream, Type: "n", Data: json.RawMessage(`{"n":1}`)}
				var mu sync.Mutex
				var calls []string
				note := func(s string) { mu.Lock(); calls = append(calls, s); mu.Unlock() }
				var applies, releases atomic.Int32
				var claimedFirst, claimedAgain atomic.Bool
				again := make(chan struct{})
				store := utLoopStore()
				store.ClaimFunc = func(ctx context.Context, req worker.ClaimRequest) (worker.Claimed, error) {
					first := !claimedFirst.Swap(true)
					// p claimed again: the failed release had committed
					later := !first && releases.Load() == 1 && !claimedAgain.Swap(true)
					if first || later {
						note("claim p")
						if later && beforeReport {
							close(again)
						}
						return worker.Claimed{Pairs: []worker.Pair{p}}, nil
					}
					return worker.Claimed{}, nil
				}
				store.ApplyFunc = func(ctx context.Context, req worker.ApplyRequest, decide func([]worker.PairState) []worker.PairWrite) ([]worker.Pair, error) {
					n := applies.Add(1)
					note(fmt.Sprintf("apply %d", n))
					// not require: a job goroutine
					assert.Len(t, decide([]worker.PairState{{Pair: p, Events: []worker.Event{ev}}}), 1)
					time.Sleep(1500 * time.Millisecond) // between two polls (PollInterval 1s)
					note(fmt.Sprintf("apply %d committed", n))
					return nil, nil
				}
				store.ReleaseFunc = func(ctx context.Context, req worker.ReleaseRequest) error {
					if releases.Add(1) == 1 {
						note("release failed")
						if beforeReport {
							<-again
						}
						return &net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET} // committed, the reply lost
					}
					note("release")
					return nil
				}
				store.LeasedFunc = func(context.Context, uuid.UUID) ([]worker.Pair, error) {
					note("leased")
					if claimedAgain.Load() && releases.Load() < 2 {
						return []worker.Pair{p}, nil // the second job's lease
					}
					return nil, nil
				}
				w := utStartPollOnly(t, store)
				time.Sleep(5 * time.Second)
				require.NoError(t, w.Stop(context.Background()))
				mu.Lock()
				defer mu.Unlock()
				got := slices.DeleteFunc(slices.Clone(calls), func(s string) bool { return s == "leased" })
				assert.Equal(t, []string{"claim p", "apply 1", "apply 1 committed", "release failed", "claim p", "apply 2", "apply 2 committed", "release"}, got,
					"the second job's lease is released once, by that job, after its commit")
				assert.Contains(t, calls, "leased", "the leases were looked at")
				assert.Less(t, slices.Index(calls, "leased"), slices.Index(calls, "apply 2 committed"), "while the second job ran")
			})
		})
	}
}

// A claim that failed with a lost connection may have committed, leasing pairs this instance
// never learnt of: after the next claim that succeeds, the loop reads the pairs it leases
// (unexpired leases only) and releases those no job here holds (q, not p, whose job runs).
// After an outage longer than the lease, the read finds only p's; after claims that never
// reached a server, nothing is read.
func TestUnitPairsAClaimCutOffLeasedAreReleased(t *testing.T) {
	// A claim that could not connect never reached a server: nothing to read after it.
	_, connectErr := pgconn.Connect(context.Background(), "postgres://127.0.0.1:1/none?connect_timeout=5")
	var ce *pgconn.ConnectError
	require.ErrorAs(t, connectErr, &ce)
	reset := &net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET}
	for _, tc := range []struct {
		name    string
		outage  time.Duration
		err     error
		read    bool
		release bool
	}{
		{"outage of 2s", 2050 * time.Millisecond, reset, true, true},
		{"outage of 20s, the lease still lasts", 20 * time.Second, reset, true, true},
		{"outage past the lease", 35 * time.Second, reset, true, false},
		{"outage of 2s, claims never sent", 2050 * time.Millisecond, connectErr, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				p := worker.Pair{Stream: uuid.New(), Perspective: utBuilds()[0].Key}
				q := worker.Pair{Stream: uuid.New(), Perspective: utBuilds()[0].Key}
				var up, claimedP atomic.Bool
				applying, done := make(chan struct{}), make(chan struct{})
				store := utLoopStore()
				start := time.Now()
				store.ClaimFunc = func(ctx context.Context, req worker.ClaimRequest) (worker.Claimed, error) {
					switch {
					case !up.Load():
						return worker.Claimed{}, tc.err // an OpError: the first one committed, q is leased here
					case !claimedP.Swap(true):
						return worker.Claimed{Pairs: []worker.Pair{p}}, nil
					}
					return worker.Claimed{}, nil
				}
				store.ApplyFunc = func(ctx context.Context, req worker.ApplyRequest, decide func([]worker.PairState) []worker.PairWrite) ([]worker.Pair, error) {
					close(applying)
					<-done
					return nil, nil
				}
				store.LeasedFunc = func(context.Context, uuid.UUID) ([]worker.Pair, error) {
					if time.Since(start) >= locker.DefaultLockTimeout {
						return []worker.Pair{p}, nil // q's lease lapsed
					}
					return []worker.Pair{p, q}, nil
				}
				w := utStartPollOnly(t, store)
				time.Sleep(tc.outage)
				up.Store(true)
				<-applying
				synctest.Wait()
				leased := len(store.LeasedCalls())
				var released [][]worker.Pair
				for _, c := range store.ReleaseCalls() {
					released = append(released, c.Req.Pairs)
				}
				close(done)
				require.NoError(t, w.Stop(context.Background()))
				if tc.read {
					assert.Equal(t, 1, leased, "the leases read once, after the claim that succeeded")
				} else {
					assert.Zero(t, leased, "after claims never sent, nothing is read")
				}
				if tc.release {
					assert.Equal(t, [][]worker.Pair{{q}}, released, "q released while p's job runs; p is not")
				} else {
					assert.Empty(t, released, "nothing but p's lease, which its job holds, or nothing read: nothing released")
				}
			})
		})
	}
}

// A pair whose failure could not be recorded backs off through its lease's release; when an
// outage cut that release off too, the release after the outage gives it the same backoff
// rather than making it due at once.
func TestUnitALeaseAnOutageCutOffKeepsAnUnrecordedFailuresBackoff(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		p := worker.Pair{Stream: uuid.New(), Perspective: utBuilds()[0].Key}
		var down atomic.Bool
		store := utOutageStore(p, &down)
		store.ApplyFunc = func(ctx context.Context, req worker.ApplyRequest, decide func([]worker.PairState) []worker.PairWrite) ([]worker.Pair, error) {
			return nil, fmt.Errorf("deadlock detected")
		}
		store.MarkFailedFunc = func(context.Context, worker.Pair, worker.Failure, func(int) worker.FailureAction) (worker.FailureAction, error) {
			down.Store(true) // the server goes after refusing the record
			return worker.FailureRetry, errors.New("permission denied for table wh_perspective_cursors")
		}
		w := utStartPollOnly(t, store)
		time.Sleep(2050 * time.Millisecond)
		down.Store(false)
		time.Sleep(500 * time.Millisecond)
		synctest.Wait()
		require.NoError(t, w.Stop(context.Background()))
		releases := store.ReleaseCalls()
		require.Len(t, releases, 2, "the job's release the outage failed, and the one after it")
		for i, r := range releases {
			assert.Equal(t, []worker.Pair{p}, r.Req.Pairs, "release %d", i)
			assert.Equal(t, map[worker.Pair]time.Duration{p: worker.DefaultRetryBackoff}, r.Req.Later,
				"release %d: due after the first unrecorded failure's backoff", i)
		}
	})
}

// utFullBatch is BatchSize events of p's stream: a batch that keeps the pair's lease for a
// next one (a continuation).
func utFullBatch(p worker.Pair) []worker.Event {
	evs := make([]worker.Event, worker.DefaultBatchSize)
	for i := range evs {
		evs[i] = worker.Event{ID: uuid.Must(uuid.NewV7()), StreamID: p.Stream, Type: "n", Data: json.RawMessage(`{"n":1}`)}
	}
	return evs
}

// Stop whose context ends while the leases are unknown (a claim was cut off, leasing q) and
// a continuation of p waits for a slot: the look at the leases runs under a context of its
// own, not the loop's ended one, and Stop releases both p's lease and q's.
func TestUnitStopCutShortReleasesAFollowUpsLeaseWhileLeasesAreUnknown(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		p := worker.Pair{Stream: uuid.New(), Perspective: utBuilds()[0].Key}
		q := worker.Pair{Stream: uuid.New(), Perspective: utBuilds()[0].Key}
		reset := &net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET}
		applying, unblock := make(chan struct{}), make(chan struct{})
		var n atomic.Int32
		store := utLoopStore()
		store.ClaimFunc = func(ctx context.Context, req worker.ClaimRequest) (worker.Claimed, error) {
			if n.Add(1) == 1 {
				return worker.Claimed{Pairs: []worker.Pair{p}}, nil
			}
			return worker.Claimed{}, reset // may have committed: the leases are unknown
		}
		store.ApplyFunc = func(ctx context.Context, req worker.ApplyRequest, decide func([]worker.PairState) []worker.PairWrite) ([]worker.Pair, error) {
			decide([]worker.PairState{{Pair: p, Events: utFullBatch(p)}}) // folded: a full batch
			close(applying)
			<-unblock // its commit returns after Stop's context ended
			return nil, nil
		}
		store.LeasedFunc = func(ctx context.Context, _ uuid.UUID) ([]worker.Pair, error) {
			if err := ctx.Err(); err != nil {
				return nil, err // as pgx does
			}
			return []worker.Pair{p, q}, nil
		}
		w := utStartPollOnly(t, store)
		<-applying
		time.Sleep(3 * time.Second) // claims cut off meanwhile
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		go func() { time.Sleep(1500 * time.Millisecond); close(unblock) }() // after Stop's context ends
		require.ErrorIs(t, w.Stop(ctx), context.DeadlineExceeded)
		releases := store.ReleaseCalls()
		require.Len(t, releases, 1, "one release at Stop")
		want := []worker.Pair{p, q}
		slices.SortFunc(want, func(a, b worker.Pair) int { return strings.Compare(a.Stream.String(), b.Stream.String()) })
		assert.Equal(t, want, releases[0].Req.Pairs, "the continuation's lease and the unknown one")
		assert.Len(t, store.LeasedCalls(), 1, "the leases were looked at")
	})
}

// A continuation (a follow-up that keeps its pair's lease) runs while the loop looks at the
// leases after a cut-off claim: the look does not release its pair.
func TestUnitTheLookAtTheLeasesLeavesARunningFollowUpsPair(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		p := worker.Pair{Stream: uuid.New(), Perspective: utBuilds()[0].Key}
		reset := &net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET}
		second, unblock := make(chan struct{}), make(chan struct{})
		var n, applies atomic.Int32
		var running, releasedWhileRunning atomic.Bool
		store := utLoopStore()
		store.ClaimFunc = func(ctx context.Context, req worker.ClaimRequest) (worker.Claimed, error) {
			switch n.Add(1) {
			case 1:
				return worker.Claimed{Pairs: []worker.Pair{p}}, nil
			case 2:
				return worker.Claimed{}, reset
			}
			return worker.Claimed{}, nil
		}
		store.ApplyFunc = func(ctx context.Context, req worker.ApplyRequest, decide func([]worker.PairState) []worker.PairWrite) ([]worker.Pair, error) {
			if applies.Add(1) == 2 {
				running.Store(true)
				close(second)
				<-unblock
				running.Store(false)
				decide([]worker.PairState{{Pair: p}})
				return nil, nil
			}
			decide([]worker.PairState{{Pair: p, Events: utFullBatch(p)}})
			return nil, nil
		}
		store.ReleaseFunc = func(ctx context.Context, req worker.ReleaseRequest) error {
			if running.Load() {
				releasedWhileRunning.Store(true)
			}
			return nil
		}
		store.LeasedFunc = func(ctx context.Context, _ uuid.UUID) ([]worker.Pair, error) {
			return []worker.Pair{p}, nil
		}
		w := utStartPollOnly(t, store)
		<-second
		time.Sleep(5 * time.Second)
		close(unblock)
		require.NoError(t, w.Stop(context.Background()))
		require.NotEmpty(t, store.LeasedCalls(), "the leases were looked at while the follow-up ran")
		assert.False(t, releasedWhileRunning.Load(), "the running follow-up's lease was not released")
	})
}

// A look at the leases that fails is made again after the next claim that succeeds.
func TestUnitAFailedLookAtTheLeasesIsMadeAgain(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := worker.Pair{Stream: uuid.New(), Perspective: utBuilds()[0].Key}
		reset := &net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET}
		var n, reads atomic.Int32
		store := utLoopStore()
		store.ClaimFunc = func(ctx context.Context, req worker.ClaimRequest) (worker.Claimed, error) {
			if n.Add(1) == 1 {
				return worker.Claimed{}, reset // committed: q is leased here
			}
			return worker.Claimed{}, nil
		}
		store.LeasedFunc = func(context.Context, uuid.UUID) ([]worker.Pair, error) {
			if reads.Add(1) == 1 {
				return nil, &pgconn.PgError{Code: "57014", Message: "canceling statement due to statement timeout"}
			}
			return []worker.Pair{q}, nil
		}
		w := utStartPollOnly(t, store)
		time.Sleep(3 * time.Second) // claims every PollInterval (1s)
		synctest.Wait()
		require.NoError(t, w.Stop(context.Background()))
		assert.EqualValues(t, 2, reads.Load(), "read again after the next claim, then no more")
		releases := store.ReleaseCalls()
		require.Len(t, releases, 1)
		assert.Equal(t, []worker.Pair{q}, releases[0].Req.Pairs)
	})
}
