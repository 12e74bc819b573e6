package worker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/perspectives-go/perspectives/db"
	"github.com/perspectives-go/perspectives/locker"
)

// bootstrap writes the first snapshot of a pair that has a model but no snapshot. It takes
// the stream lock with reason bootstrap when it can and proceeds when it cannot: the
// snapshot is of the model and position read together under the cursor row lock, so it is
// correct whoever else is working, and writing it twice is harmless.
func (w *Worker) bootstrap(ctx context.Context, k pairKey) (err error) {
	attrs := []any{slog.String("perspective", k.Perspective), slog.String("stream", k.Stream.String())}
	locked := false
	if w.locker != nil {
		ok, release, err := w.acquire(ctx, k, locker.ReasonBootstrap)
		if err != nil {
			w.log.Warn("bootstrap: stream lock not taken; proceeding", append(attrs, slog.Any("error", err))...)
		} else if !ok {
			w.log.Debug("bootstrap: stream lock held elsewhere; proceeding", attrs...)
		}
		locked = ok
		defer release()
	}
	ctx, span := w.tel.startSpan(ctx, "perspectives.bootstrap", k, w.cfg.InstanceID)
	span.SetAttributes(attribute.Bool("locked", locked))
	defer func() {
		result := "ok"
		if err != nil {
			result = "error"
		}
		w.tel.bootstraps.Add(context.WithoutCancel(ctx), 1, metric.WithAttributes(
			attrPerspective.String(k.Perspective), attrResult.String(result), attribute.Bool("locked", locked)))
		endSpan(span, err)
	}()
	err = w.store.InTx(ctx, func(q db.Querier) error {
		cur, err := q.CursorLock(ctx, db.CursorLockParams{StreamID: k.Stream, PerspectiveName: k.Perspective})
		if err != nil {
			return fmt.Errorf("lock cursor: %w", err)
		}
		if !cur.LastEventID.Valid {
			return nil // purged meanwhile: nothing to snapshot
		}
		m, err := q.ModelGet(ctx, db.ModelGetParams{StreamID: k.Stream, PerspectiveName: k.Perspective})
		if errors.Is(err, pgx.ErrNoRows) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("load model: %w", err)
		}
		if m.LastEventID != cur.LastEventID.UUID {
			return fmt.Errorf("model is at event %s but the cursor is at %s", m.LastEventID, cur.LastEventID.UUID)
		}
		return q.SnapshotInsert(ctx, db.SnapshotInsertParams{
			StreamID: k.Stream, PerspectiveName: k.Perspective, SnapshotEventID: m.LastEventID, Model: m.Model,
		})
	})
	if err != nil {
		return fmt.Errorf("bootstrap: %w", err)
	}
	w.log.Info("snapshot bootstrapped", attrs...)
	return nil
}
