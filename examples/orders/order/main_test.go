package order_test

import (
	"testing"

	"github.com/perspectives-go/perspectives/internal/pgtest"
)

var testDB *pgtest.DB

func TestMain(m *testing.M) { pgtest.Exit(m, "orders", &testDB) }
