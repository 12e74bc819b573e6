package worker_test

// Scale of data: a queue bulk-loaded with 10 events for each of 10,000 streams (100k
// events) and for each of many more streams, on a database created for the run and never
// analyzed, drained by one default worker. Reported per size: events/s,
// the worker's time per event (ms per 1,000 events) and the claims' median and p99 latency
// (PairsClaim, from the worker's pool), and the ratios large/small. The load writes the
// rows Append would (events, cursors, queue rows) with INSERT ... SELECT, which is what a
// migration from another store or a backfill looks like; loading 10M events through Append
// would take most of the run.
//
// The large size is 100,000 streams (1M events) in make bench; the 10M case takes ten
// minutes a run here (most of it the load): PERSPECTIVES_BENCH_SCALE_STREAMS=1000000 sets
// the large size's streams (BENCHMARKS.md, section BenchmarkScale; the command is under
// "Reproduce").

import (
	"context"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/worker"
)

const scalePerStream = 10

// claimTimer records the duration of every claim a pool runs.
type claimTimer struct {
	mu    sync.Mutex
	start map[*pgx.Conn]time.Time
	took  []float64 // ms
}

func (c *claimTimer) TraceQueryStart(ctx context.Context, conn *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	if strings.HasPrefix(data.SQL, "-- name: PairsClaim ") {
		c.mu.Lock()
		c.start[conn] = time.Now()
		c.mu.Unlock()
	}
	return ctx
}

func (c *claimTimer) TraceQueryEnd(_ context.Context, conn *pgx.Conn, _ pgx.TraceQueryEndData) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if t, ok := c.start[conn]; ok {
		c.took = append(c.took, ms(time.Since(t)))
		delete(c.start, conn)
	}
}

// bulkLoad writes streams × perStream events with their cursor rows and queue rows (for
// the active builds) in three INSERT ... SELECT statements: what Append would write, without
// the time of a million Appends. Event IDs sort in event order within a stream (the event's
// number, then the stream's own hex digits); the queue rows are written in key order.
func bulkLoad(b *testing.B, pool *pgxpool.Pool, streams, perStream int) {
	b.Helper()
	for _, q := range []string{
		`INSERT INTO wh_event_store (event_id, stream_id, event_type, data)
		 SELECT (lpad(to_hex(i), 8, '0') || substr(md5(s::text), 9))::uuid, md5(s::text)::uuid,
		        'amount', jsonb_build_object('n', i)
		 FROM generate_series(1, $1::int) s, generate_series(1, $2::int) i`,
		`INSERT INTO wh_perspective_cursors (stream_id, perspective_name)
		 SELECT md5(s::text)::uuid, b.build_key FROM generate_series(1, $1::int) s,
		        wh_perspective_builds b WHERE b.state = 'active' AND $2::int > 0`,
		`INSERT INTO wh_perspective_events (stream_id, perspective_name, event_id)
		 SELECT e.stream_id, b.build_key, e.event_id FROM wh_event_store e, wh_perspective_builds b
		 WHERE b.state = 'active' AND $1::int > 0 AND $2::int > 0
		 ORDER BY e.stream_id, b.build_key, e.event_id`,
		`INSERT INTO wh_perspective_pairs (stream_id, perspective_name, due_at)
		 SELECT stream_id, perspective_name, min(enqueued_at) FROM wh_perspective_events
		 WHERE $1::int > 0 AND $2::int > 0 GROUP BY 1, 2`,
	} {
		_, err := pool.Exec(context.Background(), q, streams, perStream)
		require.NoError(b, err)
	}
}

// scaleRun loads streams × 10 events into a new database and drains them with one default
// worker. It returns the drain's time and the claims' latencies (ms).
func scaleRun(b *testing.B, streams int) (time.Duration, []float64) {
	ctx := context.Background()
	d := freshDB(b, "scale")
	cfg := worker.Config{Perspectives: []worker.Perspective{sumPerspective("bench_scale")}}
	register(b, d.Pool, cfg)
	bulkLoad(b, d.Pool, streams, scalePerStream)

	timer := &claimTimer{start: map[*pgx.Conn]time.Time{}}
	pcfg, err := pgxpool.ParseConfig(d.URL)
	require.NoError(b, err)
	pcfg.ConnConfig.Tracer = timer
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	require.NoError(b, err)
	defer pool.Close()
	// The end is the worker's count of committed applications, not a look at the queue:
	// such a look (a sequential scan) reads, and prunes, every dead row the drain has left,
	// which at 10M events would be a vacuum of its own.
	m := newBenchMetrics()
	cfg.MeterProvider = m.mp
	start := time.Now()
	w := benchStartOn(b, pool, cfg)
	stopVacuum := autovacuumQueue(b, d.URL)
	benchWait(b, 30*time.Minute, 5*time.Millisecond, "the drain", func() bool {
		return m.counter(b, "perspectives.events.applied") >= int64(streams*scalePerStream)
	})
	el := time.Since(start)
	b.Logf("%d streams: drained in %s, the queue vacuumed %d times meanwhile", streams, el, stopVacuum())
	benchStop(b, w)
	var queued bool
	require.NoError(b, d.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM wh_perspective_events)`).Scan(&queued))
	require.False(b, queued, "queue rows left after the drain")
	var models int
	require.NoError(b, d.Pool.QueryRow(ctx, `SELECT count(*)::int FROM wh_perspective_models`).Scan(&models))
	require.Equal(b, streams, models, "every stream has its model")
	timer.mu.Lock()
	defer timer.mu.Unlock()
	return el, slices.Clone(timer.took)
}

// autovacuumQueue does for the queue what autovacuum would in production, where it is on:
// the shared test cluster runs with autovacuum off (its CI configuration), and the drain's
// dead rows would otherwise only pile up. Once every autovacuum_naptime (1 minute, the
// default) it vacuums wh_perspective_events, throttled as autovacuum is by default
// (vacuum_cost_delay 2 ms, vacuum_cost_limit 200): a drain deletes far more rows a minute
// than the table's threshold (1% of it, its autovacuum_vacuum_scale_factor). The function it
// returns stops it (a vacuum under way is cancelled) and tells how many vacuums finished.
func autovacuumQueue(b *testing.B, dbURL string) (stop func() int) {
	ctx, cancel := context.WithCancel(context.Background())
	conn, err := pgx.Connect(ctx, dbURL)
	require.NoError(b, err)
	var (
		done    = make(chan struct{})
		n       int   // vacuums finished
		failure error // an error other than the cancellation
	)
	go func() {
		defer close(done)
		defer conn.Close(context.Background())
		if _, err := conn.Exec(ctx, `SET vacuum_cost_delay = '2ms'; SET vacuum_cost_limit = 200`); err != nil {
			failure = err
			return
		}
		tick := time.NewTicker(time.Minute)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
				if _, err := conn.Exec(ctx, `VACUUM wh_perspective_events`); err != nil {
					if ctx.Err() == nil {
						failure = err
					}
					return
				}
				n++
			}
		}
	}()
	b.Cleanup(func() { cancel(); <-done }) // when the benchmark fails before stop
	return func() int {
		cancel()
		<-done
		require.NoError(b, failure, "vacuuming the queue")
		return n
	}
}

// BenchmarkScale reports the drain of 100k events (10,000 streams) and of the large size
// (see above), 10 events per stream.
func BenchmarkScale(b *testing.B) {
	large := 100_000
	if v := os.Getenv("PERSPECTIVES_BENCH_SCALE_STREAMS"); v != "" {
		n, err := strconv.Atoi(v)
		require.NoError(b, err)
		large = n
	}
	small := 10_000
	var perSmall, perLarge, ratio, claimSmall, claimLarge, claimP99Small, claimP99Large, rateLarge []float64
	for range b.N {
		elS, claimsS := scaleRun(b, small)
		elL, claimsL := scaleRun(b, large)
		ps := ms(elS) / float64(small*scalePerStream) * 1000
		pl := ms(elL) / float64(large*scalePerStream) * 1000
		perSmall, perLarge, ratio = append(perSmall, ps), append(perLarge, pl), append(ratio, pl/ps)
		claimSmall, claimLarge = append(claimSmall, medianOf(claimsS)), append(claimLarge, medianOf(claimsL))
		claimP99Small, claimP99Large = append(claimP99Small, percentile(claimsS, 0.99)), append(claimP99Large, percentile(claimsL, 0.99))
		rateLarge = append(rateLarge, float64(large*scalePerStream)/elL.Seconds())
	}
	b.ReportMetric(medianOf(perSmall), "small-ms/1k-events")
	b.ReportMetric(medianOf(perLarge), "large-ms/1k-events")
	b.ReportMetric(medianOf(ratio), "large/small-per-event")
	b.ReportMetric(medianOf(rateLarge), "large-events/s")
	b.ReportMetric(medianOf(claimSmall), "small-claim-p50-ms")
	b.ReportMetric(medianOf(claimLarge), "large-claim-p50-ms")
	b.ReportMetric(medianOf(claimP99Small), "small-claim-p99-ms")
	b.ReportMetric(medianOf(claimP99Large), "large-claim-p99-ms")
}
