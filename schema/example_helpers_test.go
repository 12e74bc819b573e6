package schema_test

import (
	"log"

	"github.com/perspectives-go/perspectives/internal/pgtest"
)

// databaseURL is the application's database on a direct connection to PostgreSQL; in this
// example, a new, empty database.
func databaseURL() string {
	u, err := pgtest.EmptyURL("schema_example")
	if err != nil {
		log.Fatal(err)
	}
	return u
}
