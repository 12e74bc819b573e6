package worker_test

// Stop, graceful then hard, on the mocks inside a testing/synctest bubble: the worker's
// own loop claims a pair whose rewind runs while Stop is called.

import (
	"context"
	"encoding/json"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/google/uuid"
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
	f.store.ApplyFunc = func(ctx context.Context, pairs []worker.Pair, perPair int, decide func([]worker.PairState) []worker.PairWrite) ([]worker.Pair, error) {
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

// A pair whose job ended is looked up again by the next claim and, with nothing else to
// wake the loop, by one claim that the loop wakes for right after claimSettle, not by the
// next poll (a minute here): the Appends that were running when the job ended may have
// stamped their rows with the group's due time, which the claims since passed as held.
func TestUnitEndedPairIsLookedUpTwiceWithoutWaitingForThePoll(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		p := worker.Pair{Stream: uuid.New(), Perspective: utBuilds()[0].Key}
		due := time.Now()
		ev := worker.Event{ID: uuid.Must(uuid.NewV7()), StreamID: p.Stream, Type: "n", Data: json.RawMessage(`{"n":1}`)}
		type claim struct {
			at      time.Duration // since the job ended
			recheck []worker.QueuedGroup
		}
		var (
			claims []claim
			ended  time.Time
			n      atomic.Int32
		)
		store := utLoopStore()
		store.ClaimFunc = func(ctx context.Context, req worker.ClaimRequest) (worker.Claimed, error) {
			if n.Add(1) == 1 {
				return worker.Claimed{Pairs: []worker.Pair{p}, At: map[worker.Pair]time.Time{p: due}}, nil
			}
			claims = append(claims, claim{at: time.Since(ended), recheck: req.Recheck})
			return worker.Claimed{}, nil
		}
		store.ApplyFunc = func(ctx context.Context, pairs []worker.Pair, perPair int, decide func([]worker.PairState) []worker.PairWrite) ([]worker.Pair, error) {
			writes := decide([]worker.PairState{{Pair: p, Events: []worker.Event{ev}, Model: json.RawMessage(`{"seq":[]}`)}})
			assert.Len(t, writes, 1) // not require: a job goroutine
			ended = time.Now()
			return nil, nil
		}
		w, err := worker.NewWithStore(store, worker.Config{
			Perspectives: []worker.Perspective{utPerspective(utName, nil)},
			PollOnly:     true,
			PollInterval: time.Minute,
			Logger:       utLogger(&utLogBuf{}),
		})
		require.NoError(t, err)
		require.NoError(t, w.Start(context.Background()))
		time.Sleep(time.Second)
		synctest.Wait()
		require.NoError(t, w.Stop(context.Background()))

		want := []worker.QueuedGroup{{Pair: p, At: due}}
		require.Len(t, claims, 2, "claims after the job, with a one-minute poll: %v", claims)
		require.Equal(t, want, claims[0].recheck, "the claim right after the job looks the pair up")
		require.Less(t, claims[0].at, worker.ClaimSettle)
		require.Equal(t, want, claims[1].recheck, "and the claim the loop wakes for after claimSettle")
		require.Greater(t, claims[1].at, worker.ClaimSettle)
		require.Less(t, claims[1].at, worker.ClaimSettle+10*time.Millisecond)
	})
}
