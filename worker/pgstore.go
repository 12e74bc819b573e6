package worker

import (
	"context"
	"encoding/json"
	"log/slog"
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

	w *Worker // whose perspectives' sinks its transactions call (nil: an Admin's store, which runs none)

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
	if err := s.readAheads.Start(ctx); err != nil {
		return err
	}
	offerListenConnect(s.pool, s.listenConnect, s)
	return nil
}

// stopBackground stops the read-aheads, as the service's Stop does, withdraws the store's
// ListenConnect, and lets go of the catch-up leases the worker holds, under ctx bounded by
// releaseTimeout (with ctx ended, they are left to expire): another instance continues those
// catch-ups at once rather than when the leases expire.
func (s *pgStore) stopBackground(ctx context.Context) error {
	withdrawListenConnect(s.pool, s)
	err := s.readAheads.Stop(ctx)
	rctx, cancel := context.WithTimeout(ctx, releaseTimeout)
	defer cancel()
	if lerr := s.q.BuildCatchUpLetGo(rctx, s.w.cfg.InstanceID); lerr != nil {
		s.w.log.Warn("catch-up leases not let go at stop; another instance continues when they expire",
			slog.Any("error", lerr), slog.Duration("lease", s.w.cfg.LockOptions.LockTimeout))
	}
	return err
}

// inTx runs fn in one transaction, tx with its queries q: committed when fn returns nil,
// rolled back otherwise.
func (s *pgStore) inTx(ctx context.Context, fn func(tx pgx.Tx, q *db.Queries) error) error {
	return pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error { return fn(tx, pgq.New(tx)) })
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

// comparePairs orders pairs by stream, then perspective.
func comparePairs(a, b Pair) int {
	if c := compareIDs(a.Stream, b.Stream); c != 0 {
		return c
	}
	return strings.Compare(a.Perspective, b.Perspective)
}
