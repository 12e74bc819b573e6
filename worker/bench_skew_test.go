package worker_test

// Skew and live traffic, each on a database created for the run, never analyzed
// (autovacuum's thresholds are not reached within a run), as a new user's would be:
//
//   - BenchmarkStarvation: one hot stream and 100 cold streams of one event each after it;
//     one default worker starts. The share of the hot stream applied when the last cold stream
//     is done (target: under 20%). queue: the hot stream queued by 2,000 separate Appends
//     (20,000 events). catchup: the hot stream's 200,000 events stored before the perspective
//     is registered, first in the catch-up's order; the worker registers it and catches up.
//   - BenchmarkLiveTraffic: 2,000 streams, 1,000 Appends of 20 events (one event for each of
//     20 streams; 10 rounds over all streams) while one default worker runs (snapshots on,
//     every 100 events): how long after the last Append returns the queue is empty (target:
//     ≤ 100 ms), and the snapshot rows written (target: no more than the pairs with at least
//     EveryNEvents events, here none).
//   - BenchmarkAppendCost: Append of one event against a one-statement baseline that does the
//     same writes (the event row and one queue row) by hand, interleaved, without a worker
//     (target: ≤ 1.5×); and Append while a worker listens and applies.

import (
	"context"
	"encoding/json"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/internal/pgq"
	"github.com/perspectives-go/perspectives/internal/pgtest"
	"github.com/perspectives-go/perspectives/worker"
)

// freshDB creates a migrated database, dropped when the benchmark function returns.
func freshDB(b *testing.B, prefix string) *pgtest.DB {
	b.Helper()
	d, err := pgtest.Create(context.Background(), prefix)
	require.NoError(b, err)
	b.Cleanup(d.Close)
	return d
}

// register starts a worker of cfg on pool, waits until its perspectives' first builds are
// active (caught up on the empty store) and stops it: Appends then queue events for them,
// applied by the queue path, and no worker runs.
func register(b *testing.B, pool *pgxpool.Pool, cfg worker.Config) {
	b.Helper()
	w := benchStartOn(b, pool, cfg)
	benchWait(b, time.Minute, 5*time.Millisecond, "the first builds to be active", func() bool {
		var pending int
		require.NoError(b, pool.QueryRow(context.Background(), `SELECT count(*)::int FROM wh_perspective_builds
			WHERE state <> 'active' OR NOT catchup_done`).Scan(&pending))
		return pending == 0
	})
	benchStop(b, w)
}

// activeModels counts the models of the named perspective's active version among streams,
// and returns the event count of the model of stream one (sumPerspective models).
func activeModels(b testing.TB, pool *pgxpool.Pool, name string, streams []uuid.UUID, one uuid.UUID) (done, oneCount int) {
	b.Helper()
	args := pgq.Args([]any{name, streams, one})
	require.NoError(b, pool.QueryRow(context.Background(), `
		SELECT (SELECT count(*) FROM wh_perspective_models m
		        WHERE m.perspective_name = a.build_key AND m.stream_id = ANY($2::uuid[]))::int,
		       COALESCE((SELECT (m.model->>'c')::int FROM wh_perspective_models m
		                 WHERE m.perspective_name = a.build_key AND m.stream_id = $3::uuid), 0)
		FROM wh_perspective_builds a
		WHERE a.perspective_name = $1 AND a.state = 'active'`, args...).Scan(&done, &oneCount))
	return done, oneCount
}

const (
	starveHotAppends  = 2000
	starvePerAppend   = 10
	starveHotEvents   = starveHotAppends * starvePerAppend
	starveColdStreams = 100
	starveStoredHot   = 200000 // the catch-up's hot stream
)

// BenchmarkStarvation reports, for a hot stream on the queue path (queue) and on a catch-up
// (catchup), the share (%) of the hot stream applied when the last of the cold streams after
// it was done, how long after the worker's start that was, and how long the whole backlog
// took.
func BenchmarkStarvation(b *testing.B) {
	b.Run("queue", benchStarvationQueue)
	b.Run("catchup", benchStarvationCatchUp)
}

// benchStarvationQueue: the hot stream queued by 2,000 separate Appends of 10 events, then
// one event for each of the cold streams; then one default worker starts.
func benchStarvationQueue(b *testing.B) {
	ctx := context.Background()
	var share, coldMs, allMs []float64
	for range b.N {
		d := freshDB(b, "starve")
		cfg := worker.Config{Perspectives: []worker.Perspective{sumPerspective("bench_starve")}}
		register(b, d.Pool, cfg)
		hot := uuid.New()
		for range starveHotAppends {
			require.NoError(b, worker.Append(ctx, d.Pool, events(hot, newIDs(b, starvePerAppend))...))
		}
		cold := appendCold(b, ctx, d.Pool)
		s, c, a := starve(b, d.Pool, cfg, hot, starveHotEvents, cold)
		share, coldMs, allMs = append(share, s), append(coldMs, c), append(allMs, a)
	}
	b.ReportMetric(medianOf(share), "hot-applied-at-cold-done-%")
	b.ReportMetric(medianOf(coldMs), "cold-done-ms")
	b.ReportMetric(medianOf(allMs), "all-done-ms")
}

// benchStarvationCatchUp: the hot stream's 200,000 events stored before the perspective is
// registered (so not queued), its ID before every other stream's in the catch-up's (stream,
// event) order, then one event for each of the cold streams; then one default worker
// registers the perspective, and its first build catches up with the store.
func benchStarvationCatchUp(b *testing.B) {
	ctx := context.Background()
	var share, coldMs, allMs []float64
	for range b.N {
		d := freshDB(b, "starvecatch")
		hot := uuid.UUID{15: 1} // first in the catch-up's order
		for left := starveStoredHot; left > 0; left -= 1000 {
			require.NoError(b, worker.Append(ctx, d.Pool, events(hot, newIDs(b, min(left, 1000)))...))
		}
		cold := appendCold(b, ctx, d.Pool)
		var queued int
		require.NoError(b, d.Pool.QueryRow(ctx, `SELECT count(*)::int FROM wh_perspective_events`).Scan(&queued))
		require.Zero(b, queued, "no perspective is registered: nothing is queued")
		cfg := worker.Config{Perspectives: []worker.Perspective{sumPerspective("bench_starve")}}
		s, c, a := starve(b, d.Pool, cfg, hot, starveStoredHot, cold)
		share, coldMs, allMs = append(share, s), append(coldMs, c), append(allMs, a)
	}
	b.ReportMetric(medianOf(share), "hot-applied-at-cold-done-%")
	b.ReportMetric(medianOf(coldMs), "cold-done-ms")
	b.ReportMetric(medianOf(allMs), "all-done-ms")
}

// appendCold appends one event for each of the cold streams.
func appendCold(b *testing.B, ctx context.Context, pool *pgxpool.Pool) []uuid.UUID {
	b.Helper()
	cold := make([]uuid.UUID, starveColdStreams)
	for i := range cold {
		cold[i] = uuid.New()
		require.NoError(b, worker.Append(ctx, pool, events(cold[i], newIDs(b, 1))...))
	}
	return cold
}

// starve starts a worker of cfg and returns the share (%) of the hot stream's events applied
// when every cold stream had its model, when that was and when the hot stream had all its
// events applied (ms from the start).
func starve(b *testing.B, pool *pgxpool.Pool, cfg worker.Config, hot uuid.UUID, hotEvents int, cold []uuid.UUID) (share, coldMs, allMs float64) {
	b.Helper()
	start := time.Now()
	w := benchStartOn(b, pool, cfg)
	coldDone := false
	benchWait(b, 2*time.Minute, 2*time.Millisecond, "the backlog to be applied", func() bool {
		done, hotApplied := activeModels(b, pool, "bench_starve", cold, hot)
		if !coldDone && done == len(cold) {
			coldDone = true
			share = 100 * float64(hotApplied) / float64(hotEvents)
			coldMs = ms(time.Since(start))
		}
		return coldDone && hotApplied == hotEvents
	})
	allMs = ms(time.Since(start))
	benchStop(b, w)
	return share, coldMs, allMs
}

const (
	liveStreams   = 2000
	livePerAppend = 20
	liveRounds    = 10
)

// BenchmarkLiveTraffic reports how long the Appends took, how long after the last one
// returned the queue was empty, the events per second over the whole run, and the snapshot
// rows against the pairs that have at least EveryNEvents events.
func BenchmarkLiveTraffic(b *testing.B) {
	ctx := context.Background()
	var appendMs, lagMs, rate, snaps, snapBound []float64
	for range b.N {
		d := freshDB(b, "live")
		cfg := worker.Config{Perspectives: []worker.Perspective{sumPerspective("bench_live")}}
		w := benchStartOn(b, d.Pool, cfg)
		streams := make([]uuid.UUID, liveStreams)
		for i := range streams {
			streams[i] = uuid.New()
		}
		start := time.Now()
		for round := range liveRounds {
			for first := 0; first < liveStreams; first += livePerAppend {
				evs := make([]worker.Event, livePerAppend)
				for i := range evs {
					evs[i] = amountEvent(streams[first+i], uuid.Nil, round+1)
				}
				require.NoError(b, worker.Append(ctx, d.Pool, evs...))
			}
		}
		appended := time.Now()
		benchWait(b, 2*time.Minute, time.Millisecond, "the queue to be empty", func() bool {
			var queued bool
			require.NoError(b, d.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM wh_perspective_events)`).Scan(&queued))
			return !queued
		})
		drained := time.Now()
		benchStop(b, w)
		appendMs = append(appendMs, ms(appended.Sub(start)))
		lagMs = append(lagMs, ms(drained.Sub(appended)))
		rate = append(rate, float64(liveStreams*liveRounds)/drained.Sub(start).Seconds())
		var n, bound int
		require.NoError(b, d.Pool.QueryRow(ctx, `SELECT count(*)::int FROM wh_perspective_snapshots`).Scan(&n))
		require.NoError(b, d.Pool.QueryRow(ctx, `SELECT count(*)::int FROM (
			SELECT stream_id FROM wh_event_store GROUP BY stream_id HAVING count(*) >= $1) s`,
			worker.DefaultSnapshotEveryNEvents).Scan(&bound))
		snaps, snapBound = append(snaps, float64(n)), append(snapBound, float64(bound))
		done, _ := activeModels(b, d.Pool, "bench_live", streams, streams[0])
		require.Equal(b, liveStreams, done, "every stream has its model")
	}
	b.ReportMetric(medianOf(appendMs), "live-appends-ms")
	b.ReportMetric(medianOf(lagMs), "live-empty-after-ms")
	b.ReportMetric(medianOf(rate), "live-events/s")
	b.ReportMetric(medianOf(snaps), "live-snapshot-rows")
	b.ReportMetric(medianOf(snapBound), "live-pairs-over-every-n")
}

const (
	appendCostRounds  = 20
	appendCostPerTurn = 50
	appendCostStreams = 100
)

// floorAppend is the least one Append of one event must write, by hand, in one statement:
// the event row and its queue row.
const floorAppend = `WITH ev AS (
	INSERT INTO wh_event_store (event_id, stream_id, event_type, data)
	VALUES ($1, $2, $3, $4::jsonb)
	RETURNING event_id, stream_id
)
INSERT INTO wh_perspective_events (stream_id, perspective_name, event_id)
SELECT ev.stream_id, $5, ev.event_id FROM ev`

// BenchmarkAppendCost reports the median latency (µs) of Append of one event and of the
// floor statement, called in alternating turns on streams that have events already, and
// their ratio; then the median Append while a default worker listens and applies.
func BenchmarkAppendCost(b *testing.B) {
	ctx := context.Background()
	var appendUs, floorUs, ratio, listeningUs []float64
	for range b.N {
		d := freshDB(b, "appendcost")
		cfg := worker.Config{Perspectives: []worker.Perspective{sumPerspective("bench_append")}}
		register(b, d.Pool, cfg)
		streams := make([]uuid.UUID, appendCostStreams)
		for i := range streams {
			streams[i] = uuid.New()
			require.NoError(b, worker.Append(ctx, d.Pool, amountEvent(streams[i], uuid.Nil, 1)))
		}
		var buildKey string
		require.NoError(b, d.Pool.QueryRow(ctx, `SELECT build_key FROM wh_perspective_builds
			WHERE perspective_name = 'bench_append' AND state = 'active'`).Scan(&buildKey))
		data := json.RawMessage(`{"n":1}`)
		var app, flo []float64
		k := 0
		for round := range appendCostRounds {
			for turn := range 2 {
				for range appendCostPerTurn {
					s := streams[k%len(streams)]
					k++
					t0 := time.Now()
					if (turn+round)%2 == 0 {
						require.NoError(b, worker.Append(ctx, d.Pool, worker.Event{StreamID: s, Type: "amount", Data: data}))
						app = append(app, float64(time.Since(t0).Microseconds()))
					} else {
						id, err := uuid.NewV7()
						require.NoError(b, err)
						_, err = d.Pool.Exec(ctx, floorAppend, id, s, "amount", string(data), buildKey)
						require.NoError(b, err)
						flo = append(flo, float64(time.Since(t0).Microseconds()))
					}
				}
			}
		}
		appendUs, floorUs = append(appendUs, medianOf(app)), append(floorUs, medianOf(flo))
		ratio = append(ratio, medianOf(app)/medianOf(flo))

		w := benchStartOn(b, d.Pool, cfg)
		var lis []float64
		for i := range appendCostRounds * appendCostPerTurn {
			t0 := time.Now()
			require.NoError(b, worker.Append(ctx, d.Pool, worker.Event{StreamID: streams[i%len(streams)], Type: "amount", Data: data}))
			lis = append(lis, float64(time.Since(t0).Microseconds()))
		}
		listeningUs = append(listeningUs, medianOf(lis))
		benchStop(b, w)
	}
	b.ReportMetric(medianOf(appendUs), "append-p50-us")
	b.ReportMetric(medianOf(floorUs), "floor-p50-us")
	b.ReportMetric(medianOf(ratio), "append/floor")
	b.ReportMetric(medianOf(listeningUs), "append-listening-p50-us")
}

// BenchmarkHotStreamInstances: four workers (in this process) while four goroutines append
// 2,000 one-event Appends to one hot stream and one event to each of 500 cold streams,
// interleaved. Every Append to the backlogged hot stream names its group's old due time
// (wh_append), so each notification moves every worker's next claim back to it
// (BENCHMARKS.md, section BenchmarkHotStreamInstances): the cost shows as the queue's drain after the last Append.
func BenchmarkHotStreamInstances(b *testing.B) {
	ctx := context.Background()
	var emptyAfter, total, coldDone []float64
	for range b.N {
		d := freshDB(b, "hotinst")
		cfg := worker.Config{Perspectives: []worker.Perspective{sumPerspective("bench_hot_inst")}}
		register(b, d.Pool, cfg)
		var ws []*worker.Worker
		for range 4 {
			ws = append(ws, benchStartOn(b, d.Pool, cfg))
		}
		hot := uuid.New()
		cold := make([]uuid.UUID, 500)
		for i := range cold {
			cold[i] = uuid.New()
		}
		start := time.Now()
		var wg sync.WaitGroup
		for g := range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := g; i < 2000; i += 4 {
					require.NoError(b, worker.Append(ctx, d.Pool, events(hot, newIDs(b, 1))...))
					if i%4 == 0 {
						require.NoError(b, worker.Append(ctx, d.Pool, events(cold[i/4], newIDs(b, 1))...))
					}
				}
			}()
		}
		wg.Wait()
		appended := time.Now()
		cd := false
		benchWait(b, 2*time.Minute, 2*time.Millisecond, "drained", func() bool {
			var n int
			require.NoError(b, d.Pool.QueryRow(ctx, `SELECT count(*)::int FROM wh_perspective_events`).Scan(&n))
			done, _ := activeModels(b, d.Pool, "bench_hot_inst", cold, hot)
			if !cd && done == len(cold) {
				cd = true
				coldDone = append(coldDone, ms(time.Since(start)))
			}
			return n == 0
		})
		emptyAfter = append(emptyAfter, ms(time.Since(appended)))
		total = append(total, ms(time.Since(start)))
		for _, w := range ws {
			benchStop(b, w)
		}
	}
	b.ReportMetric(medianOf(emptyAfter), "empty-after-ms")
	b.ReportMetric(medianOf(total), "total-ms")
	b.ReportMetric(medianOf(coldDone), "cold-done-ms")
}
