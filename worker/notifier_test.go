package worker_test

// The notifier: one LISTEN session per process and pool, shared by the worker's loop and
// every WaitFor, and no pool connection held by a waiting WaitFor.

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/internal/pgtest"
	"github.com/perspectives-go/perspectives/worker"
)

// appPool opens a pool on the database of d itself (not through a pooler, so that its
// sessions can LISTEN) whose sessions name themselves app in pg_stat_activity.
func appPool(t *testing.T, d *pgtest.DB, app string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(d.DirectURL)
	require.NoError(t, err)
	cfg.ConnConfig.RuntimeParams["application_name"] = app
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// listenPIDs are the server processes of the sessions named app whose last statement is a
// LISTEN on channel.
func listenPIDs(t *testing.T, ctx context.Context, app, channel string) []int32 {
	t.Helper()
	rows, err := testDB.Pool.Query(ctx,
		`SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND query ~ ('(^|\n)LISTEN ' || $2)`, app, channel)
	require.NoError(t, err)
	pids, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	require.NoError(t, err)
	return pids
}

// listenSessions counts the sessions named app whose last statement is a LISTEN: the
// notifier's, and each WaitFor that would LISTEN on a connection of its own.
func listenSessions(t *testing.T, ctx context.Context, app string) int {
	t.Helper()
	var n int
	require.NoError(t, testDB.Pool.QueryRow(ctx,
		`SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND query ~ '(^|\n)LISTEN '`, app).Scan(&n))
	return n
}

// 100 WaitFor calls wait at once with no pool connection held: their checks take one for
// a statement each (as the notifier's probe does), and they wait on the pool's notifier, one
// LISTEN session that is not a pool connection. No worker runs on their pool (the worker
// that applies the events runs on another), and on a database of its own no other test's
// commit makes them check: what the pool counts as acquired is theirs alone, and is 0 while
// all wait. They all return once
// the events are applied.
func TestWaitForWaitersHoldNoPoolConnection(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	d := isolatedDB(t)
	app := uniqueName("waiters")
	pool := appPool(t, d, app)
	name := uniqueName("waiters")
	const waiters = 100

	// The perspective registered, its worker stopped: nothing applies the events yet.
	w := startWorkerIn(t, d, worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(name)}})
	require.NoError(t, w.Stop(ctx))
	streams, ids := make([]uuid.UUID, waiters), newIDs(t, waiters)
	var evs []worker.Event
	for i := range streams {
		streams[i] = uuid.New()
		evs = append(evs, events(streams[i], ids[i:i+1])...)
	}
	require.NoError(t, worker.Append(ctx, d.Pool, evs...))

	var subscribed atomic.Int32
	res := make(chan error, waiters)
	for i := range waiters {
		go func() {
			res <- worker.WaitForWith(ctx, pool, name, streams[i], ids[i], worker.WaitOptions{
				Recheck: time.Hour, // only a notification ends the wait
				Checked: func(listening bool) {
					if listening {
						subscribed.Add(1)
					}
				},
			})
		}()
	}
	eventually(t, 30*time.Second, "every WaitFor subscribed and checked", func() bool {
		return subscribed.Load() == waiters
	})
	// The notifier sends its probe through the pool once its session is subscribed, which
	// may be just after the waiters' checks: a statement's connection, given back at once.
	eventually(t, 5*time.Second, "the pool's connections given back", func() bool {
		return pool.Stat().AcquiredConns() == 0
	})
	for range 20 {
		require.Zero(t, pool.Stat().AcquiredConns(), "a waiting WaitFor holds no pool connection")
		time.Sleep(5 * time.Millisecond)
	}
	require.Equal(t, 1, listenSessions(t, ctx, app), "one LISTEN session serves every WaitFor")
	require.Empty(t, res, "none returned before its event is applied")

	startWorkerIn(t, d, worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(name)}})
	for range waiters {
		select {
		case err := <-res:
			require.NoError(t, err)
		case <-time.After(time.Minute):
			t.Fatal("a WaitFor did not return within a minute of its event's worker starting")
		}
	}
	eventually(t, 10*time.Second, "the session closed with its last subscriber", func() bool {
		return listenSessions(t, ctx, app) == 0
	})
}

// The worker's loop and a WaitFor on the same pool share one LISTEN session: the worker's
// ListenConnect is called once, the session that LISTENs for the loop is the one that
// LISTENs for WaitFor when it arrives, WaitFor takes no pool connection while it waits, and
// both are woken by notifications through that session (the worker polls every hour,
// WaitFor re-checks every hour). On a database of its own: no other test's Append wakes the
// worker to claim, and no other test's commit makes the WaitFor check, on the pool whose
// connections it counts.
func TestNotifierServesTheLoopAndWaitForInOneSession(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	d := isolatedDB(t)
	app := uniqueName("shared")
	pool := appPool(t, d, app)
	name := uniqueName("shared")
	gated := newGated(name)
	var connects atomic.Int32
	startWorkerWith(t, pool, worker.Config{
		Perspectives: []worker.Perspective{gated},
		PollInterval: time.Hour,
		Logger:       quietLogger(),
		ListenConnect: func(ctx context.Context) (*pgx.Conn, error) {
			connects.Add(1)
			cfg, err := pgx.ParseConfig(d.DirectURL)
			if err != nil {
				return nil, err
			}
			cfg.RuntimeParams["application_name"] = app
			return pgx.ConnectConfig(ctx, cfg)
		},
	})
	var loopSession []int32
	eventually(t, 10*time.Second, "the worker subscribed", func() bool {
		loopSession = listenPIDs(t, ctx, app, "wh_perspective_events")
		return len(loopSession) == 1
	})
	require.Equal(t, 1, listenSessions(t, ctx, app))
	time.Sleep(100 * time.Millisecond) // let the catch-up of the new perspective and the first poll pass

	stream := uuid.New()
	ids := newIDs(t, 2)
	evs := events(stream, ids)
	entered, release := gated.arm(ids[1])
	defer release()
	require.NoError(t, worker.Append(ctx, pool, evs...))
	select {
	case <-entered: // the loop was woken by the Append's notification
	case <-time.After(20 * time.Second):
		t.Fatal("the worker was not woken by the Append's notification")
	}
	// Only the apply's transaction holds a connection once the worker's other statements of
	// the moment (a claim after the catch-up's last page, a job's release) are done.
	const held int32 = 1
	eventually(t, 10*time.Second, "only the apply's transaction holds a pool connection", func() bool {
		return pool.Stat().AcquiredConns() == held
	})
	res, st := waitAsync(t, pool, name, stream, ids[1])
	// The worker's heartbeat and leader lease take one for a statement now and then; a
	// WaitFor that held one would hold it for its whole wait.
	eventually(t, 5*time.Second, "the waiting WaitFor holds no pool connection", func() bool {
		return pool.Stat().AcquiredConns() == held
	})
	require.Equal(t, loopSession, listenPIDs(t, ctx, app, "wh_applied"), "WaitFor's LISTEN ran on the loop's session")
	require.Equal(t, 1, listenSessions(t, ctx, app), "one LISTEN session for the loop and WaitFor")
	require.Equal(t, int32(1), connects.Load(), "ListenConnect called once")
	release()
	require.NoError(t, waitResult(t, res))
	require.Positive(t, st.listening.Load(), "WaitFor checked after subscribing on the worker's session")
	require.Equal(t, int32(1), connects.Load())
}

// Stop honours its deadline with a catch-up read-ahead in flight: the read-ahead, blocked in
// a slow statement, is let run until Stop's context ends, then cancelled, and Stop returns
// with it ended (no goroutine outlives Stop), within the deadline plus a bound.
func TestStopEndsAReadAheadInFlightByItsDeadline(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	w, err := worker.New(testDB.Pool, worker.Config{
		Perspectives:  []worker.Perspective{ledgerPerspective(uniqueName("readahead"))},
		Logger:        quietLogger(),
		ListenConnect: directListen(),
	})
	require.NoError(t, err)
	require.NoError(t, w.Start(ctx))
	var stmtErr error
	done := worker.ReadAheadWith(w, func(ctx context.Context) error {
		_, stmtErr = testDB.Pool.Exec(ctx, `SELECT pg_sleep(60), 'read-ahead'`)
		return stmtErr
	})
	require.NotNil(t, done, "a started worker reads ahead")
	eventually(t, 10*time.Second, "the read-ahead's statement running", func() bool {
		var n int
		require.NoError(t, testDB.Pool.QueryRow(ctx,
			`SELECT count(*) FROM pg_stat_activity WHERE state = 'active' AND query LIKE '%pg_sleep(60), %' AND pid <> pg_backend_pid()`).Scan(&n))
		return n > 0
	})

	const deadline = 300 * time.Millisecond
	began := time.Now()
	sctx, scancel := context.WithTimeout(context.Background(), deadline)
	defer scancel()
	err = w.Stop(sctx)
	took := time.Since(began)
	require.ErrorIs(t, err, context.DeadlineExceeded, "the read-ahead was cut short")
	select {
	case <-done:
	default:
		t.Fatal("the read-ahead outlived Stop")
	}
	require.ErrorIs(t, stmtErr, context.Canceled, "cancelled when Stop's context ended")
	require.Less(t, took, deadline+2*time.Second, "Stop returned by its deadline plus a bound")
	require.GreaterOrEqual(t, took, deadline, "the read-ahead was let run until the deadline")
	require.Nil(t, worker.ReadAheadWith(w, func(context.Context) error { return nil }), "a stopped worker reads nothing ahead")
}

// A WaitFor outlives the loss of the notifier's session: the notifier opens another (after
// its backoff of a second) and tells its subscribers, which check again, for what was
// committed while no session listened (here the worker starts, and applies the event, as
// the session is lost).
func TestNotifierResubscribesAfterTheSessionIsLost(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	d := isolatedDB(t)
	app := uniqueName("lost")
	pool := appPool(t, d, app)
	name := uniqueName("lost")
	w := startWorkerIn(t, d, worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(name)}})
	require.NoError(t, w.Stop(ctx))
	stream := uuid.New()
	ids := newIDs(t, 1)
	require.NoError(t, worker.Append(ctx, d.Pool, events(stream, ids)...))

	res, st := waitAsync(t, pool, name, stream, ids[0])
	pids := listenPIDs(t, ctx, app, "wh_applied")
	require.Len(t, pids, 1)
	var killed bool
	require.NoError(t, testDB.Pool.QueryRow(ctx, `SELECT pg_terminate_backend($1)`, pids[0]).Scan(&killed))
	require.True(t, killed)
	startWorkerIn(t, d, worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(name)}})
	require.NoError(t, waitResult(t, res), "WaitFor survived the session's loss")
	require.GreaterOrEqual(t, st.listening.Load(), int32(2), "checked again on the new session")
}

// A session that cannot be opened (here a ListenConnect that always fails) is said once,
// with why, and the loop claims every 100 ms meanwhile: an Append is applied at once, not
// at the next PollInterval (an hour).
func TestAListenSessionThatCannotBeOpenedIsSaidAndPolledFor(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// A database and pool of its own: the notifier is the pool's, and on a shared pool this
	// subscription could join another test's live session (or offer that session its failing
	// ListenConnect).
	d := isolatedDB(t)
	pool := appPool(t, d, "nolisten")
	name := uniqueName("nolisten")
	var logs utLogBuf
	startWorkerWith(t, pool, worker.Config{
		Perspectives: []worker.Perspective{ledgerPerspective(name)},
		PollInterval: time.Hour,
		Logger:       utLogger(&logs),
		ListenConnect: func(context.Context) (*pgx.Conn, error) {
			return nil, errors.New("no listening session for this test")
		},
	})
	eventually(t, 10*time.Second, "the lost session said", func() bool {
		return strings.Contains(logs.String(), "queue notifications interrupted; polling until resubscribed")
	})
	stream := uuid.New()
	ids := newIDs(t, 1)
	require.NoError(t, worker.Append(ctx, pool, events(stream, ids)...))
	eventually(t, 5*time.Second, "the event applied", func() bool {
		_, ok, err := worker.LoadModel(ctx, pool, name, stream)
		require.NoError(t, err)
		return ok
	})
	time.Sleep(1500 * time.Millisecond) // the notifier tries again after a second, and fails again
	require.Equal(t, 1, strings.Count(logs.String(), "queue notifications interrupted; polling until resubscribed"), logs.String())
	require.Contains(t, logs.String(), "no listening session for this test")
}
