// Package fxmodule wires the perspectives worker into a go.uber.org/fx application.
//
//	fx.New(
//		fx.Provide(newPool),                       // *pgxpool.Pool
//		fxmodule.Module,
//		fxmodule.WithPostgresLocker(),             // optional: cross-instance stream locks
//		fxmodule.Perspective(NewOrderPerspective), // one per perspective
//	)
//
// The application may also provide a worker.Config (defaults otherwise), locker.Options, a
// locker.Locker, a *slog.Logger, and an OpenTelemetry metric.MeterProvider and
// trace.TracerProvider. One rule decides between a worker.Config field and a value of the
// graph: a field the Config sets wins; a value provided to the graph fills only a field the
// Config leaves zero (Locker, LockOptions, Logger, MeterProvider, TracerProvider). Options
// are validated when the graph is built, so an invalid value fails the application before
// anything starts. The worker starts and stops with the application's lifecycle; its
// OnStart hook only registers the perspectives and starts the loop in the background.
package fxmodule

import (
	"fmt"
	"log/slog"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/fx"

	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/worker"
)

// perspectivesGroup is the value group Perspective feeds and the worker reads.
const perspectivesGroup = `group:"perspectives"`

// Module provides *worker.Worker from the application's *pgxpool.Pool and the perspectives
// added with Perspective, and runs it with the application's lifecycle. It uses a
// locker.Locker only if the application provides one (for example with WithPostgresLocker);
// without one, the worker relies on the in-process apply coordinator alone.
var Module = fx.Module("perspectives",
	fx.Provide(NewWorker),
	fx.Invoke(func(*worker.Worker) {}), // build (and so validate) the worker with the graph
)

// WorkerParams are the worker's dependencies (see NewWorker).
type WorkerParams struct {
	fx.In

	Pool         *pgxpool.Pool
	Perspectives []worker.Perspective `group:"perspectives"`
	Config       worker.Config        `optional:"true"`
	LockOptions  locker.Options       `optional:"true"`
	Locker       locker.Locker        `optional:"true"`
	Logger       *slog.Logger         `optional:"true"`
	// MeterProvider and TracerProvider, when provided, receive the worker's metrics and
	// spans (unless worker.Config sets its own, as for every field here).
	MeterProvider  metric.MeterProvider `optional:"true"`
	TracerProvider trace.TracerProvider `optional:"true"`
	Lifecycle      fx.Lifecycle
}

// NewWorker builds the worker Module provides: the Config's perspectives and those of the
// graph's group, the Config's fields where set and the graph's values where not, and a
// Start/Stop hook on the lifecycle.
func NewWorker(p WorkerParams) (*worker.Worker, error) {
	cfg := configOf(p)
	w, err := worker.New(p.Pool, cfg)
	if err != nil {
		return nil, fmt.Errorf("fxmodule: %w", err)
	}
	// Start returns at once; the loop is detached from the start context. Stop waits for it.
	p.Lifecycle.Append(fx.StartStopHook(w.Start, w.Stop))
	return w, nil
}

// configOf is p.Config with the perspectives of the group added, and the graph's values in
// the fields the Config leaves zero.
func configOf(p WorkerParams) worker.Config {
	cfg := p.Config
	cfg.Perspectives = append(append([]worker.Perspective(nil), cfg.Perspectives...), p.Perspectives...)
	if cfg.LockOptions == (locker.Options{}) {
		cfg.LockOptions = p.LockOptions
	}
	if cfg.Locker == nil {
		cfg.Locker = p.Locker
	}
	if cfg.Logger == nil {
		cfg.Logger = p.Logger
	}
	if cfg.MeterProvider == nil {
		cfg.MeterProvider = p.MeterProvider
	}
	if cfg.TracerProvider == nil {
		cfg.TracerProvider = p.TracerProvider
	}
	return cfg
}

// LockerParams are the Postgres locker's dependencies (see NewPostgresLocker).
type LockerParams struct {
	fx.In

	Pool        *pgxpool.Pool
	LockOptions locker.Options `optional:"true"`
	Config      worker.Config  `optional:"true"`
}

// WithPostgresLocker provides a locker.Locker backed by locker.Postgres (NewPostgresLocker).
func WithPostgresLocker() fx.Option {
	return fx.Provide(fx.Annotate(NewPostgresLocker, fx.As(new(locker.Locker))))
}

// NewPostgresLocker builds the locker WithPostgresLocker provides, on the pool, with the lock
// options of the same rule as NewWorker's: Config.LockOptions when set, else the graph's
// locker.Options, else the defaults.
func NewPostgresLocker(p LockerParams) (*locker.Postgres, error) {
	opts := p.Config.LockOptions
	if opts == (locker.Options{}) {
		opts = p.LockOptions
	}
	l, err := locker.NewPostgres(p.Pool, opts)
	if err != nil {
		return nil, fmt.Errorf("fxmodule: %w", err)
	}
	return l, nil
}

// Perspective adds the perspective built by constructor to the worker. constructor is an
// fx constructor returning a type that implements worker.Perspective, and optionally an
// error; its parameters are resolved from the graph.
func Perspective(constructor any) fx.Option {
	return fx.Provide(fx.Annotate(constructor, fx.As(new(worker.Perspective)), fx.ResultTags(perspectivesGroup)))
}
