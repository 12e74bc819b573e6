package worker

import (
	"context"
	"encoding/json"
	"errors"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
)

// foldModel lists the events applied; an event of type "bad" fails, one of type "panic"
// panics.
type foldModel struct {
	IDs []uuid.UUID `json:"ids"`
}

func foldApply(m foldModel, ev Event) (foldModel, error) {
	switch ev.Type {
	case "bad":
		m.IDs = append(m.IDs, uuid.Nil) // mutates what it was given, then fails
		return m, errors.New("bad event")
	case "panic":
		panic("panic event")
	}
	m.IDs = append(m.IDs, ev.ID)
	return m, nil
}

// perEvent hides a perspective's ApplyBatch: the worker applies it one event at a time.
type perEvent struct{ Perspective }

// countingBatch counts the ApplyBatch calls of a JSON perspective.
type countingBatch struct {
	Perspective
	calls int
}

func (c *countingBatch) ApplyBatch(ctx context.Context, model json.RawMessage, events []Event) (json.RawMessage, error) {
	c.calls++
	return c.Perspective.(BatchApplier).ApplyBatch(ctx, model, events)
}

func foldEventsOf(types ...string) []Event {
	evs := make([]Event, len(types))
	for i, typ := range types {
		evs[i] = Event{ID: uuid.Must(uuid.NewV7()), Type: typ}
	}
	return evs
}

// A perspective that applies runs in one call folds exactly as one applied event by event:
// the same model, the same snapshots at the same events, and on a failure the same applied
// events and failing event (found by applying the failing run one event at a time).
func TestFoldInRunsIsTheFoldEventByEvent(t *testing.T) {
	w := &Worker{cfg: Config{Snapshots: SnapshotOptions{EveryNEvents: 4}}}
	ctx := context.Background()
	jp := JSONPerspective("fold", foldApply)
	start, err := jp.Apply(ctx, nil, Event{ID: uuid.Must(uuid.NewV7()), Type: "ok"})
	require.NoError(t, err)
	many := make([]string, 11)
	for i := range many {
		many[i] = "ok"
	}
	for _, tc := range []struct {
		name  string
		types []string
		since int
	}{
		{"no failure", many, 1},
		{"since at the interval", many, 4},
		{"a failure in the second run", append(append([]string{}, many[:5]...), "bad", "ok", "ok"), 0},
		{"a panic in the first run", []string{"ok", "panic", "ok"}, 2},
		{"a failure first", []string{"bad", "ok"}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			evs := foldEventsOf(tc.types...)
			batch := &countingBatch{Perspective: jp}
			got := w.fold(ctx, batch, start, tc.since, evs)
			want := w.fold(ctx, perEvent{jp}, start, tc.since, evs)
			require.Equal(t, want.model, got.model)
			require.Equal(t, want.applied, got.applied)
			require.Equal(t, want.snaps, got.snaps)
			require.Equal(t, want.since, got.since)
			require.Equal(t, failedEvent(want.err), failedEvent(got.err))
			require.Equal(t, want.err == nil, got.err == nil)
			require.Positive(t, batch.calls)
			if want.err == nil {
				require.Less(t, batch.calls, len(evs), "runs of events, not one call per event")
			}
		})
	}
	// Without snapshots, the events are one run.
	w.cfg.Snapshots.Disabled = true
	batch := &countingBatch{Perspective: jp}
	f := w.fold(ctx, batch, start, 0, foldEventsOf(many...))
	require.NoError(t, f.err)
	require.Len(t, f.applied, len(many))
	require.Equal(t, 1, batch.calls)
}
