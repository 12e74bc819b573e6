package worker_test

// Failover to a standby under load: a private primary and a streaming-replication standby
// (synchronous: a commit is acknowledged once the standby has it), workers and appenders on
// a multi-host URL with target_session_attrs=read-write. Mid-run, with late events (rewinds)
// in flight, the primary is stopped in immediate mode and the standby promoted. Checked:
// every acknowledged event is in its model exactly once, in order; every stream lock
// acknowledged on the old primary is on the new one with its holder (so no other instance
// can take it before it expires, and a lease that was never acknowledged was never held);
// the time from the promotion to the first applied event.

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/internal/pgtest"
	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/schema"
)

func TestReliabilityFailoverToAStandby(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	primary := pgtest.StartCluster(t)
	standby := primary.StartStandby(t)
	direct, err := pgxpool.New(ctx, primary.URL)
	require.NoError(t, err)
	require.NoError(t, schema.Migrate(ctx, direct))
	direct.Close()

	both := fmt.Sprintf("postgres://postgres@127.0.0.1:%d,127.0.0.1:%d/postgres?sslmode=disable&target_session_attrs=read-write",
		primary.Port, standby.Port)
	pool, err := pgxpool.New(ctx, both)
	require.NoError(t, err)
	t.Cleanup(pool.Close)

	const lockTimeout = 10 * time.Second
	opts := locker.Options{LockTimeout: lockTimeout, KeepAliveInterval: 2 * time.Second}
	name := uniqueName("failover")
	m := newMetrics(t)
	applied := func() int64 { return m.sum("perspectives.events.applied") }
	startFaultWorkers(t, pool, name, m, opts)

	stop := make(chan struct{})
	load, wg := runFaultLoad(ctx, pool, 4, 10, stop)
	time.Sleep(2 * time.Second)

	// Leases granted (acknowledged) on the primary just before it goes.
	foreign, err := locker.NewPostgres(pool, opts)
	require.NoError(t, err)
	holder := uuid.New()
	var leased []uuid.UUID
	for range 20 {
		s := uuid.New()
		ok, err := foreign.TryAcquire(ctx, s, name, holder, locker.ReasonRewind)
		require.NoError(t, err)
		require.True(t, ok)
		leased = append(leased, s)
	}

	primary.Crash(t)
	standby.Promote(t) // returns once the standby accepts writes
	resume := appliedSince(t, applied, applied(), lockTimeout+2*time.Second)
	time.Sleep(time.Second)
	close(stop)
	wg.Wait()

	locks, err := foreign.List(ctx)
	require.NoError(t, err)
	held := map[uuid.UUID]uuid.UUID{}
	for _, l := range locks {
		if l.PerspectiveName == name {
			held[l.StreamID] = l.InstanceID
		}
	}
	for _, s := range leased {
		require.Equal(t, holder, held[s], "stream %s: the lease acknowledged on the old primary is on the new one", s)
	}
	load.check(t, ctx, pool, name, 30*time.Second)
	rewinds := m.sum("perspectives.rewind.completed")
	require.Positive(t, rewinds, "late events were rewound")
	t.Logf("failover: first event applied %s after the promotion; %d acknowledged events, %d Appends failed, %d rewinds",
		resume, len(load.acked), load.errors.Load(), rewinds)
}
