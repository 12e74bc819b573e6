package schema_test

import (
	"context"
	"fmt"
	"io/fs"
	"log"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/perspectives-go/perspectives/schema"
)

// Migrate at start-up, before any worker starts, on a direct connection: through a
// transaction pooler (PgBouncer) Migrate refuses with ErrNeedsDirectConnection. Every
// instance may migrate as it starts: when the schema is current Migrate does nothing, and
// instances that migrate at once wait for each other.
func ExampleMigrate() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, databaseURL())
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	if err := schema.Migrate(ctx, pool); err != nil {
		log.Fatal(err)
	}
	if err := schema.Migrate(ctx, pool); err != nil { // current: a no-op
		log.Fatal(err)
	}

	// golang-migrate's record of the schema, in its own table (not schema_migrations)
	var version int
	var dirty bool
	if err := pool.QueryRow(ctx, "SELECT version, dirty FROM "+schema.MigrationsTable).Scan(&version, &dirty); err != nil {
		log.Fatal(err)
	}
	ups, err := fs.Glob(schema.FS, "*.up.sql")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("at the newest migration: %v, dirty: %v\n", version == len(ups), dirty)
	var events int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM wh_event_store").Scan(&events); err != nil {
		log.Fatal(err)
	}
	fmt.Println("events stored:", events)
	// Output:
	// at the newest migration: true, dirty: false
	// events stored: 0
}
