package worker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/perspectives-go/perspectives/db"
)

// normalResult says what the normal path did or found.
type normalResult struct {
	applied        int       // events applied and committed
	rewindFrom     uuid.UUID // a queued event older than the cursor: rewind from it
	needsBootstrap bool      // the pair has a model but no snapshot
}

// applyNormal applies the pair's queued events, in ID order, in one short transaction that
// holds the cursor row. It writes nothing when the pair is busy, locked by another
// instance, needs a rewind (a queued event is not newer than the cursor) or a bootstrap.
// An event whose Apply fails ends the batch: the events before it are committed, it and
// the ones after stay queued, and the failure is recorded for a retry with backoff.
func (w *Worker) applyNormal(ctx context.Context, k pairKey, persp Perspective) (normalResult, error) {
	var res normalResult
	var applyErr error
	err := w.store.InTx(ctx, func(q db.Querier) error {
		res, applyErr = normalResult{}, nil
		cur, err := w.lockPairNoWait(ctx, q, k)
		if errors.Is(err, errBusy) {
			return nil // another transaction is applying the pair
		}
		if err != nil {
			return err
		}
		if w.lockedElsewhere(cur.StreamLockInstanceID, cur.LockLive) {
			return nil // another instance holds the stream lock: its events stay queued
		}
		queued, err := q.QueueEventsForPair(ctx, db.QueueEventsForPairParams{
			StreamID: k.Stream, PerspectiveName: k.Perspective, RowLimit: int32(w.cfg.BatchSize),
		})
		if err != nil || len(queued) == 0 {
			return err
		}
		if next, ok := w.followUp(cur.LastEventID, cur.HasSnapshot, queued[0].EventID); ok {
			res = next
			return nil
		}
		var model json.RawMessage
		if cur.LastEventID.Valid {
			// Read after the row lock, in a statement of its own (see PairLockForApply):
			// no other writer can change the model while this transaction holds the row.
			m, err := q.ModelGet(ctx, db.ModelGetParams{StreamID: k.Stream, PerspectiveName: k.Perspective})
			if err != nil {
				return fmt.Errorf("load model: %w", err)
			}
			if m.LastEventID != cur.LastEventID.UUID {
				return fmt.Errorf("model is at event %s but the cursor is at %s", m.LastEventID, cur.LastEventID.UUID)
			}
			model = json.RawMessage(m.Model)
		}

		events := make([]Event, len(queued))
		for i, qe := range queued {
			events[i] = Event{ID: qe.EventID, StreamID: k.Stream, Type: qe.EventType, Data: json.RawMessage(qe.Data), CreatedAt: qe.CreatedAt}
		}
		f := w.fold(ctx, persp, model, int(cur.EventsSinceSnapshot), events)
		applied := f.applied
		applyErr = f.err
		if len(applied) > 0 {
			deleted, err := q.PairApplyCommit(ctx, db.PairApplyCommitParams{
				StreamID: k.Stream, PerspectiveName: k.Perspective, Model: []byte(f.model),
				LastEventID: applied[len(applied)-1], EventsSinceSnapshot: int32(f.since), EventIds: applied,
			})
			if err != nil {
				return fmt.Errorf("write model: %w", err)
			}
			if int(deleted) != len(applied) {
				return fmt.Errorf("deleted %d queue rows for %d applied events", deleted, len(applied))
			}
			if err := w.writeSnapshots(ctx, q, k, f.snaps); err != nil {
				return err
			}
			res.applied = len(applied)
		}
		if applyErr != nil {
			return w.markFailed(ctx, q, k, applyErr)
		}
		return nil
	})
	if err != nil {
		return normalResult{}, fmt.Errorf("apply: %w", err)
	}
	w.reportApplied(ctx, k, res.applied, applyErr)
	return res, nil
}

// lockedElsewhere says whether a cursor's stream lock (its holder, and whether it is
// unexpired) belongs to another instance: the pair's events then stay queued.
func (w *Worker) lockedElsewhere(holder uuid.NullUUID, live bool) bool {
	return holder.Valid && live && holder.UUID != w.cfg.InstanceID
}

// followUp says what a pair needs before its queued events (the lowest is first) can be
// applied to the model at last: a rewind when first is not newer than last, a bootstrap
// when the pair has a model but no snapshot (snapshots enabled).
func (w *Worker) followUp(last uuid.NullUUID, hasSnapshot bool, first uuid.UUID) (normalResult, bool) {
	switch {
	case last.Valid && !less(last.UUID, first):
		return normalResult{rewindFrom: first}, true
	case last.Valid && !w.cfg.Snapshots.Disabled && !hasSnapshot:
		return normalResult{needsBootstrap: true}, true
	}
	return normalResult{}, false
}

// reportApplied records the metrics and logs of one pair's committed application: applied
// events, and the Apply failure that stopped it, if any.
func (w *Worker) reportApplied(ctx context.Context, k pairKey, applied int, applyErr error) {
	if applyErr != nil {
		w.log.Error("event application failed; will retry with backoff",
			slog.String("perspective", k.Perspective), slog.String("stream", k.Stream.String()),
			slog.Int("applied_before_failure", applied), slog.Any("error", applyErr))
	}
	if applied > 0 {
		w.tel.eventsApplied.Add(ctx, int64(applied), perspAttrs(k))
	}
	if applyErr == nil && applied > 0 {
		w.log.Debug("events applied",
			slog.String("perspective", k.Perspective), slog.String("stream", k.Stream.String()), slog.Int("events", applied))
	}
}

var errBusy = errors.New("pair is being applied by another transaction")

// lockPairNoWait locks k's cursor row in the current transaction, creating it when missing
// (Append and registration create it; this covers a row removed by hand).
// errBusy means another transaction holds it.
func (w *Worker) lockPairNoWait(ctx context.Context, q db.Querier, k pairKey) (db.PairLockForApplyRow, error) {
	params := db.PairLockForApplyParams{StreamID: k.Stream, PerspectiveName: k.Perspective}
	cur, err := q.PairLockForApply(ctx, params)
	if !errors.Is(err, pgx.ErrNoRows) {
		return cur, err
	}
	if err := q.CursorEnsure(ctx, db.CursorEnsureParams{StreamID: k.Stream, PerspectiveName: k.Perspective}); err != nil {
		return cur, err
	}
	cur, err = q.PairLockForApply(ctx, params)
	if errors.Is(err, pgx.ErrNoRows) {
		return cur, errBusy
	}
	return cur, err
}

// folded is the outcome of applying a pair's queued events in order.
type folded struct {
	model   json.RawMessage // the model after the applied events
	applied []uuid.UUID     // the events applied, in order
	snaps   []snapshot      // the snapshots due among them
	since   int             // events since the last snapshot, after the applied ones
	err     error           // the Apply failure that ended the fold (its event and later ones not applied)
}

// fold applies events (in ID order) to model, taking a snapshot each time
// Snapshots.EveryNEvents events have been applied since the last one (since of them before
// the first event). The first event whose Apply fails ends it.
func (w *Worker) fold(ctx context.Context, persp Perspective, model json.RawMessage, since int, events []Event) folded {
	f := folded{model: model, since: since, applied: make([]uuid.UUID, 0, len(events))}
	for _, ev := range events {
		next, err := w.applyOne(ctx, persp, f.model, ev)
		if err != nil {
			f.err = fmt.Errorf("apply event %s (%s): %w", ev.ID, ev.Type, err)
			break
		}
		f.model = next
		f.applied = append(f.applied, ev.ID)
		f.since++
		if !w.cfg.Snapshots.Disabled && f.since >= w.cfg.Snapshots.EveryNEvents {
			f.snaps = append(f.snaps, snapshot{eventID: ev.ID, model: f.model})
			f.since = 0
		}
	}
	return f
}

// applyOne runs the perspective's Apply, turning a panic or an invalid model into an error.
func (w *Worker) applyOne(ctx context.Context, persp Perspective, model json.RawMessage, ev Event) (next json.RawMessage, err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("panic in Apply: %v", r)
		}
	}()
	next, err = persp.Apply(ctx, model, ev)
	if err != nil {
		return nil, err
	}
	if len(next) == 0 || !json.Valid(next) {
		return nil, fmt.Errorf("perspective %s returned a model that is not valid JSON", persp.Name())
	}
	return next, nil
}
