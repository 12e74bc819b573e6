// Command orders is the example of a read model in the application's own tables: the
// perspective orders (package order) writes each order's model into order_rows, in the
// worker's transaction that commits it, and the application reads the view orders with
// its own sqlc queries (package db).
//
//	go run ./examples/orders   # DATABASE_URL, default postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable
//
// It migrates (the perspectives tables, then the application's), starts the worker with
// an fx application, appends a few orders, waits until they are applied and prints the
// open orders over $50 from the view (on a database it ran on before, the earlier runs'
// orders too).
package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"os"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/fx"

	"github.com/perspectives-go/perspectives/examples/orders/db"
	"github.com/perspectives-go/perspectives/examples/orders/order"
	appschema "github.com/perspectives-go/perspectives/examples/orders/schema"
	"github.com/perspectives-go/perspectives/fxmodule"
	"github.com/perspectives-go/perspectives/schema"
	"github.com/perspectives-go/perspectives/worker"
)

// DatabaseURL is the database the application uses.
type DatabaseURL string

func main() {
	url := cmp.Or(os.Getenv("DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable")
	if err := run(context.Background(), DatabaseURL(url), slog.Default(), os.Stdout); err != nil {
		log.Fatal(err)
	}
}

// NewPool opens the application's pool. When the application starts, before the worker
// does, it migrates the perspectives tables and the application's own (a direct connection
// to PostgreSQL, not one through PgBouncer).
func NewPool(lc fx.Lifecycle, url DatabaseURL) (*pgxpool.Pool, error) {
	pool, err := pgxpool.New(context.Background(), string(url))
	if err != nil {
		return nil, err
	}
	lc.Append(fx.StartStopHook(func(ctx context.Context) error {
		if err := schema.Migrate(ctx, pool); err != nil {
			return err
		}
		return appschema.Migrate(ctx, pool)
	}, pool.Close))
	return pool, nil
}

// NewOrdersPerspective is the perspective orders the worker runs: version 1.
func NewOrdersPerspective() *order.Perspective { return order.New(1) }

// run is the program: an fx application with the perspectives module, the Postgres locker
// and the perspective orders; a few orders appended, read back from the view.
func run(ctx context.Context, url DatabaseURL, logger *slog.Logger, out io.Writer) (err error) {
	var pool *pgxpool.Pool
	app := fx.New(
		fx.NopLogger,
		fx.Supply(url, logger),
		fx.Provide(NewPool),
		fxmodule.Module,
		fxmodule.WithPostgresLocker(),
		fxmodule.Perspective(NewOrdersPerspective),
		fx.Populate(&pool),
	)
	startCtx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if err := app.Start(startCtx); err != nil {
		return err
	}
	defer func() {
		stopCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer cancel()
		err = errors.Join(err, app.Stop(stopCtx))
	}()

	alice, bob, carol, dave := uuid.New(), uuid.New(), uuid.New(), uuid.New()
	events := []worker.Event{
		order.PlacedEvent(alice, "alice", 12000),
		order.ItemAddedEvent(alice, 2500),
		order.PlacedEvent(bob, "bob", 4000), // open, but not over $50
		order.PlacedEvent(carol, "carol", 30000),
		order.ShippedEvent(carol), // no longer open
		order.PlacedEvent(dave, "dave", 8000),
	}
	if err := worker.Append(ctx, pool, events...); err != nil {
		return err
	}
	// Read your writes: wait until each order's last event is in its model, and so in the
	// model's row (both commit in one transaction).
	wctx, cancelWait := context.WithTimeout(ctx, 30*time.Second)
	defer cancelWait()
	last := map[uuid.UUID]uuid.UUID{}
	for _, ev := range events {
		last[ev.StreamID] = ev.ID
	}
	for stream, id := range last {
		if err := worker.WaitFor(wctx, pool, order.Name, stream, id); err != nil {
			return err
		}
	}

	open, err := db.New(pool).OpenOrdersOver(ctx, 5000)
	if err != nil {
		return err
	}
	fmt.Fprintln(out, "open orders over $50:")
	for _, o := range open {
		fmt.Fprintf(out, "  %-6s $%d.%02d\n", o.Customer, o.TotalCents/100, o.TotalCents%100)
	}
	return nil
}
