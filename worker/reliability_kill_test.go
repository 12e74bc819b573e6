package worker_test

// Scenario 1: a worker process SIGKILLed in the middle of a rewind, holding the lock.
//
// The test binary re-executes itself (TestMain dispatches on reliabilityHelperEnv) as a
// process running one worker with the Postgres locker on this package's database. Its
// perspective sleeps on every event of the test's stream, so the rewind takes seconds and
// can be killed mid-replay.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/worker"
)

// reliabilityHelperEnv names the role of a re-executed test binary (see TestMain).
const reliabilityHelperEnv = "PERSPECTIVES_RELIABILITY_HELPER"

// The helper process's parameters, passed in its environment.
const (
	helperRoleRewindVictim = "rewind-victim"
	helperEnvDBURL         = "PERSPECTIVES_RELIABILITY_DB_URL"
	helperEnvPerspective   = "PERSPECTIVES_RELIABILITY_PERSPECTIVE"
	helperEnvStream        = "PERSPECTIVES_RELIABILITY_STREAM"
	helperEnvInstance      = "PERSPECTIVES_RELIABILITY_INSTANCE"
	helperEnvSleep         = "PERSPECTIVES_RELIABILITY_SLEEP"
)

// killLockOptions are the lock options of both the victim and the instance that takes over.
var killLockOptions = locker.Options{LockTimeout: 2 * time.Second, KeepAliveInterval: 500 * time.Millisecond}

// runReliabilityHelper runs a helper role in a re-executed test binary and returns its exit code.
func runReliabilityHelper(role string) int {
	switch role {
	case helperRoleRewindVictim:
		if err := runRewindVictim(); err != nil {
			fmt.Fprintln(os.Stderr, "rewind victim:", err)
			return 1
		}
		return 0
	case helperRoleCatchUpVictim:
		if err := runCatchUpVictim(); err != nil {
			fmt.Fprintln(os.Stderr, "catch-up victim:", err)
			return 1
		}
		return 0
	case helperRoleSinkCatchUpVictim:
		if err := runSinkCatchUpVictim(); err != nil {
			fmt.Fprintln(os.Stderr, "sink catch-up victim:", err)
			return 1
		}
		return 0
	case helperRoleLeaderVictim:
		if err := runLeaderVictim(); err != nil {
			fmt.Fprintln(os.Stderr, "leader victim:", err)
			return 1
		}
		return 0
	}
	fmt.Fprintf(os.Stderr, "unknown %s role %q\n", reliabilityHelperEnv, role)
	return 2
}

// startVictim starts this test binary as a worker process in role (runReliabilityHelper),
// with env added to its environment. It is killed when the test ends, and its stderr is
// logged if the test failed; closing its stdin (at the end too) also stops it.
func startVictim(t *testing.T, role string, env ...string) *exec.Cmd {
	t.Helper()
	exe, err := os.Executable()
	require.NoError(t, err)
	cmd := exec.Command(exe, "-test.run=^$") // runs no test should the dispatch be missing
	cmd.Env = append(append(os.Environ(), reliabilityHelperEnv+"="+role), env...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		_ = stdin.Close()
		if t.Failed() {
			t.Logf("victim process stderr:\n%s", stderr.String())
		}
	})
	return cmd
}

// slowPerspective is a ledger that prints "apply <id>" and sleeps on every event of one stream.
type slowPerspective struct {
	worker.Perspective
	stream uuid.UUID
	sleep  time.Duration
	out    io.Writer
}

func (p slowPerspective) Apply(ctx context.Context, model json.RawMessage, ev worker.Event) (json.RawMessage, error) {
	if ev.StreamID == p.stream {
		fmt.Fprintf(p.out, "apply %s\n", ev.ID)
		time.Sleep(p.sleep)
	}
	return p.Perspective.Apply(ctx, model, ev)
}

// runRewindVictim runs one worker until it is killed, its stdin closes (the parent died)
// or a minute passes.
func runRewindVictim() error {
	stream, err := uuid.Parse(os.Getenv(helperEnvStream))
	if err != nil {
		return fmt.Errorf("%s: %w", helperEnvStream, err)
	}
	instance, err := uuid.Parse(os.Getenv(helperEnvInstance))
	if err != nil {
		return fmt.Errorf("%s: %w", helperEnvInstance, err)
	}
	sleep, err := time.ParseDuration(os.Getenv(helperEnvSleep))
	if err != nil {
		return fmt.Errorf("%s: %w", helperEnvSleep, err)
	}
	return runVictim(func(pool *pgxpool.Pool) (worker.Config, error) {
		lk, err := locker.NewPostgres(pool, killLockOptions)
		if err != nil {
			return worker.Config{}, err
		}
		return worker.Config{
			InstanceID:   instance,
			Perspectives: []worker.Perspective{slowPerspective{Perspective: ledgerPerspective(os.Getenv(helperEnvPerspective)), stream: stream, sleep: sleep, out: os.Stdout}},
			Locker:       lk,
			LockOptions:  killLockOptions,
			PollInterval: 20 * time.Millisecond,
		}, nil
	})
}

// runVictim runs one worker, with the Config config makes on its pool and a log on stderr,
// until the process is killed, its stdin closes (the parent died) or a minute passes. It
// prints "started" once the worker has started.
func runVictim(config func(pool *pgxpool.Pool) (worker.Config, error)) error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	go func() { // the parent holds our stdin open; EOF means it is gone
		_, _ = io.Copy(io.Discard, os.Stdin)
		cancel()
	}()
	pool, err := pgxpool.New(ctx, os.Getenv(helperEnvDBURL))
	if err != nil {
		return err
	}
	defer pool.Close()
	cfg, err := config(pool)
	if err != nil {
		return err
	}
	cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	w, err := worker.New(pool, cfg)
	if err != nil {
		return err
	}
	if err := w.Start(ctx); err != nil {
		return err
	}
	fmt.Println("started")
	<-ctx.Done()
	return w.Stop(context.Background())
}

// TestReliabilityProcessKilledMidRewind SIGKILLs a worker process while it holds a rewind
// lock mid-replay. The lock outlives the process; an in-process instance takes the pair
// over after the lease expires (and not before), and everything converges.
func TestReliabilityProcessKilledMidRewind(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := uniqueName("reliab_kill")
	stream := uuid.New()
	ids := newIDs(t, 100)
	all := events(stream, ids)
	inspect := newLocker(t, killLockOptions)

	// Every event but the first is applied by a short-lived in-process instance.
	first := startWorker(t, worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(name)}, Locker: newLocker(t, killLockOptions), LockOptions: killLockOptions})
	require.NoError(t, worker.Append(ctx, testDB.Pool, all[1:]...))
	before := waitModel(t, ctx, name, stream, len(all)-1)
	require.NoError(t, first.Stop(ctx))

	// The victim process: 20ms per event of the stream, so its rewind of 100 events takes 2s.
	exe, err := os.Executable()
	require.NoError(t, err)
	victim := uuid.Must(uuid.NewV7())
	cmd := exec.Command(exe, "-test.run=^$") // runs no test should the dispatch be missing
	cmd.Env = append(os.Environ(),
		reliabilityHelperEnv+"="+helperRoleRewindVictim,
		helperEnvDBURL+"="+testDB.URL,
		helperEnvPerspective+"="+name,
		helperEnvStream+"="+stream.String(),
		helperEnvInstance+"="+victim.String(),
		helperEnvSleep+"=20ms",
	)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	var applies atomic.Int64
	exited := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if strings.HasPrefix(sc.Text(), "apply ") {
				applies.Add(1)
			}
		}
		close(exited)
	}()
	killed := false
	defer func() {
		if !killed {
			_ = cmd.Process.Kill()
			<-exited
			_ = cmd.Wait()
		}
		_ = stdin.Close()
		if t.Failed() {
			t.Logf("victim process stderr:\n%s", stderr.String())
		}
	}()

	require.NoError(t, worker.Append(ctx, testDB.Pool, all[0])) // late: the victim rewinds
	var held locker.Lock
	eventually(t, 30*time.Second, "the victim holding the rewind lock", func() bool {
		select {
		case <-exited:
			t.Fatalf("the victim exited early:\n%s", stderr.String())
		default:
		}
		locks, err := inspect.List(ctx)
		require.NoError(t, err)
		for _, l := range locks {
			if l.StreamID == stream && l.PerspectiveName == name && l.InstanceID == victim && l.Reason == locker.ReasonRewind {
				held = l
				return true
			}
		}
		return false
	})
	atLock := applies.Load()
	eventually(t, 10*time.Second, "the victim replaying", func() bool { return applies.Load() >= atLock+5 })

	require.NoError(t, cmd.Process.Signal(syscall.SIGKILL))
	killed = true
	<-exited
	err = cmd.Wait()
	var exitErr *exec.ExitError
	require.ErrorAs(t, err, &exitErr)
	require.Equal(t, "signal: killed", exitErr.Error())
	replayed := applies.Load()
	require.Less(t, replayed, int64(len(all)), "killed mid-replay")

	// The lock outlives its holder; nothing of the rewind was written.
	l, ok, err := inspect.Get(ctx, stream, name)
	require.NoError(t, err)
	require.True(t, ok, "the dead holder's lock is still there until it expires")
	require.Equal(t, victim, l.InstanceID)
	m, _ := loadLedger(t, ctx, name, stream)
	require.Equal(t, before, m, "the killed rewind wrote nothing")
	require.Equal(t, []uuid.UUID{ids[0]}, queued(t, ctx, name, stream), "the late event is still queued")

	// Another instance takes over after expiry.
	logs := newLogCounter()
	killedAt := time.Now()
	startWorker(t, worker.Config{
		Perspectives: []worker.Perspective{ledgerPerspective(name)},
		Locker:       newLocker(t, killLockOptions), LockOptions: killLockOptions,
		PollInterval: 20 * time.Millisecond, Logger: slog.New(logs),
	})
	streams := map[uuid.UUID][]worker.Event{stream: all}
	waitConverged(t, ctx, testDB.Pool, name, streams, 30*time.Second, "after kill")
	took := time.Since(killedAt)
	n := requireConverged(t, ctx, testDB.Pool, name, streams, "after kill")
	var updated time.Time
	require.NoError(t, testDB.Pool.QueryRow(ctx, `SELECT updated_at FROM wh_perspective_models
		WHERE stream_id = $1 AND perspective_name = $2`, stream, name).Scan(&updated))
	require.True(t, updated.After(l.Expiry), "the takeover wrote (%s) only after the dead holder's lease expired (%s)", updated, l.Expiry)
	// The log line follows the commit: wait for it.
	eventually(t, 5*time.Second, "the new instance logging its rewind", func() bool { return logs.countFor(msgRewindCompleted, stream) > 0 })
	require.Equal(t, 1, logs.countFor(msgRewindCompleted, stream), "the new instance rewound the pair, once")
	// The rewind releases its lock just after it logs its commit.
	eventually(t, 5*time.Second, "no lock left", func() bool {
		_, ok, err := inspect.Get(ctx, stream, name)
		require.NoError(t, err)
		return !ok
	})
	t.Logf("victim %s killed after replaying %d of %d events (its lease ran to %s); takeover converged %s after the kill; %d events checked",
		held.InstanceID, replayed, len(all), l.Expiry.Format(time.StampMilli), took.Round(time.Millisecond), n)
}
