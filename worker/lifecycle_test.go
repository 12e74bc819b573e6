package worker_test

// The perspective lifecycle against PostgreSQL: registration, catch-up, versions.

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/internal/pgtest"
	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/worker"
)

// An Append in a REPEATABLE READ or SERIALIZABLE transaction whose snapshot was taken
// before a perspective registered, committed after the registration, must not be lost for
// that perspective: either it is queued for it, or the transaction fails with a
// serialization error (the caller retries, as it must at these levels), and the retry is.
func TestAppendInSnapshotTransactionTakenBeforeRegistrationIsNotLost(t *testing.T) {
	t.Parallel()
	for _, iso := range []pgx.TxIsoLevel{pgx.RepeatableRead, pgx.Serializable} {
		t.Run(string(iso), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			stream := uuid.New()
			evs := events(stream, newIDs(t, 2))

			tx, err := testDB.Pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: iso})
			require.NoError(t, err)
			defer func() { _ = tx.Rollback(context.Background()) }()
			var n int
			require.NoError(t, tx.QueryRow(ctx, `SELECT count(*) FROM wh_perspectives`).Scan(&n)) // the snapshot

			name := uniqueName("snapiso")
			startWorker(t, worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(name)}})

			err = worker.Append(ctx, tx, evs...)
			if err == nil {
				err = tx.Commit(ctx)
			}
			retried := false
			if err != nil {
				var pgErr *pgconn.PgError
				require.True(t, errors.As(err, &pgErr), "%v", err)
				require.Equal(t, "40001", pgErr.Code, "a serialization failure, which the caller retries: %v", err)
				_ = tx.Rollback(ctx)
				// Retried as those isolation levels require: again while other tests'
				// registrations keep coming after the retry's snapshot.
				for attempt := 1; ; attempt++ {
					err := pgx.BeginTxFunc(ctx, testDB.Pool, pgx.TxOptions{IsoLevel: iso}, func(tx pgx.Tx) error {
						return worker.Append(ctx, tx, evs...)
					})
					if err == nil || attempt == 20 || !errors.As(err, &pgErr) || pgErr.Code != "40001" {
						require.NoError(t, err)
						break
					}
				}
				retried = true
			}
			require.Equal(t, expectedLedger(t, evs), waitModelWithin(t, ctx, name, stream, 2, 10*time.Second),
				"the events reach the perspective registered after the snapshot (retried: %v)", retried)
		})
	}
}

// waitModelWithin is waitModel with a timeout of the caller's.
func waitModelWithin(t testing.TB, ctx context.Context, name string, stream uuid.UUID, n int, timeout time.Duration) ledger {
	t.Helper()
	var m ledger
	eventually(t, timeout, "model with all events", func() bool {
		m, _ = loadLedger(t, ctx, name, stream)
		return len(m.IDs) == n
	})
	return m
}

// vledger is the model of a versioned ledger perspective: the version that built it, and
// every applied event ID in order.
type vledger struct {
	V   int         `json:"v"`
	IDs []uuid.UUID `json:"ids"`
}

// vledgerPerspective is version v of a ledger perspective named name.
type vledgerPerspective struct {
	worker.Perspective
	v int
}

func (p vledgerPerspective) Version() int { return p.v }

func newVLedger(name string, v int) worker.Perspective {
	return vledgerPerspective{v: v, Perspective: worker.JSONPerspective(name, func(m vledger, ev worker.Event) (vledger, error) {
		m.V = v
		m.IDs = append(m.IDs, ev.ID)
		return m, nil
	})}
}

func loadVLedger(t testing.TB, ctx context.Context, d *pgtest.DB, name string, stream uuid.UUID) (vledger, bool) {
	t.Helper()
	raw, ok, err := worker.LoadModel(ctx, d.Pool, name, stream)
	require.NoError(t, err)
	var m vledger
	if ok {
		require.NoError(t, json.Unmarshal(raw, &m), "model %s", raw)
	}
	return m, ok
}

// lcWorker starts a worker on d (stopped when the test ends, unless stopped before).
func lcWorker(t *testing.T, d *pgtest.DB, cfg worker.Config) *worker.Worker {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = quietLogger()
	}
	cfg.PollInterval = cmp.Or(cfg.PollInterval, 20*time.Millisecond)
	w, err := worker.New(d.Pool, cfg)
	require.NoError(t, err)
	start := time.Now()
	require.NoError(t, w.Start(context.Background()))
	require.Less(t, time.Since(start), 2*time.Second, "Start does no long work")
	t.Cleanup(func() { lcStop(t, w) })
	return w
}

func lcStop(t *testing.T, w *worker.Worker) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, w.Stop(ctx))
}

func lcCount(t testing.TB, d *pgtest.DB, sql string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, d.Pool.QueryRow(context.Background(), sql, args...).Scan(&n))
	return n
}

// lcStored is every event of d's store, by stream, in ID order.
func lcStored(t testing.TB, d *pgtest.DB) map[uuid.UUID][]uuid.UUID {
	t.Helper()
	rows, err := d.Pool.Query(context.Background(), `SELECT stream_id, event_id FROM wh_event_store ORDER BY stream_id, event_id`)
	require.NoError(t, err)
	out := map[uuid.UUID][]uuid.UUID{}
	for rows.Next() {
		var s, e uuid.UUID
		require.NoError(t, rows.Scan(&s, &e))
		out[s] = append(out[s], e)
	}
	require.NoError(t, rows.Err())
	return out
}

// lcConverged waits until every stream's model in the active build of name is version v
// folded over exactly the stored events, in ID order, and nothing is queued for it.
func lcConverged(t *testing.T, d *pgtest.DB, name string, v int, timeout time.Duration) map[uuid.UUID][]uuid.UUID {
	t.Helper()
	ctx := context.Background()
	var stored map[uuid.UUID][]uuid.UUID
	var last string
	deadline := time.Now().Add(timeout)
	for {
		stored = lcStored(t, d)
		bad := 0
		for s, ids := range stored {
			m, ok := loadVLedger(t, ctx, d, name, s)
			if !ok || m.V != v || !slices.Equal(m.IDs, ids) {
				bad++
				last = fmt.Sprintf("stream %s: version %d, %d of %d events (present %v)", s, m.V, len(m.IDs), len(ids), ok)
			}
		}
		if bad == 0 {
			return stored
		}
		if time.Now().After(deadline) {
			t.Fatalf("after %s, %d of %d streams differ from the fold of version %d; e.g. %s", timeout, bad, len(stored), v, last)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// A new perspective registers in a few statements over a store that already holds events
// and catches up from the store: no queue row per historical event, models equal to the
// fold of the stored events (streams longer than a page, and many short ones).
func TestNewPerspectiveCatchesUpFromTheStore(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := isolatedDB(t)
	long := uuid.New()
	var evs []worker.Event
	evs = append(evs, events(long, newIDs(t, 730))...)
	for range 40 {
		evs = append(evs, events(uuid.New(), newIDs(t, 12))...)
	}
	for i := 0; i < len(evs); i += 500 {
		require.NoError(t, worker.Append(ctx, d.Pool, evs[i:min(i+500, len(evs))]...))
	}
	require.Zero(t, lcCount(t, d, `SELECT count(*) FROM wh_perspective_events`), "no perspective yet: nothing queued")

	name := uniqueName("catchup")
	lcWorker(t, d, worker.Config{Perspectives: []worker.Perspective{newVLedger(name, 1)}, CatchUpPageSize: 100})
	require.Zero(t, lcCount(t, d, `SELECT count(*) FROM wh_perspective_events`), "registration queues nothing")
	stored := lcConverged(t, d, name, 1, 30*time.Second)
	require.Len(t, stored, 41)
	require.Zero(t, lcCount(t, d, `SELECT count(*) FROM wh_perspective_events`))
	var done bool
	var read, passed int64
	eventually(t, 10*time.Second, "the catch-up done", func() bool {
		require.NoError(t, d.Pool.QueryRow(ctx, `SELECT catchup_done, catchup_events, catchup_streams FROM wh_perspective_builds
			WHERE perspective_name = $1`, name).Scan(&done, &read, &passed))
		return done
	})
	require.EqualValues(t, len(evs), read, "every stored event read once")
	require.EqualValues(t, 41, passed, "every stream passed once")
}

// A rolling deployment of version 2 of a perspective over three instances, while events
// (some late) keep being appended: v2 builds beside v1 and is promoted when it has caught
// up; readers meanwhile always get a complete model, never version 1 after version 2; the
// v1 instances still running say once that their version was retired and apply nothing
// more; the retired build's rows are deleted; every model ends as v2's fold of exactly the
// stored events.
func TestRollingDeploymentBuildsTheNewVersionBesideTheOld(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := isolatedDB(t)
	name := uniqueName("rolling")
	streams := make([]uuid.UUID, 20)
	for i := range streams {
		streams[i] = uuid.New()
		require.NoError(t, worker.Append(ctx, d.Pool, events(streams[i], newIDs(t, 30))...))
	}
	lk, err := locker.NewPostgres(d.Pool, locker.Options{})
	require.NoError(t, err)
	cfg := func(v int, logs *logCapture) worker.Config {
		c := worker.Config{Perspectives: []worker.Perspective{newVLedger(name, v)}, Locker: lk, CatchUpPageSize: 64}
		if logs != nil {
			c.Logger = slog.New(logs)
		}
		return c
	}
	logs := []*logCapture{{}, {}, {}}
	v1 := []*worker.Worker{lcWorker(t, d, cfg(1, logs[0])), lcWorker(t, d, cfg(1, logs[1])), lcWorker(t, d, cfg(1, logs[2]))}
	lcConverged(t, d, name, 1, 30*time.Second)

	// Appends: rounds of 3 events per stream; one of each round's events is held back to
	// the next round, so it arrives after newer ones (late).
	stop := make(chan struct{})
	appended := make(chan error, 1)
	go func() {
		held := map[uuid.UUID]worker.Event{}
		for round := 0; ; round++ {
			select {
			case <-stop:
				var rest []worker.Event
				for _, ev := range held {
					rest = append(rest, ev)
				}
				appended <- worker.Append(ctx, d.Pool, rest...)
				return
			default:
			}
			for _, s := range streams {
				evs := events(s, newIDs(t, 3))
				batch := evs[1:]
				if ev, ok := held[s]; ok {
					batch = append(batch, ev)
				}
				held[s] = evs[0]
				if err := worker.Append(ctx, d.Pool, batch...); err != nil {
					appended <- err
					return
				}
			}
			time.Sleep(10 * time.Millisecond)
		}
	}()

	// Readers: a model once seen is never gone, and its version never goes back.
	readErr := make(chan string, 1)
	readStop := make(chan struct{})
	readDone := make(chan struct{})
	sawV2 := false
	go func() {
		defer close(readDone)
		seen := map[uuid.UUID]int{}
		for {
			select {
			case <-readStop:
				return
			default:
			}
			for _, s := range streams {
				raw, ok, err := worker.LoadModel(ctx, d.Pool, name, s)
				var m vledger
				if err == nil && ok {
					err = json.Unmarshal(raw, &m)
				}
				switch {
				case err != nil:
					readErr <- err.Error()
					return
				case !ok || len(m.IDs) == 0:
					readErr <- fmt.Sprintf("stream %s: no model (was version %d)", s, seen[s])
					return
				case m.V < seen[s]:
					readErr <- fmt.Sprintf("stream %s: version %d after version %d", s, m.V, seen[s])
					return
				}
				seen[s] = m.V
				sawV2 = sawV2 || m.V == 2
			}
		}
	}()

	// Roll: replace the v1 instances one by one with v2 instances.
	v2Logs := &logCapture{}
	for i := range v1 {
		time.Sleep(150 * time.Millisecond)
		if i < 2 {
			lcStop(t, v1[i])
		}
		lcWorker(t, d, cfg(2, v2Logs))
	}
	// The wait guards against a hang, not a speed: v2's catch-up chases the Appends, and
	// through PgBouncer beside the worker package's tests (two cores, -race) the test took
	// up to 61 s, and 30 s ran out before the build was caught up; alone it takes about 12 s.
	eventually(t, 120*time.Second, "version 2 promoted", func() bool {
		return lcCount(t, d, `SELECT count(*) FROM wh_perspective_builds WHERE perspective_name = $1 AND version = 2 AND state = 'active'`, name) == 1
	})
	time.Sleep(200 * time.Millisecond)
	close(stop)
	require.NoError(t, <-appended)
	stored := lcConverged(t, d, name, 2, 30*time.Second)
	close(readStop)
	<-readDone
	select {
	case msg := <-readErr:
		t.Fatal(msg)
	default:
	}
	require.True(t, sawV2, "readers saw the new version")
	require.Equal(t, 1, logs[2].count("perspective version retired: this instance no longer applies it"),
		"the v1 instance still running says so, once")
	require.Equal(t, 1, v2Logs.count("perspective version promoted"), "promoted once")
	require.Zero(t, lcCount(t, d, `SELECT count(*) FROM wh_perspective_events q
		JOIN wh_perspective_builds b ON b.build_key = q.perspective_name
		WHERE b.perspective_name = $1 AND b.state = 'retired' AND q.enqueued_at > b.retired_at`, name),
		"nothing is queued for the retired version once it is retired")
	rewinds := v2Logs.count("rewind completed")
	t.Logf("%d streams, %d events, %d rewinds by v2", len(stored), lcCount(t, d, `SELECT count(*) FROM wh_event_store`), rewinds)

	// The retired build's rows are deleted in the background once its grace has passed.
	_, err = d.Pool.Exec(ctx, `UPDATE wh_perspective_builds SET retired_at = now() - interval '1 hour'
		WHERE perspective_name = $1 AND state = 'retired'`, name)
	require.NoError(t, err)
	eventually(t, 30*time.Second, "the retired build's rows deleted", func() bool {
		return lcCount(t, d, `SELECT count(*) FROM wh_perspective_builds WHERE perspective_name = $1 AND state = 'retired' AND cleaned_at IS NOT NULL`, name) == 1
	})
	for _, table := range []string{"wh_perspective_cursors", "wh_perspective_models", "wh_perspective_snapshots", "wh_perspective_events"} {
		require.Zero(t, lcCount(t, d, `SELECT count(*) FROM `+table+` WHERE perspective_name = $1`, name), "%s of the retired build", table)
	}
	lcConverged(t, d, name, 2, time.Second)
}

// When every instance is replaced at once, readers keep getting the old version's models
// (no longer advancing) until the new version is promoted.
func TestReplacingEveryInstanceServesTheOldVersionUntilPromotion(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := isolatedDB(t)
	name := uniqueName("replace")
	stream := uuid.New()
	first := events(stream, newIDs(t, 5))
	require.NoError(t, worker.Append(ctx, d.Pool, first...))
	w1 := lcWorker(t, d, worker.Config{Perspectives: []worker.Perspective{newVLedger(name, 1)}})
	lcConverged(t, d, name, 1, 20*time.Second)
	lcStop(t, w1)

	more := events(stream, newIDs(t, 3))
	require.NoError(t, worker.Append(ctx, d.Pool, more...))
	m, ok := loadVLedger(t, ctx, d, name, stream)
	require.True(t, ok)
	require.Equal(t, 1, m.V)
	require.Len(t, m.IDs, 5, "no instance runs version 1: its model stays as it was")

	lcWorker(t, d, worker.Config{Perspectives: []worker.Perspective{newVLedger(name, 2)}, ManualPromotion: true})
	eventually(t, 20*time.Second, "version 2 caught up", func() bool {
		return lcCount(t, d, `SELECT count(*) FROM wh_perspective_builds WHERE perspective_name = $1 AND version = 2 AND catchup_done`, name) == 1
	})
	m, _ = loadVLedger(t, ctx, d, name, stream)
	require.Equal(t, vledger{V: 1, IDs: sortedIDs(first)}, m, "until promotion, readers get version 1's model")

	admin, err := worker.NewAdmin(d.Pool, nil)
	require.NoError(t, err)
	b, err := admin.Promote(ctx, name, 2)
	require.NoError(t, err)
	require.Equal(t, worker.BuildActive, b.State)
	lcConverged(t, d, name, 2, 20*time.Second)
}

// Three instances register a new perspective while events keep being appended (some late)
// to a store that already holds history: no event is lost, doubled or misordered.
func TestRegistrationUnderConcurrentAppendsWithThreeInstances(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := isolatedDB(t)
	name := uniqueName("regload")
	streams := make([]uuid.UUID, 15)
	for i := range streams {
		streams[i] = uuid.New()
		require.NoError(t, worker.Append(ctx, d.Pool, events(streams[i], newIDs(t, 40))...))
	}
	stop := make(chan struct{})
	appended := make(chan error, 1)
	go func() {
		held := map[uuid.UUID]worker.Event{}
		for {
			select {
			case <-stop:
				var rest []worker.Event
				for _, ev := range held {
					rest = append(rest, ev)
				}
				appended <- worker.Append(ctx, d.Pool, rest...)
				return
			default:
			}
			for _, s := range streams {
				evs := events(s, newIDs(t, 2))
				batch := evs[1:]
				if ev, ok := held[s]; ok {
					batch = append(batch, ev) // late: older than evs[1]
				}
				held[s] = evs[0]
				if err := worker.Append(ctx, d.Pool, batch...); err != nil {
					appended <- err
					return
				}
			}
		}
	}()
	lk, err := locker.NewPostgres(d.Pool, locker.Options{})
	require.NoError(t, err)
	for range 3 {
		time.Sleep(30 * time.Millisecond)
		lcWorker(t, d, worker.Config{Perspectives: []worker.Perspective{newVLedger(name, 1)}, Locker: lk, CatchUpPageSize: 50})
	}
	time.Sleep(300 * time.Millisecond)
	close(stop)
	require.NoError(t, <-appended)
	stored := lcConverged(t, d, name, 1, 30*time.Second)
	n := 0
	for _, ids := range stored {
		n += len(ids)
	}
	require.Equal(t, 1, lcCount(t, d, `SELECT count(*) FROM wh_perspective_builds WHERE perspective_name = $1`, name),
		"three instances registered one build")
	t.Logf("%d streams, %d events converged", len(stored), n)
}

// A worker started beside a transaction that appended events and stays open (a business
// transaction around Append): its registration waits for that transaction without holding
// up the Appends that come meanwhile (PostgreSQL would queue them behind a waiting exclusive
// lock request), logs after a while which transaction it waits for, and starts once that
// commits; its new perspective then has every event, the open transaction's included.
func TestStartBesideAnOpenAppendTransactionHoldsUpNoAppend(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := isolatedDB(t)
	open, err := d.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = open.Rollback(context.Background()) }()
	first := uuid.New()
	require.NoError(t, worker.Append(ctx, open, events(first, newIDs(t, 1))...))
	var holder int32
	require.NoError(t, open.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&holder))

	name := uniqueName("open_append")
	logs := &logCapture{}
	cfg := worker.Config{Perspectives: []worker.Perspective{newVLedger(name, 1)}, Logger: slog.New(logs), PollInterval: 20 * time.Millisecond}
	if d.DirectURL != d.URL {
		cfg.ListenConnect = func(ctx context.Context) (*pgx.Conn, error) { return pgx.Connect(ctx, d.DirectURL) }
	}
	w, err := worker.New(d.Pool, cfg)
	require.NoError(t, err)
	started := make(chan error, 1)
	go func() { started <- w.Start(ctx) }()
	t.Cleanup(func() { require.NoError(t, w.Stop(context.Background())) })
	time.Sleep(300 * time.Millisecond) // its first bounded wait has run out

	others := make([]uuid.UUID, 5)
	for i := range others {
		others[i] = uuid.New()
		actx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := worker.Append(actx, d.Pool, events(others[i], newIDs(t, 2))...)
		cancel()
		require.NoError(t, err, "Append %d while the registration waits", i)
	}
	select {
	case err := <-started:
		t.Fatalf("Start returned while a transaction that appended was open: %v", err)
	default:
	}

	const warning = "waiting for transactions that appended events to end (registering, rebuilding or promoting a build " +
		"waits until every Append in flight has committed; Appends are not held up meanwhile)"
	eventually(t, 20*time.Second, "the wait logged", func() bool { return logs.count(warning) > 0 })
	require.Equal(t, 1, logs.count(warning), "logged once")
	var holders string
	logs.mu.Lock()
	for _, r := range logs.records {
		if r.Message == warning {
			r.Attrs(func(a slog.Attr) bool {
				if a.Key == "holders" {
					holders = a.Value.String()
				}
				return true
			})
		}
	}
	logs.mu.Unlock()
	require.Contains(t, holders, fmt.Sprintf("server pid %d (open ", holder), "the log names the open transaction")

	require.NoError(t, open.Commit(ctx))
	select {
	case err := <-started:
		require.NoError(t, err)
	case <-time.After(20 * time.Second):
		t.Fatal("Start did not return after the open transaction committed")
	}
	waitModelIn(t, d, name, first, 1)
	for _, s := range others {
		waitModelIn(t, d, name, s, 2)
	}
}

// A Stop called while Start waits in its registration (for a transaction that appended and
// stays open) ends that wait: Stop returns by its deadline, Start returns an error that says
// it was stopped, and the worker stays stopped (a later Start is refused).
func TestStopDuringAStartWaitingForAnOpenAppendEndsTheStart(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := isolatedDB(t)
	open, err := d.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = open.Rollback(context.Background()) }()
	require.NoError(t, worker.Append(ctx, open, events(uuid.New(), newIDs(t, 1))...))

	w, err := worker.New(d.Pool, worker.Config{Perspectives: []worker.Perspective{newVLedger(uniqueName("stop_start"), 1)},
		Logger: quietLogger(), PollInterval: 20 * time.Millisecond})
	require.NoError(t, err)
	started := make(chan error, 1)
	go func() { started <- w.Start(ctx) }()
	time.Sleep(300 * time.Millisecond) // Start waits for the open transaction
	select {
	case err := <-started:
		t.Fatalf("Start returned while a transaction that appended was open: %v", err)
	default:
	}

	sctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	began := time.Now()
	require.NoError(t, w.Stop(sctx), "the worker never started: nothing to stop")
	require.Less(t, time.Since(began), 2*time.Second, "Stop returned by its deadline and one bounded statement")
	select {
	case err := <-started:
		require.ErrorContains(t, err, "stopped during start")
	case <-time.After(10 * time.Second):
		t.Fatal("Start did not return after Stop")
	}
	require.ErrorContains(t, w.Start(ctx), "worker was stopped")
}

// A Stop called while another Stop waits for an operation returns only once that Stop has
// returned: a caller that stops twice (a signal handler and a deferred Stop) never proceeds
// while the worker is still running. When the second Stop returns, the operation the first
// one waited for has committed.
func TestASecondStopWaitsForTheFirst(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := uniqueName("stop_twice")
	g := newGated(name)
	w, err := worker.New(testDB.Pool, worker.Config{Perspectives: []worker.Perspective{g}, Logger: quietLogger(),
		PollInterval: 20 * time.Millisecond, ListenConnect: directListen()})
	require.NoError(t, err)
	require.NoError(t, w.Start(ctx))
	stream := uuid.New()
	ids := newIDs(t, 1)
	entered, release := g.arm(ids[0])
	defer release() // if the test fails first
	require.NoError(t, worker.Append(ctx, testDB.Pool, events(stream, ids)...))
	<-entered // an operation runs, blocked in Apply

	stop := func(c chan<- error) {
		sctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		defer cancel()
		c <- w.Stop(sctx)
	}
	first, second := make(chan error, 1), make(chan error, 1)
	go stop(first)
	time.Sleep(100 * time.Millisecond) // the first Stop waits for the operation
	go stop(second)
	time.Sleep(200 * time.Millisecond)
	select {
	case err := <-second:
		t.Fatalf("the second Stop returned (%v) while the first waited for the operation", err)
	default:
	}
	release()
	require.NoError(t, <-second)
	_, applied := loadLedger(t, ctx, name, stream)
	require.True(t, applied, "the operation the first Stop waited for committed before the second Stop returned")
	require.NoError(t, <-first)
}

// A first build's catch-up over a store holding one stream longer than a page's share of one
// stream (CatchUpStreamShare) and short streams after it: the long stream's share is caught up,
// its rest handed to the normal path, and every model ends as the fold of its stream's events
// in ID order. In a database of its own: the package's other catch-ups would fold the long
// stream too.
func TestCatchUpHandsALongStreamsRestToTheQueue(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d, err := pgtest.Create(ctx, "catchup_long")
	require.NoError(t, err)
	defer d.Close()
	streams := gsStreamsDescending(4) // the long stream is the lowest ID: caught up first
	long := streams[3]
	all := map[uuid.UUID][]worker.Event{long: events(long, newIDs(t, worker.CatchUpStreamShare+200))}
	for _, s := range streams[:3] {
		all[s] = events(s, newIDs(t, 3))
	}
	for _, evs := range all {
		require.NoError(t, worker.Append(ctx, d.Pool, evs...))
	}
	name := uniqueName("long")
	startWorkerWith(t, d.Pool, worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(name)}, Logger: quietLogger()})
	for s, evs := range all {
		eventually(t, 30*time.Second, "the stream's model", func() bool {
			raw, ok, err := worker.LoadModel(ctx, d.Pool, name, s)
			require.NoError(t, err)
			var m ledger
			return ok && json.Unmarshal(raw, &m) == nil && len(m.IDs) == len(evs)
		})
		require.Equal(t, expectedLedger(t, evs), loadLedgerIn(t, d, name, s))
	}
}

// A new version whose catch-up handed the rest of a long stream to the queue is not promoted
// while those events wait: they were queued at the catch-up's end, so they look new, but
// they are the stream's history, and readers would get a partial model.
func TestABuildIsNotPromotedWhileWhatItsCatchUpQueuedWaits(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := isolatedDB(t)
	name := uniqueName("handoff")
	s := uuid.New()
	evs := events(s, newIDs(t, worker.CatchUpStreamShare+200))
	require.NoError(t, worker.Append(ctx, d.Pool, evs...))
	lcWorker(t, d, worker.Config{Perspectives: []worker.Perspective{newVLedger(name, 1)}})
	lcConverged(t, d, name, 1, 30*time.Second)

	// Version 2 applies the stream's first CatchUpStreamShare events in its catch-up; the rest
	// goes through the queue, where it waits for gate.
	gate := make(chan struct{})
	var once sync.Once
	open := func() { once.Do(func() { close(gate) }) }
	defer open()
	v2 := vledgerPerspective{v: 2, Perspective: worker.JSONPerspective(name, func(m vledger, ev worker.Event) (vledger, error) {
		if len(m.IDs) >= worker.CatchUpStreamShare {
			<-gate
		}
		m.V = 2
		m.IDs = append(m.IDs, ev.ID)
		return m, nil
	})}
	lcWorker(t, d, worker.Config{Perspectives: []worker.Perspective{v2}})
	eventually(t, 30*time.Second, "version 2's catch-up done", func() bool {
		return lcCount(t, d, `SELECT count(*) FROM wh_perspective_builds WHERE perspective_name = $1 AND version = 2 AND catchup_done`, name) == 1
	})
	time.Sleep(time.Second) // about 50 looks at the builds
	m, ok := loadVLedger(t, ctx, d, name, s)
	require.True(t, ok)
	require.Equal(t, 1, m.V, "readers keep version 1 while version 2's handed-off events wait")
	require.Len(t, m.IDs, len(evs))

	open()
	lcConverged(t, d, name, 2, 30*time.Second)
}

// Promoting a version retires, with the active build, the building builds older than it (a
// lower version, left building by instances that stopped before it caught up): left
// building, such a build took every Append's events for ever, and an instance of its version
// coming back promoted it over the newer one. A building build older than the active one
// (as a database may hold) is refused by Admin.Promote and retired, not promoted, by its
// version's workers: versions only go up.
func TestPromotionRetiresTheOlderBuildsAndVersionsOnlyGoUp(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := isolatedDB(t)
	name := uniqueName("olderv")
	s := uuid.New()
	require.NoError(t, worker.Append(ctx, d.Pool, events(s, newIDs(t, 5))...))
	lcWorker(t, d, worker.Config{Perspectives: []worker.Perspective{newVLedger(name, 1)}})
	lcConverged(t, d, name, 1, 30*time.Second)
	v2 := name + "@v2.1"
	_, err := worker.NewPGStore(d.Pool, time.Second, time.Second).Register(ctx, name, 2) // its instance stopped at once
	require.NoError(t, err)
	require.Equal(t, worker.BuildBuilding, buildState(t, ctx, d.Pool, v2))

	lcWorker(t, d, worker.Config{Perspectives: []worker.Perspective{newVLedger(name, 3)}})
	lcConverged(t, d, name, 3, 30*time.Second)
	require.Equal(t, worker.BuildRetired, buildState(t, ctx, d.Pool, name), "the active build retired")
	require.Equal(t, worker.BuildRetired, buildState(t, ctx, d.Pool, v2), "the older building build retired with it")
	require.NoError(t, worker.Append(ctx, d.Pool, events(s, newIDs(t, 3))...))
	require.Zero(t, lcCount(t, d, `SELECT count(*) FROM wh_perspective_events WHERE perspective_name = $1`, v2),
		"nothing queued for the retired build")

	// A building version 2 beside the active version 3, and a REPEATABLE READ transaction
	// whose snapshot predates its retirement.
	gsExec(t, ctx, d.Pool, `UPDATE wh_perspective_builds SET state = 'building', retired_at = NULL WHERE build_key = $1`, v2)
	admin, err := worker.NewAdmin(d.Pool, nil)
	require.NoError(t, err)
	_, err = admin.Promote(ctx, name, 2)
	require.ErrorContains(t, err, "versions only go up")
	tx, err := d.Pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.Background()) }()
	var n int
	require.NoError(t, tx.QueryRow(ctx, `SELECT count(*) FROM wh_perspective_builds`).Scan(&n)) // the snapshot
	lcWorker(t, d, worker.Config{Perspectives: []worker.Perspective{newVLedger(name, 2)}})
	eventually(t, 30*time.Second, "version 2 retired by its own workers", func() bool {
		return buildState(t, ctx, d.Pool, v2) == worker.BuildRetired
	})
	err = worker.Append(ctx, tx, events(uuid.New(), newIDs(t, 2))...)
	var pgErr *pgconn.PgError
	require.True(t, errors.As(err, &pgErr), "an Append whose snapshot predates the retirement fails: %v", err)
	require.Equal(t, "40001", pgErr.Code, "a serialization failure, to be retried: %v", err)
	require.Equal(t, worker.BuildActive, buildState(t, ctx, d.Pool, name+"@v3.1"))
	m, ok := loadVLedger(t, ctx, d, name, s)
	require.True(t, ok)
	require.Equal(t, 3, m.V, "readers keep version 3")
}

// Stop interrupts a catch-up page's fold once its context ends: the fold stops before its
// next Apply (or run of events), the page's transaction writes nothing, and Stop returns
// by its deadline plus the page's current run, with no Apply called after it returned.
func TestStopInterruptsACatchUpPagesFold(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := isolatedDB(t)
	for range 8 {
		require.NoError(t, worker.Append(ctx, d.Pool, events(uuid.New(), newIDs(t, 1000))...))
	}
	var calls atomic.Int64
	name := uniqueName("stop_fold")
	slow := worker.JSONPerspective(name, func(m ledger, ev worker.Event) (ledger, error) {
		calls.Add(1)
		time.Sleep(2 * time.Millisecond)
		return foldLedger(m, ev)
	})
	w, err := worker.New(d.Pool, worker.Config{Perspectives: []worker.Perspective{slow}, CatchUpPageSize: 8000,
		PollInterval: 20 * time.Millisecond, Logger: quietLogger()})
	require.NoError(t, err)
	require.NoError(t, w.Start(ctx))
	eventually(t, 10*time.Second, "the page's fold under way", func() bool { return calls.Load() > 100 })
	sctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	start := time.Now()
	_ = w.Stop(sctx) // its deadline passes with the page in flight
	took := time.Since(start)
	atStop := calls.Load()
	require.Less(t, took, 2*time.Second, "Stop returns by its deadline plus the page's current run")
	time.Sleep(300 * time.Millisecond)
	require.Equal(t, atStop, calls.Load(), "no Apply after Stop returned")
	require.Zero(t, lcCount(t, d, `SELECT count(*) FROM wh_perspective_models WHERE perspective_name = $1`, name),
		"the interrupted page wrote nothing")
}

// An Append to a stream of a catch-up page being folded does not wait for the page: the
// page's cursor rows are created and committed before its transaction (an Append waits for
// a cursor row that an open transaction inserted).
func TestAnAppendDoesNotWaitForACatchUpPage(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := isolatedDB(t)
	streams := gsStreamsDescending(2)
	s, u := streams[1], streams[0] // s sorts first: the page holds both
	evS, evU := events(s, newIDs(t, 20)), events(u, newIDs(t, 20))
	require.NoError(t, worker.Append(ctx, d.Pool, evS...))
	require.NoError(t, worker.Append(ctx, d.Pool, evU...))

	name := uniqueName("page_append")
	g := newGated(name)
	entered, release := g.arm(evU[5].ID) // the page open, both streams' cursor rows made
	defer release()
	lcWorker(t, d, worker.Config{Perspectives: []worker.Perspective{g}})
	select {
	case <-entered:
	case <-time.After(20 * time.Second):
		t.Fatal("the catch-up never reached the gate")
	}
	actx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	late := events(s, newIDs(t, 1))
	start := time.Now()
	require.NoError(t, worker.Append(actx, d.Pool, late...), "an Append waits for no catch-up page")
	require.Less(t, time.Since(start), time.Second)
	release()
	waitModelWithinIn(t, d, name, s, len(evS)+1)
	require.Equal(t, expectedLedger(t, append(slices.Clone(evS), late...)), loadLedgerIn(t, d, name, s))
}

// A first build's catch-up (not paced) holds up no live application of the instance's other
// perspectives, even in one slot: each of its pages after the first waits for a claim, so
// pages and claimed groups take turns.
func TestAFirstBuildsCatchUpTakesTurnsWithLiveApplication(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := isolatedDB(t)
	for range 40 {
		require.NoError(t, worker.Append(ctx, d.Pool, events(uuid.New(), newIDs(t, 100))...))
	}
	live := uniqueName("turns_live")
	a := lcWorker(t, d, worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(live)}})
	eventually(t, 30*time.Second, "the live perspective caught up", func() bool {
		return lcCount(t, d, `SELECT count(*) FROM wh_perspective_builds WHERE perspective_name = $1 AND catchup_done`, live) == 1
	})
	lcStop(t, a)
	added := uniqueName("turns_new")
	slow := worker.JSONPerspective(added, func(m ledger, ev worker.Event) (ledger, error) {
		time.Sleep(time.Millisecond)
		return foldLedger(m, ev)
	})
	lcWorker(t, d, worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(live), slow}, Concurrency: 1, CatchUpPageSize: 100})
	eventually(t, 10*time.Second, "the new perspective's catch-up under way", func() bool {
		return lcCount(t, d, `SELECT catchup_events FROM wh_perspective_builds WHERE perspective_name = $1`, added) > 0
	})
	x := uuid.New()
	start := time.Now()
	require.NoError(t, worker.Append(ctx, d.Pool, events(x, newIDs(t, 1))...))
	eventually(t, 30*time.Second, "the live perspective's new event applied", func() bool {
		_, ok, err := worker.LoadModel(ctx, d.Pool, live, x)
		require.NoError(t, err)
		return ok
	})
	took := time.Since(start)
	require.Zero(t, lcCount(t, d, `SELECT count(*) FROM wh_perspective_builds WHERE perspective_name = $1 AND catchup_done`, added),
		"applied while the catch-up (about 4 s) still ran")
	require.Less(t, took, time.Second, "a page or two, not the whole catch-up")
}

// An Append in a REPEATABLE READ transaction whose snapshot was taken before a promotion
// fails with a serialization error (to be retried) instead of queueing its events for the
// build the promotion retired, where, committed after that build's cleanup, they would be
// left for ever; the retried Append reaches the promoted build.
func TestAppendInSnapshotTransactionTakenBeforeAPromotionIsRetried(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := isolatedDB(t)
	name := uniqueName("snap_promo")
	s := uuid.New()
	require.NoError(t, worker.Append(ctx, d.Pool, events(s, newIDs(t, 3))...))
	lcWorker(t, d, worker.Config{Perspectives: []worker.Perspective{newVLedger(name, 1)}})
	lcConverged(t, d, name, 1, 30*time.Second)
	lcWorker(t, d, worker.Config{Perspectives: []worker.Perspective{newVLedger(name, 2)}, ManualPromotion: true})
	eventually(t, 30*time.Second, "version 2 caught up", func() bool {
		return lcCount(t, d, `SELECT count(*) FROM wh_perspective_builds WHERE perspective_name = $1 AND version = 2 AND catchup_done`, name) == 1
	})

	tx, err := d.Pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.Background()) }()
	var n int
	require.NoError(t, tx.QueryRow(ctx, `SELECT count(*) FROM wh_perspective_builds`).Scan(&n)) // the snapshot
	admin, err := worker.NewAdmin(d.Pool, nil)
	require.NoError(t, err)
	_, err = admin.Promote(ctx, name, 2)
	require.NoError(t, err)

	late := events(s, newIDs(t, 2))
	err = worker.Append(ctx, tx, late...)
	var pgErr *pgconn.PgError
	require.True(t, errors.As(err, &pgErr), "the Append fails: %v", err)
	require.Equal(t, "40001", pgErr.Code, "a serialization failure, which the caller retries: %v", err)
	require.NoError(t, tx.Rollback(ctx))
	require.NoError(t, pgx.BeginTxFunc(ctx, d.Pool, pgx.TxOptions{IsoLevel: pgx.RepeatableRead}, func(tx pgx.Tx) error {
		return worker.Append(ctx, tx, late...)
	}))
	require.Zero(t, lcCount(t, d, `SELECT count(*) FROM wh_perspective_events WHERE perspective_name = $1`, name),
		"nothing queued for the retired build")
	lcConverged(t, d, name, 2, 30*time.Second)
}

// A worker that stops in the middle of a catch-up lets go of its catch-up lease: another
// instance continues the catch-up at its next look at the builds, not when the lease
// expires (LockTimeout, 30 s here).
func TestAStoppedWorkerLetsGoOfItsCatchUp(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := isolatedDB(t)
	for range 20 {
		require.NoError(t, worker.Append(ctx, d.Pool, events(uuid.New(), newIDs(t, 100))...))
	}
	name := uniqueName("letgo")
	slow := worker.JSONPerspective(name, func(m ledger, ev worker.Event) (ledger, error) {
		time.Sleep(time.Millisecond)
		return foldLedger(m, ev)
	})
	cfg := worker.Config{Perspectives: []worker.Perspective{slow}, CatchUpPageSize: 100}
	first := lcWorker(t, d, cfg)
	eventually(t, 20*time.Second, "the catch-up under way", func() bool {
		return lcCount(t, d, `SELECT catchup_events FROM wh_perspective_builds WHERE perspective_name = $1`, name) > 0
	})
	lcStop(t, first)
	require.Zero(t, lcCount(t, d, `SELECT count(*) FROM wh_perspective_builds WHERE perspective_name = $1 AND catchup_done`, name),
		"stopped before the catch-up's end")
	require.Zero(t, lcCount(t, d, `SELECT count(*) FROM wh_perspective_builds WHERE perspective_name = $1 AND catchup_holder IS NOT NULL`, name),
		"its lease let go")

	second := lcWorker(t, d, cfg)
	eventually(t, 5*time.Second, "the other instance continuing the catch-up", func() bool {
		var holder uuid.UUID
		require.NoError(t, d.Pool.QueryRow(ctx, `SELECT COALESCE(catchup_holder, '00000000-0000-0000-0000-000000000000') FROM wh_perspective_builds WHERE perspective_name = $1`, name).Scan(&holder))
		return holder == second.InstanceID()
	})
}

// A poison event parked in the active version and in a new one (the new version's catch-up
// handed the stream to the queue, where it parked) does not hold the new version's
// promotion off: a parked pair waits for an operator in either version, and the new one is
// no further behind than the active one.
func TestAPairParkedInBothVersionsDoesNotHoldThePromotionOff(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := isolatedDB(t)
	name := uniqueName("park_promo")
	policy := worker.FailurePolicy{Attempts: 1}
	s := uuid.New()
	evs := events(s, newIDs(t, 3))
	evs[1].Type = "poison"
	lcWorker(t, d, worker.Config{Perspectives: []worker.Perspective{versioned(poisonPerspective(name), 1)}, FailurePolicy: policy})
	require.NoError(t, worker.Append(ctx, d.Pool, evs...))
	parked := func(v int) bool { return lcParked(t, d, name, s, v) }
	eventually(t, 20*time.Second, "version 1 parked", func() bool { return parked(1) })
	time.Sleep(1500 * time.Millisecond) // the active build's parked rows are older than the promotion's lag

	lcWorker(t, d, worker.Config{Perspectives: []worker.Perspective{versioned(poisonPerspective(name), 2)}, FailurePolicy: policy})
	eventually(t, 20*time.Second, "version 2 parked and promoted", func() bool {
		return parked(2) && lcCount(t, d, `SELECT count(*) FROM wh_perspective_builds WHERE perspective_name = $1 AND version = 2 AND state = 'active'`, name) == 1
	})
}

// A stream parked in a new version only (its new code refuses an event the active version
// applied) holds the new version's promotion off: readers would lose the stream's events.
func TestAPairParkedInTheNewVersionOnlyHoldsThePromotionOff(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := isolatedDB(t)
	name := uniqueName("park_new")
	policy := worker.FailurePolicy{Attempts: 1}
	s := uuid.New()
	evs := events(s, newIDs(t, 3))
	evs[1].Type = "poison"
	lcWorker(t, d, worker.Config{Perspectives: []worker.Perspective{versioned(ledgerPerspective(name), 1)}, FailurePolicy: policy})
	require.NoError(t, worker.Append(ctx, d.Pool, evs...))
	waitModelWithinIn(t, d, name, s, 3)

	lcWorker(t, d, worker.Config{Perspectives: []worker.Perspective{versioned(poisonPerspective(name), 2)}, FailurePolicy: policy})
	eventually(t, 20*time.Second, "version 2 caught up, the stream parked in it", func() bool {
		return lcParked(t, d, name, s, 2) &&
			lcCount(t, d, `SELECT count(*) FROM wh_perspective_builds WHERE perspective_name = $1 AND version = 2 AND catchup_done`, name) == 1
	})
	time.Sleep(2 * time.Second) // many looks at the builds
	require.Zero(t, lcCount(t, d, `SELECT count(*) FROM wh_perspective_builds WHERE perspective_name = $1 AND version = 2 AND state = 'active'`, name),
		"not promoted")
	waitModelWithinIn(t, d, name, s, 3)
}

// waitModelWithinIn waits for the ledger model of stream in name's active build on d to
// hold n events.
func waitModelWithinIn(t *testing.T, d *pgtest.DB, name string, stream uuid.UUID, n int) {
	t.Helper()
	eventually(t, 20*time.Second, "the model's events", func() bool {
		raw, ok, err := worker.LoadModel(context.Background(), d.Pool, name, stream)
		require.NoError(t, err)
		var m ledger
		return ok && json.Unmarshal(raw, &m) == nil && len(m.IDs) == n
	})
}

// lcParked says whether stream is parked in version v of name on d.
func lcParked(t *testing.T, d *pgtest.DB, name string, stream uuid.UUID, v int) bool {
	t.Helper()
	return lcCount(t, d, `SELECT count(*) FROM wh_perspective_cursors c JOIN wh_perspective_builds b ON b.build_key = c.perspective_name
		WHERE c.stream_id = $1 AND b.perspective_name = $2 AND b.version = $3 AND c.status = 'parked'`, stream, name, v) == 1
}
