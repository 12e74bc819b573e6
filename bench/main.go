// Command bench is the harness of make bench. It reads `go test -bench` output on its
// standard input and copies it to its standard output as it reads, then prints, for every
// benchmark and figure, the median over the runs (-count) with the minimum and maximum, and
// every target (catalog.go) with the median measured and whether it is met. It never fails
// on a missed target: speed is reported, not asserted.
//
//	go test -run '^$' -bench . -benchtime 1x -count 3 -p 1 ./... 2>&1 | go run ./bench
//	go test -run '^$' -bench . -benchtime 1x -count 3 -p 1 ./... 2>&1 | go run ./bench -write BENCHMARKS.md
//
// With -write it also rewrites the generated parts of that file: the index of the
// benchmarks (from catalog.go) always, and the results of the run (the run's facts, the
// targets table, every figure) only when the run measured every benchmark of the catalog and
// no benchmark failed, so that a partial run (BENCH=...) never replaces a whole one; the
// failure of a package that ran no benchmark (one that does not build) is named in the
// results instead. make bench
// runs the second form; `go run ./bench -write BENCHMARKS.md < /dev/null` rewrites the index
// alone. This package's test checks that BENCHMARKS.md describes exactly the benchmark
// functions of the repository and the targets of the catalog.
package main

import (
	"bufio"
	"cmp"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"
)

var (
	benchLine = regexp.MustCompile(`^(Benchmark\S+?)(?:-\d+)?\s+(\d+)\s+(.+)$`)
	// The header go test prints before a benchmark's log lines.
	benchHeader = regexp.MustCompile(`^--- BENCH: (Benchmark\S+?)(?:-\d+)?$`)
	// A log line of a benchmark that left a variant out: "not run: <variant>: <reason>".
	notRunLine = regexp.MustCompile(`^\s+\S+:\d+: not run: (\S+): (.+)$`)
)

// series are the figures of one benchmark.
type series struct {
	order []string             // metric units in first-seen order
	vals  map[string][]float64 // unit -> one value per run
}

// run is what the input told.
type run struct {
	results map[string]*series
	names   []string                     // benchmarks in first-seen order
	notRun  map[string]map[string]string // benchmark -> variant -> reason
	failed  []string                     // lines that report a failure of a benchmark
	// lines that report a failure of a package that ran no benchmark (a build failure of a
	// package without benchmarks): they leave the figures whole, and the results say so
	others  []string
	pkgs    map[string]bool // the packages that ran benchmarks ("pkg:" headers)
	current string          // the benchmark whose log lines follow
}

func newRun() *run {
	return &run{results: map[string]*series{}, notRun: map[string]map[string]string{}, pkgs: map[string]bool{}}
}

func main() {
	write := flag.String("write", "", "rewrite the generated parts of this file (BENCHMARKS.md)")
	flag.Parse()
	info := startInfo(filepath.Dir(cmp.Or(*write, ".")))
	r := newRun()
	in := bufio.NewReader(os.Stdin)
	for {
		line, err := in.ReadString('\n')
		if line != "" {
			fmt.Print(line)
			r.parse(strings.TrimRight(line, "\n"))
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "bench:", err)
			os.Exit(1)
		}
	}
	info.finish()
	report(os.Stdout, r)
	fmt.Printf("\nload average (1, 5, 15 min): %s at the start, %s at the end\n", info.loadStart, info.loadEnd)
	if *write != "" {
		if err := writeDoc(*write, r, func() []string { return runFacts(*write, r, info) }); err != nil {
			fmt.Fprintln(os.Stderr, "bench:", err)
			os.Exit(1)
		}
	}
}

// parse records what one line of go test's output tells.
func (r *run) parse(line string) {
	switch {
	case strings.HasPrefix(line, "pkg: "):
		r.pkgs[strings.TrimSpace(strings.TrimPrefix(line, "pkg: "))] = true
		return
	case strings.HasPrefix(line, "--- FAIL"), strings.HasPrefix(line, "panic: "):
		r.failed = append(r.failed, line)
		return
	case strings.HasPrefix(line, "FAIL\t"):
		if pkg := strings.Fields(line)[1]; r.pkgs[pkg] {
			r.failed = append(r.failed, line)
		} else {
			r.others = append(r.others, line)
		}
		return
	}
	if m := benchHeader.FindStringSubmatch(line); m != nil {
		r.current = m[1]
		return
	}
	if m := notRunLine.FindStringSubmatch(line); m != nil && r.current != "" {
		if r.notRun[r.current] == nil {
			r.notRun[r.current] = map[string]string{}
		}
		r.notRun[r.current][m[1]] = m[2]
		return
	}
	m := benchLine.FindStringSubmatch(line)
	if m == nil {
		return
	}
	fields := strings.Fields(m[3])
	if len(fields)%2 != 0 {
		return
	}
	s := r.results[m[1]]
	if s == nil {
		s = &series{vals: map[string][]float64{}}
		r.results[m[1]] = s
		r.names = append(r.names, m[1])
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

// missing are the benchmarks of the catalog the run has no result of.
func (r *run) missing() []string {
	var out []string
	for _, b := range benchmarks {
		if !slices.ContainsFunc(r.names, func(n string) bool { return n == b.name || strings.HasPrefix(n, b.name+"/") }) {
			out = append(out, b.name)
		}
	}
	return out
}

// runs is the largest number of runs of any figure.
func (r *run) runs() int {
	n := 0
	for _, s := range r.results {
		for _, xs := range s.vals {
			n = max(n, len(xs))
		}
	}
	return n
}

// verdict is what the run tells of t: the median measured (nil when not measured) and
// "met", "MISSED", "not run (reason)" or "not measured".
func (r *run) verdict(t target) (xs []float64, verdict string) {
	if s := r.results[t.bench]; s != nil && len(s.vals[t.metric]) > 0 {
		xs = s.vals[t.metric]
		v := median(xs)
		if (t.atMost && v <= t.bound) || (!t.atMost && v >= t.bound) {
			return xs, "met"
		}
		return xs, "MISSED"
	}
	if reason, ok := r.notRun[t.bench][t.needs]; ok && t.needs != "" {
		return nil, "not run (" + reason + ")"
	}
	return nil, "not measured"
}

func (t target) bounds() string {
	if t.atMost {
		return "≤ " + num(t.bound)
	}
	return "≥ " + num(t.bound)
}

func report(w io.Writer, r *run) {
	if len(r.names) == 0 {
		fmt.Fprintln(w, "\nbench: no benchmark results in the input")
	} else {
		fmt.Fprintln(w, "\n==== Summary: median over runs (min … max, runs) ====")
		for _, name := range r.names {
			s := r.results[name]
			fmt.Fprintf(w, "\n%s\n", name)
			for _, unit := range s.order {
				xs := s.vals[unit]
				fmt.Fprintf(w, "  %-26s %14s   (%s … %s, %d)\n", unit, num(median(xs)), num(slices.Min(xs)), num(slices.Max(xs)), len(xs))
			}
		}
	}
	fmt.Fprintln(w, "\n==== Targets ====")
	width := 0
	for _, t := range targets {
		width = max(width, utf8.RuneCountInString(t.what))
	}
	for _, t := range targets {
		xs, verdict := r.verdict(t)
		if xs == nil {
			fmt.Fprintf(w, "  %-8s %-*s %s\n", "-", width, t.what, verdict)
			continue
		}
		fmt.Fprintf(w, "  %-8s %-*s %s = %s (target %s)\n", verdict, width, t.what, t.metric, num(median(xs)), t.bounds())
	}
	for _, name := range sortedKeys(r.notRun) {
		for _, v := range sortedKeys(r.notRun[name]) {
			fmt.Fprintf(w, "  not run: %s, variant %s: %s\n", name, v, r.notRun[name][v])
		}
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

func num(v float64) string {
	switch {
	case v >= 1000 || v <= -1000:
		return strconv.FormatFloat(v, 'f', 0, 64)
	case v >= 10 || v <= -10:
		return strconv.FormatFloat(v, 'f', 1, 64)
	default:
		return strconv.FormatFloat(v, 'f', 3, 64)
	}
}

// loadAvg is the machine's load average (1, 5, 15 min), "unknown" where it cannot be read.
func loadAvg() string {
	data, err := os.ReadFile("/proc/loadavg")
	if f := strings.Fields(string(data)); err == nil && len(f) >= 3 {
		return strings.Join(f[:3], " ")
	}
	return "unknown"
}

// span is the time from start to end as the results show it.
func span(start, end time.Time) string {
	start, end = start.UTC(), end.UTC()
	if start.Format(time.DateOnly) == end.Format(time.DateOnly) {
		return start.Format("2006-01-02 15:04") + "–" + end.Format("15:04") + " UTC"
	}
	return start.Format("2006-01-02 15:04") + " UTC to " + end.Format("2006-01-02 15:04") + " UTC"
}
