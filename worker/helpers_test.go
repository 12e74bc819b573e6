package worker_test

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/db"
	"github.com/perspectives-go/perspectives/internal/pgq"
	"github.com/perspectives-go/perspectives/internal/pgtest"
	"github.com/perspectives-go/perspectives/worker"
)

// ledger is a model that reveals order, gaps and duplicates: every applied event ID in order.
type ledger struct {
	IDs []uuid.UUID `json:"ids"`
	Sum int         `json:"sum"`
}

type amount struct {
	N int `json:"n"`
}

func foldLedger(m ledger, ev worker.Event) (ledger, error) {
	var a amount
	if len(ev.Data) > 0 {
		if err := json.Unmarshal(ev.Data, &a); err != nil {
			return m, err
		}
	}
	m.IDs = append(m.IDs, ev.ID)
	m.Sum += a.N
	return m, nil
}

func ledgerPerspective(name string) worker.Perspective {
	return worker.JSONPerspective(name, foldLedger)
}

// expectedLedger folds events sorted by ID, as the model must be.
func expectedLedger(t testing.TB, events []worker.Event) ledger {
	t.Helper()
	sorted := slices.Clone(events)
	slices.SortFunc(sorted, func(a, b worker.Event) int { return bytes.Compare(a.ID[:], b.ID[:]) })
	var m ledger
	for _, ev := range sorted {
		var err error
		m, err = foldLedger(m, ev)
		require.NoError(t, err)
	}
	return m
}

// newIDs returns n UUIDv7 IDs in ascending order.
func newIDs(t testing.TB, n int) []uuid.UUID {
	t.Helper()
	ids := make([]uuid.UUID, n)
	for i := range ids {
		ids[i] = uuid.Must(uuid.NewV7())
	}
	slices.SortFunc(ids, func(a, b uuid.UUID) int { return bytes.Compare(a[:], b[:]) })
	return ids
}

func events(stream uuid.UUID, ids []uuid.UUID) []worker.Event {
	out := make([]worker.Event, len(ids))
	for i, id := range ids {
		out[i] = worker.Event{ID: id, StreamID: stream, Type: "amount", Data: json.RawMessage(`{"n":` + itoa(i+1) + `}`)}
	}
	return out
}

func itoa(i int) string { return jsonInt(i) }

func jsonInt(i int) string { b, _ := json.Marshal(i); return string(b) }

func loadLedger(t testing.TB, ctx context.Context, name string, stream uuid.UUID) (ledger, bool) {
	t.Helper()
	raw, ok, err := worker.LoadModel(ctx, testDB.Pool, name, stream)
	require.NoError(t, err)
	var m ledger
	if ok {
		require.NoError(t, json.Unmarshal(raw, &m))
	}
	return m, ok
}

func queued(t testing.TB, ctx context.Context, name string, stream uuid.UUID) []uuid.UUID {
	t.Helper()
	ids, err := pgq.New(testDB.Pool).QueueIDsForPair(ctx, db.QueueIDsForPairParams{StreamID: stream, PerspectiveName: name})
	require.NoError(t, err)
	return ids
}

// eventually waits for cond (see pgtest.Eventually).
var eventually = pgtest.Eventually

// logCapture is a slog handler that keeps records for assertions.
type logCapture struct {
	mu      sync.Mutex
	records []slog.Record
}

func (c *logCapture) Enabled(context.Context, slog.Level) bool { return true }
func (c *logCapture) Handle(_ context.Context, r slog.Record) error {
	c.mu.Lock()
	c.records = append(c.records, r.Clone())
	c.mu.Unlock()
	return nil
}
func (c *logCapture) WithAttrs([]slog.Attr) slog.Handler { return c }
func (c *logCapture) WithGroup(string) slog.Handler      { return c }

func (c *logCapture) count(msg string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for _, r := range c.records {
		if r.Message == msg {
			n++
		}
	}
	return n
}

func quietLogger() *slog.Logger {
	return slog.New(slog.NewTextHandler(&bytes.Buffer{}, &slog.HandlerOptions{Level: slog.LevelError + 10}))
}

func startWorker(t testing.TB, cfg worker.Config) *worker.Worker {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = quietLogger()
	}
	if cfg.PollInterval == 0 {
		cfg.PollInterval = 20 * time.Millisecond
	}
	if cfg.ListenConnect == nil {
		cfg.ListenConnect = directListen()
	}
	return startWorkerWith(t, testDB.Pool, cfg)
}

// startWorkerWith starts a worker on pool with cfg as it is; it is stopped when the test
// ends.
func startWorkerWith(t testing.TB, pool *pgxpool.Pool, cfg worker.Config) *worker.Worker {
	t.Helper()
	w, err := worker.New(pool, cfg)
	require.NoError(t, err)
	require.NoError(t, w.Start(context.Background()))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		require.NoError(t, w.Stop(ctx))
	})
	return w
}

// directListen is the ListenConnect of the tests' workers: a direct connection when the
// tests run through a pooler (PGTEST_POOLER_URL), else nil (a connection of the pool).
func directListen() func(context.Context) (*pgx.Conn, error) {
	if testDB.DirectURL == testDB.URL {
		return nil
	}
	return func(ctx context.Context) (*pgx.Conn, error) { return pgx.Connect(ctx, testDB.DirectURL) }
}

// gatedPerspective is a ledger perspective whose Apply, once armed, stops at one event
// until released: a test can act while a rewind is in the middle of its replay. With
// honourCtx, the stopped Apply also returns its context's error once that ends (as an Apply
// that calls a service with its ctx does).
type gatedPerspective struct {
	worker.Perspective
	honourCtx bool
	mu        sync.Mutex
	blockOn   uuid.UUID
	entered   chan struct{}
	release   chan struct{}
}

func newGated(name string) *gatedPerspective {
	return &gatedPerspective{Perspective: ledgerPerspective(name)}
}

// arm makes the next Apply of id block; it returns the channel closed when Apply reaches it
// and the function that lets it continue.
func (g *gatedPerspective) arm(id uuid.UUID) (entered <-chan struct{}, release func()) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.blockOn, g.entered, g.release = id, make(chan struct{}), make(chan struct{})
	rel := g.release
	var once sync.Once
	return g.entered, func() { once.Do(func() { close(rel) }) }
}

func (g *gatedPerspective) Apply(ctx context.Context, model json.RawMessage, ev worker.Event) (json.RawMessage, error) {
	g.mu.Lock()
	var entered, release chan struct{}
	if g.blockOn == ev.ID && g.entered != nil {
		entered, release = g.entered, g.release
		g.blockOn, g.entered = uuid.Nil, nil
	}
	g.mu.Unlock()
	if entered != nil {
		close(entered)
		if !g.honourCtx {
			<-release
		}
		select {
		case <-release:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	return g.Perspective.Apply(ctx, model, ev)
}
