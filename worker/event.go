package worker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/perspectives-go/perspectives/db"
	"github.com/perspectives-go/perspectives/internal/pgq"
	"github.com/perspectives-go/perspectives/locker"
)

// Event is one stored event. Order within a stream is ID order (IDs are UUIDv7).
type Event struct {
	ID        uuid.UUID       // zero on Append: a new UUIDv7 is assigned
	StreamID  uuid.UUID       // required
	Type      string          // required
	Data      json.RawMessage // must be valid JSON; empty means JSON null
	CreatedAt time.Time       // zero on Append: the database's now()
}

// DBTX is what Append and LoadModel run on: a *pgxpool.Pool, a *pgx.Conn or a pgx.Tx.
type DBTX = db.DBTX

// beginner is implemented by pools, connections and transactions (as a savepoint).
type beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// Append stores events and enqueues them for every registered perspective, atomically.
// Inside the caller's transaction (a pgx.Tx), nothing is visible or queued unless that
// transaction commits. Events with a zero ID get a UUIDv7; when events is passed as
// slice..., the assigned IDs are written back into that slice.
//
// Bad input (a nil stream ID, an empty type, data that is not JSON, an ID used twice in the
// call) is refused with an error wrapping locker.ErrInvalidArgument before anything is written.
// An ID that is already stored fails with ErrDuplicateEvent and nothing is written.
func Append(ctx context.Context, dbtx DBTX, events ...Event) error {
	if isNil(dbtx) {
		return fmt.Errorf("worker: append: %w: db is nil", locker.ErrInvalidArgument)
	}
	if len(events) == 0 {
		return nil
	}
	p := db.EventsAppendParams{
		EventIds:   make([]uuid.UUID, len(events)),
		StreamIds:  make([]uuid.UUID, len(events)),
		EventTypes: make([]string, len(events)),
		Datas:      make([]string, len(events)),
		CreatedAts: make([]time.Time, len(events)),
	}
	seen := make(map[uuid.UUID]struct{}, len(events))
	for i := range events {
		ev := &events[i]
		if ev.StreamID == uuid.Nil {
			return fmt.Errorf("worker: append: %w: event %d: stream ID is the nil UUID", locker.ErrInvalidArgument, i)
		}
		if ev.Type == "" {
			return fmt.Errorf("worker: append: %w: event %d: type is empty", locker.ErrInvalidArgument, i)
		}
		data := ev.Data
		if len(data) == 0 {
			data = json.RawMessage("null")
		}
		if !json.Valid(data) {
			return fmt.Errorf("worker: append: %w: event %d: data is not valid JSON", locker.ErrInvalidArgument, i)
		}
		if _, dup := seen[ev.ID]; dup && ev.ID != uuid.Nil {
			return fmt.Errorf("worker: append: %w: event %d: ID %s appears twice", locker.ErrInvalidArgument, i, ev.ID)
		}
		seen[ev.ID] = struct{}{}
		p.StreamIds[i], p.EventTypes[i], p.Datas[i] = ev.StreamID, ev.Type, string(data)
		p.CreatedAts[i] = ev.CreatedAt.UTC()
	}
	ids := make([]uuid.UUID, len(events))
	for i := range events {
		ids[i] = events[i].ID
		if ids[i] == uuid.Nil {
			id, err := uuid.NewV7()
			if err != nil {
				return fmt.Errorf("worker: append: new event ID: %w", err)
			}
			ids[i] = id
		}
	}
	copy(p.EventIds, ids)

	run := func(q *db.Queries) error {
		// The shared advisory lock orders this append against the registration of builds
		// (which takes it exclusively): see Store.Register.
		isolation, err := q.AppendLockAndNotify(ctx)
		if err != nil {
			return err
		}
		if isolation != "read committed" && isolation != "read uncommitted" {
			// The snapshot may predate a build registered since: then this fails, rather
			// than queue the events for the builds the snapshot knows only.
			if err := q.RegistrationCheck(ctx); err != nil {
				return fmt.Errorf("a perspective build was registered after this %s transaction's snapshot was taken; retry the transaction: %w", isolation, err)
			}
		}
		_, err = q.EventsAppend(ctx, p)
		return err
	}
	var err error
	if b, ok := dbtx.(beginner); ok {
		err = pgx.BeginFunc(ctx, b, func(tx pgx.Tx) error { return run(pgq.New(tx)) })
	} else {
		err = run(pgq.New(dbtx))
	}
	if err != nil {
		if isUniqueViolation(err) {
			return fmt.Errorf("worker: append: %w: %w", ErrDuplicateEvent, err)
		}
		return fmt.Errorf("worker: append: %w", err)
	}
	for i := range events {
		events[i].ID = ids[i]
	}
	return nil
}

// ErrDuplicateEvent is returned by Append when an event ID is already stored.
var ErrDuplicateEvent = errors.New("duplicate event ID")

// LoadModel returns the current model of (perspectiveName, streamID) in the perspective's
// active version, and whether one exists. While a new version (or a rebuild) builds beside
// it, the active version's models are served; its promotion switches every stream at once.
func LoadModel(ctx context.Context, dbtx DBTX, perspectiveName string, streamID uuid.UUID) (json.RawMessage, bool, error) {
	if isNil(dbtx) {
		return nil, false, fmt.Errorf("worker: load model: %w: db is nil", locker.ErrInvalidArgument)
	}
	if err := locker.ValidatePair(streamID, perspectiveName); err != nil {
		return nil, false, fmt.Errorf("worker: load model: %w", err)
	}
	model, err := pgq.New(dbtx).ModelActiveGet(ctx, db.ModelActiveGetParams{StreamID: streamID, PerspectiveName: perspectiveName})
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, fmt.Errorf("worker: load model: %w", err)
	}
	return json.RawMessage(model), true, nil
}
