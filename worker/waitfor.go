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
// Each check is one statement of a few primary-key lookups, on a pool connection taken for
// it and given back at once. WaitFor checks once at once; when the event is not there yet,
// it subscribes to the notification that the worker's commits send (applying events, a
// rewind, a catch-up page, a promotion, parking or skipping a pair) on the process's
// notifier for the pool, the one LISTEN session that the worker's loop and every WaitFor on
// that pool share (a worker's Config.ListenConnect gives it, else it is a connection of its
// own: never a pool connection, so that a waiting WaitFor holds none). It checks again once
// the subscription is in place, then at every notification, and every second in any case,
// so that a lost notification costs at most a second. Behind a transaction pooler (PgBouncer
// in transaction mode, detected as the worker's LISTEN is) with no worker's ListenConnect in
// the process, a session cannot LISTEN: WaitFor then polls, every 10 ms at first, doubling
// to every 500 ms.
//
// It returns once ctx ends, except that a WaitFor that was the notifier's last subscriber
// stops the notifier before it returns: when the notifier was opening its session at that
// moment (the database slow to answer or unreachable), up to 3 seconds more.
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
	q := pgq.New(pool)
	if done, err := w.check(ctx, q, false); done {
		return err
	}
	if o.pollOnly {
		return w.poll(ctx, pool)
	}
	return w.listen(ctx, pool)
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

// listen waits on the pool's notifier, subscribed to the workers' notification, checking
// on the pool at each notification and every recheck; it polls when the notifier cannot
// LISTEN.
func (w *waiter) listen(ctx context.Context, pool *pgxpool.Pool) error {
	sub := subscribe(pool, topicApplied)
	defer sub.close()
	q := pgq.New(pool)
	t := time.NewTimer(w.o.recheck)
	defer t.Stop()
	var session uint64
	for {
		select {
		case <-ctx.Done():
			return w.fail(ctx, ctx.Err())
		case <-sub.c:
			nt := sub.take()
			if nt.polling {
				sub.close()
				return w.poll(ctx, pool)
			}
			var due bool
			if due, session = checkDue(nt, session); !due {
				continue // the re-check timer runs
			}
		case <-t.C:
		}
		if done, err := w.check(ctx, q, session != 0); done {
			return err
		}
		t.Reset(w.o.recheck)
	}
}

// checkDue says whether a subscription's notice calls for a check, given the session that
// served the subscription so far, and returns the session that serves it now (0: none). A
// notification calls for one even when the session was lost since it came; a session that
// newly serves the subscription calls for one too (what was sent before it subscribed is
// answered so).
func checkDue(nt notice, session uint64) (bool, uint64) {
	return nt.notified || (nt.session != 0 && nt.session != session), nt.session
}

// poll checks on the pool with a growing delay, for a pool whose sessions cannot LISTEN.
func (w *waiter) poll(ctx context.Context, pool *pgxpool.Pool) error {
	q := pgq.New(pool)
	delay := backoff{first: w.o.pollMin, max: w.o.pollMax} // each check that finds nothing doubles it
	t := time.NewTimer(delay.fail(time.Now()))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return w.fail(ctx, ctx.Err())
		case <-t.C:
		}
		if done, err := w.check(ctx, q, false); done {
			return err
		}
		t.Reset(delay.fail(time.Now()))
	}
}
