package worker

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/perspectives-go/perspectives/db"
	"github.com/perspectives-go/perspectives/locker"
)

// replayPageSize is how many events a rewind reads per round trip; memory does not grow
// with the stream's length.
const replayPageSize = 500

// errCursorMoved means the cursor changed while a long operation ran: its write is refused.
var errCursorMoved = errors.New("cursor moved during the operation")

// rewind rebuilds the pair's model because trigger (a queued event not newer than the
// cursor) arrived late. Under the stream lock (when a locker is configured) it restores the
// newest snapshot strictly before the earliest queued event, replays the stream from the
// event store in ID order, and commits under the fencing check. When the lock is not
// acquired it does nothing: the rows stay queued and the next cycle retries.
func (w *Worker) rewind(ctx context.Context, k pairKey, persp Perspective, trigger uuid.UUID) (err error) {
	attrs := []any{slog.String("perspective", k.Perspective), slog.String("stream", k.Stream.String()), slog.String("trigger", trigger.String())}
	if w.locker != nil {
		ok, release, err := w.acquire(ctx, k, locker.ReasonRewind)
		if err != nil {
			return fmt.Errorf("rewind: acquire stream lock: %w", err)
		}
		defer release()
		if !ok {
			w.log.Debug("rewind skipped: stream lock held by another instance", attrs...)
			return nil
		}
		lockSet := lockAttrs(k, locker.ReasonRewind)
		var ka *keepAlive
		ctx, ka = startKeepAlive(ctx, w.locker, k, w.cfg.InstanceID, w.cfg.LockOptions.KeepAliveInterval, w.log, keepAliveHooks{
			renewFailed: func() { w.tel.lockRenewFailures.Add(context.WithoutCancel(ctx), 1, lockSet) },
			lost: func() {
				w.tel.lockLost.Add(context.WithoutCancel(ctx), 1, metric.WithAttributes(
					attrPerspective.String(k.Perspective), attrReason.String(string(locker.ReasonRewind)), attrStage.String("renew")))
			},
		})
		defer ka.stop()
	}
	ctx, span := w.tel.startSpan(ctx, "perspectives.rewind", k, w.cfg.InstanceID)
	span.SetAttributes(attribute.String("trigger", trigger.String()))
	defer func() { endSpan(span, err) }()
	w.tel.rewindStarted.Add(ctx, 1, perspAttrs(k))

	start := time.Now()
	stats, err := w.runRewind(ctx, k, persp)
	if err != nil {
		w.tel.rewindFailed.Add(context.WithoutCancel(ctx), 1, perspAttrs(k))
		if cause := context.Cause(ctx); errors.Is(cause, ErrLockLost) {
			err = fmt.Errorf("%w: %w", cause, err)
		} else if errors.Is(err, ErrLockLost) {
			w.tel.lockLost.Add(context.WithoutCancel(ctx), 1, metric.WithAttributes(
				attrPerspective.String(k.Perspective), attrReason.String(string(locker.ReasonRewind)), attrStage.String("commit")))
		}
		return fmt.Errorf("rewind: %w", err)
	}
	if stats.replayed == 0 {
		return nil // nothing was queued any more
	}
	d := time.Since(start)
	done := metric.WithAttributes(attrPerspective.String(k.Perspective), attrFromSnapshot.Bool(stats.fromSnapshot))
	w.tel.rewindCompleted.Add(ctx, 1, done)
	w.tel.rewindDuration.Record(ctx, d.Seconds(), done)
	w.tel.rewindReplayed.Add(ctx, int64(stats.replayed), done)
	span.SetAttributes(attrFromSnapshot.Bool(stats.fromSnapshot), attribute.Int("events_replayed", stats.replayed))
	w.log.Info("rewind completed", append(attrs,
		slog.Int("replayed", stats.replayed), slog.Bool("from_snapshot", stats.fromSnapshot),
		slog.Duration("duration", d))...)
	return nil
}

type rewindStats struct {
	replayed     int
	fromSnapshot bool
}

func (w *Worker) runRewind(ctx context.Context, k pairKey, persp Perspective) (rewindStats, error) {
	var st rewindStats
	cur, err := w.store.CursorGet(ctx, db.CursorGetParams{StreamID: k.Stream, PerspectiveName: k.Perspective})
	if err != nil {
		return st, fmt.Errorf("read cursor: %w", err)
	}
	queuedIDs, err := w.store.QueueIDsForPair(ctx, db.QueueIDsForPairParams{StreamID: k.Stream, PerspectiveName: k.Perspective})
	if err != nil {
		return st, fmt.Errorf("read queue: %w", err)
	}
	if len(queuedIDs) == 0 {
		return st, nil // someone else applied them meanwhile
	}
	trigger := queuedIDs[0] // ascending: the earliest queued event
	upto := queuedIDs[len(queuedIDs)-1]
	if cur.LastEventID.Valid && less(upto, cur.LastEventID.UUID) {
		upto = cur.LastEventID.UUID
	}
	pending := make(map[uuid.UUID]bool, len(queuedIDs))
	for _, id := range queuedIDs {
		pending[id] = false
	}

	var model json.RawMessage
	after := uuid.Nil
	if !w.cfg.Snapshots.Disabled {
		snap, err := w.store.SnapshotLatestBefore(ctx, db.SnapshotLatestBeforeParams{
			StreamID: k.Stream, PerspectiveName: k.Perspective, BeforeEventID: trigger,
		})
		switch {
		case errors.Is(err, pgx.ErrNoRows):
		case err != nil:
			return st, fmt.Errorf("read snapshot: %w", err)
		default:
			model, after, st.fromSnapshot = json.RawMessage(snap.Model), snap.SnapshotEventID, true
		}
	}

	// Replay (after, upto] page by page, keeping only the newest snapshots taken on the way.
	var ring []snapshot
	counter := 0
	for {
		page, err := w.store.EventsReplayPage(ctx, db.EventsReplayPageParams{
			StreamID: k.Stream, AfterEventID: after, UptoEventID: upto, PageSize: replayPageSize,
		})
		if err != nil {
			return st, fmt.Errorf("replay: %w", err)
		}
		for _, e := range page {
			ev := Event{ID: e.EventID, StreamID: e.StreamID, Type: e.EventType, Data: json.RawMessage(e.Data), CreatedAt: e.CreatedAt}
			next, err := w.applyOne(ctx, persp, model, ev)
			if err != nil {
				return st, fmt.Errorf("replay event %s (%s): %w", ev.ID, ev.Type, err)
			}
			model = next
			st.replayed++
			if _, ok := pending[ev.ID]; ok {
				pending[ev.ID] = true
			}
			counter++
			if !w.cfg.Snapshots.Disabled && counter >= w.cfg.Snapshots.EveryNEvents {
				ring = append(ring, snapshot{eventID: ev.ID, model: model})
				if len(ring) > w.cfg.Snapshots.MaxPerStream {
					ring = ring[1:]
				}
				counter = 0
			}
			after = ev.ID
		}
		if len(page) < replayPageSize {
			break
		}
	}
	if ctx.Err() != nil {
		return st, context.Cause(ctx)
	}
	replayedQueued := make([]uuid.UUID, 0, len(pending))
	for id, seen := range pending {
		if seen {
			replayedQueued = append(replayedQueued, id)
		}
	}
	if model == nil || len(replayedQueued) == 0 {
		return st, fmt.Errorf("replay reached none of the queued events (up to %s)", upto)
	}

	err = w.store.InTx(ctx, func(q db.Querier) error {
		now, err := q.CursorLock(ctx, db.CursorLockParams{StreamID: k.Stream, PerspectiveName: k.Perspective})
		if err != nil {
			return fmt.Errorf("lock cursor: %w", err)
		}
		if w.locker != nil && !holdsLock(now, w.cfg.InstanceID) {
			return ErrLockLost
		}
		if now.Version != cur.Version {
			return errCursorMoved
		}
		if _, err := q.PairApplyCommit(ctx, db.PairApplyCommitParams{
			StreamID: k.Stream, PerspectiveName: k.Perspective, Model: []byte(model),
			LastEventID: upto, EventsSinceSnapshot: int32(counter), EventIds: replayedQueued,
		}); err != nil {
			return fmt.Errorf("write model: %w", err)
		}
		if _, err := q.SnapshotsDeleteFrom(ctx, db.SnapshotsDeleteFromParams{
			StreamID: k.Stream, PerspectiveName: k.Perspective, FromEventID: trigger,
		}); err != nil {
			return fmt.Errorf("drop invalidated snapshots: %w", err)
		}
		return w.writeSnapshots(ctx, q, k, ring)
	})
	if err != nil {
		return st, fmt.Errorf("commit: %w", err)
	}
	return st, nil
}

// less orders event IDs as PostgreSQL orders uuid values (byte-wise).
func less(a, b uuid.UUID) bool { return bytes.Compare(a[:], b[:]) < 0 }

// compareIDs orders event IDs as PostgreSQL orders uuid values (bytewise).
func compareIDs(a, b uuid.UUID) int { return bytes.Compare(a[:], b[:]) }

// holdsLock is the fencing check: instance holds an unexpired stream lock on the locked
// cursor row (expiry judged by the database clock when the row was read).
func holdsLock(cur db.CursorLockRow, instance uuid.UUID) bool {
	return cur.StreamLockInstanceID.Valid && cur.StreamLockInstanceID.UUID == instance && cur.LockLive
}
