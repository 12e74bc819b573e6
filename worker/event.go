package worker

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

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

// Append stores events and enqueues them for every registered perspective, atomically, in
// one statement (one round trip; on a pool or a connection, an implicit transaction of its
// own). Inside the caller's transaction (a pgx.Tx), nothing is visible or queued unless that
// transaction commits, and no savepoint is made: a failed Append aborts that transaction, as
// any failed statement does. Events with a zero ID get a UUIDv7; when events is passed as
// slice..., the assigned IDs are written back into that slice.
//
// Bad input (a nil stream ID, an empty type, data that is not JSON, an ID used twice in the
// call, text PostgreSQL cannot store: invalid UTF-8, a NUL byte in the type, a \u0000 escape
// in the data) is refused with an error wrapping locker.ErrInvalidArgument before any SQL
// runs. An ID that is already stored fails with ErrDuplicateEvent and nothing is written. In
// a REPEATABLE READ or SERIALIZABLE transaction whose snapshot predates the registration of
// a perspective build, Append fails with a serialization error (SQLSTATE 40001): retry the
// transaction, as those isolation levels require.
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
		if err := storable(ev.Type, data); err != nil {
			return fmt.Errorf("worker: append: %w: event %d: %w", locker.ErrInvalidArgument, i, err)
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

	_, err := pgq.New(dbtx).EventsAppend(ctx, p)
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

// storable says why PostgreSQL could not store an event's type or (valid JSON) data, if it
// could not: text must be UTF-8 without NUL bytes, and jsonb refuses the escape \u0000.
func storable(typ string, data []byte) error {
	switch {
	case !utf8.ValidString(typ):
		return errors.New("type is not valid UTF-8")
	case strings.IndexByte(typ, 0) >= 0:
		return errors.New("type contains a NUL byte")
	case !utf8.Valid(data):
		return errors.New("data is not valid UTF-8")
	}
	// In valid JSON a backslash outside a string is impossible and inside one starts an
	// escape unless the backslash before it did: \u0000 is an escape when the backslashes
	// that run up to it are odd in number.
	for i := 0; ; {
		j := bytes.Index(data[i:], []byte(`\u0000`))
		if j < 0 {
			return nil
		}
		j += i
		run := 0
		for k := j - 1; k >= 0 && data[k] == '\\'; k-- {
			run++
		}
		if run%2 == 0 {
			return errors.New(`data contains the escape \u0000, which PostgreSQL's jsonb cannot store`)
		}
		i = j + 1
	}
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

// Load decodes the active version's model of (perspectiveName, streamID) into an M, as
// LoadModel reads it, and reports whether one exists (the zero M when not). A model that does
// not decode into M is an error naming the perspective and the stream.
func Load[M any](ctx context.Context, dbtx DBTX, perspectiveName string, streamID uuid.UUID) (M, bool, error) {
	var m M
	raw, ok, err := LoadModel(ctx, dbtx, perspectiveName, streamID)
	if err != nil || !ok {
		return m, false, err
	}
	if err := json.Unmarshal(raw, &m); err != nil {
		var zero M
		return zero, false, fmt.Errorf("worker: load %s of stream %s into %T: %w", perspectiveName, streamID, m, err)
	}
	return m, true, nil
}
