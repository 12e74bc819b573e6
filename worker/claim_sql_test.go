package worker_test

// Tests of the claim's SQL (queries/claim.sql, wh_append and wh_pairs_release of
// schema/000008_due_pairs.up.sql) against the package's PostgreSQL: a pair's due row is made
// by Append and kept at its earliest due time, a claim leases the oldest due pairs once each
// and never waits, a release ends the leases without ever leaving a queued event without a due
// row, and an operator's action on a pair writes one due row whatever the pair's backlog.

import (
	"bytes"
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/db"
	"github.com/perspectives-go/perspectives/internal/pgq"
	"github.com/perspectives-go/perspectives/internal/pgtest"
	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/worker"
)

// csClaim runs PairsClaim for instance on the builds, and returns the pairs it leased and
// when the next pair not due yet becomes due.
func csClaim(t *testing.T, ctx context.Context, q db.DBTX, instance uuid.UUID, limit int, keys ...string) ([]gsPair, *time.Time) {
	t.Helper()
	rows, err := pgq.New(q).PairsClaim(ctx, db.PairsClaimParams{
		InstanceID: instance, BuildKeys: keys, MaxPairs: int32(limit), LeaseSeconds: 30,
	})
	require.NoError(t, err)
	var out []gsPair
	var next *time.Time
	for _, r := range rows {
		if r.StreamID == uuid.Nil {
			next = &r.DueAt
			continue
		}
		require.Equal(t, instance, r.LeasedBy.UUID)
		out = append(out, gsPair{r.StreamID, r.PerspectiveName})
	}
	return out, next
}

// csRelease releases the pairs as instance's jobs do (Store.Release): each due at its oldest
// event, or after the wait later gives it.
func csRelease(t *testing.T, ctx context.Context, instance uuid.UUID, later map[gsPair]time.Duration, pairs ...gsPair) {
	t.Helper()
	req := worker.ReleaseRequest{Instance: instance, Later: map[worker.Pair]time.Duration{}}
	for _, p := range pairs {
		req.Pairs = append(req.Pairs, worker.Pair{Stream: p.Stream, Perspective: p.Name})
	}
	for p, d := range later {
		req.Later[worker.Pair{Stream: p.Stream, Perspective: p.Name}] = d
	}
	require.NoError(t, worker.NewPGStore(testDB.Pool, time.Second, time.Second).Release(ctx, req))
}

// Append gives each pair one due row, however many Appends queue for it, due at the first;
// a claim leases the oldest due pairs first, each once, up to its limit, moving their due time
// to the lease's end; the next claim takes the next ones.
func TestClaimSQLLeasesTheOldestDuePairsOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := gsRegister(t, ctx, "cs_order")
	streams := gsStreamsDescending(4) // the oldest rows are not the lowest stream IDs
	for _, s := range streams {
		gsAppend(t, ctx, s, 1)
	}
	gsAppend(t, ctx, streams[0], 3) // more rows for the oldest pair: still one row, still first
	gsSeal(t, ctx, []string{name}, streams...)
	var rows int
	require.NoError(t, testDB.Pool.QueryRow(ctx, `SELECT count(*) FROM wh_perspective_pairs WHERE perspective_name = $1`, name).Scan(&rows))
	require.Equal(t, 4, rows, "one due row per pair")

	me := uuid.New()
	first, _ := csClaim(t, ctx, testDB.Pool, me, 2, name)
	require.ElementsMatch(t, []gsPair{{streams[0], name}, {streams[1], name}}, first, "the two oldest")
	var now time.Time
	require.NoError(t, testDB.Pool.QueryRow(ctx, `SELECT now()`).Scan(&now))
	for _, p := range first {
		d := gsDue(t, ctx, p)
		require.Equal(t, me, d.LeasedBy)
		require.True(t, d.DueAt.After(now.Add(25*time.Second)), "due again when the lease lapses: %v", d.DueAt)
	}
	second, next := csClaim(t, ctx, testDB.Pool, uuid.New(), 10, name)
	require.ElementsMatch(t, []gsPair{{streams[2], name}, {streams[3], name}}, second, "the rest, not the leased ones")
	require.NotNil(t, next, "the first lease's end is the next due time")
	third, _ := csClaim(t, ctx, testDB.Pool, uuid.New(), 10, name)
	require.Empty(t, third)
}

// Leased returns the pairs whose due rows an instance leases, and no other's, and not a
// lease that lapsed (its pair is due): after its release, none.
func TestClaimSQLLeasedReturnsTheInstancesLeasesOnly(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := gsRegister(t, ctx, "cs_leased")
	streams := gsStreamsDescending(3)
	for _, s := range streams {
		gsAppend(t, ctx, s, 1)
	}
	gsSeal(t, ctx, []string{name}, streams...)
	me, other := uuid.New(), uuid.New()
	mine, _ := csClaim(t, ctx, testDB.Pool, me, 2, name)
	require.Len(t, mine, 2)
	theirs, _ := csClaim(t, ctx, testDB.Pool, other, 10, name)
	require.Len(t, theirs, 1)
	store := worker.NewPGStore(testDB.Pool, time.Second, time.Second)
	asPairs := func(ps []gsPair) []worker.Pair {
		var out []worker.Pair
		for _, p := range ps {
			out = append(out, worker.Pair{Stream: p.Stream, Perspective: p.Name})
		}
		return out
	}
	leased, err := store.Leased(ctx, me)
	require.NoError(t, err)
	require.ElementsMatch(t, asPairs(mine), leased, "its own leases")
	leased, err = store.Leased(ctx, other)
	require.NoError(t, err)
	require.ElementsMatch(t, asPairs(theirs), leased)
	// One of its leases lapses: its row is due now, still marked as its.
	require.EqualValues(t, 1, gsExec(t, ctx, testDB.Pool, `UPDATE wh_perspective_pairs SET due_at = now() - interval '1 second'
		WHERE stream_id = $1 AND perspective_name = $2 AND leased_by = $3`, mine[0].Stream, mine[0].Name, me))
	leased, err = store.Leased(ctx, me)
	require.NoError(t, err)
	require.ElementsMatch(t, asPairs(mine[1:]), leased, "a lapsed lease is not read")
	csRelease(t, ctx, me, nil, mine...)
	leased, err = store.Leased(ctx, me)
	require.NoError(t, err)
	require.Empty(t, leased, "none once released")
}

// A claim skips pairs under an unexpired stream lock (anyone's), pairs backing off, parked
// pairs, pairs of builds it was not asked for and pairs whose build's catch-up has not passed
// their stream; it reports when the backoff ends (not the parked pair: never).
func TestClaimSQLSkipsLockedBackingOffParkedAndWaitingPairs(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := gsRegister(t, ctx, "cs_skip")
	other := gsRegister(t, ctx, "cs_skip_other")
	locked, expired, backing, parked, free := uuid.New(), uuid.New(), uuid.New(), uuid.New(), uuid.New()
	for _, s := range []uuid.UUID{locked, expired, backing, parked, free} {
		gsAppend(t, ctx, s, 1)
	}
	gsSeal(t, ctx, []string{name}, locked, expired, backing, parked, free)
	gsExec(t, ctx, testDB.Pool, `UPDATE wh_perspective_cursors SET stream_lock_instance_id = $2,
		stream_lock_expiry = now() + interval '1 minute', stream_lock_reason = 'rewind'
		WHERE stream_id = $1 AND perspective_name = $3`, locked, uuid.New(), name)
	gsExec(t, ctx, testDB.Pool, `UPDATE wh_perspective_cursors SET stream_lock_instance_id = $2,
		stream_lock_expiry = now() - interval '1 second', stream_lock_reason = 'rewind'
		WHERE stream_id = $1 AND perspective_name = $3`, expired, uuid.New(), name)
	var backoffEnds time.Time
	require.NoError(t, testDB.Pool.QueryRow(ctx, `UPDATE wh_perspective_pairs SET due_at = now() + interval '1 hour'
		WHERE stream_id = $1 AND perspective_name = $2 RETURNING due_at`, backing, name).Scan(&backoffEnds))
	gsExec(t, ctx, testDB.Pool, `UPDATE wh_perspective_pairs SET due_at = 'infinity'
		WHERE stream_id = $1 AND perspective_name = $2`, parked, name)

	got, next := csClaim(t, ctx, testDB.Pool, uuid.New(), 100, name)
	require.ElementsMatch(t, []gsPair{{expired, name}, {free, name}}, got)
	require.NotNil(t, next)
	require.True(t, next.Equal(backoffEnds), "the backoff's end, %v, not %v", backoffEnds, *next)

	// A build whose catch-up is at free's stream: its pairs from that stream on wait.
	gsExec(t, ctx, testDB.Pool, `UPDATE wh_perspective_builds SET catchup_done = false, catchup_stream_id = $2
		WHERE build_key = $1`, other, free)
	waiting, _ := csClaim(t, ctx, testDB.Pool, uuid.New(), 100, other)
	for _, p := range waiting {
		require.Less(t, p.Stream.String(), free.String(), "only the streams the catch-up has passed")
	}
}

// A claim never waits for another transaction: a due row another claim is leasing (locked,
// not committed) is skipped, and so is nothing else.
func TestClaimSQLSkipsRowsAnotherClaimHolds(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := gsRegister(t, ctx, "cs_held")
	a, b := uuid.New(), uuid.New()
	gsAppend(t, ctx, a, 1)
	gsAppend(t, ctx, b, 1)
	gsSeal(t, ctx, []string{name}, a, b)
	holder := gsBegin(t, ctx)
	held, _ := csClaim(t, ctx, holder, uuid.New(), 1, name) // leasing the oldest, not committed
	require.Len(t, held, 1)
	tx := gsBeginNoWait(t, ctx)
	got, _ := csClaim(t, ctx, tx, uuid.New(), 10, name)
	require.Len(t, got, 1, "the other pair, at once")
	require.NotEqual(t, held[0], got[0])
}

// A release ends the caller's leases: a pair with nothing queued loses its row, the others
// are due at their oldest queued event (or after the wait given), and a lease another
// instance holds now is left alone.
func TestClaimSQLReleaseDeletesEmptyPairsAndMakesTheRestDue(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := gsRegister(t, ctx, "cs_release")
	empty, left, later, taken := uuid.New(), uuid.New(), uuid.New(), uuid.New()
	for _, s := range []uuid.UUID{empty, left, later, taken} {
		gsAppend(t, ctx, s, 2)
	}
	gsSeal(t, ctx, []string{name}, empty, left, later, taken)
	me := uuid.New()
	claimed, _ := csClaim(t, ctx, testDB.Pool, me, 10, name)
	require.Len(t, claimed, 4)
	gsExec(t, ctx, testDB.Pool, `DELETE FROM wh_perspective_events WHERE stream_id = $1 AND perspective_name = $2`, empty, name)
	var oldest time.Time
	require.NoError(t, testDB.Pool.QueryRow(ctx, `SELECT min(enqueued_at) FROM wh_perspective_events
		WHERE stream_id = $1 AND perspective_name = $2`, left, name).Scan(&oldest))
	gsExec(t, ctx, testDB.Pool, `UPDATE wh_perspective_pairs SET leased_by = $3
		WHERE stream_id = $1 AND perspective_name = $2`, taken, name, uuid.New()) // this lease lapsed and was taken
	takenBefore := gsDue(t, ctx, gsPair{taken, name})

	var before time.Time
	require.NoError(t, testDB.Pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&before))
	csRelease(t, ctx, me, map[gsPair]time.Duration{{later, name}: time.Minute},
		gsPair{empty, name}, gsPair{left, name}, gsPair{later, name}, gsPair{taken, name})

	require.False(t, gsDue(t, ctx, gsPair{empty, name}).Exists, "nothing queued: no due row")
	d := gsDue(t, ctx, gsPair{left, name})
	require.True(t, d.Exists && d.DueAt.Equal(oldest) && d.LeasedBy == uuid.Nil, "due at its oldest queued event %v, not leased: %+v", oldest, d)
	d = gsDue(t, ctx, gsPair{later, name})
	require.Equal(t, uuid.Nil, d.LeasedBy)
	require.True(t, d.DueAt.Sub(before) >= time.Minute-time.Second && d.DueAt.Sub(before) < time.Minute+5*time.Second, "due in a minute: %v", d.DueAt.Sub(before))
	require.Equal(t, takenBefore, gsDue(t, ctx, gsPair{taken, name}), "another instance's lease is its own")
}

// A release never leaves a queued event without a due row: an Append still queueing for the
// pair (its transaction open) holds the due row, so the release, which finds the pair's queue
// empty, leaves the row, without waiting for the Append; once the Append commits, the pair is
// claimed. An Append that begins after a release deleted the row makes it again.
func TestClaimSQLReleaseRacingAnAppendLeavesTheDueRow(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := gsRegister(t, ctx, "cs_race")
	s := uuid.New()
	p := gsPair{s, name}
	me := uuid.New()
	lease := func() {
		t.Helper()
		require.EqualValues(t, 1, gsExec(t, ctx, testDB.Pool, `UPDATE wh_perspective_pairs SET leased_by = $3, due_at = now() + interval '30 seconds'
			WHERE stream_id = $1 AND perspective_name = $2`, s, name, me))
		// its job applied every queued event
		gsExec(t, ctx, testDB.Pool, `DELETE FROM wh_perspective_events WHERE stream_id = $1 AND perspective_name = $2`, s, name)
	}
	gsAppend(t, ctx, s, 1)
	lease()

	appending := gsBegin(t, ctx)
	require.NoError(t, worker.Append(ctx, appending, events(s, newIDs(t, 1))...))
	releasing := gsBeginNoWait(t, ctx) // fails rather than wait for the Append
	streams, names := gsArrays(p)
	require.NoError(t, pgq.New(releasing).PairsRelease(ctx, db.PairsReleaseParams{
		InstanceID: me, StreamIds: streams, PerspectiveNames: names, Delays: []float64{-1},
	}))
	require.NoError(t, releasing.Commit(ctx))
	d := gsDue(t, ctx, p)
	require.True(t, d.Exists, "the row an Append in flight holds is not deleted")
	require.Equal(t, uuid.Nil, d.LeasedBy, "but its lease ended")
	require.NoError(t, appending.Commit(ctx))
	require.Len(t, queued(t, ctx, name, s), 1)
	got, _ := csClaim(t, ctx, testDB.Pool, uuid.New(), 1000, name)
	require.Contains(t, got, p, "due: claimed without a poll's wait")

	lease()
	csRelease(t, ctx, me, nil, p)
	require.False(t, gsDue(t, ctx, p).Exists, "no Append in flight: the empty pair's row goes")
	gsAppend(t, ctx, s, 1)
	d = gsDue(t, ctx, p)
	require.True(t, d.Exists && d.LeasedBy == uuid.Nil, "made again by the next Append: %+v", d)
}

// A stream queued again for a pair (queueStream: an operator's rebuild of the stream, a
// catch-up's hand-off) holds the pair's due row until it commits, as an Append does: a
// release racing it (the pair's last job, its queue empty as that release sees it) neither
// deletes the row nor waits for the queueing to end, and once both have committed the
// queued events have a due row.
func TestClaimSQLReleaseRacingAQueueingOfTheStreamLeavesTheDueRow(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := gsRegister(t, ctx, "cs_requeue")
	s := uuid.New()
	p := gsPair{s, name}
	me := uuid.New()
	gsAppend(t, ctx, s, 2)
	// Its job applied every queued event and is about to release its lease.
	require.EqualValues(t, 1, gsExec(t, ctx, testDB.Pool, `UPDATE wh_perspective_pairs SET leased_by = $3, due_at = now() + interval '30 seconds'
		WHERE stream_id = $1 AND perspective_name = $2`, s, name, me))
	gsExec(t, ctx, testDB.Pool, `DELETE FROM wh_perspective_events WHERE stream_id = $1 AND perspective_name = $2`, s, name)

	queueing := gsBegin(t, ctx)
	n, err := worker.QueueStream(ctx, pgq.New(queueing), worker.Pair{Stream: s, Perspective: name}, uuid.Nil)
	require.NoError(t, err)
	require.EqualValues(t, 2, n)
	released := make(chan error, 1)
	go func() {
		streams, names := gsArrays(p)
		released <- pgq.New(testDB.Pool).PairsRelease(ctx, db.PairsReleaseParams{
			InstanceID: me, StreamIds: streams, PerspectiveNames: names, Delays: []float64{-1},
		})
	}()
	select {
	case err := <-released:
		require.NoError(t, err)
	case <-time.After(2 * time.Second):
		t.Fatal("the release waited for the queueing transaction")
	}
	require.NoError(t, queueing.Commit(ctx))
	require.Len(t, queued(t, ctx, name, s), 2)
	d := gsDue(t, ctx, p)
	require.True(t, d.Exists, "the queued events have a due row")
	require.Equal(t, uuid.Nil, d.LeasedBy, "the lease ended")
	got, _ := csClaim(t, ctx, testDB.Pool, uuid.New(), 1000, name)
	require.Contains(t, got, p, "due: claimed without a poll's wait")
}

// Concurrent Appends to one pair and releases of it, in any interleaving, leave a due row
// whenever an event is queued.
func TestClaimSQLConcurrentAppendsAndReleasesNeverLoseTheDueRow(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := gsRegister(t, ctx, "cs_storm")
	s := uuid.New()
	p := gsPair{s, name}
	me := uuid.New()
	var wg sync.WaitGroup
	stop := make(chan struct{})
	wg.Add(1)
	go func() { // the worker: lease, apply everything queued, release
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			_, _ = testDB.Pool.Exec(ctx, `UPDATE wh_perspective_pairs SET leased_by = $3
				WHERE stream_id = $1 AND perspective_name = $2`, s, name, me)
			_, _ = testDB.Pool.Exec(ctx, `DELETE FROM wh_perspective_events WHERE stream_id = $1 AND perspective_name = $2`, s, name)
			_, _ = testDB.Pool.Exec(ctx, `SELECT wh_pairs_release($1, ARRAY[$2::uuid], ARRAY[$3::text], ARRAY[-1::float8])`, me, s, name)
		}
	}()
	for range 200 {
		require.NoError(t, worker.Append(ctx, testDB.Pool, events(s, newIDs(t, 1))...))
	}
	close(stop)
	wg.Wait()
	if len(queued(t, ctx, name, s)) > 0 {
		require.True(t, gsDue(t, ctx, p).Exists, "events queued without a due row")
	}
	// Whatever the last release did, an Append now leaves the pair due.
	gsAppend(t, ctx, s, 1)
	require.True(t, gsDue(t, ctx, p).Exists)
}

// Appending to a pair keeps its due row's earlier due time: a backoff stays, and a parked pair
// stays parked, but an event that sorts before its failing one (a late event) makes it due
// now.
func TestClaimSQLAppendKeepsTheDueTimeButALateEventWakesAParkedPair(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := gsRegister(t, ctx, "cs_keep")
	backing, parked := uuid.New(), uuid.New()
	gsAppend(t, ctx, backing, 1)
	early := newIDs(t, 1) // sorts before the parked pair's events
	pids := gsAppend(t, ctx, parked, 2)
	var backoffEnds time.Time
	require.NoError(t, testDB.Pool.QueryRow(ctx, `UPDATE wh_perspective_pairs SET due_at = now() + interval '1 hour'
		WHERE stream_id = $1 AND perspective_name = $2 RETURNING due_at`, backing, name).Scan(&backoffEnds))
	gsExec(t, ctx, testDB.Pool, `UPDATE wh_perspective_pairs SET due_at = 'infinity' WHERE stream_id = $1 AND perspective_name = $2`, parked, name)
	gsExec(t, ctx, testDB.Pool, `UPDATE wh_perspective_cursors SET status = 'parked', failed_event_id = $3, attempts = 3
		WHERE stream_id = $1 AND perspective_name = $2`, parked, name, pids[0])

	gsAppend(t, ctx, backing, 1)
	gsAppend(t, ctx, parked, 1)
	require.True(t, gsDue(t, ctx, gsPair{backing, name}).DueAt.Equal(backoffEnds), "the backoff stays")
	require.True(t, gsDue(t, ctx, gsPair{parked, name}).Parked, "a later event waits with the parked pair")

	require.NoError(t, worker.Append(ctx, testDB.Pool, events(parked, early)...))
	d := gsDue(t, ctx, gsPair{parked, name})
	require.False(t, d.Parked, "the late event is applied now")
	var now time.Time
	require.NoError(t, testDB.Pool.QueryRow(ctx, `SELECT now()`).Scan(&now))
	require.False(t, d.DueAt.After(now))
}

// An operator's action on a pair, or a failure's record, writes the pair's cursor and due row
// only: no queued event row, whatever the backlog. Counted in the transaction's own statistics
// (pg_stat_get_xact_tuples_*) for a pair with 1 and with 2,000 queued events: the same. In a
// database of its own: streams of thousands of events in the package's database would make
// every other test's catch-up fold them.
func TestClaimSQLOperatorActionsWriteOneRowWhateverTheBacklog(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d, err := pgtest.Create(ctx, "claim_o1")
	require.NoError(t, err)
	defer d.Close()
	const name = "cs_o1"
	gsExec(t, ctx, d.Pool, `INSERT INTO wh_perspectives (perspective_name) VALUES ($1)`, name)
	gsExec(t, ctx, d.Pool, `INSERT INTO wh_perspective_builds (build_key, perspective_name, version, build, state, catchup_done)
		VALUES ($1, $1, 1, 1, 'active', true)`, name)
	type counts struct{ queueWritten, pairsWritten, cursorsWritten int64 }
	measure := func(backlog int, action string) counts {
		t.Helper()
		s := uuid.New()
		ids := newIDs(t, backlog)
		require.NoError(t, worker.Append(ctx, d.Pool, events(s, ids)...))
		gsExec(t, ctx, d.Pool, `UPDATE wh_perspective_cursors SET status = 'parked', failed_event_id = $3, attempts = 3
			WHERE stream_id = $1 AND perspective_name = $2`, s, name, ids[0])
		gsExec(t, ctx, d.Pool, `UPDATE wh_perspective_pairs SET due_at = 'infinity' WHERE stream_id = $1 AND perspective_name = $2`, s, name)
		tx, err := d.Pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = tx.Rollback(context.Background()) }()
		q := pgq.New(tx)
		// The counts so far (PostgreSQL 15 keeps a backend's counts pending across
		// transactions until it reports them): the action's are the difference.
		written := func() counts {
			var c counts
			require.NoError(t, tx.QueryRow(ctx, `SELECT
				pg_stat_get_xact_tuples_updated('wh_perspective_events'::regclass) + pg_stat_get_xact_tuples_inserted('wh_perspective_events'::regclass),
				pg_stat_get_xact_tuples_updated('wh_perspective_pairs'::regclass) + pg_stat_get_xact_tuples_inserted('wh_perspective_pairs'::regclass),
				pg_stat_get_xact_tuples_updated('wh_perspective_cursors'::regclass)`).Scan(&c.queueWritten, &c.pairsWritten, &c.cursorsWritten))
			return c
		}
		before := written()
		switch action {
		case "retry":
			_, err = q.PairsRetry(ctx, db.PairsRetryParams{PerspectiveName: name, StreamID: uuid.NullUUID{UUID: s, Valid: true}})
		case "skip":
			_, err = q.EventSkip(ctx, db.EventSkipParams{StreamID: s, BuildKeys: []string{name}, EventID: ids[0], SkippedBy: "op"})
		case "park", "backoff":
			a := map[string]string{"park": "park", "backoff": "retry"}[action]
			_, err = q.PairsMarkFailed(ctx, db.PairsMarkFailedParams{StreamIds: []uuid.UUID{s}, PerspectiveNames: []string{name},
				Errors: []string{"e"}, EventIds: []uuid.UUID{ids[0]}, Actions: []string{a}, BaseSeconds: 1, MaxSeconds: 2, SkippedBy: "w"})
		case "purge":
			err = q.CursorReset(ctx, db.CursorResetParams{StreamID: s, PerspectiveName: name})
		}
		require.NoError(t, err, action)
		after := written()
		require.NoError(t, tx.Commit(ctx))
		return counts{after.queueWritten - before.queueWritten, after.pairsWritten - before.pairsWritten,
			after.cursorsWritten - before.cursorsWritten}
	}
	for _, action := range []string{"retry", "skip", "park", "backoff", "purge"} {
		small, large := measure(1, action), measure(2000, action)
		require.Equal(t, small, large, "%s: the same rows written for 1 and 2,000 queued events", action)
		require.Zero(t, large.queueWritten, "%s: no queued event row written", action)
		require.LessOrEqual(t, large.pairsWritten, int64(1), "%s: at most the pair's due row", action)
	}
}

// gsStreamsDescending returns n new stream IDs, highest first: appended in this order, the
// oldest rows are not the lowest stream IDs.
func gsStreamsDescending(n int) []uuid.UUID {
	out := make([]uuid.UUID, n)
	for i := range out {
		out[i] = uuid.New()
	}
	slices.SortFunc(out, func(a, b uuid.UUID) int { return bytes.Compare(b[:], a[:]) })
	return out
}

// Every statement that makes a pair due tells the listening workers (wh_perspective_events, on
// commit), and leaves the pair claimable at once: an Append, a purge of a parked pair, a
// rebuild of a stream, an operator's retry and skip. So no pair made due waits for a poll. In
// a database of its own, whose only notifications are the test's.
func TestClaimSQLStatementsMakingPairsDueWakeTheWorkers(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d, err := pgtest.Create(ctx, "claim_wake")
	require.NoError(t, err)
	defer d.Close()
	const name = "cs_wake"
	gsExec(t, ctx, d.Pool, `INSERT INTO wh_perspectives (perspective_name) VALUES ($1)`, name)
	gsExec(t, ctx, d.Pool, `INSERT INTO wh_perspective_builds (build_key, perspective_name, version, build, state, catchup_done)
		VALUES ($1, $1, 1, 1, 'active', true)`, name)
	listener := gsListener(t, ctx, d.DirectURL)
	admin, err := worker.NewAdmin(d.Pool, nil)
	require.NoError(t, err)
	me := uuid.New()
	// woken requires a notification, and that the pair is claimable now.
	woken := func(what string, s uuid.UUID) {
		t.Helper()
		wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		_, err := listener.WaitForNotification(wctx)
		require.NoError(t, err, "%s: the workers are told", what)
		got, _ := csClaim(t, ctx, d.Pool, me, 100, name)
		require.Contains(t, got, gsPair{s, name}, "%s: the pair is claimable at once", what)
		for { // what else this step sent
			wctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
			_, err := listener.WaitForNotification(wctx)
			cancel()
			if err != nil {
				return
			}
		}
	}
	park := func(s uuid.UUID, failing uuid.UUID) {
		t.Helper()
		gsExec(t, ctx, d.Pool, `UPDATE wh_perspective_cursors SET status = 'parked', failed_event_id = $3, attempts = 3
			WHERE stream_id = $1 AND perspective_name = $2`, s, name, failing)
		require.EqualValues(t, 1, gsExec(t, ctx, d.Pool, `UPDATE wh_perspective_pairs SET due_at = 'infinity', leased_by = NULL
			WHERE stream_id = $1 AND perspective_name = $2`, s, name))
	}

	appended := uuid.New()
	require.NoError(t, worker.Append(ctx, d.Pool, events(appended, newIDs(t, 2))...))
	woken("an Append", appended)

	purged := uuid.New()
	ids := newIDs(t, 2)
	require.NoError(t, worker.Append(ctx, d.Pool, events(purged, ids)...))
	woken("its Append", purged)
	park(purged, ids[0])
	require.NoError(t, admin.Purge(ctx, purged, name))
	woken("a purge", purged)

	rebuilt := uuid.New()
	require.NoError(t, worker.Append(ctx, d.Pool, events(rebuilt, newIDs(t, 2))...))
	woken("its Append", rebuilt)
	gsExec(t, ctx, d.Pool, `DELETE FROM wh_perspective_events WHERE stream_id = $1`, rebuilt)
	gsExec(t, ctx, d.Pool, `DELETE FROM wh_perspective_pairs WHERE stream_id = $1`, rebuilt)
	n, err := admin.Rebuild(ctx, rebuilt, name)
	require.NoError(t, err)
	require.EqualValues(t, 2, n)
	woken("a rebuild", rebuilt)

	retried := uuid.New()
	ids = newIDs(t, 2)
	require.NoError(t, worker.Append(ctx, d.Pool, events(retried, ids)...))
	woken("its Append", retried)
	park(retried, ids[0])
	r, err := admin.Retry(ctx, retried, name)
	require.NoError(t, err)
	require.Equal(t, 1, r)
	woken("a retry", retried)

	skipped := uuid.New()
	ids = newIDs(t, 2)
	require.NoError(t, worker.Append(ctx, d.Pool, events(skipped, ids)...))
	woken("its Append", skipped)
	park(skipped, ids[0])
	_, err = admin.Skip(ctx, skipped, name, ids[0], "alice")
	require.NoError(t, err)
	woken("a skip", skipped)
}

// slowRelease is a Postgres locker whose Release waits a while first: the claims that a
// stream-locked operation's commit triggers surely run while its lock is still held.
type slowRelease struct{ *locker.Postgres }

func (l slowRelease) Release(ctx context.Context, stream uuid.UUID, name string, instance uuid.UUID) error {
	time.Sleep(300 * time.Millisecond)
	return l.Postgres.Release(ctx, stream, name, instance)
}

// An operator's rebuild of a stream queues its events under the stream lock, which keeps the
// claims off the pair; once the lock is released the workers are told, and the worker applies
// the stream at once, not at its next poll (an hour away here).
func TestAdminRebuildWakesTheWorkersOnceItsLockIsReleased(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := uniqueName("rebuild_wake")
	startWorker(t, worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(name)}, PollInterval: time.Hour})
	stream := uuid.New()
	ids := newIDs(t, 3)
	require.NoError(t, worker.Append(ctx, testDB.Pool, events(stream, ids)...))
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	require.NoError(t, worker.WaitFor(wctx, testDB.Pool, name, stream, ids[2]))

	lk, err := locker.NewPostgres(testDB.Pool, locker.Options{})
	require.NoError(t, err)
	admin, err := worker.NewAdmin(testDB.Pool, slowRelease{lk})
	require.NoError(t, err)
	n, err := admin.Rebuild(ctx, stream, name)
	require.NoError(t, err)
	require.EqualValues(t, 3, n)
	wctx, cancel = context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	require.NoError(t, worker.WaitFor(wctx, testDB.Pool, name, stream, ids[2]), "rebuilt without waiting for a poll")
}

// A worker's purge of a parked pair makes its queued events due under the stream lock, which
// keeps the claims off the pair; once the lock is released the worker claims the pair at
// once, not at its next poll (an hour away here): its poison event is tried again from a
// fresh count and the pair parks anew (a purge deletes the model; it queues nothing again).
func TestWorkerPurgeClaimsThePairOnceItsLockIsReleased(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := uniqueName("purge_wake")
	lk, err := locker.NewPostgres(testDB.Pool, locker.Options{})
	require.NoError(t, err)
	cfg := fastFailures(name, worker.FailurePolicy{Attempts: 2})
	cfg.PollInterval, cfg.Locker = time.Hour, slowRelease{lk}
	w := startWorker(t, cfg)
	admin := newAdmin(t)
	stream := uuid.New()
	evs := events(stream, newIDs(t, 3))
	evs[1].Type = "poison"
	require.NoError(t, worker.Append(ctx, testDB.Pool, evs...))
	before := waitParked(t, admin, name, stream, 2)

	require.NoError(t, w.Purge(ctx, stream, name))
	_, found := loadLedger(t, ctx, name, stream)
	require.False(t, found, "purged")
	eventually(t, 10*time.Second, "the pair tried again and parked anew", func() bool {
		fp := failedPair(t, admin, name, stream)
		return fp != nil && fp.Parked && fp.Since.After(before.Since)
	})
}
