package worker_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"log/slog"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/perspectives-go/perspectives/worker"
)

// A poison event parks its pair: the pair is retried with backoff, and after Attempts
// failures in a row it stops and waits for an operator, who skips the event here (the CLI's
// perspectives skip, or the dashboard's Skip button, do the same). The events before the
// poison event are applied; the ones after it wait behind it and are applied after the skip.
func ExampleFailurePolicy() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, databaseURL())
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	invoiceTotals := worker.JSONPerspective("invoice_totals", func(m OrderTotals, ev worker.Event) (OrderTotals, error) {
		if ev.Type != "LineAdded" {
			return m, nil
		}
		var line LineAdded
		if err := json.Unmarshal(ev.Data, &line); err != nil {
			return m, err
		}
		if line.Amount < 0 {
			return m, fmt.Errorf("negative amount %d", line.Amount) // no retry will ever apply it
		}
		m.Lines++
		m.Total += line.Amount
		return m, nil
	})
	w, err := worker.New(pool, worker.Config{
		Perspectives:  []worker.Perspective{invoiceTotals},
		FailurePolicy: worker.FailurePolicy{Attempts: 3}, // park after 3 failures in a row (default 8)
		RetryBackoff:  10 * time.Millisecond,             // 10 ms, then 20 ms (default 1 s, doubling)
		Logger:        slog.New(slog.DiscardHandler),     // it would log each failure and the parking
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := w.Start(ctx); err != nil {
		log.Fatal(err)
	}
	defer w.Stop(context.Background())

	invoice := uuid.New()
	events := []worker.Event{
		{StreamID: invoice, Type: "LineAdded", Data: json.RawMessage(`{"amount": 25}`)},
		{StreamID: invoice, Type: "LineAdded", Data: json.RawMessage(`{"amount": -5}`)}, // the poison event
		{StreamID: invoice, Type: "LineAdded", Data: json.RawMessage(`{"amount": 10}`)},
	}
	if err := worker.Append(ctx, pool, events...); err != nil {
		log.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	err = worker.WaitFor(wctx, pool, "invoice_totals", invoice, events[2].ID)
	var parked *worker.ParkedError
	if !errors.As(err, &parked) {
		log.Fatalf("not parked: %v", err)
	}
	fmt.Println("parked at the poison event:", parked.Event == events[1].ID)
	fmt.Printf("after %d attempts: %s\n", parked.Attempts, strings.ReplaceAll(parked.LastError, parked.Event.String(), "<event>"))
	model, _, err := worker.LoadModel(ctx, pool, "invoice_totals", invoice)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("model:", string(model))

	// The operator: the event is garbage, skip it (recorded with who skipped it and when).
	admin, err := worker.NewAdmin(pool, nil) // nil: the workers run without a locker
	if err != nil {
		log.Fatal(err)
	}
	versions, err := admin.Skip(ctx, invoice, "invoice_totals", parked.Event, "alice")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("skipped in versions:", versions)
	if err := worker.WaitFor(wctx, pool, "invoice_totals", invoice, events[2].ID); err != nil {
		log.Fatal(err)
	}
	model, _, err = worker.LoadModel(ctx, pool, "invoice_totals", invoice)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("model:", string(model))
	// Output:
	// parked at the poison event: true
	// after 3 attempts: apply event <event> (LineAdded): negative amount -5
	// model: {"lines": 1, "total": 25}
	// skipped in versions: [1]
	// model: {"lines": 2, "total": 35}
}

// With Skip, the failure policy skips a poison event itself: the pair goes on without it,
// and the skip is recorded (Admin.Skipped; the CLI's perspectives failed --skipped). A
// reader waiting for the skipped event gets ErrSkipped.
func ExampleFailurePolicy_skip() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, databaseURL())
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	receiptTotals := worker.JSONPerspective("receipt_totals", func(m OrderTotals, ev worker.Event) (OrderTotals, error) {
		if ev.Type != "LineAdded" {
			return m, nil
		}
		var line LineAdded
		if err := json.Unmarshal(ev.Data, &line); err != nil {
			return m, err
		}
		if line.Amount < 0 {
			return m, fmt.Errorf("negative amount %d", line.Amount)
		}
		m.Lines++
		m.Total += line.Amount
		return m, nil
	})
	w, err := worker.New(pool, worker.Config{
		Perspectives: []worker.Perspective{receiptTotals},
		FailurePolicies: map[string]worker.FailurePolicy{ // per perspective; FailurePolicy for the others
			"receipt_totals": {Attempts: 1, Skip: true}, // skip at the first failure
		},
		Logger: slog.New(slog.DiscardHandler), // it would log the skip at ERROR
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := w.Start(ctx); err != nil {
		log.Fatal(err)
	}
	defer w.Stop(context.Background())

	receipt := uuid.New()
	events := []worker.Event{
		{StreamID: receipt, Type: "LineAdded", Data: json.RawMessage(`{"amount": 25}`)},
		{StreamID: receipt, Type: "LineAdded", Data: json.RawMessage(`{"amount": -5}`)}, // the poison event
		{StreamID: receipt, Type: "LineAdded", Data: json.RawMessage(`{"amount": 10}`)},
	}
	if err := worker.Append(ctx, pool, events...); err != nil {
		log.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := worker.WaitFor(wctx, pool, "receipt_totals", receipt, events[2].ID); err != nil {
		log.Fatal(err)
	}
	err = worker.WaitFor(wctx, pool, "receipt_totals", receipt, events[1].ID)
	fmt.Println("waiting for the poison event:", errors.Is(err, worker.ErrSkipped))
	model, _, err := worker.LoadModel(ctx, pool, "receipt_totals", receipt)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("model:", string(model))

	admin, err := worker.NewAdmin(pool, nil)
	if err != nil {
		log.Fatal(err)
	}
	skipped, err := admin.Skipped(ctx, "receipt_totals", 100)
	if err != nil {
		log.Fatal(err)
	}
	for _, s := range skipped {
		if s.Stream == receipt {
			fmt.Printf("skipped: the poison event %v, by the policy %v, error %q\n",
				s.Event == events[1].ID, s.ByPolicy, strings.ReplaceAll(s.LastError, s.Event.String(), "<event>"))
		}
	}
	// Output:
	// waiting for the poison event: true
	// model: {"lines": 2, "total": 35}
	// skipped: the poison event true, by the policy true, error "apply event <event> (LineAdded): negative amount -5"
}
