package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/perspectives-go/perspectives/db"
)

// The generated parts of BENCHMARKS.md: each lies between its begin line (which starts with
// the begin marker) and its end line.
const (
	indexBegin   = "<!-- bench:index:begin"
	indexEnd     = "<!-- bench:index:end -->"
	resultsBegin = "<!-- bench:results:begin"
	resultsEnd   = "<!-- bench:results:end -->"
)

// runInfo is what the results say of the run besides its figures.
type runInfo struct {
	dir                string // the checkout
	start, end         time.Time
	loadStart, loadEnd string
	head, headEnd      string   // the commit checked out at the start and at the end ("" unknown)
	changed            []string // tracked files with uncommitted changes at the start
}

// startInfo notes the state of the checkout at dir as the run starts (go test builds the
// packages meanwhile).
func startInfo(dir string) *runInfo {
	i := &runInfo{dir: dir, start: time.Now(), loadStart: loadAvg(), head: gitHead(dir)}
	if out, err := exec.Command("git", "-C", dir, "status", "--porcelain", "--untracked-files=no").Output(); err == nil {
		for _, l := range strings.Split(strings.TrimRight(string(out), "\n"), "\n") {
			if len(l) > 3 {
				i.changed = append(i.changed, l[3:])
			}
		}
	}
	return i
}

func (i *runInfo) finish() { i.end, i.loadEnd, i.headEnd = time.Now(), loadAvg(), gitHead(i.dir) }

// gitHead is the commit checked out at dir, "" when git cannot tell.
func gitHead(dir string) string {
	out, err := exec.Command("git", "-C", dir, "rev-parse", "--short=10", "HEAD").Output()
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(out))
}

// renderIndex is the index of the benchmarks, from the catalog.
func renderIndex() string {
	var b strings.Builder
	b.WriteString("| benchmark | file | what it measures | baseline (measured in the same run) |\n|---|---|---|---|\n")
	for _, m := range benchmarks {
		fmt.Fprintf(&b, "| [`%s`](#%s) | `%s` | %s | %s |\n", m.name, strings.ToLower(m.name), m.file, m.what, m.baseline)
	}
	return b.String()
}

// renderResults is the results of the run: its facts, the targets, every figure.
func renderResults(r *run, facts []string) string {
	var b strings.Builder
	for _, f := range facts {
		b.WriteString("- " + f + "\n")
	}
	b.WriteString("\n| target | benchmark, figure | median (min … max) | bound | result |\n|---|---|---|---|---|\n")
	for _, t := range targets {
		xs, verdict := r.verdict(t)
		measured := "—"
		if xs != nil {
			measured = spread(xs)
		}
		if verdict == "MISSED" || verdict == "met" {
			verdict = "**" + verdict + "**"
		}
		fmt.Fprintf(&b, "| %s | `%s` `%s` | %s | %s | %s |\n", t.what, t.bench, t.metric, measured, t.bounds(), verdict)
	}
	fmt.Fprintf(&b, "\n<details><summary>Every figure of the run: median (min … max) over %d runs</summary>\n\n", r.runs())
	b.WriteString("| benchmark | figure | median (min … max) |\n|---|---|---|\n")
	for _, name := range r.names {
		s := r.results[name]
		for _, unit := range s.order {
			fmt.Fprintf(&b, "| `%s` | `%s` | %s |\n", name, unit, spread(s.vals[unit]))
		}
	}
	for _, name := range sortedKeys(r.notRun) {
		for _, v := range sortedKeys(r.notRun[name]) {
			fmt.Fprintf(&b, "| `%s` | variant `%s` | not run (%s) |\n", name, v, r.notRun[name][v])
		}
	}
	b.WriteString("\n</details>\n")
	return b.String()
}

// spread is a figure's median with its minimum and maximum (the median alone for one run).
func spread(xs []float64) string {
	if len(xs) == 1 {
		return num(xs[0])
	}
	return fmt.Sprintf("%s (%s … %s)", num(median(xs)), num(slices.Min(xs)), num(slices.Max(xs)))
}

func sortedKeys[V any](m map[string]V) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

// writeDoc rewrites the index of path, and its results when the run is complete (facts
// gives the lines that describe the run).
func writeDoc(path string, r *run, facts func() []string) error {
	data, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	doc, err := replaceBlock(string(data), indexBegin, indexEnd, renderIndex())
	if err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	why := ""
	switch missing := r.missing(); {
	case len(r.failed) > 0:
		why = fmt.Sprintf("the run failed (%s)", r.failed[0])
	case len(missing) > 0:
		why = fmt.Sprintf("the run has no result of %d of the %d benchmarks (%s)", len(missing), len(benchmarks), strings.Join(missing, ", "))
	}
	if why == "" {
		doc, err = replaceBlock(doc, resultsBegin, resultsEnd, renderResults(r, facts()))
		if err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
	}
	if err := os.WriteFile(path, []byte(doc), 0o644); err != nil {
		return err
	}
	if why != "" {
		fmt.Printf("bench: %s: index written; results not written: %s\n", path, why)
	} else {
		fmt.Printf("bench: %s: index and results written\n", path)
	}
	return nil
}

// replaceBlock replaces what lies between the line that starts with begin and the line end.
func replaceBlock(doc, begin, end, body string) (string, error) {
	lines := strings.SplitAfter(doc, "\n")
	b := slices.IndexFunc(lines, func(l string) bool { return strings.HasPrefix(l, begin) })
	e := slices.IndexFunc(lines, func(l string) bool { return strings.TrimRight(l, "\n") == end })
	if b < 0 || e < b {
		return "", fmt.Errorf("no %s … %s lines", begin, end)
	}
	return strings.Join(lines[:b+1], "") + body + strings.Join(lines[e:], ""), nil
}

// block is what lies between the line that starts with begin and the line end ("" if none).
func block(doc, begin, end string) string {
	lines := strings.SplitAfter(doc, "\n")
	b := slices.IndexFunc(lines, func(l string) bool { return strings.HasPrefix(l, begin) })
	e := slices.IndexFunc(lines, func(l string) bool { return strings.TrimRight(l, "\n") == end })
	if b < 0 || e < b {
		return ""
	}
	return strings.Join(lines[b+1:e], "")
}

// runFacts are the lines of the results that describe the run of path's checkout: commit,
// when, machine, Go, PostgreSQL, PgBouncer, load average.
func runFacts(path string, r *run, info *runInfo) []string {
	commit := "unknown"
	if info.head != "" {
		commit = "`" + info.head + "` at the start"
		var changed []string
		for _, f := range info.changed {
			if filepath.Join(info.dir, f) != filepath.Clean(path) {
				changed = append(changed, "`"+f+"`")
			}
		}
		if len(changed) > 0 {
			commit += ", with uncommitted changes to " + strings.Join(changed, ", ")
		} else {
			commit += ", no uncommitted changes to tracked files"
		}
		if info.headEnd != info.head {
			commit += fmt.Sprintf("; commits landed during the run (`%s` at the end), which the packages built after them include", info.headEnd)
		}
	}
	out := []string{
		"**commit** " + commit,
		fmt.Sprintf("**run** %s; %d runs of each benchmark (`BENCH=%s`, `BENCH_COUNT=%s`)",
			span(info.start, info.end), r.runs(), cmp.Or(os.Getenv("BENCH"), "."), cmp.Or(os.Getenv("BENCH_COUNT"), "3")),
		"**machine** " + machine(),
		"**Go** " + goVersion(),
		"**PostgreSQL** " + postgres(),
		"**PgBouncer installed** " + pgbouncer(),
		fmt.Sprintf("**load average** (1, 5, 15 min) %s at the start, %s at the end", info.loadStart, info.loadEnd),
	}
	if len(r.others) > 0 {
		out = append(out, "**failures outside the benchmarks** (packages that ran none) `"+strings.Join(r.others, "`, `")+"`")
	}
	return out
}

func machine() string {
	cpu := "unknown CPU"
	if data, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, l := range strings.Split(string(data), "\n") {
			if k, v, ok := strings.Cut(l, ":"); ok && strings.TrimSpace(k) == "model name" {
				cpu = strings.TrimSpace(v)
				break
			}
		}
	}
	out := fmt.Sprintf("%s, %d cores", cpu, runtime.NumCPU())
	if data, err := os.ReadFile("/proc/meminfo"); err == nil {
		var kb float64
		if _, err := fmt.Sscanf(string(data), "MemTotal: %f kB", &kb); err == nil {
			out += fmt.Sprintf(", %.1f GiB memory", kb/(1<<20))
		}
	}
	if rel, err := os.ReadFile("/proc/sys/kernel/osrelease"); err == nil {
		out += ", Linux " + strings.TrimSpace(string(rel))
	}
	return out
}

func goVersion() string {
	out := runtime.Version() + " " + runtime.GOOS + "/" + runtime.GOARCH
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, d := range bi.Deps {
			if d.Path == "github.com/jackc/pgx/v5" {
				out += ", pgx " + d.Version
			}
		}
	}
	return out
}

// postgres is the server at DATABASE_URL (make bench's default when unset): its version,
// where it is, and the settings that move the figures.
func postgres() string {
	dbURL := cmp.Or(os.Getenv("DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		return "unknown (" + err.Error() + ")"
	}
	defer conn.Close(context.Background())
	q := db.New(conn)
	version, err := q.ServerVersion(ctx)
	if err != nil {
		return "unknown (" + err.Error() + ")"
	}
	settings, err := q.ServerSettings(ctx, []string{"fsync", "synchronous_commit", "wal_sync_method", "full_page_writes", "shared_buffers", "work_mem", "autovacuum", "max_connections", "jit"})
	if err != nil {
		return version + "; settings unknown (" + err.Error() + ")"
	}
	where := "at an unparsed DATABASE_URL"
	if u, err := url.Parse(dbURL); err == nil {
		where = "at " + cmp.Or(u.Host, "its Unix socket")
	}
	return fmt.Sprintf("`%s`, %s; `%s`", version, where, strings.Join(settings, "`, `"))
}

// pgbouncer is the version of the installed PgBouncer, as scripts/pgbouncer.sh finds it.
func pgbouncer() string {
	bin, err := exec.LookPath("pgbouncer")
	if err != nil {
		bin = "/usr/sbin/pgbouncer"
	}
	out, err := exec.Command(bin, "--version").Output()
	if errors.Is(err, exec.ErrNotFound) || errors.Is(err, os.ErrNotExist) {
		return "none"
	}
	if err != nil {
		return "unknown (" + err.Error() + ")"
	}
	first, _, _ := strings.Cut(string(out), "\n")
	return strings.TrimSpace(first)
}
