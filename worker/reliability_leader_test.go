package worker_test

// A worker process SIGKILLed while it holds the leader leases: they outlive it until they
// expire, and then another instance takes them over and runs the maintenance (it promotes a
// rebuild), not before.

import (
	"context"
	"fmt"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/worker"
)

const helperRoleLeaderVictim = "leader-victim"

// runLeaderVictim runs one worker of the ledger perspective until it is killed, its stdin
// closes (the parent died) or a minute passes.
func runLeaderVictim() error {
	instance, err := uuid.Parse(os.Getenv(helperEnvInstance))
	if err != nil {
		return fmt.Errorf("%s: %w", helperEnvInstance, err)
	}
	return runVictim(func(*pgxpool.Pool) (worker.Config, error) {
		return worker.Config{
			InstanceID:   instance,
			Perspectives: []worker.Perspective{ledgerPerspective(os.Getenv(helperEnvPerspective))},
			LockOptions:  killLockOptions,
			PollInterval: 20 * time.Millisecond,
		}, nil
	})
}

func TestReliabilityLeaderKilledIsTakenOverAfterItsLeaseExpires(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := isolatedDB(t)
	name := uniqueName("reliab_leader")
	victim := uuid.New()

	cmd := startVictim(t, helperRoleLeaderVictim,
		helperEnvDBURL+"="+d.URL, helperEnvPerspective+"="+name, helperEnvInstance+"="+victim.String())
	promotion := "promotion:" + name + "@v1"
	eventually(t, 30*time.Second, "the victim holds the leases", func() bool {
		var n int
		require.NoError(t, d.Pool.QueryRow(ctx, `SELECT count(*) FROM wh_leader WHERE name = $1`, promotion).Scan(&n))
		return n > 0 && leaseHolder(t, ctx, d.Pool, promotion) == victim
	})

	// The survivor runs the same perspective, started while the victim leads.
	survivor := startWorkerWith(t, d.Pool, worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(name)},
		LockOptions: killLockOptions, PollInterval: 20 * time.Millisecond, Logger: quietLogger(), ListenConnect: directListen()})
	require.Equal(t, victim, leaseHolder(t, ctx, d.Pool, promotion), "the victim still leads")

	require.NoError(t, cmd.Process.Signal(syscall.SIGKILL))
	_ = cmd.Wait()
	var expires time.Time
	require.NoError(t, d.Pool.QueryRow(ctx, `SELECT expires_at FROM wh_leader WHERE name = $1`, promotion).Scan(&expires))

	// A rebuild caught up by the survivor waits for a leader to promote it.
	require.NoError(t, worker.Append(ctx, d.Pool, events(uuid.New(), newIDs(t, 3))...))
	admin, err := worker.NewAdmin(d.Pool, nil)
	require.NoError(t, err)
	rebuild, created, err := admin.RebuildPerspective(ctx, name)
	require.NoError(t, err)
	require.True(t, created)
	eventually(t, 30*time.Second, "the rebuild promoted by the survivor", func() bool {
		return buildState(t, ctx, d.Pool, rebuild.Key) == worker.BuildActive
	})
	var promoted time.Time
	require.NoError(t, d.Pool.QueryRow(ctx, `SELECT promoted_at FROM wh_perspective_builds WHERE build_key = $1`, rebuild.Key).Scan(&promoted))
	require.False(t, promoted.Before(expires), "promoted after the dead leader's lease expired (%s), not before (%s)", expires, promoted)
	require.Equal(t, survivor.InstanceID(), leaseHolder(t, ctx, d.Pool, promotion), "the survivor took the lease over")
	for _, lease := range []string{"cleanup:" + name, "instances"} {
		require.Equal(t, survivor.InstanceID(), leaseHolder(t, ctx, d.Pool, lease), lease)
	}
}
