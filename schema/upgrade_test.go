package schema_test

// Upgrades. TestUpgradeStepByStep migrates a fresh database one migration at a time and,
// after each, writes rows in the shape that release N (the code that came with migration N)
// wrote them: plain SQL doing what that release's queries did (git log -p -- queries/).
// Every migration must keep every row it finds, add only the rows its step expects, and
// leave the columns it adds NULL unless its step says it fills them; then the worker of the
// current release must carry on from all of it. A new migration needs its step in
// upgradeSteps: the test fails until it has one.

import (
	"context"
	"encoding/json"
	"fmt"
	"io/fs"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/golang-migrate/migrate/v4"
	migratepgx "github.com/golang-migrate/migrate/v4/database/pgx/v5"
	"github.com/golang-migrate/migrate/v4/source/iofs"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/internal/pgtest"
	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/schema"
	"github.com/perspectives-go/perspectives/worker"
)

// upgradeStep is one migration's part of TestUpgradeStepByStep.
type upgradeStep struct {
	// added returns the rows the migration is meant to add (its backfill), by table; a
	// column left out of a row is set by the database at migration time and must not be
	// NULL. nil: it adds none.
	added func(u *upgrade, before tableRows) map[string][]row
	// filled names the columns ("table.column") the migration adds and fills in the rows it
	// finds, which write or a later check must look at; every other column it adds to a
	// table must be NULL in the table's existing rows.
	filled []string
	// dropped names the columns ("table.column") the migration drops.
	dropped []string
	// write writes, at this version, what the release that came with the migration wrote.
	write func(u *upgrade)
}

// upgradeSteps: step i is migration i+1.
var upgradeSteps = []upgradeStep{
	{write: (*upgrade).writeRelease1},
	{added: (*upgrade).addedBuilds, write: (*upgrade).writeRelease2},
	{write: (*upgrade).writeRelease3},
	{write: (*upgrade).writeRelease4},
	{write: (*upgrade).writeRelease5},
	{write: (*upgrade).writeRelease6},
	{write: (*upgrade).writeRelease7},
	{added: (*upgrade).addedDuePairs, write: (*upgrade).writeRelease8, dropped: []string{
		"wh_perspective_events.attempts", "wh_perspective_events.last_error", "wh_perspective_events.next_attempt_at",
		"wh_perspective_cursors.next_attempt_at", "wh_instances.claimed_at"}},
	{filled: []string{"wh_perspectives.sink", "wh_instances.sink_ms", "wh_perspective_builds.promotion_requested"}, write: (*upgrade).writeRelease9},
	{write: (*upgrade).writeRelease10},
	{write: (*upgrade).writeRelease11},
	{write: (*upgrade).writeRelease12},
	{write: (*upgrade).writeRelease13},
}

func TestUpgradeStepByStep(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	ups, err := fs.Glob(schema.FS, "*.up.sql")
	require.NoError(t, err)
	require.Len(t, upgradeSteps, len(ups), "every migration needs its step in upgradeSteps (what it adds, what its release writes)")

	d, err := pgtest.CreateEmpty(ctx, "schema_upgrade")
	require.NoError(t, err)
	defer d.Close()
	direct, err := pgxpool.New(ctx, d.DirectURL) // migrations need a direct connection
	require.NoError(t, err)
	defer direct.Close()
	u := newUpgrade(t, ctx, direct)

	m, closeMigrator := newMigrator(t, direct)
	defer closeMigrator()
	for i, step := range upgradeSteps {
		version := i + 1
		before := dumpTables(t, ctx, direct)
		require.NoError(t, m.Migrate(uint(version)), "migration %d", version)
		after := dumpTables(t, ctx, direct)
		var want map[string][]row
		if step.added != nil {
			want = step.added(u, before)
		}
		requireKept(t, version, before, after, step.filled, step.dropped, want)
		step.write(u)
	}

	before := dumpTables(t, ctx, direct)
	require.NoError(t, schema.Migrate(ctx, direct), "the latest version")
	requireKept(t, len(ups), before, dumpTables(t, ctx, direct), nil, nil, nil)

	u.carryOn(d.Pool)
}

// TestDownMigrationsRunBackToZero runs every down migration, one at a time, from the latest
// version to none, on tables that hold rows (a parked pair among them): each runs, the down
// migration of 000004 maps the parked pair back to a failing one, and at version 0 no table
// or function of the schema is left, so that migrating up again works.
func TestDownMigrationsRunBackToZero(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	d, err := pgtest.CreateEmpty(ctx, "schema_down")
	require.NoError(t, err)
	defer d.Close()
	direct, err := pgxpool.New(ctx, d.DirectURL)
	require.NoError(t, err)
	defer direct.Close()
	u := newUpgrade(t, ctx, direct)

	m, closeMigrator := newMigrator(t, direct)
	defer closeMigrator()
	require.NoError(t, m.Up())
	latest, dirty, err := m.Version()
	require.NoError(t, err)
	require.False(t, dirty)

	u.exec(`INSERT INTO wh_perspectives (perspective_name) VALUES ('ledger')`)
	u.exec(`INSERT INTO wh_perspective_builds (build_key, perspective_name, version, build, state, promoted_at, catchup_done)
		VALUES ('ledger', 'ledger', 1, 1, 'active', now(), true)`)
	p := u.stream("P")
	ids := u.newIDs(3)
	u.appendEvents(p, ids)
	u.applyPair(8, p, "ledger", ids[:1], 1)
	u.park(8, p, "ledger", ids[1])

	for v := int(latest); v > 0; v-- {
		require.NoError(t, m.Steps(-1), "down migration %d", v)
		got, dirty, err := m.Version()
		if v == 1 {
			require.ErrorIs(t, err, migrate.ErrNilVersion)
		} else {
			require.NoError(t, err)
			require.Equal(t, uint(v-1), got)
			require.False(t, dirty)
		}
		if v == 8 {
			var parked int
			require.NoError(t, direct.QueryRow(ctx, `SELECT count(*) FROM wh_perspective_events
				WHERE stream_id = $1 AND next_attempt_at = '9999-12-31 00:00:00+00'`, p).Scan(&parked))
			require.Equal(t, 2, parked, "the parked pair's rows wait for an operator again at version 7")
		}
		if v == 4 {
			var status string
			require.NoError(t, direct.QueryRow(ctx, `SELECT status FROM wh_perspective_cursors
				WHERE stream_id = $1 AND perspective_name = 'ledger'`, p).Scan(&status))
			require.Equal(t, "failed", status, "a parked pair is failing at version 3")
			var waiting int
			require.NoError(t, direct.QueryRow(ctx, `SELECT count(*) FROM wh_perspective_events
				WHERE next_attempt_at > now() + interval '1 day'`).Scan(&waiting))
			require.Zero(t, waiting, "no queued row waits for an operator at version 3")
		}
	}

	var left []string
	rows, err := direct.Query(ctx, `SELECT relname FROM pg_class
		WHERE relnamespace = current_schema()::regnamespace AND relname LIKE 'wh\_%' AND relname NOT LIKE $1 || '%'
		UNION ALL
		SELECT proname FROM pg_proc WHERE pronamespace = current_schema()::regnamespace AND proname LIKE 'wh\_%'
		ORDER BY 1`, schema.MigrationsTable)
	require.NoError(t, err)
	for rows.Next() {
		var name string
		require.NoError(t, rows.Scan(&name))
		left = append(left, name)
	}
	require.NoError(t, rows.Err())
	require.Empty(t, left, "objects of the schema left at version 0")

	require.NoError(t, m.Up(), "up again after down to 0")
	again, _, err := m.Version()
	require.NoError(t, err)
	require.Equal(t, latest, again)
}

// newMigrator is a golang-migrate instance on the migrations, built as schema.Migrate
// builds it, and the function that closes it (before pool is closed: it holds a connection).
func newMigrator(t *testing.T, pool *pgxpool.Pool) (*migrate.Migrate, func()) {
	t.Helper()
	src, err := iofs.New(schema.FS, ".")
	require.NoError(t, err)
	driver, err := migratepgx.WithInstance(stdlib.OpenDBFromPool(pool), &migratepgx.Config{MigrationsTable: schema.MigrationsTable})
	require.NoError(t, err)
	m, err := migrate.NewWithInstance("iofs", src, "pgx5", driver)
	require.NoError(t, err)
	return m, func() {
		srcErr, dbErr := m.Close()
		require.NoError(t, srcErr)
		require.NoError(t, dbErr)
	}
}

// row is a table row as JSON (to_jsonb), numbers as json.Number.
type row = map[string]any

// tableRows is every row of every table of the schema but the migrations table: table →
// primary key (as JSON) → row.
type tableRows map[string]map[string]row

func dumpTables(t *testing.T, ctx context.Context, pool *pgxpool.Pool) tableRows {
	t.Helper()
	var tables []string
	rows, err := pool.Query(ctx, `SELECT table_name FROM information_schema.tables
		WHERE table_schema = current_schema() AND table_name LIKE 'wh\_%' AND table_name <> $1
		ORDER BY 1`, schema.MigrationsTable)
	require.NoError(t, err)
	for rows.Next() {
		var name string
		require.NoError(t, rows.Scan(&name))
		tables = append(tables, name)
	}
	require.NoError(t, rows.Err())
	out := tableRows{}
	for _, table := range tables {
		var pk []string
		require.NoError(t, pool.QueryRow(ctx, `SELECT COALESCE(array_agg(a.attname::text ORDER BY k.ord), '{}')
			FROM pg_index i
			CROSS JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)
			JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
			WHERE i.indrelid = $1::regclass AND i.indisprimary`, table).Scan(&pk))
		require.NotEmpty(t, pk, "table %s has no primary key", table)
		rows, err := pool.Query(ctx, fmt.Sprintf(`SELECT to_jsonb(t)::text FROM %s t`, table))
		require.NoError(t, err)
		out[table] = map[string]row{}
		for rows.Next() {
			var text string
			require.NoError(t, rows.Scan(&text))
			r := decodeRow(t, text)
			key := make([]any, len(pk))
			for i, col := range pk {
				key[i] = r[col]
			}
			k, err := json.Marshal(key)
			require.NoError(t, err)
			out[table][string(k)] = r
		}
		require.NoError(t, rows.Err())
	}
	return out
}

func decodeRow(t *testing.T, text string) row {
	t.Helper()
	dec := json.NewDecoder(strings.NewReader(text))
	dec.UseNumber()
	var r row
	require.NoError(t, dec.Decode(&r))
	return r
}

// normalized is r as dumpTables would return it.
func normalized(t *testing.T, r row) row {
	t.Helper()
	text, err := json.Marshal(r)
	require.NoError(t, err)
	return decodeRow(t, string(text))
}

// requireKept fails unless migration version kept every row of before in after, with the
// values of the columns before had; left the columns it added NULL in them (but filled);
// and added exactly the rows of want (matched on want's columns; the others not NULL).
func requireKept(t *testing.T, version int, before, after tableRows, filled, dropped []string, want map[string][]row) {
	t.Helper()
	for table, rows := range before {
		got, ok := after[table]
		require.True(t, ok, "migration %d dropped table %s", version, table)
		for key, old := range rows {
			now, ok := got[key]
			require.True(t, ok, "migration %d lost the row %s of %s", version, key, table)
			for col, v := range old {
				if slices.Contains(dropped, table+"."+col) {
					require.NotContains(t, now, col, "migration %d keeps %s.%s", version, table, col)
					continue
				}
				require.Equal(t, v, now[col], "migration %d changed %s.%s of the row %s", version, table, col, key)
			}
			for col, v := range now {
				if _, had := old[col]; !had && !slices.Contains(filled, table+"."+col) {
					require.Nil(t, v, "migration %d added %s.%s with a value in the row %s that was there before", version, table, col, key)
				}
			}
		}
	}
	added := map[string][]row{}
	for table, rows := range after {
		for key, r := range rows {
			if _, had := before[table][key]; !had {
				added[table] = append(added[table], r)
			}
		}
	}
	for table := range want {
		require.Contains(t, added, table, "migration %d added no row to %s", version, table)
	}
	for table, rows := range added {
		expected := slices.Clone(want[table])
		require.Len(t, rows, len(expected), "migration %d added rows to %s: %v", version, table, rows)
		for _, r := range rows {
			i := slices.IndexFunc(expected, func(w row) bool {
				w = normalized(t, w)
				for col, v := range w {
					if fmt.Sprint(r[col]) != fmt.Sprint(v) || (r[col] == nil) != (v == nil) {
						return false
					}
				}
				return true
			})
			require.GreaterOrEqual(t, i, 0, "migration %d added to %s the row %v, not one of %v", version, table, r, expected)
			for col, v := range r {
				if _, set := expected[i][col]; !set {
					require.NotNil(t, v, "migration %d left %s.%s NULL in the row %v", version, table, col, r)
				}
			}
			expected = slices.Delete(expected, i, i+1)
		}
	}
}

// upgrade is the database TestUpgradeStepByStep writes, and what it wrote there.
type upgrade struct {
	t       *testing.T
	ctx     context.Context
	db      *pgxpool.Pool             // a direct pool
	streams map[string]uuid.UUID      // by the names the steps give them
	events  map[uuid.UUID][]uuid.UUID // every event stored in each stream
	skipped map[pair][]uuid.UUID      // events a pair skipped: never in its model
	late    uuid.UUID                 // sorts between stream A's snapshot and its cursor
	gone    uuid.UUID                 // an instance of an earlier release, gone (killed)
}

func newUpgrade(t *testing.T, ctx context.Context, direct *pgxpool.Pool) *upgrade {
	return &upgrade{t: t, ctx: ctx, db: direct, streams: map[string]uuid.UUID{},
		events: map[uuid.UUID][]uuid.UUID{}, skipped: map[pair][]uuid.UUID{}, gone: uuid.Must(uuid.NewV7())}
}

// pair is a stream and a build key.
type pair struct {
	stream uuid.UUID
	build  string
}

// ledgerModel is the model of the test's perspectives: the IDs of the events applied.
type ledgerModel struct {
	IDs []uuid.UUID `json:"ids"`
}

func ledgerApply(m ledgerModel, ev worker.Event) (ledgerModel, error) {
	m.IDs = append(m.IDs, ev.ID)
	return m, nil
}

// versioned is a Perspective of a given version.
type versioned struct {
	worker.Perspective
	version int
}

func (v versioned) Version() int { return v.version }

func (u *upgrade) exec(sql string, args ...any) int64 {
	u.t.Helper()
	tag, err := u.db.Exec(u.ctx, sql, args...)
	require.NoError(u.t, err, "%s", sql)
	return tag.RowsAffected()
}

// stream is a new stream named name.
func (u *upgrade) stream(name string) uuid.UUID {
	u.t.Helper()
	require.NotContains(u.t, u.streams, name)
	u.streams[name] = uuid.New()
	return u.streams[name]
}

// newIDs are n new event IDs, in increasing order.
func (u *upgrade) newIDs(n int) []uuid.UUID {
	ids := make([]uuid.UUID, n)
	for i := range ids {
		ids[i] = uuid.Must(uuid.NewV7())
	}
	return ids
}

func texts(ids []uuid.UUID) []string {
	out := make([]string, len(ids))
	for i, id := range ids {
		out[i] = id.String()
	}
	return out
}

func modelOf(t *testing.T, ids []uuid.UUID) string {
	t.Helper()
	b, err := json.Marshal(ledgerModel{IDs: ids})
	require.NoError(t, err)
	return string(b)
}

// storeEvents stores events of a stream as releases 1 and 2 appended them: one statement
// storing the events, making sure each pair has a cursor row and queueing a row per event
// and pair, for every registered perspective (release 1: wh_perspectives) or every build
// being built or active (release 2).
func (u *upgrade) storeEvents(release int, stream uuid.UUID, ids []uuid.UUID) {
	u.t.Helper()
	targets := `SELECT perspective_name AS key FROM wh_perspectives`
	if release >= 2 {
		targets = `SELECT build_key AS key FROM wh_perspective_builds WHERE state IN ('building', 'active')`
	}
	u.exec(`WITH ev AS (
		INSERT INTO wh_event_store (event_id, stream_id, event_type, data)
		SELECT e.id, $1, 'added', jsonb_build_object('n', e.n)
		FROM unnest($2::text[]::uuid[]) WITH ORDINALITY AS e (id, n)
		RETURNING event_id, stream_id
	), targets AS (`+targets+`
	), cursors AS (
		INSERT INTO wh_perspective_cursors (stream_id, perspective_name)
		SELECT DISTINCT ev.stream_id, p.key FROM ev CROSS JOIN targets p
		ORDER BY 1, 2
		ON CONFLICT (stream_id, perspective_name) DO NOTHING
	)
	INSERT INTO wh_perspective_events (stream_id, perspective_name, event_id)
	SELECT ev.stream_id, p.key, ev.event_id FROM ev CROSS JOIN targets p`, stream, texts(ids))
	u.events[stream] = append(u.events[stream], ids...)
}

// appendEvents appends events to a stream as releases 3 on do: through wh_append (the
// version of the schema at hand).
func (u *upgrade) appendEvents(stream uuid.UUID, ids []uuid.UUID) {
	u.t.Helper()
	datas := make([]string, len(ids))
	for i := range ids {
		datas[i] = fmt.Sprintf(`{"n": %d}`, i+1)
	}
	var queued int64
	require.NoError(u.t, u.db.QueryRow(u.ctx, `SELECT wh_append($1::text[]::uuid[], array_fill($2::uuid, ARRAY[$3::int]),
		array_fill('added'::text, ARRAY[$3::int]), $4::text[], array_fill(NULL::timestamptz, ARRAY[$3::int]))`,
		texts(ids), stream, len(ids), datas).Scan(&queued))
	require.Positive(u.t, queued)
	u.events[stream] = append(u.events[stream], ids...)
}

// applyPair writes what an apply commit of release wrote when a pair had applied the events
// applied, in order: its model and cursor at the last of them (the cursor's version bumped,
// its failure state cleared), their queue rows deleted (release 5 on: by wh_delete_applied).
func (u *upgrade) applyPair(release int, stream uuid.UUID, build string, applied []uuid.UUID, sinceSnapshot int) {
	u.t.Helper()
	last := applied[len(applied)-1]
	u.exec(`INSERT INTO wh_perspective_models (stream_id, perspective_name, model, last_event_id)
		VALUES ($1, $2, $3::jsonb, $4)
		ON CONFLICT (stream_id, perspective_name) DO UPDATE
		SET model = EXCLUDED.model, last_event_id = EXCLUDED.last_event_id, updated_at = now()`,
		stream, build, modelOf(u.t, applied), last)
	failure := ""
	if release >= 4 {
		failure = ", failed_event_id = NULL, failed_since = NULL"
	}
	if release < 8 {
		failure += ", next_attempt_at = NULL"
	}
	n := u.exec(`UPDATE wh_perspective_cursors
		SET last_event_id = $3, version = version + 1, events_since_snapshot = $4, status = 'ok',
		    last_error = NULL, attempts = 0, updated_at = now()`+failure+`
		WHERE stream_id = $1 AND perspective_name = $2`, stream, build, last, sinceSnapshot)
	require.EqualValues(u.t, 1, n, "the cursor of %s/%s", stream, build)
	if release >= 5 {
		u.exec(`SELECT wh_delete_applied(array_fill($1::uuid, ARRAY[$3::int]), array_fill($2::text, ARRAY[$3::int]),
			$4::text[]::uuid[])`, stream, build, len(applied), texts(applied))
		return
	}
	u.exec(`DELETE FROM wh_perspective_events WHERE stream_id = $1 AND perspective_name = $2
		AND event_id = ANY($3::text[]::uuid[])`, stream, build, texts(applied))
}

// park writes what release 4 on wrote when a pair's failure policy parked it on the event
// failing after eight failures: the cursor parked; before release 8 the rows waiting at
// 9999-12-31, from release 8 on its due row waiting ('infinity').
func (u *upgrade) park(release int, stream uuid.UUID, build string, failing uuid.UUID) {
	u.t.Helper()
	if release >= 8 {
		u.exec(`UPDATE wh_perspective_cursors
			SET status = 'parked', last_error = 'poison', failed_event_id = $3,
			    failed_since = now() - interval '1 hour', attempts = 8, updated_at = now()
			WHERE stream_id = $1 AND perspective_name = $2`, stream, build, failing)
		u.exec(`UPDATE wh_perspective_pairs SET due_at = 'infinity', leased_by = NULL
			WHERE stream_id = $1 AND perspective_name = $2`, stream, build)
		return
	}
	u.exec(`UPDATE wh_perspective_cursors
		SET status = 'parked', last_error = 'poison', failed_event_id = $3,
		    failed_since = now() - interval '1 hour', attempts = 8, next_attempt_at = NULL, updated_at = now()
		WHERE stream_id = $1 AND perspective_name = $2`, stream, build, failing)
	u.exec(`UPDATE wh_perspective_events
		SET attempts = attempts + 8, last_error = 'poison', next_attempt_at = '9999-12-31 00:00:00+00'
		WHERE stream_id = $1 AND perspective_name = $2`, stream, build)
}

// writeRelease1: the perspectives ledger and tally are registered (their names key their
// pairs). Stream A: ledger applied three of its five events, with a snapshot after the
// second, and an expired rewind lock of the gone instance is on its cursor; tally applied
// all five. Stream B: ledger applied its first event and failed on the second three times
// (the backoff has run out); tally applied none.
func (u *upgrade) writeRelease1() {
	u.exec(`INSERT INTO wh_perspectives (perspective_name) VALUES ('ledger'), ('tally')`)

	a := u.stream("A")
	ids := u.newIDs(6)
	u.late = ids[2]
	stored := []uuid.UUID{ids[0], ids[1], ids[3], ids[4], ids[5]}
	u.storeEvents(1, a, stored)
	u.applyPair(1, a, "ledger", stored[:3], 1)
	u.exec(`INSERT INTO wh_perspective_snapshots (stream_id, perspective_name, snapshot_event_id, model)
		VALUES ($1, 'ledger', $2, $3::jsonb)`, a, stored[1], modelOf(u.t, stored[:2]))
	u.exec(`UPDATE wh_perspective_cursors
		SET stream_lock_instance_id = $2, stream_lock_expiry = now() - interval '1 minute', stream_lock_reason = 'rewind'
		WHERE stream_id = $1 AND perspective_name = 'ledger'`, a, u.gone)
	u.applyPair(1, a, "tally", stored, 5)

	b := u.stream("B")
	ids = u.newIDs(3)
	u.storeEvents(1, b, ids)
	u.applyPair(1, b, "ledger", ids[:1], 1)
	// PairsMarkFailed of release 1: the failure and the retry time on the cursor and on
	// every queued row of the pair.
	u.exec(`UPDATE wh_perspective_cursors
		SET status = 'failed', last_error = 'boom', attempts = 3, next_attempt_at = now() - interval '1 second', updated_at = now()
		WHERE stream_id = $1 AND perspective_name = 'ledger'`, b)
	u.exec(`UPDATE wh_perspective_events
		SET attempts = 3, last_error = 'boom', next_attempt_at = now() - interval '1 second'
		WHERE stream_id = $1 AND perspective_name = 'ledger'`, b)
}

// addedBuilds: migration 2 makes each registered perspective the first build of its
// version 1 (keyed by its name), active and caught up since its registration, and sets the
// registration epoch at 0.
func (u *upgrade) addedBuilds(before tableRows) map[string][]row {
	var builds []row
	for _, p := range before["wh_perspectives"] {
		builds = append(builds, row{
			"build_key": p["perspective_name"], "perspective_name": p["perspective_name"],
			"version": 1, "build": 1, "state": "active",
			"promoted_at": p["registered_at"], "retired_at": nil, "cleaned_at": nil,
			"catchup_stream_id": nil, "catchup_event_id": nil, "catchup_done": true,
			"catchup_events": 0, "catchup_streams": 0, "catchup_started_at": nil,
			"catchup_done_at": p["registered_at"], "catchup_holder": nil, "catchup_expiry": nil,
		})
	}
	require.Len(u.t, builds, 2)
	return map[string][]row{
		"wh_perspective_builds": builds,
		"wh_registration":       {{"id": 1, "epoch": 0}},
	}
}

// writeRelease2: the gone instance registered version 2 of tally beside version 1 (the
// build tally@v2.1, building); its catch-up passed the first stream in (stream_id,
// event_id) order and stopped there (its lease ran out). Stream C was appended after it:
// queued for ledger, tally and tally@v2.1; ledger applied two of its three events.
func (u *upgrade) writeRelease2() {
	u.exec(`INSERT INTO wh_perspective_builds (build_key, perspective_name, version, build, state)
		VALUES ('tally@v2.1', 'tally', 2, 1, 'building')`)
	u.exec(`UPDATE wh_registration SET epoch = epoch + 1 WHERE id = 1`)
	first := u.streams["A"]
	if u.streams["B"].String() < first.String() {
		first = u.streams["B"]
	}
	evs := u.events[first]
	u.exec(`INSERT INTO wh_perspective_cursors (stream_id, perspective_name) VALUES ($1, 'tally@v2.1')`, first)
	u.applyPair(2, first, "tally@v2.1", evs, len(evs))
	u.exec(`UPDATE wh_perspective_builds
		SET catchup_stream_id = $1, catchup_event_id = $2, catchup_events = $3,
		    catchup_started_at = now() - interval '1 hour', catchup_holder = $4,
		    catchup_expiry = now() - interval '59 minutes'
		WHERE build_key = 'tally@v2.1'`, first, evs[len(evs)-1], len(evs), u.gone)

	c := u.stream("C")
	ids := u.newIDs(3)
	u.storeEvents(2, c, ids)
	u.applyPair(2, c, "ledger", ids[:2], 2)
}

// writeRelease3: Appends through wh_append: stream D, whose three events ledger applied,
// and one more event of stream A, queued behind its earlier rows.
func (u *upgrade) writeRelease3() {
	d := u.stream("D")
	ids := u.newIDs(3)
	u.appendEvents(d, ids)
	u.applyPair(3, d, "ledger", ids, 3)
	u.appendEvents(u.streams["A"], u.newIDs(1))
}

// writeRelease4: stream P: ledger applied its first event and parked on the second after
// eight failures. Stream S: ledger's failure policy skipped its second event after eight
// failures, and ledger applied the other two. The gone instance's heartbeat row.
func (u *upgrade) writeRelease4() {
	p := u.stream("P")
	ids := u.newIDs(3)
	u.appendEvents(p, ids)
	u.applyPair(4, p, "ledger", ids[:1], 1)
	u.park(4, p, "ledger", ids[1])

	s := u.stream("S")
	ids = u.newIDs(3)
	u.appendEvents(s, ids)
	u.applyPair(4, s, "ledger", ids[:1], 1)
	u.exec(`INSERT INTO wh_skipped_events (stream_id, perspective_name, event_id, skipped_by, reason, attempts, last_error)
		VALUES ($1, 'ledger', $2, $3, 'policy', 8, 'poison')`, s, ids[1], u.gone.String())
	u.exec(`DELETE FROM wh_perspective_events WHERE stream_id = $1 AND perspective_name = 'ledger' AND event_id = $2`, s, ids[1])
	u.applyPair(4, s, "ledger", []uuid.UUID{ids[0], ids[2]}, 2)
	u.skipped[pair{s, "ledger"}] = []uuid.UUID{ids[1]}

	u.exec(`INSERT INTO wh_instances (instance_id, host, pid, started_at, last_seen_at, heartbeat_interval, perspectives, versions, rates)
		VALUES ($1, 'old-host', 101, now() - interval '2 hours', now() - interval '1 hour', interval '10 seconds',
		        '{ledger,tally}', '{1,2}', '{1.5,0}')`, u.gone)
}

// writeRelease5: stream E: ledger applied two of its three events (their rows deleted by
// wh_delete_applied). The heartbeat row of another gone instance, with when it last claimed.
func (u *upgrade) writeRelease5() {
	e := u.stream("E")
	ids := u.newIDs(3)
	u.appendEvents(e, ids)
	u.applyPair(5, e, "ledger", ids[:2], 2)
	u.exec(`INSERT INTO wh_instances (instance_id, host, pid, started_at, last_seen_at, heartbeat_interval, perspectives, versions, rates, claimed_at)
		VALUES ($1, 'old-host', 102, now() - interval '2 hours', now() - interval '1 hour', interval '10 seconds',
		        '{ledger,tally}', '{1,2}', '{2.5,0.5}', now() - interval '1 hour')`, uuid.Must(uuid.NewV7()))
}

// writeRelease6: stream F: ledger applied one of its two events.
func (u *upgrade) writeRelease6() {
	f := u.stream("F")
	ids := u.newIDs(2)
	u.appendEvents(f, ids)
	u.applyPair(6, f, "ledger", ids[:1], 1)
}

// writeRelease7: stream G: ledger applied one of its two events. The leader leases of a
// release-7 instance that was killed: expired, so the worker that carries on takes them over
// (and promotes tally's version 2 under one of them).
func (u *upgrade) writeRelease7() {
	g := u.stream("G")
	ids := u.newIDs(2)
	u.appendEvents(g, ids)
	u.applyPair(7, g, "ledger", ids[:1], 1)
	u.exec(`INSERT INTO wh_leader (name, leader_id, elected_at, expires_at)
		SELECT n, $1, now() - interval '1 hour', now() - interval '50 minutes'
		FROM unnest('{instances,cleanup:ledger,cleanup:tally,promotion:ledger@v1,promotion:tally@v2}'::text[]) AS n`,
		uuid.Must(uuid.NewV7()))
}

// addedDuePairs: migration 8 gives every pair with queued rows its due row, not leased
// (writeRelease8 checks the due times of the failing and the parked pair).
func (u *upgrade) addedDuePairs(before tableRows) map[string][]row {
	seen := map[string]bool{}
	var pairs []row
	for _, q := range before["wh_perspective_events"] {
		k := fmt.Sprint(q["stream_id"], "/", q["perspective_name"])
		if seen[k] {
			continue
		}
		seen[k] = true
		pairs = append(pairs, row{"stream_id": q["stream_id"], "perspective_name": q["perspective_name"], "leased_by": nil})
	}
	require.NotEmpty(u.t, pairs)
	return map[string][]row{"wh_perspective_pairs": pairs}
}

// writeRelease8: the parked pair's due row waits for an operator and the failing one's is due
// (its backoff ran out). Stream H is appended (its due row made by wh_append), claimed by the
// gone instance (leased), its first event applied and the lease released (wh_pairs_release):
// due again at its second event.
func (u *upgrade) writeRelease8() {
	var parked, failing string
	require.NoError(u.t, u.db.QueryRow(u.ctx, `SELECT
		(SELECT due_at::text FROM wh_perspective_pairs WHERE stream_id = $1 AND perspective_name = 'ledger'),
		(SELECT (due_at <= now())::text FROM wh_perspective_pairs WHERE stream_id = $2 AND perspective_name = 'ledger')`,
		u.streams["P"], u.streams["B"]).Scan(&parked, &failing))
	require.Equal(u.t, []string{"infinity", "true"}, []string{parked, failing})

	h := u.stream("H")
	ids := u.newIDs(2)
	u.appendEvents(h, ids)
	require.EqualValues(u.t, 1, u.exec(`UPDATE wh_perspective_pairs SET leased_by = $2, due_at = now() + interval '30 seconds'
		WHERE stream_id = $1 AND perspective_name = 'ledger'`, h, u.gone))
	u.applyPair(8, h, "ledger", ids[:1], 1)
	u.exec(`SELECT wh_pairs_release($1, ARRAY[$2::uuid], ARRAY['ledger'], ARRAY[-1::float8])`, u.gone, h)
	var leased bool
	require.NoError(u.t, u.db.QueryRow(u.ctx, `SELECT leased_by IS NOT NULL FROM wh_perspective_pairs
		WHERE stream_id = $1 AND perspective_name = 'ledger' AND due_at <= now()`, h).Scan(&leased))
	require.False(u.t, leased)
}

// writeRelease9: the perspectives registered before it write to no sink; a registration
// with one records it (a perspective of its own, which carryOn's workers do not run).
func (u *upgrade) writeRelease9() {
	var sinks int
	require.NoError(u.t, u.db.QueryRow(u.ctx, `SELECT count(*) FROM wh_perspectives WHERE sink`).Scan(&sinks))
	require.Zero(u.t, sinks)
	u.exec(`INSERT INTO wh_perspectives (perspective_name, sink) VALUES ('orders', true)`)
}

// writeRelease10: the release writes what release 9 did; its migration makes every function
// of the schema PL/pgSQL running its generic plan (the claim and the deletion of applied
// rows were SQL functions, with the same signatures).
func (u *upgrade) writeRelease10() {
	var fns []string
	require.NoError(u.t, u.db.QueryRow(u.ctx, `SELECT array_agg(p.proname || ' ' || l.lanname || ' ' ||
			('plan_cache_mode=force_generic_plan' = ANY(p.proconfig))::text ORDER BY p.proname)
		FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang
		WHERE p.proname LIKE 'wh\_%'`).Scan(&fns))
	require.Equal(u.t, []string{"wh_append plpgsql true", "wh_claim_pairs plpgsql true", "wh_delete_applied plpgsql true",
		"wh_pairs_release plpgsql true"}, fns)
}

// writeRelease11: the release writes what release 10 did; its migration gives wh_append (same
// signature) and wh_claim_pairs the settings under which they look up the cursor and due rows
// by key.
func (u *upgrade) writeRelease11() {
	require.ElementsMatch(u.t, []string{"plan_cache_mode=force_generic_plan", "enable_hashjoin=off", "enable_mergejoin=off",
		"enable_seqscan=off", "jit=off"}, u.settings("wh_append"))
	require.ElementsMatch(u.t, []string{"plan_cache_mode=force_generic_plan", "enable_sort=off", "enable_bitmapscan=off",
		"enable_hashjoin=off", "enable_mergejoin=off", "enable_seqscan=off", "jit=off"}, u.settings("wh_claim_pairs"))
}

// writeRelease12: the release writes what release 11 did; its migration gives wh_pairs_release
// (same signature) the settings under which it looks up the due rows and the queue by key.
func (u *upgrade) writeRelease12() {
	require.ElementsMatch(u.t, []string{"plan_cache_mode=force_generic_plan", "enable_hashjoin=off", "enable_mergejoin=off",
		"enable_seqscan=off", "jit=off"}, u.settings("wh_pairs_release"))
}

// writeRelease13: the release writes what release 12 did; its migration adds the functions
// the apply transaction's statements run (the lock of the cursor rows, the snapshots' read,
// the commit and the creation of missing cursor rows), each with the settings under which it
// looks up the cursor and snapshot rows by key.
func (u *upgrade) writeRelease13() {
	for _, fn := range []string{"wh_lock_cursors", "wh_apply_commit", "wh_ensure_cursors"} {
		require.ElementsMatch(u.t, []string{"plan_cache_mode=force_generic_plan", "enable_hashjoin=off", "enable_mergejoin=off",
			"enable_seqscan=off", "jit=off"}, u.settings(fn), fn)
	}
	require.ElementsMatch(u.t, []string{"plan_cache_mode=force_generic_plan", "enable_seqscan=off", "jit=off"},
		u.settings("wh_snapshot_ids"))
}

// settings is the function name's settings ("name=value").
func (u *upgrade) settings(name string) []string {
	var s []string
	require.NoError(u.t, u.db.QueryRow(u.ctx, `SELECT p.proconfig FROM pg_proc p WHERE p.proname = $1`, name).Scan(&s))
	return s
}

// carryOn starts a worker of the current release on the upgraded database (pool: the tests'
// pool) with ledger and version 2 of tally, appends a new event to every stream (and stream
// A's late event), and checks that every model of the active builds is the fold of its
// stream's events in event-ID order, without the events its build skipped.
func (u *upgrade) carryOn(pool *pgxpool.Pool) {
	t, ctx := u.t, u.ctx
	lk, err := locker.NewPostgres(pool, locker.Options{})
	require.NoError(t, err)
	admin, err := worker.NewAdmin(pool, lk)
	require.NoError(t, err)

	// The failing and parked pairs, the skipped event: as the releases left them.
	failed, err := admin.Failed(ctx, "ledger", 10)
	require.NoError(t, err)
	require.Len(t, failed, 2)
	require.Equal(t, []any{u.streams["P"], true, u.events[u.streams["P"]][1], 8, "poison"},
		[]any{failed[0].Stream, failed[0].Parked, failed[0].Event, failed[0].Attempts, failed[0].LastError})
	require.Equal(t, []any{u.streams["B"], false, uuid.Nil, 3, "boom"},
		[]any{failed[1].Stream, failed[1].Parked, failed[1].Event, failed[1].Attempts, failed[1].LastError})
	skipped, err := admin.Skipped(ctx, "ledger", 10)
	require.NoError(t, err)
	require.Len(t, skipped, 1)
	require.Equal(t, []any{u.streams["S"], u.skipped[pair{u.streams["S"], "ledger"}], true, 8},
		[]any{skipped[0].Stream, []uuid.UUID{skipped[0].Event}, skipped[0].ByPolicy, skipped[0].Attempts})

	ledger := worker.JSONPerspective("ledger", ledgerApply)
	tally := versioned{worker.JSONPerspective("tally", ledgerApply), 2}
	w, err := worker.New(pool, worker.Config{
		Perspectives: []worker.Perspective{ledger, tally},
		Locker:       lk,
		PollInterval: 50 * time.Millisecond,
		Logger:       slog.New(slog.DiscardHandler),
	})
	require.NoError(t, err)
	require.NoError(t, w.Start(ctx))
	defer func() { require.NoError(t, w.Stop(context.Background())) }()

	names := slices.Sorted(maps.Keys(u.streams))
	last := map[uuid.UUID]uuid.UUID{}
	for _, name := range names {
		stream := u.streams[name]
		id := uuid.Must(uuid.NewV7())
		require.NoError(t, worker.Append(ctx, pool, worker.Event{ID: id, StreamID: stream, Type: "added", Data: json.RawMessage(`{"n": 0}`)}))
		u.events[stream] = append(u.events[stream], id)
		last[stream] = id
	}
	a := u.streams["A"]
	require.NoError(t, worker.Append(ctx, pool, worker.Event{ID: u.late, StreamID: a, Type: "added", Data: json.RawMessage(`{"n": 0}`)}))
	u.events[a] = append(u.events[a], u.late)

	// The parked pair stays parked, its new event too, until an operator retries it.
	p := u.streams["P"]
	short, cancel := context.WithTimeout(ctx, 2*time.Second)
	err = worker.WaitFor(short, pool, "ledger", p, last[p])
	cancel()
	require.ErrorIs(t, err, worker.ErrParked)
	n, err := admin.Retry(ctx, p, "ledger")
	require.NoError(t, err)
	require.Equal(t, 1, n)

	for _, name := range names {
		stream := u.streams[name]
		for _, persp := range []struct{ name, build string }{{"ledger", "ledger"}, {"tally", "tally@v2.1"}} {
			wait, cancel := context.WithTimeout(ctx, 30*time.Second)
			err := worker.WaitFor(wait, pool, persp.name, stream, last[stream])
			if err == nil && stream == a {
				err = worker.WaitFor(wait, pool, persp.name, stream, u.late)
			}
			cancel()
			require.NoError(t, err, "%s of stream %s", persp.name, name)

			want := slices.Clone(u.events[stream])
			slices.SortFunc(want, func(x, y uuid.UUID) int { return strings.Compare(x.String(), y.String()) })
			want = slices.DeleteFunc(want, func(id uuid.UUID) bool {
				return slices.Contains(u.skipped[pair{stream, persp.build}], id)
			})
			raw, ok, err := worker.LoadModel(ctx, pool, persp.name, stream)
			require.NoError(t, err)
			require.True(t, ok, "%s of stream %s has a model", persp.name, name)
			var got ledgerModel
			require.NoError(t, json.Unmarshal(raw, &got))
			require.Equal(t, want, got.IDs, "%s of stream %s is the fold of its events in event-ID order", persp.name, name)
		}
	}

	var states []string
	rows, err := pool.Query(ctx, `SELECT build_key || ' ' || state FROM wh_perspective_builds ORDER BY build_key`)
	require.NoError(t, err)
	for rows.Next() {
		var s string
		require.NoError(t, rows.Scan(&s))
		states = append(states, s)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, []string{"ledger active", "tally retired", "tally@v2.1 active"}, states)
	var leases []string
	rows, err = pool.Query(ctx, `SELECT name FROM wh_leader WHERE leader_id = $1 AND expires_at > now() ORDER BY name`, w.InstanceID())
	require.NoError(t, err)
	for rows.Next() {
		var s string
		require.NoError(t, rows.Scan(&s))
		leases = append(leases, s)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, []string{"cleanup:ledger", "cleanup:tally", "instances", "promotion:ledger@v1", "promotion:tally@v2"}, leases,
		"the expired leases of the killed instance are taken over")
	var queued int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM wh_perspective_events
		WHERE perspective_name IN ('ledger', 'tally@v2.1')`).Scan(&queued))
	require.Zero(t, queued, "nothing left queued for the active builds")
}
