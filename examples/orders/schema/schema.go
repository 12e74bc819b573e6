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
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/perspectives-go/perspectives/schema"
)

// FS holds the migrations: 000001_name.up.sql / 000001_name.down.sql.
//
//go:embed *.sql
var FS embed.FS

// MigrationsTable is the table in which golang-migrate records the applied version.
const MigrationsTable = "orders_schema_migrations"

// Migrate applies every up migration; it is a no-op when the schema is current. It uses the
// library's schema.MigrateFS, and like the library's migrations it needs a direct
// connection to PostgreSQL (golang-migrate's advisory lock is a session's), not one through
// a transaction pooler.
func Migrate(ctx context.Context, pool *pgxpool.Pool) error {
	if err := schema.MigrateFS(ctx, pool, FS, MigrationsTable); err != nil {
		return fmt.Errorf("orders schema: %w", err)
	}
	return nil
}
