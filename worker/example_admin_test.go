package worker_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"log/slog"
	"strings"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/perspectives-go/perspectives/worker"
)

// A bug parks a pair; once it is fixed, the operator finds the parked pair and retries it
// (the CLI's perspectives failed and perspectives retry, or the dashboard, do the same).
// Admin needs no perspective of its own: the running workers do the work.
func ExampleAdmin_Retry() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, databaseURL())
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	var fixed atomic.Bool // stands for the release that fixes the bug
	cartTotals := worker.JSONPerspective("cart_totals", func(m OrderTotals, ev worker.Event) (OrderTotals, error) {
		var line LineAdded
		switch ev.Type {
		case "LineAdded":
			if err := json.Unmarshal(ev.Data, &line); err != nil {
				return m, err
			}
			m.Lines++
			m.Total += line.Amount
		case "DiscountGiven":
			if !fixed.Load() {
				return m, errors.New("discounts are not supported") // the bug
			}
			if err := json.Unmarshal(ev.Data, &line); err != nil {
				return m, err
			}
			m.Total -= line.Amount
		}
		return m, nil
	})
	w, err := worker.New(pool, worker.Config{
		Perspectives:  []worker.Perspective{cartTotals},
		FailurePolicy: worker.FailurePolicy{Attempts: 1}, // park at the first failure
		Logger:        slog.New(slog.DiscardHandler),
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := w.Start(ctx); err != nil {
		log.Fatal(err)
	}
	defer w.Stop(context.Background())

	cart := uuid.New()
	events := []worker.Event{
		{StreamID: cart, Type: "LineAdded", Data: json.RawMessage(`{"amount": 25}`)},
		{StreamID: cart, Type: "DiscountGiven", Data: json.RawMessage(`{"amount": 5}`)},
	}
	if err := worker.Append(ctx, pool, events...); err != nil {
		log.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := worker.WaitFor(wctx, pool, "cart_totals", cart, events[1].ID); !errors.Is(err, worker.ErrParked) {
		log.Fatalf("not parked: %v", err)
	}

	admin, err := worker.NewAdmin(pool, nil) // nil: the workers run without a locker
	if err != nil {
		log.Fatal(err)
	}
	failed, err := admin.Failed(ctx, "cart_totals", 100) // parked first, then the oldest failure
	if err != nil {
		log.Fatal(err)
	}
	for _, f := range failed {
		if f.Stream == cart {
			fmt.Printf("failed: parked %v at a %s event after %d attempt(s): %s\n",
				f.Parked, f.EventType, f.Attempts, strings.ReplaceAll(f.LastError, f.Event.String(), "<event>"))
		}
	}

	fixed.Store(true)
	n, err := admin.Retry(ctx, cart, "cart_totals") // uuid.Nil: every failing pair of the perspective
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("pairs retried:", n)
	if err := worker.WaitFor(wctx, pool, "cart_totals", cart, events[1].ID); err != nil {
		log.Fatal(err)
	}
	model, _, err := worker.LoadModel(ctx, pool, "cart_totals", cart)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("model:", string(model))
	// Output:
	// failed: parked true at a DiscountGiven event after 1 attempt(s): apply event <event> (DiscountGiven): discounts are not supported
	// pairs retried: 1
	// model: {"lines": 1, "total": 20}
}
