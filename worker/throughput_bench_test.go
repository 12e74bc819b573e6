package worker_test

// Worker throughput: events applied per second by one instance draining a backlog of
// 1,000 streams × 50 events, against a hand-written baseline that performs the same reads
// and writes with as few batched statements as it can, measured in the same run and
// interleaved (every round runs every variant once, in a rotating order, each from the same
// restored backlog).

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/internal/pgtest"
	"github.com/perspectives-go/perspectives/worker"
)

// appendBacklog stores streams × perStream events on pool (in ID order per stream), in
// Appends of 1,000 events.
func appendBacklog(b testing.TB, ctx context.Context, pool *pgxpool.Pool, streams, perStream int) {
	b.Helper()
	batch := make([]worker.Event, 0, 1000)
	for range streams {
		s := uuid.New()
		for i, id := range newIDs(b, perStream) {
			batch = append(batch, worker.Event{ID: id, StreamID: s, Type: "amount", Data: json.RawMessage(`{"n":` + itoa(i+1) + `}`)})
			if len(batch) == cap(batch) {
				require.NoError(b, worker.Append(ctx, pool, batch...))
				batch = batch[:0]
			}
		}
	}
	if len(batch) > 0 {
		require.NoError(b, worker.Append(ctx, pool, batch...))
	}
}

type sumModel struct {
	Count int `json:"c"`
	Sum   int `json:"s"`
}

// sumPerspective is a cheap perspective, so benchmarks measure the worker, not the fold.
func sumPerspective(name string) worker.Perspective {
	return worker.JSONPerspective(name, func(m sumModel, ev worker.Event) (sumModel, error) {
		var a amount
		if err := json.Unmarshal(ev.Data, &a); err != nil {
			return m, err
		}
		m.Count++
		m.Sum += a.N
		return m, nil
	})
}

const (
	drainStreams   = 1000
	drainPerStream = 50
	drainEvents    = drainStreams * drainPerStream
	drainName      = "bench_drain"
)

// drainVariant is one way of draining the backlog.
type drainVariant struct {
	name      string // metric prefix
	cfg       worker.Config
	base      bool // the hand-written baseline instead of the worker
	instances int  // workers draining together (0: one)
	// on a pool through a PgBouncer of the benchmark's own in transaction mode: "exec" (the
	// installed PgBouncer, pgx exec mode) or "prepared" (>= 1.21 keeping prepared
	// statements, pgx's default mode); "": direct
	pooler string
	mode   string // pgx's query exec mode of a direct pool ("": its default)
}

var drainVariants = []drainVariant{
	{name: "worker", cfg: worker.Config{}}, // defaults: Concurrency 4, BatchSize 100
	{name: "baseline", base: true},
	{name: "c1", cfg: worker.Config{Concurrency: 1}},
	{name: "c2", cfg: worker.Config{Concurrency: 2}},
	{name: "c8", cfg: worker.Config{Concurrency: 8}},
	{name: "b1000", cfg: worker.Config{BatchSize: 1000}},
	{name: "x2", cfg: worker.Config{Concurrency: 2}, instances: 2}, // two instances, 2 slots each
	{name: "pooled", cfg: worker.Config{}, pooler: "exec"},         // defaults, through the installed PgBouncer
	{name: "prepared", cfg: worker.Config{}, pooler: "prepared"},   // defaults, through PgBouncer >= 1.21
	{name: "exec", cfg: worker.Config{}, mode: "exec"},             // defaults, direct in pgx's exec mode
}

var drainRound int

// BenchmarkWorkerDrain measures events applied per second by one instance draining a
// backlog of 1000 streams × 50 events (queue rows and cursor rows in place, perspective
// registered; the worker only drains), for the default configuration, Concurrency 1, 2 and
// 8, BatchSize 1000, two instances, through each of two PgBouncers (pooled: the installed
// one with pgx's exec mode; prepared: one keeping prepared statements, pgx's default mode),
// direct in pgx's exec mode (exec: what the mode costs without the pooler's hop), and the
// hand-written baseline. Each iteration is one round of every variant; the figures
// are events/s per variant and worker/baseline, and where the time goes: statements and
// commits per stream, streams per claim (PairsClaim), statements in flight on average
// (time inside statements / wall time), and the CPU cores used by the server processes of
// the test database and by this process. Where the installed PgBouncer is older than 1.21
// (and the system's package sources offer no newer one) the prepared variant is not run:
// the benchmark logs "not run: prepared: <reason>", which the harness (bench/) reports for
// its targets.
//
// PERSPECTIVES_BENCH_DRAIN=worker,baseline runs only the variants named (for profiling);
// PERSPECTIVES_BENCH_VERBOSE=1 logs every variant's statements (count and time by name).
func BenchmarkWorkerDrain(b *testing.B) {
	ctx := context.Background()
	b.StopTimer() // only the drains are timed
	backlog := drainBacklog{pool: testDB.Pool, persp: sumPerspective(drainName), events: drainEvents, saved: "bench_drain"}
	if benchClaim(b, "drain") {
		register(b, testDB.Pool, worker.Config{Perspectives: []worker.Perspective{backlog.persp}})
		appendBacklog(b, ctx, testDB.Pool, drainStreams, drainPerStream)
		backlog.save(b, ctx)
	}
	variants := drainVariants
	if only := os.Getenv("PERSPECTIVES_BENCH_DRAIN"); only != "" {
		variants = slices.DeleteFunc(slices.Clone(variants), func(v drainVariant) bool {
			return !slices.Contains(strings.Split(only, ","), v.name)
		})
	}
	if slices.ContainsFunc(variants, func(v drainVariant) bool { return v.pooler == "prepared" }) {
		if why := pgtest.PreparedPoolerMissing(b); why != "" {
			b.Logf("not run: prepared: %s", why)
			variants = slices.DeleteFunc(slices.Clone(variants), func(v drainVariant) bool { return v.pooler == "prepared" })
		}
	}
	verbose := os.Getenv("PERSPECTIVES_BENCH_VERBOSE") != ""
	tracer := newStmtTracer()
	pool := benchPool(b, testDB.URL, tracer)
	fig := map[string]map[string][]float64{} // variant -> figure -> one value per round
	add := func(v, k string, x float64) {
		if fig[v] == nil {
			fig[v] = map[string][]float64{}
		}
		fig[v][k] = append(fig[v][k], x)
	}
	pooled := map[string]*pgxpool.Pool{} // through PgBouncers of the benchmark's own, started on first use
	direct := map[string]*pgxpool.Pool{"": pool}
	for range b.N {
		for j := range variants {
			v := variants[(drainRound+j)%len(variants)]
			backlog.reset(b, ctx)
			tracer.take()
			cpu := startCPU(b, testDB.Pool)
			var el time.Duration
			switch {
			case v.base:
				el = backlog.drainBaseline(b, ctx, pool)
			case v.pooler != "":
				if pooled[v.pooler] == nil {
					u := pgtest.WithExecMode(pgtest.StartPooler(b, testDB.Name), "exec")
					if v.pooler == "prepared" {
						u = pgtest.StartPreparedPooler(b, testDB.Name)
					}
					cfg, err := pgxpool.ParseConfig(u)
					require.NoError(b, err)
					cfg.MaxConns = testDB.Pool.Config().MaxConns // as the direct pool
					p, err := pgxpool.NewWithConfig(ctx, cfg)
					require.NoError(b, err)
					b.Cleanup(p.Close)
					pooled[v.pooler] = p
				}
				el = backlog.drainWorker(b, ctx, pooled[v.pooler], v.cfg, 1, nil)
			default:
				if direct[v.mode] == nil {
					direct[v.mode] = benchPool(b, pgtest.WithExecMode(testDB.URL, v.mode), tracer)
				}
				el = backlog.drainWorker(b, ctx, direct[v.mode], v.cfg, max(v.instances, 1), nil)
			}
			pgCPU, goCPU := cpu.stop(b)
			st := tracer.take()
			n, busy := stmtTotal(st)
			add(v.name, "events/s", drainEvents/el.Seconds())
			add(v.name, "stmts/stream", float64(n)/drainStreams)
			add(v.name, "commits/stream", float64(st["COMMIT"].n)/drainStreams)
			add(v.name, "inflight", busy.Seconds()/el.Seconds())
			add(v.name, "pg-cores", pgCPU/el.Seconds())
			add(v.name, "go-cores", goCPU/el.Seconds())
			if c := st["PairsClaim"].n; c > 0 {
				add(v.name, "streams/claim", float64(drainStreams)/float64(c))
			}
			if verbose {
				fmt.Fprintf(os.Stderr, "%s: %.0f events/s in %s; server CPU %.2f cores, Go CPU %.2f cores, %.2f statements in flight; statements:\n%s",
					v.name, drainEvents/el.Seconds(), el, pgCPU/el.Seconds(), goCPU/el.Seconds(), busy.Seconds()/el.Seconds(), stmtReport(st))
			}
		}
		drainRound++
	}
	for _, v := range variants {
		b.ReportMetric(medianOf(fig[v.name]["events/s"]), v.name+"-events/s")
	}
	// Where the time goes, for the default configuration, BatchSize 1000 and the baseline.
	for _, name := range []string{"worker", "b1000", "baseline"} {
		for _, k := range []string{"stmts/stream", "commits/stream", "streams/claim", "inflight", "pg-cores", "go-cores"} {
			if xs := fig[name][k]; len(xs) > 0 {
				b.ReportMetric(medianOf(xs), name+"-"+k)
			}
		}
	}
	if len(fig["worker"]) > 0 && len(fig["baseline"]) > 0 {
		b.ReportMetric(medianOf(fig["worker"]["events/s"])/medianOf(fig["baseline"]["events/s"]), "worker/baseline")
	}
	// The drain's time through each pooler, and direct in exec mode, over its time direct in
	// pgx's default mode (default configuration).
	for _, name := range []string{"pooled", "prepared", "exec"} {
		if len(fig["worker"]) > 0 && len(fig[name]) > 0 {
			b.ReportMetric(medianOf(fig["worker"]["events/s"])/medianOf(fig[name]["events/s"]), name+"/direct-time")
		}
	}
}

// drainBacklog is a queued backlog that drains start from, restored before each: the
// database, the perspective it is queued for, its events, and the tables it is saved in.
type drainBacklog struct {
	pool   *pgxpool.Pool // the database's (setup, restores, checks)
	persp  worker.Perspective
	events int    // queued events
	saved  string // the saved tables' prefix: <saved>_queue, <saved>_cursors
}

// save keeps the queue and cursor rows aside as the backlog (Appends for the registered
// perspective have queued them and created the cursor rows), and empties the queue, the due
// rows and the cursors, so that another backlog can be appended alone on the same database.
func (d drainBacklog) save(b *testing.B, ctx context.Context) {
	b.Helper()
	for _, sql := range []string{
		`DROP TABLE IF EXISTS ` + d.saved + `_queue, ` + d.saved + `_cursors`,
		`CREATE TABLE ` + d.saved + `_queue AS SELECT * FROM wh_perspective_events`,
		`CREATE TABLE ` + d.saved + `_cursors AS SELECT * FROM wh_perspective_cursors`,
		`TRUNCATE wh_perspective_events, wh_perspective_pairs, wh_perspective_cursors`,
	} {
		_, err := d.pool.Exec(ctx, sql)
		require.NoError(b, err)
	}
}

// reset restores the undrained backlog, with fresh tables and statistics (autovacuum
// is off on the test cluster: without this every drain would see the previous one's dead
// rows).
func (d drainBacklog) reset(b *testing.B, ctx context.Context) {
	b.Helper()
	for _, sql := range []string{
		`TRUNCATE wh_perspective_events, wh_perspective_pairs, wh_perspective_cursors, wh_perspective_models, wh_perspective_snapshots`,
		`INSERT INTO wh_perspective_events SELECT * FROM ` + d.saved + `_queue`,
		dueRowsSQL,
		`INSERT INTO wh_perspective_cursors SELECT * FROM ` + d.saved + `_cursors`,
		`VACUUM (ANALYZE) wh_perspective_events, wh_perspective_pairs, wh_perspective_cursors, wh_perspective_models, wh_perspective_snapshots, wh_event_store`,
		`CHECKPOINT`,
	} {
		_, err := d.pool.Exec(ctx, sql)
		require.NoError(b, err)
	}
}

// drainWorker starts n workers (instances with their own IDs) of cfg with the backlog's
// perspective on pool (PollInterval 10 ms unless cfg sets it) and returns the time until
// they have applied every event (their events.applied counter, which counts committed
// applications), checking that the queue is then empty. watch, when not nil, is given the
// count of applied events and the time since the start at every look at the counter (every
// 2 ms).
func (d drainBacklog) drainWorker(b *testing.B, ctx context.Context, pool *pgxpool.Pool, cfg worker.Config, n int, watch func(applied int64, at time.Duration)) time.Duration {
	m := newBenchMetrics()
	cfg.Perspectives = []worker.Perspective{d.persp}
	cfg.MeterProvider = m.mp // shared: the counter sums every instance's applications
	cfg.PollInterval = cmp.Or(cfg.PollInterval, 10*time.Millisecond)
	cfg.Logger = quietLogger()
	ws := make([]*worker.Worker, n)
	for i := range ws {
		w, err := worker.New(pool, cfg)
		require.NoError(b, err)
		ws[i] = w
	}
	b.StartTimer()
	start := time.Now()
	for _, w := range ws {
		require.NoError(b, w.Start(ctx))
	}
	benchWait(b, 5*time.Minute, 2*time.Millisecond, "the drain", func() bool {
		applied := m.counter(b, "perspectives.events.applied")
		if watch != nil {
			watch(applied, time.Since(start))
		}
		return applied >= int64(d.events)
	})
	el := time.Since(start)
	b.StopTimer()
	for _, w := range ws {
		benchStop(b, w)
	}
	var left int
	require.NoError(b, d.pool.QueryRow(ctx, `SELECT count(*) FROM wh_perspective_events`).Scan(&left))
	require.Zero(b, left, "queue rows left after the drain")
	return el
}

// The baseline: per chunk of pairs, one transaction of two statements: claim the pairs
// (cursor rows FOR UPDATE) and read their queued events with data and current model; fold
// in Go with the same perspective; then write every model, advance every cursor and delete
// every applied queue row in one statement. Two goroutines (two cores) drain concurrently,
// each its own half of the pairs (a hash partition), so that no statement's snapshot can
// see queue rows another transaction has just applied.
const (
	drainBaselineChunk = 100 // pairs per transaction
	drainBaselineConc  = 2

	baselineRead = `-- name: BaselineRead
WITH hints AS (
    -- For the write that follows in this transaction: 5000 single-row index probes, not a
    -- hash join over the whole queue (its generic plan) or a two-array index scan.
    SELECT set_config('enable_hashjoin', 'off', true), set_config('enable_mergejoin', 'off', true)
), pairs AS (
    SELECT c.stream_id
    FROM wh_perspective_cursors c
    WHERE c.perspective_name = $1
      AND abs(hashtext(c.stream_id::text)) % $3 = $4
      AND EXISTS (SELECT 1 FROM wh_perspective_events q
                  WHERE q.stream_id = c.stream_id AND q.perspective_name = c.perspective_name)
    ORDER BY c.stream_id
    LIMIT $2
    FOR UPDATE
)
SELECT q.stream_id, q.event_id, e.event_type, e.data, e.created_at, m.model
FROM hints, pairs p
JOIN wh_perspective_events q ON q.stream_id = p.stream_id AND q.perspective_name = $1
JOIN wh_event_store e ON e.event_id = q.event_id
LEFT JOIN wh_perspective_models m ON m.stream_id = p.stream_id AND m.perspective_name = $1
ORDER BY q.stream_id, q.event_id`

	baselineWrite = `-- name: BaselineWrite
WITH input AS (
    SELECT * FROM unnest($2::uuid[], $3::text[], $4::uuid[], $5::int[])
        AS i(stream_id, model, last_event_id, since_snapshot)
), models AS (
    INSERT INTO wh_perspective_models (stream_id, perspective_name, model, last_event_id)
    SELECT stream_id, $1, model::jsonb, last_event_id FROM input
    ON CONFLICT (stream_id, perspective_name) DO UPDATE
    SET model = EXCLUDED.model, last_event_id = EXCLUDED.last_event_id, updated_at = now()
), cursors AS (
    UPDATE wh_perspective_cursors c
    SET last_event_id = i.last_event_id, version = c.version + 1,
        events_since_snapshot = i.since_snapshot, status = 'ok', last_error = NULL,
        attempts = 0, updated_at = now()
    FROM input i
    WHERE c.stream_id = i.stream_id AND c.perspective_name = $1
)
DELETE FROM wh_perspective_events q
USING unnest($6::uuid[], $7::uuid[]) AS d(stream_id, event_id)
WHERE q.stream_id = d.stream_id AND q.perspective_name = $1 AND q.event_id = d.event_id`
)

// drainBaseline drains the backlog on pool with the baseline and returns the time it took,
// checking that the queue is then empty.
func (d drainBacklog) drainBaseline(b *testing.B, ctx context.Context, pool *pgxpool.Pool) time.Duration {
	b.StartTimer()
	start := time.Now()
	var wg sync.WaitGroup
	errs := make(chan error, drainBaselineConc)
	for part := range drainBaselineConc {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				n, err := baselineChunk(ctx, pool, d.persp, part)
				if err != nil {
					errs <- err
					return
				}
				if n == 0 {
					return
				}
			}
		}()
	}
	wg.Wait()
	el := time.Since(start)
	b.StopTimer()
	close(errs)
	for err := range errs {
		require.NoError(b, err)
	}
	var left int
	require.NoError(b, d.pool.QueryRow(ctx, `SELECT count(*) FROM wh_perspective_events`).Scan(&left))
	require.Zero(b, left, "queue rows left after the baseline drain")
	return el
}

// baselineChunk drains one chunk of pairs of persp and returns how many events it applied.
func baselineChunk(ctx context.Context, pool *pgxpool.Pool, persp worker.Perspective, part int) (int, error) {
	applied := 0
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, baselineRead, persp.Name(), drainBaselineChunk, drainBaselineConc, part)
		if err != nil {
			return err
		}
		var (
			streams, lasts, delStreams, delEvents []uuid.UUID
			models                                []string
			since                                 []int32
			model                                 json.RawMessage
			cur                                   uuid.UUID
			count                                 int32
			run                                   []worker.Event // the stream's events, for a BatchApplier
			failed                                error
		)
		batch, _ := persp.(worker.BatchApplier) // as the worker folds: one call per stream's run
		flush := func() {
			if cur == uuid.Nil {
				return
			}
			if batch != nil {
				next, err := batch.ApplyBatch(ctx, model, run)
				if err != nil {
					failed = err
					return
				}
				model, run = next, run[:0]
			}
			streams, models, since = append(streams, cur), append(models, string(model)), append(since, count)
			lasts = append(lasts, delEvents[len(delEvents)-1])
		}
		for rows.Next() {
			var (
				stream, id uuid.UUID
				typ        string
				data, mdl  []byte
				created    time.Time
			)
			if err := rows.Scan(&stream, &id, &typ, &data, &created, &mdl); err != nil {
				return err
			}
			if stream != cur {
				flush()
				cur, model, count = stream, json.RawMessage(mdl), 0
			}
			ev := worker.Event{ID: id, StreamID: stream, Type: typ, Data: data, CreatedAt: created}
			if batch != nil {
				run = append(run, ev)
			} else {
				next, err := persp.Apply(ctx, model, ev)
				if err != nil {
					return err
				}
				model = next
			}
			count++
			delStreams, delEvents = append(delStreams, stream), append(delEvents, id)
		}
		if err := rows.Err(); err != nil {
			return err
		}
		flush()
		if failed != nil {
			return failed
		}
		if len(streams) == 0 {
			return nil
		}
		tag, err := tx.Exec(ctx, baselineWrite, persp.Name(), streams, models, lasts, since, delStreams, delEvents)
		if err != nil {
			return err
		}
		if int(tag.RowsAffected()) != len(delEvents) {
			return fmt.Errorf("baseline deleted %d queue rows for %d events", tag.RowsAffected(), len(delEvents))
		}
		applied = len(delEvents)
		return nil
	})
	return applied, err
}
