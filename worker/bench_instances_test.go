package worker_test

// Many instances (issue 15, item 5): the same backlog drained by one worker process and by
// four, each a process of its own (this test binary run again as a worker), on a database
// created for the run. Reported per variant (instancesVariants): events/s and its ratio to
// one default process, the claims (QueueDuePairs statements) per applied event and their
// ratio, the CPU time the whole machine spent during the drain (database and workers) and its
// ratio, and the smallest and largest share of the events one process applied. On a 2-core
// machine four processes cannot apply more than one: the figure that matters is that they do
// not apply less, nor waste claims colliding. One process with as many slots as the four
// (x1c16) tells the cost of more instances from that of more concurrent transactions.

import (
	"bufio"
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/perspectives-go/perspectives/worker"
)

// benchWorkerEnv, set to a database URL, makes this test binary a worker process of
// BenchmarkInstances (see TestMain): it prints "ready", starts its worker when a line
// arrives on stdin, and when stdin closes stops it and prints "claims N applied M transactions K".
const benchWorkerEnv = "PERSPECTIVES_BENCH_WORKER_DB"

// benchWorkerConcEnv is the Concurrency of a worker process (unset: the default).
const benchWorkerConcEnv = "PERSPECTIVES_BENCH_WORKER_CONCURRENCY"

const (
	instancesName      = "bench_instances"
	instancesStreams   = 2000
	instancesPerStream = 25
	instancesEvents    = instancesStreams * instancesPerStream
)

// runBenchWorker is the worker process of BenchmarkInstances.
func runBenchWorker(dbURL string) int {
	if err := benchWorkerProcess(dbURL); err != nil {
		fmt.Fprintln(os.Stderr, "bench worker:", err)
		return 1
	}
	return 0
}

func benchWorkerProcess(dbURL string) error {
	ctx := context.Background()
	concurrency, _ := strconv.Atoi(os.Getenv(benchWorkerConcEnv)) // 0: the default
	cfg, err := pgxpool.ParseConfig(dbURL)
	if err != nil {
		return err
	}
	// A connection per slot, the loop's claim and the heartbeat (the default pool has 4).
	cfg.MaxConns = max(cfg.MaxConns, int32(cmp.Or(concurrency, worker.DefaultConcurrency))+2)
	tracer := newStmtTracer() // counts the claims and apply transactions
	cfg.ConnConfig.Tracer = tracer
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	reader := sdkmetric.NewManualReader()
	w, err := worker.New(pool, worker.Config{
		Perspectives:  []worker.Perspective{sumPerspective(instancesName)},
		MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)),
		Logger:        slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
		Concurrency:   concurrency,
	})
	if err != nil {
		return err
	}
	fmt.Println("ready")
	in := bufio.NewReader(os.Stdin)
	if _, err := in.ReadString('\n'); err != nil {
		return fmt.Errorf("waiting for the start: %w", err)
	}
	if err := w.Start(ctx); err != nil {
		return err
	}
	_, _ = io.Copy(io.Discard, in) // until the parent closes stdin
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := w.Stop(sctx); err != nil {
		return err
	}
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(ctx, &rm); err != nil {
		return err
	}
	var applied int64
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if sum, ok := m.Data.(metricdata.Sum[int64]); ok && m.Name == "perspectives.events.applied" {
				for _, dp := range sum.DataPoints {
					applied += dp.Value
				}
			}
		}
	}
	stats := tracer.take()
	fmt.Printf("claims %d applied %d transactions %d\n", stats["QueueDuePairs"].n, applied, stats["PairsLockForApply"].n)
	return nil
}

// benchProcess is a running worker process.
type benchProcess struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	lines chan string
}

func startBenchProcess(b *testing.B, dbURL string, concurrency int) *benchProcess {
	b.Helper()
	exe, err := os.Executable()
	require.NoError(b, err)
	cmd := exec.Command(exe, "-test.run=^$", "-test.bench=^$")
	cmd.Env = append(os.Environ(), benchWorkerEnv+"="+dbURL, benchWorkerConcEnv+"="+strconv.Itoa(concurrency))
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	require.NoError(b, err)
	stdout, err := cmd.StdoutPipe()
	require.NoError(b, err)
	require.NoError(b, cmd.Start())
	p := &benchProcess{cmd: cmd, stdin: stdin, lines: make(chan string, 4)}
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			p.lines <- sc.Text()
		}
		close(p.lines)
	}()
	b.Cleanup(func() { _ = stdin.Close(); _ = cmd.Process.Kill(); _ = cmd.Wait() })
	return p
}

// expect returns the process's next line, failing unless it starts with prefix.
func (p *benchProcess) expect(b *testing.B, prefix string) string {
	b.Helper()
	select {
	case line, ok := <-p.lines:
		require.True(b, ok, "the worker process ended before printing %q", prefix)
		require.True(b, strings.HasPrefix(line, prefix), "worker process printed %q, want %q", line, prefix)
		return line
	case <-time.After(time.Minute):
		b.Fatalf("no %q from the worker process within a minute", prefix)
		return ""
	}
}

// drainProcesses drains the database's backlog with n worker processes of the given
// Concurrency (0: the default) and returns the time it took, the CPU time the whole machine
// spent meanwhile (the database's and the workers'), and each process's claims and applied
// events.
func drainProcesses(b *testing.B, pool *pgxpool.Pool, dbURL string, n, concurrency int) (time.Duration, float64, []int64, []int64) {
	b.Helper()
	ps := make([]*benchProcess, n)
	for i := range ps {
		ps[i] = startBenchProcess(b, dbURL, concurrency)
	}
	for _, p := range ps {
		p.expect(b, "ready")
	}
	start := time.Now()
	cpu0 := machineCPU(b)
	for _, p := range ps {
		_, err := io.WriteString(p.stdin, "go\n")
		require.NoError(b, err)
	}
	benchWait(b, 5*time.Minute, 2*time.Millisecond, "the drain", func() bool {
		var queued bool
		require.NoError(b, pool.QueryRow(context.Background(), `SELECT EXISTS (SELECT 1 FROM wh_perspective_events)`).Scan(&queued))
		return !queued
	})
	el := time.Since(start)
	cpu := machineCPU(b) - cpu0
	claims, applied := make([]int64, n), make([]int64, n)
	for i, p := range ps {
		require.NoError(b, p.stdin.Close())
		line := p.expect(b, "claims ")
		_, err := fmt.Sscanf(line, "claims %d applied %d", &claims[i], &applied[i])
		require.NoError(b, err)
		b.Logf("process %d of %d: %s", i+1, n, line)
		require.NoError(b, p.cmd.Wait())
	}
	return el, cpu, claims, applied
}

// instancesVariants are the ways BenchmarkInstances drains the backlog; the first is the
// reference of the ratios.
var instancesVariants = []struct {
	name                   string
	processes, concurrency int
}{
	{"x1", 1, 0},   // one process, default Concurrency (4)
	{"x4", 4, 0},   // four processes, default Concurrency each (16 slots on 2 cores)
	{"x4c1", 4, 1}, // four processes, Concurrency 1 each (as many slots as x1)
	// one process with as many slots as x4: what 16 transactions cost on this machine,
	// whatever the number of instances
	{"x1c16", 1, 16},
}

// BenchmarkInstances reports the drain of 2,000 streams × 25 events by one worker process
// and by four, on the same backlog (restored between the variants).
func BenchmarkInstances(b *testing.B) {
	ctx := context.Background()
	results := map[string]map[string][]float64{} // variant -> unit -> one value per run
	for range b.N {
		d := freshDB(b, "instances")
		register(b, d.Pool, worker.Config{Perspectives: []worker.Perspective{sumPerspective(instancesName)}})
		batch := make([]worker.Event, 0, 1000)
		for range instancesStreams {
			s := uuid.New()
			for i := range instancesPerStream {
				batch = append(batch, worker.Event{StreamID: s, Type: "amount", Data: json.RawMessage(`{"n":` + itoa(i+1) + `}`)})
				if len(batch) == cap(batch) {
					require.NoError(b, worker.Append(ctx, d.Pool, batch...))
					batch = batch[:0]
				}
			}
		}
		// Kept aside, to restore the same backlog for the second drain.
		for _, q := range []string{
			`CREATE TABLE bench_queue AS SELECT * FROM wh_perspective_events`,
			`ANALYZE`,
		} {
			_, err := d.Pool.Exec(ctx, q)
			require.NoError(b, err)
		}
		restore := func() {
			for _, q := range []string{
				`TRUNCATE wh_perspective_models, wh_perspective_snapshots`,
				`UPDATE wh_perspective_cursors SET last_event_id = NULL, version = version + 1, events_since_snapshot = 0`,
				`INSERT INTO wh_perspective_events SELECT * FROM bench_queue`,
			} {
				_, err := d.Pool.Exec(ctx, q)
				require.NoError(b, err)
			}
		}
		sum := func(xs []int64) (s int64) {
			for _, x := range xs {
				s += x
			}
			return s
		}
		var base struct{ rate, cpe, cpu float64 }
		for i, v := range instancesVariants {
			if i > 0 {
				restore()
			}
			el, cpu, claims, applied := drainProcesses(b, d.Pool, d.URL, v.processes, v.concurrency)
			require.EqualValues(b, instancesEvents, sum(applied), "%s: every event applied once", v.name)
			b.Logf("%s: %s, machine CPU %.2f s, claims %v applied %v", v.name, el, cpu, claims, applied)
			rate, cpe := instancesEvents/el.Seconds(), float64(sum(claims))/instancesEvents
			if i == 0 {
				base.rate, base.cpe, base.cpu = rate, cpe, cpu
			}
			lo, hi := applied[0], applied[0]
			for _, a := range applied {
				lo, hi = min(lo, a), max(hi, a)
			}
			r := results[v.name]
			if r == nil {
				r = map[string][]float64{}
				results[v.name] = r
			}
			r["events/s"] = append(r["events/s"], rate)
			r["claims/event"] = append(r["claims/event"], cpe)
			r["throughput/x1"] = append(r["throughput/x1"], rate/base.rate)
			r["claims/event/x1"] = append(r["claims/event/x1"], cpe/base.cpe)
			r["cpu/x1"] = append(r["cpu/x1"], cpu/base.cpu)
			r["min-share-%"] = append(r["min-share-%"], 100*float64(lo)/instancesEvents)
			r["max-share-%"] = append(r["max-share-%"], 100*float64(hi)/instancesEvents)
		}
	}
	for i, v := range instancesVariants {
		for _, unit := range []string{"events/s", "claims/event", "throughput/x1", "claims/event/x1", "cpu/x1", "min-share-%", "max-share-%"} {
			if (i == 0 && unit != "events/s" && unit != "claims/event") || (v.processes == 1 && strings.HasSuffix(unit, "share-%")) {
				continue
			}
			b.ReportMetric(medianOf(results[v.name][unit]), v.name+"-"+unit)
		}
	}
}

// machineCPU is the CPU time the machine has spent busy since it booted, in seconds: the
// first line of /proc/stat, all but idle and iowait, in USER_HZ (100 per second on Linux).
func machineCPU(b *testing.B) float64 {
	b.Helper()
	data, err := os.ReadFile("/proc/stat")
	require.NoError(b, err)
	line, _, _ := strings.Cut(string(data), "\n")
	fields := strings.Fields(line)
	require.Greater(b, len(fields), 5, "/proc/stat: %q", line)
	var busy float64
	for i, x := range fields[1:] {
		v, err := strconv.ParseFloat(x, 64)
		require.NoError(b, err)
		if i != 3 && i != 4 && i != 8 && i != 9 { // idle, iowait; guest and guest_nice are in user and nice already
			busy += v
		}
	}
	return busy / 100
}
