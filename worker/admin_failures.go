package worker

import (
	"context"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/perspectives-go/perspectives/db"
	"github.com/perspectives-go/perspectives/locker"
)

// FailedPair is a (stream, perspective) whose processing fails: retried with backoff, or
// parked by its failure policy (see FailurePolicy).
type FailedPair struct {
	Stream      uuid.UUID
	Perspective string // the perspective's name
	Version     int
	Parked      bool      // parked: waits for Retry or Skip; else retried at NextAttempt
	Event       uuid.UUID // the failing event (uuid.Nil: the failure was not one event's)
	EventType   string    // its type ("" when not known)
	Attempts    int       // failures in a row
	LastError   string
	Since       time.Time // when its failures began
	NextAttempt time.Time // when it is retried (zero: parked, or due now)
}

// SkippedEvent is an event a pair will never apply, skipped by its failure policy or by an
// operator (Skip).
type SkippedEvent struct {
	Stream      uuid.UUID
	Perspective string
	Version     int
	Event       uuid.UUID
	EventType   string // "" when not known
	At          time.Time
	By          string // the operator, or the worker instance whose policy skipped it
	ByPolicy    bool   // skipped by the failure policy, not by an operator
	Attempts    int    // the pair's failures in a row at the skip
	LastError   string
}

// MaxListed is the most rows Failed and Skipped return.
const MaxListed = 10000

// Failed returns the failing and parked pairs of the perspective (of every perspective when
// perspectiveName is empty), of its versions that are not retired: parked first, then the
// oldest failure first; at most limit (1 to MaxListed).
func (a *Admin) Failed(ctx context.Context, perspectiveName string, limit int) ([]FailedPair, error) {
	arg, err := listArgs(perspectiveName, limit)
	if err != nil {
		return nil, fmt.Errorf("worker: failed: %w", err)
	}
	rows, err := a.store.q.PairsFailed(ctx, db.PairsFailedParams{PerspectiveName: arg.name, MaxRows: arg.limit})
	if err != nil {
		return nil, fmt.Errorf("worker: failed: %w", err)
	}
	out := make([]FailedPair, len(rows))
	for i, r := range rows {
		out[i] = FailedPair{
			Stream: r.StreamID, Perspective: r.PerspectiveName, Version: int(r.Version),
			Parked: r.Status == "parked", Event: r.FailedEventID.UUID, EventType: deref(r.FailedEventType),
			Attempts: int(r.Attempts), LastError: r.LastError, Since: r.FailedSince,
		}
		if r.NextAttemptAt != nil { // only a pair backing off has one (a parked pair's due row is at infinity)
			out[i].NextAttempt = *r.NextAttemptAt
		}
	}
	return out, nil
}

// Skipped returns the skipped events of the perspective (of every perspective when
// perspectiveName is empty), of its versions that are not retired, newest first; at most
// limit (1 to MaxListed).
func (a *Admin) Skipped(ctx context.Context, perspectiveName string, limit int) ([]SkippedEvent, error) {
	arg, err := listArgs(perspectiveName, limit)
	if err != nil {
		return nil, fmt.Errorf("worker: skipped: %w", err)
	}
	rows, err := a.store.q.SkippedEvents(ctx, db.SkippedEventsParams{PerspectiveName: arg.name, MaxRows: arg.limit})
	if err != nil {
		return nil, fmt.Errorf("worker: skipped: %w", err)
	}
	out := make([]SkippedEvent, len(rows))
	for i, r := range rows {
		out[i] = SkippedEvent{
			Stream: r.StreamID, Perspective: r.PerspectiveName, Version: int(r.Version), Event: r.EventID,
			EventType: deref(r.EventType), At: r.SkippedAt, By: r.SkippedBy, ByPolicy: r.Reason == "policy",
			Attempts: int(r.Attempts), LastError: r.LastError,
		}
	}
	return out, nil
}

type listArg struct {
	name  *string
	limit int32
}

func listArgs(perspectiveName string, limit int) (listArg, error) {
	var arg listArg
	if perspectiveName != "" {
		if err := locker.ValidatePerspectiveName(perspectiveName); err != nil {
			return arg, err
		}
		arg.name = &perspectiveName
	}
	if limit < 1 || limit > MaxListed {
		return arg, fmt.Errorf("%w: limit must be between 1 and %d, got %d", locker.ErrInvalidArgument, MaxListed, limit)
	}
	arg.limit = int32(limit)
	return arg, nil
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// Retry makes the failing and parked pairs of the perspective due now, in every version that
// is not retired: the pair of streamID, or all of them when streamID is uuid.Nil. Running
// workers retry them at once (not at the next backoff). A retried pair keeps its count of
// failures until an application succeeds: when it fails again its failure policy acts at
// once (a parked pair parks again). It returns the number of pairs it made due (0: none was
// failing).
func (a *Admin) Retry(ctx context.Context, streamID uuid.UUID, perspectiveName string) (int, error) {
	if err := a.registered(ctx, perspectiveName); err != nil {
		return 0, fmt.Errorf("worker: retry: %w", err)
	}
	arg := db.PairsRetryParams{PerspectiveName: perspectiveName}
	if streamID != uuid.Nil {
		arg.StreamID = uuid.NullUUID{UUID: streamID, Valid: true}
	}
	rows, err := a.store.q.PairsRetry(ctx, arg)
	if err != nil {
		return 0, fmt.Errorf("worker: retry: %w", err)
	}
	return len(rows), nil
}

// Skip skips an event of a stream for the perspective, in every version that is not retired
// where the event is queued for the stream or is its failing event: the skip is recorded
// with by (who skips it: an operator's name) and the time, the event is never applied to
// that version's model (a rewind's replay leaves it out too), and when it was the pair's
// failing event the pair's failure clears and running workers apply the events after it.
// Readers waiting for it (WaitFor) get ErrSkipped. It returns the versions it skipped the
// event in; an event neither queued for the stream nor failing in any version is refused
// with an error wrapping locker.ErrInvalidArgument, and nothing is written.
func (a *Admin) Skip(ctx context.Context, streamID uuid.UUID, perspectiveName string, eventID uuid.UUID, by string) ([]int, error) {
	if err := locker.ValidatePair(streamID, perspectiveName); err != nil {
		return nil, fmt.Errorf("worker: skip: %w", err)
	}
	switch {
	case eventID == uuid.Nil:
		return nil, fmt.Errorf("worker: skip: %w: event ID is the nil UUID", locker.ErrInvalidArgument)
	case strings.TrimSpace(by) == "":
		return nil, fmt.Errorf("worker: skip: %w: by is empty: say who skips the event", locker.ErrInvalidArgument)
	case !utf8.ValidString(by) || strings.IndexByte(by, 0) >= 0:
		return nil, fmt.Errorf("worker: skip: %w: by is not text PostgreSQL can store (invalid UTF-8 or a NUL byte)", locker.ErrInvalidArgument)
	}
	builds, err := a.store.Builds(ctx, []string{perspectiveName})
	if err != nil {
		return nil, fmt.Errorf("worker: skip: %w", err)
	}
	if len(builds) == 0 {
		return nil, fmt.Errorf("worker: skip: %w: perspective %q is not registered", locker.ErrInvalidArgument, perspectiveName)
	}
	version := make(map[string]int, len(builds))
	var keys []string
	for _, b := range builds {
		if b.State != BuildRetired {
			keys = append(keys, b.Key)
			version[b.Key] = b.Version
		}
	}
	var skipped []string
	err = a.store.inTx(ctx, func(_ pgx.Tx, q *db.Queries) error {
		if err := q.CursorsLockOfStream(ctx, db.CursorsLockOfStreamParams{StreamID: streamID, BuildKeys: keys}); err != nil {
			return err
		}
		skipped, err = q.EventSkip(ctx, db.EventSkipParams{EventID: eventID, StreamID: streamID, BuildKeys: keys, SkippedBy: by})
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("worker: skip: %w", err)
	}
	if len(skipped) == 0 {
		return nil, fmt.Errorf("worker: skip: %w: event %s is neither queued for stream %s nor its failing event in any version of %q (see perspectives failed)",
			locker.ErrInvalidArgument, eventID, streamID, perspectiveName)
	}
	versions := make([]int, len(skipped))
	for i, key := range skipped {
		versions[i] = version[key]
	}
	return versions, nil
}

// registered checks that perspectiveName is a registered perspective's name.
func (a *Admin) registered(ctx context.Context, perspectiveName string) error {
	if err := locker.ValidatePerspectiveName(perspectiveName); err != nil {
		return err
	}
	ok, err := a.store.q.PerspectiveExists(ctx, perspectiveName)
	if err != nil {
		return err
	}
	if !ok {
		return fmt.Errorf("%w: perspective %q is not registered", locker.ErrInvalidArgument, perspectiveName)
	}
	return nil
}
