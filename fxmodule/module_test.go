package fxmodule_test

import (
	"context"
	"encoding/json"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/metric"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	"go.uber.org/fx"
	"go.uber.org/fx/fxtest"

	"github.com/perspectives-go/perspectives/fxmodule"
	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/mocks"
	"github.com/perspectives-go/perspectives/worker"
)

type counter struct{ N int }

func counterPerspective(name string) func() worker.Perspective {
	return func() worker.Perspective {
		return worker.JSONPerspective(name, func(m counter, _ worker.Event) (counter, error) {
			m.N++
			return m, nil
		})
	}
}

func pool() fx.Option { return fx.Supply(testDB.Pool) }

func quiet() fx.Option {
	return fx.Options(fx.NopLogger, fx.Supply(slog.New(slog.DiscardHandler)))
}

func TestValidateApp(t *testing.T) {
	t.Parallel()
	require.NoError(t, fx.ValidateApp(fx.NopLogger, fx.Provide(func() *pgxpool.Pool { return nil }),
		fxmodule.Module, fxmodule.Perspective(counterPerspective("v1"))), "without a locker")
	require.NoError(t, fx.ValidateApp(fx.NopLogger, fx.Provide(func() *pgxpool.Pool { return nil }),
		fxmodule.Module, fxmodule.WithPostgresLocker(), fxmodule.Perspective(counterPerspective("v2"))), "with the Postgres locker")
	err := fx.ValidateApp(fx.NopLogger, fxmodule.Module, fxmodule.Perspective(counterPerspective("v3")))
	require.ErrorContains(t, err, "*pgxpool.Pool", "the pool is required")
}

func TestStartStopAppliesEventsAndLeavesNoLock(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := "fx_" + uuid.NewString()[:8]
	var w *worker.Worker
	var lk locker.Locker
	app := fxtest.New(t, pool(), quiet(),
		fx.Supply(worker.Config{PollInterval: 20 * time.Millisecond}),
		fxmodule.Module, fxmodule.WithPostgresLocker(),
		fxmodule.Perspective(counterPerspective(name)),
		fx.Populate(&w, &lk),
	)
	app.RequireStart()
	stream := uuid.New()
	require.NoError(t, worker.Append(ctx, testDB.Pool,
		worker.Event{StreamID: stream, Type: "t"}, worker.Event{StreamID: stream, Type: "t"}))
	require.Eventually(t, func() bool {
		raw, ok, err := worker.LoadModel(ctx, testDB.Pool, name, stream)
		var c counter
		return err == nil && ok && json.Unmarshal(raw, &c) == nil && c.N == 2
	}, 20*time.Second, 10*time.Millisecond)

	// Hold a lock as this instance would mid-operation; stopping the app releases it.
	ok, err := lk.TryAcquire(ctx, stream, name, w.InstanceID(), locker.ReasonPurge)
	require.NoError(t, err)
	require.True(t, ok)
	require.NoError(t, w.Purge(ctx, stream, name))
	app.RequireStop()
	pl := lk.(*locker.Postgres)
	_, held, err := pl.Get(ctx, stream, name)
	require.NoError(t, err)
	require.False(t, held, "no lock is left after stop")
}

func TestInvalidOptionsFailAppBeforeStart(t *testing.T) {
	t.Parallel()
	started := false
	app := fx.New(pool(), quiet(),
		fx.Supply(locker.Options{LockTimeout: 10 * time.Second, KeepAliveInterval: 6 * time.Second}),
		fxmodule.Module, fxmodule.WithPostgresLocker(),
		fxmodule.Perspective(counterPerspective("bad_opts")),
		fx.Invoke(func(lc fx.Lifecycle) { lc.Append(fx.StartHook(func() { started = true })) }),
	)
	err := app.Err()
	require.ErrorIs(t, err, locker.ErrInvalidOptions)
	require.ErrorContains(t, err, "KeepAliveInterval (6s)")
	require.ErrorContains(t, err, "10s")
	require.False(t, started)

	app = fx.New(pool(), quiet(),
		fx.Supply(worker.Config{BatchSize: -5}),
		fxmodule.Module, fxmodule.Perspective(counterPerspective("bad_cfg")))
	require.ErrorIs(t, app.Err(), worker.ErrInvalidConfig)
	require.ErrorContains(t, app.Err(), "BatchSize")

	app = fx.New(pool(), quiet(), fxmodule.Module)
	require.ErrorIs(t, app.Err(), worker.ErrInvalidConfig, "no perspectives")
}

func TestPerspectiveConstructorWithError(t *testing.T) {
	t.Parallel()
	name := "fx_err_" + uuid.NewString()[:8]
	app := fx.New(pool(), quiet(), fxmodule.Module,
		fxmodule.Perspective(func() (worker.Perspective, error) { return counterPerspective(name)(), nil }),
		fxmodule.Perspective(func() (worker.Perspective, error) { return nil, context.DeadlineExceeded }),
	)
	require.ErrorIs(t, app.Err(), context.DeadlineExceeded, "a constructor's error fails the app")
}

// Without a locker, applies and purges of one pair are still serialized in-process by the
// apply coordinator, and no locker is ever called.
func TestNoLockerSerializesThroughCoordinator(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := "fx_nolock_" + uuid.NewString()[:8]
	stream := uuid.New()
	var inFlight, maxInFlight, applies atomic.Int32
	entered := make(chan struct{})
	release := make(chan struct{})
	var once, releaseOnce sync.Once
	unblock := func() { releaseOnce.Do(func() { close(release) }) }
	defer unblock()
	persp := &mocks.PerspectiveMock{
		NameFunc: func() string { return name },
		ApplyFunc: func(ctx context.Context, model json.RawMessage, ev worker.Event) (json.RawMessage, error) {
			if ev.StreamID != stream {
				return json.RawMessage(`{}`), nil // events other tests append to their own streams
			}
			n := inFlight.Add(1)
			defer inFlight.Add(-1)
			for {
				m := maxInFlight.Load()
				if n <= m || maxInFlight.CompareAndSwap(m, n) {
					break
				}
			}
			applies.Add(1)
			once.Do(func() { close(entered); <-release })
			return json.RawMessage(`{}`), nil
		},
	}
	unused := &mocks.LockerMock{}
	var w *worker.Worker
	app := fxtest.New(t, pool(), quiet(),
		fx.Supply(worker.Config{PollInterval: 10 * time.Millisecond}),
		fxmodule.Module,
		fxmodule.Perspective(func() worker.Perspective { return persp }),
		fx.Populate(&w),
	)
	app.RequireStart()
	require.NoError(t, worker.Append(ctx, testDB.Pool, worker.Event{StreamID: stream, Type: "t"}))
	<-entered // the loop is inside Apply for (stream, name)

	purged := make(chan error, 1)
	go func() { purged <- w.Purge(ctx, stream, name) }()
	select {
	case err := <-purged:
		t.Fatalf("purge ran while an apply of the same pair was in progress: %v", err)
	case <-time.After(100 * time.Millisecond):
	}
	unblock()
	require.NoError(t, <-purged)
	app.RequireStop()
	require.Equal(t, int32(1), maxInFlight.Load())
	require.Equal(t, int32(1), applies.Load())
	require.Empty(t, unused.TryAcquireCalls())
	_, ok, err := worker.LoadModel(ctx, testDB.Pool, name, stream)
	require.NoError(t, err)
	require.False(t, ok, "the purge ran after the apply committed and removed its model")
}

func TestMeterProviderThroughFx(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := "fx_metrics_" + uuid.NewString()[:8]
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	app := fxtest.New(t, pool(), quiet(),
		fx.Supply(worker.Config{PollInterval: 10 * time.Millisecond}),
		fx.Supply(fx.Annotate(mp, fx.As(new(metric.MeterProvider)))),
		fxmodule.Module,
		fxmodule.Perspective(counterPerspective(name)),
	)
	app.RequireStart()
	defer app.RequireStop()
	stream := uuid.New()
	require.NoError(t, worker.Append(ctx, testDB.Pool, worker.Event{StreamID: stream, Type: "t"}))
	require.Eventually(t, func() bool {
		var rm metricdata.ResourceMetrics
		require.NoError(t, reader.Collect(ctx, &rm))
		for _, sm := range rm.ScopeMetrics {
			for _, m := range sm.Metrics {
				if m.Name != "perspectives.events.applied" {
					continue
				}
				for _, dp := range m.Data.(metricdata.Sum[int64]).DataPoints {
					if v, _ := dp.Attributes.Value("perspective"); v.AsString() == name && dp.Value >= 1 {
						return true
					}
				}
			}
		}
		return false
	}, 20*time.Second, 10*time.Millisecond, "the provided MeterProvider receives the worker's metrics")
}

// The locker WithPostgresLocker builds follows the same rule as the worker: Config's lock
// options when set, else the graph's locker.Options.
func TestPostgresLockerOptionsFollowTheConfigFirstRule(t *testing.T) {
	t.Parallel()
	graphOpts := locker.Options{LockTimeout: time.Minute, KeepAliveInterval: 20 * time.Second}
	cfgOpts := locker.Options{LockTimeout: 40 * time.Second, KeepAliveInterval: 10 * time.Second}
	for _, tc := range []struct {
		name string
		cfg  worker.Config
		want locker.Options
	}{
		{"config sets them", worker.Config{LockOptions: cfgOpts}, cfgOpts},
		{"config leaves them zero", worker.Config{}, graphOpts},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var lk locker.Locker
			app := fxtest.New(t, pool(), quiet(),
				fx.Supply(tc.cfg), fx.Supply(graphOpts),
				fxmodule.Module, fxmodule.WithPostgresLocker(),
				fxmodule.Perspective(counterPerspective("fx_opts_"+uuid.NewString()[:8])),
				fx.Populate(&lk))
			defer app.RequireStart().RequireStop()
			require.Equal(t, tc.want, lk.(*locker.Postgres).Options())
		})
	}
}

// A Locker that does not keep its locks on the cursor rows fails the application at
// construction, naming the type.
func TestForeignLockerIsRefused(t *testing.T) {
	t.Parallel()
	app := fx.New(pool(), quiet(),
		fx.Provide(func() locker.Locker { return &mocks.LockerMock{} }),
		fxmodule.Module, fxmodule.Perspective(counterPerspective("fx_foreign")))
	err := app.Err()
	require.ErrorIs(t, err, worker.ErrInvalidConfig)
	require.ErrorContains(t, err, "*mocks.LockerMock")
	require.ErrorContains(t, err, "locker.CursorRowLocker")
}
