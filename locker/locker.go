// Package locker provides stream locks: leases on one pair (a stream and a perspective
// build) that pause live application of the pair's events, on every worker instance, while
// one instance rewinds, bootstraps or purges it.
//
// A lock is kept on the pair's cursor row (wh_perspective_cursors). [Locker.TryAcquire]
// succeeds when the pair is unlocked, its lock has expired, or the caller already holds it;
// [Locker.Renew] extends the lock only while the caller holds it, and reports whether it
// does (a keepalive calls it every [Options.KeepAliveInterval]); [Locker.Release] clears it
// when the caller holds it. Expiry is computed and compared with the database clock only.
//
// An application usually only makes a [Postgres] with [NewPostgres] and gives it to the
// worker (worker.Config.Locker, or fxmodule.WithPostgresLocker), which takes, renews and
// releases the locks itself. [Postgres.Get], [Postgres.List], [Postgres.ListStatus] and
// [Postgres.ForceRelease] are for operators: the command-line tool's perspectives locks and
// the dashboard's Force release use them. [Options] sets how long a lock lasts and how often
// it is renewed. Bad input is refused with an error wrapping [ErrInvalidArgument], and
// invalid options with one wrapping [ErrInvalidOptions], before any SQL runs.
package locker

//go:generate go tool moq -rm -out ../mocks/locker.go -pkg mocks . Locker

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
)

// Reason says why a lock is held. It is stored with the lock for observability.
type Reason string

// The reasons used by the worker.
const (
	ReasonRewind    Reason = "rewind"    // a late-arriving event forces a replay from a snapshot
	ReasonBootstrap Reason = "bootstrap" // the first snapshot of an existing model is written
	ReasonPurge     Reason = "purge"     // the pair's model and snapshots are deleted
)

// MaxReasonLength is the longest reason the lock column (varchar(50)) stores.
const MaxReasonLength = 50

// MaxPerspectiveNameLength is the longest perspective name accepted.
const MaxPerspectiveNameLength = 200

var (
	// ErrInvalidArgument is wrapped by every error that refuses bad input (a nil stream or
	// instance ID, an empty or over-long perspective name or reason) before any SQL runs.
	ErrInvalidArgument = errors.New("invalid argument")
	// ErrInvalidOptions is wrapped by every error of Options.Validate.
	ErrInvalidOptions = errors.New("invalid lock options")
)

// Locker acquires, renews and releases stream locks.
type Locker interface {
	// TryAcquire takes the lock on (streamID, perspectiveName) for instanceID. It reports
	// false, with no error, when another instance holds an unexpired lock.
	TryAcquire(ctx context.Context, streamID uuid.UUID, perspectiveName string, instanceID uuid.UUID, reason Reason) (bool, error)
	// Renew extends the lock's expiry if instanceID holds it and it has not expired, and
	// reports whether it still holds it. A lapsed lock is never revived.
	Renew(ctx context.Context, streamID uuid.UUID, perspectiveName string, instanceID uuid.UUID) (held bool, err error)
	// Release clears the lock if instanceID holds it; otherwise it changes nothing.
	Release(ctx context.Context, streamID uuid.UUID, perspectiveName string, instanceID uuid.UUID) error
}

// CursorRowLocker is a Locker whose locks are the lock columns of the pair's cursor row in
// wh_perspective_cursors (stream_lock_instance_id, stream_lock_expiry), as Postgres keeps
// them. The worker needs one: it pauses live application of a locked pair, and fences a
// rewind's or purge's final write, by reading those columns in the transaction that writes
// (a lease checked anywhere else could lapse between the check and the write). A Locker
// that wraps Postgres (to add logging, say) implements it by forwarding to Postgres.
type CursorRowLocker interface {
	Locker
	// LocksCursorRows marks the implementation; it does nothing.
	LocksCursorRows()
}

// Lock is one held, unexpired stream lock.
type Lock struct {
	StreamID        uuid.UUID
	PerspectiveName string
	InstanceID      uuid.UUID
	Reason          Reason
	Expiry          time.Time // database time at which the lock lapses
}

// ValidatePair checks a (stream, perspective) pair; the error wraps ErrInvalidArgument.
func ValidatePair(streamID uuid.UUID, perspectiveName string) error {
	if streamID == uuid.Nil {
		return fmt.Errorf("%w: stream ID is the nil UUID", ErrInvalidArgument)
	}
	return ValidatePerspectiveName(perspectiveName)
}

// ValidatePerspectiveName checks a perspective name; the error wraps ErrInvalidArgument.
func ValidatePerspectiveName(name string) error {
	if name == "" {
		return fmt.Errorf("%w: perspective name is empty", ErrInvalidArgument)
	}
	if err := validText("perspective name", name); err != nil {
		return err
	}
	if n := len([]rune(name)); n > MaxPerspectiveNameLength {
		return fmt.Errorf("%w: perspective name is %d characters, more than %d", ErrInvalidArgument, n, MaxPerspectiveNameLength)
	}
	return nil
}

func validateHolder(streamID uuid.UUID, perspectiveName string, instanceID uuid.UUID) error {
	if err := ValidatePair(streamID, perspectiveName); err != nil {
		return err
	}
	if instanceID == uuid.Nil {
		return fmt.Errorf("%w: instance ID is the nil UUID", ErrInvalidArgument)
	}
	return nil
}

func validateReason(reason Reason) error {
	if reason == "" {
		return fmt.Errorf("%w: reason is empty", ErrInvalidArgument)
	}
	if err := validText("reason", string(reason)); err != nil {
		return err
	}
	if n := len([]rune(string(reason))); n > MaxReasonLength {
		return fmt.Errorf("%w: reason is %d characters, more than %d", ErrInvalidArgument, n, MaxReasonLength)
	}
	return nil
}

// validText refuses what PostgreSQL text cannot store: invalid UTF-8 and NUL bytes.
func validText(what, s string) error {
	if !utf8.ValidString(s) {
		return fmt.Errorf("%w: %s is not valid UTF-8", ErrInvalidArgument, what)
	}
	if strings.ContainsRune(s, 0) {
		return fmt.Errorf("%w: %s contains a NUL byte", ErrInvalidArgument, what)
	}
	return nil
}
