package worker_test

// Maintenance once: the leader leases (worker/leader.go) against PostgreSQL. One instance of
// several runs the maintenance; a graceful stop hands it over at the others' next attempt; a
// lapsed lease fences its holder's writes; promotion holds the append lock's exclusive side
// for key lookups only. The takeover after a kill is in reliability_leader_test.go.

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/internal/pgtest"
	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/worker"
)

// leaderTracer records the statements run on a pool, by name (sqlc's "-- name: X" header;
// other statements by their first word: begin, commit, rollback), per connection in order.
type leaderTracer struct {
	mu     sync.Mutex
	byConn map[*pgx.Conn][]string
	counts map[string]int
}

func newLeaderTracer() *leaderTracer {
	return &leaderTracer{byConn: map[*pgx.Conn][]string{}, counts: map[string]int{}}
}

func (tr *leaderTracer) TraceQueryStart(ctx context.Context, conn *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	name := strings.ToLower(strings.Fields(data.SQL + " ?")[0])
	if rest, ok := strings.CutPrefix(data.SQL, "-- name: "); ok {
		name = strings.Fields(rest)[0]
	}
	tr.mu.Lock()
	defer tr.mu.Unlock()
	tr.byConn[conn] = append(tr.byConn[conn], name)
	tr.counts[name]++
	return ctx
}

func (tr *leaderTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// count is how many statements named name ran since the last reset.
func (tr *leaderTracer) count(name string) int {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	return tr.counts[name]
}

func (tr *leaderTracer) reset() {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	clear(tr.byConn)
	clear(tr.counts)
}

// tracedPool is a pool on d whose statements tr records.
func tracedPool(t *testing.T, d *pgtest.DB, tr *leaderTracer) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(d.URL)
	require.NoError(t, err)
	cfg.ConnConfig.Tracer = tr
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// leaderLockOptions renew the leases every 100 ms and let them last 30 s: a handover that
// waited for an expiry would take far longer than the tests wait.
var leaderLockOptions = locker.Options{LockTimeout: 30 * time.Second, KeepAliveInterval: 100 * time.Millisecond}

// leaseHolder is the instance holding the unexpired lease name (uuid.Nil: none).
func leaseHolder(t *testing.T, ctx context.Context, pool *pgxpool.Pool, name string) uuid.UUID {
	t.Helper()
	var holder uuid.UUID
	err := pool.QueryRow(ctx, `SELECT leader_id FROM wh_leader WHERE name = $1 AND expires_at > now()`, name).Scan(&holder)
	if err == pgx.ErrNoRows {
		return uuid.Nil
	}
	require.NoError(t, err)
	return holder
}

// buildState is the state of build key.
func buildState(t *testing.T, ctx context.Context, pool *pgxpool.Pool, key string) string {
	t.Helper()
	var state string
	require.NoError(t, pool.QueryRow(ctx, `SELECT state FROM wh_perspective_builds WHERE build_key = $1`, key).Scan(&state))
	return state
}

// Of two instances running the same perspective, only the one holding its leases runs the
// maintenance: the other looks for no retired build to clean, checks no promotion and
// fences nothing, while the leader does all of it (a rebuild is promoted).
func TestLeaderOnlyOneOfTwoInstancesRunsTheMaintenance(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := uniqueName("leader_one")
	trA, trB := newLeaderTracer(), newLeaderTracer()
	cfg := func() worker.Config {
		return worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(name)}, LockOptions: leaderLockOptions,
			PollInterval: 20 * time.Millisecond, Logger: quietLogger(), ListenConnect: directListen()}
	}
	a := startWorkerWith(t, tracedPool(t, testDB, trA), cfg())
	// Start's first attempt is bounded (KeepAliveInterval); under load A may take the leases
	// at its next one: B starts once A holds them.
	eventually(t, 10*time.Second, "the first to start holds the leases", func() bool {
		return leaseHolder(t, ctx, testDB.Pool, "cleanup:"+name) == a.InstanceID() &&
			leaseHolder(t, ctx, testDB.Pool, "promotion:"+name+"@v1") == a.InstanceID()
	})
	b := startWorkerWith(t, tracedPool(t, testDB, trB), cfg())
	require.Equal(t, a.InstanceID(), leaseHolder(t, ctx, testDB.Pool, "cleanup:"+name), "the first to start keeps them")
	require.Equal(t, a.InstanceID(), leaseHolder(t, ctx, testDB.Pool, "promotion:"+name+"@v1"))
	trA.reset()
	trB.reset()

	require.NoError(t, worker.Append(ctx, testDB.Pool, events(uuid.New(), newIDs(t, 3))...))
	admin, err := worker.NewAdmin(testDB.Pool, nil)
	require.NoError(t, err)
	rebuild, created, err := admin.RebuildPerspective(ctx, name)
	require.NoError(t, err)
	require.True(t, created)
	eventually(t, 20*time.Second, "the rebuild promoted", func() bool {
		return buildState(t, ctx, testDB.Pool, rebuild.Key) == worker.BuildActive
	})
	eventually(t, 20*time.Second, "the leader looks for retired builds to clean", func() bool {
		return trA.count("BuildsToClean") >= 10
	})

	require.Positive(t, trA.count("LeaderHold"), "the leader's maintenance writes are fenced")
	for _, stmt := range []string{"BuildsToClean", "BuildCleanupBatch", "BuildQueueAge", "RegisterLock"} {
		require.Zero(t, trB.count(stmt), "the other instance runs no maintenance statement %s", stmt)
	}
	// Its only fenced writes are the forgetting of gone instances: the instances lease is
	// shared by every instance of the database (the package's other tests' too), and B may win
	// it when another test's worker stops. Each forgetting is one fence and one delete.
	require.Equal(t, trB.count("InstancesForget"), trB.count("LeaderHold"),
		"the other instance fences no promotion or cleanup (LeaderHold only before InstancesForget)")
	require.Positive(t, trB.count("LeaderAttempt"), "it attempts the leases")
	require.Equal(t, a.InstanceID(), leaseHolder(t, ctx, testDB.Pool, "cleanup:"+name))
	require.NotEqual(t, b.InstanceID(), a.InstanceID())
}

// A graceful Stop resigns the leases: another instance takes them over at its next attempt
// (100 ms), not when they would have expired (30 s), and runs the maintenance from then on.
func TestLeaderHandoverOnStopIsImmediate(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := uniqueName("leader_stop")
	trB := newLeaderTracer()
	cfg := worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(name)}, LockOptions: leaderLockOptions,
		PollInterval: 20 * time.Millisecond, Logger: quietLogger(), ListenConnect: directListen()}
	a, err := worker.New(testDB.Pool, cfg)
	require.NoError(t, err)
	require.NoError(t, a.Start(ctx))
	lease := "cleanup:" + name
	eventually(t, 10*time.Second, "the first to start holds the lease", func() bool {
		return leaseHolder(t, ctx, testDB.Pool, lease) == a.InstanceID()
	})
	b := startWorkerWith(t, tracedPool(t, testDB, trB), cfg)
	require.Equal(t, a.InstanceID(), leaseHolder(t, ctx, testDB.Pool, lease))
	var expires time.Time
	require.NoError(t, testDB.Pool.QueryRow(ctx, `SELECT expires_at FROM wh_leader WHERE name = $1`, lease).Scan(&expires))
	require.Zero(t, trB.count("BuildsToClean"))

	stopped := time.Now()
	require.NoError(t, a.Stop(ctx))
	eventually(t, 10*time.Second, "the other instance holds the lease", func() bool {
		return leaseHolder(t, ctx, testDB.Pool, lease) == b.InstanceID()
	})
	var elected time.Time
	require.NoError(t, testDB.Pool.QueryRow(ctx, `SELECT elected_at FROM wh_leader WHERE name = $1`, lease).Scan(&elected))
	require.True(t, elected.Before(expires), "taken over before the resigned lease would have expired")
	require.Less(t, time.Since(stopped), 10*time.Second)
	eventually(t, 10*time.Second, "the new leader runs the cleanup", func() bool { return trB.count("BuildsToClean") > 0 })
}

// A maintenance write fenced by a lease commits only while its holder holds the lease
// unexpired: a lapsed lease, another holder's lease or no lease at all is refused with
// ErrNotLeader and nothing is written; the holder's own unexpired lease passes.
func TestLeaderFenceRefusesALapsedLease(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := isolatedDB(t)
	store := psStore(d)
	me, other := uuid.New(), uuid.New()
	setLease := func(name string, holder uuid.UUID, expiresIn string) {
		gsExec(t, ctx, d.Pool, `INSERT INTO wh_leader (name, leader_id, elected_at, expires_at)
			VALUES ($1, $2, now() - interval '1 minute', now() + $3::interval)
			ON CONFLICT (name) DO UPDATE SET leader_id = EXCLUDED.leader_id, expires_at = EXCLUDED.expires_at`, name, holder, expiresIn)
	}

	name, v1, v2 := psPromoteFixture(t, ctx, d, store)
	gsExec(t, ctx, d.Pool, `UPDATE wh_perspective_builds SET catchup_done = true, catchup_done_at = now() WHERE build_key = $1`, v2)
	lease := worker.LeaderLease{Name: "promotion:" + name + "@v2", Holder: me}
	for _, tc := range []struct {
		name   string
		holder uuid.UUID
		expiry string // from now
	}{
		{"lapsed", me, "-1 second"},
		{"another instance's", other, "30 seconds"},
	} {
		setLease(lease.Name, tc.holder, tc.expiry)
		ok, err := store.Promote(ctx, name, v2, false, lease)
		require.ErrorIs(t, err, worker.ErrNotLeader, tc.name)
		require.False(t, ok)
		require.Equal(t, worker.BuildBuilding, buildState(t, ctx, d.Pool, v2), "%s: not promoted", tc.name)
		require.Equal(t, worker.BuildActive, buildState(t, ctx, d.Pool, v1))
	}
	_, err := store.Promote(ctx, name, v2, false, worker.LeaderLease{Name: "promotion:none", Holder: me})
	require.ErrorIs(t, err, worker.ErrNotLeader, "no such lease")

	setLease(lease.Name, me, "30 seconds")
	ok, err := store.Promote(ctx, name, v2, false, lease)
	require.NoError(t, err)
	require.True(t, ok, "its own unexpired lease")
	require.Equal(t, worker.BuildActive, buildState(t, ctx, d.Pool, v2))

	// The cleanup of the retired build, once its grace has passed.
	gsExec(t, ctx, d.Pool, `UPDATE wh_perspective_builds SET retired_at = now() - interval '2 hours' WHERE build_key = $1`, v1)
	gsExec(t, ctx, d.Pool, `INSERT INTO wh_perspective_cursors (stream_id, perspective_name) VALUES ($1, $2)`, uuid.New(), v1)
	cursors := func() int {
		var n int
		require.NoError(t, d.Pool.QueryRow(ctx, `SELECT count(*) FROM wh_perspective_cursors WHERE perspective_name = $1`, v1).Scan(&n))
		return n
	}
	clean := worker.LeaderLease{Name: "cleanup:" + name, Holder: me}
	setLease(clean.Name, me, "-1 second")
	_, err = store.Cleanup(ctx, []string{name}, time.Hour, 1000, clean)
	require.ErrorIs(t, err, worker.ErrNotLeader)
	require.Equal(t, 1, cursors(), "nothing deleted under a lapsed lease")
	setLease(clean.Name, me, "30 seconds")
	_, err = store.Cleanup(ctx, []string{name}, time.Hour, 1000, clean)
	require.NoError(t, err)
	require.Zero(t, cursors(), "deleted under its own unexpired lease")
}

// Promotion reads the queue (the two builds' oldest queued events) before it takes the
// append lock's exclusive side, and under it runs only key lookups and the flip: the fence,
// the builds of the perspective, the two state updates, the registration's epoch.
func TestPromotionHoldsTheExclusiveAppendLockForKeyLookupsOnly(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := isolatedDB(t)
	name, v1, v2 := psPromoteFixture(t, ctx, d, psStore(d))
	gsExec(t, ctx, d.Pool, `UPDATE wh_perspective_builds SET catchup_done = true, catchup_done_at = now() - interval '1 minute' WHERE build_key = $1`, v2)
	psQueuedSince(t, ctx, d, v2, "10 seconds")
	psQueuedSince(t, ctx, d, v1, "9.5 seconds")
	me := uuid.New()
	lease := worker.LeaderLease{Name: "promotion:" + name + "@v2", Holder: me}
	gsExec(t, ctx, d.Pool, `INSERT INTO wh_leader (name, leader_id, elected_at, expires_at) VALUES ($1, $2, now(), now() + interval '30 seconds')`,
		lease.Name, me)

	tr := newLeaderTracer()
	store := worker.NewPGStore(tracedPool(t, d, tr), psRetryBase, psRetryMax)
	ok, err := store.Promote(ctx, name, v2, false, lease)
	require.NoError(t, err)
	require.True(t, ok)

	tr.mu.Lock()
	defer tr.mu.Unlock()
	var locked []string // the statements of the transaction that took the exclusive side
	agesBefore := 0
	for _, stmts := range tr.byConn {
		seen := 0
		for i, s := range stmts {
			if s == "BuildQueueAge" {
				seen++
			}
			if s != "RegisterLock" {
				continue
			}
			agesBefore += seen
			for _, u := range stmts[i+1:] {
				if u == "commit" || u == "rollback" {
					break
				}
				locked = append(locked, u)
			}
		}
	}
	require.Equal(t, 2, agesBefore, "both queue ages read before the exclusive lock was taken")
	require.Equal(t, []string{"LeaderHold", "BuildsOf", "RegistrationBump", "BuildSetState", "BuildSetState"}, locked,
		"under the exclusive lock: the fence, the builds' key lookup, the flip and the registration's one-row update")
}
