package main

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

const (
	root    = ".."
	docPath = "../BENCHMARKS.md"
)

// benchmarkFuncs are the benchmark functions of the repository's *_test.go files: name ->
// file, from the repository's root.
func benchmarkFuncs(t *testing.T) map[string]string {
	t.Helper()
	found := map[string]string{}
	fset := token.NewFileSet()
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if path != root && (strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata" || d.Name() == "node_modules") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(root, path)
		if err != nil {
			return err
		}
		for _, decl := range f.Decls {
			fn, ok := decl.(*ast.FuncDecl)
			if !ok || fn.Recv != nil || !strings.HasPrefix(fn.Name.Name, "Benchmark") {
				continue
			}
			if other, dup := found[fn.Name.Name]; dup {
				return fmt.Errorf("%s is declared in %s and in %s: BENCHMARKS.md names benchmarks by function", fn.Name.Name, other, rel)
			}
			found[fn.Name.Name] = filepath.ToSlash(rel)
		}
		return nil
	})
	require.NoError(t, err)
	require.NotEmpty(t, found, "no benchmark function found under %s", root)
	return found
}

func readDoc(t *testing.T) string {
	t.Helper()
	data, err := os.ReadFile(docPath)
	require.NoError(t, err)
	return string(data)
}

// sections are the benchmarks BENCHMARKS.md has a section for ("### BenchmarkX" headings).
func sections(doc string) []string {
	var out []string
	for _, l := range strings.Split(doc, "\n") {
		if name, ok := strings.CutPrefix(l, "### "); ok && strings.HasPrefix(name, "Benchmark") {
			out = append(out, strings.TrimSpace(name))
		}
	}
	return out
}

func TestCatalogListsEveryBenchmarkFunction(t *testing.T) {
	funcs := benchmarkFuncs(t)
	known := map[string]string{}
	for _, b := range benchmarks {
		require.NotContains(t, known, b.name, "bench/catalog.go lists %s twice", b.name)
		known[b.name] = b.file
	}
	for name, file := range funcs {
		require.Contains(t, known, name, "%s (%s) is not in bench/catalog.go's benchmarks: add it there and give it a section in BENCHMARKS.md", name, file)
		require.Equal(t, file, known[name], "bench/catalog.go gives %s the wrong file", name)
	}
	for name, file := range known {
		require.Contains(t, funcs, name, "bench/catalog.go lists %s (%s), which the repository does not have", name, file)
	}
}

func TestCatalogTargetsNameItsBenchmarks(t *testing.T) {
	for _, tg := range targets {
		require.True(t, slices.ContainsFunc(benchmarks, func(b benchmark) bool {
			return tg.bench == b.name || strings.HasPrefix(tg.bench, b.name+"/")
		}), "target %q: %s is not a benchmark of the catalog", tg.what, tg.bench)
	}
}

func TestDocumentHasASectionForEveryBenchmarkFunction(t *testing.T) {
	funcs := benchmarkFuncs(t)
	have := sections(readDoc(t))
	for name, file := range funcs {
		require.Contains(t, have, name, "BENCHMARKS.md has no section \"### %s\" (%s)", name, file)
	}
	for _, name := range have {
		require.Contains(t, funcs, name, "BENCHMARKS.md has a section for %s, which the repository does not have", name)
	}
	require.Len(t, have, len(funcs), "BENCHMARKS.md has a benchmark's section twice")
}

func TestDocumentIndexIsTheCatalogs(t *testing.T) {
	require.Equal(t, renderIndex(), block(readDoc(t), indexBegin, indexEnd),
		"BENCHMARKS.md's index is not bench/catalog.go's: run `go run ./bench -write BENCHMARKS.md < /dev/null`")
}

// targetRows are the rows of the targets table in the results part of doc.
func targetRows(doc string) [][]string {
	var rows [][]string
	in := false
	for _, l := range strings.Split(block(doc, resultsBegin, resultsEnd), "\n") {
		switch {
		case strings.HasPrefix(l, "| target |"):
			in = true
		case in && strings.HasPrefix(l, "|---"):
		case in && strings.HasPrefix(l, "| "):
			cells := strings.Split(strings.Trim(l, "|"), " | ")
			for i := range cells {
				cells[i] = strings.TrimSpace(cells[i])
			}
			rows = append(rows, cells)
		case in:
			return rows
		}
	}
	return rows
}

func TestDocumentResultsHaveEveryTarget(t *testing.T) {
	rows := targetRows(readDoc(t))
	require.Len(t, rows, len(targets), "BENCHMARKS.md's results table has %d targets, the harness %d: run make bench", len(rows), len(targets))
	for i, tg := range targets {
		require.Len(t, rows[i], 5, "row %d: %v", i+1, rows[i])
		require.Equal(t, []string{tg.what, fmt.Sprintf("`%s` `%s`", tg.bench, tg.metric), tg.bounds()},
			[]string{rows[i][0], rows[i][1], rows[i][3]}, "row %d of the results is not the harness's target: run make bench", i+1)
	}
}

// input is go test output: two runs of BenchmarkLockCyclePooled/conc=1 without the prepared
// variant, one of BenchmarkWakeupLatency.
const input = `goos: linux
BenchmarkLockCyclePooled/conc=1-2   	       1	3231619753 ns/op	         1.25 pooled/lock	   2207928 pooled-ns/cycle
--- BENCH: BenchmarkLockCyclePooled/conc=1-2
    bench_test.go:121: installed PgBouncer: 1.18.0; the system's package sources offer no newer one
    bench_test.go:122: not run: prepared: PgBouncer < 1.21 installed
BenchmarkLockCyclePooled/conc=1-2   	       1	3231619753 ns/op	         1.45 pooled/lock	   2207928 pooled-ns/cycle
--- BENCH: BenchmarkLockCyclePooled/conc=1-2
    bench_test.go:122: not run: prepared: PgBouncer < 1.21 installed
BenchmarkWakeupLatency-2   	       1	3231619753 ns/op	        12 idle-p50-ms	        11 late-p50-ms
--- BENCH: BenchmarkWakeupLatency-2
    bench_wakeup_test.go:12: not run: other: something
PASS
`

func parsed(text string) *run {
	r := newRun()
	for _, l := range strings.Split(text, "\n") {
		r.parse(l)
	}
	return r
}

func findTarget(t *testing.T, bench, metric string) target {
	t.Helper()
	i := slices.IndexFunc(targets, func(tg target) bool { return tg.bench == bench && tg.metric == metric })
	require.GreaterOrEqual(t, i, 0, "no target %s %s", bench, metric)
	return targets[i]
}

func TestVerdicts(t *testing.T) {
	r := parsed(input)
	require.Equal(t, []string{"BenchmarkLockCyclePooled/conc=1", "BenchmarkWakeupLatency"}, r.names)
	require.Equal(t, []float64{1.25, 1.45}, r.results["BenchmarkLockCyclePooled/conc=1"].vals["pooled/lock"])
	for _, c := range []struct{ bench, metric, want string }{
		{"BenchmarkLockCyclePooled/conc=1", "pooled/lock", "MISSED"},                                 // median 1.35 > 1.3
		{"BenchmarkLockCyclePooled/conc=1", "prepared/lock", "not run (PgBouncer < 1.21 installed)"}, // logged
		{"BenchmarkLockCyclePooled/conc=8", "prepared/lock", "not measured"},                         // not in the input
		{"BenchmarkWakeupLatency", "late-p50-ms", "met"},                                             // 11 ≤ 25
		{"BenchmarkWakeupLatency", "idle-p50-ms", "MISSED"},                                          // 12 > 10
		{"BenchmarkWakeupLatency", "idle-call-p50-ms", "not measured"},                               // needs no variant
		{"BenchmarkLockCycle/conc=1", "lock/floor", "not measured"},
	} {
		_, got := r.verdict(findTarget(t, c.bench, c.metric))
		require.Equal(t, c.want, got, "%s %s", c.bench, c.metric)
	}
	require.Empty(t, r.failed)
	require.Contains(t, r.missing(), "BenchmarkLockCycle")
	require.NotContains(t, r.missing(), "BenchmarkLockCyclePooled")
	require.Contains(t, parsed("--- FAIL: BenchmarkScale\nFAIL\tgithub.com/x/worker\t12s\n").failed, "--- FAIL: BenchmarkScale")
	// A package that ran benchmarks failed; another, without benchmarks, did not build.
	f := parsed("pkg: github.com/x/worker\nFAIL\tgithub.com/x/worker\t12s\nFAIL\tgithub.com/x/ui [build failed]\n")
	require.Equal(t, []string{"FAIL\tgithub.com/x/worker\t12s"}, f.failed)
	require.Equal(t, []string{"FAIL\tgithub.com/x/ui [build failed]"}, f.others)
}

// complete is a run with a result of every benchmark of the catalog.
func complete() string {
	var b strings.Builder
	for _, m := range benchmarks {
		fmt.Fprintf(&b, "%s/sub-2 \t 1\t 100 ns/op\t 1.5 x/y\n", m.name)
	}
	return b.String()
}

func TestWriteDoc(t *testing.T) {
	path := filepath.Join(t.TempDir(), "BENCHMARKS.md")
	doc := "# B\n\n" + indexBegin + " -->\nold index\n" + indexEnd + "\n\n## Results\n\n" +
		resultsBegin + " -->\nold results\n" + resultsEnd + "\n\ntail\n"
	require.NoError(t, os.WriteFile(path, []byte(doc), 0o644))
	facts := func() []string { return []string{"**commit** `abc`"} }
	read := func() string {
		data, err := os.ReadFile(path)
		require.NoError(t, err)
		return string(data)
	}

	// A partial run: the index only.
	require.NoError(t, writeDoc(path, parsed(input), facts))
	got := read()
	require.Equal(t, renderIndex(), block(got, indexBegin, indexEnd))
	require.Equal(t, "old results\n", block(got, resultsBegin, resultsEnd))
	require.True(t, strings.HasSuffix(got, resultsEnd+"\n\ntail\n"))

	// A complete run that failed: the index only.
	require.NoError(t, writeDoc(path, parsed(complete()+"--- FAIL: BenchmarkScale\n"), facts))
	require.Equal(t, "old results\n", block(read(), resultsBegin, resultsEnd))

	// A complete run that failed in a benchmark's package: the index only.
	require.NoError(t, writeDoc(path, parsed("pkg: github.com/x/worker\n"+complete()+"FAIL\tgithub.com/x/worker\t1s\n"), facts))
	require.Equal(t, "old results\n", block(read(), resultsBegin, resultsEnd))

	// A complete run: the results too, with every target, even where a package that ran
	// no benchmark failed.
	require.NoError(t, writeDoc(path, parsed("pkg: github.com/x/worker\n"+complete()+"FAIL\tgithub.com/x/ui [build failed]\n"), facts))
	got = read()
	res := block(got, resultsBegin, resultsEnd)
	require.True(t, strings.HasPrefix(res, "- **commit** `abc`\n"), res)
	require.Len(t, targetRows(got), len(targets))
	require.Contains(t, res, "| `BenchmarkScale/sub` | `x/y` | 1.500 |")
	require.True(t, strings.HasPrefix(got, "# B\n\n"+indexBegin+" -->\n"))
	require.True(t, strings.HasSuffix(got, resultsEnd+"\n\ntail\n"))

	require.NoError(t, os.WriteFile(path, []byte("# no markers\n"), 0o644))
	require.Error(t, writeDoc(path, parsed(complete()), facts))
}
