package fxmodule

// The one precedence rule between worker.Config and the graph's values, field by field.

import (
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/metric"
	metricnoop "go.opentelemetry.io/otel/metric/noop"
	"go.opentelemetry.io/otel/trace"
	tracenoop "go.opentelemetry.io/otel/trace/noop"

	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/worker"
)

func TestConfigFieldsWinGraphValuesFillTheRest(t *testing.T) {
	graphOpts := locker.Options{LockTimeout: time.Minute, KeepAliveInterval: 20 * time.Second}
	cfgOpts := locker.Options{LockTimeout: 40 * time.Second, KeepAliveInterval: 10 * time.Second}
	graphLocker, cfgLocker := &locker.Postgres{}, &locker.Postgres{}
	graphLog, cfgLog := slog.New(slog.DiscardHandler), slog.New(slog.DiscardHandler)
	var graphMP, cfgMP metric.MeterProvider = metricnoop.NewMeterProvider(), metricnoop.NewMeterProvider()
	var graphTP, cfgTP trace.TracerProvider = tracenoop.NewTracerProvider(), tracenoop.NewTracerProvider()
	a := worker.JSONPerspective("a", func(m int, _ worker.Event) (int, error) { return m, nil })
	b := worker.JSONPerspective("b", func(m int, _ worker.Event) (int, error) { return m, nil })
	graph := WorkerParams{
		Perspectives: []worker.Perspective{b}, LockOptions: graphOpts, Locker: graphLocker,
		Logger: graphLog, MeterProvider: graphMP, TracerProvider: graphTP,
	}

	// A Config that sets nothing takes every value of the graph.
	got := configOf(graph)
	require.Equal(t, graphOpts, got.LockOptions)
	require.Same(t, graphLocker, got.Locker)
	require.Same(t, graphLog, got.Logger)
	require.Equal(t, graphMP, got.MeterProvider)
	require.Equal(t, graphTP, got.TracerProvider)
	require.Equal(t, []string{"b"}, names(got.Perspectives))

	// A Config that sets every field keeps each; the perspectives are both lists.
	withCfg := graph
	withCfg.Config = worker.Config{
		Perspectives: []worker.Perspective{a}, LockOptions: cfgOpts, Locker: cfgLocker,
		Logger: cfgLog, MeterProvider: cfgMP, TracerProvider: cfgTP,
	}
	got = configOf(withCfg)
	require.Equal(t, cfgOpts, got.LockOptions)
	require.Same(t, cfgLocker, got.Locker)
	require.Same(t, cfgLog, got.Logger)
	require.Equal(t, cfgMP, got.MeterProvider)
	require.Equal(t, cfgTP, got.TracerProvider)
	require.Equal(t, []string{"a", "b"}, names(got.Perspectives))

	// Nothing in the graph: the Config's zero fields stay zero (worker.New's defaults).
	got = configOf(WorkerParams{})
	require.Nil(t, got.Locker)
	require.Nil(t, got.Logger)
	require.Zero(t, got.LockOptions)
}

func names(ps []worker.Perspective) []string {
	out := make([]string, len(ps))
	for i, p := range ps {
		out[i] = p.Name()
	}
	return out
}
