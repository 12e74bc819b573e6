package worker_test

// Tests of sinks against PostgreSQL: a perspective that also writes its models to a table of
// the application's, in the transaction that commits them, on every path that changes a
// model, and through versions (Promoter, Retirer).

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/internal/pgtest"
	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/worker"
)

// ledgerSink is the ledger perspective with a sink: each change is a row of sink_rows
// (build_key, stream_id), deleted when the model is. fail, when set, refuses the changes it
// names. Promotions and retirements are recorded in sink_promotions and sink_retired.
type ledgerSink struct {
	worker.Perspective
	version int

	mu     sync.Mutex
	fail   func(worker.Change) bool
	writes int // Write calls that succeeded
}

func newLedgerSink(name string, version int) *ledgerSink {
	return &ledgerSink{Perspective: ledgerPerspective(name), version: version}
}

func (p *ledgerSink) Version() int { return p.version }

func (p *ledgerSink) failing(f func(worker.Change) bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.fail = f
}

var errSinkRefused = errors.New("the sink refused the change")

func (p *ledgerSink) Write(ctx context.Context, tx pgx.Tx, changes []worker.Change) error {
	p.mu.Lock()
	fail := p.fail
	p.mu.Unlock()
	for _, c := range changes {
		if c.Build.Key != changes[0].Build.Key {
			return errors.New("changes of two builds in one Write")
		}
		if fail != nil && fail(c) {
			return errSinkRefused
		}
		var err error
		if c.Model == nil {
			_, err = tx.Exec(ctx, `DELETE FROM sink_rows WHERE build_key = $1 AND stream_id = $2`, c.Build.Key, c.StreamID)
		} else {
			_, err = tx.Exec(ctx, `INSERT INTO sink_rows (build_key, stream_id, model, last_event_id, replay) VALUES ($1, $2, $3, $4, $5)
				ON CONFLICT (build_key, stream_id) DO UPDATE SET model = EXCLUDED.model, last_event_id = EXCLUDED.last_event_id, replay = EXCLUDED.replay`,
				c.Build.Key, c.StreamID, string(c.Model), c.LastEventID, c.Replay)
		}
		if err != nil {
			return err
		}
	}
	p.mu.Lock()
	p.writes++
	p.mu.Unlock()
	return nil
}

func (p *ledgerSink) Promoted(ctx context.Context, tx pgx.Tx, from *worker.Build, to worker.Build) error {
	var fromKey *string
	if from != nil {
		fromKey = &from.Key
	}
	// The active build as the promotion transaction sees it: the new one.
	_, err := tx.Exec(ctx, `INSERT INTO sink_promotions (from_key, to_key, active_seen)
		SELECT $1, $2, (SELECT build_key FROM wh_perspective_builds WHERE perspective_name = $3 AND state = 'active')`,
		fromKey, to.Key, to.Perspective)
	return err
}

func (p *ledgerSink) Retired(ctx context.Context, db worker.DBTX, b worker.Build) error {
	if _, err := db.Exec(ctx, `DELETE FROM sink_rows WHERE build_key = $1`, b.Key); err != nil {
		return err
	}
	_, err := db.Exec(ctx, `INSERT INTO sink_retired (build_key) VALUES ($1)`, b.Key)
	return err
}

// sinkDB is a database of its own with the sink's tables.
func sinkDB(t *testing.T) *pgtest.DB {
	t.Helper()
	ctx := context.Background()
	d, err := pgtest.Create(ctx, "sink")
	require.NoError(t, err)
	t.Cleanup(d.Close)
	_, err = d.Pool.Exec(ctx, `
		CREATE TABLE sink_rows (build_key text NOT NULL, stream_id uuid NOT NULL, model jsonb NOT NULL,
			last_event_id uuid NOT NULL, replay boolean NOT NULL, PRIMARY KEY (build_key, stream_id));
		CREATE TABLE sink_promotions (from_key text, to_key text NOT NULL, active_seen text);
		CREATE TABLE sink_retired (build_key text NOT NULL)`)
	require.NoError(t, err)
	return d
}

// sinkRow is a stream's row of sink_rows, its model decoded as an M.
type sinkRow[M any] struct {
	model  M
	last   uuid.UUID
	replay bool
}

// sinkRowsOf is the build key's rows of sink_rows, by stream.
func sinkRowsOf[M any](t *testing.T, d *pgtest.DB, key string) map[uuid.UUID]sinkRow[M] {
	t.Helper()
	rows, err := d.Pool.Query(context.Background(), `SELECT stream_id, model, last_event_id, replay FROM sink_rows WHERE build_key = $1`, key)
	require.NoError(t, err)
	out := map[uuid.UUID]sinkRow[M]{}
	for rows.Next() {
		var id uuid.UUID
		var raw []byte
		var r sinkRow[M]
		require.NoError(t, rows.Scan(&id, &raw, &r.last, &r.replay))
		require.NoError(t, json.Unmarshal(raw, &r.model))
		out[id] = r
	}
	require.NoError(t, rows.Err())
	return out
}

// sinkRows is sinkRowsOf for the ledger perspective.
func sinkRows(t *testing.T, d *pgtest.DB, key string) map[uuid.UUID]sinkRow[ledger] {
	t.Helper()
	return sinkRowsOf[ledger](t, d, key)
}

// activeKey is the perspective's active build key.
func activeKey(t *testing.T, d *pgtest.DB, name string) string {
	t.Helper()
	var key string
	require.NoError(t, d.Pool.QueryRow(context.Background(),
		`SELECT build_key FROM wh_perspective_builds WHERE perspective_name = $1 AND state = 'active'`, name).Scan(&key))
	return key
}

func waitIn(t *testing.T, d *pgtest.DB, name string, stream, event uuid.UUID) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, worker.WaitFor(ctx, d.Pool, name, stream, event))
}

// requireRowsAreModels checks that the sink's rows of build key are exactly the models of
// the streams, each the fold of its sorted events.
func requireRowsAreModels(t *testing.T, d *pgtest.DB, key string, want map[uuid.UUID][]worker.Event) {
	t.Helper()
	rows := sinkRows(t, d, key)
	require.Len(t, rows, len(want), "one row per stream with a model")
	for stream, evs := range want {
		r, ok := rows[stream]
		require.True(t, ok, "stream %s has a row", stream)
		m := expectedLedger(t, evs)
		require.Equal(t, m, r.model, "stream %s: the row is the fold of its sorted events", stream)
		require.Equal(t, m.IDs[len(m.IDs)-1], r.last)
	}
}

func TestSinkFollowsTheModelOnEveryPath(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := sinkDB(t)
	name := uniqueName("sink")
	p := newLedgerSink(name, 1)
	w := startWorkerIn(t, d, worker.Config{Perspectives: []worker.Perspective{p}})

	// Live application: a row per stream, not a replay.
	a, b, c := uuid.New(), uuid.New(), uuid.New()
	want := map[uuid.UUID][]worker.Event{}
	for _, s := range []uuid.UUID{a, b, c} {
		evs := events(s, newIDs(t, 3))
		require.NoError(t, worker.Append(ctx, d.Pool, evs...))
		want[s] = evs
	}
	for s, evs := range want {
		waitIn(t, d, name, s, evs[len(evs)-1].ID)
	}
	key := activeKey(t, d, name)
	requireRowsAreModels(t, d, key, want)
	for s, r := range sinkRows(t, d, key) {
		require.False(t, r.replay, "stream %s was applied live", s)
	}

	// A late event: the rewind rewrites the row, as a replay.
	late := worker.Event{ID: uuid.Must(uuid.NewV7()), StreamID: a, Type: "amount", Data: json.RawMessage(`{"n":100}`)}
	ids := newIDs(t, 2)
	late.ID = ids[0]
	next := worker.Event{ID: ids[1], StreamID: a, Type: "amount", Data: json.RawMessage(`{"n":7}`)}
	require.NoError(t, worker.Append(ctx, d.Pool, next))
	waitIn(t, d, name, a, next.ID)
	require.NoError(t, worker.Append(ctx, d.Pool, late))
	waitIn(t, d, name, a, late.ID)
	want[a] = append(want[a], next, late)
	requireRowsAreModels(t, d, key, want)
	require.True(t, sinkRows(t, d, key)[a].replay, "the rewind's change is a replay")

	// A purge deletes the row with the model.
	require.NoError(t, w.Purge(ctx, b, name))
	delete(want, b)
	requireRowsAreModels(t, d, key, want)
	_, ok, err := worker.LoadModel(ctx, d.Pool, name, b)
	require.NoError(t, err)
	require.False(t, ok)

	// An operator's purge, rebuild or forced promotion, without the perspective's code, is
	// refused: it would leave the table behind the models. Nothing is written.
	admin, err := worker.NewAdmin(d.Pool, nil)
	require.NoError(t, err)
	err = admin.Purge(ctx, a, name)
	require.ErrorIs(t, err, locker.ErrInvalidArgument)
	require.ErrorContains(t, err, "sink")
	require.ErrorContains(t, err, "Worker.Purge")
	_, err = admin.Rebuild(ctx, a, name)
	require.ErrorIs(t, err, locker.ErrInvalidArgument)
	require.ErrorContains(t, err, "RebuildPerspective")
	requireRowsAreModels(t, d, key, want)
	_, ok, err = worker.LoadModel(ctx, d.Pool, name, a)
	require.NoError(t, err)
	require.True(t, ok)
}

func TestSinkFailureParksThePairAndCommitsTheOthers(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := sinkDB(t)
	name := uniqueName("sinkfail")
	p := newLedgerSink(name, 1)
	bad := uuid.New()
	p.failing(func(c worker.Change) bool { return c.StreamID == bad })
	startWorkerIn(t, d, worker.Config{
		Perspectives:  []worker.Perspective{p},
		RetryBackoff:  10 * time.Millisecond,
		FailurePolicy: worker.FailurePolicy{Attempts: 2},
	})

	want := map[uuid.UUID][]worker.Event{}
	var all []worker.Event
	for range 5 {
		s := uuid.New()
		evs := events(s, newIDs(t, 2))
		want[s] = evs
		all = append(all, evs...)
	}
	badEvents := events(bad, newIDs(t, 2))
	all = append(all, badEvents...)
	// One Append: the pairs are claimed together, and most likely applied in one group.
	require.NoError(t, worker.Append(ctx, d.Pool, all...))
	for s, evs := range want {
		waitIn(t, d, name, s, evs[len(evs)-1].ID)
	}
	key := activeKey(t, d, name)
	eventually(t, 30*time.Second, "the failing pair parked", func() bool {
		var status string
		err := d.Pool.QueryRow(ctx, `SELECT status FROM wh_perspective_cursors WHERE stream_id = $1 AND perspective_name = $2`, bad, key).Scan(&status)
		return err == nil && status == "parked"
	})
	requireRowsAreModels(t, d, key, want)
	_, ok, err := worker.LoadModel(ctx, d.Pool, name, bad)
	require.NoError(t, err)
	require.False(t, ok, "nothing of the failing pair is committed")
	var cause string
	require.NoError(t, d.Pool.QueryRow(ctx, `SELECT last_error FROM wh_perspective_cursors WHERE stream_id = $1 AND perspective_name = $2`, bad, key).Scan(&cause))
	require.Contains(t, cause, errSinkRefused.Error())
	require.Len(t, queuedIn(t, d, key, bad), 2, "its events stay queued")

	// Healed, an operator's retry applies it.
	p.failing(nil)
	admin, err := worker.NewAdmin(d.Pool, nil)
	require.NoError(t, err)
	_, err = admin.Retry(ctx, bad, name)
	require.NoError(t, err)
	waitIn(t, d, name, bad, badEvents[1].ID)
	want[bad] = badEvents
	requireRowsAreModels(t, d, key, want)
}

func queuedIn(t *testing.T, d *pgtest.DB, key string, stream uuid.UUID) []uuid.UUID {
	t.Helper()
	rows, err := d.Pool.Query(context.Background(), `SELECT event_id FROM wh_perspective_events WHERE stream_id = $1 AND perspective_name = $2`, stream, key)
	require.NoError(t, err)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
	require.NoError(t, err)
	return ids
}

func TestSinkThroughCatchUpVersionsAndPromotion(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := sinkDB(t)
	name := uniqueName("sinkver")

	// History stored before any worker runs the perspective: the first build catches up, and
	// a stream whose sink fails during the catch-up is handed to the normal path alone.
	want := map[uuid.UUID][]worker.Event{}
	var bad uuid.UUID
	for i := range 30 {
		s := uuid.New()
		evs := events(s, newIDs(t, 4))
		require.NoError(t, worker.Append(ctx, d.Pool, evs...))
		want[s] = evs
		if i == 10 {
			bad = s
		}
	}
	v1 := newLedgerSink(name, 1)
	v1.failing(func(c worker.Change) bool { return c.StreamID == bad && c.Replay })
	w1 := startWorkerIn(t, d, worker.Config{Perspectives: []worker.Perspective{v1}, CatchUpPageSize: 20})
	for s, evs := range want {
		waitIn(t, d, name, s, evs[len(evs)-1].ID)
	}
	k1 := activeKey(t, d, name)
	requireRowsAreModels(t, d, k1, want)
	// The page whose sink failed (20 events: at most 6 streams) went to the normal path.
	rows := sinkRows(t, d, k1)
	require.False(t, rows[bad].replay, "the stream whose catch-up sink failed was applied by the normal path")
	handed := 0
	for _, r := range rows {
		if !r.replay {
			handed++
		}
	}
	require.LessOrEqual(t, handed, 6, "only the failing page's streams were handed to the normal path")
	var promotions int
	require.NoError(t, d.Pool.QueryRow(ctx, `SELECT count(*) FROM sink_promotions WHERE from_key IS NULL AND to_key = $1 AND active_seen = $1`, k1).Scan(&promotions))
	require.Equal(t, 1, promotions, "the first build's promotion, from none, inside the promotion transaction")

	// Version 2 builds beside version 1: its rows have their own build key, v1's stay. Its
	// workers wait for an operator (ManualPromotion), whose promotion they carry out, so
	// that the sink's Promoted runs.
	v1.failing(nil)
	require.NoError(t, w1.Stop(ctx))
	v2 := newLedgerSink(name, 2)
	startWorkerIn(t, d, worker.Config{Perspectives: []worker.Perspective{v2}, CatchUpPageSize: 20, ManualPromotion: true})
	admin, err := worker.NewAdmin(d.Pool, nil)
	require.NoError(t, err)
	var requested worker.Build
	eventually(t, 60*time.Second, "version 2 caught up, its promotion requested", func() bool {
		requested, err = admin.Promote(ctx, name, 2)
		return err == nil
	})
	require.True(t, requested.PromotionRequested)
	require.Equal(t, worker.BuildBuilding, requested.State, "requested of the workers, not promoted by the Admin")
	eventually(t, 60*time.Second, "version 2 promoted by its workers", func() bool { return activeKey(t, d, name) != k1 })
	k2 := activeKey(t, d, name)
	requireRowsAreModels(t, d, k2, want)
	var seen string
	require.NoError(t, d.Pool.QueryRow(ctx, `SELECT active_seen FROM sink_promotions WHERE from_key = $1 AND to_key = $2`, k1, k2).Scan(&seen))
	require.Equal(t, k2, seen, "Promoted ran in the promotion transaction, after the flip")

	// Retired once the retired build is cleaned up: not while a cursor row of it is left,
	// held by another transaction (a rewind committing, say), whose Write would come after.
	retired := func() int {
		var n int
		require.NoError(t, d.Pool.QueryRow(ctx, `SELECT count(*) FROM sink_retired WHERE build_key = $1`, k1).Scan(&n))
		return n
	}
	holding, err := d.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = holding.Rollback(context.Background()) }()
	var held uuid.UUID
	require.NoError(t, holding.QueryRow(ctx, `SELECT stream_id FROM wh_perspective_cursors WHERE perspective_name = $1 LIMIT 1 FOR UPDATE`, k1).Scan(&held))
	_, err = d.Pool.Exec(ctx, `UPDATE wh_perspective_builds SET retired_at = now() - interval '1 hour' WHERE build_key = $1`, k1)
	require.NoError(t, err)
	eventually(t, 30*time.Second, "the retired build's rows deleted but the held one", func() bool {
		var n int
		require.NoError(t, d.Pool.QueryRow(ctx, `SELECT count(*) FROM wh_perspective_cursors WHERE perspective_name = $1`, k1).Scan(&n))
		return n == 1
	})
	time.Sleep(500 * time.Millisecond) // a few more looks at the builds
	require.Zero(t, retired(), "Retired waits for the held row")
	require.NoError(t, holding.Rollback(ctx))
	eventually(t, 30*time.Second, "the retired build cleaned", func() bool {
		var n int
		require.NoError(t, d.Pool.QueryRow(ctx, `SELECT count(*) FROM sink_retired WHERE build_key = $1`, k1).Scan(&n))
		return n == 1
	})
	require.Empty(t, sinkRows(t, d, k1), "Retired deleted the retired build's rows")
	requireRowsAreModels(t, d, k2, want)
}
