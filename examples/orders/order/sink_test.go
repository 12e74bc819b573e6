package order_test

// The sink's decisions, against a mock of the application's queries: no database.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"slices"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/examples/orders/db"
	"github.com/perspectives-go/perspectives/examples/orders/mocks"
	"github.com/perspectives-go/perspectives/examples/orders/order"
	"github.com/perspectives-go/perspectives/worker"
)

// recording is a mock of the queries whose writes succeed.
func recording() *mocks.QuerierMock {
	return &mocks.QuerierMock{
		OrderRowsUpsertFunc:       func(context.Context, db.OrderRowsUpsertParams) error { return nil },
		OrderRowsDeleteFunc:       func(context.Context, db.OrderRowsDeleteParams) error { return nil },
		OrderNotificationsAddFunc: func(context.Context, db.OrderNotificationsAddParams) error { return nil },
	}
}

func withMock(version int, m *mocks.QuerierMock) *order.Perspective {
	return order.NewWithQueries(version, func(db.DBTX) db.Querier { return m })
}

func modelJSON(t *testing.T, m order.Model) json.RawMessage {
	t.Helper()
	raw, err := json.Marshal(m)
	require.NoError(t, err)
	return raw
}

// sortedIDs returns n random order IDs in ascending order.
func sortedIDs(n int) []uuid.UUID {
	ids := make([]uuid.UUID, n)
	for i := range ids {
		ids[i] = uuid.New()
	}
	slices.SortFunc(ids, func(a, b uuid.UUID) int { return bytes.Compare(a[:], b[:]) })
	return ids
}

var buildV2 = worker.Build{Key: "orders@v2.1", Perspective: order.Name, Version: 2, N: 1}

// One Write: an upsert of the placed orders' rows, a delete of the purged order's row and of
// the order not placed yet, and a notification for the order shipped by a live change;
// each one statement for the batch, in order ID order, under the build's key.
func TestWriteUpsertsDeletesAndNotifiesInOneStatementEach(t *testing.T) {
	t.Parallel()
	ids := sortedIDs(5)
	last := sortedIDs(5)
	m := recording()
	changes := []worker.Change{ // not in ID order
		{StreamID: ids[3], Build: buildV2, Model: modelJSON(t, order.Model{Customer: "dave", Status: order.StatusShipped, TotalCents: 400}), LastEventID: last[3]},
		{StreamID: ids[1], Build: buildV2, Model: nil, LastEventID: uuid.Nil}, // purged
		{StreamID: ids[0], Build: buildV2, Model: modelJSON(t, order.Model{Customer: "alice", Status: order.StatusOpen, TotalCents: 100}), LastEventID: last[0]},
		{StreamID: ids[4], Build: buildV2, Model: modelJSON(t, order.Model{TotalCents: 50}), LastEventID: last[4]}, // an item, not placed yet
		{StreamID: ids[2], Build: buildV2, Model: modelJSON(t, order.Model{Customer: "carol", Status: order.StatusCancelled, TotalCents: 300}), LastEventID: last[2]},
	}
	require.NoError(t, withMock(2, m).Write(context.Background(), nil, changes))

	require.Equal(t, []db.OrderRowsUpsertParams{{
		BuildKey:     "orders@v2.1",
		OrderIds:     []uuid.UUID{ids[0], ids[2], ids[3]},
		Customers:    []string{"alice", "carol", "dave"},
		Statuses:     []string{order.StatusOpen, order.StatusCancelled, order.StatusShipped},
		TotalsCents:  []int64{100, 300, 400},
		LastEventIds: []uuid.UUID{last[0], last[2], last[3]},
	}}, upserts(m))
	require.Equal(t, []db.OrderRowsDeleteParams{{BuildKey: "orders@v2.1", OrderIds: []uuid.UUID{ids[1], ids[4]}}}, deletes(m))
	require.Equal(t, []db.OrderNotificationsAddParams{{OrderIds: []uuid.UUID{ids[3]}, Kind: order.NotifyShipped}}, notifications(m))
}

// A replayed change (a rewind, a catch-up, a rebuild) writes the row and queues no
// notification, even for a shipped order; the live changes of the same call still do.
func TestWriteOfAReplayedChangeQueuesNoNotification(t *testing.T) {
	t.Parallel()
	ids := sortedIDs(2)
	shipped := order.Model{Customer: "erin", Status: order.StatusShipped, TotalCents: 700}
	m := recording()
	require.NoError(t, withMock(1, m).Write(context.Background(), nil, []worker.Change{
		{StreamID: ids[0], Build: buildV2, Model: modelJSON(t, shipped), LastEventID: uuid.New(), Replay: true},
	}))
	require.Len(t, upserts(m), 1)
	require.Equal(t, []uuid.UUID{ids[0]}, upserts(m)[0].OrderIds)
	require.Empty(t, m.OrderNotificationsAddCalls(), "a replay notifies nothing")
	require.Empty(t, m.OrderRowsDeleteCalls())

	m = recording()
	require.NoError(t, withMock(1, m).Write(context.Background(), nil, []worker.Change{
		{StreamID: ids[0], Build: buildV2, Model: modelJSON(t, shipped), LastEventID: uuid.New(), Replay: true},
		{StreamID: ids[1], Build: buildV2, Model: modelJSON(t, shipped), LastEventID: uuid.New()},
	}))
	require.Equal(t, []db.OrderNotificationsAddParams{{OrderIds: []uuid.UUID{ids[1]}, Kind: order.NotifyShipped}}, notifications(m))
}

// A purge alone deletes and upserts nothing; an empty call sends nothing at all.
func TestWriteOfPurgesOnlyDeletes(t *testing.T) {
	t.Parallel()
	ids := sortedIDs(2)
	m := recording()
	p := withMock(1, m)
	require.NoError(t, p.Write(context.Background(), nil, nil))
	require.Zero(t, writes(m))
	require.NoError(t, p.Write(context.Background(), nil, []worker.Change{
		{StreamID: ids[1], Build: worker.Build{Key: order.Name}},
		{StreamID: ids[0], Build: worker.Build{Key: order.Name}},
	}))
	require.Equal(t, []db.OrderRowsDeleteParams{{BuildKey: order.Name, OrderIds: ids}}, deletes(m))
	require.Empty(t, m.OrderRowsUpsertCalls())
	require.Empty(t, m.OrderNotificationsAddCalls())
}

// A failing statement fails Write (the worker rolls its transaction back) and stops it:
// nothing after it is sent.
func TestWriteStopsAtAFailingStatement(t *testing.T) {
	t.Parallel()
	boom := errors.New("boom")
	m := recording()
	m.OrderRowsUpsertFunc = func(context.Context, db.OrderRowsUpsertParams) error { return boom }
	err := withMock(1, m).Write(context.Background(), nil, []worker.Change{
		{StreamID: uuid.New(), Build: buildV2, Model: modelJSON(t, order.Model{Customer: "f", Status: order.StatusShipped}), LastEventID: uuid.New()},
	})
	require.ErrorIs(t, err, boom)
	require.ErrorContains(t, err, "upsert rows")
	require.Empty(t, m.OrderNotificationsAddCalls(), "no notification for a row that was not written")
}

// A model that is not an order's fails Write, naming the order.
func TestWriteRefusesAModelItCannotDecode(t *testing.T) {
	t.Parallel()
	id := uuid.New()
	m := recording()
	err := withMock(1, m).Write(context.Background(), nil, []worker.Change{
		{StreamID: id, Build: buildV2, Model: json.RawMessage(`{"total_cents": "many"}`), LastEventID: uuid.New()},
	})
	require.ErrorContains(t, err, id.String())
	require.Zero(t, writes(m))
}

// Promoted points the view at the promoted build's key, whatever was active before.
func TestPromotedPointsTheViewAtTheNewBuild(t *testing.T) {
	t.Parallel()
	m := &mocks.QuerierMock{OrdersViewPointFunc: func(context.Context, string) error { return nil }}
	p := withMock(2, m)
	from := worker.Build{Key: order.Name, Perspective: order.Name, Version: 1, N: 1}
	require.NoError(t, p.Promoted(context.Background(), nil, &from, buildV2))
	require.NoError(t, p.Promoted(context.Background(), nil, nil, worker.Build{Key: "orders@v2.2"}))
	calls := m.OrdersViewPointCalls()
	require.Len(t, calls, 2)
	require.Equal(t, "orders@v2.1", calls[0].BuildKey)
	require.Equal(t, "orders@v2.2", calls[1].BuildKey)

	m.OrdersViewPointFunc = func(context.Context, string) error { return errors.New("lock timeout") }
	require.ErrorContains(t, p.Promoted(context.Background(), nil, nil, buildV2), "lock timeout", "the promotion rolls back")
}

// Retired deletes the build's rows in batches of RetireBatch until a batch deletes none (a
// short one may mean that another call deleted rows at the same time: rows may be left), and
// stops at an error.
func TestRetiredDeletesTheBuildsRowsInBoundedBatches(t *testing.T) {
	t.Parallel()
	deleted := []int64{order.RetireBatch, 7, order.RetireBatch, 0}
	m := &mocks.QuerierMock{}
	m.OrderRowsDeleteBuildFunc = func(context.Context, db.OrderRowsDeleteBuildParams) (int64, error) {
		return deleted[len(m.OrderRowsDeleteBuildCalls())-1], nil
	}
	retired := worker.Build{Key: order.Name, Perspective: order.Name, Version: 1, N: 1, State: worker.BuildRetired}
	require.NoError(t, withMock(2, m).Retired(context.Background(), nil, retired))
	calls := m.OrderRowsDeleteBuildCalls()
	require.Len(t, calls, 4)
	for _, c := range calls {
		require.Equal(t, db.OrderRowsDeleteBuildParams{BuildKey: order.Name, BatchSize: order.RetireBatch}, c.Arg)
	}

	m = &mocks.QuerierMock{OrderRowsDeleteBuildFunc: func(context.Context, db.OrderRowsDeleteBuildParams) (int64, error) {
		return 0, errors.New("connection reset")
	}}
	require.ErrorContains(t, withMock(2, m).Retired(context.Background(), nil, retired), "connection reset")
	require.Len(t, m.OrderRowsDeleteBuildCalls(), 1)
}

// Fold: version 1 totals the items, version 2 adds the shipping fee; an order is shipped
// or cancelled only while open; other events leave the model as it is.
func TestFold(t *testing.T) {
	t.Parallel()
	id := uuid.New()
	for _, tc := range []struct {
		name    string
		events  []worker.Event
		v1, v2  order.Model
		wantErr string
	}{
		{
			name:   "placed with items",
			events: []worker.Event{order.PlacedEvent(id, "alice", 1000), order.ItemAddedEvent(id, 250)},
			v1:     order.Model{Customer: "alice", Status: order.StatusOpen, TotalCents: 1250},
			v2:     order.Model{Customer: "alice", Status: order.StatusOpen, TotalCents: 1250 + order.ShippingFeeCents},
		},
		{
			name:   "shipped, then cancelled too late",
			events: []worker.Event{order.PlacedEvent(id, "bob", 500), order.ShippedEvent(id), order.CancelledEvent(id)},
			v1:     order.Model{Customer: "bob", Status: order.StatusShipped, TotalCents: 500},
			v2:     order.Model{Customer: "bob", Status: order.StatusShipped, TotalCents: 500 + order.ShippingFeeCents},
		},
		{
			name:   "cancelled, then shipped by mistake",
			events: []worker.Event{order.PlacedEvent(id, "carol", 500), order.CancelledEvent(id), order.ShippedEvent(id)},
			v1:     order.Model{Customer: "carol", Status: order.StatusCancelled, TotalCents: 500},
			v2:     order.Model{Customer: "carol", Status: order.StatusCancelled, TotalCents: 500 + order.ShippingFeeCents},
		},
		{
			name:   "not placed: no status, no fee",
			events: []worker.Event{order.ItemAddedEvent(id, 70), order.ShippedEvent(id)},
			v1:     order.Model{TotalCents: 70},
			v2:     order.Model{TotalCents: 70},
		},
		{
			name:   "an event of another type",
			events: []worker.Event{order.PlacedEvent(id, "dave", 10), {StreamID: id, Type: "PaymentReceived", Data: json.RawMessage(`{"x":1}`)}},
			v1:     order.Model{Customer: "dave", Status: order.StatusOpen, TotalCents: 10},
			v2:     order.Model{Customer: "dave", Status: order.StatusOpen, TotalCents: 10 + order.ShippingFeeCents},
		},
		{
			name:    "bad data",
			events:  []worker.Event{{StreamID: id, Type: order.TypeItemAdded, Data: json.RawMessage(`{"cents":"x"}`)}},
			wantErr: order.TypeItemAdded,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for v, want := range map[int]order.Model{1: tc.v1, 2: tc.v2} {
				var m order.Model
				var err error
				for _, ev := range tc.events {
					if m, err = order.Fold(v, m, ev); err != nil {
						break
					}
				}
				if tc.wantErr != "" {
					require.ErrorContains(t, err, tc.wantErr)
					continue
				}
				require.NoError(t, err)
				require.Equal(t, want, m, "version %d", v)
			}
		})
	}
}

func upserts(m *mocks.QuerierMock) []db.OrderRowsUpsertParams {
	var out []db.OrderRowsUpsertParams
	for _, c := range m.OrderRowsUpsertCalls() {
		out = append(out, c.Arg)
	}
	return out
}

func deletes(m *mocks.QuerierMock) []db.OrderRowsDeleteParams {
	var out []db.OrderRowsDeleteParams
	for _, c := range m.OrderRowsDeleteCalls() {
		out = append(out, c.Arg)
	}
	return out
}

func notifications(m *mocks.QuerierMock) []db.OrderNotificationsAddParams {
	var out []db.OrderNotificationsAddParams
	for _, c := range m.OrderNotificationsAddCalls() {
		out = append(out, c.Arg)
	}
	return out
}

// writes is how many writes m was asked for.
func writes(m *mocks.QuerierMock) int {
	return len(m.OrderRowsUpsertCalls()) + len(m.OrderRowsDeleteCalls()) + len(m.OrderNotificationsAddCalls())
}
