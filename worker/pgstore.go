package worker

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/perspectives-go/perspectives/db"
	"github.com/perspectives-go/perspectives/internal/pgq"
)

// pgStore is the Store on a pgx pool, over the sqlc queries of queries/.
type pgStore struct {
	pool *pgxpool.Pool
	q    *db.Queries
	// retryBase and retryMax are the failure backoff (Config.RetryBackoff, MaxRetryBackoff).
	retryBase, retryMax time.Duration

	readAheadMu sync.Mutex
	readAhead   map[string]*pageRead // per build: the catch-up page read ahead, if any
	readAheads  service              // runs the read-aheads, between the worker's Start and Stop

	listenConnect func(context.Context) (*pgx.Conn, error) // Config.ListenConnect

	skippedBy string // who the failure policy's skips are recorded as skipped by

	log *slog.Logger // nil: logs nothing (an Admin's store)
}

var _ Store = (*pgStore)(nil)

func newPGStore(pool *pgxpool.Pool, retryBase, retryMax time.Duration) *pgStore {
	return &pgStore{pool: pool, q: pgq.New(pool), retryBase: retryBase, retryMax: retryMax, readAhead: map[string]*pageRead{}}
}

// startBackground starts the store's background service (the catch-up read-aheads), for
// the worker's Start, and offers its ListenConnect to the pool's notifier, so that the
// process's one LISTEN session is that connection whoever subscribes first.
func (s *pgStore) startBackground(ctx context.Context) error {
	offerListenConnect(s.pool, s.listenConnect, s)
	return s.readAheads.Start(ctx)
}

// stopBackground stops the read-aheads, as the service's Stop does, and withdraws the
// store's ListenConnect.
func (s *pgStore) stopBackground(ctx context.Context) error {
	withdrawListenConnect(s.pool, s)
	return s.readAheads.Stop(ctx)
}

// inTx runs fn in one transaction: committed when fn returns nil, rolled back otherwise.
func (s *pgStore) inTx(ctx context.Context, fn func(q *db.Queries) error) error {
	return pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error { return fn(pgq.New(tx)) })
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

func (s *pgStore) Claim(ctx context.Context, req ClaimRequest) (Claimed, error) {
	rows, err := s.q.PairsClaim(ctx, db.PairsClaimParams{
		InstanceID:   req.Instance,
		BuildKeys:    req.Perspectives,
		MaxPairs:     int32(req.Limit),
		LeaseSeconds: req.Lease.Seconds(),
	})
	if err != nil {
		return Claimed{}, err
	}
	var c Claimed
	for _, r := range rows {
		if r.StreamID == uuid.Nil {
			c.NextDue = r.DueAt // the next waiting pair's due time
			continue
		}
		c.Pairs = append(c.Pairs, Pair{Stream: r.StreamID, Perspective: r.PerspectiveName})
	}
	// The statement returns the pairs in no particular order: oldest stream first keeps
	// groups, and so their row locks, in one order.
	slices.SortFunc(c.Pairs, comparePairs)
	return c, nil
}

func (s *pgStore) Release(ctx context.Context, req ReleaseRequest) error {
	if len(req.Pairs) == 0 {
		return nil
	}
	streams, names := pairArrays(req.Pairs)
	delays := make([]float64, len(req.Pairs))
	for i, p := range req.Pairs {
		delays[i] = -1 // at its oldest queued event
		if d, ok := req.Later[p]; ok {
			delays[i] = d.Seconds()
		}
	}
	return s.q.PairsRelease(ctx, db.PairsReleaseParams{
		InstanceID: req.Instance, StreamIds: streams, PerspectiveNames: names, Delays: delays,
	})
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
		return s.writePairs(ctx, q, []PairWrite{c.Write}, nil)
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
			SnapshotEventIds: []uuid.UUID{m.LastEventID}, Models: []string{string(m.Model)},
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

func (s *pgStore) MarkFailed(ctx context.Context, p Pair, f Failure, decide func(failures int) FailureAction) (FailureAction, error) {
	err := s.inTx(ctx, func(q *db.Queries) error {
		if _, err := q.CursorsEnsure(ctx, db.CursorsEnsureParams{StreamIds: []uuid.UUID{p.Stream}, PerspectiveNames: []string{p.Perspective}}); err != nil {
			return fmt.Errorf("create cursor: %w", err)
		}
		cur, err := q.CursorFailuresLock(ctx, db.CursorFailuresLockParams{StreamID: p.Stream, PerspectiveName: p.Perspective})
		if err != nil {
			return fmt.Errorf("lock cursor: %w", err)
		}
		f.Action = decide(failuresOf(f.Event, cur.FailedEventID.UUID, int(cur.Attempts)))
		var arg db.PairsMarkFailedParams
		addFailure(&arg, p, f)
		return s.markFailed(ctx, q, arg)
	})
	if err != nil {
		return "", err
	}
	return f.Action, nil
}

// Listen subscribes to the queue's notification on the pool's notifier (see notifier),
// which the process's WaitFor calls share: its session is listenConnect's when given, else
// a connection of its own (never a pool connection). Behind a transaction pooler without
// listenConnect, Listen returns ErrNotificationsLost. When the notifier's session is lost,
// Listen returns why (the worker subscribes again later, polling meanwhile).
func (s *pgStore) Listen(ctx context.Context, notify func()) error {
	sub := subscribe(s.pool, topicQueue, s.listenConnect)
	defer sub.close()
	var session uint64
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-sub.c:
		}
		nt := sub.take()
		switch {
		case nt.polling:
			return ErrNotificationsLost
		case nt.session == 0 && session != 0:
			return cmp.Or(nt.err, errors.New("the notifier's session was lost"))
		case nt.session != session:
			// Events may have been appended before the subscription took effect (or while the
			// session was replaced).
			session = nt.session
			notify()
		}
		if nt.notified {
			notify()
		}
	}
}

// probeTimeout bounds the wait for the notifier's probe notification, and the grace of its
// subscribing statements.
const probeTimeout = 2 * time.Second

// graceAfter returns a context that ends grace after ctx ends (or when cancel is called),
// for statements that should finish rather than be cancelled when ctx ends.
func graceAfter(ctx context.Context, grace time.Duration) (context.Context, context.CancelFunc) {
	gctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	stop := context.AfterFunc(ctx, func() {
		select {
		case <-gctx.Done():
		case <-time.After(grace):
			cancel()
		}
	})
	return gctx, func() { stop(); cancel() }
}

// comparePairs orders pairs by stream, then perspective.
func comparePairs(a, b Pair) int {
	if c := compareIDs(a.Stream, b.Stream); c != 0 {
		return c
	}
	return strings.Compare(a.Perspective, b.Perspective)
}
