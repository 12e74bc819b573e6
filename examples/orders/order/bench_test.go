package order_test

// BenchmarkSink: what the sink costs. The same backlog is drained, and the same late event
// rewound, by the perspective orders with its sink (sqlc upserts of order_rows in every
// commit) and by the same perspective without it, each on a database of its own.

import (
	"context"
	"encoding/json"
	"log/slog"
	"slices"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/examples/orders/order"
	"github.com/perspectives-go/perspectives/internal/pgtest"
	"github.com/perspectives-go/perspectives/worker"
)

// plainOrders is the perspective orders without its sink.
type plainOrders struct{ p *order.Perspective }

func (o plainOrders) Name() string { return o.p.Name() }
func (o plainOrders) Version() int { return o.p.Version() }
func (o plainOrders) Apply(ctx context.Context, m json.RawMessage, ev worker.Event) (json.RawMessage, error) {
	return o.p.Apply(ctx, m, ev)
}
func (o plainOrders) ApplyBatch(ctx context.Context, m json.RawMessage, evs []worker.Event) (json.RawMessage, error) {
	return o.p.ApplyBatch(ctx, m, evs)
}

// sinkBenchRuns alternates, run by run, which variant drains first.
var sinkBenchRuns int

const (
	sinkBenchOrders    = 4000 // orders of 25 events
	sinkBenchLongItems = 2000 // items of the long order, which the late events rewind
	sinkBenchLate      = 3    // late events per variant
)

// sinkVariant is one database and the perspective it runs.
type sinkVariant struct {
	name  string
	db    *pgtest.DB
	persp worker.Perspective
	late  []worker.Event // older than every event of the long order
}

func (v *sinkVariant) worker(b *testing.B) *worker.Worker {
	w, err := worker.New(v.db.Pool, worker.Config{Perspectives: []worker.Perspective{v.persp}, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(b, err)
	require.NoError(b, w.Start(context.Background()))
	return w
}

func BenchmarkSink(b *testing.B) {
	ctx := context.Background()
	long := uuid.New()
	variants := []*sinkVariant{
		{name: "sink", db: newDB(b), persp: order.New(1)},
		{name: "plain", db: newDB(b), persp: plainOrders{order.New(1)}},
	}
	for _, v := range variants {
		for range sinkBenchLate {
			v.late = append(v.late, order.ItemAddedEvent(long, 1))
			v.late[len(v.late)-1].ID = uuid.Must(uuid.NewV7())
		}
	}
	// The backlog, the same in both: each registers its perspective first, so that the
	// events are queued, and the worker starts on the whole backlog.
	var backlog []worker.Event
	for i := range sinkBenchOrders {
		id := uuid.New()
		backlog = append(backlog, order.PlacedEvent(id, "customer", int64(1000+i)))
		for range 23 {
			backlog = append(backlog, order.ItemAddedEvent(id, 100))
		}
		backlog = append(backlog, order.ShippedEvent(id))
	}
	backlog = append(backlog, order.PlacedEvent(long, "long", 1))
	for range sinkBenchLongItems {
		backlog = append(backlog, order.ItemAddedEvent(long, 1))
	}
	for i := range backlog {
		backlog[i].ID = uuid.Must(uuid.NewV7())
	}
	for _, v := range variants {
		w := v.worker(b)
		require.NoError(b, w.Stop(ctx))
		for i := 0; i < len(backlog); i += 1000 {
			require.NoError(b, worker.Append(ctx, v.db.Pool, backlog[i:min(i+1000, len(backlog))]...))
		}
	}

	b.ResetTimer()
	turn := slices.Clone(variants)
	if sinkBenchRuns%2 == 1 {
		slices.Reverse(turn)
	}
	sinkBenchRuns++
	rate := map[string]float64{}
	for _, v := range turn {
		start := time.Now()
		w := v.worker(b)
		for {
			var queued bool
			require.NoError(b, v.db.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM wh_perspective_events)`).Scan(&queued))
			if !queued {
				break
			}
			time.Sleep(5 * time.Millisecond)
		}
		rate[v.name] = float64(len(backlog)) / time.Since(start).Seconds()
		require.NoError(b, w.Stop(ctx))
	}
	// The late events, one variant after the other in turn, each on a worker of its own.
	workers := map[string]*worker.Worker{}
	for _, v := range variants {
		workers[v.name] = v.worker(b)
	}
	rewind := map[string][]float64{}
	for i := range sinkBenchLate {
		for _, v := range turn {
			start := time.Now()
			require.NoError(b, worker.Append(ctx, v.db.Pool, v.late[i]))
			wctx, cancel := context.WithTimeout(ctx, time.Minute)
			require.NoError(b, worker.WaitFor(wctx, v.db.Pool, order.Name, long, v.late[i].ID))
			cancel()
			rewind[v.name] = append(rewind[v.name], float64(time.Since(start).Microseconds())/1000)
		}
	}
	b.StopTimer()
	for _, w := range workers {
		require.NoError(b, w.Stop(ctx))
	}

	// Both ended with the same models, and the sink's table holds them.
	sinkRows := count(b, variants[0].db.Pool, `SELECT count(*) FROM orders`)
	require.Equal(b, sinkBenchOrders+1, sinkRows, "the view has every order")
	for _, id := range []uuid.UUID{long, backlog[0].StreamID} {
		a, ok, err := worker.LoadModel(ctx, variants[0].db.Pool, order.Name, id)
		require.NoError(b, err)
		require.True(b, ok)
		p, ok, err := worker.LoadModel(ctx, variants[1].db.Pool, order.Name, id)
		require.NoError(b, err)
		require.True(b, ok)
		require.JSONEq(b, string(p), string(a))
	}

	b.ReportMetric(rate["sink"], "sink-events/s")
	b.ReportMetric(rate["plain"], "plain-events/s")
	b.ReportMetric(rate["sink"]/rate["plain"], "sink/plain")
	s, p := median(rewind["sink"]), median(rewind["plain"])
	b.ReportMetric(s, "rewind-sink-ms")
	b.ReportMetric(p, "rewind-plain-ms")
	b.ReportMetric(s/p, "rewind-sink/plain")
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[len(s)/2]
}
