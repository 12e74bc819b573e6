package order_test

// The perspective and its sink against PostgreSQL, with workers: the view orders equals a
// function of the fold of the sorted events, through live application, a rewind, a purge,
// and a new version built beside the active one and promoted.

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/examples/orders/db"
	"github.com/perspectives-go/perspectives/examples/orders/order"
	appschema "github.com/perspectives-go/perspectives/examples/orders/schema"
	"github.com/perspectives-go/perspectives/internal/pgtest"
	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/worker"
)

// newDB is a fresh database of the test's own (the view orders is the database's, so
// tests that repoint it cannot share one) with the perspectives tables and the
// application's.
func newDB(t testing.TB) *pgtest.DB {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	d, err := pgtest.Create(ctx, "orders")
	require.NoError(t, err)
	t.Cleanup(d.Close)
	direct, err := pgxpool.New(ctx, d.DirectURL) // migrations need a direct connection
	require.NoError(t, err)
	defer direct.Close()
	require.NoError(t, appschema.Migrate(ctx, direct))
	return d
}

// startWorker starts a worker running version v of the perspective orders on d, with the
// Postgres locker; it is stopped when the test ends.
func startWorker(t *testing.T, d *pgtest.DB, v int, pageSize int) *worker.Worker {
	t.Helper()
	lk, err := locker.NewPostgres(d.Pool, locker.Options{})
	require.NoError(t, err)
	cfg := worker.Config{
		Perspectives:    []worker.Perspective{order.New(v)},
		Locker:          lk,
		PollInterval:    20 * time.Millisecond,
		CatchUpPageSize: pageSize,
		Logger:          slog.New(slog.DiscardHandler),
	}
	if d.DirectURL != d.URL {
		cfg.ListenConnect = func(ctx context.Context) (*pgx.Conn, error) { return pgx.Connect(ctx, d.DirectURL) }
	}
	w, err := worker.New(d.Pool, cfg)
	require.NoError(t, err)
	require.NoError(t, w.Start(context.Background()))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		require.NoError(t, w.Stop(ctx))
	})
	return w
}

// newIDs returns n UUIDv7 event IDs in ascending order.
func newIDs(n int) []uuid.UUID {
	ids := make([]uuid.UUID, n)
	for i := range ids {
		ids[i] = uuid.Must(uuid.NewV7())
	}
	slices.SortFunc(ids, func(a, b uuid.UUID) int { return bytes.Compare(a[:], b[:]) })
	return ids
}

// someOrders is the events of n orders, from a seeded generator: each placed, with up to
// three items, and some shipped or cancelled.
func someOrders(seed uint64, n int) []worker.Event {
	r := rand.New(rand.NewPCG(seed, 0))
	var evs []worker.Event
	for i := range n {
		id := uuid.New()
		evs = append(evs, order.PlacedEvent(id, fmt.Sprintf("customer-%d", i), 1000+r.Int64N(20000)))
		for range r.IntN(4) {
			evs = append(evs, order.ItemAddedEvent(id, 100+r.Int64N(5000)))
		}
		switch r.IntN(6) {
		case 0:
			evs = append(evs, order.ShippedEvent(id))
		case 1:
			evs = append(evs, order.CancelledEvent(id))
		}
	}
	return evs
}

func appendAll(t *testing.T, pool *pgxpool.Pool, evs []worker.Event) {
	t.Helper()
	for i := 0; i < len(evs); i += 500 {
		require.NoError(t, worker.Append(context.Background(), pool, evs[i:min(i+500, len(evs))]...))
	}
}

// expectedRows is what the view must show for version v after the events: for each
// placed order, the fold of its events sorted by ID, and the newest event's ID; by order ID.
func expectedRows(t *testing.T, v int, evs []worker.Event) []db.Order {
	t.Helper()
	sorted := slices.Clone(evs)
	slices.SortFunc(sorted, func(a, b worker.Event) int { return bytes.Compare(a.ID[:], b.ID[:]) })
	models := map[uuid.UUID]order.Model{}
	last := map[uuid.UUID]uuid.UUID{}
	for _, ev := range sorted {
		m, err := order.Fold(v, models[ev.StreamID], ev)
		require.NoError(t, err)
		models[ev.StreamID], last[ev.StreamID] = m, ev.ID
	}
	rows := []db.Order{}
	for id, m := range models {
		if m.Status != "" {
			rows = append(rows, db.Order{OrderID: id, Customer: m.Customer, Status: m.Status, TotalCents: m.TotalCents, LastEventID: last[id]})
		}
	}
	slices.SortFunc(rows, func(a, b db.Order) int { return bytes.Compare(a.OrderID[:], b.OrderID[:]) })
	return rows
}

// waitApplied waits until the last event of each order in evs is in the order's model.
func waitApplied(t *testing.T, pool *pgxpool.Pool, evs []worker.Event) {
	t.Helper()
	last := map[uuid.UUID]uuid.UUID{}
	for _, ev := range evs {
		last[ev.StreamID] = ev.ID
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for stream, id := range last {
		require.NoError(t, worker.WaitFor(ctx, pool, order.Name, stream, id))
	}
}

func view(t *testing.T, pool *pgxpool.Pool) []db.Order {
	t.Helper()
	rows, err := db.New(pool).OrdersList(context.Background())
	require.NoError(t, err)
	return rows
}

func count(t testing.TB, pool *pgxpool.Pool, sql string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, pool.QueryRow(context.Background(), sql, args...).Scan(&n))
	return n
}

// shippedOrders is the order IDs of the shipped rows, sorted.
func shippedOrders(rows []db.Order) []uuid.UUID {
	var ids []uuid.UUID
	for _, r := range rows {
		if r.Status == order.StatusShipped {
			ids = append(ids, r.OrderID)
		}
	}
	return ids
}

func notified(t *testing.T, pool *pgxpool.Pool) []uuid.UUID {
	t.Helper()
	rows, err := db.New(pool).OrderNotificationsList(context.Background())
	require.NoError(t, err)
	var ids []uuid.UUID
	for _, r := range rows {
		require.Equal(t, order.NotifyShipped, r.Kind)
		ids = append(ids, r.OrderID)
	}
	return ids
}

// The view follows the models in the transactions that commit them: after live
// application it equals the fold of the sorted events (and a shipped order is notified
// once); a late event's rewind fixes the row (a late shipping notifies nothing: it is
// replayed); a purge deletes the row.
func TestViewFollowsTheModels(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := newDB(t)
	w := startWorker(t, d, 1, 0)

	evs := someOrders(1, 40)
	appendAll(t, d.Pool, evs)
	waitApplied(t, d.Pool, evs)
	want := expectedRows(t, 1, evs)
	require.Len(t, want, 40)
	require.Equal(t, want, view(t, d.Pool), "the rows commit with the models: no wait after WaitFor")
	require.NotEmpty(t, shippedOrders(want))
	require.Equal(t, shippedOrders(want), notified(t, d.Pool), "each live shipping notified once")

	// Late events: each order's event IDs[1] is applied before IDs[0], which is older than
	// the pair's cursor when it arrives: a rewind replays the order's events in ID order.
	alice, bob := uuid.New(), uuid.New()
	late := []worker.Event{order.PlacedEvent(alice, "alice", 1000), order.PlacedEvent(bob, "bob", 2000)}
	for i, id := range newIDs(2) {
		late[i].ID = id
	}
	ids := newIDs(4)
	aliceItem, aliceLateItem := order.ItemAddedEvent(alice, 300), order.ItemAddedEvent(alice, 40)
	bobItem, bobLateShipped := order.ItemAddedEvent(bob, 500), order.ShippedEvent(bob)
	aliceLateItem.ID, bobLateShipped.ID, aliceItem.ID, bobItem.ID = ids[0], ids[1], ids[2], ids[3]
	require.NoError(t, worker.Append(ctx, d.Pool, late[0], late[1], aliceItem, bobItem))
	waitApplied(t, d.Pool, []worker.Event{aliceItem, bobItem})
	require.NoError(t, worker.Append(ctx, d.Pool, aliceLateItem, bobLateShipped)) // older than the cursors
	waitApplied(t, d.Pool, []worker.Event{aliceLateItem, bobLateShipped})
	evs = append(evs, late[0], late[1], aliceItem, bobItem, aliceLateItem, bobLateShipped)
	want = expectedRows(t, 1, evs)
	require.Equal(t, want, view(t, d.Pool), "the rewinds rewrote the rows")
	got := rowOf(t, view(t, d.Pool), alice)
	require.Equal(t, int64(1340), got.TotalCents, "alice's late item counted")
	require.Equal(t, aliceItem.ID, got.LastEventID, "the newest event stays the last")
	require.Equal(t, order.StatusShipped, rowOf(t, view(t, d.Pool), bob).Status, "bob's late shipping applied")
	require.False(t, slices.Contains(notified(t, d.Pool), bob), "a late shipping is applied by a rewind: replayed, not notified")

	// A purge deletes the model and the row in one transaction.
	require.NoError(t, w.Purge(ctx, alice, order.Name))
	_, ok, err := worker.LoadModel(ctx, d.Pool, order.Name, alice)
	require.NoError(t, err)
	require.False(t, ok)
	require.Zero(t, count(t, d.Pool, `SELECT count(*) FROM order_rows WHERE order_id = $1`, alice), "the purged order's row")
	want = slices.DeleteFunc(want, func(r db.Order) bool { return r.OrderID == alice })
	require.Equal(t, want, view(t, d.Pool))
	require.Equal(t, len(want), count(t, d.Pool, `SELECT count(*) FROM order_rows`), "one build: every row is in the view")
}

func rowOf(t *testing.T, rows []db.Order, id uuid.UUID) db.Order {
	t.Helper()
	i := slices.IndexFunc(rows, func(r db.Order) bool { return r.OrderID == id })
	require.GreaterOrEqual(t, i, 0, "order %s in the view", id)
	return rows[i]
}

// Version 2 builds its rows beside version 1's while a reader samples the view
// continuously: the reader sees version 1's complete rows until the promotion and version
// 2's complete rows after it, never a mix, never an empty view, though version 2's partial
// rows are in the table meanwhile. The catch-up notifies nothing (an order whose shipping
// arrived late and was never notified stays so). Once the retired build is cleaned up,
// its rows are gone.
func TestNewVersionBuildsBesideTheOldAndTheViewSwitchesAtPromotion(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := newDB(t)
	startWorker(t, d, 1, 0)
	evs := someOrders(2, 300)
	appendAll(t, d.Pool, evs)
	waitApplied(t, d.Pool, evs)
	require.Equal(t, shippedOrders(expectedRows(t, 1, evs)), notified(t, d.Pool))

	// An order shipped by a late event: the rewind notifies nothing, and neither must
	// version 2's catch-up, which replays it among the history.
	carol := uuid.New()
	ids := newIDs(3)
	carolEvs := []worker.Event{order.PlacedEvent(carol, "carol", 9000), order.ShippedEvent(carol), order.ItemAddedEvent(carol, 100)}
	for i := range carolEvs {
		carolEvs[i].ID = ids[i]
	}
	require.NoError(t, worker.Append(ctx, d.Pool, carolEvs[0], carolEvs[2]))
	waitApplied(t, d.Pool, carolEvs[2:])
	require.NoError(t, worker.Append(ctx, d.Pool, carolEvs[1])) // late
	waitApplied(t, d.Pool, carolEvs[1:2])
	evs = append(evs, carolEvs...)
	v1, v2 := expectedRows(t, 1, evs), expectedRows(t, 2, evs)
	require.NotEqual(t, v1, v2)
	require.Equal(t, v1, view(t, d.Pool))
	notifiedBefore := notified(t, d.Pool)
	require.False(t, slices.Contains(notifiedBefore, carol), "carol's late shipping notified")

	const v2Key = "orders@v2.1"
	var mu sync.Mutex
	var samples, sawV1, sawV2, hidden int
	var problem string
	stop, done := make(chan struct{}), make(chan struct{})
	stopSampling := sync.OnceFunc(func() { close(stop); <-done })
	defer stopSampling()
	go func() {
		defer close(done)
		q := db.New(d.Pool)
		for {
			select {
			case <-stop:
				return
			default:
			}
			var building int
			err := d.Pool.QueryRow(ctx, `SELECT count(*) FROM order_rows WHERE build_key = $1`, v2Key).Scan(&building)
			var rows []db.Order
			if err == nil {
				rows, err = q.OrdersList(ctx)
			}
			mu.Lock()
			samples++
			switch {
			case err != nil:
				problem = err.Error()
			case slices.Equal(rows, v1) && sawV2 > 0:
				problem = "version 1's rows after version 2's"
			case slices.Equal(rows, v1):
				sawV1++
				if building > 0 && building < len(v2) {
					hidden++ // version 2's partial rows were in the table, not in the view
				}
			case slices.Equal(rows, v2):
				sawV2++
			default:
				problem = describe(rows, v1, v2)
			}
			stopped := problem != ""
			mu.Unlock()
			if stopped {
				return
			}
		}
	}()

	startWorker(t, d, 2, 100) // pages of 100 events: the build takes several
	pgtest.Eventually(t, 60*time.Second, "version 2 promoted and sampled", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return sawV2 >= 20 || problem != ""
	})
	stopSampling()
	require.Empty(t, problem, "after %d samples (%d of version 1, %d of version 2)", samples, sawV1, sawV2)
	require.Positive(t, sawV1, "sampled before the promotion")
	require.Positive(t, hidden, "sampled while version 2's rows were partial")
	t.Logf("%d samples: %d of version 1 (%d while version 2 was partial), %d of version 2", samples, sawV1, hidden, sawV2)
	require.Equal(t, notifiedBefore, notified(t, d.Pool), "the catch-up replays history: no notification, not even carol's")

	// Live events after the promotion reach version 2's rows.
	evs = append(evs, order.ItemAddedEvent(v2[0].OrderID, 1))
	require.NoError(t, worker.Append(ctx, d.Pool, evs[len(evs)-1:]...)) // gives it its ID
	waitApplied(t, d.Pool, evs[len(evs)-1:])
	v2 = expectedRows(t, 2, evs)
	require.Equal(t, v2, view(t, d.Pool))

	// The retired build's rows are deleted when it is cleaned up, its grace (30 s) passed.
	require.Equal(t, len(v1), count(t, d.Pool, `SELECT count(*) FROM order_rows WHERE build_key = $1`, order.Name))
	_, err := d.Pool.Exec(ctx, `UPDATE wh_perspective_builds SET retired_at = now() - interval '1 hour'
		WHERE build_key = $1 AND state = 'retired'`, order.Name)
	require.NoError(t, err)
	pgtest.Eventually(t, 30*time.Second, "the retired build cleaned up", func() bool {
		return count(t, d.Pool, `SELECT count(*) FROM wh_perspective_builds WHERE build_key = $1 AND cleaned_at IS NOT NULL`, order.Name) == 1
	})
	require.Zero(t, count(t, d.Pool, `SELECT count(*) FROM order_rows WHERE build_key = $1`, order.Name), "version 1's rows")
	require.Equal(t, v2, view(t, d.Pool), "version 2's rows stay")
	require.Equal(t, len(v2), count(t, d.Pool, `SELECT count(*) FROM order_rows`))
}

// describe says how a sample of the view differs from both versions' rows.
func describe(rows, v1, v2 []db.Order) string {
	byID := func(rs []db.Order) map[uuid.UUID]db.Order {
		m := map[uuid.UUID]db.Order{}
		for _, r := range rs {
			m[r.OrderID] = r
		}
		return m
	}
	m1, m2 := byID(v1), byID(v2)
	var of1, of2, neither int
	for _, r := range rows {
		switch r {
		case m1[r.OrderID]:
			of1++
		case m2[r.OrderID]:
			of2++
		default:
			neither++
		}
	}
	return fmt.Sprintf("a sample of %d rows (want %d): %d of version 1, %d of version 2, %d of neither",
		len(rows), len(v1), of1, of2, neither)
}
