package worker_test

// The drain against its floor: on a database created for the run, 4,000 streams × 50 events
// queued by Appends for a perspective whose model lists the IDs of its events, drained from
// the same restored backlog by one default worker, by the one-pass SQL floor (one statement
// in one transaction that folds every stream in SQL) and by the hand-written batched baseline
// of BenchmarkWorkerDrain, interleaved in a rotating order. Every drain must leave the same
// models, the right ones; the worker and the floor the same cursors, due rows and queue.

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/worker"
)

const (
	floorStreams   = 4000
	floorPerStream = 50
	floorEvents    = floorStreams * floorPerStream
	floorName      = "bench_floor"
	floorRounds    = 2 // rounds of every variant per run
)

// idsPerspective's model lists the IDs of the stream's "amount" events, in order: a model
// that grows with its stream, folded in SQL by the floor with jsonb_agg.
func idsPerspective(name string) worker.Perspective {
	return worker.JSONPerspective(name, func(m []string, ev worker.Event) ([]string, error) {
		if ev.Type == "amount" {
			m = append(m, ev.ID.String())
		}
		if m == nil {
			m = []string{}
		}
		return m, nil
	})
}

// floorDrain is the floor: in one transaction, one statement takes the perspective's queue
// rows (deleting them), reads their events from the store, folds each stream's model (the
// IDs of its "amount" events in ID order, after those of its model so far), and writes one
// model row and one cursor row per stream and deletes its due row, as the worker's commit
// and release do. No claim, lease, batching, snapshot or fencing.
const floorDrain = `-- name: FloorDrain
WITH taken AS (
    DELETE FROM wh_perspective_events q
    WHERE q.perspective_name = $1
    RETURNING q.stream_id, q.event_id
), folded AS (
    SELECT t.stream_id,
           COALESCE(jsonb_agg(t.event_id ORDER BY t.event_id) FILTER (WHERE e.event_type = 'amount'), '[]') AS ids,
           (array_agg(t.event_id ORDER BY t.event_id DESC))[1] AS last_event_id,
           count(*)::int AS n
    FROM taken t
    JOIN wh_event_store e ON e.event_id = t.event_id
    GROUP BY t.stream_id
), models AS (
    INSERT INTO wh_perspective_models (stream_id, perspective_name, model, last_event_id)
    SELECT f.stream_id, $1, COALESCE(m.model, '[]') || f.ids, f.last_event_id
    FROM folded f
    LEFT JOIN wh_perspective_models m ON m.stream_id = f.stream_id AND m.perspective_name = $1
    ON CONFLICT (stream_id, perspective_name) DO UPDATE
    SET model = EXCLUDED.model, last_event_id = EXCLUDED.last_event_id, updated_at = now()
), cursors AS (
    UPDATE wh_perspective_cursors c
    SET last_event_id = f.last_event_id, version = c.version + 1,
        events_since_snapshot = c.events_since_snapshot + f.n,
        status = 'ok', last_error = NULL, failed_event_id = NULL, failed_since = NULL, attempts = 0,
        updated_at = now()
    FROM folded f
    WHERE c.stream_id = f.stream_id AND c.perspective_name = $1
)
DELETE FROM wh_perspective_pairs d
USING folded f
WHERE d.stream_id = f.stream_id AND d.perspective_name = $1`

// drainFloor runs the floor on pool and returns the time from its BEGIN to its COMMIT.
func drainFloor(b *testing.B, ctx context.Context, pool *pgxpool.Pool, name string, streams int) time.Duration {
	b.Helper()
	b.StartTimer()
	start := time.Now()
	var pairs int64
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		tag, err := tx.Exec(ctx, floorDrain, name)
		pairs = tag.RowsAffected()
		return err
	})
	el := time.Since(start)
	b.StopTimer()
	require.NoError(b, err)
	require.EqualValues(b, streams, pairs, "the floor deleted a due row per stream")
	return el
}

// drainState is what a drain leaves: digests of the models and of the cursors (what the
// worker's commit writes, without the version and the times), and the rows left in the
// queue, the due rows and the snapshots.
type drainState struct {
	models, cursors         string
	queue, pairs, snapshots int
}

func readDrainState(b *testing.B, ctx context.Context, pool *pgxpool.Pool) drainState {
	b.Helper()
	var s drainState
	require.NoError(b, pool.QueryRow(ctx, `SELECT
		(SELECT COALESCE(md5(string_agg(concat_ws(' ', m.stream_id, m.perspective_name, m.model, m.last_event_id), ','
		                                ORDER BY m.stream_id, m.perspective_name)), '')
		 FROM wh_perspective_models m),
		(SELECT COALESCE(md5(string_agg(concat_ws(' ', c.stream_id, c.perspective_name, c.last_event_id, c.events_since_snapshot,
		                                          c.status, c.last_error, c.attempts, c.failed_event_id, c.failed_since,
		                                          c.stream_lock_instance_id), ','
		                                ORDER BY c.stream_id, c.perspective_name)), '')
		 FROM wh_perspective_cursors c),
		(SELECT count(*) FROM wh_perspective_events)::int,
		(SELECT count(*) FROM wh_perspective_pairs)::int,
		(SELECT count(*) FROM wh_perspective_snapshots)::int`).Scan(&s.models, &s.cursors, &s.queue, &s.pairs, &s.snapshots))
	return s
}

// requireIDModels checks that every stream of the store has its model of name, listing
// its events' IDs in order, at its last event.
func requireIDModels(b *testing.B, ctx context.Context, pool *pgxpool.Pool, name string, streams int, variant string) {
	b.Helper()
	var models, right int
	require.NoError(b, pool.QueryRow(ctx, `SELECT
		(SELECT count(*) FROM wh_perspective_models WHERE perspective_name = $1)::int,
		(SELECT count(*) FROM wh_perspective_models m
		 JOIN (SELECT stream_id, jsonb_agg(event_id ORDER BY event_id) AS ids,
		              (array_agg(event_id ORDER BY event_id DESC))[1] AS last_event_id
		       FROM wh_event_store GROUP BY stream_id) s ON s.stream_id = m.stream_id
		 WHERE m.perspective_name = $1 AND m.model = s.ids AND m.last_event_id = s.last_event_id)::int`,
		name).Scan(&models, &right))
	require.Equal(b, streams, models, "%s: a model per stream", variant)
	require.Equal(b, streams, right, "%s: every model lists its stream's events in order", variant)
}

var floorVariants = []string{"worker", "floor", "baseline"}

var floorRound int

// BenchmarkDrainFloor reports the events per second of the default worker, of the one-pass
// SQL floor and of the hand-written baseline, each draining the same restored backlog of
// 4,000 streams × 50 events, and the worker's throughput over each of the others'.
//
// PERSPECTIVES_BENCH_VERBOSE=1 logs every drain's statements (count and time by name).
func BenchmarkDrainFloor(b *testing.B) {
	ctx := context.Background()
	b.StopTimer() // only the drains are timed
	verbose := os.Getenv("PERSPECTIVES_BENCH_VERBOSE") != ""
	tracer := newStmtTracer()
	rates, pgCores, goCores := map[string][]float64{}, map[string][]float64{}, map[string][]float64{}
	for range b.N {
		d := freshDB(b, "floor")
		backlog := drainBacklog{pool: d.Pool, persp: idsPerspective(floorName), events: floorEvents, saved: "bench_floor"}
		register(b, d.Pool, worker.Config{Perspectives: []worker.Perspective{backlog.persp}})
		appendBacklog(b, ctx, d.Pool, floorStreams, floorPerStream)
		backlog.save(b, ctx)
		pool := benchPool(b, d.URL, tracer)
		states := map[string]drainState{} // what each variant's last drain left
		for range floorRounds {
			for j := range floorVariants {
				v := floorVariants[(floorRound+j)%len(floorVariants)]
				backlog.reset(b, ctx)
				tracer.take()
				cpu := startCPU(b, d.Pool)
				var el time.Duration
				switch v {
				case "worker": // the defaults, PollInterval too
					el = backlog.drainWorker(b, ctx, pool, worker.Config{PollInterval: worker.DefaultPollInterval}, 1, nil)
				case "floor":
					el = drainFloor(b, ctx, pool, floorName, floorStreams)
				case "baseline":
					el = backlog.drainBaseline(b, ctx, pool)
				}
				pgCPU, goCPU := cpu.stop(b)
				st := tracer.take()
				rates[v] = append(rates[v], floorEvents/el.Seconds())
				pgCores[v] = append(pgCores[v], pgCPU/el.Seconds())
				goCores[v] = append(goCores[v], goCPU/el.Seconds())
				requireIDModels(b, ctx, d.Pool, floorName, floorStreams, v)
				states[v] = readDrainState(b, ctx, d.Pool)
				if verbose {
					fmt.Fprintf(os.Stderr, "%s: %.0f events/s in %s; server CPU %.2f cores, Go CPU %.2f cores; statements:\n%s",
						v, floorEvents/el.Seconds(), el, pgCPU/el.Seconds(), goCPU/el.Seconds(), stmtReport(st))
				}
			}
			floorRound++
		}
		ref := states["worker"]
		require.Zero(b, ref.queue, "the worker leaves no queue row")
		require.Equal(b, ref, states["floor"], "the floor leaves what the worker leaves")
		base := states["baseline"]
		require.Equal(b, ref.models, base.models, "the baseline leaves the worker's models")
		require.Equal(b, ref.cursors, base.cursors, "the baseline leaves the worker's cursors")
		require.Zero(b, base.queue, "the baseline leaves no queue row")
	}
	w, f, base := medianOf(rates["worker"]), medianOf(rates["floor"]), medianOf(rates["baseline"])
	b.ReportMetric(w, "worker-events/s")
	b.ReportMetric(f, "floor-events/s")
	b.ReportMetric(base, "baseline-events/s")
	b.ReportMetric(w/f, "worker/floor")
	b.ReportMetric(w/base, "worker/baseline")
	for _, v := range floorVariants {
		b.ReportMetric(medianOf(pgCores[v]), v+"-pg-cores")
		b.ReportMetric(medianOf(goCores[v]), v+"-go-cores")
	}
}
