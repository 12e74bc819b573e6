package worker

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/google/uuid"

	"github.com/perspectives-go/perspectives/locker"
)

// ErrLockLost is the cause of an operation's cancellation when its stream lock is no longer
// held (a renewal said so, or the lease ran out before a renewal succeeded), and the error
// of a final write that the fencing check refused.
var ErrLockLost = errors.New("stream lock lost")

// keepAlive renews a stream lock every KeepAliveInterval while an operation runs, as a
// service.
type keepAlive struct {
	cancel context.CancelCauseFunc
	svc    service
}

// keepAliveHooks observe renewals (metrics); nil fields are skipped.
type keepAliveHooks struct {
	renewFailed func()
	lost        func(stage string) // "renew": a renewal said lost; "deadline": the lease ran out
}

// leaseMargin is how long before the end of its lease a holder stops trusting it: the
// time a final commit may take, and what the two clocks may drift apart in one lease.
func leaseMargin(opts locker.Options) time.Duration { return opts.LockTimeout / 10 }

// startKeepAlive starts renewing the lock on k for instance every opts.KeepAliveInterval;
// acquired is when the acquire was sent; attrs name the pair in the log. The returned context is cancelled, with cause
// ErrLockLost, as soon as a renewal reports the lock lost, or when LockTimeout less
// leaseMargin has passed since the last successful acquire or renewal was sent (the lease
// may have run out: fencing at commit would refuse the work anyway, so stop doing it). Each
// renewal is bounded by the interval and by that deadline; a failed one is logged and
// retried at the next tick. When the first failure since the last success would leave the
// next tick at or past that deadline (an interval near LockTimeout/2), the retry comes
// halfway to the deadline instead, so that one failed renewal never cancels the operation.
func startKeepAlive(parent context.Context, l locker.Locker, k Pair, instance uuid.UUID, opts locker.Options, acquired time.Time, log *slog.Logger, attrs []any, hooks keepAliveHooks) (context.Context, *keepAlive) {
	ctx, cancel := context.WithCancelCause(parent)
	ka := &keepAlive{cancel: cancel}
	trust := opts.LockTimeout - leaseMargin(opts)
	lost := func(stage, msg string) {
		if hooks.lost != nil {
			hooks.lost(stage)
		}
		log.Warn(msg, attrs...)
		cancel(ErrLockLost)
	}
	_ = ka.svc.Start(ctx) // a fresh service: it starts
	// The renewals run under ctx, the operation's: stop cancels it first.
	ka.svc.Go(func(_, _ context.Context) {
		deadline := acquired.Add(trust)
		expire := time.NewTimer(time.Until(deadline))
		defer expire.Stop()
		tick := time.NewTimer(opts.KeepAliveInterval)
		defer tick.Stop()
		failed := 0 // renewals failed since the last successful one
		for {
			select {
			case <-ctx.Done():
				return
			case <-expire.C:
				lost("deadline", "stream lock lease ran out before a renewal succeeded; cancelling operation")
				return
			case <-tick.C:
			}
			sent := time.Now()
			tick.Reset(opts.KeepAliveInterval)
			bound := sent.Add(opts.KeepAliveInterval)
			if deadline.Before(bound) {
				bound = deadline
			}
			rctx, rcancel := context.WithDeadline(ctx, bound)
			held, err := l.Renew(rctx, k.Stream, k.Perspective, instance)
			rcancel()
			switch {
			case ctx.Err() != nil:
				return
			case err != nil:
				if hooks.renewFailed != nil {
					hooks.renewFailed()
				}
				if !time.Now().Before(deadline) {
					lost("deadline", "stream lock lease ran out before a renewal succeeded; cancelling operation")
					return
				}
				failed++
				if failed == 1 && !sent.Add(opts.KeepAliveInterval).Before(deadline) {
					tick.Reset(time.Until(deadline) / 2)
				}
				log.Warn("stream lock renewal failed; retrying at next tick", append(attrs, slog.Any("error", err))...)
			case !held:
				lost("renew", "stream lock lost; cancelling operation")
				return
			default:
				failed = 0
				deadline = sent.Add(trust)
				expire.Reset(time.Until(deadline))
			}
		}
	})
	return ctx, ka
}

// stop ends the renewals and waits for the renewing goroutine. It never reports an error:
// an operation that committed stays committed whatever a late renewal said.
func (ka *keepAlive) stop() {
	ka.cancel(context.Canceled)           // after a loss, its cause stays (the first cause is kept)
	_ = ka.svc.Stop(context.Background()) // the renewal in progress ends with ctx, at once
}
