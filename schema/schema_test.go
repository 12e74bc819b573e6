package schema_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

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
	require.Equal(t, int64(1), version)
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
	require.Equal(t, 7, n, "six perspectives tables plus the migrations table")
	// Every connection went back to the pool: nothing is acquired now.
	require.Equal(t, int32(0), d.Pool.Stat().AcquiredConns())
}

func TestMigrateRefusesNilPool(t *testing.T) {
	err := schema.Migrate(context.Background(), nil)
	require.ErrorContains(t, err, "nil pool")
}

func TestMigrateHonoursCancelledContext(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	require.ErrorIs(t, schema.Migrate(ctx, testDB.Pool), context.Canceled)
}
