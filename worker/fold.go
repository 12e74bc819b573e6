package worker

// The fold of events into a model, shared by the normal path, a rewind and a catch-up.

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/google/uuid"
)

// folded is the outcome of applying a pair's events in order.
type folded struct {
	model   json.RawMessage // the model after the applied events
	applied []uuid.UUID     // the events applied, in order
	snaps   []Snapshot      // the snapshots due among them, oldest first
	since   int             // events since the last snapshot, after the applied ones
	err     error           // the Apply failure that ended the fold (its event and later ones not applied)
}

// fold applies events (in ID order) to model, taking a snapshot each time
// Snapshots.EveryNEvents events have been applied since the last one (since of them before
// the first event). The first event whose Apply fails, or returns a model that is not JSON,
// ends it. Only the models it returns (the last one and the snapshots) are checked to be
// valid JSON; when one is not, the fold runs again checking every model, to find the event
// at fault. ctx ending ends it too, before its next Apply (or run), with an error that is no
// event's: its caller's transaction, on the same ctx, writes nothing of it.
func (w *Worker) fold(ctx context.Context, persp Perspective, model json.RawMessage, since int, events []Event) folded {
	f := w.foldEvents(ctx, persp, model, since, events, false)
	valid := len(f.applied) == 0 || json.Valid(f.model)
	for _, s := range f.snaps {
		valid = valid && json.Valid(s.Model)
	}
	if !valid {
		return w.foldEvents(ctx, persp, model, since, events, true)
	}
	return f
}

// foldEvents is fold; checkJSON checks every model Apply returns. A perspective that is a
// BatchApplier gets each run of events up to the next snapshot in one call (not when
// checkJSON); when a run fails, its events and the rest are applied one at a time.
func (w *Worker) foldEvents(ctx context.Context, persp Perspective, model json.RawMessage, since int, events []Event, checkJSON bool) folded {
	f := folded{model: model, since: since, applied: make([]uuid.UUID, 0, len(events))}
	batch, _ := persp.(BatchApplier)
	if checkJSON {
		batch = nil
	}
	applied := func(run []Event, model json.RawMessage) {
		f.model = model
		for _, ev := range run {
			f.applied = append(f.applied, ev.ID)
		}
		f.since += len(run)
		if !w.cfg.Snapshots.Disabled && f.since >= w.cfg.Snapshots.EveryNEvents {
			f.snaps = append(f.snaps, Snapshot{EventID: run[len(run)-1].ID, Model: f.model})
			f.since = 0
		}
	}
	for i := 0; i < len(events); {
		if ctx.Err() != nil {
			f.err = fmt.Errorf("fold interrupted: %w", context.Cause(ctx))
			break
		}
		if batch != nil {
			n := len(events) - i
			if !w.cfg.Snapshots.Disabled {
				n = min(n, max(1, w.cfg.Snapshots.EveryNEvents-f.since))
			}
			run := events[i : i+n]
			if next, ok := applyRun(ctx, batch, f.model, run); ok {
				applied(run, next)
				i += n
				continue
			}
			batch = nil // one event at a time from here: that finds the failing event
		}
		ev := events[i]
		next, err := w.applyOne(ctx, persp, f.model, ev, checkJSON)
		if err != nil {
			f.err = eventError{event: ev.ID, err: fmt.Errorf("apply event %s (%s): %w", ev.ID, ev.Type, err)}
			break
		}
		applied(events[i:i+1], next)
		i++
	}
	return f
}

// applyRun is ApplyBatch of run on model; ok is false when it failed, panicked or returned
// an empty model.
func applyRun(ctx context.Context, b BatchApplier, model json.RawMessage, run []Event) (next json.RawMessage, ok bool) {
	defer func() {
		if recover() != nil {
			ok = false
		}
	}()
	next, err := b.ApplyBatch(ctx, model, run)
	return next, err == nil && len(next) > 0
}

// perspectiveError is an error of a perspective's Apply: the pair's failure, whatever it
// wraps (an io.EOF of its own decoder, a timeout of a call it made), never the database's.
type perspectiveError struct{ err error }

func (e perspectiveError) Error() string { return e.err.Error() }

func (e perspectiveError) Unwrap() error { return e.err }

// applyOne runs the perspective's Apply, turning a panic or an empty model (or, when
// checkJSON, one that is not valid JSON) into an error.
func (w *Worker) applyOne(ctx context.Context, persp Perspective, model json.RawMessage, ev Event, checkJSON bool) (next json.RawMessage, err error) {
	defer func() {
		if r := recover(); r != nil {
			err = perspectiveError{fmt.Errorf("panic in Apply: %v", r)}
		}
	}()
	next, err = persp.Apply(ctx, model, ev)
	if err != nil {
		return nil, perspectiveError{err}
	}
	if len(next) == 0 || checkJSON && !json.Valid(next) {
		return nil, fmt.Errorf("perspective %s returned a model that is not valid JSON", persp.Name())
	}
	return next, nil
}
