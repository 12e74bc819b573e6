package worker

// A purge: a pair's model and snapshots deleted and its cursor reset, under the stream lock
// (queries/purge.sql).

import (
	"context"
	"errors"
	"fmt"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/perspectives-go/perspectives/db"
	"github.com/perspectives-go/perspectives/locker"
)

// ErrLocked is returned by Purge when another instance holds the pair's stream lock.
var ErrLocked = errors.New("stream lock held by another instance")

// Purge deletes the model and snapshots of (streamID, perspectiveName) and resets its
// cursor, in every build of the perspective this worker applies (the active one, and one
// building beside it). With a locker it must first take each pair's stream lock (reason
// purge); when another instance holds one, Purge returns an error wrapping ErrLocked and
// that build's pair is not purged. Events still queued for the pair are applied afterwards,
// to a fresh model. A purge resets the model; it does not forget the stream's stored events:
// a late event queued after it (one that sorts before an event applied since) rewinds the
// pair from the stream's start (the purge dropped its snapshots), and that replay applies
// every stored event of the stream, those from before the purge too.
func (w *Worker) Purge(ctx context.Context, streamID uuid.UUID, perspectiveName string) error {
	if err := locker.ValidatePair(streamID, perspectiveName); err != nil {
		return fmt.Errorf("worker: purge: %w", err)
	}
	if w.persp[perspectiveName] == nil {
		return fmt.Errorf("worker: purge: %w: unknown perspective %q (this worker runs %v)",
			locker.ErrInvalidArgument, perspectiveName, w.names)
	}
	set := w.builds()
	var keys []string
	for _, key := range set.keys {
		if set.byKey[key].Perspective == perspectiveName {
			keys = append(keys, key)
		}
	}
	if len(keys) == 0 {
		return fmt.Errorf("worker: purge: this instance applies no version of perspective %q (a newer version is active)", perspectiveName)
	}
	for _, key := range keys {
		if err := w.purge(ctx, Pair{Stream: streamID, Perspective: key}); err != nil {
			return fmt.Errorf("worker: purge: %w", err)
		}
	}
	return nil
}

// purge purges one pair, under the apply coordinator and the stream lock.
func (w *Worker) purge(ctx context.Context, k Pair) (err error) {
	ctx, span := w.startSpan(ctx, "perspectives.purge", k)
	defer func() {
		result := "ok"
		switch {
		case errors.Is(err, ErrLocked):
			result = "locked"
		case err != nil:
			result = "error"
		}
		w.tel.purges.Add(context.WithoutCancel(ctx), 1, w.metricPair(k, attrResult.String(result)))
		endSpan(span, err)
	}()
	// The purge may make the pair due (a failing or parked pair's queued events) while its
	// stream lock and the apply coordinator keep the claims and jobs off it: once both are
	// released, this instance's loop claims it at once (it applies the pair).
	defer w.Notify()
	releaseCoord, err := w.coord.lock(ctx, k)
	if err != nil {
		return err
	}
	defer releaseCoord()
	holder := uuid.Nil
	if w.cfg.Locker != nil {
		l, err := w.acquire(ctx, k, locker.ReasonPurge)
		if err != nil {
			return fmt.Errorf("acquire stream lock: %w", err)
		}
		if l == nil {
			b := w.buildOf(k.Perspective)
			return fmt.Errorf("%s version %d, stream %s: %w", b.Perspective, b.Version, k.Stream, ErrLocked)
		}
		defer l.release()
		holder = w.cfg.InstanceID
	}
	if err := w.store.Purge(ctx, k, holder); err != nil {
		return err
	}
	w.log.Info("pair purged", w.logPair(k)...)
	return nil
}

func (s *pgStore) Purge(ctx context.Context, p Pair, holder uuid.UUID) error {
	return s.inTx(ctx, func(tx pgx.Tx, q *db.Queries) error { return s.purgeIn(ctx, tx, q, p, holder) })
}

// purgeIn is Purge in the transaction tx (q runs in it).
func (s *pgStore) purgeIn(ctx context.Context, tx pgx.Tx, q *db.Queries, p Pair, holder uuid.UUID) error {
	if _, err := q.CursorsEnsure(ctx, db.CursorsEnsureParams{StreamIds: []uuid.UUID{p.Stream}, PerspectiveNames: []string{p.Perspective}}); err != nil {
		return fmt.Errorf("create cursor: %w", err)
	}
	cur, err := q.CursorLock(ctx, db.CursorLockParams{StreamID: p.Stream, PerspectiveName: p.Perspective})
	if err != nil {
		return fmt.Errorf("lock cursor: %w", cursorGone(err))
	}
	if holder != uuid.Nil && cur.LockHolder != holder {
		return ErrLockLost
	}
	if _, err := q.ModelDelete(ctx, db.ModelDeleteParams{StreamID: p.Stream, PerspectiveName: p.Perspective}); err != nil {
		return fmt.Errorf("delete model: %w", err)
	}
	if _, err := q.SnapshotsDeleteFrom(ctx, db.SnapshotsDeleteFromParams{
		StreamID: p.Stream, PerspectiveName: p.Perspective, FromEventID: uuid.Nil,
	}); err != nil {
		return fmt.Errorf("delete snapshots: %w", err)
	}
	if err := q.CursorReset(ctx, db.CursorResetParams{StreamID: p.Stream, PerspectiveName: p.Perspective}); err != nil {
		return err
	}
	return s.w.writeSinks(ctx, tx, []pairChange{{Pair: p}})
}

// notifyIfDue tells the listening workers that p is due, when it is (see PairNotifyIfDue).
func (s *pgStore) notifyIfDue(ctx context.Context, p Pair) error {
	return s.q.PairNotifyIfDue(ctx, db.PairNotifyIfDueParams{StreamID: p.Stream, PerspectiveName: p.Perspective})
}

// PurgeStore is what a purge asks of the database.
type PurgeStore interface {
	// Purge deletes the pair's model and snapshots and resets its cursor, in one
	// transaction holding the cursor row. When holder is not nil it first checks that
	// holder holds an unexpired stream lock on the pair, and returns ErrLockLost otherwise.
	Purge(ctx context.Context, p Pair, holder uuid.UUID) error
}
