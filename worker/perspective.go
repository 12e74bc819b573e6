package worker

//go:generate go tool moq -rm -out ../mocks/perspective.go -pkg mocks . Perspective

import (
	"context"
	"encoding/json"
	"fmt"
)

// Perspective folds a stream's events, in event-ID order, into a JSON model.
type Perspective interface {
	// Name identifies the perspective; unique per worker, at most 200 characters.
	Name() string
	// Apply returns the model after ev. model is nil before the first event. An error (or
	// panic) leaves the event queued; it is retried with backoff.
	Apply(ctx context.Context, model json.RawMessage, ev Event) (json.RawMessage, error)
}

// A Perspective that also implements BatchApplier applies a run of events in one call.
// ApplyBatch must return what Apply would after applying events to model in order, one
// after the other. The worker calls it for each run of a pair's events up to its next
// snapshot, instead of Apply for each event; when it fails (an error, a panic, an empty
// model) the worker applies that run's events one at a time with Apply, which finds the
// failing event, and goes on with Apply. JSONPerspective's perspectives implement it: they
// decode the model once per run and encode it once, where Apply decodes and encodes it at
// every event. A perspective that embeds another (a worker.Perspective field) hides the
// embedded one's ApplyBatch: forward it, or the worker calls Apply for each event.
type BatchApplier interface {
	ApplyBatch(ctx context.Context, model json.RawMessage, events []Event) (json.RawMessage, error)
}

// JSONPerspective builds a Perspective over a Go model type M, marshalled as JSON.
// Before the first event, apply receives M's zero value. It also implements BatchApplier.
func JSONPerspective[M any](name string, apply func(model M, ev Event) (M, error)) Perspective {
	return jsonPerspective[M]{name: name, apply: apply}
}

type jsonPerspective[M any] struct {
	name  string
	apply func(M, Event) (M, error)
}

func (p jsonPerspective[M]) Name() string { return p.name }

func (p jsonPerspective[M]) Apply(ctx context.Context, raw json.RawMessage, ev Event) (json.RawMessage, error) {
	return p.ApplyBatch(ctx, raw, []Event{ev})
}

// ApplyBatch decodes the model, applies the events to it in order and encodes the result.
func (p jsonPerspective[M]) ApplyBatch(_ context.Context, raw json.RawMessage, events []Event) (json.RawMessage, error) {
	var m M
	if len(raw) > 0 {
		if err := json.Unmarshal(raw, &m); err != nil {
			return nil, fmt.Errorf("perspective %s: decode model: %w", p.name, err)
		}
	}
	for _, ev := range events {
		var err error
		if m, err = p.apply(m, ev); err != nil {
			return nil, err
		}
	}
	out, err := json.Marshal(m)
	if err != nil {
		return nil, fmt.Errorf("perspective %s: encode model: %w", p.name, err)
	}
	return out, nil
}
