package worker

// Read-your-writes: wait until an appended event is in the model LoadModel serves.

import (
	"context"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/perspectives-go/perspectives/db"
	"github.com/perspectives-go/perspectives/internal/pgq"
	"github.com/perspectives-go/perspectives/locker"
)

// WaitFor waits until the event eventID of stream streamID is in the model that LoadModel
// returns for perspectiveName: the model of the perspective's active build, judged afresh
// at every check (a promotion while it waits switches it to the new active build). It
// returns nil once the pair's cursor is at or after the event and the event is not queued
// for the pair (a late event, older than the cursor, counts once its rewind has committed).
//
// It returns an error wrapping ErrParked (a *ParkedError: the failing event, attempts,
// last error, since when) when the pair is parked and the event is not in the model; one
// wrapping ErrSkipped when the event was skipped (it will never be in the model); one
// wrapping locker.ErrInvalidArgument for bad input (a nil stream or event ID, an invalid
// perspective name, a perspective that is not registered, an event that is not stored in
// that stream: call WaitFor after the Append's transaction has committed); or ctx's error
// (bound the wait with a deadline: with no worker running, the event never arrives).
//
// Each check is one statement of a few primary-key lookups. WaitFor checks once at once;
// when the event is not there yet, it takes a connection from the pool for the wait
// (released after), LISTENs there for the notification that the worker's commits send
// (applying events, a rewind, a catch-up page, a promotion, parking or skipping a pair),
// checks again once the subscription is in place, and then at every notification, and
// every second in any case, so that a lost notification costs at most a second. Behind a
// transaction pooler (PgBouncer in transaction mode, detected as the worker's LISTEN is)
// a session cannot LISTEN: WaitFor then polls, every 10 ms at first, doubling to every
// 500 ms, and needs no connection between checks.
func WaitFor(ctx context.Context, pool *pgxpool.Pool, perspectiveName string, streamID, eventID uuid.UUID) error {
	return waitFor(ctx, pool, perspectiveName, streamID, eventID, waitOptions{})
}

// waitOptions are WaitFor's timings; zero fields take the defaults below. Tests change them.
type waitOptions struct {
	recheck  time.Duration        // the safety re-check while listening (default waitRecheck)
	pollMin  time.Duration        // the first poll delay without LISTEN (default waitPollMin)
	pollMax  time.Duration        // the longest poll delay (default waitPollMax)
	pollOnly bool                 // poll even where LISTEN works
	checked  func(listening bool) // called after every check (tests count them)
}

const (
	waitRecheck = time.Second
	waitPollMin = 10 * time.Millisecond
	waitPollMax = 500 * time.Millisecond
)

func waitFor(ctx context.Context, pool *pgxpool.Pool, perspectiveName string, streamID, eventID uuid.UUID, o waitOptions) error {
	if pool == nil {
		return fmt.Errorf("worker: wait for event: %w: pool is nil", locker.ErrInvalidArgument)
	}
	if err := locker.ValidatePair(streamID, perspectiveName); err != nil {
		return fmt.Errorf("worker: wait for event: %w", err)
	}
	if eventID == uuid.Nil {
		return fmt.Errorf("worker: wait for event: %w: event ID is the nil UUID", locker.ErrInvalidArgument)
	}
	if o.recheck <= 0 {
		o.recheck = waitRecheck
	}
	if o.pollMin <= 0 {
		o.pollMin = waitPollMin
	}
	if o.pollMax < o.pollMin {
		o.pollMax = max(waitPollMax, o.pollMin)
	}
	w := &waiter{
		o:   o,
		arg: db.WaitCheckParams{PerspectiveName: perspectiveName, StreamID: streamID, EventID: eventID},
	}
	if done, err := w.check(ctx, pgq.New(pool), false); done {
		return err
	}
	if o.pollOnly {
		return w.poll(ctx, pool)
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return w.fail(ctx, fmt.Errorf("take a connection: %w", err))
	}
	pooled, _, _, err := pgq.Pooled(ctx, conn.Conn())
	if err != nil || pooled {
		conn.Release()
		if err != nil {
			return w.fail(ctx, fmt.Errorf("check for a pooler: %w", err))
		}
		return w.poll(ctx, pool)
	}
	return w.listen(ctx, conn)
}

// waiter is one WaitFor call.
type waiter struct {
	o   waitOptions
	arg db.WaitCheckParams
}

// check judges the event once: done with a nil error when it is in the model, done with an
// error when it never will be (or the check failed), not done while it may still come.
func (w *waiter) check(ctx context.Context, q *db.Queries, listening bool) (bool, error) {
	r, err := q.WaitCheck(ctx, w.arg)
	if w.o.checked != nil {
		w.o.checked(listening)
	}
	if err != nil {
		return true, w.fail(ctx, err)
	}
	a := w.arg
	switch {
	case !r.Registered:
		return true, fmt.Errorf("worker: wait for event: %w: perspective %q is not registered", locker.ErrInvalidArgument, a.PerspectiveName)
	case !r.Stored:
		return true, fmt.Errorf("worker: wait for event: %w: event %s is not stored in stream %s", locker.ErrInvalidArgument, a.EventID, a.StreamID)
	case r.SkippedAt != nil:
		return true, fmt.Errorf("worker: wait for event %s: %w: stream %s, perspective %q version %d: skipped by %s (%s) at %s",
			a.EventID, ErrSkipped, a.StreamID, a.PerspectiveName, r.Version, r.SkippedBy, r.SkippedReason, r.SkippedAt.Format(time.RFC3339))
	case r.Applied:
		return true, nil
	case r.Status == "parked":
		pe := &ParkedError{
			Stream:      a.StreamID,
			Perspective: a.PerspectiveName,
			Version:     int(r.Version),
			Event:       r.FailedEventID.UUID,
			Attempts:    int(r.Attempts),
			LastError:   r.LastError,
		}
		if r.FailedSince != nil {
			pe.Since = *r.FailedSince
		}
		return true, fmt.Errorf("worker: wait for event %s: %w", a.EventID, pe)
	}
	return false, nil
}

// fail is the error of a failed check or wait: ctx's error once ctx is done.
func (w *waiter) fail(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		err = context.Cause(ctx)
	}
	return fmt.Errorf("worker: wait for event %s: %w", w.arg.EventID, err)
}

// listen waits on conn, subscribed to the workers' notification, and gives conn back to
// the pool (unsubscribed) when done.
func (w *waiter) listen(ctx context.Context, conn *pgxpool.Conn) error {
	defer unlisten(conn)
	q := pgq.New(conn)
	if err := q.WaitListen(ctx); err != nil {
		return w.fail(ctx, fmt.Errorf("listen: %w", err))
	}
	for {
		// Every notification received so far is answered by the check that follows.
		drainNotifications(conn)
		if done, err := w.check(ctx, q, true); done {
			return err
		}
		wctx, cancel := context.WithTimeout(ctx, w.o.recheck)
		_, err := conn.Conn().WaitForNotification(wctx)
		timedOut := wctx.Err() != nil
		cancel()
		switch {
		case err == nil: // notified
		case ctx.Err() != nil:
			return w.fail(ctx, err)
		case timedOut: // the safety re-check
		default:
			return w.fail(ctx, fmt.Errorf("wait for a notification: %w", err))
		}
	}
}

// poll checks on the pool with a growing delay, for a pool whose sessions cannot LISTEN.
func (w *waiter) poll(ctx context.Context, pool *pgxpool.Pool) error {
	q := pgq.New(pool)
	t := time.NewTimer(w.o.pollMin)
	defer t.Stop()
	for delay := w.o.pollMin; ; {
		select {
		case <-ctx.Done():
			return w.fail(ctx, ctx.Err())
		case <-t.C:
		}
		if done, err := w.check(ctx, q, false); done {
			return err
		}
		delay = min(2*delay, w.o.pollMax)
		t.Reset(delay)
	}
}

// unlisten ends the subscription of conn and gives it back to its pool; a connection that
// cannot be unsubscribed is closed instead (the pool replaces it).
func unlisten(conn *pgxpool.Conn) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	if err := pgq.New(conn).WaitUnlisten(ctx); err != nil {
		// The wait's outcome is known: the connection is only not reused. Close's error is the
		// socket's, and the pool discards a closed connection on Release whatever it was.
		_ = conn.Conn().Close(ctx)
	}
	drainNotifications(conn) // those received before UNLISTEN took effect
	conn.Release()
}

// drainNotifications discards the notifications conn has received and not yet returned,
// without waiting for more.
func drainNotifications(conn *pgxpool.Conn) {
	done, cancel := context.WithCancel(context.Background())
	cancel()
	for {
		if _, err := conn.Conn().WaitForNotification(done); err != nil {
			return
		}
	}
}
