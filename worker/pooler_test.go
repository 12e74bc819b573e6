package worker_test

// The worker behind a transaction pooler of its own (PgBouncer in transaction mode, started
// by scripts/pgbouncer.sh on a private port): the wake-up. The rest of the suite runs
// through a pooler as well in make test (PGTEST_POOLER_URL, both exec modes without
// prepared statements).

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/internal/pgtest"
	"github.com/perspectives-go/perspectives/worker"
)

const lostMsg = "LISTEN receives no notifications on this connection"

// poolerPool opens a pool through a PgBouncer of the test's own, in exec mode.
func poolerPool(t *testing.T) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), pgtest.WithExecMode(pgtest.StartPooler(t, testDB.Name), "exec"))
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// startWorkerOn starts a worker on pool with cfg, logging to logs.
func startWorkerOn(t *testing.T, pool *pgxpool.Pool, logs *utLogBuf, cfg worker.Config) {
	t.Helper()
	cfg.Logger = utLogger(logs)
	startWorkerWith(t, pool, cfg)
}

// A LISTEN through a transaction pooler would hear nothing: the worker finds out by itself
// (its pool connection's backend is not the one it opened), does not LISTEN, says so once,
// and polls.
func TestListenThroughATransactionPoolerFallsBackToPolling(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := poolerPool(t)
	name := uniqueName("pooled_listen")
	logs := &utLogBuf{}
	startWorkerOn(t, pool, logs, worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(name)}, PollInterval: 300 * time.Millisecond})
	eventually(t, 10*time.Second, "the warning", func() bool { return strings.Contains(logs.String(), lostMsg) })

	stream := uuid.New()
	evs := events(stream, newIDs(t, 3))
	require.NoError(t, worker.Append(ctx, pool, evs...))
	require.Equal(t, expectedLedger(t, evs), waitModel(t, ctx, name, stream, 3), "applied by polling")
	require.Equal(t, 1, strings.Count(logs.String(), lostMsg), "said once:\n%s", logs.String())
}

// With ListenConnect on a direct connection, Appends through the pooler wake the worker
// (it polls only every hour here), and nothing is said about lost notifications.
func TestListenConnectWakesTheWorkerBehindAPooler(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := poolerPool(t)
	name := uniqueName("direct_listen")
	logs := &utLogBuf{}
	startWorkerOn(t, pool, logs, worker.Config{
		Perspectives: []worker.Perspective{ledgerPerspective(name)},
		PollInterval: time.Hour,
		ListenConnect: func(ctx context.Context) (*pgx.Conn, error) {
			return pgx.Connect(ctx, testDB.DirectURL)
		},
	})
	time.Sleep(100 * time.Millisecond) // let the first (immediate) poll pass
	stream := uuid.New()
	evs := events(stream, newIDs(t, 2))
	require.NoError(t, worker.Append(ctx, pool, evs...))
	require.Equal(t, expectedLedger(t, evs), waitModelWithin(t, ctx, name, stream, 2, 10*time.Second))
	time.Sleep(2500 * time.Millisecond) // past the subscription's probe timeout (2s)
	require.NotContains(t, logs.String(), lostMsg)
	require.NotContains(t, logs.String(), "probe notification did not arrive")
}

// Behind a pooler, a WaitFor polls until a worker on its pool offers its ListenConnect; a
// WaitFor that subscribes after the offer listens on that session, and the worker's commit
// ends its wait with no poll (its safety re-check is an hour away).
func TestWaitForListensOnAWorkersOfferedListenConnect(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := poolerPool(t)
	name, other := uniqueName("offer_wait"), uniqueName("offer_other")
	// Registered by a worker that stops at once: the event waits in the queue, unapplied.
	registrar, err := worker.New(pool, worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(name)}, Logger: quietLogger()})
	require.NoError(t, err)
	require.NoError(t, registrar.Start(ctx))
	require.NoError(t, registrar.Stop(ctx))
	stream := uuid.New()
	ids := newIDs(t, 1)
	require.NoError(t, worker.Append(ctx, pool, events(stream, ids)...))

	before, stBefore := waitAsync(t, pool, name, stream, ids[0])
	require.Zero(t, stBefore.listening.Load(), "no ListenConnect offered: WaitFor polls")
	direct := func(ctx context.Context) (*pgx.Conn, error) { return pgx.Connect(ctx, testDB.DirectURL) }
	startWorkerOn(t, pool, &utLogBuf{}, worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(other)},
		PollInterval: time.Hour, ListenConnect: direct})
	after, stAfter := waitAsync(t, pool, name, stream, ids[0])
	require.Positive(t, stAfter.listening.Load(), "WaitFor listens on the offered session")

	startWorkerOn(t, pool, &utLogBuf{}, worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(name)}, PollInterval: time.Hour})
	require.NoError(t, waitResult(t, after))
	require.Equal(t, int32(1), stAfter.polled.Load(), "woken by the notification: only the first check was made before LISTEN")
	require.NoError(t, waitResult(t, before))
	require.Zero(t, stBefore.listening.Load(), "the WaitFor from before the offer found the event by polling")
}
