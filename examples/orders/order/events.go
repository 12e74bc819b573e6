// Package order is the perspective "orders" of the example: the fold of an order stream's
// events into a Model (Fold, versions 1 and 2), and the sink that keeps the application's
// table order_rows, and so the view orders, in step with the models (Perspective).
package order

import (
	"encoding/json"

	"github.com/google/uuid"

	"github.com/perspectives-go/perspectives/worker"
)

// The event types of an order stream; the stream ID is the order ID.
const (
	TypePlaced    = "OrderPlaced"    // data: Placed
	TypeItemAdded = "ItemAdded"      // data: ItemAdded
	TypeShipped   = "OrderShipped"   // no data
	TypeCancelled = "OrderCancelled" // no data
)

// Placed is the data of an OrderPlaced event.
type Placed struct {
	Customer   string `json:"customer"`
	TotalCents int64  `json:"total_cents"`
}

// ItemAdded is the data of an ItemAdded event.
type ItemAdded struct {
	Cents int64 `json:"cents"`
}

// PlacedEvent is an OrderPlaced event of order.
func PlacedEvent(order uuid.UUID, customer string, totalCents int64) worker.Event {
	return event(order, TypePlaced, Placed{Customer: customer, TotalCents: totalCents})
}

// ItemAddedEvent is an ItemAdded event of order.
func ItemAddedEvent(order uuid.UUID, cents int64) worker.Event {
	return event(order, TypeItemAdded, ItemAdded{Cents: cents})
}

// ShippedEvent is an OrderShipped event of order.
func ShippedEvent(order uuid.UUID) worker.Event { return event(order, TypeShipped, nil) }

// CancelledEvent is an OrderCancelled event of order.
func CancelledEvent(order uuid.UUID) worker.Event { return event(order, TypeCancelled, nil) }

func event(order uuid.UUID, typ string, data any) worker.Event {
	raw, err := json.Marshal(data)
	if err != nil {
		panic(err) // the types above always marshal
	}
	return worker.Event{StreamID: order, Type: typ, Data: raw}
}
