package worker_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/perspectives-go/perspectives/worker"
)

// Behind PgBouncer in transaction mode the application's pool goes through the pooler,
// which keeps no session to LISTEN on: ListenConnect gives the worker a direct connection
// of its own for the wake-up, so that each committed Append wakes it at once, not at its
// next poll.
func ExampleConfig_listenConnect() {
	ctx := context.Background()
	// e.g. postgres://app@pgbouncer:6432/app?default_query_exec_mode=exec
	pool, err := pgxpool.New(ctx, pooledDatabaseURL())
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	orderTotals := worker.JSONPerspective("order_totals", func(m OrderTotals, ev worker.Event) (OrderTotals, error) {
		var line LineAdded
		if err := json.Unmarshal(ev.Data, &line); err != nil {
			return m, err
		}
		m.Lines++
		m.Total += line.Amount
		return m, nil
	})
	var sessions atomic.Int32 // LISTEN sessions the worker opened
	w, err := worker.New(pool, worker.Config{
		Perspectives: []worker.Perspective{orderTotals},
		ListenConnect: func(ctx context.Context) (*pgx.Conn, error) {
			sessions.Add(1)
			return pgx.Connect(ctx, databaseURL()) // straight to PostgreSQL, not through the pooler
		},
		PollInterval: time.Minute, // the fallback only: Appends wake the worker
		Logger:       slog.New(slog.DiscardHandler),
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := w.Start(ctx); err != nil {
		log.Fatal(err)
	}

	order := uuid.New()
	wctx, cancel := context.WithTimeout(ctx, 20*time.Second) // well within PollInterval
	defer cancel()
	for _, amount := range []string{"25", "10"} {
		events := []worker.Event{{StreamID: order, Type: "LineAdded", Data: json.RawMessage(`{"amount": ` + amount + `}`)}}
		if err := worker.Append(ctx, pool, events...); err != nil {
			log.Fatal(err)
		}
		if err := worker.WaitFor(wctx, pool, "order_totals", order, events[0].ID); err != nil {
			log.Fatal(err)
		}
	}
	if err := w.Stop(ctx); err != nil {
		log.Fatal(err)
	}
	model, _, err := worker.LoadModel(ctx, pool, "order_totals", order)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("model:", string(model))
	fmt.Println("LISTEN sessions opened:", sessions.Load())
	// Output:
	// model: {"lines": 2, "total": 35}
	// LISTEN sessions opened: 1
}
