package worker_test

import (
	"context"
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
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

// The README's example alert rules use metric names and labels the worker exports.
func TestReadmeAlertRulesUseExportedNames(t *testing.T) {
	t.Parallel()
	readme, err := os.ReadFile("../README.md")
	require.NoError(t, err)
	text := string(readme)
	start := strings.Index(text, "### Alert rules")
	require.NotEqual(t, -1, start, "README has the alert rules")
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
		require.True(t, ok, "the README's rules use %s, which the worker does not export (it exports %v)", name, keys(exported))
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
