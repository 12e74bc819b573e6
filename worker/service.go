package worker

import (
	"context"
	"errors"
	"fmt"
	"sync"
)

// service is the lifecycle of one background service (the notifier, a heartbeat, the leader
// elector, a stream lock's keepalive, the catch-up read-aheads): Start, then goroutines run
// with Go, then Stop ends them and waits for every one. No goroutine of a service outlives
// its Stop.
//
// Each goroutine gets two contexts: stopping, cancelled as soon as Stop is called (a
// graceful stop: start nothing new, let the statement under way finish), and ctx, cancelled
// when Stop's context ends (a hard stop: cancel what runs); stopping ends with ctx too. A
// service's goroutine runs each statement either under ctx or under a timeout of its own
// (statements that are let finish rather than cancelled: pgx cancels a statement with a
// cancel request, which PgBouncer before 1.21 can exit on), and returns once the statement
// is over. So Stop returns by its context's deadline plus at most one such bounded
// statement.
//
// The zero value is ready to Start. A service is started once; it cannot be started again
// after Stop.
type service struct {
	mu       sync.Mutex
	started  bool
	stopped  bool
	ctx      context.Context    // the goroutines' context (hard stop: cancelled)
	cancel   context.CancelFunc // cancels ctx
	stopping context.Context    // cancelled by Stop at once (graceful stop)
	stop     context.CancelFunc // cancels stopping
	wg       sync.WaitGroup
	done     chan struct{} // closed once Stop has seen every goroutine end
}

// errServiceStopped is Start's error on a service that was stopped.
var errServiceStopped = errors.New("service was stopped")

// Start makes the service ready for Go. Its goroutines are not tied to ctx's cancellation
// (Stop ends them); they keep ctx's values.
func (s *service) Start(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.stopped:
		return errServiceStopped
	case s.started:
		return errors.New("service already started")
	}
	s.ctx, s.cancel = context.WithCancel(context.WithoutCancel(ctx))
	s.stopping, s.stop = context.WithCancel(s.ctx)
	s.done = make(chan struct{})
	s.started = true
	return nil
}

// Go runs fn in a goroutine of the service, with the service's two contexts (see
// service). It reports false, and runs nothing, when the service is not started or Stop has
// been called.
func (s *service) Go(fn func(ctx, stopping context.Context)) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.started || s.stopped {
		return false
	}
	s.wg.Add(1)
	ctx, stopping := s.ctx, s.stopping
	go func() {
		defer s.wg.Done()
		fn(ctx, stopping)
	}()
	return true
}

// Stop cancels stopping at once, waits for the service's goroutines to end and, when ctx
// ends first, cancels their context and waits for them still: it returns by ctx's deadline
// plus at most one bounded statement (see service). It returns ctx's error when ctx ended
// before the goroutines did. It is idempotent, and safe on a service never started.
func (s *service) Stop(ctx context.Context) error {
	s.mu.Lock()
	if !s.started {
		s.stopped = true
		s.mu.Unlock()
		return nil
	}
	first := !s.stopped
	s.stopped = true
	done := s.done
	if first {
		s.stop()
	}
	s.mu.Unlock()
	if first {
		// No Go adds to wg once stopped is set (both under mu).
		go func() { s.wg.Wait(); close(done) }()
	}
	select {
	case <-done:
		s.cancel()
		return nil
	case <-ctx.Done():
		s.cancel()
		<-done
		return fmt.Errorf("stop: %w", ctx.Err())
	}
}
