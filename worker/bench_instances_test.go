package worker_test

// Many instances: the same backlog drained by one worker process and by
// four, each a process of its own (this test binary run again as a worker), on a database
// created for the run. Reported per variant (instancesVariants): events/s and its ratio to
// one default process, the claims (PairsClaim statements) per applied event and their
// ratio, the CPU time the whole machine spent during the drain (database and workers) and its
// ratio, and the smallest and largest share of the events one process applied. On a 2-core
// machine four processes cannot apply more than one: the figure that matters is that they do
// not apply less, nor waste claims colliding. One process with as many slots as the four
// (x1c16) tells the cost of more instances from that of more concurrent transactions.
// Each variant drains twice (drainProcesses): cold, the processes just started, and warm,
// the processes waiting for work as long-running instances do. The figures without a round
// in their name are the warm round's; "-cold-" ones the cold round's.

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
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/worker"
)

// benchWorkerEnv, set to a database URL, makes this test binary a worker process of
// BenchmarkInstances (see TestMain): it prints "ready", starts its worker when a line
// arrives on stdin, answers each further line with "claims N applied M transactions K" (the
// counts since its last answer), and stops its worker when stdin closes.
const benchWorkerEnv = "PERSPECTIVES_BENCH_WORKER_DB"

// benchWorkerConcEnv is the Concurrency of a worker process (unset: the default).
const benchWorkerConcEnv = "PERSPECTIVES_BENCH_WORKER_CONCURRENCY"

// benchCPUProfileEnv names a directory to which each worker process writes its CPU profile,
// from its worker's start to its stop, as <pid>.prof (for go tool pprof;
// BENCHMARKS.md, section BenchmarkInstances).
const benchCPUProfileEnv = "PERSPECTIVES_BENCH_CPUPROFILE"

const (
	instancesName      = "bench_instances"
	instancesStreams   = 8000
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
	m := newBenchMetrics() // without the gauges, which would query the queue at every count
	w, err := worker.New(pool, worker.Config{
		Perspectives:  []worker.Perspective{sumPerspective(instancesName)},
		MeterProvider: m.mp,
		Logger:        slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
		Concurrency:   concurrency,
	})
	if err != nil {
		return err
	}
	fmt.Println("ready")
	in := bufio.NewScanner(os.Stdin)
	if !in.Scan() {
		return fmt.Errorf("waiting for the start: %v", cmp.Or(in.Err(), io.EOF))
	}
	if err := w.Start(ctx); err != nil {
		return err
	}
	if dir := os.Getenv(benchCPUProfileEnv); dir != "" {
		f, err := os.Create(fmt.Sprintf("%s/%d.prof", dir, os.Getpid()))
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	// Each further line asks for the counts since the last one; stdin's end stops the worker.
	var reported int64
	var used time.Duration // the process's CPU time at its last answer
	for in.Scan() {
		applied, err := m.total("perspectives.events.applied")
		if err != nil {
			return err
		}
		stats := tracer.take()
		var ru syscall.Rusage
		if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
			return err
		}
		cpu := time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
		var lastCommit int64 // Unix nanoseconds; 0: none since the last answer
		if c, ok := stats["PairsApplyCommit"]; ok {
			lastCommit = c.last.UnixNano()
		}
		fmt.Printf("claims %d applied %d transactions %d cpu %d last %d\n",
			stats["PairsClaim"].n, applied-reported, stats["PairsLockForApply"].n, cpu-used, lastCommit)
		used = cpu
		reported = applied
	}
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	return w.Stop(sctx)
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

// instancesRound is one drain of the backlog by a variant's processes: the time it took, the
// CPU time the whole machine spent meanwhile (the database's and the workers'), and each
// process's claims and applied events.
type instancesRound struct {
	el              time.Duration // to the end of the last apply commit statement
	cpu             float64       // the machine's
	workersCPU      float64       // the worker processes' (a part of cpu)
	claims, applied []int64
}

// drainProcesses starts n worker processes of the given Concurrency (0: the default) and has
// them drain the backlog twice. The cold round is the backlog restore has put in place before
// they start: it includes each process's start-up (its connections, and every server backend's
// first statements). The warm round is the same backlog restored again, in one transaction
// with the wake-up notification, while the processes wait for work, as long-running instances do.
func drainProcesses(b *testing.B, pool *pgxpool.Pool, dbURL string, n, concurrency int, restore func(pgx.Tx)) (cold, warm instancesRound) {
	b.Helper()
	ctx := context.Background()
	inTx := func(extra string) (commit func()) {
		tx, err := pool.Begin(ctx)
		require.NoError(b, err)
		restore(tx)
		if extra != "" {
			_, err = tx.Exec(ctx, extra)
			require.NoError(b, err)
		}
		return func() { require.NoError(b, tx.Commit(ctx)) }
	}
	inTx("")()
	ps := make([]*benchProcess, n)
	for i := range ps {
		ps[i] = startBenchProcess(b, dbURL, concurrency)
	}
	for _, p := range ps {
		p.expect(b, "ready")
	}
	round := func(start func()) instancesRound {
		t0, cpu0 := time.Now(), machineCPU(b)
		start()
		benchWait(b, 5*time.Minute, 50*time.Millisecond, "the drain", func() bool {
			var queued bool
			require.NoError(b, pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM wh_perspective_events)`).Scan(&queued))
			return !queued
		})
		// The drain's time runs to the end of its last apply commit statement, as the processes
		// tell it: the queue is looked at only every 50 ms (the look reads every dead row the
		// drain left, and would take a core's fifth if it ran all the time).
		r := instancesRound{cpu: machineCPU(b) - cpu0, claims: make([]int64, n), applied: make([]int64, n)}
		// A process counts an event applied right after its commit, which the empty queue may
		// precede by a moment: ask until every event is counted.
		for deadline := time.Now().Add(10 * time.Second); ; {
			var total int64
			for i, p := range ps {
				_, err := io.WriteString(p.stdin, "count\n")
				require.NoError(b, err)
				var c, a, t, cpu, last int64
				_, err = fmt.Sscanf(p.expect(b, "claims "), "claims %d applied %d transactions %d cpu %d last %d", &c, &a, &t, &cpu, &last)
				require.NoError(b, err)
				if last != 0 {
					r.el = max(r.el, time.Unix(0, last).Sub(t0))
				}
				r.claims[i] += c
				r.applied[i] += a
				r.workersCPU += time.Duration(cpu).Seconds()
				total += r.applied[i]
			}
			if total >= instancesEvents || time.Now().After(deadline) {
				require.Positive(b, r.el, "no apply commit was seen")
				return r
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	cold = round(func() {
		for _, p := range ps {
			_, err := io.WriteString(p.stdin, "go\n")
			require.NoError(b, err)
		}
	})
	commit := inTx(`SELECT pg_notify('wh_perspective_events', '')`)
	warm = round(commit)
	for _, p := range ps {
		require.NoError(b, p.stdin.Close())
		require.NoError(b, p.cmd.Wait())
	}
	return cold, warm
}

type instancesVariant struct {
	name                   string
	processes, concurrency int
}

// instancesVariants are the ways BenchmarkInstances drains the backlog; the first is the
// reference of the ratios.
var instancesVariants = []instancesVariant{
	{"x1", 1, 0},   // one process, default Concurrency (4)
	{"x4", 4, 0},   // four processes, default Concurrency each (16 slots on 2 cores)
	{"x4c1", 4, 1}, // four processes, Concurrency 1 each (as many slots as x1)
	// one process with as many slots as x4: what 16 transactions cost on this machine,
	// whatever the number of instances
	{"x1c16", 1, 16},
}

// BenchmarkInstances reports the drain of 8,000 streams × 25 events by one worker process
// and by four, on the same backlog (restored between the variants).
//
// PERSPECTIVES_BENCH_INSTANCES=x4,x1c16 runs only the variants named (for profiling; the
// first one named is then the reference of the ratios).
func BenchmarkInstances(b *testing.B) {
	ctx := context.Background()
	variants := instancesVariants
	if only := os.Getenv("PERSPECTIVES_BENCH_INSTANCES"); only != "" {
		variants = slices.DeleteFunc(slices.Clone(variants), func(v instancesVariant) bool {
			return !slices.Contains(strings.Split(only, ","), v.name)
		})
		require.NotEmpty(b, variants, "PERSPECTIVES_BENCH_INSTANCES=%s names no variant", only)
	}
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
		// Kept aside, to restore the same backlog for every drain.
		for _, q := range []string{
			`CREATE TABLE bench_queue AS SELECT * FROM wh_perspective_events`,
			`ANALYZE`,
		} {
			_, err := d.Pool.Exec(ctx, q)
			require.NoError(b, err)
		}
		restore := func(tx pgx.Tx) {
			for _, q := range []string{
				`TRUNCATE wh_perspective_models, wh_perspective_snapshots, wh_perspective_events, wh_perspective_pairs`,
				`UPDATE wh_perspective_cursors SET last_event_id = NULL, version = version + 1, events_since_snapshot = 0`,
				// Due now, in the order they were appended (their times squeezed into the last
				// millisecond).
				`INSERT INTO wh_perspective_events (stream_id, perspective_name, event_id, enqueued_at)
				 SELECT q.stream_id, q.perspective_name, q.event_id, t
				 FROM bench_queue q, (SELECT max(enqueued_at) AS last FROM bench_queue) l,
				      LATERAL (SELECT now() - (l.last - q.enqueued_at) / 1000 AS t) at`,
				dueRowsSQL,
			} {
				_, err := tx.Exec(ctx, q)
				require.NoError(b, err)
			}
		}
		var base [2]struct{ rate, cpe, cpu float64 } // cold, warm
		for i, v := range variants {
			cold, warm := drainProcesses(b, d.Pool, d.URL, v.processes, v.concurrency, restore)
			for k, r := range []instancesRound{cold, warm} {
				var claims, applied int64
				lo, hi := r.applied[0], r.applied[0]
				for j, a := range r.applied {
					claims, applied = claims+r.claims[j], applied+a
					lo, hi = min(lo, a), max(hi, a)
				}
				prefix := v.name + []string{"-cold", ""}[k]
				require.EqualValues(b, instancesEvents, applied, "%s: every event applied once", prefix)
				b.Logf("%s: %s, machine CPU %.2f s (worker processes %.2f s), claims %v applied %v", prefix, r.el, r.cpu, r.workersCPU, r.claims, r.applied)
				rate, cpe := instancesEvents/r.el.Seconds(), float64(claims)/instancesEvents
				if i == 0 {
					base[k].rate, base[k].cpe, base[k].cpu = rate, cpe, r.cpu
				}
				res := results[prefix]
				if res == nil {
					res = map[string][]float64{}
					results[prefix] = res
				}
				res["events/s"] = append(res["events/s"], rate)
				res["claims/event"] = append(res["claims/event"], cpe)
				res["throughput/x1"] = append(res["throughput/x1"], rate/base[k].rate)
				res["claims/event/x1"] = append(res["claims/event/x1"], cpe/base[k].cpe)
				res["cpu/x1"] = append(res["cpu/x1"], r.cpu/base[k].cpu)
				res["min-share-%"] = append(res["min-share-%"], 100*float64(lo)/instancesEvents)
				res["max-share-%"] = append(res["max-share-%"], 100*float64(hi)/instancesEvents)
			}
		}
	}
	for i, v := range variants {
		for k, prefix := range []string{v.name + "-cold", v.name} {
			for _, unit := range []string{"events/s", "claims/event", "throughput/x1", "claims/event/x1", "cpu/x1", "min-share-%", "max-share-%"} {
				ratio := strings.Contains(unit, "/x1")
				if (i == 0 && ratio) || (v.processes == 1 && strings.HasSuffix(unit, "share-%")) ||
					(k == 0 && unit != "throughput/x1" && unit != "claims/event/x1" && !(i == 0 && unit == "events/s")) {
					continue
				}
				b.ReportMetric(medianOf(results[prefix][unit]), prefix+"-"+unit)
			}
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
