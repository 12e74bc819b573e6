package worker_test

import (
	"context"
	"encoding/json"
	"log/slog"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/perspectives-go/perspectives/internal/pgq"
	"github.com/perspectives-go/perspectives/internal/pgtest"
	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/worker"
)

// metricsReader collects what the worker recorded.
type metricsReader struct {
	t      *testing.T
	reader *sdkmetric.ManualReader
	mp     *sdkmetric.MeterProvider
}

func newMetrics(t *testing.T) *metricsReader {
	r := sdkmetric.NewManualReader()
	return &metricsReader{t: t, reader: r, mp: sdkmetric.NewMeterProvider(sdkmetric.WithReader(r))}
}

func (m *metricsReader) collect() map[string]metricdata.Aggregation {
	m.t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(m.t, m.reader.Collect(context.Background(), &rm))
	out := map[string]metricdata.Aggregation{}
	for _, sm := range rm.ScopeMetrics {
		for _, mt := range sm.Metrics {
			out[mt.Name] = mt.Data
		}
	}
	return out
}

// sum returns the value of a counter for the data point whose attributes include want.
func (m *metricsReader) sum(name string, want ...attribute.KeyValue) int64 {
	m.t.Helper()
	data, ok := m.collect()[name]
	if !ok {
		return 0
	}
	var total int64
	for _, dp := range data.(metricdata.Sum[int64]).DataPoints {
		if hasAll(dp.Attributes, want) {
			total += dp.Value
		}
	}
	return total
}

func (m *metricsReader) histogramCount(name string, want ...attribute.KeyValue) uint64 {
	m.t.Helper()
	data, ok := m.collect()[name]
	if !ok {
		return 0
	}
	var n uint64
	for _, dp := range data.(metricdata.Histogram[float64]).DataPoints {
		if hasAll(dp.Attributes, want) {
			n += dp.Count
		}
	}
	return n
}

func (m *metricsReader) gaugeInt(name string, want ...attribute.KeyValue) (int64, bool) {
	m.t.Helper()
	data, ok := m.collect()[name]
	if !ok {
		return 0, false
	}
	for _, dp := range data.(metricdata.Gauge[int64]).DataPoints {
		if hasAll(dp.Attributes, want) {
			return dp.Value, true
		}
	}
	return 0, false
}

func (m *metricsReader) gaugeFloat(name string, want ...attribute.KeyValue) (float64, bool) {
	m.t.Helper()
	data, ok := m.collect()[name]
	if !ok {
		return 0, false
	}
	for _, dp := range data.(metricdata.Gauge[float64]).DataPoints {
		if hasAll(dp.Attributes, want) {
			return dp.Value, true
		}
	}
	return 0, false
}

func hasAll(set attribute.Set, want []attribute.KeyValue) bool {
	for _, kv := range want {
		v, ok := set.Value(kv.Key)
		if !ok || v != kv.Value {
			return false
		}
	}
	return true
}

// No metric carries the stream ID: cardinality stays bounded.
func (m *metricsReader) requireNoStreamAttribute() {
	m.t.Helper()
	for name, data := range m.collect() {
		var sets []attribute.Set
		switch d := data.(type) {
		case metricdata.Sum[int64]:
			for _, dp := range d.DataPoints {
				sets = append(sets, dp.Attributes)
			}
		case metricdata.Histogram[float64]:
			for _, dp := range d.DataPoints {
				sets = append(sets, dp.Attributes)
			}
		case metricdata.Gauge[int64]:
			for _, dp := range d.DataPoints {
				sets = append(sets, dp.Attributes)
			}
		case metricdata.Gauge[float64]:
			for _, dp := range d.DataPoints {
				sets = append(sets, dp.Attributes)
			}
		}
		for _, s := range sets {
			_, has := s.Value("stream")
			require.False(m.t, has, "metric %s carries the stream ID", name)
		}
	}
}

// isolatedDB gives a test its own database, so that no other test's events reach its
// perspectives (a new perspective catches up on every stored event) and its counts are exact.
func isolatedDB(t *testing.T) *pgtest.DB {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	d, err := pgtest.Create(ctx, "worker_telemetry")
	require.NoError(t, err)
	t.Cleanup(d.Close)
	return d
}

func startWorkerIn(t *testing.T, d *pgtest.DB, cfg worker.Config) *worker.Worker {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = quietLogger()
	}
	cfg.PollInterval = 20 * time.Millisecond
	if d.DirectURL != d.URL {
		cfg.ListenConnect = func(ctx context.Context) (*pgx.Conn, error) { return pgx.Connect(ctx, d.DirectURL) }
	}
	w, err := worker.New(d.Pool, cfg)
	require.NoError(t, err)
	require.NoError(t, w.Start(context.Background()))
	t.Cleanup(func() { require.NoError(t, w.Stop(context.Background())) })
	return w
}

func lockerIn(t *testing.T, d *pgtest.DB, opts locker.Options) *locker.Postgres {
	t.Helper()
	lk, err := locker.NewPostgres(d.Pool, opts)
	require.NoError(t, err)
	return lk
}

func waitModelIn(t *testing.T, d *pgtest.DB, name string, stream uuid.UUID, n int) ledger {
	t.Helper()
	ctx := context.Background()
	var m ledger
	eventually(t, 20*time.Second, "model with all events", func() bool {
		raw, ok, err := worker.LoadModel(ctx, d.Pool, name, stream)
		require.NoError(t, err)
		m = ledger{}
		if ok {
			require.NoError(t, json.Unmarshal(raw, &m))
		}
		left, err := pgq.New(d.Pool).QueueCount(ctx)
		require.NoError(t, err)
		return len(m.IDs) == n && left == 0
	})
	return m
}

func persp(name string) attribute.KeyValue { return attribute.String("perspective", name) }
func reason(r locker.Reason) attribute.KeyValue {
	return attribute.String("reason", string(r))
}

func TestMetricsRewindFromSnapshot(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := uniqueName("metrics_rewind")
	d := isolatedDB(t)
	m := newMetrics(t)
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	startWorkerIn(t, d, worker.Config{
		Perspectives:   []worker.Perspective{ledgerPerspective(name)},
		Locker:         lockerIn(t, d, locker.Options{}),
		Snapshots:      worker.SnapshotOptions{EveryNEvents: 2},
		MeterProvider:  m.mp,
		TracerProvider: tp,
	})
	stream := uuid.New()
	ids := newIDs(t, 7)
	all := events(stream, ids)
	// ids[3] arrives late. The six others are applied in one batch, with a snapshot after
	// every second one: at ids[1], ids[4] and ids[6].
	var first []worker.Event
	for i, ev := range all {
		if i != 3 {
			first = append(first, ev)
		}
	}
	require.NoError(t, worker.Append(ctx, d.Pool, first...))
	waitModelIn(t, d, name, stream, 6)
	// The counter is recorded after the commit that makes the model visible.
	eventually(t, 10*time.Second, "6 events applied recorded", func() bool {
		return m.sum("perspectives.events.applied", persp(name)) == 6
	})

	require.NoError(t, worker.Append(ctx, d.Pool, all[3]))
	require.Equal(t, expectedLedger(t, all), waitModelIn(t, d, name, stream, 7))
	fromSnap := attribute.Bool("from_snapshot", true)
	eventually(t, 10*time.Second, "rewind recorded", func() bool {
		return m.sum("perspectives.rewind.completed", persp(name), fromSnap) == 1
	})
	// Restored the snapshot at ids[1] (the newest strictly before ids[3]); replayed ids[2..6].
	require.Equal(t, int64(5), m.sum("perspectives.rewind.events_replayed", persp(name), fromSnap))
	require.Equal(t, uint64(1), m.histogramCount("perspectives.rewind.duration", persp(name), fromSnap))
	require.Equal(t, int64(1), m.sum("perspectives.rewind.started", persp(name)))
	require.Zero(t, m.sum("perspectives.rewind.failed", persp(name)))
	require.Equal(t, int64(1), m.sum("perspectives.lock.acquired", persp(name), reason(locker.ReasonRewind)))
	eventually(t, 10*time.Second, "release recorded", func() bool {
		return m.sum("perspectives.lock.released", persp(name), reason(locker.ReasonRewind)) == 1
	})
	require.Equal(t, uint64(1), m.histogramCount("perspectives.lock.hold_duration", persp(name), reason(locker.ReasonRewind)))
	depth, ok := m.gaugeInt("perspectives.queue.depth", persp(name))
	require.True(t, ok)
	require.Zero(t, depth)
	m.requireNoStreamAttribute()

	var rewindSpans int
	for _, s := range spans.Ended() {
		if s.Name() == "perspectives.rewind" {
			rewindSpans++
			require.Contains(t, s.Attributes(), attribute.String("stream", stream.String()))
			require.Contains(t, s.Attributes(), attribute.Bool("from_snapshot", true))
			require.Contains(t, s.Attributes(), attribute.Int("events_replayed", 5))
		}
	}
	require.Equal(t, 1, rewindSpans)
}

func TestMetricsContendedPurgeAndQueueGauges(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := uniqueName("metrics_contended")
	d := isolatedDB(t)
	m := newMetrics(t)
	lk := lockerIn(t, d, locker.Options{})
	w := startWorkerIn(t, d, worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(name)}, Locker: lk, MeterProvider: m.mp})

	stream := uuid.New()
	foreign := uuid.New()
	ok, err := lk.TryAcquire(ctx, stream, name, foreign, locker.ReasonRewind)
	require.NoError(t, err)
	require.True(t, ok)
	require.NoError(t, worker.Append(ctx, d.Pool, events(stream, newIDs(t, 3))...))

	require.ErrorIs(t, w.Purge(ctx, stream, name), worker.ErrLocked)
	require.Equal(t, int64(1), m.sum("perspectives.lock.contended", persp(name), reason(locker.ReasonPurge)))
	require.Equal(t, int64(1), m.sum("perspectives.purge.count", persp(name), attribute.String("result", "locked")))
	require.Zero(t, m.sum("perspectives.lock.acquired", persp(name)))

	// The locked pair's events wait in the queue: the gauges show them.
	depth, ok := m.gaugeInt("perspectives.queue.depth", persp(name))
	require.True(t, ok)
	require.Equal(t, int64(3), depth)
	eventually(t, 5*time.Second, "oldest age grows", func() bool {
		age, ok := m.gaugeFloat("perspectives.queue.oldest_age", persp(name))
		return ok && age > 0.05
	})

	require.NoError(t, lk.Release(ctx, stream, name, foreign))
	waitModelIn(t, d, name, stream, 3)
	require.NoError(t, w.Purge(ctx, stream, name))
	require.Equal(t, int64(1), m.sum("perspectives.purge.count", persp(name), attribute.String("result", "ok")))
	require.Equal(t, int64(1), m.sum("perspectives.lock.acquired", persp(name), reason(locker.ReasonPurge)))
}

func TestMetricsLostLockAndTakeover(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := uniqueName("metrics_lost")
	d := isolatedDB(t)
	m := newMetrics(t)
	lk := lockerIn(t, d, locker.Options{LockTimeout: 2 * time.Second, KeepAliveInterval: 200 * time.Millisecond})
	gated := newGated(name)
	startWorkerIn(t, d, worker.Config{
		Perspectives: []worker.Perspective{gated}, Locker: lk, MeterProvider: m.mp,
		LockOptions: locker.Options{LockTimeout: 2 * time.Second, KeepAliveInterval: 200 * time.Millisecond},
		Logger:      slog.New(slog.DiscardHandler),
	})
	stream := uuid.New()
	ids := newIDs(t, 5)
	all := events(stream, ids)

	// A foreign instance's lock on the pair expires; the worker's rewind takes it over.
	foreign := uuid.New()
	ok, err := lk.TryAcquire(ctx, stream, name, foreign, locker.ReasonRewind)
	require.NoError(t, err)
	require.True(t, ok)
	forceExpiry(t, ctx, d, stream, name)
	require.NoError(t, worker.Append(ctx, d.Pool, all[1:]...))
	waitModelIn(t, d, name, stream, 4)

	entered, release := gated.arm(ids[2])
	defer release()
	require.NoError(t, worker.Append(ctx, d.Pool, all[0])) // late
	<-entered
	require.Equal(t, int64(1), m.sum("perspectives.lock.takeovers", persp(name), reason(locker.ReasonRewind)),
		"the rewind replaced the foreign instance's expired lock")
	// Mid-replay, the lease lapses: the next renewal reports the lock lost.
	forceExpiry(t, ctx, d, stream, name)
	eventually(t, 10*time.Second, "loss recorded", func() bool {
		return m.sum("perspectives.lock.lost", persp(name), attribute.String("stage", "renew")) == 1
	})
	release()
	eventually(t, 10*time.Second, "failed rewind recorded", func() bool {
		return m.sum("perspectives.rewind.failed", persp(name)) >= 1
	})
	require.Equal(t, expectedLedger(t, all), waitModelIn(t, d, name, stream, 5), "the next pass completes the rewind")
	m.requireNoStreamAttribute()
}

func forceExpiry(t *testing.T, ctx context.Context, d *pgtest.DB, stream uuid.UUID, name string) {
	t.Helper()
	_, err := d.Pool.Exec(ctx, `UPDATE wh_perspective_cursors SET stream_lock_expiry = now() - interval '1 second'
		WHERE stream_id = $1 AND perspective_name = $2 AND stream_lock_instance_id IS NOT NULL`, stream, name)
	require.NoError(t, err)
}

// A new version's catch-up is measured per perspective and version: events read, streams
// passed, done, and the queue of each build; the events it applies count as applied.
func TestMetricsCatchUpProgressPerVersion(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := uniqueName("metrics_catchup")
	d := isolatedDB(t)
	m := newMetrics(t)
	for range 5 {
		require.NoError(t, worker.Append(ctx, d.Pool, events(uuid.New(), newIDs(t, 8))...))
	}
	startWorkerIn(t, d, worker.Config{Perspectives: []worker.Perspective{newVLedger(name, 1)}, MeterProvider: m.mp, CatchUpPageSize: 7})
	v1, v2 := attribute.Int("version", 1), attribute.Int("version", 2)
	eventually(t, 20*time.Second, "version 1 caught up", func() bool {
		done, ok := m.gaugeInt("perspectives.catchup.done", persp(name), v1)
		return ok && done == 1
	})
	read, _ := m.gaugeInt("perspectives.catchup.events", persp(name), v1, attribute.String("state", "active"))
	require.EqualValues(t, 40, read)
	passed, _ := m.gaugeInt("perspectives.catchup.streams", persp(name), v1)
	require.EqualValues(t, 5, passed)
	require.EqualValues(t, 40, m.sum("perspectives.catchup.events_read", persp(name), v1))
	require.EqualValues(t, 40, m.sum("perspectives.events.applied", persp(name), v1))

	// Version 2 builds beside it (a second worker, manual promotion: it stays building).
	m2 := newMetrics(t)
	startWorkerIn(t, d, worker.Config{Perspectives: []worker.Perspective{newVLedger(name, 2)}, MeterProvider: m2.mp, ManualPromotion: true})
	eventually(t, 20*time.Second, "version 2 caught up", func() bool {
		done, ok := m2.gaugeInt("perspectives.catchup.done", persp(name), v2, attribute.String("state", "building"))
		return ok && done == 1
	})
	read, _ = m2.gaugeInt("perspectives.catchup.events", persp(name), v2)
	require.EqualValues(t, 40, read)
	depth, ok := m2.gaugeInt("perspectives.queue.depth", persp(name), v2)
	require.True(t, ok)
	require.Zero(t, depth)
	_, ok = m2.gaugeInt("perspectives.queue.depth", persp(name), v1)
	require.True(t, ok, "an instance reports every build of its perspectives, the active one too")
	m.requireNoStreamAttribute()
	m2.requireNoStreamAttribute()
}
