package worker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"github.com/google/uuid"

	"github.com/perspectives-go/perspectives/db"
	"github.com/perspectives-go/perspectives/locker"
)

// ErrLocked is returned by Purge when another instance holds the pair's stream lock.
var ErrLocked = errors.New("stream lock held by another instance")

// Purge deletes the model and snapshots of (streamID, perspectiveName) and resets its
// cursor. With a locker it must first take the stream lock (reason purge); when another
// instance holds it, Purge returns an error wrapping ErrLocked and deletes nothing. Events
// still queued for the pair are applied afterwards, to a fresh model.
func (w *Worker) Purge(ctx context.Context, streamID uuid.UUID, perspectiveName string) error {
	if err := locker.ValidatePair(streamID, perspectiveName); err != nil {
		return fmt.Errorf("worker: purge: %w", err)
	}
	if w.persp[perspectiveName] == nil {
		return fmt.Errorf("worker: purge: %w: unknown perspective %q (this worker runs %v)",
			locker.ErrInvalidArgument, perspectiveName, w.names)
	}
	k := pairKey{Stream: streamID, Perspective: perspectiveName}
	releaseCoord, err := w.coord.lock(ctx, k)
	if err != nil {
		return fmt.Errorf("worker: purge: %w", err)
	}
	defer releaseCoord()
	if w.locker != nil {
		ok, release, err := w.acquire(ctx, k, locker.ReasonPurge)
		if err != nil {
			return fmt.Errorf("worker: purge: acquire stream lock: %w", err)
		}
		defer release()
		if !ok {
			return fmt.Errorf("worker: purge %s/%s: %w", perspectiveName, streamID, ErrLocked)
		}
	}
	err = w.store.InTx(ctx, func(q db.Querier) error {
		if err := q.CursorEnsure(ctx, db.CursorEnsureParams{StreamID: k.Stream, PerspectiveName: k.Perspective}); err != nil {
			return err
		}
		cur, err := q.CursorLock(ctx, db.CursorLockParams{StreamID: k.Stream, PerspectiveName: k.Perspective})
		if err != nil {
			return fmt.Errorf("lock cursor: %w", err)
		}
		if w.locker != nil && !(cur.StreamLockInstanceID.Valid && cur.StreamLockInstanceID.UUID == w.cfg.InstanceID && cur.LockLive) {
			return ErrLockLost
		}
		if _, err := q.ModelDelete(ctx, db.ModelDeleteParams{StreamID: k.Stream, PerspectiveName: k.Perspective}); err != nil {
			return fmt.Errorf("delete model: %w", err)
		}
		if _, err := q.SnapshotsDeleteAll(ctx, db.SnapshotsDeleteAllParams{StreamID: k.Stream, PerspectiveName: k.Perspective}); err != nil {
			return fmt.Errorf("delete snapshots: %w", err)
		}
		return q.CursorReset(ctx, db.CursorResetParams{StreamID: k.Stream, PerspectiveName: k.Perspective})
	})
	if err != nil {
		return fmt.Errorf("worker: purge: %w", err)
	}
	w.log.Info("pair purged", slog.String("perspective", perspectiveName), slog.String("stream", streamID.String()))
	return nil
}
