package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
)

// target is the database a command connected to: connect records it, and run names it when
// the command's error says what to do about that database.
type target struct{ url string }

type targetKey struct{}

// withTarget returns a context in which connect records the database it connects to.
func withTarget(ctx context.Context) (context.Context, *target) {
	t := &target{}
	return context.WithValue(ctx, targetKey{}, t), t
}

// recordTarget notes dbURL as the database of the command running under ctx.
func recordTarget(ctx context.Context, dbURL string) {
	if t, ok := ctx.Value(targetKey{}).(*target); ok {
		t.url = dbURL
	}
}

// schemaCodes are the SQLSTATEs of a database without the perspectives schema, or with an
// older one: an undefined table, function or column.
var schemaCodes = []string{"42P01", "42883", "42703"}

// errorLine is the one line run prints for a command's error: a database without the
// perspectives schema, or with an older one (a table, function or column of ours missing),
// is said so, with the command that migrates it; anything else is the error itself.
func errorLine(err error, t *target) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && slices.Contains(schemaCodes, pgErr.Code) && strings.Contains(pgErr.Message, "wh_") {
		migrate := "perspectives migrate"
		if t != nil && t.url != "" {
			migrate += " --database-url " + shellQuote(redact(t.url))
		}
		return fmt.Sprintf("the perspectives schema is missing from the database, or out of date (%s); if it is the right database, run: %s",
			pgErr.Message, migrate)
	}
	return oneLine(err)
}

// shellQuote quotes s for a POSIX shell (a URL's ? and & would be taken by it).
func shellQuote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// connectError is a failed connection to the database at url (password hidden).
//
// pgx's message names the user and database, then each address tried, then the dial error,
// which names the address again: "failed to connect to `user=postgres database=postgres`:
// 127.0.0.1:1 (127.0.0.1): dial error: dial tcp 127.0.0.1:1: connect: connection refused".
// After the URL, which says all of that, only the reason is left to say.
type connectError struct {
	url string
	err error
}

func (e *connectError) Unwrap() error { return e.err }

func (e *connectError) Error() string {
	var pgErr *pgconn.PgError
	if errors.As(e.err, &pgErr) {
		// The server answered: a wrong password, a database that does not exist, ...
		return fmt.Sprintf("database %s refused the connection: %s", e.url, pgErr.Error())
	}
	return fmt.Sprintf("cannot reach database %s: %s (is PostgreSQL running there? set --database-url or DATABASE_URL)", e.url, connectReason(e.err))
}

// connectReason is why pgx could not connect, without what the URL says: the dial errors
// (with their address only when several addresses were tried), else pgx's message without
// its user and database.
func connectReason(err error) string {
	var dials []*net.OpError
	var walk func(error)
	walk = func(err error) {
		if op, ok := err.(*net.OpError); ok {
			dials = append(dials, op)
			return
		}
		switch u := err.(type) {
		case interface{ Unwrap() []error }:
			for _, e := range u.Unwrap() {
				walk(e)
			}
		case interface{ Unwrap() error }:
			if e := u.Unwrap(); e != nil {
				walk(e)
			}
		}
	}
	walk(err)
	if len(dials) == 0 {
		var ce *pgconn.ConnectError
		if errors.As(err, &ce) && ce.Unwrap() != nil {
			return oneLine(ce.Unwrap())
		}
		return oneLine(err)
	}
	reasons := make([]string, len(dials))
	for i, op := range dials {
		reasons[i] = dialReason(op)
		if len(dials) > 1 && op.Addr != nil {
			reasons[i] = op.Addr.String() + ": " + reasons[i]
		}
	}
	return strings.Join(reasons, "; ")
}

// dialReason is a dial error without its operation and address: "connection refused".
func dialReason(op *net.OpError) string {
	if op.Err == nil {
		return oneLine(op)
	}
	var sys *os.SyscallError
	if errors.As(op.Err, &sys) {
		return oneLine(sys.Err)
	}
	return oneLine(op.Err)
}
