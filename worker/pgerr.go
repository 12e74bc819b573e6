package worker

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"syscall"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

func isUniqueViolation(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "23505"
}

// isLockTimeout reports whether err is a lock wait that outlasted lock_timeout (SQLSTATE
// 55P03, lock_not_available).
func isLockTimeout(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "55P03"
}

// isConnectionError reports whether err says that the database could not be reached or
// went away (a restart, a failover, a network fault), rather than anything about the pair:
// its work is then left queued for the next claim, not backed off. An error of the
// perspective's Apply never is one, nor is a context's end.
func isConnectionError(err error) bool {
	var perr perspectiveError
	if err == nil || errors.As(err, &perr) || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	var connectErr *pgconn.ConnectError
	if errors.As(err, &connectErr) { // could not connect (whatever the server said)
		return true
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch {
		case len(pgErr.Code) == 5 && pgErr.Code[:2] == "08": // connection exception
			return true
		case pgErr.Code == "57P01", pgErr.Code == "57P02", pgErr.Code == "57P03": // admin or crash shutdown, cannot connect now
			return true
		case pgErr.Code == "25006": // read_only_sql_transaction: a standby until it is promoted
			return true
		}
		return false
	}
	var opErr *net.OpError
	return errors.As(err, &opErr) || errors.Is(err, pgconn.ErrConnClosed) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}

// cutOff reports whether err, a statement's under ctx, may have been cut off after it
// reached the server, by a lost connection or ctx's end: it may have committed.
func cutOff(ctx context.Context, err error) bool {
	return (isConnectionError(err) || ctx.Err() != nil) && !neverSent(err)
}

// neverSent reports whether err came before its statement reached a server: no connection
// could be made, or pgx knows that nothing was sent. Such a statement cannot have committed.
func neverSent(err error) bool {
	var connectErr *pgconn.ConnectError
	return errors.As(err, &connectErr) || pgconn.SafeToRetry(err)
}

// errCursorGone is a cursor row that CursorsEnsure found and a later lock of it did not: a
// transaction deleted it meanwhile (the cleanup of a retired build, or by hand).
var errCursorGone = errors.New("the pair's cursor row was deleted by another transaction meanwhile")

// cursorGone is err, or errCursorGone (wrapping it) when err says that the lock of a cursor
// row that CursorsEnsure made sure of found no row.
func cursorGone(err error) error {
	if errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("%w: %w", errCursorGone, err)
	}
	return err
}
