package worker_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log"
	"log/slog"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/schema"
	"github.com/perspectives-go/perspectives/worker"
)

// databaseURL is the application's database; in these examples, the test database.
func databaseURL() string { return testDB.URL }

// OrderTotals is a read model: the number of lines and the total of one order.
type OrderTotals struct {
	Lines int `json:"lines"`
	Total int `json:"total"`
}

// LineAdded is an event's payload.
type LineAdded struct {
	Amount int `json:"amount"`
}

// The README's quickstart: migrate, run a worker with the Postgres locker, append events
// and read the model.
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, databaseURL())
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if err := schema.Migrate(ctx, pool); err != nil {
		log.Fatal(err)
	}

	orderTotals := worker.JSONPerspective("order_totals", func(m OrderTotals, ev worker.Event) (OrderTotals, error) {
		var line LineAdded
		if err := json.Unmarshal(ev.Data, &line); err != nil {
			return m, err
		}
		m.Lines++
		m.Total += line.Amount
		return m, nil
	})
	lk, err := locker.NewPostgres(pool, locker.Options{LockTimeout: 30 * time.Second, KeepAliveInterval: 10 * time.Second})
	if err != nil {
		log.Fatal(err)
	}
	w, err := worker.New(pool, worker.Config{
		Perspectives: []worker.Perspective{orderTotals},
		Locker:       lk, // nil: one instance, in-process coordination only
		Logger:       slog.New(slog.DiscardHandler),
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := w.Start(ctx); err != nil {
		log.Fatal(err)
	}
	defer w.Stop(context.Background())

	order := uuid.New()
	err = worker.Append(ctx, pool,
		worker.Event{StreamID: order, Type: "LineAdded", Data: json.RawMessage(`{"amount": 25}`)},
		worker.Event{StreamID: order, Type: "LineAdded", Data: json.RawMessage(`{"amount": 10}`)},
	)
	if err != nil {
		log.Fatal(err)
	}

	var totals OrderTotals
	for totals.Lines < 2 { // the worker applies the events within a poll interval
		time.Sleep(20 * time.Millisecond)
		raw, ok, err := worker.LoadModel(ctx, pool, "order_totals", order)
		if err != nil {
			log.Fatal(err)
		}
		if ok {
			_ = json.Unmarshal(raw, &totals)
		}
	}
	fmt.Printf("lines=%d total=%d\n", totals.Lines, totals.Total)
	// Output: lines=2 total=35
}

// Append inside the application's own transaction: the events are stored and queued only
// if the transaction commits.
func ExampleAppend() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, databaseURL())
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	tx, err := pool.Begin(ctx)
	if err != nil {
		log.Fatal(err)
	}
	events := []worker.Event{{StreamID: uuid.New(), Type: "OrderPlaced", Data: json.RawMessage(`{}`)}}
	if err := worker.Append(ctx, tx, events...); err != nil {
		log.Fatal(err)
	}
	// ... the application's own writes in tx ...
	if err := tx.Commit(ctx); err != nil {
		log.Fatal(err)
	}
	fmt.Println("assigned a UUIDv7:", events[0].ID.Version() == 7)
	// Output: assigned a UUIDv7: true
}
