package worker_test

// The loop backs off from what keeps failing without being about the connection: a claim
// the database refuses, and a pair whose failure cannot be recorded. Woken many times
// meanwhile (a queue notification every 100ms), it tries again only when the backoff ends;
// a success resets the backoff. On the mocks, inside testing/synctest bubbles.

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/mocks"
	"github.com/perspectives-go/perspectives/worker"
)

// newBackoffWorker starts a worker on store that polls only once an hour: what it does
// besides is what wakes it (Notify) and its backoffs, RetryBackoff 1s doubling up to 4s.
func newBackoffWorker(t *testing.T, store *mocks.StoreMock, logs *utLogBuf) *worker.Worker {
	t.Helper()
	w, err := worker.NewWithStore(store, worker.Config{
		Perspectives:    []worker.Perspective{utPerspective(utName, nil)},
		PollOnly:        true,
		PollInterval:    time.Hour,
		RetryBackoff:    time.Second,
		MaxRetryBackoff: 4 * time.Second,
		Logger:          utLogger(logs),
	})
	require.NoError(t, err)
	require.NoError(t, w.Start(context.Background()))
	synctest.Wait()
	return w
}

// notifyUntil wakes w every 100ms until d after start, letting the loop act on each wake.
func notifyUntil(w *worker.Worker, start time.Time, d time.Duration) {
	for time.Since(start) < d {
		time.Sleep(100 * time.Millisecond)
		w.Notify()
		synctest.Wait()
	}
}

// logCount is how many records at level have a message that begins with msg.
func logCount(logs *utLogBuf, level, msg string) int {
	return strings.Count(logs.String(), "level="+level+` msg="`+msg)
}

// seconds turns seconds since the start into durations.
func seconds(s ...float64) []time.Duration {
	out := make([]time.Duration, len(s))
	for i, v := range s {
		out[i] = time.Duration(v * float64(time.Second))
	}
	return out
}

// A claim that fails with an error that is not about the connection is tried again after
// RetryBackoff, doubling up to the cap, however often the loop is woken meanwhile; it is
// logged once for the spell, and a claim that succeeds ends it: the next failure waits
// RetryBackoff again.
func TestUnitLoopBacksOffFromAFailingClaim(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		logs := &utLogBuf{}
		store := utLoopStore()
		var mu sync.Mutex
		failing := true
		var failed []time.Duration // when the failing claims ran, since start
		start := time.Now()
		store.ClaimFunc = func(context.Context, worker.ClaimRequest) (worker.Claimed, error) {
			mu.Lock()
			defer mu.Unlock()
			if !failing {
				return worker.Claimed{}, nil
			}
			failed = append(failed, time.Since(start))
			return worker.Claimed{}, errors.New(`permission denied for table wh_perspective_events`)
		}
		w := newBackoffWorker(t, store, logs)
		setFailing := func(f bool) {
			mu.Lock()
			defer mu.Unlock()
			failing = f
		}
		took := func() []time.Duration {
			mu.Lock()
			defer mu.Unlock()
			out := slices.Clone(failed)
			failed = failed[:0]
			return out
		}

		notifyUntil(w, start, 20*time.Second)
		assert.Equal(t, seconds(0, 1, 3, 7, 11, 15, 19), took(), "claims while they fail: backing off, capped at 4s")
		assert.Equal(t, 1, logCount(logs, "ERROR", "poll queue failed"), "said once for the spell")

		setFailing(false) // the next claim, at 23s, succeeds
		notifyUntil(w, start, 25*time.Second)
		assert.Empty(t, took())
		assert.Equal(t, 1, logCount(logs, "INFO", "claims succeed again"))

		setFailing(true)
		notifyUntil(w, start, 30*time.Second)
		assert.Equal(t, seconds(25.1, 26.1, 28.1), took(), "the backoff starts again at RetryBackoff")
		assert.Equal(t, 2, logCount(logs, "ERROR", "poll queue failed"), "a new spell is said again")
		assert.Zero(t, strings.Count(logs.String(), "database unavailable"), "not taken for a lost connection")

		require.NoError(t, w.Stop(context.Background()))
	})
}

// A pair whose failure cannot be recorded (MarkFailed fails: its due row keeps no backoff) is
// not claimed again at every wake but after the backoff its failure would have had
// (RetryBackoff, doubling up to MaxRetryBackoff), which its job's release gives its due row;
// it is logged once for the spell, and a job of the pair that succeeds ends it. The other
// claims go on meanwhile.
func TestUnitLoopBacksOffFromAPairWhoseFailureCannotBeRecorded(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		logs := &utLogBuf{}
		store := utLoopStore()
		p := worker.Pair{Stream: uuid.New(), Perspective: utName}
		var mu sync.Mutex
		queued, failing := true, true // p has rows due; its Apply and MarkFailed fail
		var marks []time.Duration     // when MarkFailed ran, since start
		claims := 0
		start := time.Now()
		// p's due row, as the database keeps it: leased by a claim, due again when released
		// (after the wait the release gives it).
		due, leased := start, false
		store.ClaimFunc = func(_ context.Context, req worker.ClaimRequest) (worker.Claimed, error) {
			mu.Lock()
			defer mu.Unlock()
			claims++
			if !queued || leased || time.Now().Before(due) {
				return worker.Claimed{NextDue: due}, nil
			}
			leased = true
			return worker.Claimed{Pairs: []worker.Pair{p}}, nil
		}
		store.ReleaseFunc = func(_ context.Context, req worker.ReleaseRequest) error {
			mu.Lock()
			defer mu.Unlock()
			require.Equal(t, []worker.Pair{p}, req.Pairs)
			leased, due = false, time.Now().Add(req.Later[p])
			return nil
		}
		store.ApplyFunc = func(context.Context, worker.ApplyRequest, func([]worker.PairState) []worker.PairWrite) ([]worker.Pair, error) {
			mu.Lock()
			defer mu.Unlock()
			if failing {
				return nil, errors.New("value too long for type character varying(50)")
			}
			queued = false // applied: nothing left
			return nil, nil
		}
		store.MarkFailedFunc = func(ctx context.Context, _ worker.Pair, _ worker.Failure, _ func(int) worker.FailureAction) (worker.FailureAction, error) {
			mu.Lock()
			marks = append(marks, time.Since(start))
			spinning := len(marks) > 100
			mu.Unlock()
			if spinning {
				<-ctx.Done() // retried at once, again and again: let the bubble's clock move
			}
			return "", errors.New("cannot execute UPDATE in a read-only transaction")
		}
		w := newBackoffWorker(t, store, logs)
		set := func(q, f bool) {
			mu.Lock()
			defer mu.Unlock()
			queued, failing = q, f
		}
		took := func() (out []time.Duration, n int) {
			mu.Lock()
			defer mu.Unlock()
			out, n = slices.Clone(marks), claims
			marks, claims = marks[:0], 0
			return out, n
		}

		notifyUntil(w, start, 20*time.Second)
		marked, claimed := took()
		assert.Equal(t, seconds(0, 1, 3, 7, 11, 15, 19), marked, "the pair's tries: backing off, capped at MaxRetryBackoff")
		assert.Greater(t, claimed, 190, "the loop claims at every wake meanwhile")
		assert.Equal(t, 1, logCount(logs, "ERROR", "recording failure failed"), "said once for the spell")

		set(true, false) // its next try, at 23s, succeeds
		notifyUntil(w, start, 25*time.Second)
		marked, _ = took()
		assert.Empty(t, marked)
		assert.Equal(t, 1, logCount(logs, "INFO", "pair processed again after failures that could not be recorded"))

		set(true, true)
		notifyUntil(w, start, 30*time.Second)
		marked, _ = took()
		assert.Equal(t, seconds(25.1, 26.1, 28.1), marked, "the backoff starts again at RetryBackoff")
		assert.Equal(t, 2, logCount(logs, "ERROR", "recording failure failed"), "a new spell is said again")

		require.NoError(t, w.Stop(context.Background()))
	})
}
