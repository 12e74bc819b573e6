package worker_test

// Heartbeats (wh_instances), Admin.Instances, and the lag figures of BuildStatus (failing and
// parked pairs, live instances) and their gauges, against PostgreSQL.

import (
	"context"
	"encoding/json"
	"os"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"

	"github.com/perspectives-go/perspectives/db"
	"github.com/perspectives-go/perspectives/worker"
)

func newAdmin(t *testing.T) *worker.Admin {
	t.Helper()
	a, err := worker.NewAdmin(testDB.Pool, nil)
	require.NoError(t, err)
	return a
}

// instanceOf is the instance id as Admin.Instances reports it.
func instanceOf(t *testing.T, a *worker.Admin, id uuid.UUID) (worker.Instance, bool) {
	t.Helper()
	all, err := a.Instances(context.Background())
	require.NoError(t, err)
	for _, in := range all {
		if in.ID == id {
			return in, true
		}
	}
	return worker.Instance{}, false
}

// buildOf is the status of version of the perspective name (its newest build not retired).
func buildOf(t *testing.T, a *worker.Admin, name string, version int) worker.BuildStatus {
	t.Helper()
	v, err := a.Versions(context.Background())
	require.NoError(t, err)
	var out *worker.BuildStatus
	for i, b := range v.Builds {
		if b.Perspective == name && b.Version == version && b.State != worker.BuildRetired {
			out = &v.Builds[i]
		}
	}
	require.NotNil(t, out, "no build of %s version %d", name, version)
	return *out
}

func TestHeartbeatWrittenAtStartRefreshedAndDeletedAtStop(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	a := newAdmin(t)
	name, other := uniqueName("hb"), uniqueName("hb_v3")
	w, err := worker.New(testDB.Pool, worker.Config{
		Perspectives: []worker.Perspective{ledgerPerspective(name), newVLedger(other, 3)},
		Logger:       quietLogger(), PollInterval: 20 * time.Millisecond, ListenConnect: directListen(),
	})
	require.NoError(t, err)
	const every = 200 * time.Millisecond
	w.SetHeartbeatInterval(every)
	_, ok := instanceOf(t, a, w.InstanceID())
	require.False(t, ok, "no row before Start")

	require.NoError(t, w.Start(ctx))
	stopped := false
	defer func() {
		if !stopped {
			require.NoError(t, w.Stop(ctx))
		}
	}()
	first, ok := instanceOf(t, a, w.InstanceID())
	require.True(t, ok, "the row is written before Start returns")
	host, err := os.Hostname()
	require.NoError(t, err)
	require.Equal(t, host, first.Host)
	require.Equal(t, os.Getpid(), first.PID)
	require.Equal(t, every, first.HeartbeatInterval)
	require.True(t, first.Alive)
	require.Less(t, first.SinceSeen, 5*time.Second)
	require.Equal(t, []worker.PerspectiveVersion{{Name: name, Version: 1}, {Name: other, Version: 3}}, first.Perspectives)
	require.True(t, first.Runs(other, 3))
	require.False(t, first.Runs(other, 1))
	require.False(t, first.Started.After(first.LastSeen))

	// Refreshed every interval; started stays.
	eventually(t, 10*time.Second, "heartbeat refreshed", func() bool {
		in, ok := instanceOf(t, a, w.InstanceID())
		return ok && in.LastSeen.After(first.LastSeen) && in.Started.Equal(first.Started) && in.Alive
	})
	require.Equal(t, int64(1), buildOf(t, a, name, 1).LiveInstances)
	require.Equal(t, int64(1), buildOf(t, a, other, 3).LiveInstances)

	require.NoError(t, w.Stop(ctx))
	stopped = true
	_, ok = instanceOf(t, a, w.InstanceID())
	require.False(t, ok, "the row is deleted at Stop")
	require.Zero(t, buildOf(t, a, name, 1).LiveInstances)
}

// A heartbeat that waits on the instance's row while a deletion of it commits does not bring
// the row back. (Stop deletes the row after the last heartbeat returned; a heartbeat whose
// client gave up on it after heartbeatTimeout may still run on the server after that.) The
// next heartbeat of the running instance writes the row again.
func TestHeartbeatRunningAfterItsRowIsDeletedDoesNotBringItBack(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	a := newAdmin(t)
	w, err := worker.New(testDB.Pool, worker.Config{
		Perspectives: []worker.Perspective{ledgerPerspective(uniqueName("hb_gone"))},
		Logger:       quietLogger(), ListenConnect: directListen(),
	})
	require.NoError(t, err)
	w.SetHeartbeatInterval(time.Hour) // no periodic heartbeat: only the test's
	require.NoError(t, w.Start(ctx))
	t.Cleanup(func() { require.NoError(t, w.Stop(ctx)) })
	_, ok := instanceOf(t, a, w.InstanceID())
	require.True(t, ok, "the row is written at Start")

	tx, err := testDB.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, "DELETE FROM wh_instances WHERE instance_id = $1", w.InstanceID())
	require.NoError(t, err)
	beaten := make(chan struct{})
	go func() { defer close(beaten); w.BeatNow() }()
	eventually(t, 5*time.Second, "the heartbeat waits on the row the deletion holds", func() bool {
		var n int
		require.NoError(t, testDB.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%wh_instances%'`).Scan(&n))
		return n > 0
	})
	require.NoError(t, tx.Commit(ctx))
	<-beaten
	_, ok = instanceOf(t, a, w.InstanceID())
	require.False(t, ok, "the heartbeat did not bring the deleted row back")

	w.BeatNow()
	in, ok := instanceOf(t, a, w.InstanceID())
	require.True(t, ok, "the next heartbeat writes the running instance's row again")
	require.True(t, in.Alive)
}

// insertInstance writes an instance row as another process would have, last seen seenAgo
// before now on the database clock.
func insertInstance(t *testing.T, id uuid.UUID, host string, every, seenAgo time.Duration, name string, version int) {
	t.Helper()
	_, err := testDB.Pool.Exec(context.Background(), `
		INSERT INTO wh_instances (instance_id, host, pid, started_at, last_seen_at, heartbeat_interval, perspectives, versions)
		VALUES ($1, $2, 4242, now() - $3::interval - interval '1 hour', now() - $3::interval, $4::interval, ARRAY[$5::text], ARRAY[$6::int])`,
		id, host, seenAgo.String(), every.String(), name, version)
	require.NoError(t, err)
	t.Cleanup(func() {
		_, _ = testDB.Pool.Exec(context.Background(), `DELETE FROM wh_instances WHERE instance_id = $1`, id)
	})
}

func TestInstanceWithStaleHeartbeatIsGone(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	a := newAdmin(t)
	name := uniqueName("hb_stale")
	// Register the perspective, then stop its worker: only the rows below run it.
	w := startWorker(t, worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(name)}})
	require.NoError(t, w.Stop(ctx))
	require.Zero(t, buildOf(t, a, name, 1).LiveInstances)

	recent, stale, ancient := uuid.New(), uuid.New(), uuid.New()
	insertInstance(t, recent, "host-recent", 5*time.Second, 14*time.Second, name, 1) // < 3 intervals: alive
	insertInstance(t, stale, "host-stale", 5*time.Second, 16*time.Second, name, 1)   // > 3 intervals: gone
	insertInstance(t, ancient, "host-ancient", 5*time.Second, 25*time.Hour, name, 1) // forgotten at the next start

	in, ok := instanceOf(t, a, recent)
	require.True(t, ok)
	require.True(t, in.Alive, "last seen 14s ago at a 5s interval")
	in, ok = instanceOf(t, a, stale)
	require.True(t, ok)
	require.False(t, in.Alive, "last seen 16s ago at a 5s interval: gone")
	require.Equal(t, "host-stale", in.Host)
	require.Equal(t, 4242, in.PID)
	require.Equal(t, 5*time.Second, in.HeartbeatInterval)
	require.InDelta(t, 16*time.Second, in.SinceSeen, float64(5*time.Second), "judged on the database clock")
	require.Equal(t, []worker.PerspectiveVersion{{Name: name, Version: 1}}, in.Perspectives)
	require.Equal(t, int64(1), buildOf(t, a, name, 1).LiveInstances, "only the recent one is alive")

	_, err := testDB.Pool.Exec(ctx, `UPDATE wh_instances SET last_seen_at = now() - interval '20 seconds' WHERE instance_id = $1`, recent)
	require.NoError(t, err)
	in, _ = instanceOf(t, a, recent)
	require.False(t, in.Alive)
	require.Zero(t, buildOf(t, a, name, 1).LiveInstances, "no live instance runs it")

	// The holder of the instances lease forgets those gone for more than a day (the tests
	// running in parallel start instances too: any of them may hold it; one that starts takes
	// it when it is free).
	startWorker(t, worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(uniqueName("hb_forget"))}})
	eventually(t, 15*time.Second, "gone for 25 hours: forgotten", func() bool {
		_, ok := instanceOf(t, a, ancient)
		return !ok
	})
	_, ok = instanceOf(t, a, stale)
	require.True(t, ok, "gone for seconds: kept, shown gone")
}

func TestBuildStatusCountsFailingAndParkedPairs(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	a := newAdmin(t)
	m := newMetrics(t)
	name := uniqueName("st_parked")
	w := startWorker(t, worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(name)}, MeterProvider: m.mp})
	streams := []uuid.UUID{uuid.New(), uuid.New(), uuid.New(), uuid.New()}
	for _, s := range streams {
		require.NoError(t, worker.Append(ctx, testDB.Pool, events(s, newIDs(t, 2))...))
	}
	for _, s := range streams {
		waitModel(t, ctx, name, s, 2)
	}
	b := buildOf(t, a, name, 1)
	require.Zero(t, b.Failing)
	require.Zero(t, b.Parked)
	require.Equal(t, int64(1), b.LiveInstances)

	// Cursor states set as the failure policy leaves them (the set-up of another writer).
	setStatus := func(status string, ids ...uuid.UUID) {
		t.Helper()
		tag, err := testDB.Pool.Exec(ctx, `UPDATE wh_perspective_cursors SET status = $1, attempts = 3, last_error = 'boom'
			WHERE perspective_name = $2 AND stream_id = ANY($3::uuid[])`, status, name, uuidStrings(ids))
		require.NoError(t, err)
		require.Equal(t, int64(len(ids)), tag.RowsAffected())
	}
	setStatus("parked", streams[0], streams[1])
	setStatus("failed", streams[2])
	b = buildOf(t, a, name, 1)
	require.Equal(t, int64(2), b.Parked)
	require.Equal(t, int64(1), b.Failing)
	// (Not b.Queued: every Append of the tests running beside this one queues for this
	// perspective too.)

	set := []attribute.KeyValue{persp(name), attribute.Int("version", 1), attribute.String("state", worker.BuildActive)}
	parked, ok := m.gaugeInt("perspectives.pairs.parked", set...)
	require.True(t, ok)
	require.Equal(t, int64(2), parked)
	failing, ok := m.gaugeInt("perspectives.pairs.failing", set...)
	require.True(t, ok)
	require.Equal(t, int64(1), failing)
	live, ok := m.gaugeInt("perspectives.instances.live", set...)
	require.True(t, ok)
	require.Equal(t, int64(1), live)

	// Pairs that are ok again are not counted.
	setStatus("ok", streams[0], streams[2])
	b = buildOf(t, a, name, 1)
	require.Equal(t, int64(1), b.Parked)
	require.Zero(t, b.Failing)
	require.NoError(t, w.Stop(ctx))
	require.Zero(t, buildOf(t, a, name, 1).LiveInstances)
}

func uuidStrings(ids []uuid.UUID) []string {
	out := make([]string, len(ids))
	for i, id := range ids {
		out[i] = id.String()
	}
	return out
}

// BuildsStatus counts a build's failing and parked pairs through the partial index of the
// cursors that are not ok: a few index entries, not a scan of a large cursor table.
func TestBuildsStatusReadsOnlyCursorsThatAreNotOK(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := isolatedDB(t)
	name := uniqueName("st_plan")
	conn := planConnect(t, ctx, d)
	planExec(t, ctx, conn, `ALTER TABLE wh_perspective_cursors SET (autovacuum_enabled = false)`)
	planExec(t, ctx, conn, `INSERT INTO wh_perspectives (perspective_name) VALUES ($1)`, name)
	planExec(t, ctx, conn, `INSERT INTO wh_perspective_builds (build_key, perspective_name, version, build, state, catchup_done)
		VALUES ($1, $1, 1, 1, 'active', true)`, name)
	planExec(t, ctx, conn, `INSERT INTO wh_perspective_cursors (stream_id, perspective_name, status)
		SELECT gen_random_uuid(), $1, CASE WHEN g % 10000 = 0 THEN 'parked' WHEN g % 10000 = 1 THEN 'failed' ELSE 'ok' END
		FROM generate_series(1, 100000) g`, name)

	call := planRecord(t, func(q *db.Queries) error { _, err := q.BuildsStatus(ctx); return err })
	check := func(state string) {
		t.Helper()
		require.Empty(t, call.args, "no parameters: one plan")
		var out string
		require.NoError(t, conn.QueryRow(ctx, "EXPLAIN (FORMAT JSON) "+call.sql).Scan(&out))
		var doc []struct{ Plan map[string]any }
		require.NoError(t, json.Unmarshal([]byte(out), &doc))
		require.Len(t, doc, 1)
		plan := doc[0].Plan
		// Under jit_above_cost (100,000, the default): JIT-compiling it took half a second
		// once (a subquery per build over the instances).
		require.Less(t, plan["Total Cost"].(float64), 100000.0, "%s: estimated cost", state)
		{
			reads := 0
			planNodes(plan, func(n map[string]any, _ []string) {
				table, ok := planIsRead(n)
				if !ok || table != "wh_perspective_cursors" {
					return
				}
				reads++
				index, _, _, ok := planIndexOf(n)
				require.True(t, ok && index == "wh_perspective_cursors_failed_idx",
					"%s: %s reads the cursors; want the partial index of the cursors that are not ok:\n%s",
					state, planScan(n), planSummary(plan))
			})
			require.Equal(t, 1, reads, "%s: %s", state, planSummary(plan))
		}
	}
	check("never analyzed")
	planExec(t, ctx, conn, `ANALYZE wh_perspective_cursors`)
	check("analyzed")

	a, err := worker.NewAdmin(d.Pool, nil)
	require.NoError(t, err)
	v, err := a.Versions(ctx)
	require.NoError(t, err)
	require.Len(t, v.Builds, 1)
	require.Equal(t, int64(10), v.Builds[0].Parked)
	require.Equal(t, int64(10), v.Builds[0].Failing)
}

// A build's throughput is the sum of the rates its live instances reported with their last
// heartbeat; a gone instance's rate does not count. A worker's own heartbeat reports the
// events it applied.
func TestBuildStatusThroughputFromHeartbeats(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	a := newAdmin(t)
	name := uniqueName("st_rate")
	w, err := worker.New(testDB.Pool, worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(name)}, Logger: quietLogger()})
	require.NoError(t, err)
	w.SetHeartbeatInterval(200 * time.Millisecond)
	require.NoError(t, w.Start(ctx))
	t.Cleanup(func() { require.NoError(t, w.Stop(context.Background())) })
	stream := uuid.New()
	require.NoError(t, worker.Append(ctx, testDB.Pool, events(stream, newIDs(t, 3))...))
	waitModel(t, ctx, name, stream, 3)
	eventually(t, 10*time.Second, "the worker's heartbeat reports its rate", func() bool {
		return buildOf(t, a, name, 1).EventsPerSecond > 0
	})
	require.NoError(t, w.Stop(ctx)) // its row goes: only the rows below count

	insert := func(rate float64, seenAgo string) {
		t.Helper()
		_, err := testDB.Pool.Exec(ctx, `
			INSERT INTO wh_instances (instance_id, host, pid, last_seen_at, heartbeat_interval, perspectives, versions, rates)
			VALUES ($1, 'h', 1, now() - $2::interval, interval '5 seconds', ARRAY[$3::text, 'other'], ARRAY[1, 1], ARRAY[$4::float8, 99])`,
			uuid.New(), seenAgo, name, rate)
		require.NoError(t, err)
	}
	insert(3.5, "1 second")
	insert(1.5, "2 seconds")
	insert(100, "1 minute") // gone
	require.InDelta(t, 5.0, buildOf(t, a, name, 1).EventsPerSecond, 1e-9)
	instances, err := a.Instances(ctx)
	require.NoError(t, err)
	var rates []float64
	for _, in := range instances {
		if in.Runs(name, 1) && in.Alive && in.Host == "h" {
			require.Len(t, in.Rates, 2)
			rates = append(rates, in.Rates[0])
		}
	}
	require.ElementsMatch(t, []float64{3.5, 1.5}, rates)
}
