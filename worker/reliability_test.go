package worker_test

// Reliability suite: fault injection and randomized multi-instance model checking against
// the real PostgreSQL. RELIABILITY.md (repository root) lists the scenarios, what each
// injects and checks, and the numbers of the recorded runs.
//
//	reliability_test.go        shared checks; backends terminated; keepalive starved
//	reliability_kill_test.go   a worker process SIGKILLed mid-rewind (helper process)
//	reliability_model_test.go  the randomized model check (RELIABILITY_SEED, RELIABILITY_BUDGET)
//	reliability_input_test.go  bad input through the public entry points
//	reliability_stale_test.go  the normal path stalled mid-statement while another instance rewinds
//
// Every scenario ends with the same check (requireConverged): each model equals the fold
// of its stream's stored events sorted by ID (the ledger model records every applied ID,
// so an order change, gap or duplicate shows), no queue rows are left for the test's
// perspective on its streams, every snapshot equals the fold up to its position, and the
// stored events are exactly the ones the test appended.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"os"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/db"
	"github.com/perspectives-go/perspectives/internal/pgq"
	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/worker"
)

// ---------------------------------------------------------------------------------------
// Seeds and budgets.

// reliabilitySeed is RELIABILITY_SEED when set, else a fresh seed. It is logged, so that a
// failing run can be replayed.
func reliabilitySeed(t testing.TB) uint64 {
	t.Helper()
	if s := os.Getenv("RELIABILITY_SEED"); s != "" {
		seed, err := strconv.ParseUint(s, 10, 64)
		require.NoError(t, err, "RELIABILITY_SEED must be an unsigned integer")
		t.Logf("seed=%d (from RELIABILITY_SEED)", seed)
		return seed
	}
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed=%d (replay with RELIABILITY_SEED=%d)", seed, seed)
	return seed
}

// reliabilityBudget is RELIABILITY_BUDGET (a Go duration) when set, else def.
func reliabilityBudget(t testing.TB, def time.Duration) time.Duration {
	t.Helper()
	if s := os.Getenv("RELIABILITY_BUDGET"); s != "" {
		d, err := time.ParseDuration(s)
		require.NoError(t, err, "RELIABILITY_BUDGET must be a Go duration such as 2m")
		return d
	}
	return def
}

// ---------------------------------------------------------------------------------------
// Logs.

// logCounter is a slog handler shared by several worker instances: it counts records by
// message (and by message and stream) and keeps the first warnings and errors for failure
// reports. Count per stream where it matters: a test's perspective also receives the
// events other tests append to their streams.
type logCounter struct {
	mu      sync.Mutex
	counts  map[string]int
	samples []string
	causes  map[string]int // warning or error message and its error attribute, IDs elided
}

func newLogCounter() *logCounter {
	return &logCounter{counts: map[string]int{}, causes: map[string]int{}}
}

var uuidPattern = regexp.MustCompile(`[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}`)

func (c *logCounter) Enabled(context.Context, slog.Level) bool { return true }
func (c *logCounter) WithAttrs([]slog.Attr) slog.Handler       { return c }
func (c *logCounter) WithGroup(string) slog.Handler            { return c }
func (c *logCounter) Handle(_ context.Context, r slog.Record) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.counts[r.Message]++
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == "stream" {
			c.counts[r.Message+"\x00"+a.Value.String()]++
		}
		return true
	})
	if r.Level >= slog.LevelWarn {
		cause := r.Message
		r.Attrs(func(a slog.Attr) bool {
			if a.Key == "error" {
				cause += ": " + uuidPattern.ReplaceAllString(a.Value.String(), "<id>")
			}
			return true
		})
		c.causes[cause]++
	}
	if r.Level >= slog.LevelWarn && len(c.samples) < 40 {
		var b strings.Builder
		b.WriteString(r.Level.String() + " " + r.Message)
		r.Attrs(func(a slog.Attr) bool {
			if a.Key != "stack" {
				fmt.Fprintf(&b, " %s=%v", a.Key, a.Value)
			}
			return true
		})
		c.samples = append(c.samples, b.String())
	}
	return nil
}

func (c *logCounter) count(msg string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.counts[msg]
}

// countFor is the number of records with msg about stream.
func (c *logCounter) countFor(msg string, stream uuid.UUID) int {
	return c.count(msg + "\x00" + stream.String())
}

// countOn is the number of records with msg about any of streams.
func (c *logCounter) countOn(msg string, streams ...uuid.UUID) int {
	n := 0
	for _, s := range streams {
		n += c.countFor(msg, s)
	}
	return n
}

// summary is every message with its count, and its count on the given streams (the test's
// own; its perspective also applies other tests' streams), for t.Logf.
func (c *logCounter) summary(streams ...uuid.UUID) string {
	c.mu.Lock()
	defer c.mu.Unlock()
	keys := make([]string, 0, len(c.counts))
	for k := range c.counts {
		if !strings.Contains(k, "\x00") {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	var b strings.Builder
	fmt.Fprintf(&b, "\n    %7s %7s  message", "all", "ours")
	for _, k := range keys {
		ours := 0
		for _, s := range streams {
			ours += c.counts[k+"\x00"+s.String()]
		}
		fmt.Fprintf(&b, "\n    %7d %7d  %s", c.counts[k], ours, k)
	}
	return b.String()
}

// causeSummary is every distinct warning or error (message and error, IDs elided) with
// its count.
func (c *logCounter) causeSummary() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	keys := make([]string, 0, len(c.causes))
	for k := range c.causes {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&b, "\n    %7d  %s", c.causes[k], k)
	}
	return b.String()
}

func (c *logCounter) warnings() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return strings.Join(c.samples, "\n    ")
}

// Messages the worker logs (worker.go, rewind.go, keepalive.go).
const (
	msgRewindCompleted = "rewind completed"
	msgLockLost        = "stream lock lost: the operation's work was refused; will retry with backoff"
	msgRenewFailed     = "stream lock renewal failed; retrying at next tick"
	msgProcessFailed   = "processing failed; will retry with backoff"
	msgApplyFailed     = "event application failed; will retry with backoff"
	msgPanic           = "panic while processing pair"
)

// ---------------------------------------------------------------------------------------
// Appends and the final check.

// appendRetrying appends evs (their IDs set) until it succeeds. A retry that finds the IDs
// stored means an earlier attempt committed although its reply was lost (the batch is
// atomic, and its IDs are used nowhere else). It returns the number of failed attempts.
func appendRetrying(t testing.TB, ctx context.Context, pool *pgxpool.Pool, evs []worker.Event) int {
	t.Helper()
	for failures := 0; ; failures++ {
		err := worker.Append(ctx, pool, evs...)
		if err == nil || (failures > 0 && errors.Is(err, worker.ErrDuplicateEvent)) {
			return failures
		}
		require.Less(t, failures, 100, "append keeps failing: %v", err)
		time.Sleep(10 * time.Millisecond)
	}
}

// pairState is what the database holds for one (stream, perspective).
type pairState struct {
	stored    []uuid.UUID // wh_event_store, ID order
	model     ledger
	hasModel  bool
	modelLast uuid.UUID
	cursor    *db.CursorGetRow
	queued    []uuid.UUID
	snapshots map[uuid.UUID]ledger
	lock      *locker.Lock
}

// readPair reads one pair's rows on q (a pool or a snapshot transaction).
func readPair(ctx context.Context, q db.DBTX, name string, stream uuid.UUID) (pairState, error) {
	var st pairState
	dq := pgq.New(q)
	evs, err := dq.EventsForStream(ctx, stream)
	if err != nil {
		return st, err
	}
	for _, e := range evs {
		st.stored = append(st.stored, e.EventID)
	}
	models, err := dq.ModelsGet(ctx, db.ModelsGetParams{StreamIds: []uuid.UUID{stream}, PerspectiveNames: []string{name}})
	switch {
	case err != nil:
		return st, err
	case len(models) == 1:
		m := models[0]
		st.hasModel, st.modelLast = true, m.LastEventID
		if err := json.Unmarshal(m.Model, &st.model); err != nil {
			return st, fmt.Errorf("model of %s is not a ledger: %w", stream, err)
		}
	}
	cur, err := dq.CursorGet(ctx, db.CursorGetParams{StreamID: stream, PerspectiveName: name})
	switch {
	case errors.Is(err, pgx.ErrNoRows):
	case err != nil:
		return st, err
	default:
		st.cursor = &cur
		if cur.StreamLockInstanceID.Valid && cur.LockLive {
			st.lock = &locker.Lock{StreamID: stream, PerspectiveName: name, InstanceID: cur.StreamLockInstanceID.UUID}
		}
	}
	if st.queued, err = dq.QueueIDsForPair(ctx, db.QueueIDsForPairParams{StreamID: stream, PerspectiveName: name}); err != nil {
		return st, err
	}
	rows, err := q.Query(ctx, `SELECT snapshot_event_id, model FROM wh_perspective_snapshots
		WHERE stream_id = $1 AND perspective_name = $2`, stream, name)
	if err != nil {
		return st, err
	}
	st.snapshots = map[uuid.UUID]ledger{}
	for rows.Next() {
		var id uuid.UUID
		var raw []byte
		if err := rows.Scan(&id, &raw); err != nil {
			rows.Close()
			return st, err
		}
		var l ledger
		if err := json.Unmarshal(raw, &l); err != nil {
			rows.Close()
			return st, fmt.Errorf("snapshot of %s at %s is not a ledger: %w", stream, id, err)
		}
		st.snapshots[id] = l
	}
	return st, rows.Err()
}

func sortedIDs(evs []worker.Event) []uuid.UUID {
	ids := make([]uuid.UUID, len(evs))
	for i, e := range evs {
		ids[i] = e.ID
	}
	slices.SortFunc(ids, func(a, b uuid.UUID) int { return bytes.Compare(a[:], b[:]) })
	return ids
}

// foldUpTo is the ledger of the events with ID <= upto, folded in ID order.
func foldUpTo(t testing.TB, evs []worker.Event, upto uuid.UUID) ledger {
	t.Helper()
	var sub []worker.Event
	for _, e := range evs {
		if bytes.Compare(e.ID[:], upto[:]) <= 0 {
			sub = append(sub, e)
		}
	}
	return expectedLedger(t, sub)
}

func duplicates(ids []uuid.UUID) []uuid.UUID {
	seen := map[uuid.UUID]bool{}
	var dup []uuid.UUID
	for _, id := range ids {
		if seen[id] {
			dup = append(dup, id)
		}
		seen[id] = true
	}
	return dup
}

// waitConverged waits until every stream's model holds all its events and nothing is
// queued for it. On timeout it fails with the state of every stream that is not done.
func waitConverged(t testing.TB, ctx context.Context, pool *pgxpool.Pool, name string, streams map[uuid.UUID][]worker.Event, timeout time.Duration, tag string) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		var pending []string
		for s, evs := range streams {
			st, err := readPair(ctx, pool, name, s)
			if err != nil {
				pending = append(pending, fmt.Sprintf("%s: read: %v", s, err))
				continue
			}
			if len(st.queued) > 0 || len(st.model.IDs) != len(evs) {
				line := fmt.Sprintf("%s: model %d/%d events, %d queued", s, len(st.model.IDs), len(evs), len(st.queued))
				if st.cursor != nil {
					line += fmt.Sprintf(", cursor status %s attempts %d", st.cursor.Status, st.cursor.Attempts)
					if st.cursor.LastError != nil {
						line += ", last error: " + *st.cursor.LastError
					}
				}
				if st.lock != nil {
					line += ", locked by " + st.lock.InstanceID.String()
				}
				pending = append(pending, line)
			}
		}
		if len(pending) == 0 {
			return
		}
		if time.Now().After(deadline) {
			sort.Strings(pending)
			t.Fatalf("%s: not converged after %s; %d of %d streams pending:\n  %s", tag, timeout, len(pending), len(streams), strings.Join(pending, "\n  "))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// requireConverged is the final check of every scenario. It returns the number of events
// checked.
func requireConverged(t testing.TB, ctx context.Context, pool *pgxpool.Pool, name string, streams map[uuid.UUID][]worker.Event, tag string) int {
	t.Helper()
	checked := 0
	for s, evs := range streams {
		st, err := readPair(ctx, pool, name, s)
		require.NoError(t, err, "%s: stream %s", tag, s)
		want := sortedIDs(evs)
		require.Equal(t, want, st.stored, "%s: stream %s: the stored events are exactly the appended ones", tag, s)
		require.True(t, st.hasModel, "%s: stream %s has no model", tag, s)
		require.Empty(t, duplicates(st.model.IDs), "%s: stream %s: events applied twice", tag, s)
		require.Equal(t, want, st.model.IDs, "%s: stream %s: the model applied exactly the stored events, in ID order", tag, s)
		require.Equal(t, expectedLedger(t, evs), st.model, "%s: stream %s: model equals the fold of the sorted events", tag, s)
		require.Equal(t, want[len(want)-1], st.modelLast, "%s: stream %s: model position", tag, s)
		require.NotNil(t, st.cursor, "%s: stream %s has no cursor", tag, s)
		require.Equal(t, want[len(want)-1], st.cursor.LastEventID.UUID, "%s: stream %s: cursor position", tag, s)
		require.Empty(t, st.queued, "%s: stream %s: queue rows left for the perspective", tag, s)
		for pos, snap := range st.snapshots {
			require.Equal(t, foldUpTo(t, evs, pos), snap, "%s: stream %s: snapshot at %s equals the fold up to it", tag, s, pos)
		}
		checked += len(evs)
	}
	return checked
}

// ---------------------------------------------------------------------------------------
// Scenario 2: every backend of the database terminated, repeatedly, under load.

// TestReliabilityBackendsTerminated terminates every backend of the package's database
// (pg_terminate_backend) ten times, every 150ms, while three workers apply a shuffled
// workload with late events. The workers are not restarted: pgxpool reconnects and every
// failed poll, apply, rewind, renewal or release is retried.
//
// Not parallel, on purpose: it kills the connections of everything on this database, and a
// serial test never overlaps the parallel ones (they start after every serial test).
func TestReliabilityBackendsTerminated(t *testing.T) {
	ctx := context.Background()
	seed := reliabilitySeed(t)
	tag := fmt.Sprintf("seed=%d", seed)
	rng := rand.New(rand.NewPCG(seed, 2))
	name := uniqueName("reliab_term")
	logs := newLogCounter()
	// Registered first, so it runs last: drop the pool's connections the terminations left
	// dead, before the next test uses the pool.
	t.Cleanup(testDB.Pool.Reset)

	lockOpts := locker.Options{LockTimeout: 2 * time.Second, KeepAliveInterval: 500 * time.Millisecond}
	for range 3 {
		startWorker(t, worker.Config{
			Perspectives: []worker.Perspective{ledgerPerspective(name)},
			Locker:       newLocker(t, lockOpts),
			LockOptions:  lockOpts,
			BatchSize:    5,
			Snapshots:    worker.SnapshotOptions{EveryNEvents: 3, MaxPerStream: 3},
			PollInterval: 10 * time.Millisecond,
			RetryBackoff: 20 * time.Millisecond, MaxRetryBackoff: 200 * time.Millisecond,
			Logger: slog.New(logs),
		})
	}

	const nStreams, perStream = 10, 30
	streams := map[uuid.UUID][]worker.Event{}
	var pending []worker.Event
	for range nStreams {
		s := uuid.New()
		streams[s] = events(s, newIDs(t, perStream))
		pending = append(pending, streams[s]...)
	}
	rng.Shuffle(len(pending), func(i, j int) { pending[i], pending[j] = pending[j], pending[i] })

	const rounds = 10
	var terminated atomic.Int64
	killerDone := make(chan error, 1)
	go func() {
		killerDone <- func() error {
			for range rounds {
				time.Sleep(150 * time.Millisecond)
				conn, err := pgx.Connect(ctx, testDB.URL)
				if err != nil {
					return err
				}
				var n int64
				err = conn.QueryRow(ctx, `SELECT count(*) FILTER (WHERE pg_terminate_backend(pid))
					FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()`).Scan(&n)
				_ = conn.Close(ctx)
				if err != nil {
					return err
				}
				terminated.Add(n)
			}
			return nil
		}()
	}()

	appendStart := time.Now()
	appendFailures, batches := 0, 0
	for len(pending) > 0 {
		n := min(len(pending), 1+rng.IntN(6))
		appendFailures += appendRetrying(t, ctx, testDB.Pool, pending[:n])
		pending = pending[n:]
		batches++
		time.Sleep(time.Duration(rng.IntN(10)) * time.Millisecond)
	}
	appended := time.Since(appendStart)
	require.NoError(t, <-killerDone, "%s: terminating backends", tag)
	faultsEnded := time.Now()

	// Check on a fresh pool: the test's own pool may still hold connections that died.
	checkPool, err := pgxpool.New(ctx, testDB.URL)
	require.NoError(t, err)
	defer checkPool.Close()
	waitConverged(t, ctx, checkPool, name, streams, 60*time.Second, tag)
	recovered := time.Since(faultsEnded)
	checked := requireConverged(t, ctx, checkPool, name, streams, tag)

	require.Positive(t, terminated.Load(), "%s: no backend was terminated: the fault was not injected", tag)
	require.Zero(t, logs.count(msgPanic), "%s: %s", tag, logs.warnings())
	t.Logf("%s: %d rounds, %d backends terminated, %d append batches in %s (%d failed attempts, retried); converged %s after the last round; %d events checked, %d streams; worker logs:%s\n  warnings and errors (all streams):%s",
		tag, rounds, terminated.Load(), batches, appended.Round(time.Millisecond), appendFailures, recovered.Round(time.Millisecond), checked, nStreams, logs.summary(slices.Collect(maps.Keys(streams))...), logs.causeSummary())
}

// ---------------------------------------------------------------------------------------
// Scenario 3: a holder's keepalive starved past LockTimeout.

// starvableLocker is the real locker whose Renew can be made to block (until the
// keepalive gives up) or to fail, as when the holder's process is starved or partitioned
// from the database while its rewind runs.
type starvableLocker struct {
	locker.Locker
	stream  uuid.UUID    // the only stream whose renewals are starved
	mode    atomic.Int32 // renewNormal, renewBlocks or renewFails
	starved atomic.Int64 // renewals that were blocked or failed
}

// LocksCursorRows: it wraps locker.Postgres, so its locks are on the cursor rows.
func (s *starvableLocker) LocksCursorRows() {}

const (
	renewNormal int32 = iota
	renewBlocks
	renewFails
)

var errInjectedRenew = errors.New("injected renewal failure")

func (s *starvableLocker) Renew(ctx context.Context, stream uuid.UUID, perspective string, instance uuid.UUID) (bool, error) {
	mode := s.mode.Load()
	if stream != s.stream {
		mode = renewNormal
	}
	switch mode {
	case renewBlocks:
		s.starved.Add(1)
		<-ctx.Done()
		return false, ctx.Err()
	case renewFails:
		s.starved.Add(1)
		return false, errInjectedRenew
	}
	return s.Locker.Renew(ctx, stream, perspective, instance)
}

// TestReliabilityKeepAliveStarved starves the keepalive of an instance (A) whose rewind is
// held mid-replay, until its lease lapses; another instance (B) takes over. When A resumes,
// its commit must be refused and write nothing; the final state must be right.
//
//   - renew-blocks: B completes its rewind and releases before A resumes.
//   - renew-fails: A resumes while B still holds the lock, mid-replay.
func TestReliabilityKeepAliveStarved(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name         string
		mode         int32
		bStillActive bool
	}{
		{"renew-blocks", renewBlocks, false},
		{"renew-fails", renewFails, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			name := uniqueName("reliab_starve")
			lockOpts := locker.Options{LockTimeout: 2 * time.Second, KeepAliveInterval: 500 * time.Millisecond}
			logsA, logsB := newLogCounter(), newLogCounter()
			stream := uuid.New()
			lkA := &starvableLocker{Locker: newLocker(t, lockOpts), stream: stream}
			gatedA := newGated(name)
			wA := startWorker(t, worker.Config{
				Perspectives: []worker.Perspective{gatedA}, Locker: lkA, LockOptions: lockOpts,
				PollInterval: 10 * time.Millisecond, Logger: slog.New(logsA),
			})
			inspect := newLocker(t, lockOpts)

			ids := newIDs(t, 20)
			all := events(stream, ids)
			require.NoError(t, worker.Append(ctx, testDB.Pool, all[1:]...))
			before := waitModel(t, ctx, name, stream, len(all)-1)

			// A's rewind stops mid-replay holding the lock; its renewals are starved.
			enteredA, releaseA := gatedA.arm(ids[5])
			defer releaseA()
			lkA.mode.Store(tc.mode)
			require.NoError(t, worker.Append(ctx, testDB.Pool, all[0])) // late
			select {
			case <-enteredA:
			case <-time.After(20 * time.Second):
				t.Fatal("A's rewind did not start")
			}
			lockA, held, err := inspect.Get(ctx, stream, name)
			require.NoError(t, err)
			require.True(t, held)
			require.Equal(t, wA.InstanceID(), lockA.InstanceID, "A holds the lock mid-rewind")
			require.Equal(t, locker.ReasonRewind, lockA.Reason)

			// B takes over once A's lease lapses (no renewal reaches the database).
			gatedB := newGated(name)
			var enteredB <-chan struct{}
			releaseB := func() {}
			if tc.bStillActive {
				enteredB, releaseB = gatedB.arm(ids[8])
			}
			defer releaseB()
			wB := startWorker(t, worker.Config{
				Perspectives: []worker.Perspective{gatedB}, Locker: newLocker(t, lockOpts), LockOptions: lockOpts,
				PollInterval: 10 * time.Millisecond, Logger: slog.New(logsB),
			})
			if tc.bStillActive {
				select {
				case <-enteredB:
				case <-time.After(20 * time.Second):
					t.Fatal("B did not take over")
				}
				lockB, held, err := inspect.Get(ctx, stream, name)
				require.NoError(t, err)
				require.True(t, held)
				require.Equal(t, wB.InstanceID(), lockB.InstanceID, "B holds the lock after A's lease lapsed")
				require.False(t, lockB.Expiry.Before(lockA.Expiry.Add(lockOpts.LockTimeout)),
					"B acquired (lease to %s) only after A's lease expired (%s)", lockB.Expiry, lockA.Expiry)
			} else {
				waitModel(t, ctx, name, stream, len(all))
				var updated time.Time
				require.NoError(t, testDB.Pool.QueryRow(ctx, `SELECT updated_at FROM wh_perspective_models
					WHERE stream_id = $1 AND perspective_name = $2`, stream, name).Scan(&updated))
				require.True(t, updated.After(lockA.Expiry), "B wrote (%s) only after A's lease expired (%s)", updated, lockA.Expiry)
				// The log line follows the commit: wait for it.
				eventually(t, 5*time.Second, "B logging its rewind", func() bool { return logsB.countFor(msgRewindCompleted, stream) > 0 })
				require.Equal(t, 1, logsB.countFor(msgRewindCompleted, stream), "B did the rewind, once")
			}

			// A resumes: its commit is refused and writes nothing.
			stBefore, err := readPair(ctx, testDB.Pool, name, stream)
			require.NoError(t, err)
			rewindsA := logsA.countFor(msgRewindCompleted, stream)
			releaseA()
			eventually(t, 20*time.Second, "A's stale work refused", func() bool { return logsA.countFor(msgLockLost, stream) > 0 })
			stAfter, err := readPair(ctx, testDB.Pool, name, stream)
			require.NoError(t, err)
			require.Equal(t, stBefore.model, stAfter.model, "the starved holder wrote nothing")
			require.Equal(t, stBefore.cursor.Version, stAfter.cursor.Version, "the cursor did not move")
			require.Equal(t, rewindsA, logsA.countFor(msgRewindCompleted, stream), "A's rewind did not complete")
			if tc.bStillActive {
				require.Equal(t, before, stAfter.model, "the model is still the one before the late event")
				require.Equal(t, []uuid.UUID{ids[0]}, stAfter.queued, "the late event is still queued")
				require.Positive(t, logsA.countFor(msgRenewFailed, stream), "A logged its failing renewals")
				releaseB()
			}
			require.Positive(t, lkA.starved.Load(), "A's keepalive was starved")

			streams := map[uuid.UUID][]worker.Event{stream: all}
			waitConverged(t, ctx, testDB.Pool, name, streams, 20*time.Second, tc.name)
			n := requireConverged(t, ctx, testDB.Pool, name, streams, tc.name)
			// The model commits before the holder's release: wait for the release, reading the
			// column itself, so that a lock left to expire (not released) still fails.
			eventually(t, 5*time.Second, "no lock left (released, not expired)", func() bool {
				var holder *uuid.UUID
				require.NoError(t, testDB.Pool.QueryRow(ctx, `SELECT stream_lock_instance_id FROM wh_perspective_cursors
					WHERE stream_id = $1 AND perspective_name = $2`, stream, name).Scan(&holder))
				return holder == nil
			})
			t.Logf("%s: %d starved renewals, A refused %d commits, %d events checked",
				tc.name, lkA.starved.Load(), logsA.countFor(msgLockLost, stream), n)
		})
	}
}
