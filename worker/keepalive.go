package worker

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"time"

	"github.com/google/uuid"

	"github.com/perspectives-go/perspectives/locker"
)

// ErrLockLost is the cause of an operation's cancellation when a renewal reports that the
// stream lock is no longer held; its final write is then refused.
var ErrLockLost = errors.New("stream lock lost")

// keepAlive renews a stream lock every interval while an operation runs.
type keepAlive struct {
	cancel context.CancelCauseFunc
	done   chan struct{}
	once   sync.Once
}

// keepAliveHooks observe renewals (metrics); nil fields are skipped.
type keepAliveHooks struct {
	renewFailed func()
	lost        func()
}

// startKeepAlive starts renewing the lock on k for instance every interval. The returned
// context is cancelled, with cause ErrLockLost, as soon as a renewal reports the lock lost;
// a renewal error is logged and retried at the next tick.
func startKeepAlive(parent context.Context, l locker.Locker, k pairKey, instance uuid.UUID, interval time.Duration, log *slog.Logger, hooks keepAliveHooks) (context.Context, *keepAlive) {
	ctx, cancel := context.WithCancelCause(parent)
	ka := &keepAlive{cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(ka.done)
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			held, err := l.Renew(ctx, k.Stream, k.Perspective, instance)
			if ctx.Err() != nil {
				return
			}
			if err != nil {
				if hooks.renewFailed != nil {
					hooks.renewFailed()
				}
				log.Warn("stream lock renewal failed; retrying at next tick",
					slog.String("perspective", k.Perspective), slog.String("stream", k.Stream.String()),
					slog.Any("error", err))
				continue
			}
			if !held {
				if hooks.lost != nil {
					hooks.lost()
				}
				log.Warn("stream lock lost; cancelling operation",
					slog.String("perspective", k.Perspective), slog.String("stream", k.Stream.String()))
				cancel(ErrLockLost)
				return
			}
		}
	}()
	return ctx, ka
}

// stop ends the renewals and waits for the renewing goroutine. It never reports an error:
// an operation that committed stays committed whatever a late renewal said.
func (ka *keepAlive) stop() {
	ka.once.Do(func() { ka.cancel(context.Canceled) })
	<-ka.done
}
