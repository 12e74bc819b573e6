package worker

import (
	"context"
	"fmt"
	"log/slog"

	"go.opentelemetry.io/otel/attribute"

	"github.com/perspectives-go/perspectives/locker"
)

// bootstrap writes the first snapshot of a pair whose model has a long enough history but
// no snapshot. It takes the stream lock with reason bootstrap when it can and proceeds when
// it cannot: the snapshot is of the model and position read together under the cursor row
// lock, so it is correct whoever else is working, and writing it twice is harmless.
func (w *Worker) bootstrap(ctx context.Context, k Pair) (err error) {
	attrs := w.logPair(k)
	locked := false
	if w.locker != nil {
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
