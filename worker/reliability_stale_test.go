package worker_test

// A statement of the normal path delayed between taking its snapshot and locking the
// cursor row (a backend descheduled under load) while another instance rewinds the pair.

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/db"
	"github.com/perspectives-go/perspectives/internal/pgq"
	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/worker"
)

// TestReliabilityNormalPathAfterConcurrentRewind widens one real window and checks that no
// event is lost through it.
//
// The normal path locks the cursor row with FOR UPDATE ... SKIP LOCKED. Under READ
// COMMITTED, a statement that finds the row changed by a transaction that committed after
// the statement's snapshot locks and returns the row's newest version, but rows it joined
// from other tables (not locked) stay as of its snapshot. If the model is read in the same
// statement, it can be older than the cursor it came with.
//
// The rig: on instance B's pool only, search_path puts public before pg_catalog, and a
// public.unnest(anyarray) waits on an advisory lock the test holds when called on behalf of
// the statement that locks the cursor rows (PairsLockForApply, whose wh_lock_cursors unnests
// the pairs before it locks their rows). So B's normal-path statement takes its snapshot,
// then waits (as a descheduled backend would) before it reaches the row lock. Meanwhile:
//
//	e2..e5 applied; e1 arrives late; B's statement starts (snapshot: model e2..e5)
//	instance R rewinds: model e1..e5, cursor still at e5 (version bumped), e1's row deleted; R releases
//	e6 arrives; B's statement resumes: cursor e5 (newest), model as of its snapshot
//
// B must not build on a model that lacks e1. Every event must end up in the model.
//
// Not parallel: it creates a function in the shared database, and its set-up needs the
// perspective's queue to hold only this test's rows.
func TestReliabilityNormalPathAfterConcurrentRewind(t *testing.T) {
	ctx := context.Background()
	name := uniqueName("reliab_stale")
	stream := uuid.New()
	ids := newIDs(t, 6)
	all := events(stream, ids)
	lockOpts := locker.Options{LockTimeout: 2 * time.Second, KeepAliveInterval: 500 * time.Millisecond}
	cfg := func() worker.Config {
		return worker.Config{
			Perspectives: []worker.Perspective{ledgerPerspective(name)},
			Locker:       newLocker(t, lockOpts), LockOptions: lockOpts,
			Snapshots:    worker.SnapshotOptions{Disabled: true},
			PollInterval: 10 * time.Millisecond, Logger: quietLogger(),
		}
	}

	// The gate. Advisory key: classid 0, objid key.
	key := int64(1_000_000 + rand.IntN(1_000_000))
	_, err := testDB.Pool.Exec(ctx, fmt.Sprintf(`CREATE FUNCTION public.unnest(a anyarray) RETURNS SETOF anyelement
		LANGUAGE plpgsql VOLATILE AS $f$
		BEGIN
			IF pg_catalog.current_query() LIKE '%%wh_lock_cursors(%%' THEN
				PERFORM pg_catalog.pg_advisory_lock_shared(%d);
				PERFORM pg_catalog.pg_advisory_unlock_shared(%d);
			END IF;
			RETURN QUERY SELECT pg_catalog.unnest(a);
		END $f$`, key, key))
	require.NoError(t, err)
	t.Cleanup(func() {
		_, err := testDB.Pool.Exec(context.Background(), `DROP FUNCTION public.unnest(anyarray)`)
		require.NoError(t, err)
	})
	gate, err := pgx.Connect(ctx, testDB.DirectURL) // a session advisory lock: no pooler
	require.NoError(t, err)
	defer gate.Close(ctx)

	// e2..e5 applied by a first instance, which then stops with the perspective's queue empty.
	first := startWorker(t, cfg())
	require.NoError(t, worker.Append(ctx, testDB.Pool, all[1:5]...))
	waitModel(t, ctx, name, stream, 4)
	q := pgq.New(testDB.Pool)
	eventually(t, 20*time.Second, "the perspective's backlog drained", func() bool {
		n, err := q.QueueCountFor(ctx, db.QueueCountForParams{PerspectiveName: name})
		require.NoError(t, err)
		return n == 0
	})
	require.NoError(t, first.Stop(ctx))

	// B, on the gated pool, starts its normal-path statement for the late e1, and waits.
	_, err = gate.Exec(ctx, `SELECT pg_advisory_lock($1)`, key)
	require.NoError(t, err)
	gateHeld := true
	defer func() {
		if gateHeld {
			_, _ = gate.Exec(context.Background(), `SELECT pg_advisory_unlock($1)`, key)
		}
	}()
	pcfg, err := pgxpool.ParseConfig(testDB.DirectURL) // the rig sets a session parameter: no pooler
	require.NoError(t, err)
	pcfg.ConnConfig.RuntimeParams["search_path"] = "public, pg_catalog"
	bPool, err := pgxpool.NewWithConfig(ctx, pcfg)
	require.NoError(t, err)
	t.Cleanup(bPool.Close) // after B's Stop (cleanups run last-registered first)
	b, err := worker.New(bPool, cfg())
	require.NoError(t, err)
	require.NoError(t, b.Start(ctx))
	t.Cleanup(func() {
		sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		require.NoError(t, b.Stop(sctx))
	})
	require.NoError(t, worker.Append(ctx, testDB.Pool, all[0])) // late
	eventually(t, 10*time.Second, "B's normal-path statement waiting at the gate (the rig needs wh_lock_cursors to unnest the pairs before it locks their rows)", func() bool {
		var waiting int
		require.NoError(t, testDB.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks
			WHERE locktype = 'advisory' AND NOT granted AND classid = 0 AND objid = $1`, key).Scan(&waiting))
		return waiting > 0
	})

	// R rewinds e1 (the cursor stays at e5), releases, stops.
	r := startWorker(t, cfg())
	eventually(t, 20*time.Second, "R's rewind", func() bool {
		m, _ := loadLedger(t, ctx, name, stream)
		return len(m.IDs) == 5 && len(queued(t, ctx, name, stream)) == 0
	})
	require.NoError(t, r.Stop(ctx))
	m, _ := loadLedger(t, ctx, name, stream)
	require.Equal(t, expectedLedger(t, all[:5]), m, "R's rewind applied e1")
	_, held, err := newLocker(t, lockOpts).Get(ctx, stream, name)
	require.NoError(t, err)
	require.False(t, held)

	// e6 arrives; B's statement resumes.
	require.NoError(t, worker.Append(ctx, testDB.Pool, all[5]))
	_, err = gate.Exec(ctx, `SELECT pg_advisory_unlock($1)`, key)
	require.NoError(t, err)
	gateHeld = false
	eventually(t, 20*time.Second, "B applying e6", func() bool { return len(queued(t, ctx, name, stream)) == 0 })

	m, _ = loadLedger(t, ctx, name, stream)
	require.Equal(t, expectedLedger(t, all), m,
		"every event is in the model; a model without %s means B built e6 on the model as of its statement's snapshot (before R's rewind) and the late event is lost for good", ids[0])
}
