// Command bench summarises `go test -bench` output: it copies its input to stdout as it
// reads it, then prints, for every benchmark and metric, the median over the runs (-count)
// with the minimum and maximum, and the targets of the issues with the median measured and
// whether it is met. It never fails on a missed target: speed is reported, not asserted.
//
//	go test -run '^$' -bench . -benchtime 1x -count 3 -p 1 ./... 2>&1 | go run ./bench
//
// `make bench` runs exactly that. BENCHMARKS.md explains every figure.
package main

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
)

// target is one figure of the issues with its bound.
type target struct {
	bench, metric string
	atMost        bool // the figure must be <= bound (else >= bound)
	bound         float64
	what          string
}

var targets = []target{
	{"BenchmarkLockCycle/conc=1", "lock/floor", true, 1.10, "lock cycle ≤ 1.10× the floor, concurrency 1"},
	{"BenchmarkLockCycle/conc=8", "lock/floor", true, 1.10, "lock cycle ≤ 1.10× the floor, concurrency 8"},
	{"BenchmarkWorkerDrain", "worker-events/s", false, 50000, "drain ≥ 50,000 events/s (default config)"},
	{"BenchmarkWorkerDrain", "worker/baseline", false, 0.6, "drain ≥ 0.6× the hand-written baseline"},
	{"BenchmarkWakeupLatency", "idle-p50-ms", true, 10, "wake-up at idle, median ≤ 10 ms"},
	{"BenchmarkWakeupLatency", "late-p50-ms", true, 25, "late event (rewind), median ≤ 25 ms"},
	{"BenchmarkRewindCost", "100k/1k-rewind", true, 1.5, "100k-event rewind ≤ 1.5× the 1k rewind (worker time)"},
	{"BenchmarkRewindCost", "100k/1k-e2e", true, 1.5, "100k-event rewind ≤ 1.5× the 1k rewind (Append to model)"},
	{"BenchmarkRewindCost", "100k/1k-peak-heap", true, 1.25, "peak heap of a rewind flat in stream length (100k/1k ≤ 1.25)"},
	{"BenchmarkIsolation", "during/normal", false, 0.9, "other streams during a long rewind ≥ 0.9× normal"},
	{"BenchmarkTakeover/poll=1s", "takeover/bound", true, 1, "takeover ≤ LockTimeout + PollInterval + 1s (poll 1s)"},
	{"BenchmarkTakeover/poll=100ms", "takeover/bound", true, 1, "takeover ≤ LockTimeout + PollInterval + 1s (poll 100ms)"},
	// Issue 12: the lifecycle over 1,000,000 stored events (20,000 streams × 50).
	{"BenchmarkLifecycle", "register-start-ms", true, 1000, "registration: Start of a new perspective ≤ 1 s"},
	{"BenchmarkLifecycle", "register-append-max-ms", true, 50, "registration: slowest Append meanwhile ≤ 50 ms"},
	{"BenchmarkLifecycle", "register-queue-rows", true, 20000, "registration: queue rows ≤ 1 per stream (20,000)"},
	{"BenchmarkLifecycle", "catchup/floor", false, 0.8, "catch-up throughput ≥ 0.8× the hand-written floor"},
	{"BenchmarkLifecycle", "during-build/idle", true, 2, "Append → v1 model while v2 builds ≤ 2× idle"},
	// Issue 15: wake-up from the caller's clock (before Append is called).
	{"BenchmarkWakeupLatency", "idle-call-p50-ms", true, 10, "wake-up at idle from the Append call, median ≤ 10 ms"},
	{"BenchmarkWakeupLatency", "late-call-p50-ms", true, 25, "late event from the Append call, median ≤ 25 ms"},
	{"BenchmarkStarvation", "hot-applied-at-cold-done-%", true, 20, "100 cold streams done before 20% of a hot stream's 2,000 Appends"},
	{"BenchmarkAppendCost", "append/floor", true, 1.5, "Append of 1 event ≤ 1.5× a one-statement floor"},
	{"BenchmarkWorkerDrain", "worker/baseline", false, 0.9, "drain ≥ 0.9× the hand-written baseline (issue 15)"},
	{"BenchmarkLiveTraffic", "live-empty-after-ms", true, 100, "live traffic, fresh database: queue empty ≤ 100 ms after the last Append"},
	{"BenchmarkLiveTraffic", "live-snapshot-rows", true, 0, "live traffic: snapshot rows ≤ pairs with ≥ EveryNEvents events (0 here)"},
	{"BenchmarkInstances", "x4-throughput/x1", false, 1, "4 worker processes: throughput ≥ 1 process's"},
	{"BenchmarkInstances", "x4-claims/event/x1", true, 1.2, "4 worker processes: claims per applied event ≤ 1.2× 1 process's"},
	{"BenchmarkScale", "large/small-per-event", true, 1.5, "drain per-event cost, large vs 100k events ≤ 1.5× (10M: PERSPECTIVES_BENCH_SCALE_STREAMS=1000000)"},
	// Issue 13: through PgBouncer in transaction mode, against direct: with a PgBouncer that
	// keeps prepared statements (>= 1.21, pgx's default mode; the setting the README gives),
	// and with Debian 12's 1.18, which cannot (pgx's exec mode: every statement planned again).
	{"BenchmarkLockCyclePooled/conc=1", "prepared/lock", true, 1.3, "lock cycle through PgBouncer ≥ 1.21 keeping prepared statements ≤ 1.3× direct, concurrency 1"},
	{"BenchmarkLockCyclePooled/conc=8", "prepared/lock", true, 1.3, "lock cycle through PgBouncer ≥ 1.21 keeping prepared statements ≤ 1.3× direct, concurrency 8"},
	{"BenchmarkWorkerDrain", "prepared/direct-time", true, 1.3, "drain through PgBouncer ≥ 1.21 keeping prepared statements ≤ 1.3× the direct drain's time"},
	{"BenchmarkLockCyclePooled/conc=1", "pooled/lock", true, 1.3, "lock cycle through PgBouncer 1.18 (exec mode) ≤ 1.3× direct, concurrency 1"},
	{"BenchmarkLockCyclePooled/conc=8", "pooled/lock", true, 1.3, "lock cycle through PgBouncer 1.18 (exec mode) ≤ 1.3× direct, concurrency 8"},
	{"BenchmarkWorkerDrain", "pooled/direct-time", true, 1.3, "drain through PgBouncer 1.18 (exec mode) ≤ 1.3× the direct drain's time"},
}

var benchLine = regexp.MustCompile(`^(Benchmark\S+?)(?:-\d+)?\s+(\d+)\s+(.+)$`)

type series struct {
	order []string             // metric units in first-seen order
	vals  map[string][]float64 // unit -> one value per run
}

func main() {
	results := map[string]*series{}
	var names []string
	in := bufio.NewReader(os.Stdin)
	for {
		line, err := in.ReadString('\n')
		if line != "" {
			fmt.Print(line)
			parse(strings.TrimRight(line, "\n"), results, &names)
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "bench:", err)
			os.Exit(1)
		}
	}
	report(results, names)
}

// parse records the metrics of one benchmark result line.
func parse(line string, results map[string]*series, names *[]string) {
	m := benchLine.FindStringSubmatch(line)
	if m == nil {
		return
	}
	fields := strings.Fields(m[3])
	if len(fields)%2 != 0 {
		return
	}
	s := results[m[1]]
	if s == nil {
		s = &series{vals: map[string][]float64{}}
		results[m[1]] = s
		*names = append(*names, m[1])
	}
	for i := 0; i < len(fields); i += 2 {
		v, err := strconv.ParseFloat(fields[i], 64)
		if err != nil {
			return
		}
		unit := fields[i+1]
		if unit == "ns/op" { // wall time of a self-sized benchmark: not a result
			continue
		}
		if _, ok := s.vals[unit]; !ok {
			s.order = append(s.order, unit)
		}
		s.vals[unit] = append(s.vals[unit], v)
	}
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func report(results map[string]*series, names []string) {
	if len(names) == 0 {
		fmt.Println("\nbench: no benchmark results in the input")
		return
	}
	fmt.Println("\n==== Summary: median over runs (min … max, runs) ====")
	for _, name := range names {
		s := results[name]
		fmt.Printf("\n%s\n", name)
		for _, unit := range s.order {
			xs := s.vals[unit]
			fmt.Printf("  %-26s %14s   (%s … %s, %d)\n", unit, num(median(xs)), num(slices.Min(xs)), num(slices.Max(xs)), len(xs))
		}
	}
	fmt.Println("\n==== Targets ====")
	for _, t := range targets {
		s := results[t.bench]
		if s == nil || len(s.vals[t.metric]) == 0 {
			fmt.Printf("  %-8s %-70s not measured\n", "-", t.what)
			continue
		}
		v := median(s.vals[t.metric])
		met := v >= t.bound
		op := "≥"
		if t.atMost {
			met, op = v <= t.bound, "≤"
		}
		verdict := "MISSED"
		if met {
			verdict = "met"
		}
		fmt.Printf("  %-8s %-70s %s = %s (target %s %s)\n", verdict, t.what, t.metric, num(v), op, num(t.bound))
	}
	if load, err := os.ReadFile("/proc/loadavg"); err == nil {
		fmt.Printf("\nload average at the end (1, 5, 15 min): %s", strings.Join(strings.Fields(string(load))[:3], " "))
		fmt.Println()
	}
}

func num(v float64) string {
	switch {
	case v >= 1000:
		return strconv.FormatFloat(v, 'f', 0, 64)
	case v >= 10:
		return strconv.FormatFloat(v, 'f', 1, 64)
	default:
		return strconv.FormatFloat(v, 'f', 3, 64)
	}
}
