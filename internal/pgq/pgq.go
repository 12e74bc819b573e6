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
//
// Where pgx encodes an argument as text (exec, simple_protocol), the arrays of UUIDs and of
// strings write their text themselves, in one pass: pgx's own text encoding of an array
// takes every element through its generic encoder and checks it for quoting (about 0.4 µs a
// UUID; a commit of 2,500 events passes 5,000 UUIDs and 2,500 names). Where pgx encodes them
// in binary (its default mode), pgx's binary encoding does.
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

// Args returns args with every []uuid.UUID replaced by the same UUIDs as a uuidArray and
// every []string by a textArray (a nil slice stays a NULL array). args itself is not changed.
func Args(args []any) []any {
	var out []any
	for i, a := range args {
		var conv any
		switch v := a.(type) {
		case []uuid.UUID:
			conv = uuidArray(nil)
			if v != nil {
				ids := make(uuidArray, len(v))
				for j, id := range v {
					ids[j] = pgtype.UUID{Bytes: id, Valid: true}
				}
				conv = ids
			}
		case []string:
			conv = textArray(v)
		default:
			continue
		}
		if out == nil {
			out = append([]any(nil), args...)
		}
		out[i] = conv
	}
	if out == nil {
		return args
	}
	return out
}

// uuidArray is an array of UUIDs that pgx encodes in binary as any []pgtype.UUID, and in
// text through TextValue.
type uuidArray []pgtype.UUID

// TextValue is a as a PostgreSQL array literal ({…,…}); NULL when a is nil.
func (a uuidArray) TextValue() (pgtype.Text, error) {
	if a == nil {
		return pgtype.Text{}, nil
	}
	const hex = "0123456789abcdef"
	b := make([]byte, 0, 2+37*len(a))
	b = append(b, '{')
	for i, id := range a {
		if i > 0 {
			b = append(b, ',')
		}
		if !id.Valid {
			b = append(b, "NULL"...)
			continue
		}
		for j, c := range id.Bytes {
			if j == 4 || j == 6 || j == 8 || j == 10 {
				b = append(b, '-')
			}
			b = append(b, hex[c>>4], hex[c&0x0f])
		}
	}
	b = append(b, '}')
	return pgtype.Text{String: string(b), Valid: true}, nil
}

// textArray is an array of strings that pgx encodes in binary as any []string, and in text
// through TextValue.
type textArray []string

// TextValue is a as a PostgreSQL array literal, every element quoted ({"…","…"}); NULL
// when a is nil.
func (a textArray) TextValue() (pgtype.Text, error) {
	if a == nil {
		return pgtype.Text{}, nil
	}
	n := 2
	for _, s := range a {
		n += len(s) + 3
	}
	b := make([]byte, 0, n)
	b = append(b, '{')
	for i, s := range a {
		if i > 0 {
			b = append(b, ',')
		}
		b = append(b, '"')
		for j := 0; j < len(s); j++ {
			if s[j] == '"' || s[j] == '\\' {
				b = append(b, '\\')
			}
			b = append(b, s[j])
		}
		b = append(b, '"')
	}
	b = append(b, '}')
	return pgtype.Text{String: string(b), Valid: true}, nil
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
