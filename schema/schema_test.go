package schema_test

import (
	"context"
	"fmt"
	"io/fs"
	"sync"
	"testing"
	"testing/fstest"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/db"
	"github.com/perspectives-go/perspectives/internal/pgtest"
	"github.com/perspectives-go/perspectives/schema"
)

var testDB *pgtest.DB

func TestMain(m *testing.M) { pgtest.Exit(m, "schema", &testDB) }

func TestMigrateIsNoOpWhenCurrent(t *testing.T) {
	ctx := context.Background()
	require.NoError(t, schema.Migrate(ctx, testDB.Pool))
	var version int64
	var dirty bool
	require.NoError(t, testDB.Pool.QueryRow(ctx, "SELECT version, dirty FROM "+schema.MigrationsTable).Scan(&version, &dirty))
	ups, err := fs.Glob(schema.FS, "*.up.sql")
	require.NoError(t, err)
	require.NotEmpty(t, ups)
	require.Equal(t, int64(len(ups)), version, "at the last of the migrations %v", ups)
	require.False(t, dirty)
}

func TestMigrateConcurrentlyOnFreshDatabase(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	d, err := pgtest.CreateEmpty(ctx, "schema_conc")
	require.NoError(t, err)
	defer d.Close()

	var wg sync.WaitGroup
	errs := make([]error, 6)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = schema.Migrate(ctx, d.Pool)
		}()
	}
	wg.Wait()
	for _, err := range errs {
		require.NoError(t, err)
	}
	var n int
	require.NoError(t, d.Pool.QueryRow(ctx, "SELECT count(*) FROM information_schema.tables WHERE table_name LIKE 'wh_%'").Scan(&n))
	require.Equal(t, 13, n, "twelve perspectives tables plus the migrations table")
	// Every connection went back to the pool: nothing is acquired now.
	require.Equal(t, int32(0), d.Pool.Stat().AcquiredConns())
}

func TestMigrateRefusesNilPool(t *testing.T) {
	err := schema.Migrate(context.Background(), nil)
	require.ErrorContains(t, err, "nil pool")
}

// MigrateFS refuses, before it connects, migrations it cannot apply or record.
func TestMigrateFSRefusesBadInput(t *testing.T) {
	ctx := context.Background()
	err := schema.MigrateFS(ctx, nil, schema.FS, "app_migrations")
	require.ErrorContains(t, err, "nil pool")
	err = schema.MigrateFS(ctx, testDB.Pool, nil, "app_migrations")
	require.ErrorContains(t, err, "nil migrations")
	err = schema.MigrateFS(ctx, testDB.Pool, schema.FS, "")
	require.ErrorContains(t, err, "empty migrations table name")
}

func TestMigrateHonoursCancelledContext(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	require.ErrorIs(t, schema.Migrate(ctx, testDB.Pool), context.Canceled)
}

// A database migrated before builds existed keeps its perspectives' rows: each becomes the
// first build of version 1, active and caught up, keyed by the perspective's name, so its
// models are still read and its events still queued.
func TestMigrateFromVersion1KeepsEachPerspectiveAsItsFirstBuild(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	d, err := pgtest.CreateEmpty(ctx, "schema_v1")
	require.NoError(t, err)
	defer d.Close()

	m, closeMigrator := newMigrator(t, d.Pool)
	require.NoError(t, m.Steps(1), "the schema as it was before builds")
	closeMigrator()

	stream, event := uuid.New(), uuid.Must(uuid.NewV7())
	for _, sql := range []string{
		`INSERT INTO wh_perspectives (perspective_name) VALUES ('orders'), ('visits')`,
		`INSERT INTO wh_perspective_models (stream_id, perspective_name, model, last_event_id) VALUES ($1, 'orders', '{"n":1}', $2)`,
	} {
		args := []any{}
		if len(sql) > 80 {
			args = []any{stream, event}
		}
		_, err := d.Pool.Exec(ctx, sql, args...)
		require.NoError(t, err)
	}
	require.NoError(t, schema.Migrate(ctx, d.Pool))

	rows, err := d.Pool.Query(ctx, `SELECT build_key, perspective_name, version, build, state, catchup_done
		FROM wh_perspective_builds ORDER BY build_key`)
	require.NoError(t, err)
	type build struct {
		Key, Name      string
		Version, Build int
		State          string
		Done           bool
	}
	var got []build
	for rows.Next() {
		var b build
		require.NoError(t, rows.Scan(&b.Key, &b.Name, &b.Version, &b.Build, &b.State, &b.Done))
		got = append(got, b)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, []build{
		{"orders", "orders", 1, 1, "active", true},
		{"visits", "visits", 1, 1, "active", true},
	}, got)
	var model string
	require.NoError(t, d.Pool.QueryRow(ctx, `SELECT m.model::text FROM wh_perspective_models m
		JOIN wh_perspective_builds b ON b.build_key = m.perspective_name AND b.state = 'active'
		WHERE b.perspective_name = 'orders' AND m.stream_id = $1`, stream).Scan(&model))
	require.JSONEq(t, `{"n":1}`, model, "the active build's model is the one stored before")
}

// Through a transaction pooler Migrate refuses, in every query exec mode, and writes
// nothing (golang-migrate's session-level advisory lock would leak there; concurrent runs
// hung or failed).
func TestMigrateRefusesAConnectionPooler(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	d, err := pgtest.CreateEmpty(ctx, "schema_pooler")
	require.NoError(t, err)
	defer d.Close()
	pooler := pgtest.StartPooler(t, d.Name)
	for _, mode := range []string{"exec", "simple_protocol", ""} {
		t.Run("mode="+mode, func(t *testing.T) {
			pool, err := pgxpool.New(ctx, pgtest.WithExecMode(pooler, mode))
			require.NoError(t, err)
			defer pool.Close()
			err = schema.Migrate(ctx, pool)
			require.ErrorIs(t, err, schema.ErrNeedsDirectConnection)
			require.ErrorContains(t, err, "direct URL")
		})
	}
	var n int
	require.NoError(t, d.Pool.QueryRow(ctx, "SELECT count(*) FROM information_schema.tables WHERE table_name LIKE 'wh_%'").Scan(&n))
	require.Zero(t, n, "nothing was written")
	// The same database migrates on a direct pool.
	direct, err := pgxpool.New(ctx, d.DirectURL)
	require.NoError(t, err)
	defer direct.Close()
	require.NoError(t, schema.Migrate(ctx, direct))
}

// Several instances migrating at once take turns however long a migration runs (longer
// than golang-migrate's own 15 s lock wait here): each returns nil, the migration ran once,
// and no connection of the pools is left holding a lock.
func TestMigrateConcurrentlyWithASlowMigration(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	d, err := pgtest.CreateEmpty(ctx, "schema_slow")
	require.NoError(t, err)
	defer d.Close()
	slow := fstest.MapFS{
		"000001_slow.up.sql":   {Data: []byte("SELECT pg_sleep(16); CREATE TABLE app_slow (id int); INSERT INTO app_slow VALUES (1);")},
		"000001_slow.down.sql": {Data: []byte("DROP TABLE app_slow;")},
	}
	pools := make([]*pgxpool.Pool, 3)
	for i := range pools {
		pools[i], err = pgxpool.New(ctx, d.URL)
		require.NoError(t, err)
		defer pools[i].Close()
	}
	var wg sync.WaitGroup
	errs := make([]error, len(pools))
	for i, p := range pools {
		wg.Go(func() { errs[i] = schema.MigrateFS(ctx, p, slow, "app_slow_migrations") })
	}
	wg.Wait()
	for _, err := range errs {
		require.NoError(t, err)
	}
	var rows int
	require.NoError(t, d.Pool.QueryRow(ctx, "SELECT count(*) FROM app_slow").Scan(&rows))
	require.Equal(t, 1, rows, "the migration ran once")
	var held int
	require.NoError(t, d.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks l JOIN pg_database db ON db.oid = l.database
		WHERE l.locktype = 'advisory' AND db.datname = current_database()`).Scan(&held))
	require.Zero(t, held, "no session holds a migration lock")
}

// A Migrate waiting for another instance's migration gives up when its ctx ends.
func TestMigrateWaitingForAnotherEndsWithItsContext(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d, err := pgtest.CreateEmpty(ctx, "schema_wait")
	require.NoError(t, err)
	defer d.Close()
	// Another instance's turn: the lock Migrate takes for the history table.
	other, err := pgx.Connect(ctx, d.URL)
	require.NoError(t, err)
	defer other.Close(ctx)
	mine, err := db.New(other).MigrationTurnTry(ctx, schema.MigrationsTable)
	require.NoError(t, err)
	require.True(t, mine)

	wctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	start := time.Now()
	err = schema.Migrate(wctx, d.Pool)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.ErrorContains(t, err, "wait for another migration")
	require.Less(t, time.Since(start), 3*time.Second)
	require.Equal(t, int32(0), d.Pool.Stat().AcquiredConns())
}

// A database left dirty by a failed (rolled back) migration is refused with what to do: set
// the version back to the one before, not force the dirty one.
func TestMigrateSaysHowToRecoverFromADirtyVersion(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d, err := pgtest.CreateEmpty(ctx, "schema_dirty")
	require.NoError(t, err)
	defer d.Close()
	require.NoError(t, schema.Migrate(ctx, d.Pool))
	_, err = d.Pool.Exec(ctx, "UPDATE "+schema.MigrationsTable+" SET dirty = true")
	require.NoError(t, err)
	var version int
	require.NoError(t, d.Pool.QueryRow(ctx, "SELECT version FROM "+schema.MigrationsTable).Scan(&version))
	err = schema.Migrate(ctx, d.Pool)
	require.Error(t, err)
	require.ErrorContains(t, err, fmt.Sprintf("migration %d failed earlier and was rolled back", version))
	require.ErrorContains(t, err, fmt.Sprintf("UPDATE %s SET version = %d, dirty = false", schema.MigrationsTable, version-1))
}
