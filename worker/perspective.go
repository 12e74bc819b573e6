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

// JSONPerspective builds a Perspective over a Go model type M, marshalled as JSON.
// Before the first event, apply receives M's zero value.
func JSONPerspective[M any](name string, apply func(model M, ev Event) (M, error)) Perspective {
	return jsonPerspective[M]{name: name, apply: apply}
}

type jsonPerspective[M any] struct {
	name  string
	apply func(M, Event) (M, error)
}

func (p jsonPerspective[M]) Name() string { return p.name }

func (p jsonPerspective[M]) Apply(_ context.Context, raw json.RawMessage, ev Event) (json.RawMessage, error) {
	var m M
	if len(raw) > 0 {
		if err := json.Unmarshal(raw, &m); err != nil {
			return nil, fmt.Errorf("perspective %s: decode model: %w", p.name, err)
		}
	}
	next, err := p.apply(m, ev)
	if err != nil {
		return nil, err
	}
	out, err := json.Marshal(next)
	if err != nil {
		return nil, fmt.Errorf("perspective %s: encode model: %w", p.name, err)
	}
	return out, nil
}
