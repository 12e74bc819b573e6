package worker_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"log/slog"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/perspectives-go/perspectives/worker"
)

// Read your writes: append, wait until the event is in the served model,
// then read it.
func ExampleWaitFor() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, databaseURL())
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
	w, err := worker.New(pool, worker.Config{Perspectives: []worker.Perspective{orderTotals}, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		log.Fatal(err)
	}
	if err := w.Start(ctx); err != nil {
		log.Fatal(err)
	}
	defer w.Stop(context.Background())

	order := uuid.New()
	events := []worker.Event{{StreamID: order, Type: "LineAdded", Data: json.RawMessage(`{"amount": 25}`)}}
	if err := worker.Append(ctx, pool, events...); err != nil { // assigns events[0].ID
		log.Fatal(err)
	}

	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	err = worker.WaitFor(wctx, pool, "order_totals", order, events[0].ID)
	var parked *worker.ParkedError
	switch {
	case errors.As(err, &parked): // the pair is parked (errors.Is(err, worker.ErrParked)): which event failed, and why
		log.Fatalf("parked at event %s: %s", parked.Event, parked.LastError)
	case errors.Is(err, worker.ErrSkipped): // the event was skipped: it will never be in the model
		log.Fatal(err)
	case err != nil: // ctx's error (is a worker running?), bad input, the database
		log.Fatal(err)
	}
	raw, _, err := worker.LoadModel(ctx, pool, "order_totals", order) // includes the event
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(string(raw))
	// Output: {"lines": 1, "total": 25}
}
