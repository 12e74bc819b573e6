package fxmodule_test

import (
	"context"
	"fmt"
	"log"
	"log/slog"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/fx"

	"github.com/perspectives-go/perspectives/fxmodule"
	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/worker"
)

// Visits counts the events of a stream.
type Visits struct {
	Count int `json:"count"`
}

// NewVisitsPerspective is an fx constructor of a perspective.
func NewVisitsPerspective() worker.Perspective {
	return worker.JSONPerspective("visits", func(m Visits, _ worker.Event) (Visits, error) {
		m.Count++
		return m, nil
	})
}

// NewPool is the application's pool constructor.
func NewPool(lc fx.Lifecycle) (*pgxpool.Pool, error) {
	pool, err := pgxpool.New(context.Background(), databaseURL())
	if err != nil {
		return nil, err
	}
	lc.Append(fx.StopHook(pool.Close))
	return pool, nil
}

// The README's "With fx": the module, the Postgres locker with options, and one
// perspective; the worker starts and stops with the application.
func Example() {
	var pool *pgxpool.Pool
	app := fx.New(
		fx.NopLogger,
		fx.Provide(NewPool),
		fx.Supply(locker.Options{LockTimeout: 30 * time.Second, KeepAliveInterval: 10 * time.Second}),
		fx.Supply(worker.Config{PollInterval: 100 * time.Millisecond, Logger: slog.New(slog.DiscardHandler)}),
		fxmodule.Module,
		fxmodule.WithPostgresLocker(),
		fxmodule.Perspective(NewVisitsPerspective),
		fx.Populate(&pool),
	)
	ctx := context.Background()
	if err := app.Start(ctx); err != nil {
		log.Fatal(err)
	}
	defer app.Stop(ctx)

	page := uuid.New()
	events := []worker.Event{{StreamID: page, Type: "Visited"}, {StreamID: page, Type: "Visited"}}
	if err := worker.Append(ctx, pool, events...); err != nil {
		log.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := worker.WaitFor(wctx, pool, "visits", page, events[1].ID); err != nil {
		log.Fatal(err)
	}
	v, _, err := worker.Load[Visits](ctx, pool, "visits", page)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("visits:", v.Count)
	// Output: visits: 2
}
