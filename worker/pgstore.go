package worker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/perspectives-go/perspectives/db"
)

// pgStore is the Store on a pgx pool, over the sqlc queries of queries/.
type pgStore struct {
	pool *pgxpool.Pool
	q    *db.Queries
	// retryBase and retryMax are the failure backoff (Config.RetryBackoff, MaxRetryBackoff).
	retryBase, retryMax time.Duration
}

var _ Store = (*pgStore)(nil)

func newPGStore(pool *pgxpool.Pool, retryBase, retryMax time.Duration) *pgStore {
	return &pgStore{pool: pool, q: db.New(pool), retryBase: retryBase, retryMax: retryMax}
}

// inTx runs fn in one transaction: committed when fn returns nil, rolled back otherwise.
func (s *pgStore) inTx(ctx context.Context, fn func(q *db.Queries) error) error {
	return pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error { return fn(db.New(tx)) })
}

// eventOf is a stored event as the worker sees it.
func eventOf(e db.WhEventStore) Event {
	return Event{ID: e.EventID, StreamID: e.StreamID, Type: e.EventType, Data: json.RawMessage(e.Data), CreatedAt: e.CreatedAt}
}

// pairArrays gives pairs as the two parallel arrays (stream_ids, perspective_names) the
// statements take.
func pairArrays(pairs []Pair) ([]uuid.UUID, []string) {
	streams, names := make([]uuid.UUID, len(pairs)), make([]string, len(pairs))
	for i, p := range pairs {
		streams[i], names[i] = p.Stream, p.Perspective
	}
	return streams, names
}

func (s *pgStore) Register(ctx context.Context, perspective string) (int64, error) {
	var queued int64
	err := s.inTx(ctx, func(q *db.Queries) error {
		// The exclusive side of the append lock: no Append commits while the backlog is
		// queued (see AppendLockAndNotify).
		if err := q.RegisterLock(ctx); err != nil {
			return err
		}
		n, err := q.PerspectiveRegister(ctx, perspective)
		if err != nil || n == 0 {
			return err
		}
		queued, err = q.PerspectiveEnqueueBacklog(ctx, perspective)
		return err
	})
	return queued, err
}

func (s *pgStore) Claim(ctx context.Context, req ClaimRequest) ([]Pair, error) {
	skip := make([]string, len(req.Skip))
	for i, p := range req.Skip {
		skip[i] = p.Stream.String() + "/" + p.Perspective
	}
	rows, err := s.q.QueueDuePairs(ctx, db.QueueDuePairsParams{
		InstanceID:       req.Instance,
		PerspectiveNames: req.Perspectives,
		BusyPairs:        skip,
		PairLimit:        int32(req.Limit),
		MaxSteps:         int32(req.MaxSteps),
	})
	if err != nil {
		return nil, err
	}
	pairs := make([]Pair, len(rows))
	for i, r := range rows {
		pairs[i] = Pair{Stream: r.StreamID, Perspective: r.PerspectiveName}
	}
	return pairs, nil
}

func (s *pgStore) Apply(ctx context.Context, pairs []Pair, perPair int, decide func([]PairState) []PairWrite) ([]Pair, error) {
	var busy []Pair
	err := s.inTx(ctx, func(q *db.Queries) error {
		states, held, err := lockPairs(ctx, q, pairs)
		busy = held
		if err != nil || len(states) == 0 {
			return err
		}
		if err := readPairs(ctx, q, states, perPair); err != nil {
			return err
		}
		return s.writePairs(ctx, q, decide(states))
	})
	if err != nil {
		return nil, err
	}
	return busy, nil
}

// lockPairs locks the cursor rows of pairs (creating the missing ones) and returns the
// state of each locked pair, and the pairs whose row another transaction holds.
func lockPairs(ctx context.Context, q *db.Queries, pairs []Pair) ([]PairState, []Pair, error) {
	streams, names := pairArrays(pairs)
	rows, err := q.PairsLockForApply(ctx, db.PairsLockForApplyParams{StreamIds: streams, PerspectiveNames: names})
	if err != nil {
		return nil, nil, fmt.Errorf("lock cursors: %w", err)
	}
	var busy []Pair
	if len(rows) < len(pairs) {
		// A pair not returned is held by another transaction, or has no cursor row (Append
		// and registration create it; this covers a row removed by hand). Tell them apart
		// with a read that never waits, and create only the missing rows, in key order (two
		// transactions never insert the same rows in opposite orders).
		got := make(map[Pair]bool, len(rows))
		for _, r := range rows {
			got[Pair{Stream: r.StreamID, Perspective: r.PerspectiveName}] = true
		}
		var notLocked []Pair
		for _, p := range pairs {
			if !got[p] {
				notLocked = append(notLocked, p)
			}
		}
		streams, names := pairArrays(notLocked)
		absent, err := q.CursorsMissing(ctx, db.CursorsMissingParams{StreamIds: streams, PerspectiveNames: names})
		if err != nil {
			return nil, nil, fmt.Errorf("find missing cursors: %w", err)
		}
		missing := make([]Pair, len(absent))
		for i, a := range absent {
			missing[i] = Pair{Stream: a.StreamID, Perspective: a.PerspectiveName}
		}
		slices.SortFunc(missing, comparePairs)
		created := map[Pair]bool{}
		if len(missing) > 0 {
			streams, names := pairArrays(missing)
			rows, err := q.CursorsEnsure(ctx, db.CursorsEnsureParams{StreamIds: streams, PerspectiveNames: names})
			if err != nil {
				return nil, nil, fmt.Errorf("create cursors: %w", err)
			}
			for _, c := range rows {
				created[Pair{Stream: c.StreamID, Perspective: c.PerspectiveName}] = true
			}
		}
		var fresh []Pair
		for _, p := range notLocked {
			if created[p] {
				fresh = append(fresh, p)
			} else {
				busy = append(busy, p)
			}
		}
		if len(fresh) > 0 {
			streams, names := pairArrays(fresh)
			more, err := q.PairsLockForApply(ctx, db.PairsLockForApplyParams{StreamIds: streams, PerspectiveNames: names})
			if err != nil {
				return nil, nil, fmt.Errorf("lock cursors: %w", err)
			}
			rows = append(rows, more...)
		}
	}
	states := make([]PairState, len(rows))
	for i, r := range rows {
		states[i] = PairState{
			Pair:          Pair{Stream: r.StreamID, Perspective: r.PerspectiveName},
			LastEventID:   r.LastEventID,
			SinceSnapshot: int(r.EventsSinceSnapshot),
			Snapshots:     r.SnapshotIds,
			LockHolder:    r.LockHolder,
		}
	}
	return states, busy, nil
}

// readPairs reads, after the row locks, the queued events of states (at most perPair each,
// in ID order) and the models of those that have events and a cursor position.
func readPairs(ctx context.Context, q *db.Queries, states []PairState, perPair int) error {
	byPair := make(map[Pair]*PairState, len(states))
	for i := range states {
		byPair[states[i].Pair] = &states[i]
	}
	streams, names := pairArrays(pairsOf(states))
	rows, err := q.QueueEventsForPairs(ctx, db.QueueEventsForPairsParams{
		StreamIds: streams, PerspectiveNames: names, PerPairLimit: int32(perPair),
	})
	if err != nil {
		return fmt.Errorf("read queue: %w", err)
	}
	for _, r := range rows {
		st := byPair[Pair{Stream: r.WhEventStore.StreamID, Perspective: r.PerspectiveName}]
		if st == nil {
			return fmt.Errorf("queue returned event %s of a pair not asked for", r.WhEventStore.EventID)
		}
		st.Events = append(st.Events, eventOf(r.WhEventStore))
	}
	var withModel []Pair
	for i := range states {
		st := &states[i]
		slices.SortFunc(st.Events, func(a, b Event) int { return compareIDs(a.ID, b.ID) })
		if len(st.Events) > 0 && st.LastEventID.Valid {
			withModel = append(withModel, st.Pair)
		}
	}
	if len(withModel) == 0 {
		return nil
	}
	// Read after the row locks, in a statement of its own (see PairsLockForApply).
	streams, names = pairArrays(withModel)
	models, err := q.ModelsGet(ctx, db.ModelsGetParams{StreamIds: streams, PerspectiveNames: names})
	if err != nil {
		return fmt.Errorf("load models: %w", err)
	}
	for _, m := range models {
		if st := byPair[Pair{Stream: m.StreamID, Perspective: m.PerspectiveName}]; st != nil {
			st.Model, st.ModelAt = json.RawMessage(m.Model), m.LastEventID
		}
	}
	return nil
}

func pairsOf(states []PairState) []Pair {
	pairs := make([]Pair, len(states))
	for i, st := range states {
		pairs[i] = st.Pair
	}
	return pairs
}

// writePairs writes every model, cursor and queue deletion of writes in one statement,
// then their snapshots, then their failures.
func (s *pgStore) writePairs(ctx context.Context, q *db.Queries, writes []PairWrite) error {
	var (
		commit db.PairsApplyCommitParams
		snaps  db.SnapshotsInsertParams
		drop   db.SnapshotsDeleteParams
		failed db.PairsMarkFailedParams
	)
	for _, wr := range writes {
		if len(wr.Applied) > 0 {
			commit.StreamIds = append(commit.StreamIds, wr.Stream)
			commit.PerspectiveNames = append(commit.PerspectiveNames, wr.Perspective)
			commit.Models = append(commit.Models, []byte(wr.Model))
			commit.LastEventIds = append(commit.LastEventIds, wr.LastEventID)
			commit.EventsSinceSnapshot = append(commit.EventsSinceSnapshot, int32(wr.SinceSnapshot))
			for _, id := range wr.Applied {
				commit.AppliedStreamIds = append(commit.AppliedStreamIds, wr.Stream)
				commit.AppliedPerspectiveNames = append(commit.AppliedPerspectiveNames, wr.Perspective)
				commit.AppliedEventIds = append(commit.AppliedEventIds, id)
			}
		}
		for _, sn := range wr.Snapshots {
			snaps.StreamIds = append(snaps.StreamIds, wr.Stream)
			snaps.PerspectiveNames = append(snaps.PerspectiveNames, wr.Perspective)
			snaps.SnapshotEventIds = append(snaps.SnapshotEventIds, sn.EventID)
			snaps.Models = append(snaps.Models, []byte(sn.Model))
		}
		for _, id := range wr.DropSnapshots {
			drop.StreamIds = append(drop.StreamIds, wr.Stream)
			drop.PerspectiveNames = append(drop.PerspectiveNames, wr.Perspective)
			drop.SnapshotEventIds = append(drop.SnapshotEventIds, id)
		}
		if wr.Failure != "" {
			failed.StreamIds = append(failed.StreamIds, wr.Stream)
			failed.PerspectiveNames = append(failed.PerspectiveNames, wr.Perspective)
			failed.Errors = append(failed.Errors, wr.Failure)
		}
	}
	if len(commit.StreamIds) > 0 {
		deleted, err := q.PairsApplyCommit(ctx, commit)
		if err != nil {
			return fmt.Errorf("write models: %w", err)
		}
		if int(deleted) != len(commit.AppliedEventIds) {
			return fmt.Errorf("deleted %d queue rows for %d applied events", deleted, len(commit.AppliedEventIds))
		}
	}
	if len(snaps.StreamIds) > 0 {
		if err := q.SnapshotsInsert(ctx, snaps); err != nil {
			return fmt.Errorf("write snapshots: %w", err)
		}
	}
	if len(drop.StreamIds) > 0 {
		if _, err := q.SnapshotsDelete(ctx, drop); err != nil {
			return fmt.Errorf("prune snapshots: %w", err)
		}
	}
	if len(failed.StreamIds) > 0 {
		return s.markFailed(ctx, q, failed)
	}
	return nil
}

// markFailed records the failures of arg with the store's backoff.
func (s *pgStore) markFailed(ctx context.Context, q *db.Queries, arg db.PairsMarkFailedParams) error {
	arg.BaseSeconds, arg.MaxSeconds = s.retryBase.Seconds(), s.retryMax.Seconds()
	if _, err := q.PairsMarkFailed(ctx, arg); err != nil {
		return fmt.Errorf("record failure: %w", err)
	}
	return nil
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
		if less(id, first) {
			rs.Snapshots = append(rs.Snapshots, id)
		}
	}
	return rs, nil
}

func (s *pgStore) Replay(ctx context.Context, stream uuid.UUID, after, upto uuid.UUID, limit int) ([]Event, error) {
	rows, err := s.q.EventsReplayPage(ctx, db.EventsReplayPageParams{
		StreamID: stream, AfterEventID: after, UptoEventID: upto, PageSize: int32(limit),
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
	return s.inTx(ctx, func(q *db.Queries) error {
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
		return s.writePairs(ctx, q, []PairWrite{c.Write})
	})
}

func (s *pgStore) Bootstrap(ctx context.Context, p Pair) (bool, error) {
	wrote := false
	err := s.inTx(ctx, func(q *db.Queries) error {
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
			return nil
		}
		m := models[0]
		if m.LastEventID != cur.LastEventID.UUID {
			return fmt.Errorf("model is at event %s but the cursor is at %s", m.LastEventID, cur.LastEventID.UUID)
		}
		if err := q.SnapshotsInsert(ctx, db.SnapshotsInsertParams{
			StreamIds: []uuid.UUID{p.Stream}, PerspectiveNames: []string{p.Perspective},
			SnapshotEventIds: []uuid.UUID{m.LastEventID}, Models: [][]byte{m.Model},
		}); err != nil {
			return fmt.Errorf("write snapshot: %w", err)
		}
		wrote = true
		return nil
	})
	return wrote, err
}

func (s *pgStore) Purge(ctx context.Context, p Pair, holder uuid.UUID) error {
	return s.inTx(ctx, func(q *db.Queries) error {
		if _, err := q.CursorsEnsure(ctx, db.CursorsEnsureParams{StreamIds: []uuid.UUID{p.Stream}, PerspectiveNames: []string{p.Perspective}}); err != nil {
			return fmt.Errorf("create cursor: %w", err)
		}
		cur, err := q.CursorLock(ctx, db.CursorLockParams{StreamID: p.Stream, PerspectiveName: p.Perspective})
		if err != nil {
			return fmt.Errorf("lock cursor: %w", err)
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
		return q.CursorReset(ctx, db.CursorResetParams{StreamID: p.Stream, PerspectiveName: p.Perspective})
	})
}

func (s *pgStore) MarkFailed(ctx context.Context, p Pair, cause string) error {
	return s.inTx(ctx, func(q *db.Queries) error {
		if _, err := q.CursorsEnsure(ctx, db.CursorsEnsureParams{StreamIds: []uuid.UUID{p.Stream}, PerspectiveNames: []string{p.Perspective}}); err != nil {
			return fmt.Errorf("create cursor: %w", err)
		}
		return s.markFailed(ctx, q, db.PairsMarkFailedParams{
			StreamIds: []uuid.UUID{p.Stream}, PerspectiveNames: []string{p.Perspective}, Errors: []string{cause},
		})
	})
}

// Listen holds one connection of its own (taken out of the pool: a listening session must
// not be handed to other users) for as long as it listens.
func (s *pgStore) Listen(ctx context.Context, notify func()) error {
	pc, err := s.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	conn := pc.Hijack()
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = conn.Close(cctx)
	}()
	if err := db.New(conn).QueueListen(ctx); err != nil {
		return err
	}
	notify() // events appended before the subscription took effect
	for {
		if _, err := conn.WaitForNotification(ctx); err != nil {
			return err
		}
		notify()
	}
}

func (s *pgStore) QueueDepth(ctx context.Context) ([]QueueDepth, error) {
	rows, err := s.q.QueueDepth(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]QueueDepth, len(rows))
	for i, r := range rows {
		out[i] = QueueDepth{Perspective: r.PerspectiveName, Depth: r.Depth, OldestAge: time.Duration(r.OldestAgeMicros) * time.Microsecond}
	}
	return out, nil
}

// comparePairs orders pairs by stream, then perspective.
func comparePairs(a, b Pair) int {
	if c := compareIDs(a.Stream, b.Stream); c != 0 {
		return c
	}
	return strings.Compare(a.Perspective, b.Perspective)
}
