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

// databaseURL is the application's database; in these examples, the test database, on a
// direct connection (the examples migrate, which a pooler refuses).
func databaseURL() string { return testDB.DirectURL }

// OrderTotals is a read model: the number of lines and the total of one order.
type OrderTotals struct {
	Lines int `json:"lines"`
	Total int `json:"total"`
}

// LineAdded is an event's payload.
type LineAdded struct {
	Amount int `json:"amount"`
}

// Migrate, run a worker with the Postgres locker, append events, wait until they are
// applied and read the model (the README's quickstart is the same program).
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
	events := []worker.Event{
		{StreamID: order, Type: "LineAdded", Data: json.RawMessage(`{"amount": 25}`)},
		{StreamID: order, Type: "LineAdded", Data: json.RawMessage(`{"amount": 10}`)},
	}
	if err := worker.Append(ctx, pool, events...); err != nil { // or in your pgx.Tx; gives each event a UUIDv7
		log.Fatal(err)
	}

	// The worker applies events in the background: wait until the last one is in the model.
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := worker.WaitFor(wctx, pool, "order_totals", order, events[1].ID); err != nil {
		log.Fatal(err)
	}
	raw, _, err := worker.LoadModel(ctx, pool, "order_totals", order)
	if err != nil {
		log.Fatal(err)
	}
	var totals OrderTotals
	if err := json.Unmarshal(raw, &totals); err != nil {
		log.Fatal(err)
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

// orderTotalsV2 is version 2 of order_totals: it also keeps the average line.
type orderTotalsV2 struct{ worker.Perspective }

func (orderTotalsV2) Version() int { return 2 }

// OrderTotalsV2 is version 2's model.
type OrderTotalsV2 struct {
	Lines   int `json:"lines"`
	Total   int `json:"total"`
	Average int `json:"average"`
}

// Version 2 of a perspective builds beside version 1
// from the event store and is promoted once it has caught up; readers get version 1's
// models until then, and version 2's after.
func Example_versions() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, databaseURL())
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	name := "order_lines_" + uuid.NewString()[:8]
	v1 := worker.JSONPerspective(name, func(m OrderTotals, ev worker.Event) (OrderTotals, error) {
		var line LineAdded
		err := json.Unmarshal(ev.Data, &line)
		m.Lines, m.Total = m.Lines+1, m.Total+line.Amount
		return m, err
	})
	v2 := orderTotalsV2{worker.JSONPerspective(name, func(m OrderTotalsV2, ev worker.Event) (OrderTotalsV2, error) {
		var line LineAdded
		err := json.Unmarshal(ev.Data, &line)
		m.Lines, m.Total = m.Lines+1, m.Total+line.Amount
		m.Average = m.Total / m.Lines
		return m, err
	})}
	run := func(p worker.Perspective) *worker.Worker {
		w, err := worker.New(pool, worker.Config{Perspectives: []worker.Perspective{p}, Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			log.Fatal(err)
		}
		if err := w.Start(ctx); err != nil {
			log.Fatal(err)
		}
		return w
	}
	read := func(order uuid.UUID) string {
		raw, _, err := worker.LoadModel(ctx, pool, name, order)
		if err != nil {
			log.Fatal(err)
		}
		return string(raw)
	}

	order := uuid.New()
	w1 := run(v1)
	if err := worker.Append(ctx, pool,
		worker.Event{StreamID: order, Type: "LineAdded", Data: json.RawMessage(`{"amount": 25}`)},
		worker.Event{StreamID: order, Type: "LineAdded", Data: json.RawMessage(`{"amount": 10}`)},
	); err != nil {
		log.Fatal(err)
	}
	for read(order) != `{"lines": 2, "total": 35}` {
		time.Sleep(20 * time.Millisecond)
	}
	fmt.Println("version 1:", read(order))

	w2 := run(v2) // a rolling deployment: the new version's instance beside the old one
	for read(order) == `{"lines": 2, "total": 35}` {
		time.Sleep(20 * time.Millisecond)
	}
	fmt.Println("version 2:", read(order))
	_ = w1.Stop(ctx)
	_ = w2.Stop(ctx)
	// Output:
	// version 1: {"lines": 2, "total": 35}
	// version 2: {"lines": 2, "total": 35, "average": 17}
}
