package worker

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/google/uuid"

	"github.com/perspectives-go/perspectives/locker"
)

// lease is a stream lock this instance holds for one operation.
type lease struct {
	w      *Worker
	ctx    context.Context // the operation's context, for the release's metrics
	k      Pair
	reason locker.Reason
	since  time.Time // when the acquire was sent: the lease runs at most LockTimeout from then
	ka     *keepAlive
	once   sync.Once
}

// acquirer is implemented by lockers that report takeovers (locker.Postgres).
type acquirer interface {
	Acquire(ctx context.Context, streamID uuid.UUID, perspectiveName string, instanceID uuid.UUID, reason locker.Reason) (locker.AcquireResult, error)
}

// acquire takes the stream lock on k for reason. It returns nil, with no error, when another
// instance holds it. The caller must call release on the lease it gets.
func (w *Worker) acquire(ctx context.Context, k Pair, reason locker.Reason) (*lease, error) {
	sent := time.Now()
	var res locker.AcquireResult
	var err error
	if a, ok := w.cfg.Locker.(acquirer); ok {
		res, err = a.Acquire(ctx, k.Stream, k.Perspective, w.cfg.InstanceID, reason)
	} else {
		res.Acquired, err = w.cfg.Locker.TryAcquire(ctx, k.Stream, k.Perspective, w.cfg.InstanceID, reason)
	}
	if err != nil {
		if cutOff(ctx, err) {
			// The acquire may have committed as the connection went, or as its context ended
			// (a caller's deadline): its lock, if any, is released rather than left to pause
			// the pair until it lapses (see lease.release for why that is safe).
			if rerr := w.releaseLock(ctx, k); rerr != nil {
				w.log.Warn("stream lock acquire cut off, and its release failed; a lock it took will expire",
					w.logPair(k, slog.Any("error", rerr))...)
			}
		}
		return nil, err
	}
	attrs := w.metricPair(k, attrReason.String(string(reason)))
	if !res.Acquired {
		w.tel.lockContended.Add(ctx, 1, attrs)
		return nil, nil
	}
	w.tel.lockAcquired.Add(ctx, 1, attrs)
	if res.TookOver {
		w.tel.lockTakeovers.Add(ctx, 1, attrs)
		w.log.Info("took over an expired stream lock", w.logPair(k, slog.String("reason", string(reason)))...)
	}
	return &lease{w: w, ctx: ctx, k: k, reason: reason, since: sent}, nil
}

// keepAlive renews the lease while the operation runs, and returns the operation's context:
// cancelled with cause ErrLockLost when a renewal reports the lock lost, or when the lease
// may have run out (see startKeepAlive). release stops it.
func (l *lease) keepAlive(ctx context.Context) context.Context {
	w := l.w
	set := w.metricPair(l.k, attrReason.String(string(l.reason)))
	lctx, ka := startKeepAlive(ctx, w.cfg.Locker, l.k, w.cfg.InstanceID, w.cfg.LockOptions, l.since, w.log, w.logPair(l.k), keepAliveHooks{
		renewFailed: func() { w.tel.lockRenewFailures.Add(context.WithoutCancel(ctx), 1, set) },
		lost: func(stage string) {
			w.tel.lockLost.Add(context.WithoutCancel(ctx), 1, w.metricPair(l.k, attrReason.String(string(l.reason)), attrStage.String(stage)))
		},
	})
	l.ka = ka
	return lctx
}

// release stops the keepalive and releases the lock with a fresh short context, so that it
// happens even when the operation's context was cancelled (shutdown, lost lock). A release
// that a lost connection fails (a restart, a failover) is sent again every
// reconnectInterval within that context's releaseTimeout, so that another instance need not
// wait for the lock to lapse. The operation still holds the pair here meanwhile (its
// coordinator lock and claim), so no other operation of this instance can hold the lock;
// another instance's lock is never released (Release is fenced by the holder). It is
// idempotent.
func (l *lease) release() {
	l.once.Do(func() {
		w := l.w
		if l.ka != nil {
			l.ka.stop()
		}
		mctx := context.WithoutCancel(l.ctx)
		attrs := w.metricPair(l.k, attrReason.String(string(l.reason)))
		if err := w.releaseLock(mctx, l.k); err != nil {
			w.log.Warn("stream lock release failed; it will expire", w.logPair(l.k, slog.Any("error", err))...)
		} else {
			w.tel.lockReleased.Add(mctx, 1, attrs)
		}
		w.tel.lockHold.Record(mctx, time.Since(l.since).Seconds(), attrs)
	})
}

// releaseLock releases this instance's stream lock on k under a fresh context bounded by
// releaseTimeout, sent again every reconnectInterval while a lost connection fails it.
func (w *Worker) releaseLock(ctx context.Context, k Pair) error {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), releaseTimeout)
	defer cancel()
	err := w.cfg.Locker.Release(rctx, k.Stream, k.Perspective, w.cfg.InstanceID)
	for err != nil && isConnectionError(err) && sleepCtx(rctx, reconnectInterval) {
		err = w.cfg.Locker.Release(rctx, k.Stream, k.Perspective, w.cfg.InstanceID)
	}
	return err
}

// sleepCtx waits d and reports true, unless ctx ends first, or ends by then (its deadline
// is no later than d from now): false, at once in that case.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	if dl, ok := ctx.Deadline(); ok && time.Until(dl) <= d {
		return false
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
