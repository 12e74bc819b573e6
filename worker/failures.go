package worker

// Failures: a pair's failure recorded on its due row and cursor, as its failure policy says
// (retry with backoff, park, skip: queries/failures.sql).

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/perspectives-go/perspectives/db"
)

// DefaultFailureAttempts is how many times a failing (stream, perspective) is tried, with
// backoff, before its failure policy acts: with the default backoff (1s doubling) it is
// parked about two minutes after its first failure.
const DefaultFailureAttempts = 8

// MaxFailureAttempts bounds FailurePolicy.Attempts.
const MaxFailureAttempts = 1000

// FailurePolicy says what happens to a (stream, perspective) whose processing keeps
// failing (a poison event). Every failure is retried with backoff (Config.RetryBackoff);
// when the pair has failed Attempts times in a row the policy acts:
//
//   - park (the default): the pair stops, its failing event and every later one stay
//     queued (new events keep queueing behind them), and it waits for an operator:
//     perspectives failed lists it, perspectives retry tries it again at once, perspectives
//     skip skips the event (Admin.Failed, Admin.Retry, Admin.Skip);
//   - skip: the failing event is recorded in wh_skipped_events (with the error and the
//     instance that skipped it) and the pair goes on with the events after it. A failure
//     that is not one event's (the database refused the write) parks the pair instead.
//
// Either way the events before the failing one are applied and committed, including late
// events that sort before it, and other pairs go on. Nothing is skipped silently. A stream
// lock lost during an operation (forced free, or its lease lapsed) is no failure of the
// pair's: it is recorded and retried with backoff, but never counts towards the policy.
type FailurePolicy struct {
	// Attempts is how many failures in a row the policy waits for: default 8, at most
	// 1000; 1 acts at the first failure.
	Attempts int
	// Skip skips the failing event instead of parking the pair. Default false.
	Skip bool
}

func (p FailurePolicy) withDefaults() FailurePolicy {
	p.Attempts = cmp.Or(p.Attempts, DefaultFailureAttempts)
	return p
}

// problem says what is wrong with p, its defaults filled in ("": nothing), beginning with
// the field's name.
func (p FailurePolicy) problem() string {
	if p.Attempts < 1 || p.Attempts > MaxFailureAttempts {
		return fmt.Sprintf("Attempts must be between 1 and %d, got %d", MaxFailureAttempts, p.Attempts)
	}
	return ""
}

// failuresOf is how many times event (uuid.Nil: a failure that is not one event's) has
// failed in a row so far, given the failure a pair has recorded: its event and count. A
// count is of one event: another event's failure starts a new one (as PairsMarkFailed
// counts).
func failuresOf(event, recorded uuid.UUID, attempts int) int {
	if event == recorded {
		return attempts
	}
	return 0
}

// action is what a failure of event (uuid.Nil: not one event's) does to a pair that had
// failed before times in a row before it.
func (p FailurePolicy) action(before int, event uuid.UUID) FailureAction {
	switch {
	case before+1 < p.Attempts:
		return FailureRetry
	case p.Skip && event != uuid.Nil:
		return FailureSkip
	}
	return FailurePark
}

// policy is the failure policy of the perspective named name.
func (w *Worker) policy(name string) FailurePolicy {
	if p, ok := w.cfg.FailurePolicies[name]; ok {
		return p
	}
	return w.cfg.FailurePolicy
}

// ErrParked is wrapped by the error of an operation that waits for a pair that is parked
// (WaitFor): a ParkedError says which event and why.
var ErrParked = errors.New("pair is parked after repeated failures")

// ErrSkipped is wrapped by WaitFor's error when the event it waits for was skipped: it will
// never be in the model.
var ErrSkipped = errors.New("event was skipped")

// ParkedError is a parked pair as the error of an operation that needed it to go on.
type ParkedError struct {
	Stream      uuid.UUID
	Perspective string // the perspective's name
	Version     int
	Event       uuid.UUID // the failing event (uuid.Nil: the failure was not one event's)
	Attempts    int
	LastError   string
	Since       time.Time // when its failures began
}

func (e *ParkedError) Error() string {
	ev := "its failure"
	if e.Event != uuid.Nil {
		ev = "event " + e.Event.String()
	}
	return fmt.Sprintf("stream %s, perspective %q version %d: %s failed %d times (%s); parked, waiting for perspectives retry or skip",
		e.Stream, e.Perspective, e.Version, ev, e.Attempts, e.LastError)
}

func (e *ParkedError) Unwrap() error { return ErrParked }

// eventError is a failure of one event's Apply: the pair's failing event.
type eventError struct {
	event uuid.UUID
	err   error
}

func (e eventError) Error() string { return e.err.Error() }
func (e eventError) Unwrap() error { return e.err }

// failedEvent is the event an error is the failure of (uuid.Nil: not one event's).
func failedEvent(err error) uuid.UUID {
	var ee eventError
	if errors.As(err, &ee) {
		return ee.event
	}
	return uuid.Nil
}

// addFailure adds f, a failure of p, to arg.
func addFailure(arg *db.PairsMarkFailedParams, p Pair, f Failure) {
	arg.StreamIds = append(arg.StreamIds, p.Stream)
	arg.PerspectiveNames = append(arg.PerspectiveNames, p.Perspective)
	arg.Errors = append(arg.Errors, f.Cause)
	arg.EventIds = append(arg.EventIds, f.Event)
	arg.Actions = append(arg.Actions, string(cmp.Or(f.Action, FailureRetry)))
}

// markFailed records the failures of arg with the store's backoff.
func (s *pgStore) markFailed(ctx context.Context, q *db.Queries, arg db.PairsMarkFailedParams) error {
	arg.BaseSeconds, arg.MaxSeconds = s.retryBase.Seconds(), s.retryMax.Seconds()
	arg.SkippedBy = cmp.Or(s.skippedBy, "worker")
	if _, err := q.PairsMarkFailed(ctx, arg); err != nil {
		return fmt.Errorf("record failure: %w", err)
	}
	return nil
}

// failure is err, a failure of the pair st of b, to record, with what b's failure policy
// makes of it.
func (w *Worker) failure(b *build, st PairState, err error) Failure {
	ev := failedEvent(err)
	before := failuresOf(ev, st.FailedEvent, st.Failures)
	return Failure{Cause: failureText(err), Event: ev, Action: w.policy(b.Perspective).action(before, ev)}
}

// fail records a failed operation on the pair (retried with backoff), unless it is a
// shutdown, a race that another writer won or a database that could not be reached (the
// next claim retries those at once, and r notes the last: see job.cutOffFails).
func (w *Worker) fail(ctx context.Context, k Pair, cause error, r *jobResult) {
	attrs := w.logPair(k, slog.Any("error", cause))
	if ctx.Err() != nil {
		w.log.Info("operation interrupted by shutdown", attrs...)
		return
	}
	if errors.Is(cause, ErrCursorMoved) {
		w.log.Warn("operation refused at commit; will retry", attrs...)
		return
	}
	if isConnectionError(cause) && !r.job.cutOffFails[k] {
		// Nothing about the pair: it stays queued and is claimed again once the database
		// answers (a restart, a failover), without the backoff meant for failing perspectives.
		w.log.Warn("database unavailable; the pair stays queued and is retried at the next claim", attrs...)
		r.cutOff = append(r.cutOff, k)
		return
	}
	w.tel.applyErrors.Add(context.WithoutCancel(ctx), 1, w.metricPair(k))
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), releaseTimeout)
	defer cancel()
	f := Failure{Cause: failureText(cause), Event: failedEvent(cause)}
	policy := w.policy(w.buildOf(k.Perspective).Perspective) // a build retired meanwhile: the default
	decide := func(before int) FailureAction { return policy.action(before, f.Event) }
	if errors.Is(cause, ErrLockLost) {
		decide = func(int) FailureAction { return failureLost } // see FailurePolicy
	}
	action, err := w.store.MarkFailed(rctx, k, f, decide)
	if err != nil {
		// The pair backs off in the loop (its rows stay due): said once for the spell.
		r.unrecorded = append(r.unrecorded, k)
		level := slog.LevelError
		if r.job.unrecorded[k] > 0 {
			level = slog.LevelDebug
		}
		w.log.Log(rctx, level, "recording failure failed; the pair is retried with backoff",
			append(attrs, slog.Any("record_error", err))...)
		return
	}
	w.logFailure(k, action, cause)
}

// logFailure logs a recorded failure of k, saying what it did to the pair.
func (w *Worker) logFailure(k Pair, action FailureAction, cause error, attrs ...any) {
	if ev := failedEvent(cause); ev != uuid.Nil {
		attrs = append(attrs, slog.String("event_id", ev.String()))
	}
	attrs = w.logPair(k, append(attrs, slog.Any("error", cause))...)
	switch {
	case action == FailurePark:
		w.log.Error("pair parked after repeated failures: its failing event and the ones after it wait for perspectives retry or skip", attrs...)
	case action == FailureSkip:
		w.log.Error("event skipped after repeated failures, as the perspective's failure policy says (recorded in wh_skipped_events); the pair goes on", attrs...)
	case errors.Is(cause, ErrLockLost):
		w.log.Warn("stream lock lost: the operation's work was refused; will retry with backoff", attrs...)
	case failedEvent(cause) != uuid.Nil:
		w.log.Error("event application failed; will retry with backoff", attrs...)
	default:
		w.log.Error("processing failed; will retry with backoff", attrs...)
	}
}

// failureText is the error recorded on a failed pair (its column has no length limit; a
// bound keeps one poison event from writing megabytes per attempt).
func failureText(err error) string {
	s := err.Error()
	if len(s) > 2000 {
		s = s[:2000]
	}
	return s
}

// Failure is a failed operation on a pair, to record on it.
type Failure struct {
	Cause  string        // the error, as recorded (empty: no failure)
	Event  uuid.UUID     // the event whose Apply failed (uuid.Nil: not one event's failure)
	Action FailureAction // what it does to the pair (Store.MarkFailed: its decide says)
}

// FailureAction is what a recorded failure does to its pair: the pair's failure policy
// decides it from the failures in a row so far.
type FailureAction string

// The failure actions.
const (
	FailureRetry FailureAction = "retry" // retried after the backoff
	FailurePark  FailureAction = "park"  // parked: waits for an operator (retry or skip)
	FailureSkip  FailureAction = "skip"  // Failure.Event is skipped (recorded); the pair goes on

	// failureLost: the operation's stream lock was lost, no failure of the pair's: recorded
	// and retried after the backoff of the pair's failures so far, without counting as one.
	failureLost FailureAction = "lost"
)

func (s *pgStore) MarkFailed(ctx context.Context, p Pair, f Failure, decide func(failures int) FailureAction) (FailureAction, error) {
	err := s.inTx(ctx, func(_ pgx.Tx, q *db.Queries) error {
		if _, err := q.CursorsEnsure(ctx, db.CursorsEnsureParams{StreamIds: []uuid.UUID{p.Stream}, PerspectiveNames: []string{p.Perspective}}); err != nil {
			return fmt.Errorf("create cursor: %w", err)
		}
		cur, err := q.CursorFailuresLock(ctx, db.CursorFailuresLockParams{StreamID: p.Stream, PerspectiveName: p.Perspective})
		if err != nil {
			return fmt.Errorf("lock cursor: %w", cursorGone(err))
		}
		f.Action = decide(failuresOf(f.Event, cur.FailedEventID.UUID, int(cur.Attempts)))
		var arg db.PairsMarkFailedParams
		addFailure(&arg, p, f)
		return s.markFailed(ctx, q, arg)
	})
	if err != nil {
		return "", err
	}
	return f.Action, nil
}

// FailureStore is what recording a failure asks of the database.
type FailureStore interface {
	// MarkFailed records a failure of the pair in one transaction: under its cursor row lock
	// it passes the pair's failures of f.Event so far to decide, which returns what it does
	// (retry with backoff, park, skip f.Event: see FailureAction), and writes f with that
	// action. It returns the action written.
	MarkFailed(ctx context.Context, p Pair, f Failure, decide func(failures int) FailureAction) (FailureAction, error)
}
