package worker_test

// Tests of the worker's Store on PostgreSQL (worker/pgstore*.go over queries/*.sql), method
// by method, through worker.NewPGStore: what each one reads, writes, refuses and leaves alone.
//
// The tests on the package's shared database work on perspective names of their own that no
// build registers (so no other test's Append queues anything for them or creates their cursor
// rows) and on fresh streams; they write their events, cursors, models, snapshots, stream locks
// and queue rows directly. The tests of builds (registration, catch-up, promotion, cleanup and
// a retired build's pairs) take a database of their own (isolatedDB): every Append queues for
// every build that is not retired, and their counts must be exact.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/db"
	"github.com/perspectives-go/perspectives/internal/pgq"
	"github.com/perspectives-go/perspectives/internal/pgtest"
	"github.com/perspectives-go/perspectives/worker"
)

// The failure backoff of the stores under test.
const (
	psRetryBase = 10 * time.Second
	psRetryMax  = 100 * time.Second
)

// psMaxUUID is the catch-up position of a stream passed whole.
var psMaxUUID = uuid.MustParse("ffffffff-ffff-ffff-ffff-ffffffffffff")

func psStore(d *pgtest.DB) worker.Store { return worker.NewPGStore(d.Pool, psRetryBase, psRetryMax) }

// psInsert stores the events as they are, without queueing them for anything.
func psInsert(t testing.TB, ctx context.Context, d *pgtest.DB, evs ...worker.Event) {
	t.Helper()
	for _, ev := range evs {
		gsExec(t, ctx, d.Pool, `INSERT INTO wh_event_store (event_id, stream_id, event_type, data) VALUES ($1, $2, $3, $4)`,
			ev.ID, ev.StreamID, ev.Type, string(ev.Data))
	}
}

// psEvents stores n new events of stream (see psInsert) and returns them in ID order.
func psEvents(t testing.TB, ctx context.Context, d *pgtest.DB, stream uuid.UUID, n int) []worker.Event {
	t.Helper()
	evs := events(stream, newIDs(t, n))
	psInsert(t, ctx, d, evs...)
	return evs
}

func psIDs(evs []worker.Event) []uuid.UUID {
	ids := make([]uuid.UUID, len(evs))
	for i, ev := range evs {
		ids[i] = ev.ID
	}
	return ids
}

func psNull(id uuid.UUID) uuid.NullUUID { return uuid.NullUUID{UUID: id, Valid: id != uuid.Nil} }

// psCursor creates or overwrites the pair's cursor row: position last (uuid.Nil: none),
// version and events since the last snapshot; everything else as a fresh row has it.
func psCursor(t testing.TB, ctx context.Context, d *pgtest.DB, p worker.Pair, last uuid.UUID, version int64, since int) {
	t.Helper()
	gsExec(t, ctx, d.Pool, `INSERT INTO wh_perspective_cursors (stream_id, perspective_name, last_event_id, version, events_since_snapshot)
		VALUES ($1, $2, $3, $4, $5)
		ON CONFLICT (stream_id, perspective_name) DO UPDATE
		SET last_event_id = EXCLUDED.last_event_id, version = EXCLUDED.version, events_since_snapshot = EXCLUDED.events_since_snapshot`,
		p.Stream, p.Perspective, psNull(last), version, since)
}

// psFailed marks the pair's cursor as failed, attempts times, retrying in an hour (its due
// row).
func psFailed(t testing.TB, ctx context.Context, d *pgtest.DB, p worker.Pair, attempts int) {
	t.Helper()
	gsExec(t, ctx, d.Pool, `UPDATE wh_perspective_cursors
		SET status = 'failed', attempts = $3, last_error = 'earlier failure'
		WHERE stream_id = $1 AND perspective_name = $2`, p.Stream, p.Perspective, attempts)
	gsExec(t, ctx, d.Pool, `INSERT INTO wh_perspective_pairs (stream_id, perspective_name, due_at)
		VALUES ($1, $2, now() + interval '1 hour')
		ON CONFLICT (stream_id, perspective_name) DO UPDATE SET due_at = EXCLUDED.due_at`, p.Stream, p.Perspective)
}

func psModel(t testing.TB, ctx context.Context, d *pgtest.DB, p worker.Pair, model string, last uuid.UUID) {
	t.Helper()
	gsExec(t, ctx, d.Pool, `INSERT INTO wh_perspective_models (stream_id, perspective_name, model, last_event_id) VALUES ($1, $2, $3, $4)`,
		p.Stream, p.Perspective, model, last)
}

func psSnapshot(t testing.TB, ctx context.Context, d *pgtest.DB, p worker.Pair, at uuid.UUID, model string) {
	t.Helper()
	gsExec(t, ctx, d.Pool, `INSERT INTO wh_perspective_snapshots (stream_id, perspective_name, snapshot_event_id, model) VALUES ($1, $2, $3, $4)`,
		p.Stream, p.Perspective, at, model)
}

// psQueue queues the events for the pair, in the order given.
func psQueue(t testing.TB, ctx context.Context, d *pgtest.DB, p worker.Pair, ids ...uuid.UUID) {
	t.Helper()
	for _, id := range ids {
		gsExec(t, ctx, d.Pool, `INSERT INTO wh_perspective_events (stream_id, perspective_name, event_id) VALUES ($1, $2, $3)`,
			p.Stream, p.Perspective, id)
	}
}

// psLock gives the pair's stream lock to holder, expiring after in (an interval: "1 hour",
// "-1 second") on the database clock: another writer, or a lapsed lease.
func psLock(t testing.TB, ctx context.Context, d *pgtest.DB, p worker.Pair, holder uuid.UUID, in string) {
	t.Helper()
	gsExec(t, ctx, d.Pool, `UPDATE wh_perspective_cursors
		SET stream_lock_instance_id = $3, stream_lock_expiry = clock_timestamp() + $4::interval, stream_lock_reason = 'rewind'
		WHERE stream_id = $1 AND perspective_name = $2`, p.Stream, p.Perspective, holder, in)
}

func psReadCursor(t testing.TB, ctx context.Context, d *pgtest.DB, p worker.Pair) gsCursor {
	t.Helper()
	var c gsCursor
	require.NoError(t, d.Pool.QueryRow(ctx, `
		SELECT c.last_event_id, c.version, c.events_since_snapshot, c.status, c.attempts, c.last_error,
		       (SELECT d.due_at FROM wh_perspective_pairs d
		        WHERE d.stream_id = c.stream_id AND d.perspective_name = c.perspective_name AND c.status = 'failed')
		FROM wh_perspective_cursors c WHERE c.stream_id = $1 AND c.perspective_name = $2`, p.Stream, p.Perspective).
		Scan(&c.LastEventID, &c.Version, &c.EventsSinceSnapshot, &c.Status, &c.Attempts, &c.LastError, &c.NextAttemptAt))
	return c
}

func psCursorExists(t testing.TB, ctx context.Context, d *pgtest.DB, p worker.Pair) bool {
	t.Helper()
	var ok bool
	require.NoError(t, d.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM wh_perspective_cursors
		WHERE stream_id = $1 AND perspective_name = $2)`, p.Stream, p.Perspective).Scan(&ok))
	return ok
}

// psCompact is JSON text without insignificant space (jsonb prints "a": 1).
func psCompact(t testing.TB, raw []byte) string {
	t.Helper()
	var b bytes.Buffer
	require.NoError(t, json.Compact(&b, raw), "%s", raw)
	return b.String()
}

// psModelOf is the pair's model (compact JSON) and the event it is at.
func psModelOf(t testing.TB, ctx context.Context, d *pgtest.DB, p worker.Pair) (string, uuid.UUID, bool) {
	t.Helper()
	var model []byte
	var at uuid.UUID
	err := d.Pool.QueryRow(ctx, `SELECT model::text, last_event_id FROM wh_perspective_models
		WHERE stream_id = $1 AND perspective_name = $2`, p.Stream, p.Perspective).Scan(&model, &at)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", uuid.Nil, false
	}
	require.NoError(t, err)
	return psCompact(t, model), at, true
}

// psSnapshots is the pair's snapshots: position → model (compact JSON).
func psSnapshots(t testing.TB, ctx context.Context, d *pgtest.DB, p worker.Pair) map[uuid.UUID]string {
	t.Helper()
	rows, err := d.Pool.Query(ctx, `SELECT snapshot_event_id, model::text FROM wh_perspective_snapshots
		WHERE stream_id = $1 AND perspective_name = $2`, p.Stream, p.Perspective)
	require.NoError(t, err)
	defer rows.Close()
	out := map[uuid.UUID]string{}
	for rows.Next() {
		var id uuid.UUID
		var model []byte
		require.NoError(t, rows.Scan(&id, &model))
		out[id] = psCompact(t, model)
	}
	require.NoError(t, rows.Err())
	return out
}

// psQueued is the pair's queued event IDs, ascending.
func psQueued(t testing.TB, ctx context.Context, d *pgtest.DB, p worker.Pair) []uuid.UUID {
	t.Helper()
	ids, err := pgq.New(d.Pool).QueueIDsForPair(ctx, db.QueueIDsForPairParams{StreamID: p.Stream, PerspectiveName: p.Perspective})
	require.NoError(t, err)
	return ids
}

// psRows is every row stored for a pair, as text (updated_at included): equal before and
// after an operation, the operation wrote nothing.
type psRows struct {
	Cursor    string
	Model     string
	Snapshots map[uuid.UUID]string
	Queue     map[uuid.UUID]string
}

func psRead(t testing.TB, ctx context.Context, d *pgtest.DB, p worker.Pair) psRows {
	t.Helper()
	r := psRows{Snapshots: map[uuid.UUID]string{}, Queue: map[uuid.UUID]string{}}
	one := func(sql string) string {
		var s string
		err := d.Pool.QueryRow(ctx, sql, p.Stream, p.Perspective).Scan(&s)
		if errors.Is(err, pgx.ErrNoRows) {
			return ""
		}
		require.NoError(t, err, sql)
		return s
	}
	many := func(sql string, into map[uuid.UUID]string) {
		rows, err := d.Pool.Query(ctx, sql, p.Stream, p.Perspective)
		require.NoError(t, err, sql)
		defer rows.Close()
		for rows.Next() {
			var id uuid.UUID
			var s string
			require.NoError(t, rows.Scan(&id, &s))
			into[id] = s
		}
		require.NoError(t, rows.Err())
	}
	r.Cursor = one(`SELECT c::text FROM wh_perspective_cursors c WHERE stream_id = $1 AND perspective_name = $2`)
	r.Model = one(`SELECT m::text FROM wh_perspective_models m WHERE stream_id = $1 AND perspective_name = $2`)
	many(`SELECT snapshot_event_id, s::text FROM wh_perspective_snapshots s WHERE stream_id = $1 AND perspective_name = $2`, r.Snapshots)
	many(`SELECT event_id, q::text FROM wh_perspective_events q WHERE stream_id = $1 AND perspective_name = $2`, r.Queue)
	return r
}

// psClock is the database clock.
func psClock(t testing.TB, ctx context.Context, d *pgtest.DB) time.Time {
	t.Helper()
	var now time.Time
	require.NoError(t, d.Pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&now))
	return now
}

// psLockedElsewhere reports whether another transaction holds a row lock on the pair's
// cursor row (a FOR UPDATE NOWAIT on it fails with lock_not_available).
func psLockedElsewhere(t testing.TB, ctx context.Context, d *pgtest.DB, p worker.Pair) bool {
	t.Helper()
	tx, err := d.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.Background()) }()
	_, err = tx.Exec(ctx, `SELECT 1 FROM wh_perspective_cursors
		WHERE stream_id = $1 AND perspective_name = $2 FOR UPDATE NOWAIT`, p.Stream, p.Perspective)
	if err == nil {
		return false
	}
	var pgErr *pgconn.PgError
	require.True(t, errors.As(err, &pgErr), "FOR UPDATE NOWAIT: %v", err)
	require.Equal(t, "55P03", pgErr.Code, "FOR UPDATE NOWAIT: %v", err)
	return true
}

// psLockWaiters is the number of sessions of d's database waiting for a heavyweight lock
// of the given kind (pg_stat_activity.wait_event: "advisory", "transactionid", …; "": any).
func psLockWaiters(t testing.TB, ctx context.Context, d *pgtest.DB, kind string) int {
	t.Helper()
	var n int
	require.NoError(t, d.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
		WHERE datname = current_database() AND wait_event_type = 'Lock' AND ($1 = '' OR wait_event = $1)`, kind).Scan(&n))
	return n
}

// psBuildRow is one row of wh_perspective_builds.
type psBuildRow struct {
	Perspective   string
	Version, N    int
	State         string
	CatchUpStream uuid.NullUUID
	CatchUpEvent  uuid.NullUUID
	Done          bool
	Events        int64
	Streams       int64
	Holder        uuid.NullUUID
	LeaseLive     bool
	DoneAt        *time.Time
	PromotedAt    *time.Time
	RetiredAt     *time.Time
	CleanedAt     *time.Time
}

func psBuild(t testing.TB, ctx context.Context, d *pgtest.DB, key string) psBuildRow {
	t.Helper()
	var b psBuildRow
	require.NoError(t, d.Pool.QueryRow(ctx, `SELECT perspective_name, version, build, state, catchup_stream_id, catchup_event_id,
			catchup_done, catchup_events, catchup_streams, catchup_holder, COALESCE(catchup_expiry > clock_timestamp(), false),
			catchup_done_at, promoted_at, retired_at, cleaned_at
		FROM wh_perspective_builds WHERE build_key = $1`, key).
		Scan(&b.Perspective, &b.Version, &b.N, &b.State, &b.CatchUpStream, &b.CatchUpEvent, &b.Done, &b.Events, &b.Streams,
			&b.Holder, &b.LeaseLive, &b.DoneAt, &b.PromotedAt, &b.RetiredAt, &b.CleanedAt), "build %s", key)
	return b
}

func psCount(t testing.TB, ctx context.Context, d *pgtest.DB, sql string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, d.Pool.QueryRow(ctx, sql, args...).Scan(&n), sql)
	return n
}

// psSortedStreams is n new stream IDs in ascending order (the order of a catch-up).
func psSortedStreams(n int) []uuid.UUID {
	out := make([]uuid.UUID, n)
	for i := range out {
		out[i] = uuid.New()
	}
	slices.SortFunc(out, func(a, b uuid.UUID) int { return bytes.Compare(a[:], b[:]) })
	return out
}

// Apply reads a pair's queued events above req.After's ID while its cursor is at that ID (a
// job following a full batch: a late event below it waits for the next claim's job), and
// from its lowest queued event when there is no bound or the cursor is elsewhere.
func TestPGStoreApplyReadsAboveTheBoundWhileTheCursorIsThere(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := isolatedDB(t)
	store := psStore(d)
	p := worker.Pair{Stream: uuid.New(), Perspective: uniqueName("ps_after")}
	ids := psIDs(psEvents(t, ctx, d, p.Stream, 5))
	psCursor(t, ctx, d, p, ids[2], 3, 3)
	psModel(t, ctx, d, p, `{}`, ids[2])
	psQueue(t, ctx, d, p, ids[1], ids[3], ids[4]) // ids[1] is late: below the cursor
	read := func(after map[worker.Pair]uuid.UUID) []uuid.UUID {
		t.Helper()
		var got []uuid.UUID
		_, err := store.Apply(ctx, worker.ApplyRequest{Pairs: []worker.Pair{p}, PerPair: 10, After: after},
			func(states []worker.PairState) []worker.PairWrite {
				require.Len(t, states, 1)
				got = psIDs(states[0].Events)
				return nil
			})
		require.NoError(t, err)
		return got
	}
	all := []uuid.UUID{ids[1], ids[3], ids[4]}
	require.Equal(t, all, read(nil), "no bound: from the lowest, the late event first")
	require.Equal(t, ids[3:], read(map[worker.Pair]uuid.UUID{p: ids[2]}), "the cursor at the bound: above it")
	require.Equal(t, all, read(map[worker.Pair]uuid.UUID{p: ids[3]}), "the cursor not at the bound (moved back, reset): from the lowest")
	require.Equal(t, all, read(map[worker.Pair]uuid.UUID{p: ids[0]}), "the cursor past the bound: from the lowest")
}

// Apply passes decide each locked pair's state: snapshot positions newest first, the
// holder of an unexpired stream lock only (an expired one is no holder), queued events and
// model; a retired build's pairs are neither passed nor locked.
func TestPGStoreApplyStatesSnapshotsLockHolderAndNoRetiredBuild(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := isolatedDB(t) // a build of its own, active for a while: no other test's Append may queue for it
	store := psStore(d)
	name := uniqueName("ps_state")
	retiring := uniqueName("ps_retiring")
	gsExec(t, ctx, d.Pool, `INSERT INTO wh_perspectives (perspective_name) VALUES ($1)`, retiring)
	gsExec(t, ctx, d.Pool, `INSERT INTO wh_perspective_builds (build_key, perspective_name, version, build, state, catchup_done)
		VALUES ($1, $1, 1, 1, 'active', true)`, retiring)

	snapped := worker.Pair{Stream: uuid.New(), Perspective: name}
	live := worker.Pair{Stream: uuid.New(), Perspective: name}
	expired := worker.Pair{Stream: uuid.New(), Perspective: name}
	unlocked := worker.Pair{Stream: uuid.New(), Perspective: name}
	retired := worker.Pair{Stream: uuid.New(), Perspective: retiring}

	evs := psEvents(t, ctx, d, snapped.Stream, 5)
	ids := psIDs(evs)
	psCursor(t, ctx, d, snapped, ids[2], 3, 2)
	psModel(t, ctx, d, snapped, `{"v":"at2"}`, ids[2])
	// Neither insertion order nor its reverse is newest first.
	for _, i := range []int{1, 2, 0} {
		psSnapshot(t, ctx, d, snapped, ids[i], fmt.Sprintf(`{"v":"snap%d"}`, i))
	}
	psSnapshot(t, ctx, d, worker.Pair{Stream: snapped.Stream, Perspective: name + "_other"}, ids[3], `{}`) // not the pair's
	psQueue(t, ctx, d, snapped, ids[4], ids[3])

	other := uuid.New()
	for _, p := range []worker.Pair{live, expired, unlocked, retired} {
		psCursor(t, ctx, d, p, uuid.Nil, 0, 0)
	}
	psLock(t, ctx, d, live, other, "1 hour")
	psLock(t, ctx, d, expired, other, "-1 second")
	psLock(t, ctx, d, retired, other, "1 hour")

	pairs := []worker.Pair{snapped, live, expired, unlocked, retired}
	apply := func(check func([]worker.PairState)) map[worker.Pair]worker.PairState {
		t.Helper()
		got := map[worker.Pair]worker.PairState{}
		calls := 0
		_, err := store.Apply(ctx, worker.ApplyRequest{Pairs: pairs, PerPair: 10}, func(states []worker.PairState) []worker.PairWrite {
			calls++
			for _, st := range states {
				got[st.Pair] = st
			}
			check(states)
			return nil
		})
		require.NoError(t, err)
		require.Equal(t, 1, calls, "decide is called once")
		return got
	}

	// The control: while its build is active, the pair of the retiring build is passed.
	got := apply(func([]worker.PairState) {})
	require.Contains(t, got, retired, "a pair of an active build is passed")
	require.Equal(t, other, got[retired].LockHolder)

	gsExec(t, ctx, d.Pool, `UPDATE wh_perspective_builds SET state = 'retired', retired_at = now() WHERE build_key = $1`, retiring)
	got = apply(func(states []worker.PairState) {
		for _, st := range states {
			require.True(t, psLockedElsewhere(t, ctx, d, st.Pair), "the cursor row of %v is locked while decide runs", st.Pair)
		}
		require.False(t, psLockedElsewhere(t, ctx, d, retired), "the retired build's cursor row is not locked")
	})
	keys := make([]worker.Pair, 0, len(got))
	for p := range got {
		keys = append(keys, p)
	}
	require.ElementsMatch(t, []worker.Pair{snapped, live, expired, unlocked}, keys, "a retired build's pair is not passed")

	s := got[snapped]
	require.Equal(t, uuid.NullUUID{UUID: ids[2], Valid: true}, s.LastEventID)
	require.Equal(t, 2, s.SinceSnapshot)
	require.Equal(t, []uuid.UUID{ids[2], ids[1], ids[0]}, s.Snapshots, "snapshot positions newest first, the pair's only")
	require.Equal(t, uuid.Nil, s.LockHolder)
	require.Equal(t, []uuid.UUID{ids[3], ids[4]}, psIDs(s.Events), "queued events in ID order")
	require.Equal(t, evs[3].Type, s.Events[0].Type)
	require.JSONEq(t, string(evs[3].Data), string(s.Events[0].Data))
	require.JSONEq(t, `{"v":"at2"}`, string(s.Model))
	require.Equal(t, ids[2], s.ModelAt)

	require.Equal(t, other, got[live].LockHolder, "an unexpired lock: its holder")
	require.Equal(t, uuid.Nil, got[expired].LockHolder, "an expired lock: no holder")
	require.Equal(t, uuid.Nil, got[unlocked].LockHolder)
	for _, p := range []worker.Pair{live, expired, unlocked} {
		require.Empty(t, got[p].Snapshots, "%v", p)
		require.Empty(t, got[p].Events, "%v", p)
		require.Nil(t, got[p].Model, "%v", p)
		require.False(t, got[p].LastEventID.Valid, "%v", p)
	}
}

// RewindStart reads the cursor's version and position, the queued IDs ascending, the
// newest snapshot strictly before the first queued event (one exactly at it is not taken)
// and the snapshot positions before it, newest first; nothing queued, nothing more.
func TestPGStoreRewindStartSnapshotsStrictlyBeforeTheFirstQueued(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	store := psStore(testDB)
	name := uniqueName("ps_rwstart")

	p := worker.Pair{Stream: uuid.New(), Perspective: name}
	ids := psIDs(psEvents(t, ctx, testDB, p.Stream, 8))
	psCursor(t, ctx, testDB, p, ids[6], 7, 2)
	for _, i := range []int{4, 1, 6, 3} { // ids[4] is the first queued event
		psSnapshot(t, ctx, testDB, p, ids[i], fmt.Sprintf(`{"at":%d}`, i))
	}
	psQueue(t, ctx, testDB, p, ids[7], ids[4], ids[5])
	// The same stream in another perspective: an earlier queued event and another snapshot.
	sib := worker.Pair{Stream: p.Stream, Perspective: name + "_sib"}
	psCursor(t, ctx, testDB, sib, ids[6], 99, 0)
	psQueue(t, ctx, testDB, sib, ids[0])
	psSnapshot(t, ctx, testDB, sib, ids[2], `{"sib":2}`)

	rs, err := store.RewindStart(ctx, p)
	require.NoError(t, err)
	require.EqualValues(t, 7, rs.Version)
	require.Equal(t, uuid.NullUUID{UUID: ids[6], Valid: true}, rs.LastEventID)
	require.Equal(t, []uuid.UUID{ids[4], ids[5], ids[7]}, rs.Queued, "the pair's queued IDs, ascending")
	require.NotNil(t, rs.From)
	require.Equal(t, ids[3], rs.From.EventID, "the newest snapshot strictly before the first queued event")
	require.JSONEq(t, `{"at":3}`, string(rs.From.Model))
	require.Equal(t, []uuid.UUID{ids[3], ids[1]}, rs.Snapshots, "the positions before the first queued event, newest first")

	// Only a snapshot exactly at the first queued event, and one after it: none to start from.
	at := worker.Pair{Stream: uuid.New(), Perspective: name}
	aids := psIDs(psEvents(t, ctx, testDB, at.Stream, 4))
	psCursor(t, ctx, testDB, at, aids[3], 4, 0)
	psSnapshot(t, ctx, testDB, at, aids[1], `{"at":1}`)
	psSnapshot(t, ctx, testDB, at, aids[2], `{"at":2}`)
	psQueue(t, ctx, testDB, at, aids[1])
	rs, err = store.RewindStart(ctx, at)
	require.NoError(t, err)
	require.Equal(t, []uuid.UUID{aids[1]}, rs.Queued)
	require.Nil(t, rs.From, "a snapshot at the first queued event is not before it")
	require.Empty(t, rs.Snapshots)

	// Nothing queued: no From, no Snapshots.
	idle := worker.Pair{Stream: uuid.New(), Perspective: name}
	iids := psIDs(psEvents(t, ctx, testDB, idle.Stream, 3))
	psCursor(t, ctx, testDB, idle, iids[2], 5, 0)
	psSnapshot(t, ctx, testDB, idle, iids[0], `{"at":0}`)
	psSnapshot(t, ctx, testDB, idle, iids[1], `{"at":1}`)
	rs, err = store.RewindStart(ctx, idle)
	require.NoError(t, err)
	require.EqualValues(t, 5, rs.Version)
	require.Equal(t, uuid.NullUUID{UUID: iids[2], Valid: true}, rs.LastEventID)
	require.Empty(t, rs.Queued)
	require.Nil(t, rs.From)
	require.Empty(t, rs.Snapshots)
}

// Replay returns the stream's events after `after` (exclusive) up to `upto` (inclusive),
// at most limit, in ID order, and no other stream's.
func TestPGStoreReplayBoundsLimitOrderAndStream(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	store := psStore(testDB)
	a, b := uuid.New(), uuid.New()
	all := newIDs(t, 20)
	var aIDs, bIDs []uuid.UUID // interleaved: b's IDs fall between a's
	for i, id := range all {
		if i%2 == 0 {
			aIDs = append(aIDs, id)
		} else {
			bIDs = append(bIDs, id)
		}
	}
	aEvs, bEvs := events(a, aIDs), events(b, bIDs)
	// Stored out of ID order.
	for i := range aEvs {
		psInsert(t, ctx, testDB, aEvs[len(aEvs)-1-i], bEvs[(i*3)%len(bEvs)])
	}

	replay := func(after, upto uuid.UUID, limit int) []worker.Event {
		t.Helper()
		evs, err := store.Replay(ctx, worker.Pair{Stream: a, Perspective: "ps_replay"}, after, upto, limit)
		require.NoError(t, err)
		return evs
	}
	got := replay(aIDs[2], aIDs[6], 100)
	require.Equal(t, aIDs[3:7], psIDs(got), "(after, upto]: after excluded, upto included")
	for i, ev := range got {
		want := aEvs[3+i]
		require.Equal(t, a, ev.StreamID)
		require.Equal(t, want.Type, ev.Type)
		require.JSONEq(t, string(want.Data), string(ev.Data))
		require.False(t, ev.CreatedAt.IsZero())
	}
	require.Equal(t, aIDs[3:5], psIDs(replay(aIDs[2], aIDs[6], 2)), "at most limit, the lowest IDs")
	require.Equal(t, aIDs[:2], psIDs(replay(uuid.Nil, aIDs[1], 100)), "from the stream's start")
	require.Empty(t, replay(aIDs[6], aIDs[6], 100))
	require.Equal(t, aIDs[3:6], psIDs(replay(bIDs[2], bIDs[5], 100)), "bounds that are not the stream's events")
	require.Equal(t, aIDs[9:], psIDs(replay(aIDs[8], psMaxUUID, 100)))
}

// psRewindFixture is a pair whose rewind is ready to commit: events 0..5, the cursor and the
// model at 5 (version 10, failed twice), snapshots at 0, 1, 2, 3 and 5, events 2 (late) and 4
// queued; the same stream in a sibling perspective has rows at the same positions.
type psRewindFixture struct {
	p, sib worker.Pair
	ids    []uuid.UUID
}

func psNewRewindFixture(t *testing.T, ctx context.Context) psRewindFixture {
	t.Helper()
	name := uniqueName("ps_rwcommit")
	f := psRewindFixture{p: worker.Pair{Stream: uuid.New(), Perspective: name}}
	f.sib = worker.Pair{Stream: f.p.Stream, Perspective: name + "_sib"}
	f.ids = psIDs(psEvents(t, ctx, testDB, f.p.Stream, 6))
	for _, p := range []worker.Pair{f.p, f.sib} {
		psCursor(t, ctx, testDB, p, f.ids[5], 10, 3)
		psModel(t, ctx, testDB, p, `{"v":"old"}`, f.ids[5])
		for _, i := range []int{0, 1, 2, 3, 5} {
			psSnapshot(t, ctx, testDB, p, f.ids[i], fmt.Sprintf(`{"v":"old%d"}`, i))
		}
		psQueue(t, ctx, testDB, p, f.ids[2], f.ids[4])
	}
	psFailed(t, ctx, testDB, f.p, 2)
	return f
}

// commit is the rewind's result: the late event 2 replayed (4 stays queued), new
// snapshots at 3 (replacing the old one) and 4, the retention dropping 1.
func (f psRewindFixture) commit(holder uuid.UUID, version int64) worker.RewindCommit {
	return worker.RewindCommit{
		Write: worker.PairWrite{
			Pair: f.p, Applied: []uuid.UUID{f.ids[2]}, Model: json.RawMessage(`{"v":"new"}`), LastEventID: f.ids[5], SinceSnapshot: 1,
			Snapshots: []worker.Snapshot{
				{EventID: f.ids[3], Model: json.RawMessage(`{"v":"new3"}`)},
				{EventID: f.ids[4], Model: json.RawMessage(`{"v":"new4"}`)},
			},
			DropSnapshots: []uuid.UUID{f.ids[1]},
		},
		Version: version, Holder: holder, DropFrom: f.ids[2],
	}
}

// RewindCommit refuses, writing nothing, unless the holder (when given) holds an
// unexpired stream lock and the cursor's version is unchanged; otherwise it drops the
// snapshots at and after DropFrom before writing the new ones, writes model and cursor
// (version bumped, failure cleared), deletes exactly the Applied queue rows and drops
// DropSnapshots.
func TestPGStoreRewindCommitFencesAndWrites(t *testing.T) {
	t.Parallel()
	me, other := uuid.New(), uuid.New()
	refusals := []struct {
		name    string
		lock    func(t *testing.T, ctx context.Context, f psRewindFixture)
		holder  uuid.UUID
		version int64
		want    error
	}{
		{"another instance's live lock", func(t *testing.T, ctx context.Context, f psRewindFixture) {
			psLock(t, ctx, testDB, f.p, other, "1 hour")
		}, me, 10, worker.ErrLockLost},
		{"own lock expired", func(t *testing.T, ctx context.Context, f psRewindFixture) {
			psLock(t, ctx, testDB, f.p, me, "-1 second")
		}, me, 10, worker.ErrLockLost},
		{"no lock", func(*testing.T, context.Context, psRewindFixture) {}, me, 10, worker.ErrLockLost},
		{"own lock held, version moved", func(t *testing.T, ctx context.Context, f psRewindFixture) {
			psLock(t, ctx, testDB, f.p, me, "1 hour")
		}, me, 9, worker.ErrCursorMoved},
		{"no locker, version moved", func(*testing.T, context.Context, psRewindFixture) {}, uuid.Nil, 11, worker.ErrCursorMoved},
	}
	for _, tc := range refusals {
		t.Run("refused/"+tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			f := psNewRewindFixture(t, ctx)
			tc.lock(t, ctx, f)
			before, sibBefore := psRead(t, ctx, testDB, f.p), psRead(t, ctx, testDB, f.sib)
			err := psStore(testDB).RewindCommit(ctx, f.commit(tc.holder, tc.version))
			require.ErrorIs(t, err, tc.want)
			require.Equal(t, before, psRead(t, ctx, testDB, f.p), "a refused commit writes nothing")
			require.Equal(t, sibBefore, psRead(t, ctx, testDB, f.sib))
		})
	}

	commits := []struct {
		name   string
		lock   func(t *testing.T, ctx context.Context, f psRewindFixture)
		holder uuid.UUID
	}{
		{"own live lock", func(t *testing.T, ctx context.Context, f psRewindFixture) {
			psLock(t, ctx, testDB, f.p, me, "1 hour")
		}, me},
		{"no locker: another instance's lock is not checked", func(t *testing.T, ctx context.Context, f psRewindFixture) {
			psLock(t, ctx, testDB, f.p, other, "1 hour")
		}, uuid.Nil},
		{"no locker, no lock", func(*testing.T, context.Context, psRewindFixture) {}, uuid.Nil},
	}
	for _, tc := range commits {
		t.Run("committed/"+tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			f := psNewRewindFixture(t, ctx)
			tc.lock(t, ctx, f)
			sibBefore := psRead(t, ctx, testDB, f.sib)
			require.NoError(t, psStore(testDB).RewindCommit(ctx, f.commit(tc.holder, 10)))

			model, at, ok := psModelOf(t, ctx, testDB, f.p)
			require.True(t, ok)
			require.Equal(t, `{"v":"new"}`, model)
			require.Equal(t, f.ids[5], at)
			require.Equal(t, gsCursor{
				LastEventID: uuid.NullUUID{UUID: f.ids[5], Valid: true}, Version: 11, EventsSinceSnapshot: 1, Status: "ok",
			}, psReadCursor(t, ctx, testDB, f.p), "cursor written, version bumped, failure cleared")
			require.Equal(t, []uuid.UUID{f.ids[4]}, psQueued(t, ctx, testDB, f.p), "exactly the applied queue row is deleted")
			require.Equal(t, map[uuid.UUID]string{
				f.ids[0]: `{"v":"old0"}`, // before DropFrom, not dropped
				f.ids[3]: `{"v":"new3"}`, // written after the drop at and after DropFrom
				f.ids[4]: `{"v":"new4"}`,
			}, psSnapshots(t, ctx, testDB, f.p), "1 dropped (DropSnapshots); 2 (= DropFrom) and 5 dropped; the new ones kept")
			require.Equal(t, sibBefore, psRead(t, ctx, testDB, f.sib), "the sibling perspective's rows are untouched")
		})
	}
}

// Purge is fenced like RewindCommit; it deletes the model and every snapshot and resets
// the cursor (no position, version bumped, failure cleared), keeping the queue rows; it
// works when the pair has no cursor row.
func TestPGStorePurgeFencedResetsAndKeepsTheQueue(t *testing.T) {
	t.Parallel()
	me, other := uuid.New(), uuid.New()
	type fixture struct {
		p, sib worker.Pair
		ids    []uuid.UUID
	}
	setup := func(t *testing.T, ctx context.Context, withCursor bool) fixture {
		name := uniqueName("ps_purge")
		f := fixture{p: worker.Pair{Stream: uuid.New(), Perspective: name}}
		f.sib = worker.Pair{Stream: f.p.Stream, Perspective: name + "_sib"}
		f.ids = psIDs(psEvents(t, ctx, testDB, f.p.Stream, 6))
		for _, p := range []worker.Pair{f.p, f.sib} {
			if withCursor || p == f.sib {
				psCursor(t, ctx, testDB, p, f.ids[3], 4, 2)
				psFailed(t, ctx, testDB, p, 3)
			}
			psModel(t, ctx, testDB, p, `{"v":"old"}`, f.ids[3])
			psSnapshot(t, ctx, testDB, p, f.ids[1], `{"v":1}`)
			psSnapshot(t, ctx, testDB, p, f.ids[3], `{"v":3}`)
			psQueue(t, ctx, testDB, p, f.ids[4], f.ids[5])
		}
		return f
	}
	refusals := []struct {
		name       string
		withCursor bool
		lock       func(t *testing.T, ctx context.Context, p worker.Pair)
	}{
		{"another instance's live lock", true, func(t *testing.T, ctx context.Context, p worker.Pair) { psLock(t, ctx, testDB, p, other, "1 hour") }},
		{"own lock expired", true, func(t *testing.T, ctx context.Context, p worker.Pair) { psLock(t, ctx, testDB, p, me, "-1 second") }},
		{"no lock", true, func(*testing.T, context.Context, worker.Pair) {}},
		{"no cursor row", false, func(*testing.T, context.Context, worker.Pair) {}},
	}
	for _, tc := range refusals {
		t.Run("refused/"+tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			f := setup(t, ctx, tc.withCursor)
			tc.lock(t, ctx, f.p)
			before, sibBefore := psRead(t, ctx, testDB, f.p), psRead(t, ctx, testDB, f.sib)
			require.ErrorIs(t, psStore(testDB).Purge(ctx, f.p, me), worker.ErrLockLost)
			require.Equal(t, before, psRead(t, ctx, testDB, f.p), "a refused purge writes nothing (not even a cursor row)")
			require.Equal(t, sibBefore, psRead(t, ctx, testDB, f.sib))
		})
	}
	purges := []struct {
		name       string
		withCursor bool
		lock       func(t *testing.T, ctx context.Context, p worker.Pair)
		holder     uuid.UUID
		version    int64 // the cursor's version afterwards
	}{
		{"own live lock", true, func(t *testing.T, ctx context.Context, p worker.Pair) { psLock(t, ctx, testDB, p, me, "1 hour") }, me, 5},
		{"no locker: another instance's lock is not checked", true, func(t *testing.T, ctx context.Context, p worker.Pair) {
			psLock(t, ctx, testDB, p, other, "1 hour")
		}, uuid.Nil, 5},
		{"no locker, no cursor row", false, func(*testing.T, context.Context, worker.Pair) {}, uuid.Nil, 1},
	}
	for _, tc := range purges {
		t.Run("purged/"+tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			f := setup(t, ctx, tc.withCursor)
			tc.lock(t, ctx, f.p)
			before, sibBefore := psRead(t, ctx, testDB, f.p), psRead(t, ctx, testDB, f.sib)
			require.NoError(t, psStore(testDB).Purge(ctx, f.p, tc.holder))

			_, _, ok := psModelOf(t, ctx, testDB, f.p)
			require.False(t, ok, "the model is deleted")
			require.Empty(t, psSnapshots(t, ctx, testDB, f.p), "every snapshot is deleted")
			require.Equal(t, gsCursor{Version: tc.version, Status: "ok"}, psReadCursor(t, ctx, testDB, f.p),
				"the cursor is reset: no position, version bumped, failure cleared")
			require.Equal(t, before.Queue, psRead(t, ctx, testDB, f.p).Queue, "the queue rows stay as they were")
			require.Equal(t, sibBefore, psRead(t, ctx, testDB, f.sib), "the sibling perspective's rows are untouched")
		})
	}
}

// A purge that waits for the cursor row while another transaction deletes it (the cleanup
// of a retired build, or by hand) fails with an error that says so, and writes nothing: the
// row is not created again behind the deletion, and the model stays.
func TestPGStorePurgeOfACursorRowDeletedMeanwhileSaysSo(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	p := worker.Pair{Stream: uuid.New(), Perspective: uniqueName("ps_purge_gone")}
	ids := psIDs(psEvents(t, ctx, testDB, p.Stream, 2))
	psCursor(t, ctx, testDB, p, ids[1], 2, 0)
	psModel(t, ctx, testDB, p, `{"v":"kept"}`, ids[1])

	deleter, err := testDB.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = deleter.Rollback(context.WithoutCancel(ctx)) }()
	_, err = deleter.Exec(ctx, `DELETE FROM wh_perspective_cursors WHERE stream_id = $1 AND perspective_name = $2`, p.Stream, p.Perspective)
	require.NoError(t, err)

	purged := make(chan error, 1)
	go func() { purged <- psStore(testDB).Purge(ctx, p, uuid.Nil) }()
	eventually(t, 10*time.Second, "the purge waits for the deleted row", func() bool {
		var waiting bool
		require.NoError(t, testDB.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_locks l
			JOIN pg_stat_activity a ON a.pid = l.pid
			WHERE NOT l.granted AND a.datname = current_database() AND a.query LIKE '%CursorLock%')`).Scan(&waiting))
		return waiting
	})
	require.NoError(t, deleter.Commit(ctx))
	err = <-purged
	require.ErrorContains(t, err, "cursor row was deleted by another transaction meanwhile")
	require.ErrorIs(t, err, pgx.ErrNoRows)
	var rows int
	require.NoError(t, testDB.Pool.QueryRow(ctx, `SELECT count(*) FROM wh_perspective_cursors
		WHERE stream_id = $1 AND perspective_name = $2`, p.Stream, p.Perspective).Scan(&rows))
	require.Zero(t, rows, "the deleted cursor row is not created again")
	model, _, ok := psModelOf(t, ctx, testDB, p)
	require.True(t, ok, "the purge rolled back: the model stays")
	require.JSONEq(t, `{"v":"kept"}`, string(model))
}

// Bootstrap stores the model as a snapshot at the cursor's position; with no position or no
// cursor row it writes nothing and says so; a position without a model, or a model at
// another event than the cursor, is an error, and nothing is written.
func TestPGStoreBootstrapSnapshotsTheModelAtTheCursor(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	store := psStore(testDB)
	name := uniqueName("ps_boot")
	pair := func() (worker.Pair, []uuid.UUID) {
		p := worker.Pair{Stream: uuid.New(), Perspective: name}
		return p, psIDs(psEvents(t, ctx, testDB, p.Stream, 4))
	}

	ok, ids := pair()
	psCursor(t, ctx, testDB, ok, ids[3], 6, 0)
	psModel(t, ctx, testDB, ok, `{"v":"at3"}`, ids[3])
	psSnapshot(t, ctx, testDB, ok, ids[1], `{"v":"at1"}`)
	wrote, err := store.Bootstrap(ctx, ok)
	require.NoError(t, err)
	require.True(t, wrote)
	want := map[uuid.UUID]string{ids[1]: `{"v":"at1"}`, ids[3]: `{"v":"at3"}`}
	require.Equal(t, want, psSnapshots(t, ctx, testDB, ok), "one snapshot at the cursor's position, with the model")
	wrote, err = store.Bootstrap(ctx, ok)
	require.NoError(t, err)
	require.True(t, wrote, "again: idempotent")
	require.Equal(t, want, psSnapshots(t, ctx, testDB, ok))
	require.EqualValues(t, 6, psReadCursor(t, ctx, testDB, ok).Version, "a snapshot is not a change of position or model")

	noModel, ids := pair()
	psCursor(t, ctx, testDB, noModel, ids[3], 1, 0)
	noPosition, ids2 := pair()
	psCursor(t, ctx, testDB, noPosition, uuid.Nil, 1, 0)
	psModel(t, ctx, testDB, noPosition, `{"v":"stale"}`, ids2[3])
	noCursor, ids3 := pair()
	psModel(t, ctx, testDB, noCursor, `{"v":"stale"}`, ids3[3])
	for what, p := range map[string]worker.Pair{"no position": noPosition, "no cursor row": noCursor} {
		before := psRead(t, ctx, testDB, p)
		wrote, err := store.Bootstrap(ctx, p)
		require.NoError(t, err, what)
		require.False(t, wrote, what)
		require.Equal(t, before, psRead(t, ctx, testDB, p), "%s: nothing written", what)
	}

	mismatch, ids := pair()
	psCursor(t, ctx, testDB, mismatch, ids[3], 1, 0)
	psModel(t, ctx, testDB, mismatch, `{"v":"at2"}`, ids[2])
	for what, p := range map[string]worker.Pair{"a model at another event than the cursor": mismatch, "a position without a model": noModel} {
		before := psRead(t, ctx, testDB, p)
		wrote, err = store.Bootstrap(ctx, p)
		require.Error(t, err, what)
		require.False(t, wrote, what)
		require.Equal(t, before, psRead(t, ctx, testDB, p), "%s: nothing written", what)
	}
}

// psRequireBackoff checks that the pair's due row retries at now + backoff, now being a time
// of the transaction between from and to, and that it is not leased.
func psRequireBackoff(t *testing.T, ctx context.Context, d *pgtest.DB, p worker.Pair, from, to time.Time, backoff time.Duration) time.Time {
	t.Helper()
	c := psReadCursor(t, ctx, d, p)
	require.NotNil(t, c.NextAttemptAt)
	at := c.NextAttemptAt.Add(-backoff)
	require.False(t, at.Before(from) || at.After(to), "retry at %s, want now + %s with now in [%s, %s]", c.NextAttemptAt, backoff, from, to)
	var leased bool
	require.NoError(t, d.Pool.QueryRow(ctx, `SELECT leased_by IS NOT NULL FROM wh_perspective_pairs
		WHERE stream_id = $1 AND perspective_name = $2`, p.Stream, p.Perspective).Scan(&leased))
	require.False(t, leased, "the failure's record ends the lease")
	return *c.NextAttemptAt
}

// MarkFailed creates a missing cursor row and records the failure: status failed,
// attempts + 1, the error, and a retry at now + base·2^attempts (capped at max) on the pair's
// due row.
func TestPGStoreMarkFailedBacksOffCursorAndQueue(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	store := psStore(testDB)
	name := uniqueName("ps_fail")
	p := worker.Pair{Stream: uuid.New(), Perspective: name}
	sib := worker.Pair{Stream: p.Stream, Perspective: name + "_sib"}
	ids := psIDs(psEvents(t, ctx, testDB, p.Stream, 3))
	psQueue(t, ctx, testDB, p, ids[1], ids[2])
	psCursor(t, ctx, testDB, sib, uuid.Nil, 0, 0)
	psQueue(t, ctx, testDB, sib, ids[1])
	sibBefore := psRead(t, ctx, testDB, sib)
	require.False(t, psCursorExists(t, ctx, testDB, p))

	markFailed := func(cause string, attempts int32, backoff time.Duration) {
		t.Helper()
		from := psClock(t, ctx, testDB)
		action, err := store.MarkFailed(ctx, p, worker.Failure{Cause: cause}, func(int) worker.FailureAction { return worker.FailureRetry })
		require.NoError(t, err)
		require.Equal(t, worker.FailureRetry, action)
		to := psClock(t, ctx, testDB)
		c := psReadCursor(t, ctx, testDB, p)
		require.Equal(t, "failed", c.Status)
		require.Equal(t, attempts, c.Attempts)
		require.NotNil(t, c.LastError)
		require.Equal(t, cause, *c.LastError)
		psRequireBackoff(t, ctx, testDB, p, from, to, backoff)
		require.Equal(t, ids[1:], queued(t, ctx, p.Perspective, p.Stream), "its events stay queued")
	}
	markFailed("first", 1, psRetryBase)    // no cursor row before: created
	markFailed("second", 2, 2*psRetryBase) // base·2^1
	markFailed("third", 3, 4*psRetryBase)  // base·2^2
	markFailed("fourth", 4, 8*psRetryBase) // base·2^3
	markFailed("fifth", 5, psRetryMax)     // base·2^4 = 160 s, capped at 100 s
	markFailed("sixth", 6, psRetryMax)     // still capped
	require.Equal(t, sibBefore, psRead(t, ctx, testDB, sib), "the sibling perspective's cursor and queue rows are untouched")
}

// Apply writes what decide returns in its one transaction: a Failure is recorded as
// MarkFailed records it, beside the other pairs' applied events; an Applied event whose
// queue row does not exist fails the transaction, and nothing of the group is written.
func TestPGStoreApplyRecordsFailuresAndRollsBackTheWholeGroup(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	store := psStore(testDB)
	name := uniqueName("ps_apply")
	setup := func() (ok, failing, bad worker.Pair, ids map[worker.Pair][]uuid.UUID) {
		ok = worker.Pair{Stream: uuid.New(), Perspective: name}
		failing = worker.Pair{Stream: uuid.New(), Perspective: name}
		bad = worker.Pair{Stream: uuid.New(), Perspective: name}
		ids = map[worker.Pair][]uuid.UUID{}
		for _, p := range []worker.Pair{ok, failing, bad} {
			ids[p] = psIDs(psEvents(t, ctx, testDB, p.Stream, 3))
			psCursor(t, ctx, testDB, p, uuid.Nil, 0, 0)
			psQueue(t, ctx, testDB, p, ids[p]...)
		}
		return ok, failing, bad, ids
	}
	applyWrite := func(p worker.Pair, applied []uuid.UUID) worker.PairWrite {
		return worker.PairWrite{
			Pair: p, Applied: applied, Model: json.RawMessage(`{"v":"new"}`), LastEventID: applied[len(applied)-1], SinceSnapshot: 2,
			Snapshots: []worker.Snapshot{{EventID: applied[len(applied)-1], Model: json.RawMessage(`{"v":"snap"}`)}},
		}
	}

	// A failure beside an applied pair.
	ok, failing, _, ids := setup()
	from := psClock(t, ctx, testDB)
	busy, err := store.Apply(ctx, worker.ApplyRequest{Pairs: []worker.Pair{ok, failing}, PerPair: 10}, func(states []worker.PairState) []worker.PairWrite {
		require.Len(t, states, 2)
		return []worker.PairWrite{applyWrite(ok, ids[ok][:2]), {Pair: failing, Failure: worker.Failure{Cause: "boom", Action: worker.FailureRetry}}}
	})
	require.NoError(t, err)
	require.Empty(t, busy)
	to := psClock(t, ctx, testDB)
	model, at, found := psModelOf(t, ctx, testDB, ok)
	require.True(t, found)
	require.Equal(t, `{"v":"new"}`, model)
	require.Equal(t, ids[ok][1], at)
	require.Equal(t, gsCursor{LastEventID: uuid.NullUUID{UUID: ids[ok][1], Valid: true}, Version: 1, EventsSinceSnapshot: 2, Status: "ok"},
		psReadCursor(t, ctx, testDB, ok))
	require.Equal(t, ids[ok][2:], psQueued(t, ctx, testDB, ok))
	require.Equal(t, map[uuid.UUID]string{ids[ok][1]: `{"v":"snap"}`}, psSnapshots(t, ctx, testDB, ok))
	c := psReadCursor(t, ctx, testDB, failing)
	require.Equal(t, "failed", c.Status)
	require.EqualValues(t, 1, c.Attempts)
	require.Equal(t, "boom", *c.LastError)
	require.False(t, c.LastEventID.Valid, "a failure moves nothing")
	require.EqualValues(t, 0, c.Version, "a failure is not a change of position or model")
	psRequireBackoff(t, ctx, testDB, failing, from, to, psRetryBase)
	require.Equal(t, ids[failing], psQueued(t, ctx, testDB, failing), "a failure keeps the queue rows")

	// An applied event without a queue row: everything rolled back, the failure too.
	ok, failing, bad, ids := setup()
	before := map[worker.Pair]psRows{}
	for _, p := range []worker.Pair{ok, failing, bad} {
		before[p] = psRead(t, ctx, testDB, p)
	}
	gone := uuid.Must(uuid.NewV7()) // never queued
	_, err = store.Apply(ctx, worker.ApplyRequest{Pairs: []worker.Pair{ok, failing, bad}, PerPair: 10}, func(states []worker.PairState) []worker.PairWrite {
		require.Len(t, states, 3)
		return []worker.PairWrite{
			applyWrite(ok, ids[ok][:2]),
			{Pair: failing, Failure: worker.Failure{Cause: "boom", Action: worker.FailureRetry}},
			applyWrite(bad, []uuid.UUID{ids[bad][0], gone}),
		}
	})
	require.Error(t, err, "an applied event whose queue row does not exist")
	for p, rows := range before {
		require.Equal(t, rows, psRead(t, ctx, testDB, p), "nothing of the group is written (%v)", p)
	}
}

// Register: a name's first registration adds an active build keyed by the name; a newer
// version adds a building one beside it; an older version than the active one, or a second
// call, adds nothing; a name that is another perspective's build key is refused. Only a
// registration that adds a build takes the exclusive append lock; it waits for the Appends in
// flight without queueing for them (two registrations at once), so the Appends that come
// meanwhile go on, and when its context ends first it names the transactions it waited for.
func TestPGStoreRegisterBuildsAndTheAppendLock(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := isolatedDB(t)
	store := psStore(d)
	epoch := func() int64 {
		var e int64
		require.NoError(t, d.Pool.QueryRow(ctx, `SELECT epoch FROM wh_registration WHERE id = 1`).Scan(&e))
		return e
	}
	type bk struct {
		Key, Perspective string
		Version, N       int
		State            string
	}
	summary := func(bs []worker.Build) []bk {
		out := make([]bk, len(bs))
		for i, b := range bs {
			out[i] = bk{b.Key, b.Perspective, b.Version, b.N, b.State}
		}
		return out
	}
	stored := func(name string) []bk {
		bs, err := store.Builds(ctx, []string{name})
		require.NoError(t, err)
		return summary(bs)
	}
	register := func(name string, version int) []bk {
		t.Helper()
		bs, err := store.Register(ctx, name, version)
		require.NoError(t, err)
		require.Equal(t, stored(name), summary(bs), "Register returns the builds as stored")
		return summary(bs)
	}

	p := uniqueName("ps_reg")
	e0 := epoch()
	require.Equal(t, []bk{{p, p, 1, 1, worker.BuildActive}}, register(p, 1), "the first build of version 1 is keyed by the name, active")
	require.Equal(t, 1, psCount(t, ctx, d, `SELECT count(*) FROM wh_perspectives WHERE perspective_name = $1`, p))
	require.NotNil(t, psBuild(t, ctx, d, p).PromotedAt, "the first build is promoted at once")
	require.Equal(t, e0+1, epoch(), "a build added: the registration epoch moves")

	require.Equal(t, []bk{{p, p, 1, 1, worker.BuildActive}}, register(p, 1), "again: nothing added")
	require.Equal(t, e0+1, epoch())

	v2 := p + "@v2.1"
	want := []bk{{p, p, 1, 1, worker.BuildActive}, {v2, p, 2, 1, worker.BuildBuilding}}
	require.Equal(t, want, register(p, 2), "a newer version builds beside the active one")
	require.Nil(t, psBuild(t, ctx, d, v2).PromotedAt)
	require.Equal(t, want, register(p, 2), "again: nothing added")
	require.Equal(t, e0+2, epoch())

	// An older version than the active one adds nothing.
	q := uniqueName("ps_reg_newer")
	require.Equal(t, []bk{{q + "@v3.1", q, 3, 1, worker.BuildActive}}, register(q, 3), "a first registration at version 3: active")
	require.Equal(t, []bk{{q + "@v3.1", q, 3, 1, worker.BuildActive}}, register(q, 2), "an older version than the active: nothing")
	require.Equal(t, []bk{{q + "@v3.1", q, 3, 1, worker.BuildActive}}, register(q, 1))
	require.Equal(t, e0+3, epoch())

	// A name that is another perspective's build key, and a build key that is another's name.
	_, err := store.Register(ctx, v2, 1)
	require.Error(t, err)
	require.ErrorContains(t, err, `"`+v2+`"`, "the error names the key")
	require.Zero(t, psCount(t, ctx, d, `SELECT count(*) FROM wh_perspectives WHERE perspective_name = $1`, v2), "nothing registered")
	require.Zero(t, psCount(t, ctx, d, `SELECT count(*) FROM wh_perspective_builds WHERE perspective_name = $1`, v2))
	r := uniqueName("ps_reg_clash")
	register(r+"@v2.1", 1)
	register(r, 1)
	_, err = store.Register(ctx, r, 2)
	require.ErrorContains(t, err, `"`+r+`@v2.1"`, "version 2's key is another perspective's name")
	require.Equal(t, []bk{{r, r, 1, 1, worker.BuildActive}}, stored(r))
	require.Equal(t, e0+5, epoch())

	// The append lock: an open transaction holds its shared side, as an Append in flight does.
	appendTx, err := d.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = appendTx.Rollback(context.Background()) }()
	gsExec(t, ctx, appendTx, `SELECT pg_advisory_xact_lock_shared(7214082031553392641)`)

	noop, cancel := context.WithTimeout(ctx, 10*time.Second)
	bs, err := store.Register(noop, p, 2)
	cancel()
	require.NoError(t, err, "a registration that adds nothing does not wait for the append lock")
	require.Equal(t, want, summary(bs))
	require.Zero(t, psLockWaiters(t, ctx, d, ""))

	// Two registrations that add builds wait for it (two instances starting at once).
	s, s2 := uniqueName("ps_reg_wait"), uniqueName("ps_reg_wait2")
	type result struct {
		builds []worker.Build
		err    error
	}
	done, done2 := make(chan result, 1), make(chan result, 1)
	go func() {
		bs, err := store.Register(ctx, s, 1)
		done <- result{bs, err}
	}()
	go func() {
		bs, err := store.Register(ctx, s2, 1)
		done2 <- result{bs, err}
	}()
	time.Sleep(time.Second) // their first bounded waits (50 ms) have run out
	for _, c := range []chan result{done, done2} {
		select {
		case r := <-c:
			t.Fatalf("Register returned while an Append held the shared append lock: %v", r.err)
		default:
		}
	}
	require.Zero(t, psCount(t, ctx, d, `SELECT count(*) FROM wh_perspective_builds WHERE perspective_name IN ($1, $2)`, s, s2))

	// Meanwhile neither queues for the lock (PostgreSQL would queue every Append that comes
	// behind a waiting exclusive request): they wait the open transaction out with tries
	// (underAppendLock), and Appends go on.
	for i := range 100 {
		require.Zero(t, psLockWaiters(t, ctx, d, "advisory"), "sample %d: a session waits for the append lock", i)
		time.Sleep(10 * time.Millisecond)
	}
	for i := range 5 {
		actx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := worker.Append(actx, d.Pool, events(uuid.New(), newIDs(t, 1))...)
		cancel()
		require.NoError(t, err, "Append %d while registrations wait for an Append transaction that stays open", i)
	}

	// A registration whose context ends first says which transactions held it up, and adds
	// nothing.
	var holder int32
	require.NoError(t, appendTx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&holder))
	gaveUp := uniqueName("ps_reg_gave_up")
	short, cancel := context.WithTimeout(ctx, 3*time.Second)
	_, err = store.Register(short, gaveUp, 1)
	cancel()
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.ErrorContains(t, err, "append lock")
	require.ErrorContains(t, err, fmt.Sprintf("server pid %d (open ", holder), "the error names the open Append transaction")
	require.Zero(t, psCount(t, ctx, d, `SELECT count(*) FROM wh_perspective_builds WHERE perspective_name = $1`, gaveUp))
	require.Zero(t, psCount(t, ctx, d, `SELECT count(*) FROM wh_perspectives WHERE perspective_name = $1`, gaveUp))

	require.NoError(t, appendTx.Commit(ctx))
	for _, c := range []struct {
		name string
		done chan result
	}{{s, done}, {s2, done2}} {
		res := <-c.done
		require.NoError(t, res.err)
		require.Equal(t, []bk{{c.name, c.name, 1, 1, worker.BuildActive}}, summary(res.builds))
		require.Equal(t, []bk{{c.name, c.name, 1, 1, worker.BuildActive}}, stored(c.name))
	}
}

// psCatchUp is a catch-up request of the tests.
func psCatchUp(key string, instance uuid.UUID, lease time.Duration, page int) worker.CatchUpRequest {
	return worker.CatchUpRequest{Key: key, Instance: instance, Lease: lease, PageSize: page}
}

// psNoFold is a fold that must not run.
func psNoFold(t *testing.T) func(worker.CatchUpPage) []worker.PairWrite {
	return func(p worker.CatchUpPage) []worker.PairWrite {
		t.Errorf("fold called with %d events", len(p.Events))
		return nil
	}
}

// CatchUp pages through the store in (stream, event) order, one lease holder at a time
// (another instance takes over once the lease has expired); a stream cut by a page is the
// next page's Continued, with its model, cursor and snapshots; a page deletes the queue rows
// of the applied events that were queued, and only those; EnqueueFrom queues the stream's
// stored events from that event on and, on the page's last stream, moves the position past
// the whole stream; an empty page ends the catch-up; the counters are exact.
func TestPGStoreCatchUpPagesQueueAndCounters(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := isolatedDB(t)
	store := psStore(d)
	ss := psSortedStreams(4)
	s1, s2, s3, s4 := ss[0], ss[1], ss[2], ss[3]
	// Another perspective, registered before every event: every event is queued for it.
	other := uniqueName("ps_catchup_other")
	_, err := store.Register(ctx, other, 1)
	require.NoError(t, err)
	// Before the registration (queued for the other perspective only): s1 3 events, s2 4, s3 6.
	ev1, ev2, ev3 := events(s1, newIDs(t, 3)), events(s2, newIDs(t, 4)), events(s3, newIDs(t, 6))
	require.NoError(t, worker.Append(ctx, d.Pool, append(append(slices.Clone(ev1), ev2...), ev3...)...))
	name := uniqueName("ps_catchup")
	builds, err := store.Register(ctx, name, 1)
	require.NoError(t, err)
	require.Len(t, builds, 1)
	key := builds[0].Key
	require.Equal(t, name, key)
	// After it (queued for the build): one more event of s2, two of s4.
	late2, ev4 := events(s2, newIDs(t, 1)), events(s4, newIDs(t, 2))
	require.NoError(t, worker.Append(ctx, d.Pool, late2...))
	require.NoError(t, worker.Append(ctx, d.Pool, ev4...))
	ev2 = append(ev2, late2...)
	id1, id2, id3, id4 := psIDs(ev1), psIDs(ev2), psIDs(ev3), psIDs(ev4)
	pair := func(s uuid.UUID) worker.Pair { return worker.Pair{Stream: s, Perspective: key} }
	require.Equal(t, id2[4:], psQueued(t, ctx, d, pair(s2)))
	require.Equal(t, id4, psQueued(t, ctx, d, pair(s4)))

	a, b := uuid.New(), uuid.New()
	var read []uuid.UUID // every page's events, in order
	type pageWant struct {
		events    []uuid.UUID
		continued uuid.UUID
		streams   []uuid.UUID
	}
	run := func(inst uuid.UUID, want pageWant, fold func(worker.CatchUpPage) []worker.PairWrite) worker.CatchUpResult {
		t.Helper()
		calls := 0
		res, err := store.CatchUp(ctx, psCatchUp(key, inst, time.Minute, 4), func(p worker.CatchUpPage) []worker.PairWrite {
			calls++
			require.Equal(t, key, p.Key)
			require.Equal(t, want.events, psIDs(p.Events), "the page's events")
			require.Equal(t, want.continued, p.Continued, "the page's Continued")
			var streams []uuid.UUID
			for s, st := range p.Streams {
				streams = append(streams, s)
				require.Equal(t, pair(s), st.Pair)
			}
			require.ElementsMatch(t, want.streams, streams, "the page's streams, each under its cursor row lock")
			for _, s := range streams {
				// A cursor row the page created is not visible to others before the commit;
				// one that existed is locked.
				if psCursorExists(t, ctx, d, pair(s)) {
					require.True(t, psLockedElsewhere(t, ctx, d, pair(s)), "the cursor row of %s is locked during fold", s)
				}
			}
			read = append(read, psIDs(p.Events)...)
			return fold(p)
		})
		require.NoError(t, err)
		require.Equal(t, 1, calls)
		return res
	}
	buildState := func(stream, event uuid.UUID, events, streams int64, holder uuid.UUID) {
		t.Helper()
		bs := psBuild(t, ctx, d, key)
		require.Equal(t, psNull(stream), bs.CatchUpStream, "catch-up position: stream")
		require.Equal(t, psNull(event), bs.CatchUpEvent, "catch-up position: event")
		require.Equal(t, events, bs.Events, "catchup_events")
		require.Equal(t, streams, bs.Streams, "catchup_streams")
		require.Equal(t, psNull(holder), bs.Holder)
		require.True(t, bs.LeaseLive, "the lease is renewed")
		require.False(t, bs.Done)
	}

	// Page 1 (a): s1 whole, s2 cut after its first event.
	res := run(a, pageWant{events: append(slices.Clone(id1), id2[0]), streams: []uuid.UUID{s1, s2}}, func(p worker.CatchUpPage) []worker.PairWrite {
		for _, s := range []uuid.UUID{s1, s2} {
			st := p.Streams[s]
			require.False(t, st.LastEventID.Valid, "%s has no position in the build yet", s)
			require.Nil(t, st.Model)
			require.Empty(t, st.Snapshots)
		}
		return []worker.PairWrite{
			{Pair: pair(s1), Applied: id1, Model: json.RawMessage(`{"s":1,"n":3}`), LastEventID: id1[2], SinceSnapshot: 3},
			{Pair: pair(s2), Applied: id2[:1], Model: json.RawMessage(`{"s":2,"n":1}`), LastEventID: id2[0], SinceSnapshot: 0,
				Snapshots: []worker.Snapshot{{EventID: id2[0], Model: json.RawMessage(`{"s":2,"n":1}`)}}},
		}
	})
	require.Equal(t, worker.CatchUpResult{Events: 4, Applied: 4}, res)
	buildState(s2, id2[0], 4, 1, a)
	m, at, ok := psModelOf(t, ctx, d, pair(s1))
	require.True(t, ok)
	require.Equal(t, `{"n":3,"s":1}`, m)
	require.Equal(t, id1[2], at)
	require.Equal(t, gsCursor{LastEventID: psNull(id1[2]), Version: 1, EventsSinceSnapshot: 3, Status: "ok"}, psReadCursor(t, ctx, d, pair(s1)))

	// b gets nothing while a's lease lasts.
	before := psBuild(t, ctx, d, key)
	res, err = store.CatchUp(ctx, psCatchUp(key, b, time.Minute, 4), psNoFold(t))
	require.NoError(t, err)
	require.Equal(t, worker.CatchUpResult{NotHeld: true}, res)
	require.Equal(t, before, psBuild(t, ctx, d, key))

	// a's lease expires: b takes over, from a's position. Page 2: the rest of s2 (Continued).
	gsExec(t, ctx, d.Pool, `UPDATE wh_perspective_builds SET catchup_expiry = clock_timestamp() - interval '1 second' WHERE build_key = $1`, key)
	res = run(b, pageWant{events: id2[1:5], continued: s2, streams: []uuid.UUID{s2}}, func(p worker.CatchUpPage) []worker.PairWrite {
		st := p.Streams[s2]
		require.Equal(t, psNull(id2[0]), st.LastEventID, "Continued: its cursor")
		require.JSONEq(t, `{"s":2,"n":1}`, string(st.Model), "Continued: its model")
		require.Equal(t, id2[0], st.ModelAt)
		require.Equal(t, []uuid.UUID{id2[0]}, st.Snapshots, "Continued: its snapshots")
		return []worker.PairWrite{{Pair: pair(s2), Applied: id2[1:5], Model: json.RawMessage(`{"s":2,"n":5}`), LastEventID: id2[4], SinceSnapshot: 4}}
	})
	require.Equal(t, worker.CatchUpResult{Events: 4, Applied: 4}, res)
	buildState(s2, id2[4], 8, 1, b)
	require.Empty(t, psQueued(t, ctx, d, pair(s2)), "the queued event the page applied is no longer queued")
	res, err = store.CatchUp(ctx, psCatchUp(key, a, time.Minute, 4), psNoFold(t))
	require.NoError(t, err)
	require.Equal(t, worker.CatchUpResult{NotHeld: true}, res, "a's lease was taken over")

	// Page 3: s3's first four events; its second fails: recorded, and s3 queued from it on,
	// beyond the page: the position passes the whole stream.
	res = run(b, pageWant{events: id3[:4], streams: []uuid.UUID{s3}}, func(worker.CatchUpPage) []worker.PairWrite {
		return []worker.PairWrite{{Pair: pair(s3), Applied: id3[:1], Model: json.RawMessage(`{"s":3,"n":1}`), LastEventID: id3[0],
			SinceSnapshot: 1, Failure: worker.Failure{Cause: "boom", Action: worker.FailureRetry}, EnqueueFrom: id3[1]}}
	})
	require.Equal(t, worker.CatchUpResult{Events: 4, Applied: 1}, res)
	buildState(s3, psMaxUUID, 12, 3, b) // s2 and s3 passed
	require.Equal(t, id3[1:], psQueued(t, ctx, d, pair(s3)), "the stream's events from EnqueueFrom on, the page's and the later ones")
	c := psReadCursor(t, ctx, d, pair(s3))
	require.Equal(t, psNull(id3[0]), c.LastEventID)
	require.Equal(t, "failed", c.Status)
	require.EqualValues(t, 1, c.Attempts)
	require.Equal(t, "boom", *c.LastError)

	// Page 4: s4 (not Continued: s3 was passed whole); of its two queued events only the
	// applied one leaves the queue.
	res = run(b, pageWant{events: id4, streams: []uuid.UUID{s4}}, func(worker.CatchUpPage) []worker.PairWrite {
		return []worker.PairWrite{{Pair: pair(s4), Applied: id4[:1], Model: json.RawMessage(`{"s":4,"n":1}`), LastEventID: id4[0], SinceSnapshot: 1}}
	})
	require.Equal(t, worker.CatchUpResult{Events: 2, Applied: 1}, res)
	buildState(s4, id4[1], 14, 3, b)
	require.Equal(t, id4[1:], psQueued(t, ctx, d, pair(s4)), "an event not applied stays queued")

	// Page 5: nothing left: done, s4 passed.
	res, err = store.CatchUp(ctx, psCatchUp(key, b, time.Minute, 4), psNoFold(t))
	require.NoError(t, err)
	require.Equal(t, worker.CatchUpResult{Done: true}, res)
	bs := psBuild(t, ctx, d, key)
	require.True(t, bs.Done)
	require.NotNil(t, bs.DoneAt)
	require.EqualValues(t, 14, bs.Events, "every event read once (s3's last two were queued, not read)")
	require.EqualValues(t, 4, bs.Streams, "every stream passed once")
	require.False(t, bs.Holder.Valid, "the lease is given up")
	for _, inst := range []uuid.UUID{a, b} {
		res, err = store.CatchUp(ctx, psCatchUp(key, inst, time.Minute, 4), psNoFold(t))
		require.NoError(t, err)
		require.Equal(t, worker.CatchUpResult{NotHeld: true}, res, "a finished catch-up is held by no one")
	}

	var want []uuid.UUID
	for _, ids := range [][]uuid.UUID{id1, id2, id3[:4], id4} {
		want = append(want, ids...)
	}
	require.Equal(t, want, read, "the pages, in (stream, event) order, each event once")
	for s, ids := range map[uuid.UUID][]uuid.UUID{s1: id1, s2: id2, s3: id3, s4: id4} {
		require.Equal(t, ids, psQueued(t, ctx, d, worker.Pair{Stream: s, Perspective: other}),
			"the catch-up deletes no queue row of another build")
	}
}

// A catch-up page holds its lease for the whole transaction: another instance's CatchUp
// meanwhile does not wait for it and finds the lease held (NotHeld), even once the lease has
// lapsed while the page is open. A page whose lease lapsed while fold ran still commits (no
// one could take the lease over while the page's transaction held the build's row), and
// renews the lease.
func TestPGStoreCatchUpLeaseAndFencing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := isolatedDB(t)
	store := psStore(d)
	ss := psSortedStreams(2)
	s1, s2 := ss[0], ss[1]
	ev1, ev2 := events(s1, newIDs(t, 3)), events(s2, newIDs(t, 2))
	require.NoError(t, worker.Append(ctx, d.Pool, append(slices.Clone(ev1), ev2...)...))
	name := uniqueName("ps_lease")
	_, err := store.Register(ctx, name, 1)
	require.NoError(t, err)
	key := name
	id1, id2 := psIDs(ev1), psIDs(ev2)
	pair := func(s uuid.UUID) worker.Pair { return worker.Pair{Stream: s, Perspective: key} }
	a, b := uuid.New(), uuid.New()
	// bTries runs b's CatchUp while a's page is open: it must neither fold nor wait.
	bTries := func(what string) {
		t.Helper()
		bctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		r, err := store.CatchUp(bctx, psCatchUp(key, b, time.Minute, 2), func(worker.CatchUpPage) []worker.PairWrite {
			t.Errorf("%s: b folded a page while a held the lease", what)
			return nil
		})
		require.NoError(t, err, "%s: b waited for a's page", what)
		require.Equal(t, worker.CatchUpResult{NotHeld: true}, r, what)
	}

	// Page 1 (a), two events of s1; b tries during a's fold.
	res, err := store.CatchUp(ctx, psCatchUp(key, a, time.Minute, 2), func(p worker.CatchUpPage) []worker.PairWrite {
		bTries("a's lease live")
		// Nor can any other writer move the position meanwhile: the page's transaction holds
		// the build's row from the lease on (so the fence at the commit can only find the
		// lease lapsed, below).
		probe, err := d.Pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = probe.Rollback(context.Background()) }()
		gsExec(t, ctx, probe, `SET LOCAL statement_timeout = '300ms'`)
		_, err = probe.Exec(ctx, `UPDATE wh_perspective_builds SET catchup_event_id = NULL WHERE build_key = $1`, key)
		var pgErr *pgconn.PgError
		require.True(t, errors.As(err, &pgErr), "moving the position during a page should wait for the page, got %v", err)
		require.Equal(t, "57014", pgErr.Code, "query_canceled (statement_timeout): %v", err)
		return []worker.PairWrite{{Pair: pair(s1), Applied: id1[:2], Model: json.RawMessage(`{"n":2}`), LastEventID: id1[1]}}
	})
	require.NoError(t, err)
	require.Equal(t, worker.CatchUpResult{Events: 2, Applied: 2}, res)
	bTries("after a's page, a's renewed lease")
	build := psBuild(t, ctx, d, key)
	require.Equal(t, psNull(a), build.Holder)
	require.Equal(t, psNull(id1[1]), build.CatchUpEvent)

	// Page 2 (a) with a short lease that lapses while fold runs: written all the same (page
	// 1 showed that nothing else can move the position or take the lease while a page is
	// open), and the lease renewed.
	const short = 200 * time.Millisecond
	folded := false
	res, err = store.CatchUp(ctx, psCatchUp(key, a, short, 2), func(p worker.CatchUpPage) []worker.PairWrite {
		folded = true
		require.Equal(t, s1, p.Continued)
		require.Equal(t, []uuid.UUID{id1[2], id2[0]}, psIDs(p.Events))
		// The lease was taken before fold began: it ends before now + short.
		end := psClock(t, ctx, d).Add(short)
		eventually(t, 10*time.Second, "the lease to lapse", func() bool { return psClock(t, ctx, d).After(end) })
		bTries("a's lease lapsed, its page open")
		return []worker.PairWrite{
			{Pair: pair(s1), Applied: id1[2:], Model: json.RawMessage(`{"n":3}`), LastEventID: id1[2]},
			{Pair: pair(s2), Applied: id2[:1], Model: json.RawMessage(`{"n":1}`), LastEventID: id2[0]},
		}
	})
	require.True(t, folded)
	require.NoError(t, err)
	require.Equal(t, worker.CatchUpResult{Events: 2, Applied: 2}, res)
	build = psBuild(t, ctx, d, key)
	require.Equal(t, psNull(a), build.Holder)
	require.Equal(t, psNull(id2[0]), build.CatchUpEvent)
	require.EqualValues(t, 4, build.Events)
	require.EqualValues(t, 1, build.Streams)
	require.True(t, build.LeaseLive, "the page renewed a's lease")
	m, at, ok := psModelOf(t, ctx, d, pair(s1))
	require.True(t, ok)
	require.Equal(t, `{"n":3}`, m)
	require.Equal(t, id1[2], at)
}

// psPromoteFixture registers version 1 (active) and 2 (building) of a new perspective on d.
func psPromoteFixture(t *testing.T, ctx context.Context, d *pgtest.DB, store worker.Store) (name, v1, v2 string) {
	t.Helper()
	name = uniqueName("ps_promote")
	_, err := store.Register(ctx, name, 1)
	require.NoError(t, err)
	_, err = store.Register(ctx, name, 2)
	require.NoError(t, err)
	return name, name, name + "@v2.1"
}

// psQueuedSince queues an event for build key, enqueued age ago.
func psQueuedSince(t *testing.T, ctx context.Context, d *pgtest.DB, key string, age string) {
	t.Helper()
	s := uuid.New()
	gsExec(t, ctx, d.Pool, `INSERT INTO wh_perspective_events (stream_id, perspective_name, event_id, enqueued_at)
		VALUES ($1, $2, $3, now() - $4::interval)`, s, key, uuid.Must(uuid.NewV7()), age)
	gsExec(t, ctx, d.Pool, `INSERT INTO wh_perspective_pairs (stream_id, perspective_name, due_at) VALUES ($1, $2, now())`, s, key)
}

// Promote refuses a build whose catch-up is not done (even forced) and, unless forced,
// one with an event queued by the end of its catch-up or whose queue is more than a second
// behind the active build's; otherwise it makes the build active and retires the active one.
func TestPGStorePromoteWhenCaughtUp(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := isolatedDB(t)
	store := psStore(d)
	start := psClock(t, ctx, d)
	requireUnchanged := func(v1, v2 string, b1, b2 psBuildRow) {
		t.Helper()
		require.Equal(t, b1, psBuild(t, ctx, d, v1))
		require.Equal(t, b2, psBuild(t, ctx, d, v2))
	}
	requirePromoted := func(v1, v2 string) {
		t.Helper()
		old, cand := psBuild(t, ctx, d, v1), psBuild(t, ctx, d, v2)
		require.Equal(t, worker.BuildActive, cand.State)
		require.NotNil(t, cand.PromotedAt)
		require.False(t, cand.PromotedAt.Before(start))
		require.Equal(t, worker.BuildRetired, old.State)
		require.NotNil(t, old.RetiredAt)
		require.False(t, old.RetiredAt.Before(start))
		require.Nil(t, cand.RetiredAt)
	}
	promote := func(name, key string, force bool) bool {
		t.Helper()
		ok, err := store.Promote(ctx, name, key, force, worker.LeaderLease{})
		require.NoError(t, err)
		return ok
	}

	// Not caught up: refused, forced or not.
	name, v1, v2 := psPromoteFixture(t, ctx, d, store)
	b1, b2 := psBuild(t, ctx, d, v1), psBuild(t, ctx, d, v2)
	require.Equal(t, worker.BuildBuilding, b2.State)
	require.Nil(t, b2.PromotedAt)
	require.False(t, promote(name, v2, false))
	require.False(t, promote(name, v2, true), "forced: the catch-up must still be done")
	requireUnchanged(v1, v2, b1, b2)
	_, err := store.Promote(ctx, name, name+"@v9.1", true, worker.LeaderLease{})
	require.Error(t, err, "no such build")

	// The catch-up ended a minute ago: the queue rows below came after it (but see the end).
	done := func(key string) {
		gsExec(t, ctx, d.Pool, `UPDATE wh_perspective_builds SET catchup_done = true, catchup_done_at = now() - interval '1 minute' WHERE build_key = $1`, key)
	}
	// Caught up, its queue 10 s old and the active build's empty: refused; forced: promoted.
	done(v2)
	psQueuedSince(t, ctx, d, v2, "10 seconds")
	b1, b2 = psBuild(t, ctx, d, v1), psBuild(t, ctx, d, v2)
	require.False(t, promote(name, v2, false), "10 s behind an empty queue")
	requireUnchanged(v1, v2, b1, b2)
	require.True(t, promote(name, v2, true), "forced: the queue does not matter")
	requirePromoted(v1, v2)
	require.False(t, promote(name, v2, false), "already active")
	require.False(t, promote(name, v1, true), "a retired build is not promoted again")

	// Within a second of the active build's queue: promoted.
	name, v1, v2 = psPromoteFixture(t, ctx, d, store)
	done(v2)
	psQueuedSince(t, ctx, d, v2, "10 seconds")
	psQueuedSince(t, ctx, d, v1, "9.5 seconds")
	require.True(t, promote(name, v2, false), "half a second behind")
	requirePromoted(v1, v2)

	// Two seconds behind: refused; forced: promoted.
	name, v1, v2 = psPromoteFixture(t, ctx, d, store)
	done(v2)
	psQueuedSince(t, ctx, d, v2, "10 seconds")
	psQueuedSince(t, ctx, d, v1, "8 seconds")
	b1, b2 = psBuild(t, ctx, d, v1), psBuild(t, ctx, d, v2)
	require.False(t, promote(name, v2, false), "two seconds behind")
	requireUnchanged(v1, v2, b1, b2)
	require.True(t, promote(name, v2, true))
	requirePromoted(v1, v2)

	// Nothing queued for the candidate, the active build behind: promoted.
	name, v1, v2 = psPromoteFixture(t, ctx, d, store)
	done(v2)
	psQueuedSince(t, ctx, d, v1, "5 seconds")
	require.True(t, promote(name, v2, false))
	requirePromoted(v1, v2)

	// Its oldest queued row queued by the end of its catch-up (handed to the queue by it),
	// younger than the active build's: refused, until that row is applied; forced: promoted.
	caughtUpAgo := func(key string) {
		gsExec(t, ctx, d.Pool, `UPDATE wh_perspective_builds SET catchup_done = true, catchup_done_at = now() - interval '2 seconds' WHERE build_key = $1`, key)
	}
	name, v1, v2 = psPromoteFixture(t, ctx, d, store)
	caughtUpAgo(v2)
	psQueuedSince(t, ctx, d, v2, "3 seconds")
	psQueuedSince(t, ctx, d, v1, "5 seconds")
	b1, b2 = psBuild(t, ctx, d, v1), psBuild(t, ctx, d, v2)
	require.False(t, promote(name, v2, false), "what the catch-up queued waits")
	requireUnchanged(v1, v2, b1, b2)
	gsExec(t, ctx, d.Pool, `UPDATE wh_perspective_pairs SET due_at = 'infinity' WHERE perspective_name = $1`, v2)
	require.False(t, promote(name, v2, false), "what the catch-up queued is parked in the candidate only: readers would lose its events")
	requireUnchanged(v1, v2, b1, b2)
	gsExec(t, ctx, d.Pool, `INSERT INTO wh_perspective_cursors (stream_id, perspective_name, status, attempts, last_error)
		SELECT stream_id, $2, 'parked', 8, 'poison' FROM wh_perspective_pairs WHERE perspective_name = $1`, v2, v1)
	require.True(t, promote(name, v2, false), "what the catch-up queued is parked in the active build too: no further behind")
	requirePromoted(v1, v2)
	name, v1, v2 = psPromoteFixture(t, ctx, d, store)
	caughtUpAgo(v2)
	psQueuedSince(t, ctx, d, v2, "3 seconds")
	psQueuedSince(t, ctx, d, v1, "5 seconds")
	gsExec(t, ctx, d.Pool, `DELETE FROM wh_perspective_events WHERE perspective_name = $1`, v2)
	gsExec(t, ctx, d.Pool, `DELETE FROM wh_perspective_pairs WHERE perspective_name = $1`, v2)
	psQueuedSince(t, ctx, d, v2, "1 second") // an Append after the catch-up's end
	require.True(t, promote(name, v2, false), "what the catch-up queued is applied")
	requirePromoted(v1, v2)
	name, v1, v2 = psPromoteFixture(t, ctx, d, store)
	caughtUpAgo(v2)
	psQueuedSince(t, ctx, d, v2, "3 seconds")
	require.True(t, promote(name, v2, true), "forced: the queue does not matter")
	requirePromoted(v1, v2)
}

// Cleanup deletes the rows of a retired build (queue, snapshots, models, cursors) at most
// batch pairs per call, only once its grace has passed, only of the perspectives asked and
// of no other build; it reports more while rows remain and marks the build cleaned once
// none is left.
func TestPGStoreCleanupRetiredBuildsInBatches(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := isolatedDB(t)
	store := psStore(d)
	register := func(name string, versions ...int) {
		for _, v := range versions {
			_, err := store.Register(ctx, name, v)
			require.NoError(t, err)
		}
	}
	retire := func(key, ago string) {
		gsExec(t, ctx, d.Pool, `UPDATE wh_perspective_builds SET state = 'retired', retired_at = now() - $2::interval WHERE build_key = $1`, key, ago)
	}
	c, n, o := uniqueName("ps_clean"), uniqueName("ps_clean_new"), uniqueName("ps_clean_other")
	register(c, 1, 2)
	register(n, 1, 2)
	register(o, 1)
	retire(c, "2 hours")
	gsExec(t, ctx, d.Pool, `UPDATE wh_perspective_builds SET state = 'active' WHERE build_key = $1`, c+"@v2.1")
	retire(n, "0 seconds")
	retire(o, "2 hours")

	// Rows of every pair in every table.
	fill := func(key string, streams []uuid.UUID) {
		for _, s := range streams {
			p := worker.Pair{Stream: s, Perspective: key}
			ids := newIDs(t, 3)
			psCursor(t, ctx, d, p, ids[1], 2, 1)
			psModel(t, ctx, d, p, `{"v":1}`, ids[1])
			psSnapshot(t, ctx, d, p, ids[0], `{"v":0}`)
			psSnapshot(t, ctx, d, p, ids[1], `{"v":1}`)
			psQueue(t, ctx, d, p, ids[2], ids[1])
		}
	}
	cStreams := psSortedStreams(5)
	nStreams, oStreams := psSortedStreams(2), psSortedStreams(1)
	fill(c, cStreams)
	fill(c+"@v2.1", cStreams)
	fill(n, nStreams)
	fill(o, oStreams)
	// pairsLeft is the number of key's pairs with rows, each pair's rows all there or all gone.
	pairsLeft := func(key string, streams []uuid.UUID) int {
		t.Helper()
		left := 0
		for _, s := range streams {
			r := psRead(t, ctx, d, worker.Pair{Stream: s, Perspective: key})
			whole := r.Cursor != "" && r.Model != "" && len(r.Snapshots) == 2 && len(r.Queue) == 2
			gone := r.Cursor == "" && r.Model == "" && len(r.Snapshots) == 0 && len(r.Queue) == 0
			require.True(t, whole || gone, "pair (%s, %s) is partly deleted: %+v", s, key, r)
			if whole {
				left++
			}
		}
		return left
	}
	cleanup := func(names []string, batch int) bool {
		t.Helper()
		more, err := store.Cleanup(ctx, names, time.Hour, batch, worker.LeaderLease{})
		require.NoError(t, err)
		return more
	}
	others := func() {
		t.Helper()
		require.Equal(t, 5, pairsLeft(c+"@v2.1", cStreams), "the active build's rows stay")
		require.Equal(t, 2, pairsLeft(n, nStreams), "a build retired within the grace keeps its rows")
		require.Nil(t, psBuild(t, ctx, d, n).CleanedAt)
		require.Equal(t, 1, pairsLeft(o, oStreams), "a perspective not asked for keeps its rows")
		require.Nil(t, psBuild(t, ctx, d, o).CleanedAt)
	}

	require.False(t, cleanup([]string{n}, 10), "retired now, grace 1 h: nothing to clean")
	others()

	for _, left := range []int{3, 1, 0} {
		require.True(t, cleanup([]string{c, n}, 2), "rows deleted: more may remain")
		require.Equal(t, left, pairsLeft(c, cStreams), "at most 2 pairs per call")
		require.Nil(t, psBuild(t, ctx, d, c).CleanedAt, "not cleaned while the last call deleted rows")
		others()
	}
	require.False(t, cleanup([]string{c, n}, 2), "nothing left")
	require.NotNil(t, psBuild(t, ctx, d, c).CleanedAt, "marked cleaned once nothing is left")
	require.Equal(t, worker.BuildRetired, psBuild(t, ctx, d, c).State)
	require.Zero(t, psRowsOf(t, ctx, d, c))
	others()
	require.False(t, cleanup([]string{c, n}, 2), "a cleaned build is not looked at again")
	others()
}

// psRowsOf is the number of rows of build key in the queue, snapshots, models and cursors.
func psRowsOf(t testing.TB, ctx context.Context, d *pgtest.DB, key string) int {
	t.Helper()
	return psCount(t, ctx, d, `SELECT (SELECT count(*) FROM wh_perspective_events WHERE perspective_name = $1)
		+ (SELECT count(*) FROM wh_perspective_snapshots WHERE perspective_name = $1)
		+ (SELECT count(*) FROM wh_perspective_models WHERE perspective_name = $1)
		+ (SELECT count(*) FROM wh_perspective_cursors WHERE perspective_name = $1)`, key)
}

// psRetiredBuild registers a new perspective's versions 1 and 2 and returns the key of its
// version 1 build, retired two hours ago (past any grace), version 2 being active.
func psRetiredBuild(t *testing.T, ctx context.Context, d *pgtest.DB, store worker.Store, prefix string) string {
	t.Helper()
	c := uniqueName(prefix)
	for _, v := range []int{1, 2} {
		_, err := store.Register(ctx, c, v)
		require.NoError(t, err)
	}
	gsExec(t, ctx, d.Pool, `UPDATE wh_perspective_builds SET state = 'retired', retired_at = now() - interval '2 hours' WHERE build_key = $1`, c)
	gsExec(t, ctx, d.Pool, `UPDATE wh_perspective_builds SET state = 'active' WHERE build_key = $1`, c+"@v2.1")
	return c
}

// Every instance queues a cleanup every PollInterval, so two instances clean the same
// retired build at once. Cleaning on until Cleanup reports nothing more must leave none of
// the build's rows, and cleaned_at is set only then: not while another transaction holds
// the last pairs' cursor rows and then deletes nothing (its cleanup failed; CI saw a retired
// build marked cleaned with all its 20 cursor rows left).
func TestPGStoreCleanupIsNotMarkedDoneWhileAnotherTransactionHoldsItsLastPairs(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := isolatedDB(t)
	store := psStore(d)
	c := psRetiredBuild(t, ctx, d, store, "ps_clean_held")
	for _, s := range psSortedStreams(3) {
		p := worker.Pair{Stream: s, Perspective: c}
		ids := newIDs(t, 2)
		psCursor(t, ctx, d, p, ids[0], 1, 1)
		psQueue(t, ctx, d, p, ids[1])
	}

	other, err := d.Pool.Begin(ctx) // another instance's cleanup of them, which will fail
	require.NoError(t, err)
	defer func() { _ = other.Rollback(context.Background()) }()
	n, err := pgq.New(other).BuildCleanupBatch(ctx, db.BuildCleanupBatchParams{BuildKey: c, BatchSize: 1000})
	require.NoError(t, err)
	require.EqualValues(t, 3, n)
	more, err := store.Cleanup(ctx, []string{c}, time.Hour, 1000, worker.LeaderLease{})
	require.NoError(t, err)
	require.False(t, more)
	require.Nil(t, psBuild(t, ctx, d, c).CleanedAt, "not cleaned while its pairs are held")
	require.NoError(t, other.Rollback(ctx))

	for i := 0; i < 3 && psBuild(t, ctx, d, c).CleanedAt == nil; i++ {
		_, err := store.Cleanup(ctx, []string{c}, time.Hour, 1000, worker.LeaderLease{})
		require.NoError(t, err)
	}
	require.Zero(t, psRowsOf(t, ctx, d, c))
	require.NotNil(t, psBuild(t, ctx, d, c).CleanedAt)
}

// Every instance queues a cleanup every PollInterval, so two instances clean the same
// retired build at once. Cleaning on until Cleanup reports nothing more must leave none of
// the build's rows, and cleaned_at is set only then.
func TestPGStoreCleanupRacingAnotherInstanceLeavesNoRows(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := isolatedDB(t)
	store := psStore(d)
	c := psRetiredBuild(t, ctx, d, store, "ps_clean_race")
	for _, s := range psSortedStreams(5) {
		p := worker.Pair{Stream: s, Perspective: c}
		ids := newIDs(t, 2)
		psCursor(t, ctx, d, p, ids[0], 1, 1)
		psModel(t, ctx, d, p, `{"v":0}`, ids[0])
		psSnapshot(t, ctx, d, p, ids[0], `{"v":0}`)
		psQueue(t, ctx, d, p, ids[1])
	}
	require.Equal(t, 20, psRowsOf(t, ctx, d, c))

	// Another instance's cleanup: its batch of 2 pairs deleted, not yet committed.
	other, err := d.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = other.Rollback(context.Background()) }()
	n, err := pgq.New(other).BuildCleanupBatch(ctx, db.BuildCleanupBatchParams{BuildKey: c, BatchSize: 2})
	require.NoError(t, err)
	require.EqualValues(t, 2, n)

	type result struct {
		more bool
		err  error
	}
	done := make(chan result, 1)
	go func() {
		more, err := store.Cleanup(ctx, []string{c}, time.Hour, 2, worker.LeaderLease{})
		done <- result{more, err}
	}()
	eventually(t, 10*time.Second, "this instance's cleanup waiting for the other's, or done", func() bool {
		return len(done) == 1 || psLockWaiters(t, ctx, d, "") == 1
	})
	require.NoError(t, other.Commit(ctx))
	r := <-done
	require.NoError(t, r.err)
	more := r.more
	for i := 0; more && i < 10; i++ {
		more, err = store.Cleanup(ctx, []string{c}, time.Hour, 2, worker.LeaderLease{})
		require.NoError(t, err)
	}
	require.False(t, more)
	require.Zero(t, psRowsOf(t, ctx, d, c), "rows of the retired build left after Cleanup reported nothing more (cleaned_at %v)",
		psBuild(t, ctx, d, c).CleanedAt)
	require.NotNil(t, psBuild(t, ctx, d, c).CleanedAt)
}

// A lost stream lock (MarkFailed's action FailureLost) is recorded (the error, the backoff
// of the failures so far, a failing status) without counting as a failure: neither a later
// failure that is not one event's nor the failing event's next failure counts it, and the
// failing event stays recorded.
func TestPGStoreALostLockDoesNotCountAsAFailure(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := isolatedDB(t)
	name := uniqueName("ps_lost")
	st := psStore(d)
	_, err := st.Register(ctx, name, 1)
	require.NoError(t, err)
	s := uuid.New()
	evs := events(s, newIDs(t, 1))
	require.NoError(t, worker.Append(ctx, d.Pool, evs...))
	k := worker.Pair{Stream: s, Perspective: name}
	lost := worker.Failure{Cause: "rewind: " + worker.ErrLockLost.Error()}
	as := func(a worker.FailureAction) func(int) worker.FailureAction {
		return func(int) worker.FailureAction { return a }
	}
	for range 2 {
		_, err := st.MarkFailed(ctx, k, lost, as(worker.FailureLost))
		require.NoError(t, err)
	}
	fp := psReadCursor(t, ctx, d, k)
	require.Equal(t, "failed", fp.Status, "a healthy pair that lost its lock is failing until it succeeds")
	seen := -1
	_, err = st.MarkFailed(ctx, k, worker.Failure{Cause: "a failure that is not one event's"},
		func(before int) worker.FailureAction { seen = before; return worker.FailureRetry })
	require.NoError(t, err)
	require.Equal(t, 0, seen, "the lost locks did not count")

	_, err = st.MarkFailed(ctx, k, worker.Failure{Cause: "poison", Event: evs[0].ID}, as(worker.FailureRetry))
	require.NoError(t, err)
	_, err = st.MarkFailed(ctx, k, lost, as(worker.FailureLost))
	require.NoError(t, err)
	cur := psReadCursor(t, ctx, d, k)
	require.NotNil(t, cur.LastError)
	require.Contains(t, *cur.LastError, worker.ErrLockLost.Error())
	require.EqualValues(t, 1, cur.Attempts, "not counted")
	require.NotNil(t, cur.NextAttemptAt, "due after a backoff")
	require.Equal(t, evs[0].ID, psFailedEvent(t, d, k), "the failing event stays recorded")
	_, err = st.MarkFailed(ctx, k, worker.Failure{Cause: "poison", Event: evs[0].ID},
		func(before int) worker.FailureAction { seen = before; return worker.FailureRetry })
	require.NoError(t, err)
	require.Equal(t, 1, seen, "the poison event's count went on across the lost lock")
}

// psFailedEvent is the pair's recorded failing event (uuid.Nil: none).
func psFailedEvent(t testing.TB, d *pgtest.DB, p worker.Pair) uuid.UUID {
	t.Helper()
	var id uuid.NullUUID
	require.NoError(t, d.Pool.QueryRow(context.Background(), `SELECT failed_event_id FROM wh_perspective_cursors
		WHERE stream_id = $1 AND perspective_name = $2`, p.Stream, p.Perspective).Scan(&id))
	return id.UUID
}
