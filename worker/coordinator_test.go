package worker_test

// The in-process apply coordinator, driven in synctest bubbles so that "blocked" is
// observed deterministically (synctest.Wait) rather than guessed with sleeps.

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/worker"
)

func utClosed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

func TestCoordinatorSerializesOneKey(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c := worker.NewCoordinator()
		stream := utNewID(t)
		ctx := context.Background()

		release1, err := c.Lock(ctx, stream, "p")
		require.NoError(t, err)

		acquired := make(chan struct{})
		var release2 func()
		go func() {
			r, err := c.Lock(ctx, stream, "p")
			assert.NoError(t, err)
			release2 = r
			close(acquired)
		}()
		synctest.Wait()
		assert.False(t, utClosed(acquired), "a second Lock on the same key waits for the first release")
		assert.Equal(t, 1, c.Size())

		release1()
		synctest.Wait()
		require.True(t, utClosed(acquired), "the waiter gets the key once it is released")

		// A second call of an old release must not free the new holder's slot.
		release1()
		third := make(chan struct{})
		go func() {
			r, err := c.Lock(ctx, stream, "p")
			assert.NoError(t, err)
			close(third)
			r()
		}()
		synctest.Wait()
		assert.False(t, utClosed(third), "releasing twice must not let a third holder in")

		release2()
		synctest.Wait()
		assert.True(t, utClosed(third))
		assert.Zero(t, c.Size(), "no entry remains once every holder released")
	})
}

func TestCoordinatorDoesNotSerializeDifferentKeys(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c := worker.NewCoordinator()
		s1, s2 := utNewID(t), utNewID(t)
		ctx := context.Background()

		r1, err := c.Lock(ctx, s1, "p")
		require.NoError(t, err)

		done := make(chan struct{})
		var rs []func()
		go func() {
			defer close(done)
			r2, err := c.Lock(ctx, s2, "p") // other stream, same perspective
			assert.NoError(t, err)
			r3, err := c.Lock(ctx, s1, "q") // same stream, other perspective
			assert.NoError(t, err)
			rs = append(rs, r2, r3)
		}()
		synctest.Wait()
		require.True(t, utClosed(done), "different keys must not wait for each other")
		assert.Equal(t, 3, c.Size())

		r1()
		for _, r := range rs {
			r()
		}
		assert.Zero(t, c.Size())
	})
}

func TestCoordinatorHonoursCancellation(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c := worker.NewCoordinator()
		stream := utNewID(t)

		release, err := c.Lock(context.Background(), stream, "p")
		require.NoError(t, err)

		{ // a waiter whose context is cancelled
			ctx, cancel := context.WithCancel(context.Background())
			errc := make(chan error, 1)
			go func() {
				r, err := c.Lock(ctx, stream, "p")
				if r != nil {
					r()
				}
				errc <- err
			}()
			synctest.Wait()
			assert.Empty(t, errc, "still waiting")
			cancel()
			synctest.Wait()
			require.Len(t, errc, 1)
			assert.ErrorIs(t, <-errc, context.Canceled)
			assert.Equal(t, 1, c.Size(), "the cancelled waiter leaves no reference behind")
		}
		{ // a waiter whose deadline passes
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			start := time.Now()
			_, err := c.Lock(ctx, stream, "p")
			assert.ErrorIs(t, err, context.DeadlineExceeded)
			assert.Equal(t, 5*time.Second, time.Since(start))
			assert.Equal(t, 1, c.Size())
		}

		release()
		assert.Zero(t, c.Size(), "no entry leaks after a cancelled waiter and the release")

		// The key is usable again.
		r, err := c.Lock(context.Background(), stream, "p")
		require.NoError(t, err)
		r()
		assert.Zero(t, c.Size())
	})
}

func TestCoordinatorMutualExclusionUnderContention(t *testing.T) {
	c := worker.NewCoordinator()
	stream := utNewID(t)
	var inside, maxInside, total atomic.Int64
	var wg sync.WaitGroup
	for range 32 {
		wg.Go(func() {
			for range 50 {
				r, err := c.Lock(context.Background(), stream, "p")
				if !assert.NoError(t, err) {
					return
				}
				n := inside.Add(1)
				for {
					m := maxInside.Load()
					if n <= m || maxInside.CompareAndSwap(m, n) {
						break
					}
				}
				total.Add(1)
				inside.Add(-1)
				r()
			}
		})
	}
	wg.Wait()
	assert.Equal(t, int64(1), maxInside.Load(), "never two holders of one key at once")
	assert.Equal(t, int64(32*50), total.Load())
	assert.Zero(t, c.Size(), "no entry leaks")
}

// TryLock takes a free pair at once and refuses a held one without waiting or leaving an
// entry behind; it and Lock exclude each other.
func TestCoordinatorTryLock(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c := worker.NewCoordinator()
		s := utNewID(t)

		release, ok := c.TryLock(s, "p")
		require.True(t, ok, "a free pair is taken")
		_, again := c.TryLock(s, "p")
		assert.False(t, again, "a held pair is refused")
		assert.Equal(t, 1, c.Size(), "the refusal leaves no reference behind")
		other, ok := c.TryLock(utNewID(t), "p")
		require.True(t, ok, "another pair is free")
		other()

		got := make(chan struct{})
		go func() {
			rel, err := c.Lock(context.Background(), s, "p")
			if err == nil {
				close(got)
				rel()
			}
		}()
		synctest.Wait()
		assert.False(t, utClosed(got), "Lock waits for the TryLock holder")
		release()
		synctest.Wait()
		assert.True(t, utClosed(got), "and takes the pair once it is released")
		release() // idempotent
		assert.Zero(t, c.Size())

		rel, ok := c.TryLock(s, "p")
		require.True(t, ok, "free again")
		rel()
		assert.Zero(t, c.Size())
	})
}
