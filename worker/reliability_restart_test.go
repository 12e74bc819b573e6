package worker_test

// The database server restarts under load: a private cluster (scripts/pgcluster.sh, its own
// data directory and port) is restarted with pg_ctl restart -m immediate twice while
// appenders and two worker instances run. Checked: every acknowledged event is in its
// stream's model exactly once and nothing is doubled; the workers apply again within a
// second of the server answering; the connection errors pushed no pair into the backoff
// meant for failing perspectives.

import (
	"context"
	"encoding/json"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/internal/pgtest"
	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/schema"
	"github.com/perspectives-go/perspectives/worker"
)

// faultLoad appends to streams until stop: each appender owns its streams and sometimes
// appends an event before the previous one (a late event: a rewind). It records which
// events were acknowledged (Append returned nil) and which are unknown (Append failed: the
// commit may or may not have happened).
type faultLoad struct {
	mu      sync.Mutex
	acked   map[uuid.UUID]uuid.UUID // event → stream
	unknown map[uuid.UUID]bool
	streams []uuid.UUID
	errors  atomic.Int64
}

func runFaultLoad(ctx context.Context, pool *pgxpool.Pool, appenders, streamsEach int, stop <-chan struct{}) (*faultLoad, *sync.WaitGroup) {
	l := &faultLoad{acked: map[uuid.UUID]uuid.UUID{}, unknown: map[uuid.UUID]bool{}}
	var wg sync.WaitGroup
	for a := range appenders {
		mine := make([]uuid.UUID, streamsEach)
		for i := range mine {
			mine[i] = uuid.New()
		}
		l.streams = append(l.streams, mine...)
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(a), 7))
			var held *worker.Event // an event kept back to be appended after a newer one
			for n := 0; ; n++ {
				select {
				case <-stop:
					return
				default:
				}
				ev := worker.Event{ID: uuid.Must(uuid.NewV7()), StreamID: mine[rng.IntN(len(mine))], Type: "amount",
					Data: json.RawMessage(`{"n":1}`)}
				if held == nil && rng.IntN(8) == 0 {
					held = &ev // appended after the next one: late
					continue
				}
				batch := []worker.Event{ev}
				if held != nil {
					held.StreamID = ev.StreamID
					batch = []worker.Event{ev, *held}
					held = nil
				}
				for _, e := range batch {
					actx, cancel := context.WithTimeout(ctx, 5*time.Second)
					err := worker.Append(actx, pool, e)
					cancel()
					l.mu.Lock()
					if err == nil {
						l.acked[e.ID] = e.StreamID
					} else {
						l.unknown[e.ID] = true
						l.errors.Add(1)
					}
					l.mu.Unlock()
					if err != nil {
						time.Sleep(20 * time.Millisecond)
					}
				}
				time.Sleep(time.Duration(2+rng.IntN(6)) * time.Millisecond)
			}
		})
	}
	return l, &wg
}

// check waits until every acknowledged event is in its stream's model of name (on pool),
// then checks that no model holds an event twice or one that was never appended.
func (l *faultLoad) check(t *testing.T, ctx context.Context, pool *pgxpool.Pool, name string, within time.Duration) {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	want := map[uuid.UUID][]uuid.UUID{}
	for id, s := range l.acked {
		want[s] = append(want[s], id)
	}
	models := map[uuid.UUID]ledger{}
	eventually(t, within, "every acknowledged event applied", func() bool {
		for _, s := range l.streams {
			raw, ok, err := worker.LoadModel(ctx, pool, name, s)
			if err != nil {
				return false
			}
			var m ledger
			if ok {
				require.NoError(t, json.Unmarshal(raw, &m))
			}
			models[s] = m
			for _, id := range want[s] {
				if !slices.Contains(m.IDs, id) {
					return false
				}
			}
		}
		return true
	})
	for s, m := range models {
		seen := map[uuid.UUID]bool{}
		for _, id := range m.IDs {
			require.False(t, seen[id], "stream %s: event %s applied twice", s, id)
			seen[id] = true
			_, acked := l.acked[id]
			require.True(t, acked || l.unknown[id], "stream %s: event %s was never appended", s, id)
		}
		require.True(t, slices.IsSortedFunc(m.IDs, func(a, b uuid.UUID) int { return compareUUID(a, b) }),
			"stream %s: applied in ID order", s)
	}
}

func compareUUID(a, b uuid.UUID) int {
	for i := range a {
		if a[i] != b[i] {
			return int(a[i]) - int(b[i])
		}
	}
	return 0
}

// appliedSince polls counter every 5 ms until it exceeds from, and returns how long that
// took (or fails after within).
func appliedSince(t *testing.T, counter func() int64, from int64, within time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	for counter() <= from {
		if time.Since(start) > within {
			t.Fatalf("no event applied within %s", within)
		}
		time.Sleep(5 * time.Millisecond)
	}
	return time.Since(start)
}

// startFaultWorkers starts two instances applying a ledger perspective name on pool, with
// the Postgres locker on opts (which the workers take for their claims' leases too: a lease
// whose release an outage cut lapses after opts.LockTimeout), snapshots every 5 events and
// metrics into m; stopped when the test ends.
func startFaultWorkers(t *testing.T, pool *pgxpool.Pool, name string, m *metricsReader, opts locker.Options) {
	t.Helper()
	for range 2 {
		lk, err := locker.NewPostgres(pool, opts)
		require.NoError(t, err)
		w, err := worker.New(pool, worker.Config{
			Perspectives:  []worker.Perspective{ledgerPerspective(name)},
			Locker:        lk,
			Logger:        quietLogger(),
			MeterProvider: m.mp,
			Snapshots:     worker.SnapshotOptions{EveryNEvents: 5},
		})
		require.NoError(t, err)
		require.NoError(t, w.Start(context.Background()))
		t.Cleanup(func() {
			sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			require.NoError(t, w.Stop(sctx))
		})
	}
}

func TestReliabilityServerRestartUnderLoad(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	c := pgtest.StartCluster(t)
	pool, err := pgxpool.New(ctx, c.URL)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	require.NoError(t, schema.Migrate(ctx, pool))

	name := uniqueName("restart")
	m := newMetrics(t)
	applied := func() int64 { return m.sum("perspectives.events.applied") }
	// Leases of 5 s: the pairs in flight at a restart, whose releases failed, are due again
	// well within the final check.
	startFaultWorkers(t, pool, name, m, locker.Options{LockTimeout: 5 * time.Second, KeepAliveInterval: time.Second})

	stop := make(chan struct{})
	load, wg := runFaultLoad(ctx, pool, 4, 10, stop)
	var resumes []time.Duration
	for range 2 {
		time.Sleep(1500 * time.Millisecond)
		c.Restart(t) // returns once the server accepts connections again
		resumes = append(resumes, appliedSince(t, applied, applied(), 20*time.Second))
	}
	time.Sleep(500 * time.Millisecond)
	close(stop)
	wg.Wait()
	load.check(t, ctx, pool, name, 30*time.Second)

	var backedOff int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM wh_perspective_cursors
		WHERE perspective_name = $1 AND (attempts > 0 OR status = 'failed')`, name).Scan(&backedOff))
	require.Zero(t, backedOff, "a connection error is no pair's failure: no backoff")
	for i, d := range resumes {
		require.Less(t, d, time.Second, "restart %d: first event applied %s after the server answered", i+1, d)
	}
	t.Logf("restarts: first event applied %v after the server answered; %d acknowledged events, %d Appends failed during the restarts",
		resumes, len(load.acked), load.errors.Load())
}
