// Package schema holds the application's own tables (order_rows, the view orders,
// order_notifications) as golang-migrate migrations, and applies them. sqlc reads the same
// folder (it skips the down files).
//
// The perspectives tables come from the library's schema.Migrate; this history is kept in
// a table of its own (MigrationsTable), so that the two never collide.
package schema

import (
	"context"
	"embed"
	"errors"
	"fmt"

	"github.com/golang-migrate/migrate/v4"
	migratepgx "github.com/golang-migrate/migrate/v4/database/pgx/v5"
	"github.com/golang-migrate/migrate/v4/source/iofs"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
)

// FS holds the migrations: 000001_name.up.sql / 000001_name.down.sql.
//
//go:embed *.sql
var FS embed.FS

// MigrationsTable is the table in which golang-migrate records the applied version.
const MigrationsTable = "orders_schema_migrations"

// Migrate applies every up migration; it is a no-op when the schema is current. Like the
// library's, it needs a direct connection to PostgreSQL (golang-migrate's advisory lock is
// a session's), not one through a transaction pooler.
func Migrate(ctx context.Context, pool *pgxpool.Pool) (err error) {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("orders schema: migrate: %w", err)
	}
	src, err := iofs.New(FS, ".")
	if err != nil {
		return fmt.Errorf("orders schema: migrate: open migrations: %w", err)
	}
	// The driver owns sqlDB: closing it hands its connections back and leaves the pool open.
	sqlDB := stdlib.OpenDBFromPool(pool)
	driver, err := migratepgx.WithInstance(sqlDB, &migratepgx.Config{MigrationsTable: MigrationsTable})
	if err != nil {
		_ = sqlDB.Close()
		_ = src.Close()
		return fmt.Errorf("orders schema: migrate: connect: %w", err)
	}
	m, err := migrate.NewWithInstance("iofs", src, "pgx5", driver)
	if err != nil {
		_ = driver.Close()
		_ = src.Close()
		return fmt.Errorf("orders schema: migrate: %w", err)
	}
	defer func() {
		srcErr, dbErr := m.Close()
		if cerr := errors.Join(srcErr, dbErr); cerr != nil && err == nil {
			err = fmt.Errorf("orders schema: migrate: close: %w", cerr)
		}
	}()
	if err := m.Up(); err != nil && !errors.Is(err, migrate.ErrNoChange) {
		return fmt.Errorf("orders schema: migrate: %w", err)
	}
	return nil
}
