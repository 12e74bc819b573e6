package worker_test

import (
	"os"
	"testing"

	"github.com/perspectives-go/perspectives/internal/pgtest"
)

var testDB *pgtest.DB

func TestMain(m *testing.M) {
	// The reliability tests re-execute this test binary as a worker process that they can
	// SIGKILL (reliability_kill_test.go). That child runs one worker on the parent's
	// database and never reaches pgtest: no database of its own, no test run, no goleak.
	if role := os.Getenv(reliabilityHelperEnv); role != "" {
		os.Exit(runReliabilityHelper(role))
	}
	if dbURL := os.Getenv(benchWorkerEnv); dbURL != "" { // a worker process of BenchmarkInstances
		os.Exit(runBenchWorker(dbURL))
	}
	pgtest.Exit(m, "worker", &testDB)
}
