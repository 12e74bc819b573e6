package worker_test

// Read-your-writes: WaitFor against running workers.

import (
	"context"
	"encoding/json"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/db"
	"github.com/perspectives-go/perspectives/internal/pgtest"
	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/worker"
)

// waitStats counts the checks of a WaitFor: made while subscribed, or without (the first
// one, and every poll behind a pooler).
type waitStats struct{ listening, polled atomic.Int32 }

// waitAsync runs WaitFor in the background with its safety re-check an hour away, so that
// only a notification (or, behind a pooler, polling) can end its wait. It returns once
// WaitFor is waiting: it has made its check after subscribing (behind a pooler, its first
// poll).
func waitAsync(t *testing.T, pool *pgxpool.Pool, name string, stream, event uuid.UUID) (<-chan error, *waitStats) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	st := &waitStats{}
	waiting := make(chan struct{})
	var once sync.Once
	res := make(chan error, 1)
	go func() {
		res <- worker.WaitForWith(ctx, pool, name, stream, event, worker.WaitOptions{
			Recheck: time.Hour,
			Checked: func(listening bool) {
				if listening {
					st.listening.Add(1)
				} else {
					st.polled.Add(1)
				}
				if st.listening.Load()+st.polled.Load() >= 2 {
					once.Do(func() { close(waiting) })
				}
			},
		})
	}()
	select {
	case <-waiting:
	case err := <-res:
		t.Fatalf("WaitFor returned before the event could be in the model: %v", err)
	case <-time.After(20 * time.Second):
		t.Fatal("WaitFor did not start waiting within 20s")
	}
	return res, st
}

// waitResult is the result of waitAsync's WaitFor, which must come within a generous bound.
func waitResult(t *testing.T, res <-chan error) error {
	t.Helper()
	select {
	case err := <-res:
		return err
	case <-time.After(30 * time.Second):
		t.Fatal("WaitFor did not return within 30s, and its safety re-check is an hour away: no notification woke it")
		return nil
	}
}

// requireWokenAs checks how WaitFor waited on d: subscribed to the workers' notification,
// or, behind a transaction pooler, polling unless it found the pool's notifier on the
// session of the worker's ListenConnect (the tests' workers give one behind a pooler; a
// WaitFor that subscribes before its worker does finds none).
func requireWokenAs(t *testing.T, d *pgtest.DB, st *waitStats) {
	t.Helper()
	if d.URL != d.DirectURL && st.listening.Load() == 0 {
		require.Greater(t, st.polled.Load(), int32(1), "behind a pooler with no ListenConnect's session, WaitFor polls")
		return
	}
	require.Positive(t, st.listening.Load(), "WaitFor checks after subscribing")
	require.Equal(t, int32(1), st.polled.Load(), "only the first check is made before LISTEN")
}

// shortWait is WaitFor bounded by a short deadline.
func shortWait(pool *pgxpool.Pool, name string, stream, event uuid.UUID) error {
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	return worker.WaitFor(ctx, pool, name, stream, event)
}

func waitCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// On a database of its own (notifications are the database's: other tests' could wake it).
func TestWaitForReturnsOnceTheWorkerAppliesTheEvent(t *testing.T) {
	t.Parallel()
	ctx := waitCtx(t)
	d := isolatedDB(t)
	name := uniqueName("waitfor")
	gated := newGated(name)
	startWorkerIn(t, d, worker.Config{Perspectives: []worker.Perspective{gated}})

	stream := uuid.New()
	ids := newIDs(t, 3)
	evs := events(stream, ids)
	require.NoError(t, worker.Append(ctx, d.Pool, evs[0]))
	require.NoError(t, worker.WaitFor(ctx, d.Pool, name, stream, ids[0]))
	require.Equal(t, expectedLedger(t, evs[:1]), loadLedgerIn(t, d, name, stream), "WaitFor returned: LoadModel has the event")

	entered, release := gated.arm(ids[2])
	defer release()
	require.NoError(t, worker.Append(ctx, d.Pool, evs[1:]...))
	select {
	case <-entered:
	case <-time.After(20 * time.Second):
		t.Fatal("the worker did not apply the events")
	}
	// The worker is inside the Apply of ids[2]: the event cannot be in the model yet.
	res, st := waitAsync(t, d.Pool, name, stream, ids[2])
	require.ErrorIs(t, shortWait(d.Pool, name, stream, ids[2]), context.DeadlineExceeded)
	release()
	require.NoError(t, waitResult(t, res))
	require.Equal(t, expectedLedger(t, evs), loadLedgerIn(t, d, name, stream), "the model LoadModel returns includes the event")
	requireWokenAs(t, d, st)
}

func TestWaitForReturnsAtOnceWhenApplied(t *testing.T) {
	t.Parallel()
	ctx := waitCtx(t)
	name := uniqueName("waitdone")
	startWorker(t, worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(name)}})
	stream := uuid.New()
	ids := newIDs(t, 2)
	require.NoError(t, worker.Append(ctx, testDB.Pool, events(stream, ids)...))
	waitModel(t, ctx, name, stream, 2)

	var checks []bool
	require.NoError(t, worker.WaitForWith(ctx, testDB.Pool, name, stream, ids[0], worker.WaitOptions{
		Checked: func(listening bool) { checks = append(checks, listening) },
	}))
	require.Equal(t, []bool{false}, checks, "one check, and no LISTEN")
}

func TestWaitForLateEventWaitsForItsRewind(t *testing.T) {
	t.Parallel()
	ctx := waitCtx(t)
	d := isolatedDB(t)
	name := uniqueName("waitlate")
	gated := newGated(name)
	startWorkerIn(t, d, worker.Config{Perspectives: []worker.Perspective{gated}, Locker: lockerIn(t, d, locker.Options{})})

	stream := uuid.New()
	ids := newIDs(t, 6)
	all := events(stream, ids)
	require.NoError(t, worker.Append(ctx, d.Pool, all[1:]...))
	waitModelIn(t, d, name, stream, 5)

	entered, release := gated.arm(ids[3])
	defer release()
	require.NoError(t, worker.Append(ctx, d.Pool, all[0])) // late: older than the cursor
	select {
	case <-entered:
	case <-time.After(20 * time.Second):
		t.Fatal("the rewind did not start")
	}
	// The rewind is replaying: the cursor is past ids[0], whose queue row stays until the
	// rewind commits.
	require.Equal(t, 1, lcCount(t, d, `SELECT count(*) FROM wh_perspective_cursors WHERE stream_id = $1 AND perspective_name = $2 AND last_event_id = $3`, stream, name, ids[5]))
	require.Equal(t, 1, lcCount(t, d, `SELECT count(*) FROM wh_perspective_events WHERE stream_id = $1 AND perspective_name = $2 AND event_id = $3`, stream, name, ids[0]))
	res, st := waitAsync(t, d.Pool, name, stream, ids[0])
	require.ErrorIs(t, shortWait(d.Pool, name, stream, ids[0]), context.DeadlineExceeded)
	release()
	require.NoError(t, waitResult(t, res))
	require.Equal(t, expectedLedger(t, all), loadLedgerIn(t, d, name, stream), "the rewind's model is served")
	requireWokenAs(t, d, st)
}

// loadLedgerIn is the ledger model LoadModel returns on d.
func loadLedgerIn(t *testing.T, d *pgtest.DB, name string, stream uuid.UUID) ledger {
	t.Helper()
	raw, ok, err := worker.LoadModel(context.Background(), d.Pool, name, stream)
	require.NoError(t, err)
	require.True(t, ok, "a model")
	var m ledger
	require.NoError(t, json.Unmarshal(raw, &m))
	return m
}

// stoppedPair registers name, applies the first of events and stops the worker: the rest,
// appended then, stay queued.
func stoppedPair(t *testing.T, ctx context.Context, name string, evs []worker.Event) {
	t.Helper()
	w := startWorker(t, worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(name)}})
	require.NoError(t, worker.Append(ctx, testDB.Pool, evs[0]))
	require.NoError(t, worker.WaitFor(ctx, testDB.Pool, name, evs[0].StreamID, evs[0].ID))
	require.NoError(t, w.Stop(ctx))
	require.NoError(t, worker.Append(ctx, testDB.Pool, evs[1:]...))
}

func TestWaitForParkedPair(t *testing.T) {
	t.Parallel()
	ctx := waitCtx(t)
	name := uniqueName("waitpark")
	stream := uuid.New()
	ids := newIDs(t, 3)
	stoppedPair(t, ctx, name, events(stream, ids))

	res, st := waitAsync(t, testDB.Pool, name, stream, ids[2])
	// Park the pair on ids[1], as the failure policy does: state and notification in one
	// transaction.
	tx, err := testDB.Pool.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `UPDATE wh_perspective_cursors
		SET status = 'parked', failed_event_id = $3, attempts = 8, last_error = 'poison event refused',
		    failed_since = now() - interval '2 minutes'
		WHERE stream_id = $1 AND perspective_name = $2`, stream, name, ids[1])
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `SELECT pg_notify('wh_applied', '')`)
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))

	err = waitResult(t, res)
	require.ErrorIs(t, err, worker.ErrParked)
	var pe *worker.ParkedError
	require.ErrorAs(t, err, &pe)
	require.Equal(t, stream, pe.Stream)
	require.Equal(t, name, pe.Perspective)
	require.Equal(t, 1, pe.Version)
	require.Equal(t, ids[1], pe.Event)
	require.Equal(t, 8, pe.Attempts)
	require.Equal(t, "poison event refused", pe.LastError)
	require.WithinDuration(t, time.Now().Add(-2*time.Minute), pe.Since, time.Minute)
	requireWokenAs(t, testDB, st)

	require.ErrorIs(t, worker.WaitFor(ctx, testDB.Pool, name, stream, ids[1]), worker.ErrParked, "at once, when already parked")
	require.NoError(t, worker.WaitFor(ctx, testDB.Pool, name, stream, ids[0]), "an event applied before the failing one is in the model")
}

func TestWaitForSkippedEvent(t *testing.T) {
	t.Parallel()
	ctx := waitCtx(t)
	name := uniqueName("waitskip")
	stream := uuid.New()
	ids := newIDs(t, 3)
	evs := events(stream, ids)
	stoppedPair(t, ctx, name, evs[:2])

	// Skip ids[1] as an operator does: unqueued and recorded.
	tx, err := testDB.Pool.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `DELETE FROM wh_perspective_events WHERE stream_id = $1 AND perspective_name = $2 AND event_id = $3`, stream, name, ids[1])
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `INSERT INTO wh_skipped_events (stream_id, perspective_name, event_id, skipped_by, reason, attempts, last_error)
		VALUES ($1, $2, $3, 'ops@example', 'operator', 8, 'poison event refused')`, stream, name, ids[1])
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	err = worker.WaitFor(ctx, testDB.Pool, name, stream, ids[1])
	require.ErrorIs(t, err, worker.ErrSkipped)
	require.Contains(t, err.Error(), "ops@example")

	// Once the cursor has passed it, the skipped event is still not in the model.
	require.NoError(t, worker.Append(ctx, testDB.Pool, evs[2]))
	startWorker(t, worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(name)}})
	require.NoError(t, worker.WaitFor(ctx, testDB.Pool, name, stream, ids[2]))
	m, _ := loadLedger(t, ctx, name, stream)
	require.Equal(t, []uuid.UUID{ids[0], ids[2]}, m.IDs)
	require.ErrorIs(t, worker.WaitFor(ctx, testDB.Pool, name, stream, ids[1]), worker.ErrSkipped)
}

func TestWaitForEndsWithTheContext(t *testing.T) {
	t.Parallel()
	ctx := waitCtx(t)
	name := uniqueName("waitctx")
	stream := uuid.New()
	ids := newIDs(t, 2)
	stoppedPair(t, ctx, name, events(stream, ids))

	require.ErrorIs(t, shortWait(testDB.Pool, name, stream, ids[1]), context.DeadlineExceeded)
	polling, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	require.ErrorIs(t, worker.WaitForWith(polling, testDB.Pool, name, stream, ids[1], worker.WaitOptions{PollOnly: true}), context.DeadlineExceeded)
	done, cancel := context.WithCancel(ctx)
	cancel()
	require.ErrorIs(t, worker.WaitFor(done, testDB.Pool, name, stream, ids[1]), context.Canceled)
}

// Polling, WaitFor waits PollMin before its second check and doubles the wait after each
// check that finds nothing, up to PollMax: the waits between checks never fall short of
// that schedule, and capped at PollMax the checks keep coming (doubling without a cap would
// make some six in the second).
func TestWaitForPollsOnADoublingScheduleUpToItsMaximum(t *testing.T) {
	t.Parallel()
	ctx := waitCtx(t)
	name := uniqueName("waitsched")
	stream := uuid.New()
	ids := newIDs(t, 2)
	stoppedPair(t, ctx, name, events(stream, ids))

	const pollMin, pollMax = 10 * time.Millisecond, 40 * time.Millisecond
	var checks []time.Time
	bounded, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	err := worker.WaitForWith(bounded, testDB.Pool, name, stream, ids[1], worker.WaitOptions{
		PollOnly: true, PollMin: pollMin, PollMax: pollMax,
		Checked: func(bool) { checks = append(checks, time.Now()) },
	})
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.GreaterOrEqual(t, len(checks), 10, "capped at PollMax, the checks keep coming")
	want := pollMin
	for i := 1; i < len(checks); i++ {
		require.GreaterOrEqual(t, checks[i].Sub(checks[i-1]), want, "the wait before check %d", i+1)
		want = min(2*want, pollMax)
	}
}

// Cancelled while it waits for a notification, WaitFor gives its connection back to the
// pool, unsubscribed and reusable. On a database of its own (no other test's notification
// wakes it) and a pool of one connection.
func TestWaitForGivesItsConnectionBack(t *testing.T) {
	t.Parallel()
	ctx := waitCtx(t)
	d := isolatedDB(t)
	name := uniqueName("waitconn")
	stream := uuid.New()
	ids := newIDs(t, 2)
	w := startWorkerIn(t, d, worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(name)}})
	require.NoError(t, worker.Append(ctx, d.Pool, events(stream, ids[:1])...))
	require.NoError(t, worker.WaitFor(ctx, d.Pool, name, stream, ids[0]))
	require.NoError(t, w.Stop(ctx))
	require.NoError(t, worker.Append(ctx, d.Pool, events(stream, ids)[1]))

	cfg, err := pgxpool.ParseConfig(d.URL)
	require.NoError(t, err)
	cfg.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	defer pool.Close()
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	checks := 0
	err = worker.WaitForWith(wctx, pool, name, stream, ids[1], worker.WaitOptions{
		Recheck: time.Hour,
		Checked: func(bool) {
			if checks++; checks == 2 { // subscribed (behind a pooler: polling) and checked
				cancel()
			}
		},
	})
	require.ErrorIs(t, err, context.Canceled)
	require.Equal(t, 2, checks)
	require.Zero(t, pool.Stat().AcquiredConns())
	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	rows, err := conn.Query(ctx, `SELECT pg_listening_channels()`)
	require.NoError(t, err)
	channels, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.NotContains(t, channels, "wh_applied")
	require.Equal(t, int64(1), pool.Stat().NewConnsCount(), "the connection was reused, not replaced")
}

func TestWaitForRefusesBadInput(t *testing.T) {
	t.Parallel()
	ctx := waitCtx(t)
	name := uniqueName("waitbad")
	stream := uuid.New()
	ids := newIDs(t, 1)
	startWorker(t, worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(name)}})
	require.NoError(t, worker.Append(ctx, testDB.Pool, events(stream, ids)...))

	for _, tc := range []struct {
		name   string
		pool   *pgxpool.Pool
		pname  string
		stream uuid.UUID
		event  uuid.UUID
		want   string
	}{
		{"nil pool", nil, name, stream, ids[0], "pool is nil"},
		{"empty perspective", testDB.Pool, "", stream, ids[0], "perspective name is empty"},
		{"nil stream", testDB.Pool, name, uuid.Nil, ids[0], "stream ID is the nil UUID"},
		{"nil event", testDB.Pool, name, stream, uuid.Nil, "event ID is the nil UUID"},
		{"unregistered perspective", testDB.Pool, "nobody_" + name, stream, ids[0], `perspective "nobody_` + name + `" is not registered`},
		{"event of another stream", testDB.Pool, name, uuid.New(), ids[0], "is not stored in stream"},
		{"unknown event", testDB.Pool, name, stream, uuid.New(), "is not stored in stream"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := worker.WaitFor(ctx, tc.pool, tc.pname, tc.stream, tc.event)
			require.ErrorIs(t, err, locker.ErrInvalidArgument)
			require.ErrorContains(t, err, tc.want)
		})
	}
}

// A new perspective's first build is active at once: WaitFor returns when its catch-up
// has applied the event.
func TestWaitForNewPerspectiveWaitsForItsCatchUp(t *testing.T) {
	t.Parallel()
	ctx := waitCtx(t)
	d := isolatedDB(t)
	name := uniqueName("waitcatchup")
	stream := uuid.New()
	ids := newIDs(t, 3)
	evs := events(stream, ids)
	require.NoError(t, worker.Append(ctx, d.Pool, evs...))

	gated := newGated(name)
	entered, release := gated.arm(ids[2])
	defer release()
	startWorkerIn(t, d, worker.Config{Perspectives: []worker.Perspective{gated}})
	select {
	case <-entered:
	case <-time.After(20 * time.Second):
		t.Fatal("the catch-up did not start")
	}
	res, st := waitAsync(t, d.Pool, name, stream, ids[2])
	release()
	require.NoError(t, waitResult(t, res))
	require.Equal(t, expectedLedger(t, evs), loadLedgerIn(t, d, name, stream))
	requireWokenAs(t, d, st)
}

// WaitFor waits for the active version: a version that has the event but is not active
// does not count until its promotion, which wakes WaitFor.
func TestWaitForFollowsPromotion(t *testing.T) {
	t.Parallel()
	ctx := waitCtx(t)
	d := isolatedDB(t)
	name := uniqueName("waitpromote")
	stream := uuid.New()
	first := events(stream, newIDs(t, 3))
	require.NoError(t, worker.Append(ctx, d.Pool, first...))
	w1 := lcWorker(t, d, worker.Config{Perspectives: []worker.Perspective{newVLedger(name, 1)}})
	lcConverged(t, d, name, 1, 20*time.Second)
	lcStop(t, w1)

	more := events(stream, newIDs(t, 2))
	require.NoError(t, worker.Append(ctx, d.Pool, more...))
	last := more[1].ID
	lcWorker(t, d, worker.Config{Perspectives: []worker.Perspective{newVLedger(name, 2)}, ManualPromotion: true})
	v2 := worker.BuildKey(name, 2, 1)
	eventually(t, 20*time.Second, "version 2 has the event", func() bool {
		return lcCount(t, d, `SELECT count(*) FROM wh_perspective_cursors WHERE stream_id = $1 AND perspective_name = $2 AND last_event_id = $3`, stream, v2, last) == 1 &&
			lcCount(t, d, `SELECT count(*) FROM wh_perspective_events WHERE stream_id = $1 AND perspective_name = $2`, stream, v2) == 0 &&
			lcCount(t, d, `SELECT count(*) FROM wh_perspective_builds WHERE build_key = $1 AND catchup_done`, v2) == 1
	})
	require.ErrorIs(t, shortWait(d.Pool, name, stream, last), context.DeadlineExceeded, "version 1 is active and does not have it")

	res, st := waitAsync(t, d.Pool, name, stream, last)
	admin, err := worker.NewAdmin(d.Pool, nil)
	require.NoError(t, err)
	_, err = admin.Promote(ctx, name, 2)
	require.NoError(t, err)
	require.NoError(t, waitResult(t, res))
	m, ok := loadVLedger(t, ctx, d, name, stream)
	require.True(t, ok)
	require.Equal(t, 2, m.V)
	require.Contains(t, m.IDs, last)
	requireWokenAs(t, d, st)
}

// The check reads every table through an index lookup: its cost does not grow with the
// data. Sequential and bitmap scans are disabled, so that a table the statement could only
// scan shows as one.
func TestWaitCheckReadsByIndexLookups(t *testing.T) {
	t.Parallel()
	ctx := waitCtx(t)
	conn := planConnect(t, ctx, testDB)
	for _, set := range []string{"SET enable_seqscan = off", "SET enable_bitmapscan = off"} {
		_, err := conn.Exec(ctx, set)
		require.NoError(t, err)
	}
	call := planRecord(t, func(q *db.Queries) error {
		_, err := q.WaitCheck(ctx, db.WaitCheckParams{PerspectiveName: "plan", StreamID: uuid.New(), EventID: uuid.New()})
		return err
	})
	allowed := map[string][]string{
		"wh_perspectives":        {"wh_perspectives_pkey"},
		"wh_event_store":         {"wh_event_store_pkey", "wh_event_store_stream_idx"},
		"wh_perspective_builds":  {"wh_perspective_builds_one_active", "wh_perspective_builds_perspective_name_version_build_key"},
		"wh_perspective_cursors": planPairIndexes,
		"wh_perspective_events":  {"wh_perspective_events_pkey"},
		"wh_skipped_events":      {"wh_skipped_events_pkey"},
	}
	for _, mode := range []string{"force_generic_plan", "force_custom_plan"} {
		plan, err := planExplain(ctx, conn, mode, call)
		require.NoError(t, err)
		read := map[string]bool{}
		planNodes(plan, func(n map[string]any, _ []string) {
			table, ok := planIsRead(n)
			if !ok {
				return
			}
			read[table] = true
			typ, _ := n["Node Type"].(string)
			idx, _ := n["Index Name"].(string)
			require.Contains(t, []string{"Index Scan", "Index Only Scan"}, typ, "%s: %s", mode, planScan(n))
			require.Contains(t, allowed[table], idx, "%s: %s", mode, planScan(n))
			require.NotEmpty(t, n["Index Cond"], "%s: %s is a lookup", mode, planScan(n))
		})
		require.Len(t, read, len(allowed), "%s reads each table: %v", mode, read)
	}
}

// Where sessions cannot LISTEN (behind a pooler), WaitFor polls: it still returns once the
// event is in the model.
func TestWaitForPollsWithoutListen(t *testing.T) {
	t.Parallel()
	ctx := waitCtx(t)
	name := uniqueName("waitpoll")
	startWorker(t, worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(name)}})
	stream := uuid.New()
	ids := newIDs(t, 3)
	evs := events(stream, ids)
	require.NoError(t, worker.Append(ctx, testDB.Pool, evs...))
	var listening atomic.Int32
	require.NoError(t, worker.WaitForWith(ctx, testDB.Pool, name, stream, ids[2], worker.WaitOptions{
		PollOnly: true,
		Checked: func(l bool) {
			if l {
				listening.Add(1)
			}
		},
	}))
	require.Zero(t, listening.Load())
	m, _ := loadLedger(t, ctx, name, stream)
	require.Equal(t, expectedLedger(t, evs), m)
}

// With the worker's own failure policy: a poison event parks its pair (or, with the skip
// policy, is skipped), and WaitFor returns the pair's error; an event before the poison one
// is in the model.
func TestWaitForEndsWithTheFailurePolicy(t *testing.T) {
	t.Parallel()
	for _, skip := range []bool{false, true} {
		t.Run(map[bool]string{false: "park", true: "skip"}[skip], func(t *testing.T) {
			t.Parallel()
			ctx := waitCtx(t)
			d := isolatedDB(t)
			name := uniqueName("waitpolicy")
			stream := uuid.New()
			ids := newIDs(t, 3)
			evs := events(stream, ids)
			evs[1].Type = "poison"
			cfg := fastFailures(name, worker.FailurePolicy{Attempts: 2, Skip: skip})
			startWorkerIn(t, d, cfg)
			require.NoError(t, worker.Append(ctx, d.Pool, evs[0]))
			require.NoError(t, worker.WaitFor(ctx, d.Pool, name, stream, ids[0]))

			require.NoError(t, worker.Append(ctx, d.Pool, evs[1:]...))
			// Whether the policy acts before its first check or after, nothing but the
			// worker's notification (or, behind a pooler, polling) ends its wait.
			err := worker.WaitForWith(ctx, d.Pool, name, stream, ids[1], worker.WaitOptions{Recheck: time.Hour})
			if skip {
				require.ErrorIs(t, err, worker.ErrSkipped)
				require.NoError(t, worker.WaitFor(ctx, d.Pool, name, stream, ids[2]), "the events after a skipped one are applied")
			} else {
				require.ErrorIs(t, err, worker.ErrParked)
				var pe *worker.ParkedError
				require.ErrorAs(t, err, &pe)
				require.Equal(t, ids[1], pe.Event)
				require.Equal(t, 2, pe.Attempts)
				require.Contains(t, pe.LastError, "poison event refused")
				require.ErrorIs(t, worker.WaitFor(ctx, d.Pool, name, stream, ids[2]), worker.ErrParked, "events after the poison one wait behind it")
			}
			require.NoError(t, worker.WaitFor(ctx, d.Pool, name, stream, ids[0]))
		})
	}
}
