package worker_test

// Helpers shared by the worker benchmarks (bench_*_test.go, throughput_bench_test.go).
// BENCHMARKS.md describes what each benchmark measures and the recorded figures.
//
// The benchmarks share the package's TestMain database. They run alone (make bench passes
// -run '^$' and -p 1), so a benchmark that needs a clean slate truncates it; the state a
// benchmark builds is remembered in benchOwner so that its -count repetitions reuse it.

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"runtime"
	"runtime/metrics"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/worker"
)

// benchOwner names the benchmark whose state the database holds now ("" after a truncate
// by anything else).
var benchOwner string

// benchClaim truncates the database for owner unless owner already holds it. It reports
// whether the caller must build its state.
func benchClaim(b *testing.B, owner string) bool {
	b.Helper()
	if benchOwner == owner {
		return false
	}
	testDB.Truncate(context.Background(), b)
	benchOwner = owner
	return true
}

// benchMetrics reads the worker's own counters and histograms (events applied, rewind
// durations) through an OpenTelemetry manual reader. Every gauge is dropped: their callbacks
// query the database at every collection (the queue gauges one statement, the others
// BuildsStatus, which counts the queue too), and the benchmarks collect every few
// milliseconds: BuildsStatus alone would take a quarter of a core of a 1M-event drain's
// server CPU (29 ms a collection).
type benchMetrics struct {
	reader *sdkmetric.ManualReader
	mp     *sdkmetric.MeterProvider
}

func newBenchMetrics() *benchMetrics {
	r := sdkmetric.NewManualReader()
	drop := sdkmetric.NewView(sdkmetric.Instrument{Kind: sdkmetric.InstrumentKindObservableGauge},
		sdkmetric.Stream{Aggregation: sdkmetric.AggregationDrop{}})
	return &benchMetrics{reader: r, mp: sdkmetric.NewMeterProvider(sdkmetric.WithReader(r), sdkmetric.WithView(drop))}
}

// read collects every metric once, by name.
func (m *benchMetrics) read() (map[string]metricdata.Aggregation, error) {
	var rm metricdata.ResourceMetrics
	if err := m.reader.Collect(context.Background(), &rm); err != nil {
		return nil, err
	}
	out := map[string]metricdata.Aggregation{}
	for _, sm := range rm.ScopeMetrics {
		for _, mt := range sm.Metrics {
			out[mt.Name] = mt.Data
		}
	}
	return out, nil
}

func (m *benchMetrics) collect(b testing.TB) map[string]metricdata.Aggregation {
	out, err := m.read()
	require.NoError(b, err)
	return out
}

// total is the total of an int64 counter over all attribute sets (0 before its first
// recording); for a process without a testing.TB (BenchmarkInstances' workers).
func (m *benchMetrics) total(name string) (int64, error) {
	all, err := m.read()
	if err != nil {
		return 0, err
	}
	data, ok := all[name]
	if !ok {
		return 0, nil
	}
	var n int64
	for _, dp := range data.(metricdata.Sum[int64]).DataPoints {
		n += dp.Value
	}
	return n, nil
}

// counter is the total of an int64 counter over all attribute sets.
func (m *benchMetrics) counter(b testing.TB, name string) int64 {
	n, err := m.total(name)
	require.NoError(b, err)
	return n
}

// histogram is the count and sum of a float64 histogram over all attribute sets.
func (m *benchMetrics) histogram(b testing.TB, name string) (uint64, float64) {
	data, ok := m.collect(b)[name]
	if !ok {
		return 0, 0
	}
	var n uint64
	var sum float64
	for _, dp := range data.(metricdata.Histogram[float64]).DataPoints {
		n += dp.Count
		sum += dp.Sum
	}
	return n, sum
}

// benchStart starts a worker with a quiet logger. The caller stops it (benchStop).
func benchStart(b *testing.B, cfg worker.Config) *worker.Worker {
	b.Helper()
	return benchStartOn(b, testDB.Pool, cfg)
}

// benchStartOn starts a worker on pool (a traced pool, for instance).
func benchStartOn(b *testing.B, pool *pgxpool.Pool, cfg worker.Config) *worker.Worker {
	b.Helper()
	if cfg.Logger == nil {
		cfg.Logger = quietLogger()
	}
	w, err := worker.New(pool, cfg)
	require.NoError(b, err)
	require.NoError(b, w.Start(context.Background()))
	return w
}

func benchStop(b *testing.B, w *worker.Worker) {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(b, w.Stop(ctx))
}

// benchWait polls cond every interval until it holds, failing after timeout.
func benchWait(b testing.TB, timeout, interval time.Duration, what string, cond func() bool) {
	b.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			b.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(interval)
	}
}

// benchCount is the number of events folded into the sumPerspective model of a pair.
func benchCount(b testing.TB, name string, stream uuid.UUID) int {
	raw, ok, err := worker.LoadModel(context.Background(), testDB.Pool, name, stream)
	require.NoError(b, err)
	if !ok {
		return 0
	}
	var m sumModel
	require.NoError(b, json.Unmarshal(raw, &m))
	return m.Count
}

// benchWaitCount waits (polling every millisecond) until the model of the pair counts at
// least n events, and returns when it saw it.
func benchWaitCount(b testing.TB, name string, stream uuid.UUID, n int, timeout time.Duration) time.Time {
	b.Helper()
	var seen time.Time
	benchWait(b, timeout, time.Millisecond, "model to include the event", func() bool {
		ok := benchCount(b, name, stream) >= n
		seen = time.Now()
		return ok
	})
	return seen
}

// seqIDs makes event IDs that sort in the order of n and leave room between neighbours:
// a UUIDv7 layout (version 7, RFC 4122 variant) with one fixed millisecond timestamp, a
// salt byte (distinct generators never collide) and a 56-bit sequence n<<10|k in the random
// bits. id(n, k) with 0 < k < 1024 lies strictly between id(n, 0) and id(n+1, 0): that is
// how the benchmarks make late events.
type seqIDs struct {
	ms   uint64
	salt byte
}

var seqSalt byte

func newSeqIDs() seqIDs {
	seqSalt++
	return seqIDs{ms: uint64(time.Now().UnixMilli()), salt: seqSalt}
}

func (s seqIDs) id(n, k int) uuid.UUID {
	var u uuid.UUID
	var ts [8]byte
	binary.BigEndian.PutUint64(ts[:], s.ms)
	copy(u[0:6], ts[2:8])
	u[6] = 0x70
	u[7] = s.salt
	var seq [8]byte
	binary.BigEndian.PutUint64(seq[:], uint64(n)<<10|uint64(k))
	copy(u[9:16], seq[1:8])
	u[8] = 0x80
	return u
}

// seqStream returns n events of stream with IDs ids.id(0..n-1, 0), in order.
func seqStream(stream uuid.UUID, ids seqIDs, n int) []worker.Event {
	evs := make([]worker.Event, n)
	for i := range evs {
		evs[i] = amountEvent(stream, ids.id(i, 0), i+1)
	}
	return evs
}

// amountEvent is an event of the sumPerspective/ledger kind.
func amountEvent(stream, id uuid.UUID, n int) worker.Event {
	return worker.Event{ID: id, StreamID: stream, Type: "amount", Data: json.RawMessage(`{"n":` + itoa(n) + `}`)}
}

// benchAppend appends events in batches of 1000.
func benchAppend(b testing.TB, evs []worker.Event) {
	b.Helper()
	for len(evs) > 0 {
		n := min(len(evs), 1000)
		require.NoError(b, worker.Append(context.Background(), testDB.Pool, evs[:n]...))
		evs = evs[n:]
	}
}

// percentile returns the p-quantile (0..1) of xs by the nearest-rank method.
func percentile(xs []float64, p float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	i := int(math.Ceil(p*float64(len(s)))) - 1
	return s[max(0, min(i, len(s)-1))]
}

func medianOf(xs []float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// heapSampler records the peak of the Go heap (bytes in heap objects, live or not yet
// swept, from runtime/metrics) above its value at start, sampled every 200µs, and the bytes
// allocated meanwhile.
type heapSampler struct {
	stop, done chan struct{}
	base, peak uint64
	allocs0    uint64
}

var heapMetrics = []string{"/memory/classes/heap/objects:bytes", "/gc/heap/allocs:bytes"}

func readHeap() (objects, allocs uint64) {
	s := []metrics.Sample{{Name: heapMetrics[0]}, {Name: heapMetrics[1]}}
	metrics.Read(s)
	return s[0].Value.Uint64(), s[1].Value.Uint64()
}

func startHeapSampler() *heapSampler {
	runtime.GC()
	h := &heapSampler{stop: make(chan struct{}), done: make(chan struct{})}
	h.base, h.allocs0 = readHeap()
	h.peak = h.base
	go func() {
		defer close(h.done)
		t := time.NewTicker(200 * time.Microsecond)
		defer t.Stop()
		for {
			select {
			case <-h.stop:
				return
			case <-t.C:
			}
			if v, _ := readHeap(); v > h.peak {
				h.peak = v
			}
		}
	}()
	return h
}

// end stops sampling and returns the peak above the start and the bytes allocated.
func (h *heapSampler) end() (peakAbove, allocated uint64) {
	close(h.stop)
	<-h.done
	v, allocs := readHeap()
	h.peak = max(h.peak, v)
	return h.peak - h.base, allocs - h.allocs0
}

// stmtTracer counts the statements a pool runs and the time spent in each, by name (the
// sqlc "-- name:" comment, else the statement's first word): round trips are what the
// throughput benchmarks are about.
type stmtTracer struct {
	mu    sync.Mutex
	stats map[string]*stmtStat
}

type stmtStat struct {
	n    int
	d    time.Duration
	max  time.Duration
	last time.Time // when the last one ended
}

type stmtTraceKey struct{}

type stmtTraceStart struct {
	name string
	at   time.Time
}

func newStmtTracer() *stmtTracer { return &stmtTracer{stats: map[string]*stmtStat{}} }

func stmtName(sql string) string {
	sql = strings.TrimSpace(sql)
	if rest, ok := strings.CutPrefix(sql, "-- name: "); ok {
		if i := strings.IndexAny(rest, " \n"); i > 0 {
			return rest[:i]
		}
		return rest
	}
	if i := strings.IndexAny(sql, " \n"); i > 0 {
		sql = sql[:i]
	}
	return strings.ToUpper(sql)
}

func (t *stmtTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	return context.WithValue(ctx, stmtTraceKey{}, stmtTraceStart{name: stmtName(data.SQL), at: time.Now()})
}

func (t *stmtTracer) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryEndData) {
	st, ok := ctx.Value(stmtTraceKey{}).(stmtTraceStart)
	if !ok {
		return
	}
	end := time.Now()
	d := end.Sub(st.at)
	t.mu.Lock()
	s := t.stats[st.name]
	if s == nil {
		s = &stmtStat{}
		t.stats[st.name] = s
	}
	s.n++
	s.d += d
	s.max = max(s.max, d)
	s.last = end
	t.mu.Unlock()
}

// take returns the statistics gathered since the last take and resets them.
func (t *stmtTracer) take() map[string]stmtStat {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make(map[string]stmtStat, len(t.stats))
	for k, v := range t.stats {
		out[k] = *v
	}
	t.stats = map[string]*stmtStat{}
	return out
}

func stmtTotal(stats map[string]stmtStat) (n int, d time.Duration) {
	for _, s := range stats {
		n += s.n
		d += s.d
	}
	return n, d
}

// stmtReport formats statistics by total time, largest first.
func stmtReport(stats map[string]stmtStat) string {
	names := make([]string, 0, len(stats))
	for k := range stats {
		names = append(names, k)
	}
	slices.SortFunc(names, func(a, b string) int { return int(stats[b].d - stats[a].d) })
	var sb strings.Builder
	for _, k := range names {
		s := stats[k]
		fmt.Fprintf(&sb, "  %-28s %7d stmts %9.1f ms total %7.3f ms each %7.3f ms max\n", k, s.n, ms(s.d), ms(s.d)/float64(s.n), ms(s.max))
	}
	return sb.String()
}

// benchPool opens a pool on the database at dbURL (as pgtest does: 24 connections) with a
// statement tracer. It is closed when the benchmark ends.
func benchPool(b *testing.B, dbURL string, tracer pgx.QueryTracer) *pgxpool.Pool {
	b.Helper()
	cfg, err := pgxpool.ParseConfig(dbURL)
	require.NoError(b, err)
	cfg.MaxConns = 24
	cfg.ConnConfig.Tracer = tracer
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(b, err)
	b.Cleanup(pool.Close)
	return pool
}

// cpuMeter measures the CPU time the benchmark's own process and the PostgreSQL server
// processes serving one database use between start and stop (PostgreSQL runs on this
// host; its processes are found in pg_stat_activity and read from /proc). On a
// 2-core machine this says whether a variant is CPU-bound or waits (round trips, WAL
// flushes).
type cpuMeter struct {
	pool *pgxpool.Pool // on the database whose server processes it measures
	pg0  map[int]time.Duration
	go0  time.Duration
}

// startCPU starts measuring this process and the server processes of pool's database.
func startCPU(b testing.TB, pool *pgxpool.Pool) *cpuMeter {
	return &cpuMeter{pool: pool, pg0: backendCPU(b, pool), go0: processCPU()}
}

// stop returns the CPU seconds used by the server processes and by this process.
func (c *cpuMeter) stop(b testing.TB) (pg, goCPU float64) {
	var d time.Duration
	for pid, t := range backendCPU(b, c.pool) {
		d += t - c.pg0[pid] // a backend started meanwhile counts from zero
	}
	return d.Seconds(), (processCPU() - c.go0).Seconds()
}

func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// backendCPU is the CPU time used so far by each server process of pool's database.
func backendCPU(b testing.TB, pool *pgxpool.Pool) map[int]time.Duration {
	rows, err := pool.Query(context.Background(),
		`SELECT pid FROM pg_stat_activity WHERE datname = current_database()`)
	require.NoError(b, err)
	pids, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	require.NoError(b, err)
	out := make(map[int]time.Duration, len(pids))
	for _, pid := range pids {
		raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			continue // not on this host, or gone
		}
		s := string(raw)
		f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
		if len(f) < 13 {
			continue
		}
		ut, _ := strconv.ParseInt(f[11], 10, 64) // utime (field 14), in clock ticks of 10ms
		st, _ := strconv.ParseInt(f[12], 10, 64) // stime (field 15)
		out[int(pid)] = time.Duration(ut+st) * 10 * time.Millisecond
	}
	return out
}

// benchLocker is a Postgres stream locker on the test database.
func benchLocker(b testing.TB, opts locker.Options) *locker.Postgres {
	b.Helper()
	lk, err := locker.NewPostgres(testDB.Pool, opts)
	require.NoError(b, err)
	return lk
}

// dueRowsSQL gives every pair with queued events that has no due row one, due at its oldest
// event: what Append does, for the loads that write the queue by hand.
const dueRowsSQL = `INSERT INTO wh_perspective_pairs (stream_id, perspective_name, due_at)
	SELECT stream_id, perspective_name, min(enqueued_at) FROM wh_perspective_events GROUP BY 1, 2
	ON CONFLICT (stream_id, perspective_name) DO NOTHING`
