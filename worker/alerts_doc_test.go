package worker_test

import (
	"context"
	"os"
	"regexp"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/perspectives-go/perspectives/worker"
)

// promName is the name an OpenTelemetry instrument gets in Prometheus (the exporter's default
// translation): dots to underscores, a unit suffix (none for {annotations}), _ratio for a
// gauge in 1, _total for a counter.
func promName(m metricdata.Metrics) string {
	n := strings.ReplaceAll(m.Name, ".", "_")
	_, gauge := m.Data.(metricdata.Gauge[int64])
	if _, ok := m.Data.(metricdata.Gauge[float64]); ok {
		gauge = true
	}
	switch {
	case m.Unit == "s":
		n += "_seconds"
	case m.Unit == "1" && gauge:
		n += "_ratio"
	}
	switch d := m.Data.(type) {
	case metricdata.Sum[int64]:
		if d.IsMonotonic {
			n += "_total"
		}
	case metricdata.Sum[float64]:
		if d.IsMonotonic {
			n += "_total"
		}
	}
	return n
}

// operationsDoc is the operators' reference, relative to this package.
const operationsDoc = "../docs/operations.md"

// The example alert rules of docs/operations.md use metric names and labels the worker exports.
func TestOperationsDocAlertRulesUseExportedNames(t *testing.T) {
	t.Parallel()
	doc, err := os.ReadFile(operationsDoc)
	require.NoError(t, err)
	text := string(doc)
	start := strings.Index(text, "\n## Alert rules\n")
	require.NotEqual(t, -1, start, "%s has the alert rules", operationsDoc)
	block := regexp.MustCompile("(?s)```yaml\n(.*?)```").FindStringSubmatch(text[start:])
	require.NotNil(t, block, "a yaml block under Alert rules")
	used := map[string]bool{}
	for _, name := range regexp.MustCompile(`\bperspectives_[a-z_]+`).FindAllString(block[1], -1) {
		used[name] = true
	}
	require.GreaterOrEqual(t, len(used), 3)
	labels := map[string]bool{}
	for _, by := range regexp.MustCompile(`by \(([a-z_, ]+)\)`).FindAllStringSubmatch(block[1], -1) {
		for _, l := range strings.Split(by[1], ",") {
			labels[strings.TrimSpace(l)] = true
		}
	}
	require.NotEmpty(t, labels)

	m := newMetrics(t)
	startWorker(t, worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(uniqueName("alerts"))}, MeterProvider: m.mp})
	var rm metricdata.ResourceMetrics
	require.NoError(t, m.reader.Collect(context.Background(), &rm))
	exported := map[string]metricdata.Metrics{}
	for _, sm := range rm.ScopeMetrics {
		for _, mt := range sm.Metrics {
			exported[promName(mt)] = mt
		}
	}
	for name := range used {
		mt, ok := exported[name]
		require.True(t, ok, "the alert rules use %s, which the worker does not export (it exports %v)", name, keys(exported))
		for l := range labels {
			var has bool
			switch d := mt.Data.(type) {
			case metricdata.Gauge[int64]:
				require.NotEmpty(t, d.DataPoints, name)
				_, has = d.DataPoints[0].Attributes.Value(attribute.Key(l))
			case metricdata.Gauge[float64]:
				require.NotEmpty(t, d.DataPoints, name)
				_, has = d.DataPoints[0].Attributes.Value(attribute.Key(l))
			}
			require.True(t, has, "%s has no label %q", name, l)
		}
	}
}

func keys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	return out
}

// docInstrumentKinds are the kinds of instrument as the metrics table of docs/operations.md
// names them.
var docInstrumentKinds = map[sdkmetric.InstrumentKind]string{
	sdkmetric.InstrumentKindCounter:         "counter",
	sdkmetric.InstrumentKindHistogram:       "histogram",
	sdkmetric.InstrumentKindObservableGauge: "gauge",
}

// The metrics table of docs/operations.md lists every instrument the worker creates, with its
// kind and unit, and no other.
func TestOperationsDocListsEveryMetric(t *testing.T) {
	t.Parallel()
	doc, err := os.ReadFile(operationsDoc)
	require.NoError(t, err)
	text := string(doc)
	start := strings.Index(text, "\n## Metrics\n")
	require.NotEqual(t, -1, start, "%s has a Metrics section", operationsDoc)
	section := text[start+1:]
	if end := strings.Index(section[1:], "\n## "); end != -1 {
		section = section[:end+1]
	}
	listed := map[string][]string{} // instrument → its row's cells
	for _, l := range strings.Split(section, "\n") {
		if m := regexp.MustCompile("^\\| `(perspectives\\.[a-z_.]+)` \\|").FindStringSubmatch(l); m != nil {
			cells := strings.Split(strings.Trim(l, "|"), "|")
			for i := range cells {
				cells[i] = strings.TrimSpace(cells[i])
			}
			require.NotContains(t, listed, m[1], "%s lists %s twice", operationsDoc, m[1])
			listed[m[1]] = cells
		}
	}

	// The SDK resolves an instrument's view when the instrument is created: New creates them all.
	var mu sync.Mutex
	created := map[string]sdkmetric.Instrument{}
	record := func(in sdkmetric.Instrument) (sdkmetric.Stream, bool) {
		mu.Lock()
		defer mu.Unlock()
		created[in.Name] = in
		return sdkmetric.Stream{}, false
	}
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()), sdkmetric.WithView(record))
	t.Cleanup(func() { require.NoError(t, mp.Shutdown(context.Background())) })
	_, err = worker.New(testDB.Pool, worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(uniqueName("metrics"))}, MeterProvider: mp})
	require.NoError(t, err)

	mu.Lock()
	defer mu.Unlock()
	require.NotEmpty(t, created)
	for name, in := range created {
		row, ok := listed[name]
		require.True(t, ok, "%s does not list the instrument %s", operationsDoc, name)
		require.GreaterOrEqual(t, len(row), 3, "%s, %s: the row's cells", operationsDoc, name)
		kind, ok := docInstrumentKinds[in.Kind]
		require.True(t, ok, "%s is a %s, which the test has no name for", name, in.Kind)
		require.Equal(t, kind, row[1], "%s, %s: its kind", operationsDoc, name)
		require.Equal(t, "`"+in.Unit+"`", row[2], "%s, %s: its unit", operationsDoc, name)
	}
	for name := range listed {
		_, ok := created[name]
		require.True(t, ok, "%s lists %s, which the worker does not create", operationsDoc, name)
	}
}
