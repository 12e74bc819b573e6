package locker_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/internal/pgtest"
	"github.com/perspectives-go/perspectives/locker"
)

var testDB *pgtest.DB

func TestMain(m *testing.M) { pgtest.Exit(m, "locker", &testDB) }

// newLocker returns a Postgres locker on the package's database.
func newLocker(t testing.TB, opts locker.Options) *locker.Postgres {
	t.Helper()
	l, err := locker.NewPostgres(testDB.Pool, opts)
	require.NoError(t, err)
	return l
}

// testCtx is a context bounded so that a hung statement fails the test instead of the run.
func testCtx(t testing.TB) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// cursorLock is the lock columns of one cursor row, read with hand-written SQL.
type cursorLock struct {
	Exists   bool
	Instance *uuid.UUID
	Expiry   *time.Time
	Reason   *string
}

// readLock reads the lock columns of the (stream, perspective) cursor row.
func readLock(t testing.TB, streamID uuid.UUID, perspective string) cursorLock {
	t.Helper()
	var c cursorLock
	err := testDB.Pool.QueryRow(context.Background(),
		`SELECT stream_lock_instance_id, stream_lock_expiry, stream_lock_reason::text
		   FROM wh_perspective_cursors WHERE stream_id = $1 AND perspective_name = $2`,
		streamID, perspective).Scan(&c.Instance, &c.Expiry, &c.Reason)
	if errors.Is(err, pgx.ErrNoRows) {
		return cursorLock{}
	}
	require.NoError(t, err)
	c.Exists = true
	return c
}

// requireHeldBy asserts the cursor row shows instance holding the lock for reason, with an
// expiry in the future on the database clock.
func requireHeldBy(t testing.TB, streamID uuid.UUID, perspective string, instance uuid.UUID, reason locker.Reason) cursorLock {
	t.Helper()
	c := readLock(t, streamID, perspective)
	require.True(t, c.Exists, "cursor row must exist")
	require.NotNil(t, c.Instance, "stream_lock_instance_id must be set")
	require.Equal(t, instance, *c.Instance)
	require.NotNil(t, c.Reason, "stream_lock_reason must be set")
	require.Equal(t, string(reason), *c.Reason)
	require.NotNil(t, c.Expiry, "stream_lock_expiry must be set")
	require.Greater(t, secondsLeft(t, streamID, perspective), 0.0, "expiry must be in the future")
	return c
}

// requireUnlocked asserts the cursor row (if any) carries no lock at all.
func requireUnlocked(t testing.TB, streamID uuid.UUID, perspective string) {
	t.Helper()
	c := readLock(t, streamID, perspective)
	require.Nil(t, c.Instance, "stream_lock_instance_id must be NULL")
	require.Nil(t, c.Expiry, "stream_lock_expiry must be NULL")
	require.Nil(t, c.Reason, "stream_lock_reason must be NULL")
}

// setExpiry sets the stored expiry to now() + offset, simulating the passage of time (or
// another writer). offset is a PostgreSQL interval literal such as '-1 second'.
func setExpiry(t testing.TB, streamID uuid.UUID, perspective, offset string) {
	t.Helper()
	tag, err := testDB.Pool.Exec(context.Background(),
		`UPDATE wh_perspective_cursors SET stream_lock_expiry = now() + $3::interval
		  WHERE stream_id = $1 AND perspective_name = $2 AND stream_lock_instance_id IS NOT NULL`,
		streamID, perspective, offset)
	require.NoError(t, err)
	require.Equal(t, int64(1), tag.RowsAffected(), "setExpiry needs a locked row")
}

// secondsLeft is stream_lock_expiry - now() in seconds, on the database clock.
func secondsLeft(t testing.TB, streamID uuid.UUID, perspective string) float64 {
	t.Helper()
	var s *float64
	require.NoError(t, testDB.Pool.QueryRow(context.Background(),
		`SELECT extract(epoch FROM stream_lock_expiry - now())::float8
		   FROM wh_perspective_cursors WHERE stream_id = $1 AND perspective_name = $2`,
		streamID, perspective).Scan(&s))
	require.NotNil(t, s, "stream_lock_expiry is NULL")
	return *s
}

// requireSecondsLeft asserts the stored expiry is want from the database's now(), within 1s.
func requireSecondsLeft(t testing.TB, streamID uuid.UUID, perspective string, want time.Duration) {
	t.Helper()
	left := secondsLeft(t, streamID, perspective)
	require.InDelta(t, want.Seconds(), left, 1.0, "stored expiry - now() must be the lock timeout")
}

// rowCount is the number of cursor rows of streamID.
func rowCount(t testing.TB, streamID uuid.UUID) int {
	t.Helper()
	var n int
	require.NoError(t, testDB.Pool.QueryRow(context.Background(),
		`SELECT count(*) FROM wh_perspective_cursors WHERE stream_id = $1`, streamID).Scan(&n))
	return n
}

// insertCursor creates an unlocked cursor row, as the worker would before any lock.
func insertCursor(t testing.TB, streamID uuid.UUID, perspective string) {
	t.Helper()
	_, err := testDB.Pool.Exec(context.Background(),
		`INSERT INTO wh_perspective_cursors (stream_id, perspective_name) VALUES ($1, $2)`,
		streamID, perspective)
	require.NoError(t, err)
}

// uniquePerspective returns a perspective name no other test uses.
func uniquePerspective(prefix string) string { return prefix + "-" + uuid.NewString() }
