package worker

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
)

// fakeLeases is a leaderStore that grants every lease while grant is set, fails while fail is
// set, does not answer (until the attempt's context ends) while hang is set, and records the
// attempts and resignations.
type fakeLeases struct {
	hang     atomic.Bool
	mu       sync.Mutex
	grant    bool
	fail     bool
	attempts []time.Time
	bounds   []time.Duration // each attempt's context deadline, after the attempt began
	resigned [][]string
}

func (f *fakeLeases) leaderAttempt(ctx context.Context, names []string, _ uuid.UUID, _ time.Duration) ([]string, error) {
	if f.hang.Load() {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.attempts = append(f.attempts, time.Now())
	if d, ok := ctx.Deadline(); ok {
		f.bounds = append(f.bounds, time.Until(d))
	}
	switch {
	case f.fail:
		return nil, errors.New("connection reset")
	case f.grant:
		return slices.Clone(names), nil
	}
	return nil, nil
}

func (f *fakeLeases) leaderResign(_ context.Context, names []string, _ uuid.UUID) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.resigned = append(f.resigned, names)
	return nil
}

func (f *fakeLeases) set(grant, fail bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.grant, f.fail = grant, fail
}

// The elector attempts at start and every interval, each attempt bounded by the interval;
// it trusts a lease only until TTL less the margin after the attempt that won it was sent,
// however the attempts after it fail; a denied attempt stops the trust at once; stop resigns
// every lease and trusts none.
func TestElectorLocalDeadlineAttemptsAndResign(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		const ttl, every, margin = 10 * time.Second, time.Second, 2 * time.Second
		f := &fakeLeases{grant: true}
		var logs syncBuf
		var gained atomic.Int32
		names := leaseNames([]PerspectiveVersion{{Name: "p", Version: 2}})
		require.Equal(t, []string{"cleanup:p", "instances", "promotion:p@v2"}, names)
		e := startElector(context.Background(), f, names, uuid.New(), ttl, every, margin, slog.New(slog.NewTextHandler(&logs, nil)), func() { gained.Add(1) })
		require.True(t, e.holds("promotion:p@v2"), "won at start")
		require.False(t, e.holds("promotion:q@v1"), "a lease it never attempted")
		require.EqualValues(t, 1, gained.Load())
		start := time.Now()

		time.Sleep(3*every + every/2)
		f.set(true, true) // every attempt from now on fails
		f.mu.Lock()
		require.Len(t, f.attempts, 4, "at start and every interval")
		require.Equal(t, []time.Duration{every, every, every, every}, f.bounds, "each bounded by the interval (at start, also by heartbeatTimeout)")
		f.mu.Unlock()
		won := start.Add(3 * every) // the last attempt that won
		time.Sleep(time.Until(won.Add(ttl - margin - time.Millisecond)))
		require.True(t, e.holds("cleanup:p"), "trusted until TTL less the margin after the last win")
		time.Sleep(2 * time.Millisecond)
		require.False(t, e.holds("cleanup:p"), "not trusted after it, though no attempt said it was lost")
		require.Equal(t, 1, logs.count("leader lease attempt failed"), "a warning once, for a spell of failures")

		f.set(true, false)
		time.Sleep(every)
		require.True(t, e.holds("cleanup:p"), "won again")
		require.EqualValues(t, 2, gained.Load(), "a lease won again after it lapsed is a gain")
		f.set(false, false)
		time.Sleep(every)
		require.False(t, e.holds("cleanup:p"), "a denied attempt (taken over) stops the trust at once")
		require.Equal(t, 1, logs.count("leader lease lost to another instance"))

		f.set(true, false)
		time.Sleep(every)
		require.True(t, e.holds("instances"))
		e.stop(context.Background())
		require.False(t, e.holds("instances"), "none trusted after stop")
		count := func() (attempts, resigned int) {
			f.mu.Lock()
			defer f.mu.Unlock()
			require.Equal(t, [][]string{names}, f.resigned, "every lease resigned at stop, once")
			return len(f.attempts), len(f.resigned)
		}
		n, _ := count()
		time.Sleep(5 * every)
		after, _ := count()
		require.Equal(t, n, after, "no attempt after stop")
	})
}

// Stop's context bounds its wait for an attempt under way on a database that does not
// answer: the attempt is cancelled when it ends, and the leases are resigned.
func TestElectorStopHonoursItsContextWithAnAttemptUnderWay(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		const every = 10 * time.Second
		f := &fakeLeases{grant: true}
		names := leaseNames(nil)
		e := startElector(context.Background(), f, names, uuid.New(), 3*every, every, 0, slog.New(slog.DiscardHandler), nil)
		require.True(t, e.holds(leaseInstances))
		f.hang.Store(true)
		time.Sleep(every + time.Millisecond) // the second attempt is under way, for up to every
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		defer cancel()
		start := time.Now()
		e.stop(ctx)
		require.Equal(t, 200*time.Millisecond, time.Since(start), "stop returned when its context ended")
		require.False(t, e.holds(leaseInstances))
		f.mu.Lock()
		defer f.mu.Unlock()
		require.Equal(t, [][]string{names}, f.resigned, "resigned all the same")
	})
}

// Without a leaderStore (one instance, a unit test's mock Store) the elector holds every
// lease and fences nothing.
func TestElectorWithoutAStoreHoldsEveryLease(t *testing.T) {
	t.Parallel()
	e := startElector(context.Background(), nil, leaseNames(nil), uuid.New(), time.Second, 100*time.Millisecond, 0, slog.New(slog.DiscardHandler), nil)
	require.True(t, e.holds(leaseInstances))
	require.True(t, e.holds(leasePromotion("any", 3)))
	require.Equal(t, LeaderLease{}, e.fence(leaseInstances))
	e.stop(context.Background())
}
