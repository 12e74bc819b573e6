package worker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/metric"

	"github.com/perspectives-go/perspectives/db"
	"github.com/perspectives-go/perspectives/locker"
)

// ErrLocked is returned by Purge when another instance holds the pair's stream lock.
var ErrLocked = errors.New("stream lock held by another instance")

// Purge deletes the model and snapshots of (streamID, perspectiveName) and resets its
// cursor. With a locker it must first take the stream lock (reason purge); when another
// instance holds it, Purge returns an error wrapping ErrLocked and deletes nothing. Events
// still queued for the pair are applied afterwards, to a fresh model.
func (w *Worker) Purge(ctx context.Context, streamID uuid.UUID, perspectiveName string) (err error) {
	if err := locker.ValidatePair(streamID, perspectiveName); err != nil {
		return fmt.Errorf("worker: purge: %w", err)
	}
	if w.persp[perspectiveName] == nil {
		return fmt.Errorf("worker: purge: %w: unknown perspective %q (this worker runs %v)",
			locker.ErrInvalidArgument, perspectiveName, w.names)
	}
	k := Pair{Stream: streamID, Perspective: perspectiveName}
	ctx, span := w.tel.startSpan(ctx, "perspectives.purge", k, w.cfg.InstanceID)
	defer func() {
		result := "ok"
		switch {
		case errors.Is(err, ErrLocked):
			result = "locked"
		case err != nil:
			result = "error"
		}
		w.tel.purges.Add(context.WithoutCancel(ctx), 1, metric.WithAttributes(attrPerspective.String(perspectiveName), attrResult.String(result)))
		endSpan(span, err)
	}()
	releaseCoord, err := w.coord.lock(ctx, k)
	if err != nil {
		return fmt.Errorf("worker: purge: %w", err)
	}
	defer releaseCoord()
	holder := uuid.Nil
	if w.locker != nil {
		l, err := w.acquire(ctx, k, locker.ReasonPurge)
		if err != nil {
			return fmt.Errorf("worker: purge: acquire stream lock: %w", err)
		}
		if l == nil {
			return fmt.Errorf("worker: purge %s/%s: %w", perspectiveName, streamID, ErrLocked)
		}
		defer l.release()
		holder = w.cfg.InstanceID
	}
	if err := w.store.Purge(ctx, k, holder); err != nil {
		return fmt.Errorf("worker: purge: %w", err)
	}
	w.log.Info("pair purged", slog.String("perspective", perspectiveName), slog.String("stream", streamID.String()))
	return nil
}

// Admin runs operators' actions on a database without running any perspective: purging a
// pair and queueing a rebuild, under the stream lock. Running workers apply the results.
type Admin struct {
	store    *pgStore
	locker   locker.Locker
	instance uuid.UUID
}

// NewAdmin returns an Admin on pool. l is the locker the workers use (nil: none); like the
// worker's, it must keep its locks on the cursor rows (locker.CursorRowLocker). The Admin
// takes stream locks under its own new instance ID.
func NewAdmin(pool *pgxpool.Pool, l locker.Locker) (*Admin, error) {
	if pool == nil {
		return nil, fmt.Errorf("worker: admin: %w: pool is nil", locker.ErrInvalidArgument)
	}
	if l != nil && isNil(l) {
		return nil, fmt.Errorf("worker: admin: %w: locker is a nil %T: pass a locker, or nil for none", locker.ErrInvalidArgument, l)
	}
	if _, ok := l.(locker.CursorRowLocker); l != nil && !ok {
		return nil, fmt.Errorf("worker: admin: %w: locker is a %T, which does not keep its locks on the cursor rows (see locker.CursorRowLocker)", locker.ErrInvalidArgument, l)
	}
	id, err := uuid.NewV7()
	if err != nil {
		return nil, fmt.Errorf("worker: admin: %w", err)
	}
	return &Admin{store: newPGStore(pool, DefaultRetryBackoff, DefaultMaxRetryBackoff), locker: l, instance: id}, nil
}

// Purge is Worker.Purge for a registered perspective, from outside any worker.
func (a *Admin) Purge(ctx context.Context, streamID uuid.UUID, perspectiveName string) error {
	return a.withLock(ctx, streamID, perspectiveName, "purge", func(k Pair, holder uuid.UUID) error {
		return a.store.Purge(ctx, k, holder)
	})
}

// Rebuild purges (streamID, perspectiveName) and queues every stored event of the stream
// for it again, so that running workers rebuild the model from the start. It returns the
// number of events queued.
func (a *Admin) Rebuild(ctx context.Context, streamID uuid.UUID, perspectiveName string) (int64, error) {
	var queued int64
	err := a.withLock(ctx, streamID, perspectiveName, "rebuild", func(k Pair, holder uuid.UUID) error {
		if err := a.store.Purge(ctx, k, holder); err != nil {
			return err
		}
		n, err := a.store.q.QueueEnqueueStream(ctx, db.QueueEnqueueStreamParams{StreamID: streamID, PerspectiveName: perspectiveName})
		queued = n
		return err
	})
	return queued, err
}

// withLock runs fn on the pair under the stream lock (reason purge) when the Admin has a
// locker; fn gets the holder to fence its write with (uuid.Nil without a locker).
func (a *Admin) withLock(ctx context.Context, streamID uuid.UUID, perspectiveName, op string, fn func(k Pair, holder uuid.UUID) error) error {
	if err := locker.ValidatePair(streamID, perspectiveName); err != nil {
		return fmt.Errorf("worker: %s: %w", op, err)
	}
	known, err := a.store.q.PerspectiveExists(ctx, perspectiveName)
	if err != nil {
		return fmt.Errorf("worker: %s: %w", op, err)
	}
	if !known {
		return fmt.Errorf("worker: %s: %w: perspective %q is not registered", op, locker.ErrInvalidArgument, perspectiveName)
	}
	k := Pair{Stream: streamID, Perspective: perspectiveName}
	holder := uuid.Nil
	if a.locker != nil {
		ok, err := a.locker.TryAcquire(ctx, streamID, perspectiveName, a.instance, locker.ReasonPurge)
		if err != nil {
			return fmt.Errorf("worker: %s: acquire stream lock: %w", op, err)
		}
		if !ok {
			return fmt.Errorf("worker: %s %s/%s: %w", op, perspectiveName, streamID, ErrLocked)
		}
		defer func() {
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), releaseTimeout)
			defer cancel()
			_ = a.locker.Release(rctx, streamID, perspectiveName, a.instance)
		}()
		holder = a.instance
	}
	if err := fn(k, holder); err != nil {
		return fmt.Errorf("worker: %s: %w", op, err)
	}
	return nil
}
