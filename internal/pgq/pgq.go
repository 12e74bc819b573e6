// Package pgq opens the sqlc queries (package db) on a pool, connection or transaction so
// that they run in every pgx query exec mode — the default (prepared, cached statements) and
// also exec and simple_protocol, which a transaction pooler such as PgBouncer 1.18 needs (a
// prepared statement outlives the transaction that made it, and the pooler hands the next
// transaction another server connection).
//
// In those two modes pgx does not ask the server for the parameters' types: it encodes each
// argument from its Go type alone, as text. It knows how for every argument the queries take
// except an array of github.com/google/uuid UUIDs (a type pgx has no mapping for), so New
// passes such arrays as pgtype.UUID arrays, which encode the same in every mode. JSON arrays
// are passed as text[] and cast in SQL (see queries/), for the same reason: pgx would encode
// [][]byte as bytea.
package pgq

import (
	"context"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/perspectives-go/perspectives/db"
)

// New returns the queries on dbtx, with arguments every query exec mode can encode.
func New(dbtx db.DBTX) *db.Queries { return db.New(portable{dbtx}) }

// portable converts the arguments of each statement before dbtx runs it.
type portable struct{ dbtx db.DBTX }

func (p portable) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return p.dbtx.Exec(ctx, sql, Args(args)...)
}

func (p portable) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	return p.dbtx.Query(ctx, sql, Args(args)...)
}

func (p portable) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return p.dbtx.QueryRow(ctx, sql, Args(args)...)
}

// Args returns args with every []uuid.UUID replaced by the same UUIDs as []pgtype.UUID (a
// nil slice stays a NULL array). args itself is not changed.
func Args(args []any) []any {
	var out []any
	for i, a := range args {
		ids, ok := a.([]uuid.UUID)
		if !ok {
			continue
		}
		if out == nil {
			out = append([]any(nil), args...)
		}
		if ids == nil {
			out[i] = []pgtype.UUID(nil)
			continue
		}
		conv := make([]pgtype.UUID, len(ids))
		for j, id := range ids {
			conv[j] = pgtype.UUID{Bytes: id, Valid: true}
		}
		out[i] = conv
	}
	if out == nil {
		return args
	}
	return out
}

// Pooled reports whether conn goes through a connection pooler (PgBouncer and the like):
// PostgreSQL tells each connection its backend's process ID at start-up (BackendKeyData); a
// pooler tells its client an ID of its own, while pg_backend_pid() names the server backend
// that runs the statement. It returns both IDs.
func Pooled(ctx context.Context, conn *pgx.Conn) (pooled bool, told, runs uint32, err error) {
	pid, err := New(conn).BackendPID(ctx)
	if err != nil {
		return false, 0, 0, err
	}
	told = conn.PgConn().PID()
	return told != uint32(pid), told, uint32(pid), nil
}
