package worker_test

// Tests of the group path's and the claim's SQL (queries/apply.sql, queries/models.sql,
// queries/claim.sql), run through the sqlc-generated code against the package's real
// PostgreSQL database: which rows each statement reads, locks, writes and deletes, and that
// the statements that must not wait for another transaction do not.
//
// The tests run in parallel with the rest of the package on one database. Each works on
// fresh streams and on perspectives registered for it alone; the claim tests, which scan a
// perspective's whole queue, also unregister theirs once set up (gsSeal), so that other
// tests' appends queue nothing more for them.

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
	for _, table := range []string{"wh_perspective_events", "wh_perspective_pairs"} {
		gsExec(t, ctx, testDB.Pool,
			`DELETE FROM `+table+` WHERE perspective_name = ANY($1) AND stream_id <> ALL($2)`, names, streams)
	}
}

// gsExec runs sql on q and returns the rows it affected.
func gsExec(t testing.TB, ctx context.Context, q db.DBTX, sql string, args ...any) int64 {
	t.Helper()
	tag, err := q.Exec(ctx, sql, pgq.Args(args)...) // any query exec mode (the pooler suite)
	require.NoError(t, err, sql)
	return tag.RowsAffected()
}

// gsAppend stores n events of stream in one Append (one transaction) and returns their IDs.
func gsAppend(t testing.TB, ctx context.Context, stream uuid.UUID, n int) []uuid.UUID {
	t.Helper()
	ids := newIDs(t, n)
	require.NoError(t, worker.Append(ctx, testDB.Pool, events(stream, ids)...))
	return ids
}

// gsListener is a session of its own (LISTEN needs one) on the database at url listening on
// the queue's channel, closed when the test ends.
func gsListener(t *testing.T, ctx context.Context, url string) *pgx.Conn {
	t.Helper()
	listener, err := pgx.Connect(ctx, url)
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
	NextAttemptAt       *time.Time // when a failing pair is retried: its due row's due time (nil: not failing)
}

func gsReadCursor(t testing.TB, ctx context.Context, p gsPair) gsCursor {
	t.Helper()
	var c gsCursor
	require.NoError(t, testDB.Pool.QueryRow(ctx, `
		SELECT c.last_event_id, c.version, c.events_since_snapshot, c.status, c.attempts, c.last_error,
		       (SELECT d.due_at FROM wh_perspective_pairs d
		        WHERE d.stream_id = c.stream_id AND d.perspective_name = c.perspective_name AND c.status = 'failed')
		FROM wh_perspective_cursors c WHERE c.stream_id = $1 AND c.perspective_name = $2`, p.Stream, p.Name).
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

// CursorsEnsure creates and returns exactly the pairs without a cursor row, and nothing the
// second time; it does not wait for a row another open transaction updated (an upsert does:
// the control), and leaves an existing row alone.
func TestGroupSQLCursorsEnsureCreatesOnlyMissingAndNeverWaits(t *testing.T) {
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
	_, err := control.Exec(ctx, `INSERT INTO wh_perspective_cursors (stream_id, perspective_name) VALUES ($1, $2)
		ON CONFLICT (stream_id, perspective_name) DO NOTHING`, updated.Stream, updated.Name)
	var pgErr *pgconn.PgError
	require.True(t, errors.As(err, &pgErr), "an upsert of the updated row should wait and time out, got %v", err)
	require.Equal(t, "57014", pgErr.Code, "query_canceled (statement_timeout): %v", err)
	require.NoError(t, control.Rollback(ctx))

	tx := gsBeginNoWait(t, ctx)
	q := pgq.New(tx)
	want := []gsPair{deleted, never, otherName}
	s, n := gsArrays(updated, existing, deleted, never, otherName)
	created, err := q.CursorsEnsure(ctx, db.CursorsEnsureParams{StreamIds: s, PerspectiveNames: n})
	require.NoError(t, err, "CursorsEnsure must not wait for the updated row")
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
	require.NoError(t, holder.Commit(ctx))
	require.Equal(t, gsCursor{Attempts: 1, Status: "ok"}, gsReadCursor(t, ctx, updated), "the updated row is the holder's")
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
		r := row
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

	// With a bound, a pair's events above it: long's after its second event; short's bound
	// is its last event (none above it); the nil UUID and a missing bound read from the
	// lowest.
	bounded := func(after []uuid.UUID, streams ...uuid.UUID) map[uuid.UUID][]uuid.UUID {
		names := make([]string, len(streams))
		for i := range names {
			names[i] = name
		}
		rows, err := pgq.New(testDB.Pool).QueueEventsForPairs(ctx, db.QueueEventsForPairsParams{
			StreamIds: streams, PerspectiveNames: names, AfterEventIds: after, PerPairLimit: 2,
		})
		require.NoError(t, err)
		got := map[uuid.UUID][]uuid.UUID{}
		for _, r := range rows {
			got[r.StreamID] = append(got[r.StreamID], r.EventID)
		}
		for s := range got {
			slices.SortFunc(got[s], func(a, b uuid.UUID) int { return bytes.Compare(a[:], b[:]) })
		}
		return got
	}
	require.Equal(t, map[uuid.UUID][]uuid.UUID{long: sortedIDs(longEvs[2:4])},
		bounded([]uuid.UUID{longEvs[1].ID, shortEvs[1].ID}, long, short))
	require.Equal(t, map[uuid.UUID][]uuid.UUID{long: sortedIDs(longEvs[:2]), short: sortedIDs(shortEvs)},
		bounded([]uuid.UUID{uuid.Nil}, long, short))
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
		    attempts = 3
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

// PairsMarkFailed records each pair's error on its cursor and schedules the retry on its due
// row at base doubled per earlier attempt, capped at max, ending its lease; the pairs not
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
		require.Equal(t, uuid.Nil, gsDue(t, ctx, p).LeasedBy, "%v: its lease ends", p)
	}
	for _, p := range []gsPair{bystander, {first.Stream, sibling}} {
		c := gsReadCursor(t, ctx, p)
		require.Equal(t, "ok", c.Status, "%v", p)
		require.Zero(t, c.Attempts, "%v", p)
		d := gsDue(t, ctx, p)
		require.True(t, d.Exists && !d.DueAt.After(before), "%v: still due at its append, %+v", p, d)
	}
}

// PairsMarkFailed's backoff runs from the time of its statement, not of its transaction's
// start: in an apply transaction it runs after the perspective's Apply, maybe long after, and
// a backoff shorter than that Apply would otherwise be over before it was recorded.
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
		due := gsDue(t, ctx, p)
		require.True(t, due.Exists, "%v", p)
		require.True(t, due.DueAt.Sub(began) >= 250*time.Millisecond,
			"%v: due %s after its transaction began, want the statement's time", p, due.DueAt.Sub(began))
	}
}

// PairsMarkFailed's other actions: park makes the pair's due row wait ('infinity'); skip
// records the event in wh_skipped_events, unqueues it, makes the pair due now, clears its
// failure and bumps its version. A failure of
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
	require.Nil(t, c.NextAttemptAt, "a parked pair has no retry time")
	require.True(t, gsDue(t, ctx, parked).Parked, "its due row waits for an operator")

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
	require.False(t, gsDue(t, ctx, skipped).DueAt.After(now), "the rest is due now")
	var after int64
	require.NoError(t, testDB.Pool.QueryRow(ctx, `SELECT version FROM wh_perspective_cursors
		WHERE stream_id = $1 AND perspective_name = $2`, skipped.Stream, name).Scan(&after))
	require.Equal(t, version+1, after, "a rewind in flight that replayed the event is refused")

	c = gsReadCursor(t, ctx, moved)
	require.Equal(t, "failed", c.Status)
	require.EqualValues(t, 1, c.Attempts, "another event's failure starts a new count")
}

// gsDueRow is a pair's due row.
type gsDueRow struct {
	Exists   bool
	DueAt    time.Time // zero when parked
	Parked   bool      // due 'infinity'
	LeasedBy uuid.UUID
}

// gsDue reads the pair's due row.
func gsDue(t testing.TB, ctx context.Context, p gsPair) gsDueRow {
	t.Helper()
	var d gsDueRow
	var due *time.Time
	var by uuid.NullUUID
	err := testDB.Pool.QueryRow(ctx, `SELECT CASE WHEN due_at < 'infinity' THEN due_at END, due_at = 'infinity', leased_by
		FROM wh_perspective_pairs WHERE stream_id = $1 AND perspective_name = $2`, p.Stream, p.Name).Scan(&due, &d.Parked, &by)
	if errors.Is(err, pgx.ErrNoRows) {
		return d
	}
	require.NoError(t, err)
	d.Exists, d.LeasedBy = true, by.UUID
	if due != nil {
		d.DueAt = *due
	}
	return d
}
