package worker

// A bootstrap: a pair's first snapshot, written under the stream lock when its history is
// long enough for one to pay.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"go.opentelemetry.io/otel/attribute"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/perspectives-go/perspectives/db"
	"github.com/perspectives-go/perspectives/locker"
)

// bootstrap writes the first snapshot of a pair whose model has a long enough history but
// no snapshot. It takes the stream lock with reason bootstrap when it can and proceeds when
// it cannot: the snapshot is of the model and position read together under the cursor row
// lock, so it is correct whoever else is working, and writing it twice is harmless.
func (w *Worker) bootstrap(ctx context.Context, k Pair) (err error) {
	attrs := w.logPair(k)
	locked := false
	if w.cfg.Locker != nil {
		l, err := w.acquire(ctx, k, locker.ReasonBootstrap)
		switch {
		case err != nil:
			w.log.Warn("bootstrap: stream lock not taken; proceeding", append(attrs, slog.Any("error", err))...)
		case l == nil:
			w.log.Debug("bootstrap: stream lock held elsewhere; proceeding", attrs...)
		default:
			locked = true
			defer l.release()
		}
	}
	ctx, span := w.startSpan(ctx, "perspectives.bootstrap", k)
	span.SetAttributes(attribute.Bool("locked", locked))
	defer func() {
		result := "ok"
		if err != nil {
			result = "error"
		}
		w.tel.bootstraps.Add(context.WithoutCancel(ctx), 1, w.metricPair(k, attrResult.String(result), attribute.Bool("locked", locked)))
		endSpan(span, err)
	}()
	wrote, err := w.store.Bootstrap(ctx, k)
	if err != nil {
		return fmt.Errorf("bootstrap: %w", err)
	}
	if wrote {
		w.log.Info("snapshot bootstrapped", attrs...)
	}
	return nil
}

func (s *pgStore) Bootstrap(ctx context.Context, p Pair) (bool, error) {
	wrote := false
	err := s.inTx(ctx, func(_ pgx.Tx, q *db.Queries) error {
		cur, err := q.CursorLock(ctx, db.CursorLockParams{StreamID: p.Stream, PerspectiveName: p.Perspective})
		if errors.Is(err, pgx.ErrNoRows) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("lock cursor: %w", err)
		}
		if !cur.LastEventID.Valid {
			return nil // purged meanwhile: nothing to snapshot
		}
		models, err := q.ModelsGet(ctx, db.ModelsGetParams{StreamIds: []uuid.UUID{p.Stream}, PerspectiveNames: []string{p.Perspective}})
		if err != nil {
			return fmt.Errorf("load model: %w", err)
		}
		if len(models) == 0 {
			// Its failure, retried with backoff and parked by the policy: returning nothing
			// written, the apply after it would ask for a bootstrap again, for ever.
			return fmt.Errorf("the cursor is at event %s but the pair has no model", cur.LastEventID.UUID)
		}
		m := models[0]
		if m.LastEventID != cur.LastEventID.UUID {
			return fmt.Errorf("model is at event %s but the cursor is at %s", m.LastEventID, cur.LastEventID.UUID)
		}
		if err := q.SnapshotsInsert(ctx, db.SnapshotsInsertParams{
			StreamIds: []uuid.UUID{p.Stream}, PerspectiveNames: []string{p.Perspective},
			SnapshotEventIds: []uuid.UUID{m.LastEventID}, Models: []string{string(m.Model)},
		}); err != nil {
			return fmt.Errorf("write snapshot: %w", err)
		}
		wrote = true
		return nil
	})
	return wrote, err
}

// BootstrapStore is what a bootstrap asks of the database.
type BootstrapStore interface {
	// Bootstrap stores the pair's model, read together with its cursor under the cursor row
	// lock, as a snapshot at the cursor's position. It reports whether it wrote one (not
	// when the cursor has no position: purged meanwhile). A position without a model, or a
	// model at another event, is an error.
	Bootstrap(ctx context.Context, p Pair) (bool, error)
}
