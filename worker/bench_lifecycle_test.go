package worker_test

// The perspective lifecycle at scale, on a store of 1,000,000 events (20,000 streams × 50):
//
//   - registration: Start of a new perspective, while another goroutine appends one event
//     at a time; the slowest of those Appends; queue rows written by registration.
//   - catch-up throughput against a hand-written baseline measured in the same run: one SQL
//     pass that reads the store in (stream, event) order, folds each stream with the same
//     perspective code, and writes one model per stream in batches.
//   - blue/green: Append → v1 model latency while v2 builds over the store, against the
//     same latency with nothing building.

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/worker"
)

const (
	lifeStreams   = 20000
	lifePerStream = 50
	lifeEvents    = lifeStreams * lifePerStream
)

// lifeRun numbers the runs: each registers perspectives of its own.
var lifeRun int

// BenchmarkLifecycle reports registration, catch-up and blue/green figures (see above).
func BenchmarkLifecycle(b *testing.B) {
	ctx := context.Background()
	if benchClaim(b, "lifecycle") {
		start := time.Now()
		_, err := testDB.Pool.Exec(ctx, `INSERT INTO wh_event_store (event_id, stream_id, event_type, data)
			SELECT gen_random_uuid(), s.id, 'amount', jsonb_build_object('n', e.n)
			FROM (SELECT gen_random_uuid() AS id FROM generate_series(1, $1)) s
			CROSS JOIN generate_series(1, $2) AS e(n)`, lifeStreams, lifePerStream)
		require.NoError(b, err)
		_, err = testDB.Pool.Exec(ctx, `VACUUM ANALYZE wh_event_store`)
		require.NoError(b, err)
		b.Logf("stored %d events in %s", lifeEvents, time.Since(start).Round(time.Millisecond))
	}
	for range b.N {
		lifeRun++
		name := fmt.Sprintf("bench_life_%d", lifeRun)

		// Registration under a steady trickle of Appends (to a stream of their own).
		live := uuid.New()
		var slowest atomic.Int64
		stop := make(chan struct{})
		var wg sync.WaitGroup
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				t0 := time.Now()
				require.NoError(b, worker.Append(ctx, testDB.Pool, amountEvent(live, uuid.Nil, 1)))
				if d := int64(time.Since(t0)); d > slowest.Load() {
					slowest.Store(d)
				}
				time.Sleep(2 * time.Millisecond)
			}
		}()
		time.Sleep(50 * time.Millisecond)
		slowest.Store(0)
		tracer := newStmtTracer()
		pool := testDB.Pool
		if os.Getenv("PERSPECTIVES_BENCH_VERBOSE") != "" {
			pool = benchPool(b, testDB.URL, tracer)
		}
		t0 := time.Now()
		v1 := benchStartOn(b, pool, worker.Config{Perspectives: []worker.Perspective{versioned(sumPerspective(name), 1)}, CatchUpPageSize: lifePage()})
		startTook := time.Since(t0)
		time.Sleep(100 * time.Millisecond)
		close(stop)
		wg.Wait()
		var queuedByRegistration int
		require.NoError(b, testDB.Pool.QueryRow(ctx, `SELECT count(*) FROM wh_perspective_events
			WHERE perspective_name = $1 AND stream_id <> $2`, name, live).Scan(&queuedByRegistration))
		b.ReportMetric(ms(startTook), "register-start-ms")
		b.ReportMetric(ms(time.Duration(slowest.Load())), "register-append-max-ms")
		b.ReportMetric(float64(queuedByRegistration), "register-queue-rows")

		// Catch-up of v1 over the store, from its registration (a new perspective's first
		// build is active at once and fills as it goes).
		catchUp := lifeWaitCaughtUp(b, name, 1, t0)
		if os.Getenv("PERSPECTIVES_BENCH_VERBOSE") != "" {
			b.Logf("catch-up of %d events in %s, statements:\n%s", lifeEvents, catchUp, stmtReport(tracer.take()))
		}
		b.ReportMetric(float64(lifeEvents)/catchUp.Seconds(), "catchup-events/s")

		// The floor, on the same store, with the same perspective code.
		floor := lifeFloor(b, ctx, sumPerspective(name), name+"_floor")
		b.ReportMetric(float64(lifeEvents)/floor.Seconds(), "floor-events/s")
		b.ReportMetric(floor.Seconds()/catchUp.Seconds(), "catchup/floor")

		// Blue/green: live latency to v1 at idle, then while v2 builds.
		tracer.take()
		idle := lifeLatencies(b, name, live, 15, nil)
		idleStmts := tracer.take()
		v2started := time.Now()
		v2 := benchStart(b, worker.Config{Perspectives: []worker.Perspective{versioned(sumPerspective(name), 2)}, ManualPromotion: true})
		building := lifeLatencies(b, name, live, 15, func() bool { return lifeCaughtUp(b, name, 2) })
		if os.Getenv("PERSPECTIVES_BENCH_VERBOSE") != "" {
			b.Logf("v1's statements, idle (%v ms):\n%s", idle, stmtReport(idleStmts))
			b.Logf("v1's statements while v2 builds (%v ms):\n%s", building, stmtReport(tracer.take()))
		}
		b.ReportMetric(medianOf(idle), "live-idle-p50-ms")
		b.ReportMetric(medianOf(building), "live-during-build-p50-ms")
		b.ReportMetric(medianOf(building)/medianOf(idle), "during-build/idle")
		b.ReportMetric(float64(len(building)), "samples-during-build")
		lifeWaitCaughtUp(b, name, 2, v2started)
		benchStop(b, v2)
		benchStop(b, v1)
	}
}

// versionedPerspective is p as version v of its name.
type versionedPerspective struct {
	worker.Perspective
	v int
}

func (p versionedPerspective) Version() int { return p.v }

func versioned(p worker.Perspective, v int) worker.Perspective { return versionedPerspective{p, v} }

func lifeCaughtUp(b testing.TB, name string, version int) bool {
	var done bool
	err := testDB.Pool.QueryRow(context.Background(), `SELECT catchup_done FROM wh_perspective_builds
		WHERE perspective_name = $1 AND version = $2 AND state <> 'retired'`, name, version).Scan(&done)
	require.NoError(b, err)
	return done
}

// lifeWaitCaughtUp waits for version's catch-up and returns how long it took from since
// (seen within 10 ms).
func lifeWaitCaughtUp(b testing.TB, name string, version int, since time.Time) time.Duration {
	benchWait(b, 10*time.Minute, 10*time.Millisecond, "catch-up", func() bool { return lifeCaughtUp(b, name, version) })
	return time.Since(since)
}

// lifeLatencies appends n events, one at a time at random phases, to stream and measures
// each from before Append to LoadModel showing it (the active version of name). It stops
// early when until reports true (nil: never).
func lifeLatencies(b testing.TB, name string, stream uuid.UUID, n int, until func() bool) []float64 {
	var out []float64
	for i := 0; i < n && (until == nil || !until()); i++ {
		time.Sleep(time.Duration(30+i%7*10) * time.Millisecond)
		have := benchCount(b, name, stream)
		t0 := time.Now()
		require.NoError(b, worker.Append(context.Background(), testDB.Pool, amountEvent(stream, uuid.Nil, 1)))
		seen := benchWaitCount(b, name, stream, have+1, time.Minute)
		out = append(out, ms(seen.Sub(t0)))
	}
	return out
}

// lifeFloor is the hand-written floor: one query reads the store in (stream, event) order,
// each stream is folded with persp, and its model is written in batches of 1000 streams (one
// multi-row statement each). It returns the time taken, and deletes what it wrote.
func lifeFloor(b testing.TB, ctx context.Context, persp worker.Perspective, key string) time.Duration {
	read, err := testDB.Pool.Acquire(ctx)
	require.NoError(b, err)
	defer read.Release()
	start := time.Now()
	rows, err := read.Query(ctx, `SELECT stream_id, event_id, event_type, data, created_at FROM wh_event_store ORDER BY stream_id, event_id`)
	require.NoError(b, err)
	var (
		streams []uuid.UUID
		models  [][]byte
		lasts   []uuid.UUID
		cur     uuid.UUID
		model   json.RawMessage
		last    uuid.UUID
	)
	flush := func() {
		_, err := testDB.Pool.Exec(ctx, `INSERT INTO wh_perspective_models (stream_id, perspective_name, model, last_event_id)
			SELECT unnest($1::uuid[]), $2, unnest($3::jsonb[]), unnest($4::uuid[])`, streams, key, models, lasts)
		require.NoError(b, err)
		streams, models, lasts = streams[:0], models[:0], lasts[:0]
	}
	end := func() {
		if model == nil {
			return
		}
		streams, models, lasts = append(streams, cur), append(models, []byte(model)), append(lasts, last)
		if len(streams) == 1000 {
			flush()
		}
	}
	for rows.Next() {
		var ev worker.Event
		var data []byte
		require.NoError(b, rows.Scan(&ev.StreamID, &ev.ID, &ev.Type, &data, &ev.CreatedAt))
		ev.Data = data
		if ev.StreamID != cur {
			end()
			cur, model = ev.StreamID, nil
		}
		model, err = persp.Apply(ctx, model, ev)
		require.NoError(b, err)
		last = ev.ID
	}
	require.NoError(b, rows.Err())
	end()
	if len(streams) > 0 {
		flush()
	}
	took := time.Since(start)
	_, err = testDB.Pool.Exec(ctx, `DELETE FROM wh_perspective_models WHERE perspective_name = $1`, key)
	require.NoError(b, err)
	return took
}

func lifePage() int {
	n, _ := strconv.Atoi(os.Getenv("PERSPECTIVES_BENCH_PAGE"))
	return n
}
