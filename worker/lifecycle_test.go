package worker_test

// The perspective lifecycle against PostgreSQL: registration, catch-up, versions.

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/worker"
)

// An Append in a REPEATABLE READ or SERIALIZABLE transaction whose snapshot was taken
// before a perspective registered, committed after the registration, must not be lost for
// that perspective: either it is queued for it, or the transaction fails with a
// serialization error (the caller retries, as it must at these levels), and the retry is.
func TestAppendInSnapshotTransactionTakenBeforeRegistrationIsNotLost(t *testing.T) {
	t.Parallel()
	for _, iso := range []pgx.TxIsoLevel{pgx.RepeatableRead, pgx.Serializable} {
		t.Run(string(iso), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			stream := uuid.New()
			evs := events(stream, newIDs(t, 2))

			tx, err := testDB.Pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: iso})
			require.NoError(t, err)
			defer func() { _ = tx.Rollback(context.Background()) }()
			var n int
			require.NoError(t, tx.QueryRow(ctx, `SELECT count(*) FROM wh_perspectives`).Scan(&n)) // the snapshot

			name := uniqueName("snapiso")
			startWorker(t, worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(name)}})

			err = worker.Append(ctx, tx, evs...)
			if err == nil {
				err = tx.Commit(ctx)
			}
			retried := false
			if err != nil {
				var pgErr *pgconn.PgError
				require.True(t, errors.As(err, &pgErr), "%v", err)
				require.Equal(t, "40001", pgErr.Code, "a serialization failure, which the caller retries: %v", err)
				_ = tx.Rollback(ctx)
				require.NoError(t, pgx.BeginTxFunc(ctx, testDB.Pool, pgx.TxOptions{IsoLevel: iso}, func(tx pgx.Tx) error {
					return worker.Append(ctx, tx, evs...)
				}))
				retried = true
			}
			require.Equal(t, expectedLedger(t, evs), waitModelWithin(t, ctx, name, stream, 2, 10*time.Second),
				"the events reach the perspective registered after the snapshot (retried: %v)", retried)
		})
	}
}

// waitModelWithin is waitModel with a timeout of the caller's.
func waitModelWithin(t testing.TB, ctx context.Context, name string, stream uuid.UUID, n int, timeout time.Duration) ledger {
	t.Helper()
	var m ledger
	eventually(t, timeout, "model with all events", func() bool {
		m, _ = loadLedger(t, ctx, name, stream)
		return len(m.IDs) == n
	})
	return m
}
