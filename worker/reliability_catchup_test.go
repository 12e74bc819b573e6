package worker_test

// A worker process SIGKILLed in the middle of a catch-up: another instance resumes from the
// persisted position once the dead one's lease has expired, and no event is applied twice.

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/worker"
)

const (
	helperRoleCatchUpVictim = "catchup-victim"
	helperEnvPageSize       = "PERSPECTIVES_RELIABILITY_PAGE_SIZE"
)

// sleepyPerspective sleeps on every event it applies.
type sleepyPerspective struct {
	worker.Perspective
	sleep time.Duration
}

func (p sleepyPerspective) Apply(ctx context.Context, model json.RawMessage, ev worker.Event) (json.RawMessage, error) {
	time.Sleep(p.sleep)
	return p.Perspective.Apply(ctx, model, ev)
}

// runCatchUpVictim runs one worker whose catch-up is slow, until it is killed, its stdin
// closes (the parent died) or a minute passes.
func runCatchUpVictim() error {
	sleep, err := time.ParseDuration(os.Getenv(helperEnvSleep))
	if err != nil {
		return fmt.Errorf("%s: %w", helperEnvSleep, err)
	}
	pageSize, err := strconv.Atoi(os.Getenv(helperEnvPageSize))
	if err != nil {
		return fmt.Errorf("%s: %w", helperEnvPageSize, err)
	}
	return runVictim(func(pool *pgxpool.Pool) (worker.Config, error) {
		lk, err := locker.NewPostgres(pool, killLockOptions)
		if err != nil {
			return worker.Config{}, err
		}
		return worker.Config{
			Perspectives:    []worker.Perspective{sleepyPerspective{Perspective: newVLedger(os.Getenv(helperEnvPerspective), 1), sleep: sleep}},
			Locker:          lk,
			PollInterval:    20 * time.Millisecond,
			CatchUpPageSize: pageSize,
		}, nil
	})
}

func TestReliabilityProcessKilledMidCatchUp(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := isolatedDB(t)
	name := uniqueName("reliab_catchup")
	const streams, perStream = 30, 40
	for range streams {
		require.NoError(t, worker.Append(ctx, d.Pool, events(uuid.New(), newIDs(t, perStream))...))
	}
	total := streams * perStream

	cmd := startVictim(t, helperRoleCatchUpVictim,
		helperEnvDBURL+"="+d.URL, helperEnvPerspective+"="+name, helperEnvSleep+"=2ms", helperEnvPageSize+"=25")

	read := func() (events int64, holder uuid.NullUUID, done bool) {
		require.NoError(t, d.Pool.QueryRow(ctx, `SELECT catchup_events, catchup_holder, catchup_done
			FROM wh_perspective_builds WHERE perspective_name = $1`, name).Scan(&events, &holder, &done))
		return
	}
	eventually(t, 30*time.Second, "the victim a third into its catch-up", func() bool {
		var n int
		require.NoError(t, d.Pool.QueryRow(ctx, `SELECT count(*) FROM wh_perspective_builds WHERE perspective_name = $1`, name).Scan(&n))
		if n == 0 {
			return false
		}
		e, _, _ := read()
		return e >= int64(total/3)
	})
	require.NoError(t, cmd.Process.Signal(syscall.SIGKILL))
	_ = cmd.Wait()
	atKill, holder, done := read()
	require.False(t, done, "killed mid catch-up")
	require.True(t, holder.Valid, "the dead instance's lease outlives it")
	require.Less(t, atKill, int64(total))

	lcWorker(t, d, worker.Config{
		Perspectives: []worker.Perspective{newVLedger(name, 1)}, Locker: lockerIn(t, d, killLockOptions), CatchUpPageSize: 25,
	})
	lcConverged(t, d, name, 1, 30*time.Second)
	eventually(t, 10*time.Second, "the catch-up done", func() bool { _, _, done := read(); return done })
	finalRead, _, _ := read()
	require.EqualValues(t, total, finalRead, "resumed from the persisted position: every event read once in all")
	t.Logf("killed after %d of %d events; resumed and converged", atKill, total)
}
