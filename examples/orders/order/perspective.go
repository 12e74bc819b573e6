package order

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/perspectives-go/perspectives/examples/orders/db"
	"github.com/perspectives-go/perspectives/worker"
)

// Name is the perspective's name: LoadModel's, WaitFor's and Purge's.
const Name = "orders"

// The statuses of an order.
const (
	StatusOpen      = "open"
	StatusShipped   = "shipped"
	StatusCancelled = "cancelled"
)

// ShippingFeeCents is the shipping fee that version 2 adds to each order's total.
const ShippingFeeCents = 495

// Model is the read model of one order: its JSON is the perspective's model, the source of
// truth; its row in order_rows follows it.
type Model struct {
	Customer   string `json:"customer"`
	Status     string `json:"status"` // "" until the order is placed, then one of the statuses
	TotalCents int64  `json:"total_cents"`
}

// Fold is m after ev, as version version computes it: version 1 totals the order's items,
// version 2 adds the shipping fee. An order is shipped or cancelled only while it is open.
// Events of other types are not the perspective's business: m is returned as it is. Like
// every Apply, Fold is pure: it runs again on rewinds, rebuilds and new versions.
func Fold(version int, m Model, ev worker.Event) (Model, error) {
	switch ev.Type {
	case TypePlaced:
		var p Placed
		if err := json.Unmarshal(ev.Data, &p); err != nil {
			return m, fmt.Errorf("%s %s: %w", ev.Type, ev.ID, err)
		}
		if m.Status == "" {
			m.Status = StatusOpen
		}
		m.Customer = p.Customer
		m.TotalCents += p.TotalCents
		if version >= 2 {
			m.TotalCents += ShippingFeeCents
		}
	case TypeItemAdded:
		var a ItemAdded
		if err := json.Unmarshal(ev.Data, &a); err != nil {
			return m, fmt.Errorf("%s %s: %w", ev.Type, ev.ID, err)
		}
		m.TotalCents += a.Cents
	case TypeShipped:
		if m.Status == StatusOpen {
			m.Status = StatusShipped
		}
	case TypeCancelled:
		if m.Status == StatusOpen {
			m.Status = StatusCancelled
		}
	}
	return m, nil
}

// Perspective is a version of the perspective orders, with its sink (sink.go): it
// implements worker.Perspective, worker.Versioned, worker.Sink, worker.Promoter and
// worker.Retirer.
type Perspective struct {
	worker.Perspective // the JSON fold of Fold
	version            int
	queries            func(db.DBTX) db.Querier
}

// New is version version (1 or 2) of the perspective, writing with the application's
// sqlc queries.
func New(version int) *Perspective {
	return NewWithQueries(version, func(dbtx db.DBTX) db.Querier { return db.New(dbtx) })
}

// NewWithQueries is New with the application's queries opened on a transaction by open
// (tests give it a mock).
func NewWithQueries(version int, open func(db.DBTX) db.Querier) *Perspective {
	return &Perspective{
		Perspective: worker.JSONPerspective(Name, func(m Model, ev worker.Event) (Model, error) {
			return Fold(version, m, ev)
		}),
		version: version,
		queries: open,
	}
}

// Version is the perspective's version (worker.Versioned).
func (p *Perspective) Version() int { return p.version }

// ApplyBatch applies a run of events in one call (worker.BatchApplier): the embedded JSON
// perspective's, which decodes and encodes the model once per run. Embedding hides it, so
// it is forwarded.
func (p *Perspective) ApplyBatch(ctx context.Context, model json.RawMessage, events []worker.Event) (json.RawMessage, error) {
	return p.Perspective.(worker.BatchApplier).ApplyBatch(ctx, model, events)
}
