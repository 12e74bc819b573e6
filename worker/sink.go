package worker

// Sinks: a perspective that also writes its models to the application's own tables, in the
// transaction that commits them. The JSON model stays the source of truth; a sink's rows
// follow it on every path that changes a model (the normal path, a rewind, a catch-up page,
// a rebuild, a purge), and a failing sink rolls its pairs back like a failing Apply.

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

// Change is one pair's model as committed.
type Change struct {
	StreamID    uuid.UUID
	Build       Build           // the build (perspective, version, rebuild number) the model belongs to
	Model       json.RawMessage // the committed model; nil when it was deleted (purge)
	LastEventID uuid.UUID       // the newest event the model includes; uuid.Nil when deleted
	Replay      bool            // from a rewind, a catch-up or a rebuild, not from live application
}

// A Perspective that also implements Sink has Write called in every transaction that commits
// its models, once, with every pair whose model changed there (each pair at most once).
// An error rolls the transaction back; the pairs are treated as failing, like an Apply error.
//
// Write runs on the worker's transaction: run the application's queries on tx (with sqlc,
// queries.New(tx)), and do not commit or roll it back. Changes of several builds of the
// perspective never share a call, so a sink can pick its table from changes[0].Build. A
// catch-up page whose Write fails is committed without the perspective's models, its
// streams handed to the normal path, where the failing pair is retried and parked as for an
// Apply error while the others commit.
//
// Replay is true for a rewind's change and for a catch-up's change made only of history
// (events stored before the build was registered); a change that applies an event appended
// since is live, whether the normal path or a catch-up page applies it. A sink that also
// enqueues side effects (a job inserted on tx, an outbox row) should do so for live changes
// only, keyed so that a second insert does nothing: every build applies the live events,
// the active one and one building beside it, and Change.Build.State is the instance's view
// of the build at its last look at the builds, which may lag a promotion.
type Sink interface {
	Write(ctx context.Context, tx pgx.Tx, changes []Change) error
}

// A Sink that also implements Promoter has Promoted called inside the promotion transaction
// (from is nil when no build was active), e.g. to repoint a view at the new build's table.
// A perspective's first build is active from its registration: Promoted(nil, first) runs in
// the registration transaction, so a view exists before the first model does. An error
// rolls the promotion (or the registration: Start fails) back; a promotion is tried again at
// the next look at the builds.
type Promoter interface {
	Promoted(ctx context.Context, tx pgx.Tx, from *Build, to Build) error
}

// A Sink that also implements Retirer has Retired called once when a retired build is cleaned up.
// It runs after the build's own rows are deleted, before the build is marked cleaned: an
// error leaves the build to clean, and Retired is called again at the next cleanup. It runs
// on the instance that holds the perspective's cleanup lease, whichever version that
// instance runs: each version's Retired must be able to delete an older build's rows. It
// runs on the pool, outside the lease's fence (it may take as many transactions as it
// likes), so when the lease passes to another instance during a call (the holder stopped,
// or its lease lapsed in a long call), the new holder may call it for the same build while
// the first call still runs: make it idempotent and safe to run twice at once, as a
// deletion by the build's key is.
type Retirer interface {
	Retired(ctx context.Context, db DBTX, b Build) error
}

// pairChange is one pair's committed model, as a Store's transaction hands it to the sinks.
type pairChange struct {
	Pair
	Model       json.RawMessage // nil: deleted
	LastEventID uuid.UUID
	Replay      bool // see Change.Replay
}

// The calls a Store's transactions make into the perspectives' sinks are methods of the
// worker whose store it is (pgStore.w). An Admin's store has none (w is nil: it runs no
// perspective), and the methods do nothing on a nil worker.

// promoteSinks runs the Promoter of to's perspective, if it has one, in the promotion
// transaction tx, after the flip.
func (w *Worker) promoteSinks(ctx context.Context, tx pgx.Tx, from *Build, to Build) error {
	if w == nil {
		return nil
	}
	if p, ok := w.persp[to.Perspective].(Promoter); ok {
		if err := p.Promoted(ctx, tx, from, to); err != nil {
			return sinkError{perspective: to.Perspective, err: fmt.Errorf("promoted: %w", err)}
		}
	}
	return nil
}

// hasSink says whether the perspective writes to a sink (recorded at its registration).
func (w *Worker) hasSink(perspective string) bool {
	_, ok := w.persp[perspective].(Sink)
	return ok
}

// retireSinks runs the Retirer of b's perspective, if it has one, once the retired build's
// own rows are deleted, before it is marked cleaned.
func (w *Worker) retireSinks(ctx context.Context, db DBTX, b Build) error {
	if w == nil {
		return nil
	}
	if r, ok := w.persp[b.Perspective].(Retirer); ok {
		if err := r.Retired(ctx, db, b); err != nil {
			return sinkError{perspective: b.Perspective, err: fmt.Errorf("retired: %w", err)}
		}
	}
	return nil
}

// sinkError is a sink's failure: the transaction it ran in is rolled back.
type sinkError struct {
	perspective string
	err         error
}

func (e sinkError) Error() string { return fmt.Sprintf("sink of %s: %v", e.perspective, e.err) }
func (e sinkError) Unwrap() error { return e.err }

// writeSinks calls the sink of each build among changes that has one, once per build, with
// that build's changes, on tx: in every transaction that commits models, before it commits.
// The first error is returned as a sinkError.
func (w *Worker) writeSinks(ctx context.Context, tx pgx.Tx, changes []pairChange) error {
	if w == nil || len(changes) == 0 {
		return nil
	}
	set := w.builds()
	var order []string
	byKey := map[string][]Change{}
	for _, c := range changes {
		b := set.byKey[c.Perspective]
		if b == nil {
			continue
		}
		if _, ok := b.persp.(Sink); !ok {
			continue
		}
		if _, seen := byKey[c.Perspective]; !seen {
			order = append(order, c.Perspective)
		}
		byKey[c.Perspective] = append(byKey[c.Perspective], Change{
			StreamID: c.Stream, Build: b.Build, Model: c.Model, LastEventID: c.LastEventID, Replay: c.Replay,
		})
	}
	for _, key := range order {
		b := set.byKey[key]
		start := time.Now()
		err := b.persp.(Sink).Write(ctx, tx, byKey[key])
		took := time.Since(start)
		attrs := w.metricPair(Pair{Perspective: key})
		w.tel.sinkDuration.Record(ctx, took.Seconds(), attrs)
		if err != nil {
			w.tel.sinkFailures.Add(ctx, 1, attrs)
			return sinkError{perspective: b.Perspective, err: err}
		}
		w.countSink(key, took)
	}
	return nil
}
