package worker_test

// Keepalive timing, on the fake clock of testing/synctest: no real sleeps.

import (
	"context"
	"errors"
	"sync"
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

const kaInterval = 10 * time.Second

// kaOptions is a 60s lease renewed every 10s: several renewals may fail before the local
// deadline (54s after the last successful one was sent) cancels the operation.
var kaOptions = locker.Options{LockTimeout: 60 * time.Second, KeepAliveInterval: kaInterval}

type kaFixture struct {
	stream, instance uuid.UUID
	locker           *mocks.LockerMock
	logs             *utLogBuf
}

// newKAFixture builds a LockerMock whose Renew answers with renew(call number, from 1).
func newKAFixture(t *testing.T, renew func(call int) (bool, error)) *kaFixture {
	f := &kaFixture{stream: utNewID(t), instance: utNewID(t), logs: &utLogBuf{}}
	var mu sync.Mutex
	calls := 0
	f.locker = &mocks.LockerMock{
		RenewFunc: func(ctx context.Context, stream uuid.UUID, name string, inst uuid.UUID) (bool, error) {
			mu.Lock()
			calls++
			n := calls
			mu.Unlock()
			return renew(n)
		},
	}
	return f
}

func (f *kaFixture) start(ctx context.Context) (context.Context, *worker.KeepAlive) {
	return f.startWith(ctx, kaOptions)
}

func (f *kaFixture) startWith(ctx context.Context, opts locker.Options) (context.Context, *worker.KeepAlive) {
	return worker.StartKeepAlive(ctx, f.locker, f.stream, utName, f.instance, opts, time.Now(), utLogger(f.logs))
}

func TestKeepAliveRenewsEveryIntervalUntilStopped(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newKAFixture(t, func(int) (bool, error) { return true, nil })
		ctx, ka := f.start(context.Background())

		time.Sleep(9 * time.Second)
		synctest.Wait()
		assert.Empty(t, f.locker.RenewCalls(), "the first renewal is one interval after the start")

		time.Sleep(26 * time.Second) // t = 35s
		synctest.Wait()
		calls := f.locker.RenewCalls()
		require.Len(t, calls, 3, "renewals at 10s, 20s and 30s")
		for _, c := range calls {
			assert.Equal(t, f.stream, c.StreamID)
			assert.Equal(t, utName, c.PerspectiveName)
			assert.Equal(t, f.instance, c.InstanceID)
		}
		assert.NoError(t, ctx.Err(), "a held lock does not cancel the operation")

		ka.Stop()
		time.Sleep(30 * time.Second)
		synctest.Wait()
		assert.Len(t, f.locker.RenewCalls(), 3, "no renewal after Stop")
		ka.Stop() // idempotent
	})
}

func TestKeepAliveRetriesRenewErrorAtNextTick(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newKAFixture(t, func(n int) (bool, error) {
			if n <= 2 {
				return false, errors.New("database unreachable") // held is meaningless with an error
			}
			return true, nil
		})
		ctx, ka := f.start(context.Background())
		defer ka.Stop()

		time.Sleep(25 * time.Second)
		synctest.Wait()
		assert.Len(t, f.locker.RenewCalls(), 2)
		assert.NoError(t, ctx.Err(), "a renew error does not cancel the operation")
		assert.Contains(t, f.logs.String(), "database unreachable", "the renew error is logged")

		time.Sleep(20 * time.Second) // t = 45s
		synctest.Wait()
		assert.Len(t, f.locker.RenewCalls(), 4, "renewals keep coming after errors")
		assert.NoError(t, ctx.Err())
	})
}

func TestKeepAliveLostLockCancelsAtOnce(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newKAFixture(t, func(int) (bool, error) { return false, nil })
		ctx, ka := f.start(context.Background())

		time.Sleep(kaInterval)
		synctest.Wait()
		require.Error(t, ctx.Err(), "the context is cancelled as soon as a renewal reports the lock lost")
		assert.ErrorIs(t, context.Cause(ctx), worker.ErrLockLost)
		assert.Len(t, f.locker.RenewCalls(), 1)

		time.Sleep(3 * kaInterval)
		synctest.Wait()
		assert.Len(t, f.locker.RenewCalls(), 1, "no renewal after the lock is lost")

		ka.Stop() // must not block, and must not change the cause
		assert.ErrorIs(t, context.Cause(ctx), worker.ErrLockLost)
	})
}

func TestKeepAliveEndsWithParentContext(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newKAFixture(t, func(int) (bool, error) { return true, nil })
		parent, cancel := context.WithCancel(context.Background())
		ctx, ka := f.start(parent)

		time.Sleep(15 * time.Second)
		cancel()
		synctest.Wait()
		require.ErrorIs(t, ctx.Err(), context.Canceled)
		assert.NotErrorIs(t, context.Cause(ctx), worker.ErrLockLost, "a shutdown is not a lost lock")

		time.Sleep(3 * kaInterval)
		synctest.Wait()
		assert.Len(t, f.locker.RenewCalls(), 1, "no renewal after the parent ended")
		ka.Stop()
	})
}

func TestKeepAliveLeaseDeadlineCancelsWhenRenewalsKeepFailing(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newKAFixture(t, func(int) (bool, error) { return false, errors.New("network partition") })
		opts := locker.Options{LockTimeout: 30 * time.Second, KeepAliveInterval: kaInterval}
		trust := 30*time.Second - worker.LeaseMargin(opts)
		require.Equal(t, 27*time.Second, trust, "the margin is a tenth of the lease")
		ctx, ka := f.startWith(context.Background(), opts)
		defer ka.Stop()

		time.Sleep(trust - time.Millisecond)
		synctest.Wait()
		require.NoError(t, ctx.Err(), "the lease is trusted until LockTimeout less the margin")
		assert.Len(t, f.locker.RenewCalls(), 2, "renewals at 10s and 20s failed")

		time.Sleep(time.Millisecond)
		synctest.Wait()
		require.Error(t, ctx.Err(), "the operation is cancelled once the lease may have run out")
		assert.ErrorIs(t, context.Cause(ctx), worker.ErrLockLost)
		assert.Contains(t, f.logs.String(), "lease ran out")
	})
}

// With an interval near LockTimeout/2 (valid options: 14s against 30s), the tick after a
// failed renewal would come after the local deadline (27s): the retry comes halfway to it
// instead, and one failed renewal does not cancel the operation. A second failure in a row
// is retried at the next tick, as every other failure is.
func TestKeepAliveRetriesOneFailedRenewalBeforeTheDeadline(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newKAFixture(t, func(n int) (bool, error) {
			if n == 1 {
				return false, errors.New("network blip")
			}
			return true, nil
		})
		opts := locker.Options{LockTimeout: 30 * time.Second, KeepAliveInterval: 14 * time.Second}
		require.NoError(t, opts.Validate())
		ctx, ka := f.startWith(context.Background(), opts)
		defer ka.Stop()

		time.Sleep(14 * time.Second)
		synctest.Wait()
		require.Len(t, f.locker.RenewCalls(), 1, "the renewal at 14s failed")
		time.Sleep(13*time.Second/2 - time.Millisecond)
		synctest.Wait()
		require.Len(t, f.locker.RenewCalls(), 1, "no retry before halfway to the deadline")
		time.Sleep(time.Millisecond)
		synctest.Wait()
		require.Len(t, f.locker.RenewCalls(), 2, "retried at 20.5s, halfway from 14s to 27s")
		time.Sleep(40 * time.Second)
		synctest.Wait()
		require.NoError(t, ctx.Err(), "one failed renewal does not cancel the operation")
		require.Len(t, f.locker.RenewCalls(), 4, "renewals every 14s from the retry: 34.5s and 48.5s")
	})
}

func TestKeepAliveBoundsEachRenewal(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := &kaFixture{stream: utNewID(t), instance: utNewID(t), logs: &utLogBuf{}}
		var mu sync.Mutex
		var bounds []time.Duration
		f.locker = &mocks.LockerMock{
			RenewFunc: func(ctx context.Context, stream uuid.UUID, name string, inst uuid.UUID) (bool, error) {
				dl, ok := ctx.Deadline()
				require.True(t, ok, "every renewal has a deadline")
				mu.Lock()
				bounds = append(bounds, time.Until(dl))
				mu.Unlock()
				<-ctx.Done() // a renewal that hangs (a partitioned database)
				return false, ctx.Err()
			},
		}
		opts := locker.Options{LockTimeout: 30 * time.Second, KeepAliveInterval: kaInterval}
		ctx, ka := f.startWith(context.Background(), opts)
		defer ka.Stop()

		time.Sleep(time.Hour)
		synctest.Wait()
		require.ErrorIs(t, context.Cause(ctx), worker.ErrLockLost, "hanging renewals do not keep the operation alive")
		mu.Lock()
		defer mu.Unlock()
		require.Len(t, bounds, 2, "renewals at 10s and 20s; the lease's deadline at 27s ends the second")
		assert.Equal(t, kaInterval, bounds[0], "a renewal is bounded by the interval")
		assert.Equal(t, 7*time.Second, bounds[1], "and by the lease's deadline")
	})
}

func TestKeepAliveSuccessfulRenewalMovesTheDeadline(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		// Renewals succeed at 10s and 20s, then fail: the deadline is 20s + 27s = 47s.
		f := newKAFixture(t, func(n int) (bool, error) {
			if n <= 2 {
				return true, nil
			}
			return false, errors.New("database unreachable")
		})
		ctx, ka := f.startWith(context.Background(), locker.Options{LockTimeout: 30 * time.Second, KeepAliveInterval: kaInterval})
		defer ka.Stop()

		time.Sleep(47*time.Second - time.Millisecond)
		synctest.Wait()
		require.NoError(t, ctx.Err(), "trusted until 27s after the last successful renewal was sent")
		time.Sleep(time.Millisecond)
		synctest.Wait()
		assert.ErrorIs(t, context.Cause(ctx), worker.ErrLockLost)
	})
}
