package main

import (
	"bytes"
	"context"
	"log/slog"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/internal/pgtest"
)

var testDB *pgtest.DB

func TestMain(m *testing.M) { pgtest.Exit(m, "orders_main", &testDB) }

// The program migrates, starts, appends, waits and prints the open orders over $50 from
// the view: alice's with her added item, dave's; not bob's (too small), not carol's
// (shipped).
func TestRun(t *testing.T) {
	var out bytes.Buffer
	err := run(context.Background(), DatabaseURL(testDB.DirectURL), slog.New(slog.DiscardHandler), &out)
	require.NoError(t, err)
	require.Equal(t, "open orders over $50:\n  alice  $145.00\n  dave   $80.00\n", out.String())
}
