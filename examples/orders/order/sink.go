package order

// The sink: the models of every build of the perspective follow into order_rows, in the
// worker's transactions that commit them; the view orders shows the active build's.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"slices"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/perspectives-go/perspectives/examples/orders/db"
	"github.com/perspectives-go/perspectives/worker"
)

// NotifyShipped is the kind of the notification queued in order_notifications when an
// order is shipped.
const NotifyShipped = "shipped"

// RetireBatch is how many rows of a retired build one statement of Retired deletes.
const RetireBatch = 1000

// Write writes the changes of one build into order_rows under the build's key, on the
// worker's transaction: an order whose model is deleted (a purge) or not placed yet has no
// row. It sends one statement per kind of write for the whole batch, ordered by order ID so
// that concurrent transactions take the rows' locks in one order.
//
// Live changes also queue side effects: a shipped order's notification, in the outbox
// order_notifications. A replayed change (a rewind, a catch-up of history, a rebuild)
// queues none: a new version catching up on the whole store must not notify every order of
// its history again. A rewind's change is a replay too, although it applies the late event,
// and any newer one queued with it, for the first time: a shipping applied by a rewind is
// not notified at that commit, but with the order's next live change (the outbox's key
// makes that the one notification), or never if none comes.
//
// Live changes reach every build: the active one, and one building beside it. The outbox's
// key (order, kind) makes the second build's insert a no-op, which holds across a
// promotion; filtering on Change.Build.State instead (the worker's view of the build at its
// last look at the builds) could drop the notification of an event applied by the new
// build just after its promotion, before its instance has seen it active.
func (p *Perspective) Write(ctx context.Context, tx pgx.Tx, changes []worker.Change) error {
	if len(changes) == 0 {
		return nil
	}
	changes = slices.SortedFunc(slices.Values(changes), func(a, b worker.Change) int {
		return bytes.Compare(a.StreamID[:], b.StreamID[:])
	})
	build := changes[0].Build.Key // a call holds one build's changes
	up := db.OrderRowsUpsertParams{BuildKey: build}
	del := db.OrderRowsDeleteParams{BuildKey: build}
	var shipped []uuid.UUID
	for _, c := range changes {
		var m Model
		if c.Model != nil {
			if err := json.Unmarshal(c.Model, &m); err != nil {
				return fmt.Errorf("orders sink: model of order %s: %w", c.StreamID, err)
			}
		}
		if m.Status == "" { // purged, or not placed yet
			del.OrderIds = append(del.OrderIds, c.StreamID)
			continue
		}
		up.OrderIds = append(up.OrderIds, c.StreamID)
		up.Customers = append(up.Customers, m.Customer)
		up.Statuses = append(up.Statuses, m.Status)
		up.TotalsCents = append(up.TotalsCents, m.TotalCents)
		up.LastEventIds = append(up.LastEventIds, c.LastEventID)
		if m.Status == StatusShipped && !c.Replay {
			shipped = append(shipped, c.StreamID)
		}
	}
	q := p.queries(tx)
	if len(del.OrderIds) > 0 {
		if err := q.OrderRowsDelete(ctx, del); err != nil {
			return fmt.Errorf("orders sink: delete rows: %w", err)
		}
	}
	if len(up.OrderIds) > 0 {
		if err := q.OrderRowsUpsert(ctx, up); err != nil {
			return fmt.Errorf("orders sink: upsert rows: %w", err)
		}
	}
	if len(shipped) > 0 {
		if err := q.OrderNotificationsAdd(ctx, db.OrderNotificationsAddParams{OrderIds: shipped, Kind: NotifyShipped}); err != nil {
			return fmt.Errorf("orders sink: queue notifications: %w", err)
		}
	}
	return nil
}

// Promoted points the view orders at the promoted build's rows, in the transaction that
// promotes it (or, for the perspective's first build, registers it): readers see the old
// build's rows up to its commit and the new build's from then on, never a mix.
// CREATE OR REPLACE VIEW waits for the queries reading the view, and new readers wait for
// it, until that transaction commits; orders_view_point bounds the wait with a
// lock_timeout of 1s, after which the worker rolls back and tries again.
func (p *Perspective) Promoted(ctx context.Context, tx pgx.Tx, _ *worker.Build, to worker.Build) error {
	if err := p.queries(tx).OrdersViewPoint(ctx, to.Key); err != nil {
		return fmt.Errorf("orders sink: point the view at build %s: %w", to.Key, err)
	}
	return nil
}

// Retired deletes the rows of a retired build, RetireBatch rows per statement, until a
// statement finds none left: with two calls at once (the cleanup lease passing to another
// instance during one), a statement can delete fewer than RetireBatch while rows remain.
func (p *Perspective) Retired(ctx context.Context, dbtx worker.DBTX, b worker.Build) error {
	q := p.queries(dbtx)
	for {
		n, err := q.OrderRowsDeleteBuild(ctx, db.OrderRowsDeleteBuildParams{BuildKey: b.Key, BatchSize: RetireBatch})
		if err != nil {
			return fmt.Errorf("orders sink: delete the rows of retired build %s: %w", b.Key, err)
		}
		if n == 0 {
			return nil
		}
	}
}

var (
	_ worker.Perspective  = (*Perspective)(nil)
	_ worker.Versioned    = (*Perspective)(nil)
	_ worker.Sink         = (*Perspective)(nil)
	_ worker.Promoter     = (*Perspective)(nil)
	_ worker.Retirer      = (*Perspective)(nil)
	_ worker.BatchApplier = (*Perspective)(nil)
)
