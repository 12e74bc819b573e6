package worker

// A rewind: a late event replayed from the newest snapshot before it, under the stream
// lock (queries/rewind.sql).

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

	"github.com/perspectives-go/perspectives/db"
	"github.com/perspectives-go/perspectives/locker"
)

// replayPageSize is how many events a rewind reads per round trip; memory does not grow
// with the stream's length.
const replayPageSize = 500

// rewind rebuilds the pair's model because a queued event is not newer than its cursor (it
// arrived late). Under the stream lock (when a locker is configured), kept alive while it
// runs, it restores the newest snapshot strictly before the earliest queued event, replays
// the stream from the event store in ID order, and commits under the fencing check. When
// the lock is refused it does nothing and reports contended: the rows stay queued and a
// later cycle retries.
func (w *Worker) rewind(ctx context.Context, k Pair) (contended bool, err error) {
	attrs := w.logPair(k)
	holder := uuid.Nil
	if w.cfg.Locker != nil {
		l, aerr := w.acquire(ctx, k, locker.ReasonRewind)
		if aerr != nil {
			return false, fmt.Errorf("rewind: acquire stream lock: %w", aerr)
		}
		if l == nil {
			w.log.Debug("rewind skipped: stream lock held by another instance", attrs...)
			return true, nil
		}
		defer l.release()
		ctx = l.keepAlive(ctx)
		holder = w.cfg.InstanceID
	}
	ctx, span := w.startSpan(ctx, "perspectives.rewind", k)
	defer func() { endSpan(span, err) }()
	w.tel.rewindStarted.Add(ctx, 1, w.metricPair(k))

	start := time.Now()
	stats, err := w.replay(ctx, k, holder)
	if err != nil {
		w.tel.rewindFailed.Add(context.WithoutCancel(ctx), 1, w.metricPair(k))
		if cause := context.Cause(ctx); errors.Is(cause, ErrLockLost) {
			if !errors.Is(err, cause) {
				err = fmt.Errorf("%w: %w", cause, err)
			}
		} else if errors.Is(err, ErrLockLost) {
			w.tel.lockLost.Add(context.WithoutCancel(ctx), 1, w.metricPair(k,
				attrReason.String(string(locker.ReasonRewind)), attrStage.String("commit")))
		}
		return false, fmt.Errorf("rewind: %w", err)
	}
	if stats.replayed == 0 {
		return false, nil // nothing was queued any more
	}
	d := time.Since(start)
	done := w.metricPair(k, attrFromSnapshot.Bool(stats.fromSnapshot))
	w.tel.rewindCompleted.Add(ctx, 1, done)
	w.tel.rewindDuration.Record(ctx, d.Seconds(), done)
	w.tel.rewindReplayed.Add(ctx, int64(stats.replayed), done)
	span.SetAttributes(attrFromSnapshot.Bool(stats.fromSnapshot), attribute.Int("events_replayed", stats.replayed),
		attribute.String("trigger", stats.trigger.String()))
	w.log.Info("rewind completed", append(attrs, slog.String("trigger", stats.trigger.String()),
		slog.Int("replayed", stats.replayed), slog.Bool("from_snapshot", stats.fromSnapshot),
		slog.Duration("duration", d))...)
	return false, nil
}

type rewindStats struct {
	trigger      uuid.UUID // the earliest queued event
	replayed     int
	fromSnapshot bool
}

// replay is the rewind's work: restore, replay, commit (fenced by holder when not nil).
func (w *Worker) replay(ctx context.Context, k Pair, holder uuid.UUID) (rewindStats, error) {
	var st rewindStats
	persp := w.buildOf(k.Perspective).persp
	rs, err := w.store.RewindStart(ctx, k)
	if err != nil {
		return st, err
	}
	if len(rs.Queued) == 0 {
		return st, nil // someone else applied them meanwhile
	}
	st.trigger = rs.Queued[0] // ascending: the earliest queued event
	upto := rs.Queued[len(rs.Queued)-1]
	if rs.LastEventID.Valid && compareIDs(upto, rs.LastEventID.UUID) < 0 {
		upto = rs.LastEventID.UUID
	}
	pending := make(map[uuid.UUID]bool, len(rs.Queued))
	for _, id := range rs.Queued {
		pending[id] = false
	}

	var model json.RawMessage
	after := uuid.Nil
	if !w.cfg.Snapshots.Disabled && rs.From != nil {
		model, after, st.fromSnapshot = rs.From.Model, rs.From.EventID, true
	}
	// Replay (after, upto] page by page, keeping only the snapshots the retention would.
	// An event whose Apply fails ends the replay: what precedes it is committed when that
	// moves the cursor forward (the failing event is one not applied before: a queued one),
	// so the late events before a poison event are applied; else nothing is. Either way the
	// failure is returned, to be recorded on the pair with its event.
	var snaps []Snapshot
	var failed error
	since := 0
	for {
		page, err := w.store.Replay(ctx, k, after, upto, replayPageSize)
		if err != nil {
			return st, fmt.Errorf("replay: %w", err)
		}
		f := w.fold(ctx, persp, model, since, page)
		if ctx.Err() != nil {
			// The stream lock lost, or a shutdown: an Apply that failed meanwhile may have
			// failed for that (its ctx ended), so the failure is not its event's.
			return st, context.Cause(ctx)
		}
		if f.err != nil {
			if rs.LastEventID.Valid && compareIDs(rs.LastEventID.UUID, failedEvent(f.err)) >= 0 {
				return st, fmt.Errorf("replay: %w", f.err)
			}
			failed = fmt.Errorf("replay: %w", f.err)
		}
		model, since = f.model, f.since
		snaps, _ = w.retain(append(snaps, f.snaps...), rs.Snapshots)
		for _, id := range f.applied {
			if _, ok := pending[id]; ok {
				pending[id] = true
			}
		}
		st.replayed += len(f.applied)
		if len(f.applied) > 0 {
			after = f.applied[len(f.applied)-1]
		}
		if failed != nil || len(page) < replayPageSize {
			break
		}
		after = page[len(page)-1].ID
	}
	if failed != nil {
		upto = after // the last event replayed: the cursor's new position
	}
	replayedQueued := make([]uuid.UUID, 0, len(pending))
	for _, id := range rs.Queued {
		if pending[id] {
			replayedQueued = append(replayedQueued, id)
		}
	}
	if model == nil || len(replayedQueued) == 0 {
		if failed != nil {
			return st, failed
		}
		return st, fmt.Errorf("replay reached none of the queued events (up to %s)", upto)
	}
	keep, drop := w.retain(snaps, rs.Snapshots)
	err = w.store.RewindCommit(ctx, RewindCommit{
		Write: PairWrite{
			Pair: k, Applied: replayedQueued, Model: model, LastEventID: upto, SinceSnapshot: since,
			Snapshots: keep, DropSnapshots: drop,
		},
		Version:  rs.Version,
		Holder:   holder,
		DropFrom: st.trigger,
	})
	if err != nil {
		return st, fmt.Errorf("commit: %w", err)
	}
	return st, failed
}

// compareIDs orders event IDs as PostgreSQL orders uuid values (byte-wise).
func compareIDs(a, b uuid.UUID) int { return bytes.Compare(a[:], b[:]) }

// RewindStart is what a rewind starts from.
type RewindStart struct {
	Version     int64         // the cursor's version: the commit is refused if it changed
	LastEventID uuid.NullUUID // the cursor's position
	Queued      []uuid.UUID   // the pair's queued event IDs, ascending
	From        *Snapshot     // the newest snapshot strictly before Queued[0]; nil: none
	Snapshots   []uuid.UUID   // every snapshot position before Queued[0], newest first
}

// RewindCommit is a rewind's result, written by Store.RewindCommit.
type RewindCommit struct {
	Write    PairWrite // the replayed model; Applied are the queued events the replay covered
	Version  int64     // fencing: the cursor version the rewind started from
	Holder   uuid.UUID // fencing: the instance that must hold the stream lock; uuid.Nil: no locker
	DropFrom uuid.UUID // snapshots at or after this event (the late one) are invalid
}

func (s *pgStore) RewindStart(ctx context.Context, p Pair) (RewindStart, error) {
	var rs RewindStart
	cur, err := s.q.CursorGet(ctx, db.CursorGetParams{StreamID: p.Stream, PerspectiveName: p.Perspective})
	if err != nil {
		return rs, fmt.Errorf("read cursor: %w", err)
	}
	rs.Version, rs.LastEventID = cur.Version, cur.LastEventID
	if rs.Queued, err = s.q.QueueIDsForPair(ctx, db.QueueIDsForPairParams{StreamID: p.Stream, PerspectiveName: p.Perspective}); err != nil {
		return rs, fmt.Errorf("read queue: %w", err)
	}
	if len(rs.Queued) == 0 {
		return rs, nil
	}
	first := rs.Queued[0]
	snap, err := s.q.SnapshotLatestBefore(ctx, db.SnapshotLatestBeforeParams{
		StreamID: p.Stream, PerspectiveName: p.Perspective, BeforeEventID: first,
	})
	switch {
	case errors.Is(err, pgx.ErrNoRows):
	case err != nil:
		return rs, fmt.Errorf("read snapshot: %w", err)
	default:
		rs.From = &Snapshot{EventID: snap.SnapshotEventID, Model: json.RawMessage(snap.Model)}
	}
	ids, err := s.q.SnapshotIDs(ctx, db.SnapshotIDsParams{StreamID: p.Stream, PerspectiveName: p.Perspective})
	if err != nil {
		return rs, fmt.Errorf("list snapshots: %w", err)
	}
	for _, id := range ids {
		if compareIDs(id, first) < 0 {
			rs.Snapshots = append(rs.Snapshots, id)
		}
	}
	return rs, nil
}

func (s *pgStore) Replay(ctx context.Context, p Pair, after, upto uuid.UUID, limit int) ([]Event, error) {
	rows, err := s.q.EventsReplayPage(ctx, db.EventsReplayPageParams{
		StreamID: p.Stream, BuildKey: p.Perspective, AfterEventID: after, UptoEventID: upto, PageSize: int32(limit),
	})
	if err != nil {
		return nil, err
	}
	events := make([]Event, len(rows))
	for i, r := range rows {
		events[i] = eventOf(r)
	}
	return events, nil
}

func (s *pgStore) RewindCommit(ctx context.Context, c RewindCommit) error {
	p := c.Write.Pair
	return s.inTx(ctx, func(tx pgx.Tx, q *db.Queries) error {
		cur, err := q.CursorLock(ctx, db.CursorLockParams{StreamID: p.Stream, PerspectiveName: p.Perspective})
		if err != nil {
			return fmt.Errorf("lock cursor: %w", err)
		}
		if c.Holder != uuid.Nil && cur.LockHolder != c.Holder {
			return ErrLockLost
		}
		if cur.Version != c.Version {
			return ErrCursorMoved
		}
		// Before the replay's own snapshots are written: some may be at those positions.
		if _, err := q.SnapshotsDeleteFrom(ctx, db.SnapshotsDeleteFromParams{
			StreamID: p.Stream, PerspectiveName: p.Perspective, FromEventID: c.DropFrom,
		}); err != nil {
			return fmt.Errorf("drop invalidated snapshots: %w", err)
		}
		return s.writePairs(ctx, tx, q, []PairWrite{c.Write}, nil, replayed)
	})
}

// RewindStore is what a rewind asks of the database.
type RewindStore interface {
	// RewindStart reads what a rewind starts from (not in a transaction).
	RewindStart(ctx context.Context, p Pair) (RewindStart, error)
	// Replay returns up to limit events of the pair's stream after the event after
	// (exclusive) and up to upto (inclusive), in ID order, without those the pair skipped.
	Replay(ctx context.Context, p Pair, after, upto uuid.UUID, limit int) ([]Event, error)
	// RewindCommit writes a rewind's result in one transaction that holds the pair's cursor
	// row, after the fencing check: it returns ErrLockLost, writing nothing, unless
	// c.Holder (when not nil) holds an unexpired stream lock on the pair, and
	// ErrCursorMoved unless the cursor's version is still c.Version.
	RewindCommit(ctx context.Context, c RewindCommit) error
}
