// Package schema holds the perspectives database schema as golang-migrate migrations
// and applies them.
//
// # Changing the schema
//
// A released migration is never edited, neither its up nor its down file: a database
// records only the number of the last migration it applied, so an edit would never reach
// the databases that ran the old text, and they would differ from new ones for good. A
// change to the schema is a new migration with the next number.
//
// Upgrades are forward-only. Migrate applies up migrations only; the down migrations exist
// for development (stepping back while a migration is written) and are not a way to take a
// production database back to an earlier release, whose data they may drop.
//
// Each migration file runs as one transaction: it applies whole or not at all, and the
// locks its statements take are held until it ends. A new migration keeps every row it
// finds (TestUpgradeStepByStep checks each migration against rows written as the release
// before it wrote them, and needs a step for every new one) and, where it can, keeps the
// previous release's statements working, so that its workers may run while the upgrade
// runs; CHANGELOG.md says, for each migration, whether they may.
package schema

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"time"

	"github.com/golang-migrate/migrate/v4"
	migratepgx "github.com/golang-migrate/migrate/v4/database/pgx/v5"
	"github.com/golang-migrate/migrate/v4/source/iofs"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/perspectives-go/perspectives/db"
	"github.com/perspectives-go/perspectives/internal/pgq"
)

// FS holds the migrations: 000001_name.up.sql / 000001_name.down.sql.
//
//go:embed *.sql
var FS embed.FS

// MigrationsTable is the table in which golang-migrate records the applied version.
// It is not the default schema_migrations so that it never collides with an
// application's own golang-migrate history in the same database.
const MigrationsTable = "wh_schema_migrations"

// ErrNeedsDirectConnection is returned by Migrate when its pool goes through a connection
// pooler (such as PgBouncer) instead of straight to PostgreSQL.
var ErrNeedsDirectConnection = errors.New("migrations need a direct connection to PostgreSQL, not one through a connection pooler")

// Migrate applies every up migration. It is a no-op when the schema is current and is
// safe when several instances call it at once, however long a migration takes: they take
// turns on a session-level advisory lock, on a connection of their own that they close at
// the end, each waiting until its ctx ends (a Migrate that waited finds the schema current).
// Every connection it takes from the pool is returned to it.
//
// That lock needs a session of its own, which a transaction pooler does not keep: Migrate
// refuses a pool that goes through a pooler (the backend that answers is not the one the
// connection was opened with) with an error wrapping ErrNeedsDirectConnection, before it
// writes anything. Give it a pool on a direct URL; the application may then use the pooler.
func Migrate(ctx context.Context, pool *pgxpool.Pool) error {
	return MigrateFS(ctx, pool, FS, MigrationsTable)
}

// MigrateFS is Migrate for another set of golang-migrate migrations (000001_name.up.sql and
// 000001_name.down.sql at the root of fsys), whose applied version is recorded in table:
// an application's own tables beside the library's, in the same database. Give it a table
// of its own, never MigrationsTable. It takes the same lock, needs the same direct
// connection and returns the same errors as Migrate.
func MigrateFS(ctx context.Context, pool *pgxpool.Pool, fsys fs.FS, table string) (err error) {
	switch {
	case pool == nil:
		return errors.New("schema: migrate: nil pool")
	case fsys == nil:
		return errors.New("schema: migrate: nil migrations")
	case table == "":
		return errors.New("schema: migrate: empty migrations table name")
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("schema: migrate: %w", err)
	}
	if err := checkDirect(ctx, pool); err != nil {
		return fmt.Errorf("schema: migrate: %w", err)
	}
	// The callers that migrate the same history table at once take turns on a lock of
	// their own, waited for under ctx, on a session of its own that is closed at the end.
	// golang-migrate's lock, taken next, is then never contended: its wait gives up after
	// 15 s and leaves its session waiting, and a session that then got the lock would go
	// back to the pool holding it.
	release, err := migrationTurn(ctx, pool, table)
	if err != nil {
		return fmt.Errorf("schema: migrate: %w", err)
	}
	defer release()
	src, err := iofs.New(fsys, ".")
	if err != nil {
		return fmt.Errorf("schema: migrate: open migrations: %w", err)
	}
	// The driver owns sqlDB from here: closing it (m.Close) closes sqlDB, which hands its
	// connections back to the pool and leaves the pool itself open.
	sqlDB := stdlib.OpenDBFromPool(pool)
	driver, err := migratepgx.WithInstance(sqlDB, &migratepgx.Config{MigrationsTable: table})
	if err != nil {
		_ = sqlDB.Close()
		_ = src.Close()
		return fmt.Errorf("schema: migrate: connect: %w", err)
	}
	m, err := migrate.NewWithInstance("iofs", src, "pgx5", driver)
	if err != nil {
		_ = driver.Close()
		_ = src.Close()
		return fmt.Errorf("schema: migrate: %w", err)
	}
	defer func() {
		srcErr, dbErr := m.Close()
		if cerr := errors.Join(srcErr, dbErr); cerr != nil && err == nil {
			err = fmt.Errorf("schema: migrate: close: %w", cerr)
		}
	}()
	if err := m.Up(); err != nil && !errors.Is(err, migrate.ErrNoChange) {
		var dirty migrate.ErrDirty
		if errors.As(err, &dirty) {
			back := fmt.Sprintf("UPDATE %s SET version = %d, dirty = false", table, dirty.Version-1)
			if dirty.Version <= 1 {
				back = "DELETE FROM " + table
			}
			return fmt.Errorf("schema: migrate: migration %d failed earlier and was rolled back (each runs in one transaction), but %s still records it, as dirty: fix what made it fail, then set the version back to the one before it (%s) and migrate again; forcing version %d would record a migration that never ran: %w",
				dirty.Version, table, back, dirty.Version, err)
		}
		return fmt.Errorf("schema: migrate: %w", err)
	}
	return nil
}

// migrationTurnPoll is how often a Migrate waiting for another to finish tries its lock.
const migrationTurnPoll = 100 * time.Millisecond

// migrationTurn waits, until ctx ends, for this process's turn to migrate the history table
// (a session-level advisory lock keyed by the table's name, on a connection of its own, not
// the pool's), and returns what ends the turn: closing that connection, which releases the
// lock.
func migrationTurn(ctx context.Context, pool *pgxpool.Pool, table string) (func(), error) {
	conn, err := pgx.ConnectConfig(ctx, pool.Config().ConnConfig.Copy())
	if err != nil {
		return nil, fmt.Errorf("connect: %w", err)
	}
	release := func() {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = conn.Close(cctx)
	}
	for {
		mine, err := db.New(conn).MigrationTurnTry(ctx, table)
		if err != nil {
			release()
			return nil, fmt.Errorf("wait for another migration: %w", err)
		}
		if mine {
			return release, nil
		}
		select {
		case <-ctx.Done():
			release()
			return nil, fmt.Errorf("wait for another migration to finish: %w", ctx.Err())
		case <-time.After(migrationTurnPoll):
		}
	}
}

// checkDirect fails when pool's connections go through a pooler (pgq.Pooled).
func checkDirect(ctx context.Context, pool *pgxpool.Pool) error {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	pooled, told, runs, err := pgq.Pooled(ctx, conn.Conn())
	if err != nil {
		return err
	}
	if pooled {
		return fmt.Errorf("%w (the connection was told backend %d, the statement ran in backend %d): run it with a URL that reaches the server itself, e.g. perspectives migrate --database-url <direct URL>",
			ErrNeedsDirectConnection, told, runs)
	}
	return nil
}
