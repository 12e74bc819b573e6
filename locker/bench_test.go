package locker_test

// Lock-cycle benchmarks (BENCHMARKS.md describes them and their figures).
//
// One lock cycle is TryAcquire + Renew + Release on one (stream, perspective) pair whose
// cursor row exists (Append creates it, so this is the worker's usual case). It is compared,
// in the same run and interleaved cycle by cycle, with
//
//   - floor:    the lock-cycle floor: three raw single-row primary-key UPDATEs of the same
//     lock columns of wh_perspective_cursors (set, extend, clear), through the same pool;
//   - advisory: pg_try_advisory_lock + pg_advisory_unlock on a held connection, which is
//     what users often pick instead (no lease, no expiry, no renewal, nothing visible in a
//     table, and no commit to wait for: its "cycle" is two read-only round trips).
//
// Every goroutine uses its own pairs (distinct pairs, no contention) and runs one cycle of
// each kind per iteration, in a rotating order, timing each cycle. The figures are the
// median latency of one cycle per kind and the ratio of those medians to the floor's: on a
// shared, noisy machine, fine-grained interleaving and medians are what keep the ratio
// honest. With 8 goroutines the latency is that of one cycle while 8 are in flight.
//
// Every locker and floor statement commits, and a commit waits for its WAL flush: on this
// machine the flush dominates. The sub-benchmarks with commit=async run the same on a pool
// with synchronous_commit=off, which exposes what the statements themselves cost.
//
// Nothing here asserts speed.

import (
	"context"
	"encoding/binary"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/internal/pgtest"
	"github.com/perspectives-go/perspectives/locker"
)

const benchLockPairsPerGoroutine = 64 // distinct pairs per goroutine, used round-robin

// Floor statements: the same column writes as acquire, renew and release, with no
// conditions, no upsert and no RETURNING.
const (
	floorSet = `UPDATE wh_perspective_cursors
SET stream_lock_instance_id = $3, stream_lock_expiry = clock_timestamp() + make_interval(secs => $4::float8), stream_lock_reason = $5
WHERE stream_id = $1 AND perspective_name = $2`
	floorExtend = `UPDATE wh_perspective_cursors
SET stream_lock_expiry = clock_timestamp() + make_interval(secs => $3::float8)
WHERE stream_id = $1 AND perspective_name = $2`
	floorClear = `UPDATE wh_perspective_cursors
SET stream_lock_instance_id = NULL, stream_lock_expiry = NULL, stream_lock_reason = NULL
WHERE stream_id = $1 AND perspective_name = $2`
)

type lockKind int

const (
	kindLock lockKind = iota
	kindFloor
	kindAdvisory
	kindPooled   // the locker's cycle through the installed PgBouncer, pgx exec mode (BenchmarkLockCyclePooled)
	kindPrepared // the same through a PgBouncer keeping prepared statements, pgx's default mode
	numKinds
)

// BenchmarkLockCycle reports the median latency of one cycle for the locker, the floor and
// advisory locks at concurrency 1 and 8, and the ratios lock/floor and advisory/floor.
func BenchmarkLockCycle(b *testing.B) {
	cases := []struct {
		name  string
		conc  int
		iters int // iterations per goroutine (one cycle of each kind per iteration)
		async bool
	}{
		{"conc=1", 1, 300, false},
		{"conc=8", 8, 60, false},
		{"conc=1/commit=async", 1, 1500, true},
		{"conc=8/commit=async", 8, 300, true},
	}
	for _, c := range cases {
		b.Run(c.name, func(b *testing.B) {
			pool := testDB.Pool
			if c.async {
				pool = asyncPool(b)
			}
			for range b.N {
				benchLockCycle(b, pool, nil, c.conc, c.iters)
			}
		})
	}
}

// BenchmarkLockCyclePooled runs the locker's cycle through two PgBouncers of its own in
// transaction mode, interleaved with the same cycle direct (pgx's default mode) and the
// floor: the installed PgBouncer with pgx's exec mode (a PgBouncer < 1.21 cannot keep
// prepared statements), reported as pooled/lock, and a PgBouncer >= 1.21 keeping them
// (max_prepared_statements) with pgx's default mode, reported as prepared/lock
// (scripts/pgbouncer.sh, PGBOUNCER_PREPARED). They are what each pooler and mode cost a
// lock cycle. Where the installed PgBouncer is older than 1.21 (and the system's package
// sources offer no newer one) the prepared kind is not run: the benchmark logs
// "not run: prepared: <reason>", which the harness (bench/) reports for its targets.
func BenchmarkLockCyclePooled(b *testing.B) {
	for _, c := range []struct {
		name  string
		conc  int
		iters int
	}{{"conc=1", 1, 300}, {"conc=8", 8, 60}} {
		b.Run(c.name, func(b *testing.B) {
			pooled, err := pgxpool.New(context.Background(), pgtest.WithExecMode(pgtest.StartPooler(b, testDB.Name), "exec"))
			require.NoError(b, err)
			b.Cleanup(pooled.Close)
			pools := []*pgxpool.Pool{pooled}
			if why := pgtest.PreparedPoolerMissing(b); why != "" {
				b.Logf("not run: prepared: %s", why)
			} else {
				prepared, err := pgxpool.New(context.Background(), pgtest.StartPreparedPooler(b, testDB.Name))
				require.NoError(b, err)
				b.Cleanup(prepared.Close)
				pools = append(pools, prepared)
			}
			for range b.N {
				benchLockCycle(b, testDB.Pool, pools, c.conc, c.iters)
			}
		})
	}
}

// asyncPool opens a pool on the test database whose sessions do not wait for WAL flushes.
func asyncPool(b *testing.B) *pgxpool.Pool {
	cfg, err := pgxpool.ParseConfig(testDB.URL)
	require.NoError(b, err)
	cfg.ConnConfig.RuntimeParams["synchronous_commit"] = "off"
	cfg.MaxConns = 16
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(b, err)
	b.Cleanup(pool.Close)
	return pool
}

// benchLockCycle times the cycles on pool, and through poolers when given: pooled[0] as
// kindPooled, pooled[1] (when given) as kindPrepared.
func benchLockCycle(b *testing.B, pool *pgxpool.Pool, pooled []*pgxpool.Pool, conc, iters int) {
	ctx := context.Background()
	name := uniquePerspective("bench-lock")
	l, err := locker.NewPostgres(pool, locker.Options{})
	require.NoError(b, err)
	kinds := []lockKind{kindLock, kindFloor, kindAdvisory}
	var lp [numKinds]*locker.Postgres // the lockers through the poolers, by kind
	if pooled != nil {
		// Through a transaction pooler session advisory locks do not hold: not measured.
		kinds = []lockKind{kindLock, kindFloor}
		for i, kind := range []lockKind{kindPooled, kindPrepared}[:len(pooled)] {
			kinds = append(kinds, kind)
			lp[kind], err = locker.NewPostgres(pooled[i], locker.Options{})
			require.NoError(b, err)
		}
	}
	timeout := locker.DefaultLockTimeout.Seconds()

	// Each goroutine owns benchLockPairsPerGoroutine pairs with existing cursor rows.
	streams := make([][]uuid.UUID, conc)
	var all []uuid.UUID
	for g := range streams {
		for range benchLockPairsPerGoroutine {
			s := uuid.New()
			streams[g] = append(streams[g], s)
			all = append(all, s)
		}
	}
	_, err = pool.Exec(ctx, `INSERT INTO wh_perspective_cursors (stream_id, perspective_name)
		SELECT unnest($1::uuid[]), $2`, all, name)
	require.NoError(b, err)
	defer func() {
		_, _ = pool.Exec(context.Background(), `DELETE FROM wh_perspective_cursors WHERE perspective_name = $1`, name)
	}()
	// Autovacuum is off on the shared test cluster: start every run from a clean table.
	_, err = pool.Exec(ctx, `VACUUM (ANALYZE) wh_perspective_cursors`)
	require.NoError(b, err)

	// Advisory locks need a held connection per goroutine (session-level locks).
	conns := make([]*pgxpool.Conn, conc)
	for g := range conns {
		conns[g], err = pool.Acquire(ctx)
		require.NoError(b, err)
	}
	defer func() {
		for _, c := range conns {
			c.Release()
		}
	}()
	instances := make([]uuid.UUID, conc)
	for g := range instances {
		instances[g] = uuid.New()
	}

	// stepTimes[g][kind][step] are the latencies of the cycle's three statements.
	type stepTimes [numKinds][3][]time.Duration
	times := make([]stepTimes, conc)
	cycle := func(kind lockKind, g, i int, rec bool) error {
		s := streams[g][i%len(streams[g])]
		inst := instances[g]
		var lat [3]time.Duration
		t := time.Now()
		mark := func(n int) {
			now := time.Now()
			lat[n] = now.Sub(t)
			t = now
		}
		switch kind {
		case kindLock, kindPooled, kindPrepared:
			l := l
			if lp[kind] != nil {
				l = lp[kind]
			}
			ok, err := l.TryAcquire(ctx, s, name, inst, locker.ReasonRewind)
			if err != nil {
				return err
			}
			if !ok {
				return fmt.Errorf("lock on %s not acquired", s)
			}
			mark(0)
			held, err := l.Renew(ctx, s, name, inst)
			if err != nil {
				return err
			}
			if !held {
				return fmt.Errorf("lock on %s lost", s)
			}
			mark(1)
			if err := l.Release(ctx, s, name, inst); err != nil {
				return err
			}
			mark(2)
		case kindFloor:
			if _, err := pool.Exec(ctx, floorSet, s, name, inst, timeout, string(locker.ReasonRewind)); err != nil {
				return err
			}
			mark(0)
			if _, err := pool.Exec(ctx, floorExtend, s, name, timeout); err != nil {
				return err
			}
			mark(1)
			if _, err := pool.Exec(ctx, floorClear, s, name); err != nil {
				return err
			}
			mark(2)
		default:
			key := int64(binary.BigEndian.Uint64(s[:8]))
			var ok bool
			if err := conns[g].QueryRow(ctx, `SELECT pg_try_advisory_lock($1)`, key).Scan(&ok); err != nil {
				return err
			}
			if !ok {
				return fmt.Errorf("advisory lock %d not acquired", key)
			}
			mark(0)
			if err := conns[g].QueryRow(ctx, `SELECT pg_advisory_unlock($1)`, key).Scan(&ok); err != nil {
				return err
			}
			mark(1)
		}
		if rec {
			for n := range lat {
				times[g][kind][n] = append(times[g][kind][n], lat[n])
			}
		}
		return nil
	}

	// Warm up every path (prepared statements, buffers) outside the measurement.
	for _, kind := range kinds {
		for g := range conc {
			for i := range benchLockPairsPerGoroutine {
				require.NoError(b, cycle(kind, g, i, false))
			}
		}
	}

	b.ResetTimer()
	var wg sync.WaitGroup
	errs := make(chan error, conc)
	for g := range conc {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range iters {
				for j := range kinds {
					kind := kinds[(i+g+j)%len(kinds)] // rotate: no kind always runs first
					if err := cycle(kind, g, i, true); err != nil {
						errs <- err
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	b.StopTimer()
	close(errs)
	for err := range errs {
		require.NoError(b, err)
	}

	// Median over all goroutines' cycles, per kind; and per statement.
	cycleMedian := func(kind lockKind) float64 {
		var xs []float64
		for g := range times {
			for i := range times[g][kind][0] {
				xs = append(xs, float64(times[g][kind][0][i]+times[g][kind][1][i]+times[g][kind][2][i]))
			}
		}
		return median(xs)
	}
	stepMedian := func(kind lockKind, n int) float64 {
		var xs []float64
		for g := range times {
			for _, d := range times[g][kind][n] {
				xs = append(xs, float64(d))
			}
		}
		return median(xs)
	}
	lock, floor := cycleMedian(kindLock), cycleMedian(kindFloor)
	b.ReportMetric(lock, "lock-ns/cycle")
	b.ReportMetric(floor, "floor-ns/cycle")
	b.ReportMetric(lock/floor, "lock/floor")
	if pooled != nil {
		p := cycleMedian(kindPooled)
		b.ReportMetric(p, "pooled-ns/cycle")
		b.ReportMetric(p/lock, "pooled/lock")
		if len(pooled) > 1 {
			p := cycleMedian(kindPrepared)
			b.ReportMetric(p, "prepared-ns/cycle")
			b.ReportMetric(p/lock, "prepared/lock")
		}
	} else {
		adv := cycleMedian(kindAdvisory)
		b.ReportMetric(adv, "advisory-ns/cycle")
		b.ReportMetric(adv/floor, "advisory/floor")
	}
	for n, what := range []string{"acquire/set", "renew/extend", "release/clear"} {
		b.ReportMetric(stepMedian(kindLock, n)/stepMedian(kindFloor, n), what)
	}
}

func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}
