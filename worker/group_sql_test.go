package worker_test

// Tests of the group path's and the claim's SQL (queries/apply.sql, queries/models.sql,
// queries/queue.sql), run through the sqlc-generated code against the package's real
// PostgreSQL database: which rows each statement reads, locks, writes and deletes, and that
// the statements that must not wait for another transaction do not.
//
// The tests run in parallel with the rest of the package on one database. Each works on
// fresh streams and on perspectives registered for it alone; the claim tests, which scan a
// perspective's whole queue, also unregister theirs once set up (gsSeal), so that other
// tests' appends queue nothing more for them.

import (
	"bytes"
	"cmp"
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
	"github.com/perspectives-go/perspectives/worker"
)

// gsPair is one (stream, perspective) pair as the queries return it.
type gsPair struct {
	Stream uuid.UUID
	Name   string
}

// gsArrays is the two parallel arrays (stream_ids, perspective_names) the group queries take.
func gsArrays(pairs ...gsPair) ([]uuid.UUID, []string) {
	streams := make([]uuid.UUID, len(pairs))
	names := make([]string, len(pairs))
	for i, p := range pairs {
		streams[i], names[i] = p.Stream, p.Name
	}
	return streams, names
}

// gsPairs is the pairs (stream, name) of streams.
func gsPairs(name string, streams ...uuid.UUID) []gsPair {
	out := make([]gsPair, len(streams))
	for i, s := range streams {
		out[i] = gsPair{Stream: s, Name: name}
	}
	return out
}

// gsRegister registers a new perspective for this test alone, so that Append queues events
// and creates cursor rows for it, and unregisters it when the test ends.
func gsRegister(t *testing.T, ctx context.Context, prefix string) string {
	t.Helper()
	name := uniqueName(prefix)
	_, err := pgq.New(testDB.Pool).PerspectiveRegister(ctx, name)
	require.NoError(t, err)
	// Its first build, active and caught up: Append queues events for it.
	gsExec(t, ctx, testDB.Pool, `INSERT INTO wh_perspective_builds
		(build_key, perspective_name, version, build, state, catchup_done) VALUES ($1, $1, 1, 1, 'active', true)`, name)
	t.Cleanup(func() { gsUnregister(t, context.Background(), name) })
	return name
}

// gsUnregister removes the perspectives, holding the exclusive append lock as registration
// does: the appends in flight commit first, and those after it no longer queue for them.
func gsUnregister(t *testing.T, ctx context.Context, names ...string) {
	t.Helper()
	require.NoError(t, pgx.BeginFunc(ctx, testDB.Pool, func(tx pgx.Tx) error {
		if err := pgq.New(tx).RegisterLock(ctx, 60000); err != nil { // waits up to a minute
			return err
		}
		_, err := tx.Exec(ctx, `DELETE FROM wh_perspectives WHERE perspective_name = ANY($1)`, names)
		return err
	}))
}

// gsSeal unregisters the perspectives and deletes the rows other tests' appends queued for
// them meanwhile: from then on their queue holds only the rows of streams.
func gsSeal(t *testing.T, ctx context.Context, names []string, streams ...uuid.UUID) {
	t.Helper()
	gsUnregister(t, ctx, names...)
	gsExec(t, ctx, testDB.Pool,
		`DELETE FROM wh_perspective_events WHERE perspective_name = ANY($1) AND stream_id <> ALL($2)`,
		names, streams)
}

func gsExec(t testing.TB, ctx context.Context, q db.DBTX, sql string, args ...any) {
	t.Helper()
	_, err := q.Exec(ctx, sql, pgq.Args(args)...) // any query exec mode (the pooler suite)
	require.NoError(t, err, sql)
}

// gsAppend stores n events of stream in one Append (one transaction) and returns their IDs.
func gsAppend(t testing.TB, ctx context.Context, stream uuid.UUID, n int) []uuid.UUID {
	t.Helper()
	ids := newIDs(t, n)
	require.NoError(t, worker.Append(ctx, testDB.Pool, events(stream, ids)...))
	return ids
}

// gsListener is a session of its own (LISTEN needs one) listening on the queue's channel,
// closed when the test ends.
func gsListener(t *testing.T, ctx context.Context) *pgx.Conn {
	t.Helper()
	listener, err := pgx.Connect(ctx, testDB.DirectURL)
	require.NoError(t, err)
	t.Cleanup(func() { _ = listener.Close(context.Background()) })
	_, err = listener.Exec(ctx, `LISTEN wh_perspective_events`)
	require.NoError(t, err)
	return listener
}

// gsBegin opens a transaction that the test ends (or its cleanup rolls back).
func gsBegin(t *testing.T, ctx context.Context) pgx.Tx {
	t.Helper()
	tx, err := testDB.Pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	return tx
}

// gsBeginNoWait opens a transaction in which any statement that waits (for a row lock or
// another transaction) fails after two seconds instead.
func gsBeginNoWait(t *testing.T, ctx context.Context) pgx.Tx {
	t.Helper()
	tx := gsBegin(t, ctx)
	gsExec(t, ctx, tx, `SET LOCAL statement_timeout = '2s'`)
	return tx
}

// gsHeldElsewhere reports whether another transaction holds a row lock on the pair's cursor
// row: a third transaction's FOR UPDATE NOWAIT on it fails with lock_not_available.
func gsHeldElsewhere(t *testing.T, ctx context.Context, p gsPair) bool {
	t.Helper()
	tx, err := testDB.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.Background()) }()
	_, err = tx.Exec(ctx, `SELECT 1 FROM wh_perspective_cursors
		WHERE stream_id = $1 AND perspective_name = $2 FOR UPDATE NOWAIT`, p.Stream, p.Name)
	if err == nil {
		return false
	}
	var pgErr *pgconn.PgError
	require.True(t, errors.As(err, &pgErr), "FOR UPDATE NOWAIT: %v", err)
	require.Equal(t, "55P03", pgErr.Code, "FOR UPDATE NOWAIT: %v", err)
	return true
}

// gsCursor is a cursor row's position and failure state.
type gsCursor struct {
	LastEventID         uuid.NullUUID
	Version             int64
	EventsSinceSnapshot int32
	Status              string
	Attempts            int32
	LastError           *string
	NextAttemptAt       *time.Time
}

func gsReadCursor(t testing.TB, ctx context.Context, p gsPair) gsCursor {
	t.Helper()
	var c gsCursor
	require.NoError(t, testDB.Pool.QueryRow(ctx, `
		SELECT last_event_id, version, events_since_snapshot, status, attempts, last_error, next_attempt_at
		FROM wh_perspective_cursors WHERE stream_id = $1 AND perspective_name = $2`, p.Stream, p.Name).
		Scan(&c.LastEventID, &c.Version, &c.EventsSinceSnapshot, &c.Status, &c.Attempts, &c.LastError, &c.NextAttemptAt))
	return c
}

// gsCursorExists reports whether the pair has a cursor row.
func gsCursorExists(t testing.TB, ctx context.Context, p gsPair) bool {
	t.Helper()
	var ok bool
	require.NoError(t, testDB.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM wh_perspective_cursors
		WHERE stream_id = $1 AND perspective_name = $2)`, p.Stream, p.Name).Scan(&ok))
	return ok
}

// PairsLockForApply locks and returns only the pairs whose cursor row exists and is free,
// skipping a row another open transaction holds without waiting for it.
func TestGroupSQLPairsLockForApplySkipsHeldAndMissingCursors(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := gsRegister(t, ctx, "gsql_lock")
	unregistered := uniqueName("gsql_lock_none") // no cursor row of any stream
	free := gsPair{uuid.New(), name}
	held := gsPair{uuid.New(), name}
	snapped := gsPair{uuid.New(), name}
	noCursor := gsPair{uuid.New(), name}
	ids := map[gsPair][]uuid.UUID{}
	for _, p := range []gsPair{free, held, snapped, noCursor} {
		ids[p] = gsAppend(t, ctx, p.Stream, 1)
		require.True(t, gsCursorExists(t, ctx, p), "Append creates the cursor row")
	}

	// free: another instance's live stream lock (a column, not a row lock: it is returned).
	owner := uuid.New()
	gsExec(t, ctx, testDB.Pool, `UPDATE wh_perspective_cursors
		SET stream_lock_instance_id = $3, stream_lock_expiry = now() + interval '1 hour', stream_lock_reason = 'rewind'
		WHERE stream_id = $1 AND perspective_name = $2`, free.Stream, free.Name, owner)
	// snapped: a position and a snapshot.
	gsExec(t, ctx, testDB.Pool, `UPDATE wh_perspective_cursors SET last_event_id = $3, events_since_snapshot = 4
		WHERE stream_id = $1 AND perspective_name = $2`, snapped.Stream, snapped.Name, ids[snapped][0])
	gsExec(t, ctx, testDB.Pool, `INSERT INTO wh_perspective_snapshots (stream_id, perspective_name, snapshot_event_id, model)
		VALUES ($1, $2, $3, '{}')`, snapped.Stream, snapped.Name, ids[snapped][0])
	// noCursor: its cursor row removed.
	gsExec(t, ctx, testDB.Pool, `DELETE FROM wh_perspective_cursors WHERE stream_id = $1 AND perspective_name = $2`,
		noCursor.Stream, noCursor.Name)
	// held: row-locked by another open transaction.
	holder := gsBegin(t, ctx)
	gsExec(t, ctx, holder, `SELECT 1 FROM wh_perspective_cursors WHERE stream_id = $1 AND perspective_name = $2 FOR UPDATE`,
		held.Stream, held.Name)

	tx := gsBeginNoWait(t, ctx)
	streams, names := gsArrays(free, held, snapped, noCursor, gsPair{free.Stream, unregistered})
	rows, err := pgq.New(tx).PairsLockForApply(ctx, db.PairsLockForApplyParams{StreamIds: streams, PerspectiveNames: names})
	require.NoError(t, err, "PairsLockForApply must skip the held row, not wait for it")

	got := map[gsPair]db.PairsLockForApplyRow{}
	for _, r := range rows {
		got[gsPair{r.StreamID, r.PerspectiveName}] = r
	}
	require.Len(t, rows, 2, "only the free and the snapped pair: %v", rows)
	require.Contains(t, got, free)
	require.Contains(t, got, snapped)
	require.Equal(t, db.PairsLockForApplyRow{
		StreamID: free.Stream, PerspectiveName: free.Name,
		LockHolder: owner, SnapshotIds: []uuid.UUID{},
	}, got[free])
	require.Equal(t, db.PairsLockForApplyRow{
		StreamID: snapped.Stream, PerspectiveName: snapped.Name,
		LastEventID:         uuid.NullUUID{UUID: ids[snapped][0], Valid: true},
		EventsSinceSnapshot: 4, SnapshotIds: []uuid.UUID{ids[snapped][0]},
	}, got[snapped])

	// The returned rows are locked by tx; the held one is still only the holder's.
	require.True(t, gsHeldElsewhere(t, ctx, free), "free's cursor row is locked by the tested transaction")
	require.True(t, gsHeldElsewhere(t, ctx, snapped), "snapped's cursor row is locked by the tested transaction")
	require.NoError(t, tx.Rollback(ctx))
	require.True(t, gsHeldElsewhere(t, ctx, held))

	// Once the holder is gone, the held pair is locked too: it was skipped for the lock alone.
	require.NoError(t, holder.Rollback(ctx))
	rows, err = pgq.New(testDB.Pool).PairsLockForApply(ctx, db.PairsLockForApplyParams{StreamIds: streams, PerspectiveNames: names})
	require.NoError(t, err)
	var after []gsPair
	for _, r := range rows {
		after = append(after, gsPair{r.StreamID, r.PerspectiveName})
	}
	require.ElementsMatch(t, []gsPair{free, held, snapped}, after)
}

// CursorsMissing reports exactly the pairs without a cursor row and does not wait for a row
// another open transaction updated (an upsert does: the control); CursorsEnsure creates and
// returns only the missing rows, and nothing the second time.
func TestGroupSQLCursorsMissingNeverWaitsAndCursorsEnsureCreatesOnlyMissing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := gsRegister(t, ctx, "gsql_ensure")
	unregistered := uniqueName("gsql_ensure_none")
	updated := gsPair{uuid.New(), name}  // its row updated by an open transaction
	existing := gsPair{uuid.New(), name} // its row present and free
	deleted := gsPair{uuid.New(), name}  // its row removed
	never := gsPair{uuid.New(), name}    // a stream never appended to
	otherName := gsPair{existing.Stream, unregistered}
	for _, p := range []gsPair{updated, existing, deleted} {
		gsAppend(t, ctx, p.Stream, 1)
	}
	gsExec(t, ctx, testDB.Pool, `UPDATE wh_perspective_cursors SET events_since_snapshot = 7
		WHERE stream_id = $1 AND perspective_name = $2`, existing.Stream, existing.Name)
	gsExec(t, ctx, testDB.Pool, `DELETE FROM wh_perspective_cursors WHERE stream_id = $1 AND perspective_name = $2`,
		deleted.Stream, deleted.Name)
	holder := gsBegin(t, ctx)
	gsExec(t, ctx, holder, `UPDATE wh_perspective_cursors SET attempts = attempts + 1
		WHERE stream_id = $1 AND perspective_name = $2`, updated.Stream, updated.Name)

	// The control: an upsert of the updated row does wait for the holder.
	control := gsBegin(t, ctx)
	gsExec(t, ctx, control, `SET LOCAL statement_timeout = '200ms'`)
	s, n := gsArrays(updated)
	_, err := pgq.New(control).CursorsEnsure(ctx, db.CursorsEnsureParams{StreamIds: s, PerspectiveNames: n})
	var pgErr *pgconn.PgError
	require.True(t, errors.As(err, &pgErr), "CursorsEnsure on the updated row should wait and time out, got %v", err)
	require.Equal(t, "57014", pgErr.Code, "query_canceled (statement_timeout): %v", err)
	require.NoError(t, control.Rollback(ctx))

	tx := gsBeginNoWait(t, ctx)
	q := pgq.New(tx)
	want := []gsPair{deleted, never, otherName}

	s, n = gsArrays(updated, existing, deleted, never, otherName)
	missing, err := q.CursorsMissing(ctx, db.CursorsMissingParams{StreamIds: s, PerspectiveNames: n})
	require.NoError(t, err, "CursorsMissing must not wait for the updated row")
	var gotMissing []gsPair
	for _, r := range missing {
		gotMissing = append(gotMissing, gsPair{r.StreamID, r.PerspectiveName})
	}
	require.ElementsMatch(t, want, gotMissing)

	// CursorsEnsure of the free existing row and the missing ones: it creates and returns
	// only the missing ones.
	s, n = gsArrays(existing, deleted, never, otherName)
	created, err := q.CursorsEnsure(ctx, db.CursorsEnsureParams{StreamIds: s, PerspectiveNames: n})
	require.NoError(t, err)
	var gotCreated []gsPair
	for _, r := range created {
		gotCreated = append(gotCreated, gsPair{r.StreamID, r.PerspectiveName})
	}
	require.ElementsMatch(t, want, gotCreated)

	again, err := q.CursorsEnsure(ctx, db.CursorsEnsureParams{StreamIds: s, PerspectiveNames: n})
	require.NoError(t, err)
	require.Empty(t, again, "a second CursorsEnsure creates nothing")
	require.NoError(t, tx.Commit(ctx))

	require.Equal(t, gsCursor{Version: 0, EventsSinceSnapshot: 7, Status: "ok"}, gsReadCursor(t, ctx, existing),
		"the existing row is left alone")
	for _, p := range want {
		require.Equal(t, gsCursor{Status: "ok"}, gsReadCursor(t, ctx, p), "a fresh cursor row of %v", p)
	}
	s, n = gsArrays(updated, existing, deleted, never, otherName)
	missing, err = pgq.New(testDB.Pool).CursorsMissing(ctx, db.CursorsMissingParams{StreamIds: s, PerspectiveNames: n})
	require.NoError(t, err)
	require.Empty(t, missing)
	require.NoError(t, holder.Rollback(ctx))
}

// QueueEventsForPairs returns, per asked pair, at most per_pair_limit queued events, the
// lowest IDs, with their type, data and creation time; other pairs are absent.
func TestGroupSQLQueueEventsForPairsLowestIDsPerPair(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := gsRegister(t, ctx, "gsql_events")
	unregistered := uniqueName("gsql_events_none")
	long, short, notAsked := uuid.New(), uuid.New(), uuid.New()
	base := time.Date(2024, 1, 2, 3, 4, 5, 0, time.UTC)
	stored := map[uuid.UUID]worker.Event{}
	mk := func(stream uuid.UUID, n int) []worker.Event {
		evs := make([]worker.Event, n)
		for i, id := range newIDs(t, n) {
			evs[i] = worker.Event{
				ID: id, StreamID: stream, Type: fmt.Sprintf("type_%d", i),
				Data:      json.RawMessage(fmt.Sprintf(`{"n":%d,"s":"%s"}`, i, stream)),
				CreatedAt: base.Add(time.Duration(len(stored)+i) * time.Second),
			}
			stored[id] = evs[i]
		}
		return evs
	}
	longEvs, shortEvs, notAskedEvs := mk(long, 5), mk(short, 2), mk(notAsked, 4)
	// long's highest IDs are queued first: the limit is by event ID, not queue order.
	require.NoError(t, worker.Append(ctx, testDB.Pool, longEvs[3:]...))
	require.NoError(t, worker.Append(ctx, testDB.Pool, longEvs[:3]...))
	require.NoError(t, worker.Append(ctx, testDB.Pool, shortEvs...))
	require.NoError(t, worker.Append(ctx, testDB.Pool, notAskedEvs...))

	streams, names := gsArrays(gsPair{short, name}, gsPair{long, name}, gsPair{long, unregistered})
	rows, err := pgq.New(testDB.Pool).QueueEventsForPairs(ctx, db.QueueEventsForPairsParams{
		StreamIds: streams, PerspectiveNames: names, PerPairLimit: 3,
	})
	require.NoError(t, err)

	got := map[gsPair][]uuid.UUID{}
	for _, row := range rows {
		r := row.WhEventStore
		p := gsPair{r.StreamID, row.PerspectiveName}
		got[p] = append(got[p], r.EventID)
		ev, ok := stored[r.EventID]
		require.True(t, ok, "unknown event %s", r.EventID)
		require.Equal(t, ev.StreamID, r.StreamID)
		require.Equal(t, ev.Type, r.EventType)
		require.JSONEq(t, string(ev.Data), string(r.Data))
		require.True(t, ev.CreatedAt.Equal(r.CreatedAt), "created_at %v, want %v", r.CreatedAt, ev.CreatedAt)
	}
	for p := range got {
		slices.SortFunc(got[p], func(a, b uuid.UUID) int { return bytes.Compare(a[:], b[:]) })
	}
	require.Equal(t, map[gsPair][]uuid.UUID{
		{long, name}:  sortedIDs(longEvs[:3]),
		{short, name}: sortedIDs(shortEvs),
	}, got)
}

// ModelsGet returns a row for each asked pair that has a model, and none for the others.
func TestGroupSQLModelsGetOnlyPairsWithAModel(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name, other := uniqueName("gsql_models"), uniqueName("gsql_models_other")
	a, b, c := gsPair{uuid.New(), name}, gsPair{uuid.New(), name}, gsPair{uuid.New(), name}
	bOther := gsPair{b.Stream, other} // b has a model, but of another perspective
	last := map[gsPair]uuid.UUID{}
	for _, p := range []gsPair{a, c, bOther} {
		last[p] = uuid.Must(uuid.NewV7())
		gsExec(t, ctx, testDB.Pool, `INSERT INTO wh_perspective_models (stream_id, perspective_name, model, last_event_id)
			VALUES ($1, $2, $3, $4)`, p.Stream, p.Name, fmt.Sprintf(`{"of":"%s/%s"}`, p.Stream, p.Name), last[p])
	}

	streams, names := gsArrays(a, b, c, gsPair{a.Stream, other})
	rows, err := pgq.New(testDB.Pool).ModelsGet(ctx, db.ModelsGetParams{StreamIds: streams, PerspectiveNames: names})
	require.NoError(t, err)
	require.Len(t, rows, 2, "only a and c have a model: %v", rows)
	got := map[gsPair]db.ModelsGetRow{}
	for _, r := range rows {
		got[gsPair{r.StreamID, r.PerspectiveName}] = r
	}
	for _, p := range []gsPair{a, c} {
		r, ok := got[p]
		require.True(t, ok, "no model row for %v", p)
		require.Equal(t, last[p], r.LastEventID)
		require.JSONEq(t, fmt.Sprintf(`{"of":"%s/%s"}`, p.Stream, p.Name), string(r.Model))
	}
}

// PairsApplyCommit inserts or updates each pair's model, advances and clears its cursor,
// and deletes exactly the listed queue rows, returning how many.
func TestGroupSQLPairsApplyCommitWritesModelsCursorsAndQueue(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := gsRegister(t, ctx, "gsql_commit")
	sibling := gsRegister(t, ctx, "gsql_commit_sib") // the same streams' rows of another perspective
	fresh := gsPair{uuid.New(), name}                // no model yet
	going := gsPair{uuid.New(), name}                // a model, and a cursor backing off after a failure
	bystander := gsPair{uuid.New(), name}            // not passed
	freshIDs := gsAppend(t, ctx, fresh.Stream, 3)
	goingIDs := gsAppend(t, ctx, going.Stream, 3)
	bystanderIDs := gsAppend(t, ctx, bystander.Stream, 2)

	// going's first event was applied earlier; the last attempt since failed.
	gsExec(t, ctx, testDB.Pool, `INSERT INTO wh_perspective_models (stream_id, perspective_name, model, last_event_id)
		VALUES ($1, $2, '{"old":true}', $3)`, going.Stream, going.Name, goingIDs[0])
	gsExec(t, ctx, testDB.Pool, `DELETE FROM wh_perspective_events
		WHERE stream_id = $1 AND perspective_name = $2 AND event_id = $3`, going.Stream, going.Name, goingIDs[0])
	gsExec(t, ctx, testDB.Pool, `UPDATE wh_perspective_cursors
		SET last_event_id = $3, version = 5, events_since_snapshot = 1, status = 'failed', last_error = 'boom',
		    attempts = 3, next_attempt_at = now() + interval '1 hour'
		WHERE stream_id = $1 AND perspective_name = $2`, going.Stream, going.Name, goingIDs[0])

	applied := []struct {
		p  gsPair
		id uuid.UUID
	}{
		{fresh, freshIDs[0]}, {fresh, freshIDs[1]}, {going, goingIDs[1]},
		{fresh, goingIDs[2]}, // no such row (going's event under fresh): going's row must stay
	}
	arg := db.PairsApplyCommitParams{
		StreamIds:           []uuid.UUID{fresh.Stream, going.Stream},
		PerspectiveNames:    []string{fresh.Name, going.Name},
		Models:              []string{`{"m":"fresh"}`, `{"m":"going"}`},
		LastEventIds:        []uuid.UUID{freshIDs[1], goingIDs[1]},
		EventsSinceSnapshot: []int32{2, 9},
	}
	for _, a := range applied {
		arg.AppliedStreamIds = append(arg.AppliedStreamIds, a.p.Stream)
		arg.AppliedPerspectiveNames = append(arg.AppliedPerspectiveNames, a.p.Name)
		arg.AppliedEventIds = append(arg.AppliedEventIds, a.id)
	}
	deleted, err := pgq.New(testDB.Pool).PairsApplyCommit(ctx, arg)
	require.NoError(t, err)
	require.EqualValues(t, 3, deleted)

	for p, want := range map[gsPair]struct {
		model string
		last  uuid.UUID
	}{
		fresh: {`{"m":"fresh"}`, freshIDs[1]},
		going: {`{"m":"going"}`, goingIDs[1]},
	} {
		raw, ok, err := worker.LoadModel(ctx, testDB.Pool, p.Name, p.Stream)
		require.NoError(t, err)
		require.True(t, ok, "model of %v", p)
		require.JSONEq(t, want.model, string(raw))
		var last uuid.UUID
		require.NoError(t, testDB.Pool.QueryRow(ctx, `SELECT last_event_id FROM wh_perspective_models
			WHERE stream_id = $1 AND perspective_name = $2`, p.Stream, p.Name).Scan(&last))
		require.Equal(t, want.last, last, "model position of %v", p)
	}
	_, ok, err := worker.LoadModel(ctx, testDB.Pool, bystander.Name, bystander.Stream)
	require.NoError(t, err)
	require.False(t, ok, "the bystander has no model")

	require.Equal(t, gsCursor{
		LastEventID: uuid.NullUUID{UUID: freshIDs[1], Valid: true}, Version: 1, EventsSinceSnapshot: 2, Status: "ok",
	}, gsReadCursor(t, ctx, fresh))
	require.Equal(t, gsCursor{
		LastEventID: uuid.NullUUID{UUID: goingIDs[1], Valid: true}, Version: 6, EventsSinceSnapshot: 9, Status: "ok",
	}, gsReadCursor(t, ctx, going))
	require.Equal(t, gsCursor{Status: "ok"}, gsReadCursor(t, ctx, bystander))
	require.Equal(t, gsCursor{Status: "ok"}, gsReadCursor(t, ctx, gsPair{fresh.Stream, sibling}))

	require.Equal(t, freshIDs[2:], queued(t, ctx, fresh.Name, fresh.Stream))
	require.Equal(t, goingIDs[2:], queued(t, ctx, going.Name, going.Stream))
	require.Equal(t, bystanderIDs, queued(t, ctx, bystander.Name, bystander.Stream))
	require.Equal(t, freshIDs, queued(t, ctx, sibling, fresh.Stream), "the sibling perspective's rows stay")
	require.Equal(t, goingIDs, queued(t, ctx, sibling, going.Stream), "the sibling perspective's rows stay")
}

// SnapshotsInsert stores every snapshot with its own model (replacing one at the same
// position); SnapshotsDelete deletes exactly the listed (pair, position) rows; a pair or
// position not listed keeps its snapshots.
func TestGroupSQLSnapshotsInsertAndDeleteExactlyTheListed(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	// Snapshots need no registered perspective: a unique name and fresh streams.
	name, other := uniqueName("gsql_snap"), uniqueName("gsql_snap_other")
	a, b := gsPair{uuid.New(), name}, gsPair{uuid.New(), name}
	aOther := gsPair{a.Stream, other}
	ascending := map[gsPair][]uuid.UUID{a: newIDs(t, 4), b: newIDs(t, 3)}
	ascending[aOther] = ascending[a] // the same positions under another perspective

	var ins db.SnapshotsInsertParams
	for p, ids := range ascending {
		for _, id := range ids {
			ins.StreamIds = append(ins.StreamIds, p.Stream)
			ins.PerspectiveNames = append(ins.PerspectiveNames, p.Name)
			ins.SnapshotEventIds = append(ins.SnapshotEventIds, id)
			ins.Models = append(ins.Models, fmt.Sprintf(`{"at":"%s","v":1}`, id))
		}
	}
	q := pgq.New(testDB.Pool)
	require.NoError(t, q.SnapshotsInsert(ctx, ins))
	// Again at one position: replaced, not doubled.
	require.NoError(t, q.SnapshotsInsert(ctx, db.SnapshotsInsertParams{
		StreamIds: []uuid.UUID{b.Stream}, PerspectiveNames: []string{b.Name},
		SnapshotEventIds: []uuid.UUID{ascending[b][0]}, Models: []string{fmt.Sprintf(`{"at":"%s","v":2}`, ascending[b][0])},
	}))
	stored := func(p gsPair) []uuid.UUID {
		ids, err := q.SnapshotIDs(ctx, db.SnapshotIDsParams{StreamID: p.Stream, PerspectiveName: p.Name})
		require.NoError(t, err)
		var misplaced int
		require.NoError(t, testDB.Pool.QueryRow(ctx, `SELECT count(*) FROM wh_perspective_snapshots
			WHERE stream_id = $1 AND perspective_name = $2 AND model->>'at' <> snapshot_event_id::text`,
			p.Stream, p.Name).Scan(&misplaced))
		require.Zero(t, misplaced, "every snapshot of %v keeps its own model", p)
		return ids
	}
	newestFirst := func(ids ...uuid.UUID) []uuid.UUID {
		out := slices.Clone(ids)
		slices.Reverse(out)
		return out
	}
	for p, ids := range ascending {
		require.Equal(t, newestFirst(ids...), stored(p), "inserted snapshots of %v, newest first", p)
	}
	var v int
	require.NoError(t, testDB.Pool.QueryRow(ctx, `SELECT (model->>'v')::int FROM wh_perspective_snapshots
		WHERE stream_id = $1 AND perspective_name = $2 AND snapshot_event_id = $3`, b.Stream, b.Name, ascending[b][0]).Scan(&v))
	require.Equal(t, 2, v, "a snapshot at the same position is replaced")

	// Delete a's 2nd and 3rd and b's 1st; also list a position of a under b (no such row).
	deleted, err := q.SnapshotsDelete(ctx, db.SnapshotsDeleteParams{
		StreamIds:        []uuid.UUID{a.Stream, a.Stream, b.Stream, b.Stream},
		PerspectiveNames: []string{a.Name, a.Name, b.Name, b.Name},
		SnapshotEventIds: []uuid.UUID{ascending[a][1], ascending[a][2], ascending[b][0], ascending[a][0]},
	})
	require.NoError(t, err)
	require.EqualValues(t, 3, deleted)
	require.Equal(t, newestFirst(ascending[a][0], ascending[a][3]), stored(a))
	require.Equal(t, newestFirst(ascending[b][1:]...), stored(b))
	require.Equal(t, newestFirst(ascending[aOther]...), stored(aOther), "another perspective's snapshots stay")

	// SnapshotsDeleteFrom drops the pair's snapshots at and after a position.
	deleted, err = q.SnapshotsDeleteFrom(ctx, db.SnapshotsDeleteFromParams{StreamID: a.Stream, PerspectiveName: other, FromEventID: ascending[a][2]})
	require.NoError(t, err)
	require.EqualValues(t, 2, deleted)
	require.Equal(t, newestFirst(ascending[a][:2]...), stored(aOther))
}

// PairsMarkFailed records each pair's error on its cursor and on every queued row of it,
// and schedules the retry at base doubled per earlier attempt, capped at max; the pairs not
// listed, and a sibling perspective's rows, do not change.
func TestGroupSQLPairsMarkFailedBacksOffPerPair(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := gsRegister(t, ctx, "gsql_fail")
	sibling := gsRegister(t, ctx, "gsql_fail_sib")
	first, third, capped, bystander := gsPair{uuid.New(), name}, gsPair{uuid.New(), name}, gsPair{uuid.New(), name}, gsPair{uuid.New(), name}
	for _, p := range []gsPair{first, third, capped, bystander} {
		gsAppend(t, ctx, p.Stream, 2)
	}
	gsExec(t, ctx, testDB.Pool, `UPDATE wh_perspective_cursors SET attempts = 2
		WHERE stream_id = $1 AND perspective_name = $2`, third.Stream, third.Name)
	gsExec(t, ctx, testDB.Pool, `UPDATE wh_perspective_cursors SET attempts = 50
		WHERE stream_id = $1 AND perspective_name = $2`, capped.Stream, capped.Name)

	var before time.Time
	require.NoError(t, testDB.Pool.QueryRow(ctx, `SELECT now()`).Scan(&before))
	streams, names := gsArrays(first, third, capped)
	rows, err := pgq.New(testDB.Pool).PairsMarkFailed(ctx, db.PairsMarkFailedParams{
		StreamIds: streams, PerspectiveNames: names, Errors: []string{"e1", "e3", "ecap"},
		EventIds: make([]uuid.UUID, 3), Actions: []string{"retry", "retry", "retry"},
		BaseSeconds: 10, MaxSeconds: 300,
	})
	require.NoError(t, err)
	require.Len(t, rows, 3)
	for p, want := range map[gsPair]struct {
		attempts int32
		err      string
		backoff  time.Duration
	}{
		first:  {1, "e1", 10 * time.Second},
		third:  {3, "e3", 40 * time.Second},
		capped: {51, "ecap", 300 * time.Second},
	} {
		c := gsReadCursor(t, ctx, p)
		require.Equal(t, "failed", c.Status, "%v", p)
		require.Equal(t, want.attempts, c.Attempts, "%v", p)
		require.Equal(t, want.err, *c.LastError, "%v", p)
		require.NotNil(t, c.NextAttemptAt)
		got := c.NextAttemptAt.Sub(before)
		require.True(t, got >= want.backoff && got < want.backoff+5*time.Second, "%v: retry in %s, want %s", p, got, want.backoff)
		due := gsDueTimes(t, ctx, p)
		require.Len(t, due, 1, "every queued row of %v has one retry time", p)
		require.True(t, due[0].Equal(*c.NextAttemptAt), "queue rows retry with the cursor")
	}
	require.Equal(t, gsCursor{Status: "ok"}, gsReadCursor(t, ctx, bystander))
	require.Equal(t, gsCursor{Status: "ok"}, gsReadCursor(t, ctx, gsPair{first.Stream, sibling}))
	var siblingFailed int
	require.NoError(t, testDB.Pool.QueryRow(ctx, `SELECT count(*) FROM wh_perspective_events
		WHERE perspective_name = $1 AND attempts > 0`, sibling).Scan(&siblingFailed))
	require.Zero(t, siblingFailed, "the sibling perspective's queue rows are untouched")
}

// gsClaim runs QueueDuePairs and returns the claimable pairs (at most PairLimit). A nil
// InflightPairs is sent as NULL, which must mean "none".
func gsClaim(t *testing.T, ctx context.Context, arg db.QueueDuePairsParams) []gsPair {
	t.Helper()
	rows, err := pgq.New(testDB.Pool).QueueDuePairs(ctx, arg)
	require.NoError(t, err)
	out := []gsPair{}
	for _, r := range rows {
		if r.Ok && len(out) < int(arg.PairLimit) {
			out = append(out, gsPair{r.StreamID, r.PerspectiveName})
		}
	}
	require.LessOrEqual(t, len(rows), int(arg.PairLimit)+1)
	return out
}

// gsDueTimes is the distinct next_attempt_at of the pair's queue rows, in order.
func gsDueTimes(t *testing.T, ctx context.Context, p gsPair) []time.Time {
	t.Helper()
	rows, err := testDB.Pool.Query(ctx, `SELECT DISTINCT next_attempt_at FROM wh_perspective_events
		WHERE stream_id = $1 AND perspective_name = $2 ORDER BY 1`, p.Stream, p.Name)
	require.NoError(t, err)
	times, err := pgx.CollectRows(rows, pgx.RowTo[time.Time])
	require.NoError(t, err)
	return times
}

// gsStreamsDescending returns n new stream IDs, highest first: appended in this order, the
// oldest rows are not the lowest stream IDs.
func gsStreamsDescending(n int) []uuid.UUID {
	out := make([]uuid.UUID, n)
	for i := range out {
		out[i] = uuid.New()
	}
	slices.SortFunc(out, func(a, b uuid.UUID) int { return bytes.Compare(b[:], a[:]) })
	return out
}

// QueueDuePairs returns each due pair of the asked perspectives once, however many Appends
// queued it, the pair with the oldest due row first.
func TestClaimSQLReturnsEachDuePairOnceOldestFirst(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := gsRegister(t, ctx, "claim_once")
	sibling := gsRegister(t, ctx, "claim_once_sib")
	s := gsStreamsDescending(4)
	first, second, third, notDue := s[0], s[1], s[2], s[3]
	// first is queued by three separate Appends, around the others'.
	gsAppend(t, ctx, first, 2)
	gsAppend(t, ctx, second, 1)
	gsAppend(t, ctx, first, 1)
	gsAppend(t, ctx, third, 1)
	gsAppend(t, ctx, first, 1)
	gsAppend(t, ctx, notDue, 1)
	gsExec(t, ctx, testDB.Pool, `UPDATE wh_perspective_events SET next_attempt_at = now() + interval '1 hour'
		WHERE stream_id = $1 AND perspective_name = $2`, notDue, name)
	gsSeal(t, ctx, []string{name, sibling}, s...)
	require.Len(t, gsDueTimes(t, ctx, gsPair{first, name}), 1, "three Appends, one due time: the pair's first")

	me := uuid.New()
	require.Equal(t, gsPairs(name, first, second, third), gsClaim(t, ctx, db.QueueDuePairsParams{
		PerspectiveNames: []string{name}, InstanceID: me, PairLimit: 10, MaxSteps: 100,
	}), "each due pair once, oldest due row first; the sibling's rows and the rows not yet due are not claimed")
	require.Equal(t, gsPairs(sibling, first, second, third, notDue), gsClaim(t, ctx, db.QueueDuePairsParams{
		PerspectiveNames: []string{sibling}, InstanceID: me, PairLimit: 10, MaxSteps: 100,
	}), "the sibling's rows of notDue are due")
}

// QueueDuePairs skips the caller's busy pairs, pairs under another instance's live stream
// lock and pairs whose cursor backs off; an expired or own lock does not exclude.
func TestClaimSQLSkipsBusyLockedAndBackingOffPairs(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := gsRegister(t, ctx, "claim_skip")
	sibling := gsRegister(t, ctx, "claim_skip_sib")
	streams := make([]uuid.UUID, 7)
	for i := range streams {
		streams[i] = uuid.New()
		gsAppend(t, ctx, streams[i], 1) // one Append each: claimed in this order
	}
	gsSeal(t, ctx, []string{name, sibling}, streams...)
	busy, foreignLive, foreignExpired, ownLive, backingOff, backedOff, plain :=
		streams[0], streams[1], streams[2], streams[3], streams[4], streams[5], streams[6]

	me, other := uuid.New(), uuid.New()
	setLock := func(stream uuid.UUID, perspective string, owner uuid.UUID, expiry string) {
		gsExec(t, ctx, testDB.Pool, `UPDATE wh_perspective_cursors
			SET stream_lock_instance_id = $3, stream_lock_expiry = now() + $4::interval, stream_lock_reason = 'rewind'
			WHERE stream_id = $1 AND perspective_name = $2`, stream, perspective, owner, expiry)
	}
	setLock(foreignLive, name, other, "1 hour")
	setLock(foreignExpired, name, other, "-1 minute")
	setLock(ownLive, name, me, "1 hour")
	setLock(plain, sibling, other, "1 hour") // the same stream's lock of another perspective
	gsExec(t, ctx, testDB.Pool, `UPDATE wh_perspective_cursors SET next_attempt_at = now() + interval '1 hour'
		WHERE stream_id = $1 AND perspective_name = $2`, backingOff, name)
	gsExec(t, ctx, testDB.Pool, `UPDATE wh_perspective_cursors SET next_attempt_at = now() - interval '1 minute'
		WHERE stream_id = $1 AND perspective_name = $2`, backedOff, name)

	got := gsClaim(t, ctx, db.QueueDuePairsParams{
		PerspectiveNames: []string{name}, InstanceID: me, PairLimit: 10, MaxSteps: 100,
		InflightPairs: []string{busy.String() + "/" + name, plain.String() + "/" + sibling},
	})
	require.Equal(t, gsPairs(name, foreignExpired, ownLive, backedOff, plain), got)

	// Without the exclusions of the caller, the busy pair is claimed again.
	got = gsClaim(t, ctx, db.QueueDuePairsParams{
		PerspectiveNames: []string{name}, InstanceID: me, PairLimit: 10, MaxSteps: 100,
	})
	require.Equal(t, gsPairs(name, busy, foreignExpired, ownLive, backedOff, plain), got)
	// For another instance, this instance's live lock is a foreign one.
	got = gsClaim(t, ctx, db.QueueDuePairsParams{
		PerspectiveNames: []string{name}, InstanceID: other, PairLimit: 10, MaxSteps: 100,
	})
	require.Equal(t, gsPairs(name, busy, foreignLive, foreignExpired, backedOff, plain), got)
}

// QueueDuePairs returns at most pair_limit pairs, the oldest first.
func TestClaimSQLRespectsPairLimit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := gsRegister(t, ctx, "claim_limit")
	streams := gsStreamsDescending(4)
	for _, s := range streams {
		gsAppend(t, ctx, s, 2)
	}
	gsSeal(t, ctx, []string{name}, streams...)
	me := uuid.New()

	for limit := 1; limit <= 4; limit++ {
		require.Equal(t, gsPairs(name, streams[:limit]...), gsClaim(t, ctx, db.QueueDuePairsParams{
			PerspectiveNames: []string{name}, InstanceID: me, PairLimit: int32(limit), MaxSteps: 100,
		}), "pair_limit %d", limit)
	}
	require.Equal(t, gsPairs(name, streams...), gsClaim(t, ctx, db.QueueDuePairsParams{
		PerspectiveNames: []string{name}, InstanceID: me, PairLimit: 10, MaxSteps: 100,
	}))
	// A skipped pair does not count against the limit.
	require.Equal(t, gsPairs(name, streams[1:3]...), gsClaim(t, ctx, db.QueueDuePairsParams{
		PerspectiveNames: []string{name}, InstanceID: me, PairLimit: 2, MaxSteps: 100,
		InflightPairs: []string{streams[0].String() + "/" + name},
	}))
}

// Fair order: a hot stream that queued many separate Appends before the cold streams is one
// pair in the claim, not a wall of groups in front of them. Each Append stamps its rows with
// the due time its pair already has (wh_append), so the claim passes the hot pair's rows in
// one step, and a claim with room for the hot pair and the cold ones returns them all.
func TestClaimSQLServesAHotStreamsManyAppendsAsOnePair(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := gsRegister(t, ctx, "claim_fair")
	const hotAppends, coldStreams = 200, 10
	hot := uuid.New()
	for range hotAppends {
		gsAppend(t, ctx, hot, 1) // a hot stream: many one-event Appends
	}
	cold := gsStreamsDescending(coldStreams)
	for _, c := range cold {
		gsAppend(t, ctx, c, 1)
	}
	gsSeal(t, ctx, []string{name}, append([]uuid.UUID{hot}, cold...)...)
	require.Len(t, gsDueTimes(t, ctx, gsPair{hot, name}), 1, "the hot pair's %d Appends share its due time", hotAppends)

	limit := int32(1 + coldStreams)
	got := gsClaim(t, ctx, db.QueueDuePairsParams{
		PerspectiveNames: []string{name}, InstanceID: uuid.New(), PairLimit: limit,
		MaxSteps: 2 * limit, // what the worker passes for a claim of limit pairs with nothing to skip
	})
	require.Equal(t, gsPairs(name, append([]uuid.UUID{hot}, cold...)...), got,
		"the hot pair (oldest) and every cold pair, in the order of their oldest queued event")

	// The hot pair in flight (skipped), its later Appends keep its place: the cold pairs
	// are claimed, not hidden behind its rows.
	for range 50 {
		gsAppend(t, ctx, hot, 1)
	}
	got = gsClaim(t, ctx, db.QueueDuePairsParams{
		PerspectiveNames: []string{name}, InstanceID: uuid.New(), PairLimit: coldStreams,
		InflightPairs: []string{hot.String() + "/" + name}, MaxSteps: 1 + 2*coldStreams,
	})
	require.Equal(t, gsPairs(name, cold...), got)
}

// Append stamps a pair's new queue rows with the due time of the rows it has queued: a
// pair backing off after a failure keeps its retry time for the rows it gains, and a pair
// with nothing queued gets now().
func TestAppendStampsRowsWithTheirPairsDueTime(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := gsRegister(t, ctx, "append_due")
	fresh, backingOff := uuid.New(), uuid.New()
	gsAppend(t, ctx, backingOff, 2)
	gsExec(t, ctx, testDB.Pool, `UPDATE wh_perspective_events SET next_attempt_at = now() + interval '1 hour'
		WHERE stream_id = $1 AND perspective_name = $2`, backingOff, name)
	retry := gsDueTimes(t, ctx, gsPair{backingOff, name})
	require.Len(t, retry, 1)

	before := time.Now()
	gsAppend(t, ctx, backingOff, 3)
	gsAppend(t, ctx, fresh, 1)
	gsAppend(t, ctx, fresh, 1)
	require.Equal(t, retry, gsDueTimes(t, ctx, gsPair{backingOff, name}), "the new rows wait for the pair's retry")
	due := gsDueTimes(t, ctx, gsPair{fresh, name})
	require.Len(t, due, 1, "the second Append joins the first's due time")
	require.WithinDuration(t, before, due[0], 5*time.Second, "a pair with nothing queued is due now")
	var n int
	require.NoError(t, testDB.Pool.QueryRow(ctx, `SELECT count(*) FROM wh_perspective_events
		WHERE stream_id = ANY($1) AND perspective_name = $2`, pgq.Args([]any{[]uuid.UUID{fresh, backingOff}})[0], name).Scan(&n))
	require.Equal(t, 7, n, "every event queued")
}

// An Append's notification names the earliest due time it stamped on its rows (see
// worker.Store.Listen): that of a group it joined, now() for a pair with nothing queued; an
// operator's notification names none.
func TestAppendNotificationNamesTheEarliestDueTimeItQueued(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := gsRegister(t, ctx, "append_notify")
	listener := gsListener(t, ctx)
	appender, err := pgx.Connect(ctx, testDB.DirectURL) // its notifications carry its PID
	require.NoError(t, err)
	defer func() { _ = appender.Close(ctx) }()
	// notified appends to stream on appender and returns what its notification names.
	notified := func(stream uuid.UUID) time.Time {
		t.Helper()
		require.NoError(t, worker.Append(ctx, appender, events(stream, newIDs(t, 1))...))
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		for {
			n, err := listener.WaitForNotification(wctx)
			require.NoError(t, err, "the Append's notification")
			if n.PID == appender.PgConn().PID() { // other tests append too
				require.NotEmpty(t, n.Payload)
				return worker.NotifiedDue(n.Payload)
			}
		}
	}

	old := uuid.New()
	gsAppend(t, ctx, old, 1)
	gsExec(t, ctx, testDB.Pool, `UPDATE wh_perspective_events SET next_attempt_at = date_trunc('second', now()) - interval '1 hour 0.123456 second'
		WHERE stream_id = $1 AND perspective_name = $2`, old, name)
	due := gsDueTimes(t, ctx, gsPair{old, name})
	require.Len(t, due, 1)
	require.True(t, due[0].Equal(notified(old)), "the group the Append joined, to the microsecond")

	fresh := uuid.New()
	got := notified(fresh)
	due = gsDueTimes(t, ctx, gsPair{fresh, name})
	require.Len(t, due, 1)
	require.True(t, due[0].Equal(got), "now() for a pair with nothing queued: %s, named %s", due[0], got)

	require.True(t, worker.NotifiedDue("").IsZero(), "a notification that names no due time: anywhere")
}

// The other statements that make queue rows due tell the listening workers so, naming their
// due time (a claim that ran meanwhile may have started past it): a purge making a parked
// pair's rows due now, a rebuild queueing a stream again, a failure's retry time.
func TestStatementsMakingRowsDueNameTheirDueTime(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := gsRegister(t, ctx, "due_notify")
	listener := gsListener(t, ctx)
	// named waits for a notification naming due (other tests' name other times).
	named := func(what string, p gsPair) {
		t.Helper()
		due := gsDueTimes(t, ctx, p)
		require.Len(t, due, 1, what)
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		for {
			n, err := listener.WaitForNotification(wctx)
			require.NoError(t, err, "%s: a notification naming %s", what, due[0])
			if worker.NotifiedDue(n.Payload).Equal(due[0]) {
				return
			}
		}
	}
	admin, err := worker.NewAdmin(testDB.Pool, nil)
	require.NoError(t, err)

	parked := gsPair{uuid.New(), name}
	gsAppend(t, ctx, parked.Stream, 2)
	gsExec(t, ctx, testDB.Pool, `UPDATE wh_perspective_events SET next_attempt_at = '9999-12-31 00:00:00+00'
		WHERE stream_id = $1 AND perspective_name = $2`, parked.Stream, name)
	require.NoError(t, admin.Purge(ctx, parked.Stream, name))
	named("a purge", parked)

	rebuilt := gsPair{uuid.New(), name}
	gsAppend(t, ctx, rebuilt.Stream, 2)
	gsExec(t, ctx, testDB.Pool, `DELETE FROM wh_perspective_events WHERE stream_id = $1 AND perspective_name = $2`, rebuilt.Stream, name)
	n, err := admin.Rebuild(ctx, rebuilt.Stream, name)
	require.NoError(t, err)
	require.EqualValues(t, 2, n)
	named("a rebuild", rebuilt)

	failing := gsPair{uuid.New(), name}
	gsAppend(t, ctx, failing.Stream, 1)
	store := worker.NewPGStore(testDB.Pool, time.Millisecond, time.Millisecond)
	action, err := store.MarkFailed(ctx, worker.Pair{Stream: failing.Stream, Perspective: name}, worker.Failure{Cause: "boom"},
		func(int) worker.FailureAction { return worker.FailureRetry })
	require.NoError(t, err)
	require.Equal(t, worker.FailureRetry, action)
	named("a retry", failing)
}

// QueueDuePairs passes at most max_steps queued groups. A pair has several groups when
// Appends that ran concurrently stamped its rows with different times (each read none of
// the other's rows); here the groups are made by hand.
func TestClaimSQLMaxStepsBoundsTheGroupsPassed(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := gsRegister(t, ctx, "claim_steps")
	const hotGroups = 8
	s := gsStreamsDescending(3)
	bulk, hot, cold := s[0], s[1], s[2]
	gsAppend(t, ctx, bulk, 20) // one group of 20 rows: one step
	hotIDs := gsAppend(t, ctx, hot, hotGroups)
	gsAppend(t, ctx, cold, 1)
	gsSeal(t, ctx, []string{name}, s...)
	// bulk now-2h, hot's rows now-1h+i seconds (eight groups), cold now.
	gsExec(t, ctx, testDB.Pool, `UPDATE wh_perspective_events SET next_attempt_at = now() - interval '2 hours'
		WHERE stream_id = $1 AND perspective_name = $2`, bulk, name)
	for i, id := range hotIDs {
		gsExec(t, ctx, testDB.Pool, `UPDATE wh_perspective_events
			SET next_attempt_at = now() - interval '1 hour' + $4 * interval '1 second'
			WHERE stream_id = $1 AND perspective_name = $2 AND event_id = $3`, hot, name, id, i)
	}
	require.Len(t, gsDueTimes(t, ctx, gsPair{hot, name}), hotGroups)

	claim := func(steps int32) []gsPair {
		return gsClaim(t, ctx, db.QueueDuePairsParams{
			PerspectiveNames: []string{name}, InstanceID: uuid.New(), PairLimit: 10, MaxSteps: steps,
		})
	}
	// Groups in order: bulk's one, hot's eight, cold's one.
	require.Equal(t, gsPairs(name, bulk, hot, cold), claim(1000), "with steps to spare, every due pair")
	require.Equal(t, gsPairs(name, bulk, hot, cold), claim(1+hotGroups+1), "exactly enough steps to reach cold")
	require.Equal(t, gsPairs(name, bulk, hot), claim(1+hotGroups), "one step short of cold")
	require.Equal(t, gsPairs(name, bulk, hot), claim(3), "hot's groups use up the steps before cold")
	require.Equal(t, gsPairs(name, bulk, hot), claim(2), "bulk's 20 rows are one step")
	require.Equal(t, gsPairs(name, bulk), claim(1))
}

// A pair that an apply transaction has locked carries its claim mark until that transaction
// ends: other instances' claims pass it over (they cannot see the row lock) and take the
// pairs behind it; once the transaction ends, the pair is claimed again.
func TestClaimSQLPassesPairsAnotherTransactionApplies(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := gsRegister(t, ctx, "claim_marked")
	s := gsStreamsDescending(3)
	for _, stream := range s {
		gsAppend(t, ctx, stream, 1)
	}
	gsSeal(t, ctx, []string{name}, s...)
	claim := func() []gsPair {
		return gsClaim(t, ctx, db.QueueDuePairsParams{
			PerspectiveNames: []string{name}, InstanceID: uuid.New(), PairLimit: 10, MaxSteps: 100,
		})
	}
	require.Equal(t, gsPairs(name, s...), claim())

	tx := gsBegin(t, ctx)
	streams, names := gsArrays(gsPair{s[0], name})
	locked, err := pgq.New(tx).PairsLockForApply(ctx, db.PairsLockForApplyParams{StreamIds: streams, PerspectiveNames: names})
	require.NoError(t, err)
	require.Len(t, locked, 1)
	require.Equal(t, gsPairs(name, s[1:]...), claim(), "the pair being applied is passed over")
	require.NoError(t, tx.Rollback(ctx))
	require.Equal(t, gsPairs(name, s...), claim(), "the mark ends with the transaction")
}

// A claim returns where the next one may start (Claimed.Next): at the first group it passed
// that the next claim must pass again, else just after the last group it passed. The group a
// pair in flight here was claimed at and the pairs it returns are passed over; a later group
// of a pair in flight, a pair under another transaction's claim mark, one only skipped (found
// busy), one whose stream another instance has locked, or one not due stops it; it is never
// after the claim's now(). A claim from a position returns no pair queued before it.
func TestClaimSQLNextStartsAfterWhatIsBeingApplied(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := gsRegister(t, ctx, "claim_next")
	s := gsStreamsDescending(5)
	for _, stream := range s {
		gsAppend(t, ctx, stream, 1) // one Append each: due in this order
	}
	gsSeal(t, ctx, []string{name}, s...)
	at := make([]worker.QueuePosition, len(s)) // each stream's group: its position
	for i, stream := range s {
		due := gsDueTimes(t, ctx, gsPair{stream, name})
		require.Len(t, due, 1)
		at[i] = worker.QueuePosition{At: due[0], Stream: stream}
	}
	after := func(i int) worker.QueuePosition { // just after stream i's group
		return worker.QueuePosition{At: at[i].At, Stream: s[i], Perspective: name}
	}
	pairs := func(is ...int) []worker.Pair {
		out := []worker.Pair{}
		for _, i := range is {
			out = append(out, worker.Pair{Stream: s[i], Perspective: name})
		}
		return out
	}
	inflight := func(is ...int) map[worker.Pair]time.Time { // in flight, claimed at their groups
		out := map[worker.Pair]time.Time{}
		for _, i := range is {
			out[worker.Pair{Stream: s[i], Perspective: name}] = at[i].At
		}
		return out
	}
	store := worker.NewPGStore(testDB.Pool, time.Second, time.Second)
	claim := func(req worker.ClaimRequest) worker.Claimed {
		t.Helper()
		req.Perspectives, req.MaxSteps = []string{name}, 100
		req.Limit = cmp.Or(req.Limit, 10)
		c, err := store.Claim(ctx, req)
		require.NoError(t, err)
		if c.Pairs == nil {
			c.Pairs = []worker.Pair{}
		}
		return c
	}

	c := claim(worker.ClaimRequest{InFlight: inflight(0), Limit: 2})
	require.Equal(t, pairs(1, 2), c.Pairs)
	require.Equal(t, map[worker.Pair]time.Time{pairs(1)[0]: at[1].At, pairs(2)[0]: at[2].At}, c.At)
	require.Equal(t, after(2), c.Next, "past the pair in flight and the pairs returned")
	c = claim(worker.ClaimRequest{From: c.Next})
	require.Equal(t, pairs(3, 4), c.Pairs, "from there on")
	require.Equal(t, after(4), c.Next)
	c = claim(worker.ClaimRequest{From: at[1]})
	require.Equal(t, pairs(1, 2, 3, 4), c.Pairs, "a position of a group includes it")

	// Pairs whose jobs ended, looked up again at the due time they were claimed at: one with
	// rows still there starts the claim there, though its position is past them.
	group := func(i int, at worker.QueuePosition) worker.QueuedGroup {
		return worker.QueuedGroup{Pair: pairs(i)[0], At: at.At}
	}
	c = claim(worker.ClaimRequest{From: after(4), Recheck: []worker.QueuedGroup{group(3, at[3]), group(1, at[1]), group(2, at[0])}})
	require.Equal(t, pairs(1, 2, 3, 4), c.Pairs, "from the first group looked up that has rows")
	c = claim(worker.ClaimRequest{From: after(2), Recheck: []worker.QueuedGroup{group(2, at[0])}})
	require.Equal(t, pairs(3, 4), c.Pairs, "a group looked up that has no rows: from the position")
	c = claim(worker.ClaimRequest{From: at[1], Recheck: []worker.QueuedGroup{group(3, at[3])}})
	require.Equal(t, pairs(1, 2, 3, 4), c.Pairs, "a group looked up after the position: from the position")
	c = claim(worker.ClaimRequest{From: after(4), Recheck: []worker.QueuedGroup{group(2, at[2]), group(2, at[0])}})
	require.Equal(t, pairs(2, 3, 4), c.Pairs, "one pair at two groups: from the one that has rows")
	c = claim(worker.ClaimRequest{From: after(4), Recheck: []worker.QueuedGroup{group(2, at[0]), group(2, at[2])}})
	require.Equal(t, pairs(2, 3, 4), c.Pairs, "in either order")

	c = claim(worker.ClaimRequest{Skip: pairs(0)})
	require.Equal(t, pairs(1, 2, 3, 4), c.Pairs)
	require.Equal(t, at[0], c.Next, "a pair skipped once is passed again")

	gsExec(t, ctx, testDB.Pool, `UPDATE wh_perspective_cursors SET stream_lock_instance_id = $3,
		stream_lock_expiry = now() + interval '1 minute', stream_lock_reason = 'test'
		WHERE stream_id = $1 AND perspective_name = $2`, s[1], name, uuid.New())
	c = claim(worker.ClaimRequest{InFlight: inflight(0)})
	require.Equal(t, pairs(2, 3, 4), c.Pairs)
	require.Equal(t, at[1], c.Next, "a pair another instance has locked is passed again")
	gsExec(t, ctx, testDB.Pool, `UPDATE wh_perspective_cursors SET stream_lock_instance_id = NULL,
		stream_lock_expiry = NULL, stream_lock_reason = NULL WHERE stream_id = $1 AND perspective_name = $2`, s[1], name)

	// Another transaction applying stream 0 (its claim mark).
	tx, err := testDB.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	streams, names := gsArrays(gsPair{s[0], name})
	locked, err := pgq.New(tx).PairsLockForApply(ctx, db.PairsLockForApplyParams{StreamIds: streams, PerspectiveNames: names})
	require.NoError(t, err)
	require.Len(t, locked, 1)
	c = claim(worker.ClaimRequest{Limit: 1})
	require.Equal(t, pairs(1), c.Pairs, "the pair another transaction applies is passed over")
	require.Equal(t, at[0], c.Next, "and passed again: that transaction may leave rows of it")
	require.NoError(t, tx.Rollback(ctx))
	c = claim(worker.ClaimRequest{Limit: 1})
	require.Equal(t, pairs(0), c.Pairs)
	require.Equal(t, after(0), c.Next)
	c = claim(worker.ClaimRequest{InFlight: map[worker.Pair]time.Time{pairs(0)[0]: at[1].At}, Limit: 1})
	require.Equal(t, pairs(1), c.Pairs)
	require.Equal(t, at[0], c.Next, "a pair in flight claimed at another group: passed again")

	// A later group of a pair in flight (its job may have read the pair's rows before it).
	later := gsAppend(t, ctx, s[0], 1) // stored; queued here (the perspective is unregistered)
	gsExec(t, ctx, testDB.Pool, `INSERT INTO wh_perspective_events (stream_id, perspective_name, event_id)
		VALUES ($1, $2, $3)`, s[0], name, later[0])
	due := gsDueTimes(t, ctx, gsPair{s[0], name})
	require.Len(t, due, 2)
	c = claim(worker.ClaimRequest{InFlight: inflight(0, 1, 2, 3)})
	require.Equal(t, pairs(4), c.Pairs)
	require.Equal(t, worker.QueuePosition{At: due[1], Stream: s[0]}, c.Next, "a later group of a pair in flight is passed again")

	gsExec(t, ctx, testDB.Pool, `DELETE FROM wh_perspective_events WHERE event_id = $1`, later[0])
	gsExec(t, ctx, testDB.Pool, `UPDATE wh_perspective_events SET next_attempt_at = now() + interval '1 hour'
		WHERE stream_id = $1 AND perspective_name = $2`, s[4], name)
	c = claim(worker.ClaimRequest{InFlight: inflight(0, 1, 2)})
	require.Equal(t, pairs(3), c.Pairs)
	require.Equal(t, uuid.Nil, c.Next.Stream, "a group not due yet stops it (at most now())")
	require.False(t, c.Next.At.After(time.Now()))
	require.True(t, at[3].At.Before(c.Next.At))

	gsExec(t, ctx, testDB.Pool, `DELETE FROM wh_perspective_events WHERE perspective_name = $1`, name)
	c = claim(worker.ClaimRequest{})
	require.Empty(t, c.Pairs)
	require.Equal(t, worker.QueuePosition{}, c.Next, "an empty queue: no group passed")
}

// PairsMarkFailed stamps the rows it moves with the time of its statement, not of its
// transaction's start: in an apply transaction it runs after the perspective's Apply, maybe
// long after, and claims meanwhile start past older due times (Claimed.Next), which would
// leave the rows behind them until a claim from the oldest row.
func TestGroupSQLPairsMarkFailedStampsTheStatementsTime(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := gsRegister(t, ctx, "gsql_failclock")
	retried, skipped := gsPair{uuid.New(), name}, gsPair{uuid.New(), name}
	rids := gsAppend(t, ctx, retried.Stream, 2)
	sids := gsAppend(t, ctx, skipped.Stream, 2)
	gsSeal(t, ctx, []string{name}, retried.Stream, skipped.Stream)

	tx := gsBegin(t, ctx)
	var began time.Time
	require.NoError(t, tx.QueryRow(ctx, `SELECT now()`).Scan(&began))
	time.Sleep(300 * time.Millisecond) // the Apply
	streams, names := gsArrays(retried, skipped)
	_, err := pgq.New(tx).PairsMarkFailed(ctx, db.PairsMarkFailedParams{
		StreamIds: streams, PerspectiveNames: names, Errors: []string{"er", "es"},
		EventIds: []uuid.UUID{rids[0], sids[0]}, Actions: []string{"retry", "skip"},
		BaseSeconds: 0.001, MaxSeconds: 0.001, SkippedBy: "tester",
	})
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	for _, p := range []gsPair{retried, skipped} {
		due := gsDueTimes(t, ctx, p)
		require.Len(t, due, 1, "%v", p)
		require.True(t, due[0].Sub(began) >= 250*time.Millisecond,
			"%v: due %s after its transaction began, want the statement's time", p, due[0].Sub(began))
	}
}

// PairsMarkFailed's other actions: park makes the pair's rows wait (9999-12-31) with no
// retry time on the cursor; skip records the event in wh_skipped_events, unqueues it, makes
// the pair's other rows due now, clears its failure and bumps its version. A failure of
// another event than the recorded one starts a new count.
func TestGroupSQLPairsMarkFailedParksSkipsAndCountsPerEvent(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := gsRegister(t, ctx, "gsql_park")
	parked, skipped, moved := gsPair{uuid.New(), name}, gsPair{uuid.New(), name}, gsPair{uuid.New(), name}
	pids := gsAppend(t, ctx, parked.Stream, 2)
	sids := gsAppend(t, ctx, skipped.Stream, 3)
	mids := gsAppend(t, ctx, moved.Stream, 2)
	gsExec(t, ctx, testDB.Pool, `UPDATE wh_perspective_cursors SET attempts = 4, status = 'failed', failed_event_id = $3
		WHERE stream_id = $1 AND perspective_name = $2`, skipped.Stream, name, sids[0])
	gsExec(t, ctx, testDB.Pool, `UPDATE wh_perspective_cursors SET attempts = 4, status = 'failed', failed_event_id = $3
		WHERE stream_id = $1 AND perspective_name = $2`, moved.Stream, name, mids[0])
	var version int64
	require.NoError(t, testDB.Pool.QueryRow(ctx, `SELECT version FROM wh_perspective_cursors
		WHERE stream_id = $1 AND perspective_name = $2`, skipped.Stream, name).Scan(&version))

	streams, names := gsArrays(parked, skipped, moved)
	rows, err := pgq.New(testDB.Pool).PairsMarkFailed(ctx, db.PairsMarkFailedParams{
		StreamIds: streams, PerspectiveNames: names, Errors: []string{"ep", "es", "em"},
		EventIds: []uuid.UUID{pids[0], sids[0], mids[1]}, Actions: []string{"park", "skip", "retry"},
		BaseSeconds: 10, MaxSeconds: 300, SkippedBy: "tester",
	})
	require.NoError(t, err)
	require.Len(t, rows, 3)

	c := gsReadCursor(t, ctx, parked)
	require.Equal(t, "parked", c.Status)
	require.EqualValues(t, 1, c.Attempts)
	require.Nil(t, c.NextAttemptAt, "a parked pair's wait is on its rows, not its cursor")
	due := gsDueTimes(t, ctx, parked)
	require.Len(t, due, 1)
	require.Equal(t, 9999, due[0].UTC().Year())

	c = gsReadCursor(t, ctx, skipped)
	require.Equal(t, "ok", c.Status)
	require.Zero(t, c.Attempts)
	require.Nil(t, c.LastError)
	var by, reason, lastErr string
	var attempts int
	require.NoError(t, testDB.Pool.QueryRow(ctx, `SELECT skipped_by, reason, attempts, last_error FROM wh_skipped_events
		WHERE stream_id = $1 AND perspective_name = $2 AND event_id = $3`, skipped.Stream, name, sids[0]).Scan(&by, &reason, &attempts, &lastErr))
	require.Equal(t, []any{"tester", "policy", 5, "es"}, []any{by, reason, attempts, lastErr})
	require.Equal(t, sids[1:], queued(t, ctx, name, skipped.Stream), "the skipped event is unqueued, the others stay")
	var now time.Time
	require.NoError(t, testDB.Pool.QueryRow(ctx, `SELECT now()`).Scan(&now))
	for _, d := range gsDueTimes(t, ctx, skipped) {
		require.False(t, d.After(now), "the rest is due now")
	}
	var after int64
	require.NoError(t, testDB.Pool.QueryRow(ctx, `SELECT version FROM wh_perspective_cursors
		WHERE stream_id = $1 AND perspective_name = $2`, skipped.Stream, name).Scan(&after))
	require.Equal(t, version+1, after, "a rewind in flight that replayed the event is refused")

	c = gsReadCursor(t, ctx, moved)
	require.Equal(t, "failed", c.Status)
	require.EqualValues(t, 1, c.Attempts, "another event's failure starts a new count")
}

// The claim's share of the streams (see QueueDuePairs): own pairs first, then the others in
// order. Instances of other builds, one gone (its heartbeat three intervals old), one that has
// not claimed for three intervals (its slots all taken) and one stopping do not count; an
// instance without a row owns every stream.
func TestClaimSQLInstancesPreferTheStreamsTheyOwn(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := gsRegister(t, ctx, "claim_own")
	// 40 streams, the first 6 of them owned by the second of two instances (rank 1), so that
	// the first one's claims pass more of the other's pairs than they keep.
	rankOf := func(s uuid.UUID) int {
		var rank int
		require.NoError(t, testDB.Pool.QueryRow(ctx,
			`SELECT ((hashtext($1::text)::bigint & 2147483647) % 2)::int`, s.String()).Scan(&rank))
		return rank
	}
	var first, rest []uuid.UUID
	for len(first)+len(rest) < 40 {
		s := uuid.New()
		if rankOf(s) == 1 && len(first) < 6 {
			first = append(first, s)
		} else if len(rest) < 34 {
			rest = append(rest, s)
		}
	}
	streams := append(first, rest...)
	for _, s := range streams {
		gsAppend(t, ctx, s, 1) // one Append each: claimed in this order
	}
	gsSeal(t, ctx, []string{name}, streams...)

	ids := gsStreamsDescending(6) // any six instance IDs, ranked by the database's order
	slices.SortFunc(ids, func(a, b uuid.UUID) int { return bytes.Compare(a[:], b[:]) })
	a, b, other, gone, stuck, stopping := ids[0], ids[1], ids[2], ids[3], ids[4], ids[5]
	// beat records an instance seen seenAgo ago that last claimed claimedAgo ago ("": it has
	// stopped claiming).
	beat := func(id uuid.UUID, perspective, seenAgo, claimedAgo string) {
		gsExec(t, ctx, testDB.Pool, `INSERT INTO wh_instances
			(instance_id, host, pid, heartbeat_interval, perspectives, versions, last_seen_at, claimed_at)
			VALUES ($1, 'test', 1, interval '5 seconds', ARRAY[$2::text], ARRAY[1], now() - $3::interval,
			        now() - NULLIF($4, '')::interval)`,
			id, perspective, seenAgo, claimedAgo)
		t.Cleanup(func() {
			gsExec(t, context.Background(), testDB.Pool, `DELETE FROM wh_instances WHERE instance_id = $1`, id)
		})
	}
	beat(a, name, "0 seconds", "0 seconds")
	beat(b, name, "1 second", "3 seconds")
	beat(other, name+"_other", "0 seconds", "0 seconds") // other builds: not a peer
	beat(gone, name, "16 seconds", "16 seconds")         // three heartbeats missed: gone
	beat(stuck, name, "0 seconds", "16 seconds")         // alive, but no claim for three intervals
	beat(stopping, name, "0 seconds", "")                // stopping: claims no more

	// Which of a and b owns each stream, as the claim computes it.
	owner := map[uuid.UUID]uuid.UUID{}
	for _, s := range streams {
		owner[s] = ids[rankOf(s)]
	}
	// What a claim of limit pairs by me must return: the scan passes the streams in order
	// and stops at limit own pairs; then own pairs first, then the others in order.
	expect := func(me uuid.UUID, limit int) []worker.Pair {
		var own, others []worker.Pair
		for _, s := range streams {
			if len(own) == limit {
				break
			}
			p := worker.Pair{Stream: s, Perspective: name}
			if owner[s] == me {
				own = append(own, p)
			} else {
				others = append(others, p)
			}
		}
		return append(own, others[:min(len(others), limit-len(own))]...)
	}
	ownCount := func(pairs []worker.Pair, me uuid.UUID) int {
		n := 0
		for _, p := range pairs {
			if owner[p.Stream] == me {
				n++
			}
		}
		return n
	}
	store := worker.NewPGStore(testDB.Pool, time.Second, time.Second)
	claim := func(me uuid.UUID, limit int) []worker.Pair {
		c, err := store.Claim(ctx, worker.ClaimRequest{Instance: me, Perspectives: []string{name}, Limit: limit, MaxSteps: 1000})
		require.NoError(t, err)
		return c.Pairs
	}
	for _, limit := range []int{1, 5, 15, 30} {
		gotA, gotB := claim(a, limit), claim(b, limit)
		require.Equal(t, expect(a, limit), gotA, "a, limit %d", limit)
		require.Equal(t, expect(b, limit), gotB, "b, limit %d", limit)
		// They share only the pairs one took to fill its claim.
		for _, p := range gsIntersect(gotA, gotB) {
			require.True(t, slices.Index(gotA, p) >= ownCount(gotA, a) || slices.Index(gotB, p) >= ownCount(gotB, b),
				"limit %d: %v claimed by both as their own", limit, p)
		}
	}
	// The statement itself keeps at most limit of the others' pairs, however far it scans.
	for _, limit := range []int{1, 5} {
		rows, err := pgq.New(testDB.Pool).QueueDuePairs(ctx, db.QueueDuePairsParams{
			PerspectiveNames: []string{name}, InstanceID: a, PairLimit: int32(limit), MaxSteps: 1000,
		})
		require.NoError(t, err)
		others := 0
		for _, r := range rows {
			if r.Ok && !r.Own {
				others++
			}
		}
		passed, own := 0, 0 // the others' streams the scan passes before its limit of own
		for _, st := range streams {
			if own == limit {
				break
			}
			if owner[st] == a {
				own++
			} else {
				passed++
			}
		}
		require.Greater(t, passed, limit, "limit %d: the claim passes more of the others' pairs than it keeps", limit)
		require.Equal(t, limit, others, "limit %d: the others' pairs the claim keeps", limit)
	}
	// The next claim's start: a claim that finds its fill of its own pairs starts the next one
	// after them, past the other's streams before them, which b claims; one that does not
	// (it takes b's pairs to fill it) starts the next one at the first of b's it passed.
	next := func(me uuid.UUID, limit int) worker.QueuePosition {
		c, err := store.Claim(ctx, worker.ClaimRequest{Instance: me, Perspectives: []string{name}, Limit: limit, MaxSteps: 1000})
		require.NoError(t, err)
		return c.Next
	}
	firstA := slices.IndexFunc(streams, func(s uuid.UUID) bool { return owner[s] == a })
	require.Greater(t, firstA, 0, "b's streams come first")
	last := streams[firstA]
	require.Equal(t, worker.QueuePosition{At: gsDueTimes(t, ctx, gsPair{last, name})[0], Stream: last, Perspective: name}, next(a, 1))
	require.Equal(t, worker.QueuePosition{At: gsDueTimes(t, ctx, gsPair{streams[0], name})[0], Stream: streams[0]}, next(a, 40))
	// Each instance's own pairs come first: a claim with room for all returns every stream.
	all := claim(a, 40)
	require.Len(t, all, 40)
	// An instance without a row owns every stream: the claim's plain order.
	want := make([]worker.Pair, 10)
	for i := range want {
		want[i] = worker.Pair{Stream: streams[i], Perspective: name}
	}
	require.Equal(t, want, claim(uuid.New(), 10))
}

// gsIntersect is the pairs in both x and y.
func gsIntersect(x, y []worker.Pair) []worker.Pair {
	var out []worker.Pair
	for _, p := range x {
		if slices.Contains(y, p) {
			out = append(out, p)
		}
	}
	return out
}
