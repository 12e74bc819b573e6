package worker

import (
	"cmp"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
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
// events that sort before it, and other pairs go on. Nothing is skipped silently.
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
