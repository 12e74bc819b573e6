package worker_test

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"math"
	"strings"
	"sync"
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

func newLocker(t testing.TB, opts locker.Options) *locker.Postgres {
	t.Helper()
	lk, err := locker.NewPostgres(testDB.Pool, opts)
	require.NoError(t, err)
	return lk
}

func uniqueName(prefix string) string { return prefix + "_" + uuid.NewString()[:8] }

// minutePollConfig is a worker of the ledger perspective name with a one-minute poll: after
// its first claim, one from the oldest row comes only a minute later, longer than a test
// waits for a model (waitModel).
func minutePollConfig(name string, batch, group, concurrency int) worker.Config {
	return worker.Config{
		Perspectives: []worker.Perspective{ledgerPerspective(name)},
		BatchSize:    batch, GroupSize: group, Concurrency: concurrency, PollInterval: time.Minute,
		Logger: quietLogger(), ListenConnect: directListen(),
	}
}

// waitCaughtUp waits until the perspective's build is active and caught up: the events
// appended from then on are queued for it and claimed, not read by its catch-up.
func waitCaughtUp(t testing.TB, ctx context.Context, name string) {
	t.Helper()
	eventually(t, 20*time.Second, "the build active", func() bool {
		var active bool
		require.NoError(t, testDB.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM wh_perspective_builds
			WHERE perspective_name = $1 AND state = 'active' AND catchup_done)`, name).Scan(&active))
		return active
	})
}

func waitModel(t testing.TB, ctx context.Context, name string, stream uuid.UUID, n int) ledger {
	t.Helper()
	var m ledger
	eventually(t, 20*time.Second, "model with all events", func() bool {
		m, _ = loadLedger(t, ctx, name, stream)
		return len(m.IDs) == n && len(queued(t, ctx, name, stream)) == 0
	})
	return m
}

func TestLockedPairReceivesNoLiveEventsUntilReleased(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := uniqueName("locked")
	lk := newLocker(t, locker.Options{})
	startWorker(t, worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(name)}, Locker: lk})

	stream, control := uuid.New(), uuid.New()
	foreign := uuid.New()
	ok, err := lk.TryAcquire(ctx, stream, name, foreign, locker.ReasonRewind)
	require.NoError(t, err)
	require.True(t, ok)

	evs := events(stream, newIDs(t, 5))
	require.NoError(t, worker.Append(ctx, testDB.Pool, evs...))
	// The control stream is appended after, so once it is applied the worker has polled
	// past the locked pair's rows at least once.
	for round := range 3 {
		c := events(control, newIDs(t, 2))
		require.NoError(t, worker.Append(ctx, testDB.Pool, c...))
		waitModel(t, ctx, name, control, 2*(round+1))
	}
	_, has := loadLedger(t, ctx, name, stream)
	require.False(t, has, "a pair locked by another instance must not receive live events")
	require.Len(t, queued(t, ctx, name, stream), 5, "its events stay queued")

	require.NoError(t, lk.Release(ctx, stream, name, foreign))
	require.Equal(t, expectedLedger(t, evs), waitModel(t, ctx, name, stream, 5))
}

func TestLapsedLockMidRewindRefusesStaleCommit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := uniqueName("lapsed")
	lk := newLocker(t, locker.Options{})
	logs := &logCapture{}
	gated := newGated(name)
	startWorker(t, worker.Config{Perspectives: []worker.Perspective{gated}, Locker: lk, Logger: slog.New(logs)})

	stream := uuid.New()
	ids := newIDs(t, 6)
	all := events(stream, ids)
	require.NoError(t, worker.Append(ctx, testDB.Pool, all[1:]...))
	before := waitModel(t, ctx, name, stream, 5)

	entered, release := gated.arm(ids[2])
	defer release()
	require.NoError(t, worker.Append(ctx, testDB.Pool, all[0])) // late: older than the cursor
	select {
	case <-entered:
	case <-time.After(20 * time.Second):
		t.Fatal("rewind did not start")
	}
	// The rewind is mid-replay holding the lock. Let its lease lapse and another instance take over.
	_, err := testDB.Pool.Exec(ctx, `UPDATE wh_perspective_cursors SET stream_lock_expiry = now() - interval '1 second'
		WHERE stream_id = $1 AND perspective_name = $2`, stream, name)
	require.NoError(t, err)
	foreign := uuid.New()
	ok, err := lk.TryAcquire(ctx, stream, name, foreign, locker.ReasonRewind)
	require.NoError(t, err)
	require.True(t, ok, "an expired lock is taken over")
	release()

	eventually(t, 20*time.Second, "stale commit refused", func() bool {
		return logs.count("stream lock lost: the operation's work was refused; will retry with backoff") > 0
	})
	m, _ := loadLedger(t, ctx, name, stream)
	require.Equal(t, before, m, "the stale holder wrote nothing")
	require.Equal(t, []uuid.UUID{ids[0]}, queued(t, ctx, name, stream), "the late event is still queued")

	require.NoError(t, lk.Release(ctx, stream, name, foreign))
	require.Equal(t, expectedLedger(t, all), waitModel(t, ctx, name, stream, 6))
}

func TestEventsArrivingDuringRewindAreAppliedAfter(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := uniqueName("during")
	logs := &logCapture{}
	gated := newGated(name)
	startWorker(t, worker.Config{
		Perspectives: []worker.Perspective{gated},
		Locker:       newLocker(t, locker.Options{}),
		Logger:       slog.New(logs),
		Snapshots:    worker.SnapshotOptions{EveryNEvents: 2},
	})

	stream := uuid.New()
	ids := newIDs(t, 10)
	all := events(stream, ids)
	// Apply everything but ids[0] (late), ids[4] (late, arrives during the rewind) and ids[9] (new).
	var first []worker.Event
	for i, ev := range all {
		if i != 0 && i != 4 && i != 9 {
			first = append(first, ev)
		}
	}
	require.NoError(t, worker.Append(ctx, testDB.Pool, first...))
	waitModel(t, ctx, name, stream, len(first))

	entered, release := gated.arm(ids[2])
	defer release()
	require.NoError(t, worker.Append(ctx, testDB.Pool, all[0]))
	select {
	case <-entered:
	case <-time.After(20 * time.Second):
		t.Fatal("rewind did not start")
	}
	require.NoError(t, worker.Append(ctx, testDB.Pool, all[4], all[9]))
	release()

	require.Equal(t, expectedLedger(t, all), waitModel(t, ctx, name, stream, len(all)))
	// The log line follows the commit that waitModel saw.
	eventually(t, 20*time.Second, "the event that arrived during the rewind needs its own pass", func() bool {
		return logs.count("rewind completed") >= 2
	})
}

// poisonPerspective fails on events of type "poison".
func poisonPerspective(name string) worker.Perspective {
	return worker.JSONPerspective(name, func(m ledger, ev worker.Event) (ledger, error) {
		if ev.Type == "poison" {
			return m, errors.New("poison event refused")
		}
		return foldLedger(m, ev)
	})
}

func TestPoisonEventIsIsolated(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := uniqueName("poison")
	startWorker(t, worker.Config{
		Perspectives: []worker.Perspective{poisonPerspective(name)},
		RetryBackoff: 20 * time.Millisecond, MaxRetryBackoff: 40 * time.Millisecond,
	})
	bad, good := uuid.New(), uuid.New()
	badEvs := events(bad, newIDs(t, 4))
	badEvs[2].Type = "poison"
	goodEvs := events(good, newIDs(t, 3))
	require.NoError(t, worker.Append(ctx, testDB.Pool, badEvs...))
	require.NoError(t, worker.Append(ctx, testDB.Pool, goodEvs...))

	require.Equal(t, expectedLedger(t, goodEvs), waitModel(t, ctx, name, good, 3), "other pairs continue")
	q := pgq.New(testDB.Pool)
	eventually(t, 20*time.Second, "failure retried", func() bool {
		cur, err := q.CursorGet(ctx, db.CursorGetParams{StreamID: bad, PerspectiveName: name})
		return err == nil && cur.Attempts >= 2
	})
	cur, err := q.CursorGet(ctx, db.CursorGetParams{StreamID: bad, PerspectiveName: name})
	require.NoError(t, err)
	require.Equal(t, "failed", cur.Status)
	require.NotNil(t, cur.LastError)
	require.Contains(t, *cur.LastError, "poison event refused")
	m, _ := loadLedger(t, ctx, name, bad)
	require.Equal(t, expectedLedger(t, badEvs[:2]), m, "events before the poison one are applied")
	require.Equal(t, []uuid.UUID{badEvs[2].ID, badEvs[3].ID}, queued(t, ctx, name, bad), "the poison event and those after it stay queued")
}

func TestPurge(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := uniqueName("purge")
	lk := newLocker(t, locker.Options{})
	w := startWorker(t, worker.Config{
		Perspectives: []worker.Perspective{ledgerPerspective(name)}, Locker: lk,
		Snapshots: worker.SnapshotOptions{EveryNEvents: 2},
	})
	stream := uuid.New()
	require.NoError(t, worker.Append(ctx, testDB.Pool, events(stream, newIDs(t, 5))...))
	waitModel(t, ctx, name, stream, 5)
	q := pgq.New(testDB.Pool)
	snaps, err := q.SnapshotIDs(ctx, db.SnapshotIDsParams{StreamID: stream, PerspectiveName: name})
	require.NoError(t, err)
	require.NotEmpty(t, snaps)

	// Refused while another instance holds the lock: nothing deleted.
	foreign := uuid.New()
	ok, err := lk.TryAcquire(ctx, stream, name, foreign, locker.ReasonRewind)
	require.NoError(t, err)
	require.True(t, ok)
	err = w.Purge(ctx, stream, name)
	require.ErrorIs(t, err, worker.ErrLocked)
	_, has := loadLedger(t, ctx, name, stream)
	require.True(t, has, "a refused purge deletes nothing")
	require.NoError(t, lk.Release(ctx, stream, name, foreign))

	require.NoError(t, w.Purge(ctx, stream, name))
	_, has = loadLedger(t, ctx, name, stream)
	require.False(t, has)
	snaps, err = q.SnapshotIDs(ctx, db.SnapshotIDsParams{StreamID: stream, PerspectiveName: name})
	require.NoError(t, err)
	require.Empty(t, snaps)
	cur, err := q.CursorGet(ctx, db.CursorGetParams{StreamID: stream, PerspectiveName: name})
	require.NoError(t, err)
	require.False(t, cur.LastEventID.Valid)
	require.False(t, cur.StreamLockInstanceID.Valid, "the purge lock is released")

	require.ErrorIs(t, w.Purge(ctx, stream, "no_such_perspective"), locker.ErrInvalidArgument)
	require.ErrorIs(t, w.Purge(ctx, uuid.Nil, name), locker.ErrInvalidArgument)
}

func TestNewPerspectiveCatchesUp(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := uniqueName("catchup")
	stream := uuid.New()
	evs := events(stream, newIDs(t, 7))
	require.NoError(t, worker.Append(ctx, testDB.Pool, evs...))
	startWorker(t, worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(name)}})
	require.Equal(t, expectedLedger(t, evs), waitModel(t, ctx, name, stream, 7))
}

func TestRolledBackAppendLeavesNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	stream := uuid.New()
	tx, err := testDB.Pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, worker.Append(ctx, tx, events(stream, newIDs(t, 3))...))
	require.NoError(t, tx.Rollback(ctx))

	q := pgq.New(testDB.Pool)
	stored, err := q.EventsForStream(ctx, stream)
	require.NoError(t, err)
	require.Empty(t, stored)
	var rows int
	require.NoError(t, testDB.Pool.QueryRow(ctx, `SELECT count(*) FROM wh_perspective_events WHERE stream_id = $1`, stream).Scan(&rows))
	require.Zero(t, rows)

	// The same inside a committed transaction is stored, IDs written back.
	evs := []worker.Event{{StreamID: stream, Type: "amount", Data: json.RawMessage(`{"n":1}`)}}
	tx, err = testDB.Pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, worker.Append(ctx, tx, evs...))
	require.NoError(t, tx.Commit(ctx))
	require.NotEqual(t, uuid.Nil, evs[0].ID)
	require.Equal(t, uuid.Version(7), evs[0].ID.Version())
	stored, err = q.EventsForStream(ctx, stream)
	require.NoError(t, err)
	require.Len(t, stored, 1)
	require.Equal(t, evs[0].ID, stored[0].EventID)
}

func TestAppendRefusesBadInput(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	stream := uuid.New()
	dup := uuid.Must(uuid.NewV7())
	cases := []struct {
		name   string
		events []worker.Event
		want   string
	}{
		{"nil stream", []worker.Event{{Type: "t"}}, "stream ID is the nil UUID"},
		{"empty type", []worker.Event{{StreamID: stream}}, "type is empty"},
		{"not JSON", []worker.Event{{StreamID: stream, Type: "t", Data: json.RawMessage(`{nope`)}}, "not valid JSON"},
		{"ID twice", []worker.Event{{ID: dup, StreamID: stream, Type: "t"}, {ID: dup, StreamID: stream, Type: "t"}}, "appears twice"},
		{"bad after good", []worker.Event{{StreamID: stream, Type: "t"}, {StreamID: stream, Type: ""}}, "event 1: type is empty"},
		// Text PostgreSQL cannot store (SQLSTATE 22P05, 22021 if it reached the database).
		{"NUL escape", []worker.Event{{StreamID: stream, Type: "t", Data: json.RawMessage(`{"a":"x\u0000y"}`)}}, `data contains the escape \u0000`},
		{"NUL escape after escaped backslashes", []worker.Event{{StreamID: stream, Type: "t", Data: json.RawMessage(`["\\\\\u0000"]`)}}, `escape \u0000`},
		{"NUL escape in a key", []worker.Event{{StreamID: stream, Type: "t", Data: json.RawMessage(`{"\u0000":1}`)}}, `escape \u0000`},
		{"data not UTF-8", []worker.Event{{StreamID: stream, Type: "t", Data: json.RawMessage("[\"\xff\xfe\"]")}}, "data is not valid UTF-8"},
		{"type not UTF-8", []worker.Event{{StreamID: stream, Type: "t\xff"}}, "type is not valid UTF-8"},
		{"NUL in type", []worker.Event{{StreamID: stream, Type: "t\x00u"}}, "type contains a NUL byte"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := worker.Append(ctx, testDB.Pool, tc.events...)
			require.ErrorIs(t, err, locker.ErrInvalidArgument)
			require.ErrorContains(t, err, tc.want)
		})
	}
	stored, err := pgq.New(testDB.Pool).EventsForStream(ctx, stream)
	require.NoError(t, err)
	require.Empty(t, stored, "nothing written")

	// An escaped backslash before u0000 is no escape of NUL: stored as written.
	literal := worker.Event{StreamID: uuid.New(), Type: "t", Data: json.RawMessage(`{"path":"C:\\u0000"}`)}
	require.NoError(t, worker.Append(ctx, testDB.Pool, literal))
	kept, err := pgq.New(testDB.Pool).EventsForStream(ctx, literal.StreamID)
	require.NoError(t, err)
	require.Len(t, kept, 1)
	require.JSONEq(t, string(literal.Data), string(kept[0].Data))

	ev := worker.Event{ID: uuid.Must(uuid.NewV7()), StreamID: stream, Type: "t"}
	require.NoError(t, worker.Append(ctx, testDB.Pool, ev))
	other := worker.Event{StreamID: stream, Type: "t"}
	err = worker.Append(ctx, testDB.Pool, other, ev)
	require.ErrorIs(t, err, worker.ErrDuplicateEvent)
	stored, err = pgq.New(testDB.Pool).EventsForStream(ctx, stream)
	require.NoError(t, err)
	require.Len(t, stored, 1, "a batch with a stored ID writes nothing")
	require.ErrorIs(t, worker.Append(ctx, nil, ev), locker.ErrInvalidArgument)
}

func TestNewValidatesConfig(t *testing.T) {
	t.Parallel()
	p := ledgerPerspective("cfg")
	cases := []struct {
		name string
		cfg  worker.Config
		want string
		is   error
	}{
		{"no perspectives", worker.Config{}, "Perspectives is empty", worker.ErrInvalidConfig},
		{"nil perspective", worker.Config{Perspectives: []worker.Perspective{nil}}, "Perspectives[0] is nil", worker.ErrInvalidConfig},
		{"empty name", worker.Config{Perspectives: []worker.Perspective{ledgerPerspective("")}}, "perspective name is empty", worker.ErrInvalidConfig},
		{"duplicate name", worker.Config{Perspectives: []worker.Perspective{p, ledgerPerspective("cfg")}}, `name "cfg" is used twice`, worker.ErrInvalidConfig},
		{"name too long for its build keys", worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(strings.Repeat("é", worker.MaxPerspectiveNameLength+1))}},
			"name is 178 characters, more than 177", worker.ErrInvalidConfig},
		{"lock options", worker.Config{Perspectives: []worker.Perspective{p}, LockOptions: locker.Options{LockTimeout: 10 * time.Second, KeepAliveInterval: 5 * time.Second}}, "KeepAliveInterval (5s)", locker.ErrInvalidOptions},
		{"negative batch", worker.Config{Perspectives: []worker.Perspective{p}, BatchSize: -1}, "BatchSize must be between 1 and 10000, got -1", worker.ErrInvalidConfig},
		{"huge batch", worker.Config{Perspectives: []worker.Perspective{p}, BatchSize: 10001}, "BatchSize", worker.ErrInvalidConfig},
		{"negative poll", worker.Config{Perspectives: []worker.Perspective{p}, PollInterval: -time.Second}, "PollInterval must not be negative, got -1s", worker.ErrInvalidConfig},
		{"negative snapshots", worker.Config{Perspectives: []worker.Perspective{p}, Snapshots: worker.SnapshotOptions{EveryNEvents: -1}}, "Snapshots.EveryNEvents", worker.ErrInvalidConfig},
		{"negative retention", worker.Config{Perspectives: []worker.Perspective{p}, Snapshots: worker.SnapshotOptions{MaxPerStream: -2}}, "Snapshots.MaxPerStream", worker.ErrInvalidConfig},
		{"lock options differ from the locker's", worker.Config{Perspectives: []worker.Perspective{p}, Locker: newLocker(t, locker.Options{LockTimeout: 5 * time.Second, KeepAliveInterval: time.Second}), LockOptions: locker.Options{LockTimeout: 30 * time.Second}}, "LockOptions (LockTimeout 30s, KeepAliveInterval 10s) differ from the locker's (LockTimeout 5s, KeepAliveInterval 1s)", worker.ErrInvalidConfig},
		{"negative concurrency", worker.Config{Perspectives: []worker.Perspective{p}, Concurrency: -1}, "Concurrency must be between 1 and 64, got -1", worker.ErrInvalidConfig},
		{"huge concurrency", worker.Config{Perspectives: []worker.Perspective{p}, Concurrency: 65}, "Concurrency must be between 1 and 64, got 65", worker.ErrInvalidConfig},
		{"negative group size", worker.Config{Perspectives: []worker.Perspective{p}, GroupSize: -1}, "GroupSize must be between 1 and 1000, got -1", worker.ErrInvalidConfig},
		{"huge group size", worker.Config{Perspectives: []worker.Perspective{p}, GroupSize: 1001}, "GroupSize must be between 1 and 1000, got 1001", worker.ErrInvalidConfig},
		{"backoff order", worker.Config{Perspectives: []worker.Perspective{p}, RetryBackoff: time.Minute, MaxRetryBackoff: time.Second}, "MaxRetryBackoff (1s) must not be less than RetryBackoff (1m0s)", worker.ErrInvalidConfig},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			w, err := worker.New(testDB.Pool, tc.cfg)
			require.Nil(t, w)
			require.ErrorIs(t, err, tc.is)
			require.ErrorContains(t, err, tc.want)
		})
	}
	_, err := worker.New(nil, worker.Config{Perspectives: []worker.Perspective{p}})
	require.ErrorIs(t, err, worker.ErrInvalidConfig)
	require.ErrorContains(t, err, "pool is nil")
	_, err = worker.New(testDB.Pool, worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(strings.Repeat("é", worker.MaxPerspectiveNameLength))}})
	require.NoError(t, err, "the longest name")
	require.LessOrEqual(t, len([]rune(worker.BuildKey(strings.Repeat("é", worker.MaxPerspectiveNameLength), math.MaxInt32, math.MaxInt32))),
		locker.MaxPerspectiveNameLength, "its longest build key fits in a stream lock")
	w, err := worker.New(testDB.Pool, worker.Config{Perspectives: []worker.Perspective{p}})
	require.NoError(t, err)
	require.Equal(t, uuid.Version(7), w.InstanceID().Version(), "a zero InstanceID becomes a UUIDv7")
}

func TestStopIsIdempotentAndReleasesLocks(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := uniqueName("stop")
	lk := newLocker(t, locker.Options{})
	gated := newGated(name)
	w, err := worker.New(testDB.Pool, worker.Config{Perspectives: []worker.Perspective{gated}, Locker: lk, Logger: quietLogger(), PollInterval: 20 * time.Millisecond})
	require.NoError(t, err)
	require.NoError(t, w.Start(ctx))

	stream := uuid.New()
	ids := newIDs(t, 4)
	all := events(stream, ids)
	require.NoError(t, worker.Append(ctx, testDB.Pool, all[1:]...))
	waitModel(t, ctx, name, stream, 3)
	entered, release := gated.arm(ids[1])
	require.NoError(t, worker.Append(ctx, testDB.Pool, all[0]))
	<-entered
	_, held, err := lk.Get(ctx, stream, name)
	require.NoError(t, err)
	require.True(t, held, "the rewind holds the lock")

	stopped := make(chan error, 1)
	go func() { stopped <- w.Stop(ctx) }()
	release()
	require.NoError(t, <-stopped)
	require.NoError(t, w.Stop(ctx), "Stop is idempotent")
	_, held, err = lk.Get(ctx, stream, name)
	require.NoError(t, err)
	require.False(t, held, "Stop leaves no lock held")
	require.Error(t, w.Start(ctx), "a stopped worker does not restart")
}

func TestAppendWakesIdleWorker(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := uniqueName("wake")
	// Polling every hour: only the notification can bring the events in time.
	// Its listening session is named (application_name), so that the test ends that session
	// and no other: through a pooler, a pooled session may show another test's LISTEN as its
	// last query while a third test uses it. Directly, the notifier's own session is opened
	// with the pool's settings, so it carries the pool's application_name.
	cfg := worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(name)}, PollInterval: time.Hour, Logger: quietLogger()}
	// A pool of its own: the process's notifier is one per pool, and on the package's pool
	// another test's worker may have opened its session already.
	pc, err := pgxpool.ParseConfig(testDB.URL)
	require.NoError(t, err)
	pc.ConnConfig.RuntimeParams["application_name"] = name
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	require.NoError(t, err)
	t.Cleanup(pool.Close) // after the worker's stop (cleanups run last first)
	if testDB.DirectURL != testDB.URL {
		// Through a pooler, the notifier listens on ListenConnect's direct session.
		cfg.ListenConnect = func(ctx context.Context) (*pgx.Conn, error) {
			cc, err := pgx.ParseConfig(testDB.DirectURL)
			if err != nil {
				return nil, err
			}
			cc.RuntimeParams["application_name"] = name
			return pgx.ConnectConfig(ctx, cc)
		}
	}
	startWorkerWith(t, pool, cfg)
	stream := uuid.New()
	evs := events(stream, newIDs(t, 3))
	time.Sleep(50 * time.Millisecond) // let the first (immediate) poll pass
	require.NoError(t, worker.Append(ctx, testDB.Pool, evs[1:]...))
	waitModel(t, ctx, name, stream, 2)
	require.NoError(t, worker.Append(ctx, testDB.Pool, evs[0]), "a late event is also announced")
	require.Equal(t, expectedLedger(t, evs), waitModel(t, ctx, name, stream, 3))

	// The listening session is killed: the worker subscribes again and keeps being woken.
	var killed int
	require.NoError(t, testDB.Pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity
		WHERE datname = current_database() AND application_name = $1 AND pid <> pg_backend_pid()
		  AND query LIKE '%LISTEN wh_perspective_events%'`, name).Scan(&killed))
	require.Positive(t, killed, "the listening session was found and terminated")
	other := uuid.New()
	more := events(other, newIDs(t, 2))
	require.NoError(t, worker.Append(ctx, testDB.Pool, more...))
	require.Equal(t, expectedLedger(t, more), waitModel(t, ctx, name, other, 2))
}

// A long rewind occupies one of the instance's slots; other pairs go on meanwhile.
func TestOtherStreamsProceedDuringLongRewind(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := uniqueName("isolation")
	gated := newGated(name)
	startWorker(t, worker.Config{Perspectives: []worker.Perspective{gated}, Locker: newLocker(t, locker.Options{})})

	slow := uuid.New()
	ids := newIDs(t, 4)
	all := events(slow, ids)
	require.NoError(t, worker.Append(ctx, testDB.Pool, all[1:]...))
	waitModel(t, ctx, name, slow, 3)
	entered, release := gated.arm(ids[2])
	defer release()
	require.NoError(t, worker.Append(ctx, testDB.Pool, all[0]))
	<-entered // the rewind of slow is stuck mid-replay

	for range 3 {
		other := uuid.New()
		evs := events(other, newIDs(t, 5))
		require.NoError(t, worker.Append(ctx, testDB.Pool, evs...))
		require.Equal(t, expectedLedger(t, evs), waitModel(t, ctx, name, other, 5), "applied while the rewind is stuck")
	}
	release()
	require.Equal(t, expectedLedger(t, all), waitModel(t, ctx, name, slow, 4))
}

// An event appended while its pair is being applied is not claimed by the claim that its
// wake-up triggers (the pair is leased); the job's release makes the pair due again at that
// event, and the slot freed by that work claims again, so the event does not wait for the
// next PollInterval (10 minutes here).
func TestEventAppendedWhilePairInFlightIsAppliedWithoutWaitingForPoll(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := uniqueName("inflight")
	gated := newGated(name)
	w := startWorker(t, worker.Config{Perspectives: []worker.Perspective{gated}, PollInterval: 10 * time.Minute})
	waitCaughtUp(t, ctx, name) // the events go through the queue, not the build's catch-up

	stream := uuid.New()
	all := events(stream, newIDs(t, 2))
	release := appendHeld(t, ctx, gated, all[0])
	defer release()
	require.NoError(t, worker.Append(ctx, testDB.Pool, all[1]))
	// Let that Append's wake-up and its claim run while the pair is still in flight (were
	// they later, the claim would simply find the event).
	time.Sleep(300 * time.Millisecond)
	w.Notify() // a claim long after it
	time.Sleep(100 * time.Millisecond)
	release()
	require.Equal(t, expectedLedger(t, all), waitModel(t, ctx, name, stream, 2))
}

// A pair with more queued events than BatchSize is applied BatchSize events per
// transaction, one transaction after the other, without waiting for a poll in between.
func TestPairWithMoreThanBatchSizeEventsDrainsWithoutWaitingForPolls(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := uniqueName("batches")
	w := startWorker(t, worker.Config{
		Perspectives: []worker.Perspective{ledgerPerspective(name)},
		BatchSize:    10,
		PollOnly:     true, // no wake-up from Append: only Notify below, then the worker's own
		PollInterval: 10 * time.Minute,
	})

	stream := uuid.New()
	all := events(stream, newIDs(t, 55))
	require.NoError(t, worker.Append(ctx, testDB.Pool, all...))
	w.Notify()
	require.Equal(t, expectedLedger(t, all), waitModel(t, ctx, name, stream, len(all)))
}

// Pairs whose jobs leave rows queued, BatchSize at a time, are drained at once, with a poll
// only once a minute: each job's release leaves its pair due at its oldest row left, and the
// slot it frees claims again.
func TestPairsLeftQueuedAreClaimedAgainBeforeTheNextFullClaim(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := uniqueName("left")
	cfg := minutePollConfig(name, 4, 3, 2)
	// A first worker registers the perspective, and stops once its build is active (caught
	// up: the events appended next are queued, not read by a catch-up).
	w0, err := worker.New(testDB.Pool, cfg)
	require.NoError(t, err)
	require.NoError(t, w0.Start(ctx))
	waitCaughtUp(t, ctx, name)
	require.NoError(t, w0.Stop(ctx))

	streams := make([]uuid.UUID, 12)
	evs := make([][]worker.Event, len(streams))
	for i := range streams {
		streams[i] = uuid.New()
		evs[i] = events(streams[i], newIDs(t, 4*i+1)) // 1 … 45 events: up to 12 batches
		require.NoError(t, worker.Append(ctx, testDB.Pool, evs[i]...))
	}
	startWorker(t, cfg)
	for i, s := range streams {
		require.Equal(t, expectedLedger(t, evs[i]), waitModel(t, ctx, name, s, len(evs[i])))
	}
}

// Three instances, a one-minute poll, small batches, and sixteen goroutines appending to 20
// streams for a second and a half (late events among them: IDs taken before a concurrent
// Append's to the same stream). Every event is applied well before the next poll: no pair
// is left without a due row, nor waiting for a poll.
func TestConcurrentAppendsToSeveralInstancesDrainBeforeAFullClaim(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := uniqueName("concurrent")
	cfg := minutePollConfig(name, 5, 10, 3)
	startWorker(t, cfg)
	waitCaughtUp(t, ctx, name)
	startWorker(t, cfg)
	startWorker(t, cfg)

	streams := make([]uuid.UUID, 20)
	for i := range streams {
		streams[i] = uuid.New()
	}
	var mu sync.Mutex
	all := map[uuid.UUID][]worker.Event{}
	var wg sync.WaitGroup
	deadline := time.Now().Add(1500 * time.Millisecond)
	for g := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := g; time.Now().Before(deadline); i += 7 {
				s := streams[i%len(streams)]
				evs := events(s, newIDs(t, 1+i%4))
				if err := worker.Append(ctx, testDB.Pool, evs...); err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				all[s] = append(all[s], evs...)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	require.Len(t, all, len(streams))
	for s, evs := range all {
		require.Equal(t, expectedLedger(t, evs), waitModel(t, ctx, name, s, len(evs)))
	}
}

// An Append inside a transaction that began before a claim and committed after it made its
// pair due at the transaction's start, while it was not visible to that claim. Its
// notification wakes the worker, whose next claim finds it (a one-minute poll here).
func TestAppendCommittedAfterAClaimPassedItsDueTimeIsAppliedBeforeAFullClaim(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := uniqueName("late-commit")
	w := startWorker(t, minutePollConfig(name, 10, 10, 2))
	waitCaughtUp(t, ctx, name)

	slow := events(uuid.New(), newIDs(t, 2))
	tx, err := testDB.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	require.NoError(t, worker.Append(ctx, tx, slow...)) // due at the transaction's start
	time.Sleep(100 * time.Millisecond)
	passThem(t, ctx, w, name)
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, expectedLedger(t, slow), waitModel(t, ctx, name, slow[0].StreamID, len(slow)))
}

// An Append that adds rows to a pair while a job applies it (the pair's due row leased), and
// commits after the job has ended and released the pair: the release left the due row (the
// Append held it), and the Append's notification wakes the worker, whose next claim finds it.
func TestAppendJoiningAGroupCommittedAfterItsJobIsAppliedBeforeAFullClaim(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := uniqueName("late-join")
	gated := newGated(name)
	cfg := minutePollConfig(name, 10, 10, 2)
	cfg.Perspectives = []worker.Perspective{gated}
	w := startWorker(t, cfg)
	waitCaughtUp(t, ctx, name)

	stream := uuid.New()
	all := events(stream, newIDs(t, 2))
	release := appendHeld(t, ctx, gated, all[0])
	defer release()
	tx, err := testDB.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	require.NoError(t, worker.Append(ctx, tx, all[1])) // holds the pair's due row
	var leased bool
	require.NoError(t, tx.QueryRow(ctx, `SELECT leased_by IS NOT NULL FROM wh_perspective_pairs
		WHERE stream_id = $1 AND perspective_name IN (
			SELECT build_key FROM wh_perspective_builds WHERE perspective_name = $2)`, stream, name).Scan(&leased))
	require.True(t, leased, "the Append joined a pair being applied")
	release()
	waitModel(t, ctx, name, stream, 1)
	time.Sleep(100 * time.Millisecond) // the job has ended and released the pair
	passThem(t, ctx, w, name)
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, expectedLedger(t, all), waitModel(t, ctx, name, stream, len(all)))
}

// passThem queues an event of a new stream for the perspective's active build, as Append
// would but without its lock (behind a registration that waits for the test's open
// transaction, it would wait too), wakes w and waits until the event is applied: a claim
// ran after the open transaction's rows were queued, and did not see them.
func passThem(t *testing.T, ctx context.Context, w *worker.Worker, name string) {
	t.Helper()
	ev := events(uuid.New(), newIDs(t, 1))[0]
	_, err := testDB.Pool.Exec(ctx, `WITH b AS (
			SELECT build_key FROM wh_perspective_builds WHERE perspective_name = $4 AND state = 'active'
		), e AS (
			INSERT INTO wh_event_store (event_id, stream_id, event_type, data) VALUES ($1, $2, $3, $5::jsonb)
		), c AS (
			INSERT INTO wh_perspective_cursors (stream_id, perspective_name) SELECT $2, build_key FROM b
		), d AS (
			INSERT INTO wh_perspective_pairs (stream_id, perspective_name, due_at) SELECT $2, build_key, now() FROM b
		)
		INSERT INTO wh_perspective_events (stream_id, perspective_name, event_id)
		SELECT $2, build_key, $1 FROM b`, pgq.Args([]any{ev.ID, ev.StreamID, ev.Type, name, string(ev.Data)})...)
	require.NoError(t, err)
	w.Notify()
	waitModel(t, ctx, name, ev.StreamID, 1)
}

// appendHeld arms gated at ev, appends ev and waits until its Apply has begun (and stopped
// there); the returned function lets it go on.
func appendHeld(t *testing.T, ctx context.Context, gated *gatedPerspective, ev worker.Event) (release func()) {
	t.Helper()
	entered, release := gated.arm(ev.ID)
	require.NoError(t, worker.Append(ctx, testDB.Pool, ev))
	select {
	case <-entered:
	case <-time.After(20 * time.Second):
		release()
		t.Fatal("the event was not applied")
	}
	return release
}

// A hot stream is applied BatchSize events per transaction, and a pair whose batch was full
// keeps the lease of its claim for its next batch: the third batch runs under the lease the
// first was claimed with. An event queued late while such a chain runs (older than the
// cursor, so below where a continuation reads) stays queued while the chain goes on, is
// found when the pair is claimed again, and rewound: the model ends as the fold of every
// event in ID order.
func TestAHotPairKeepsItsLeaseAcrossBatchesAndALateEventIsRewound(t *testing.T) {
	t.Parallel()
	ctx := waitCtx(t)
	name := uniqueName("hotchain")
	gated := newGated(name)
	stream := uuid.New()
	ids := newIDs(t, 1001)
	all := events(stream, ids)
	lease := func() (due time.Time, by uuid.UUID) {
		t.Helper()
		require.NoError(t, testDB.Pool.QueryRow(ctx, `SELECT due_at, leased_by FROM wh_perspective_pairs
			WHERE stream_id = $1 AND perspective_name = $2`, stream, name).Scan(&due, &by))
		return due, by
	}
	inFirst, releaseFirst := gated.arm(ids[51]) // in the first batch (ids[1] … ids[100])
	defer releaseFirst()
	w := startWorker(t, worker.Config{Perspectives: []worker.Perspective{gated}})
	waitCaughtUp(t, ctx, name)                                      // the events go through the queue, not the catch-up
	require.NoError(t, worker.Append(ctx, testDB.Pool, all[1:]...)) // 1,000 events; ids[0] comes late
	waitEntered(t, inFirst, "the first batch")
	firstDue, firstBy := lease()
	require.Equal(t, w.InstanceID(), firstBy, "leased by the worker applying it")

	inThird, releaseThird := gated.arm(ids[251]) // in the third (ids[201] … ids[300])
	defer releaseThird()
	releaseFirst()
	waitEntered(t, inThird, "the third batch")
	thirdDue, thirdBy := lease()
	require.Equal(t, firstBy, thirdBy)
	require.True(t, firstDue.Equal(thirdDue), "the lease of the first claim (to %v) is kept, not claimed again (to %v)", firstDue, thirdDue)

	require.NoError(t, worker.Append(ctx, testDB.Pool, all[0])) // late: older than the cursor
	inFifth, releaseFifth := gated.arm(ids[451])                // in the fifth (ids[401] … ids[500])
	defer releaseFifth()
	releaseThird()
	waitEntered(t, inFifth, "the fifth batch")
	// The fourth batch was read above the cursor, past the late event: applied, not rewound.
	var at uuid.UUID
	require.NoError(t, testDB.Pool.QueryRow(ctx, `SELECT last_event_id FROM wh_perspective_cursors
		WHERE stream_id = $1 AND perspective_name = $2`, stream, name).Scan(&at))
	require.Equal(t, ids[400], at, "the fourth batch committed on the normal path")
	require.Contains(t, queued(t, ctx, name, stream), ids[0], "the late event waits for the next claim")
	releaseFifth()
	require.NoError(t, worker.WaitFor(ctx, testDB.Pool, name, stream, ids[0]))
	require.NoError(t, worker.WaitFor(ctx, testDB.Pool, name, stream, ids[1000]))
	m, ok := loadLedger(t, ctx, name, stream)
	require.True(t, ok)
	require.Equal(t, expectedLedger(t, all), m, "every event once, in ID order")
	require.Empty(t, queued(t, ctx, name, stream))
}

// waitEntered waits for a gated Apply to be reached.
func waitEntered(t *testing.T, entered <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-entered:
	case <-time.After(20 * time.Second):
		t.Fatalf("%s was not applied", what)
	}
}
