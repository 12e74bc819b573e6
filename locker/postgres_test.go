package locker_test

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/locker"
)

const perspective = "OrderSummary"

// ---------------------------------------------------------------------------------------
// The original suite (Whizbang's DapperPerspectiveStreamLockerTests).
// ---------------------------------------------------------------------------------------

func TestTryAcquireFreePair(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	l := newLocker(t, locker.Options{})
	stream, inst := uuid.New(), uuid.New()
	insertCursor(t, stream, perspective)

	ok, err := l.TryAcquire(ctx, stream, perspective, inst, locker.ReasonRewind)
	require.NoError(t, err)
	require.True(t, ok)
	requireHeldBy(t, stream, perspective, inst, locker.ReasonRewind)
}

func TestTryAcquireHeldByAnotherInstanceIsRefused(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	l := newLocker(t, locker.Options{})
	stream, first, second := uuid.New(), uuid.New(), uuid.New()

	ok, err := l.TryAcquire(ctx, stream, perspective, first, locker.ReasonRewind)
	require.NoError(t, err)
	require.True(t, ok)
	before := readLock(t, stream, perspective)

	ok, err = l.TryAcquire(ctx, stream, perspective, second, locker.ReasonPurge)
	require.NoError(t, err)
	require.False(t, ok, "a lock held by another instance must be refused")

	after := requireHeldBy(t, stream, perspective, first, locker.ReasonRewind)
	require.True(t, before.Expiry.Equal(*after.Expiry), "the refused attempt must not touch the expiry")
}

func TestTryAcquireSameInstanceRefreshes(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	l := newLocker(t, locker.Options{})
	stream, inst := uuid.New(), uuid.New()

	ok, err := l.TryAcquire(ctx, stream, perspective, inst, locker.ReasonBootstrap)
	require.NoError(t, err)
	require.True(t, ok)
	setExpiry(t, stream, perspective, "1 second")
	require.Less(t, secondsLeft(t, stream, perspective), 1.5)

	ok, err = l.TryAcquire(ctx, stream, perspective, inst, locker.ReasonRewind)
	require.NoError(t, err)
	require.True(t, ok, "the holder re-acquiring its own lock must succeed")
	requireHeldBy(t, stream, perspective, inst, locker.ReasonRewind)
	requireSecondsLeft(t, stream, perspective, locker.DefaultLockTimeout)
}

func TestTryAcquireTakesOverExpiredLock(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	l := newLocker(t, locker.Options{})
	stream, first, second := uuid.New(), uuid.New(), uuid.New()

	ok, err := l.TryAcquire(ctx, stream, perspective, first, locker.ReasonRewind)
	require.NoError(t, err)
	require.True(t, ok)
	setExpiry(t, stream, perspective, "-1 second")

	ok, err = l.TryAcquire(ctx, stream, perspective, second, locker.ReasonPurge)
	require.NoError(t, err)
	require.True(t, ok, "an expired lock must be taken over")
	requireHeldBy(t, stream, perspective, second, locker.ReasonPurge)
	requireSecondsLeft(t, stream, perspective, locker.DefaultLockTimeout)

	// The previous holder has lost it: it can neither renew nor re-take it.
	held, err := l.Renew(ctx, stream, perspective, first)
	require.NoError(t, err)
	require.False(t, held)
	ok, err = l.TryAcquire(ctx, stream, perspective, first, locker.ReasonRewind)
	require.NoError(t, err)
	require.False(t, ok)
	requireHeldBy(t, stream, perspective, second, locker.ReasonPurge)
}

func TestTryAcquireLocksOnlyTargetPair(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	l := newLocker(t, locker.Options{})
	stream, otherStream := uuid.New(), uuid.New()
	holder, other := uuid.New(), uuid.New()
	otherPerspective := perspective + "-Other"

	ok, err := l.TryAcquire(ctx, stream, perspective, holder, locker.ReasonRewind)
	require.NoError(t, err)
	require.True(t, ok)

	// Another perspective of the same stream is free.
	ok, err = l.TryAcquire(ctx, stream, otherPerspective, other, locker.ReasonBootstrap)
	require.NoError(t, err)
	require.True(t, ok)
	// The same perspective of another stream is free.
	ok, err = l.TryAcquire(ctx, otherStream, perspective, other, locker.ReasonPurge)
	require.NoError(t, err)
	require.True(t, ok)

	requireHeldBy(t, stream, perspective, holder, locker.ReasonRewind)
	requireHeldBy(t, stream, otherPerspective, other, locker.ReasonBootstrap)
	requireHeldBy(t, otherStream, perspective, other, locker.ReasonPurge)
	require.Equal(t, 2, rowCount(t, stream))
	require.Equal(t, 1, rowCount(t, otherStream))
}

func TestRenewExtendsExpiry(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	l := newLocker(t, locker.Options{})
	stream, inst := uuid.New(), uuid.New()

	ok, err := l.TryAcquire(ctx, stream, perspective, inst, locker.ReasonRewind)
	require.NoError(t, err)
	require.True(t, ok)
	setExpiry(t, stream, perspective, "2 seconds")

	held, err := l.Renew(ctx, stream, perspective, inst)
	require.NoError(t, err)
	require.True(t, held)
	requireSecondsLeft(t, stream, perspective, locker.DefaultLockTimeout)
	requireHeldBy(t, stream, perspective, inst, locker.ReasonRewind) // reason kept
}

func TestRenewByNonHolderChangesNothing(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	l := newLocker(t, locker.Options{})
	stream, holder, other := uuid.New(), uuid.New(), uuid.New()

	ok, err := l.TryAcquire(ctx, stream, perspective, holder, locker.ReasonRewind)
	require.NoError(t, err)
	require.True(t, ok)
	setExpiry(t, stream, perspective, "2 seconds")
	before := readLock(t, stream, perspective)

	held, err := l.Renew(ctx, stream, perspective, other)
	require.NoError(t, err)
	require.False(t, held)

	after := requireHeldBy(t, stream, perspective, holder, locker.ReasonRewind)
	require.True(t, before.Expiry.Equal(*after.Expiry), "a non-holder's renewal must not move the expiry")

	// Renewing a pair that has no cursor row or no lock reports false and writes nothing.
	fresh := uuid.New()
	held, err = l.Renew(ctx, fresh, perspective, holder)
	require.NoError(t, err)
	require.False(t, held)
	require.Equal(t, 0, rowCount(t, fresh))
	insertCursor(t, fresh, perspective)
	held, err = l.Renew(ctx, fresh, perspective, holder)
	require.NoError(t, err)
	require.False(t, held)
	requireUnlocked(t, fresh, perspective)
}

func TestReleaseClearsLock(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	l := newLocker(t, locker.Options{})
	stream, inst := uuid.New(), uuid.New()

	ok, err := l.TryAcquire(ctx, stream, perspective, inst, locker.ReasonPurge)
	require.NoError(t, err)
	require.True(t, ok)

	require.NoError(t, l.Release(ctx, stream, perspective, inst))
	c := readLock(t, stream, perspective)
	require.True(t, c.Exists, "release clears the lock, not the cursor row")
	requireUnlocked(t, stream, perspective)
}

func TestReleaseByNonHolderChangesNothing(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	l := newLocker(t, locker.Options{})
	stream, holder, other := uuid.New(), uuid.New(), uuid.New()

	ok, err := l.TryAcquire(ctx, stream, perspective, holder, locker.ReasonRewind)
	require.NoError(t, err)
	require.True(t, ok)
	before := readLock(t, stream, perspective)

	require.NoError(t, l.Release(ctx, stream, perspective, other))
	after := requireHeldBy(t, stream, perspective, holder, locker.ReasonRewind)
	require.True(t, before.Expiry.Equal(*after.Expiry))

	// Still refused to the non-holder.
	ok, err = l.TryAcquire(ctx, stream, perspective, other, locker.ReasonRewind)
	require.NoError(t, err)
	require.False(t, ok)
}

func TestReleaseNeverLockedPair(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	l := newLocker(t, locker.Options{})
	inst := uuid.New()

	// No cursor row: nothing to do, no row created.
	noRow := uuid.New()
	require.NoError(t, l.Release(ctx, noRow, perspective, inst))
	require.Equal(t, 0, rowCount(t, noRow))

	// A cursor row without a lock: nothing to do, row untouched.
	unlocked := uuid.New()
	insertCursor(t, unlocked, perspective)
	require.NoError(t, l.Release(ctx, unlocked, perspective, inst))
	require.True(t, readLock(t, unlocked, perspective).Exists)
	requireUnlocked(t, unlocked, perspective)
}

func TestReleaseMakesPairAcquirable(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	l := newLocker(t, locker.Options{})
	stream, first, second := uuid.New(), uuid.New(), uuid.New()

	ok, err := l.TryAcquire(ctx, stream, perspective, first, locker.ReasonRewind)
	require.NoError(t, err)
	require.True(t, ok)
	ok, err = l.TryAcquire(ctx, stream, perspective, second, locker.ReasonBootstrap)
	require.NoError(t, err)
	require.False(t, ok)

	require.NoError(t, l.Release(ctx, stream, perspective, first))
	ok, err = l.TryAcquire(ctx, stream, perspective, second, locker.ReasonBootstrap)
	require.NoError(t, err)
	require.True(t, ok)
	requireHeldBy(t, stream, perspective, second, locker.ReasonBootstrap)
}

func TestFullLifecycle(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	l := newLocker(t, locker.Options{})
	stream, first, second := uuid.New(), uuid.New(), uuid.New()

	ok, err := l.TryAcquire(ctx, stream, perspective, first, locker.ReasonRewind)
	require.NoError(t, err)
	require.True(t, ok)

	for i := range 3 {
		setExpiry(t, stream, perspective, "3 seconds")
		held, err := l.Renew(ctx, stream, perspective, first)
		require.NoError(t, err)
		require.True(t, held, "renewal %d", i+1)
		requireSecondsLeft(t, stream, perspective, locker.DefaultLockTimeout)
		requireHeldBy(t, stream, perspective, first, locker.ReasonRewind)

		// Another instance is refused throughout.
		ok, err = l.TryAcquire(ctx, stream, perspective, second, locker.ReasonPurge)
		require.NoError(t, err)
		require.False(t, ok)
	}

	require.NoError(t, l.Release(ctx, stream, perspective, first))
	requireUnlocked(t, stream, perspective)

	ok, err = l.TryAcquire(ctx, stream, perspective, second, locker.ReasonPurge)
	require.NoError(t, err)
	require.True(t, ok)
	requireHeldBy(t, stream, perspective, second, locker.ReasonPurge)

	// The first holder's stale release does not free the second holder's lock.
	require.NoError(t, l.Release(ctx, stream, perspective, first))
	requireHeldBy(t, stream, perspective, second, locker.ReasonPurge)
}

// ---------------------------------------------------------------------------------------
// Beyond the original suite.
// ---------------------------------------------------------------------------------------

func TestTryAcquireCreatesCursorRow(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	l := newLocker(t, locker.Options{})
	stream, inst := uuid.New(), uuid.New()
	require.Equal(t, 0, rowCount(t, stream))

	ok, err := l.TryAcquire(ctx, stream, perspective, inst, locker.ReasonBootstrap)
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, 1, rowCount(t, stream))
	requireHeldBy(t, stream, perspective, inst, locker.ReasonBootstrap)

	// The created row is an ordinary, fresh cursor apart from the lock.
	var version int64
	var status string
	var lastEvent *uuid.UUID
	require.NoError(t, testDB.Pool.QueryRow(ctx,
		`SELECT version, status, last_event_id FROM wh_perspective_cursors WHERE stream_id = $1 AND perspective_name = $2`,
		stream, perspective).Scan(&version, &status, &lastEvent))
	require.Equal(t, int64(0), version)
	require.Equal(t, "ok", status)
	require.Nil(t, lastEvent)
}

func TestLockOperationsLeaveCursorPositionAlone(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	l := newLocker(t, locker.Options{})
	stream, inst := uuid.New(), uuid.New()
	lastEvent := uuid.New()
	_, err := testDB.Pool.Exec(ctx,
		`INSERT INTO wh_perspective_cursors (stream_id, perspective_name, last_event_id, version, events_since_snapshot)
		 VALUES ($1, $2, $3, 7, 3)`, stream, perspective, lastEvent)
	require.NoError(t, err)

	ok, err := l.TryAcquire(ctx, stream, perspective, inst, locker.ReasonRewind)
	require.NoError(t, err)
	require.True(t, ok)
	held, err := l.Renew(ctx, stream, perspective, inst)
	require.NoError(t, err)
	require.True(t, held)
	require.NoError(t, l.Release(ctx, stream, perspective, inst))
	ok, err = l.TryAcquire(ctx, stream, perspective, inst, locker.ReasonRewind)
	require.NoError(t, err)
	require.True(t, ok)
	forced, err := l.ForceRelease(ctx, stream, perspective)
	require.NoError(t, err)
	require.True(t, forced)

	var version int64
	var since int
	var gotLast uuid.UUID
	require.NoError(t, testDB.Pool.QueryRow(ctx,
		`SELECT version, events_since_snapshot, last_event_id FROM wh_perspective_cursors WHERE stream_id = $1 AND perspective_name = $2`,
		stream, perspective).Scan(&version, &since, &gotLast))
	require.Equal(t, int64(7), version, "lock operations must not bump the fencing version")
	require.Equal(t, 3, since)
	require.Equal(t, lastEvent, gotLast)
}

// TestConcurrentTryAcquireExactlyOneWins races 16 instances on one pair, 30 times, starting
// from each of the three acquirable states: no cursor row, an unlocked row, an expired lock.
func TestConcurrentTryAcquireExactlyOneWins(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	l := newLocker(t, locker.Options{})
	const rounds, racers = 30, 16
	states := []string{"no row", "unlocked row", "expired lock"}

	for round := range rounds {
		stream := uuid.New()
		state := states[round%len(states)]
		switch state {
		case "unlocked row":
			insertCursor(t, stream, perspective)
		case "expired lock":
			ok, err := l.TryAcquire(ctx, stream, perspective, uuid.New(), locker.ReasonRewind)
			require.NoError(t, err)
			require.True(t, ok)
			setExpiry(t, stream, perspective, "-1 second")
		}

		instances := make([]uuid.UUID, racers)
		for i := range instances {
			instances[i] = uuid.New()
		}
		won := make([]bool, racers)
		errs := make([]error, racers)
		start := make(chan struct{})
		var wg sync.WaitGroup
		for i := range racers {
			wg.Go(func() {
				<-start
				won[i], errs[i] = l.TryAcquire(ctx, stream, perspective, instances[i], locker.ReasonRewind)
			})
		}
		close(start)
		wg.Wait()

		winners := 0
		var winner uuid.UUID
		for i := range racers {
			require.NoError(t, errs[i], "round %d (%s), racer %d", round, state, i)
			if won[i] {
				winners++
				winner = instances[i]
			}
		}
		require.Equal(t, 1, winners, "round %d (%s): exactly one racer must win", round, state)
		requireHeldBy(t, stream, perspective, winner, locker.ReasonRewind)
		require.Equal(t, 1, rowCount(t, stream))
	}
}

// TestSustainedContention has 8 instances repeatedly take and release 2 pairs; an in-memory
// counter per pair checks that no two of them ever believe they hold the same pair.
func TestSustainedContention(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	l := newLocker(t, locker.Options{})
	const workers, maxIterations = 8, 3000
	const duration = 1500 * time.Millisecond
	streams := [2]uuid.UUID{uuid.New(), uuid.New()}

	var holders, acquisitions, refusals [2]atomic.Int64
	var violations atomic.Int64
	deadline := time.Now().Add(duration)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			inst := uuid.New()
			for i := 0; i < maxIterations && time.Now().Before(deadline); i++ {
				p := (w + i) % 2
				ok, err := l.TryAcquire(ctx, streams[p], perspective, inst, locker.ReasonRewind)
				if !assert.NoError(t, err) {
					return
				}
				if !ok {
					refusals[p].Add(1)
					continue
				}
				acquisitions[p].Add(1)
				if n := holders[p].Add(1); n != 1 {
					violations.Add(1)
					t.Errorf("pair %d: %d holders at once", p, n)
				}
				// Hold across a database round trip, so that a second holder would show.
				held, err := l.Renew(ctx, streams[p], perspective, inst)
				assert.NoError(t, err)
				assert.True(t, held, "pair %d: the holder's renewal must succeed", p)
				if n := holders[p].Load(); n != 1 {
					violations.Add(1)
					t.Errorf("pair %d: %d holders at once", p, n)
				}
				holders[p].Add(-1)
				if !assert.NoError(t, l.Release(ctx, streams[p], perspective, inst)) {
					return
				}
			}
		})
	}
	wg.Wait()

	require.Zero(t, violations.Load())
	for p := range 2 {
		t.Logf("pair %d: %d acquisitions, %d refusals", p, acquisitions[p].Load(), refusals[p].Load())
		require.Positive(t, acquisitions[p].Load(), "pair %d was never acquired", p)
		require.Positive(t, refusals[p].Load(), "pair %d never saw contention", p)
		requireUnlocked(t, streams[p], perspective)
	}
}

func TestRenewAfterExpiryDoesNotRevive(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	l := newLocker(t, locker.Options{})
	stream, inst := uuid.New(), uuid.New()

	ok, err := l.TryAcquire(ctx, stream, perspective, inst, locker.ReasonRewind)
	require.NoError(t, err)
	require.True(t, ok)
	setExpiry(t, stream, perspective, "-1 second")
	before := readLock(t, stream, perspective)

	held, err := l.Renew(ctx, stream, perspective, inst)
	require.NoError(t, err)
	require.False(t, held, "a lapsed lock must not be renewed")

	after := readLock(t, stream, perspective)
	require.Equal(t, before.Instance, after.Instance)
	require.Equal(t, before.Reason, after.Reason)
	require.NotNil(t, after.Expiry)
	require.True(t, before.Expiry.Equal(*after.Expiry), "expiry must be unchanged")
	require.Less(t, secondsLeft(t, stream, perspective), 0.0, "expiry must still be in the past")

	_, found, err := l.Get(ctx, stream, perspective)
	require.NoError(t, err)
	require.False(t, found)
}

func TestExpiryUsesDatabaseClockAndLockTimeout(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	const timeout = 45 * time.Second
	l := newLocker(t, locker.Options{LockTimeout: timeout})
	stream, inst := uuid.New(), uuid.New()

	ok, err := l.TryAcquire(ctx, stream, perspective, inst, locker.ReasonRewind)
	require.NoError(t, err)
	require.True(t, ok)
	requireSecondsLeft(t, stream, perspective, timeout)

	setExpiry(t, stream, perspective, "5 seconds")
	held, err := l.Renew(ctx, stream, perspective, inst)
	require.NoError(t, err)
	require.True(t, held)
	requireSecondsLeft(t, stream, perspective, timeout)

	// A fractional timeout is kept to sub-second precision.
	const fractional = 2500 * time.Millisecond
	lf := newLocker(t, locker.Options{LockTimeout: fractional, KeepAliveInterval: time.Second})
	other := uuid.New()
	// The expiry is the acquiring transaction's now() plus the timeout: between the database
	// clock's readings before and after the call, plus 2.5 s (a timeout rounded to whole
	// seconds falls outside unless the call took half a second or more).
	dbClock := func() (ts time.Time) {
		require.NoError(t, testDB.Pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&ts))
		return ts
	}
	before := dbClock()
	ok, err = lf.TryAcquire(ctx, other, perspective, inst, locker.ReasonRewind)
	require.NoError(t, err)
	require.True(t, ok)
	after := dbClock()
	expiry := *readLock(t, other, perspective).Expiry
	require.False(t, expiry.Before(before.Add(fractional)), "expiry %s before the call's start %s + %s", expiry, before, fractional)
	require.False(t, expiry.After(after.Add(fractional)), "expiry %s after the call's end %s + %s", expiry, after, fractional)
}

func TestGet(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	l := newLocker(t, locker.Options{})
	stream, inst := uuid.New(), uuid.New()

	_, found, err := l.Get(ctx, stream, perspective)
	require.NoError(t, err)
	require.False(t, found, "no cursor row: no lock")

	ok, err := l.TryAcquire(ctx, stream, perspective, inst, locker.ReasonBootstrap)
	require.NoError(t, err)
	require.True(t, ok)

	lock, found, err := l.Get(ctx, stream, perspective)
	require.NoError(t, err)
	require.True(t, found)
	require.Equal(t, stream, lock.StreamID)
	require.Equal(t, perspective, lock.PerspectiveName)
	require.Equal(t, inst, lock.InstanceID)
	require.Equal(t, locker.ReasonBootstrap, lock.Reason)
	stored := readLock(t, stream, perspective)
	require.True(t, stored.Expiry.Equal(lock.Expiry), "Get must return the stored expiry")

	// Another perspective of the stream is not locked.
	_, found, err = l.Get(ctx, stream, perspective+"-Other")
	require.NoError(t, err)
	require.False(t, found)

	require.NoError(t, l.Release(ctx, stream, perspective, inst))
	_, found, err = l.Get(ctx, stream, perspective)
	require.NoError(t, err)
	require.False(t, found, "after release")

	ok, err = l.TryAcquire(ctx, stream, perspective, inst, locker.ReasonPurge)
	require.NoError(t, err)
	require.True(t, ok)
	setExpiry(t, stream, perspective, "-1 second")
	_, found, err = l.Get(ctx, stream, perspective)
	require.NoError(t, err)
	require.False(t, found, "after expiry")
}

func listFor(t testing.TB, l *locker.Postgres, perspectiveName string) []locker.Lock {
	t.Helper()
	all, err := l.List(testCtx(t))
	require.NoError(t, err)
	var out []locker.Lock
	for _, lk := range all {
		if lk.PerspectiveName == perspectiveName {
			out = append(out, lk)
		}
	}
	return out
}

func TestList(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	l := newLocker(t, locker.Options{})
	persp := uniquePerspective("List")
	streams := []uuid.UUID{uuid.New(), uuid.New(), uuid.New()}
	insts := []uuid.UUID{uuid.New(), uuid.New(), uuid.New()}
	reasons := []locker.Reason{locker.ReasonRewind, locker.ReasonBootstrap, locker.ReasonPurge}

	for i := range streams {
		ok, err := l.TryAcquire(ctx, streams[i], persp, insts[i], reasons[i])
		require.NoError(t, err)
		require.True(t, ok)
	}
	require.Len(t, listFor(t, l, persp), 3)

	setExpiry(t, streams[0], persp, "-1 second")
	require.NoError(t, l.Release(ctx, streams[1], persp, insts[1]))

	got := listFor(t, l, persp)
	require.Len(t, got, 1, "only the unexpired, unreleased lock is listed")
	require.Equal(t, streams[2], got[0].StreamID)
	require.Equal(t, persp, got[0].PerspectiveName)
	require.Equal(t, insts[2], got[0].InstanceID)
	require.Equal(t, locker.ReasonPurge, got[0].Reason)
	require.True(t, readLock(t, streams[2], persp).Expiry.Equal(got[0].Expiry))
}

func TestListStatusOrderAndTimeLeft(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	l := newLocker(t, locker.Options{})
	persp := uniquePerspective("ListStatus")
	// Expiries, by stream: 20s, 5s, the default (30s).
	streams := []uuid.UUID{uuid.New(), uuid.New(), uuid.New()}
	inst := uuid.New()
	for _, s := range streams {
		ok, err := l.TryAcquire(ctx, s, persp, inst, locker.ReasonRewind)
		require.NoError(t, err)
		require.True(t, ok)
	}
	setExpiry(t, streams[0], persp, "20 seconds")
	setExpiry(t, streams[1], persp, "5 seconds")

	all, err := l.ListStatus(ctx)
	require.NoError(t, err)
	var got []locker.LockStatus
	for _, s := range all {
		if s.PerspectiveName == persp {
			got = append(got, s)
		}
	}
	require.Len(t, got, 3)
	require.Equal(t, []uuid.UUID{streams[1], streams[0], streams[2]},
		[]uuid.UUID{got[0].StreamID, got[1].StreamID, got[2].StreamID}, "soonest expiry first")
	require.InDelta(t, 5.0, got[0].ExpiresIn.Seconds(), 1.0)
	require.InDelta(t, 20.0, got[1].ExpiresIn.Seconds(), 1.0)
	require.InDelta(t, 30.0, got[2].ExpiresIn.Seconds(), 1.0)
	// The whole list is sorted too.
	for i := 1; i < len(all); i++ {
		require.False(t, all[i].Expiry.Before(all[i-1].Expiry), "list not sorted by expiry at %d", i)
	}
}

func TestForceRelease(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	l := newLocker(t, locker.Options{})
	stream, holder, other := uuid.New(), uuid.New(), uuid.New()

	ok, err := l.TryAcquire(ctx, stream, perspective, holder, locker.ReasonRewind)
	require.NoError(t, err)
	require.True(t, ok)

	forced, err := l.ForceRelease(ctx, stream, perspective)
	require.NoError(t, err)
	require.True(t, forced)
	requireUnlocked(t, stream, perspective)

	// The former holder finds out at its next renewal.
	held, err := l.Renew(ctx, stream, perspective, holder)
	require.NoError(t, err)
	require.False(t, held)
	// Another instance can take it.
	ok, err = l.TryAcquire(ctx, stream, perspective, other, locker.ReasonPurge)
	require.NoError(t, err)
	require.True(t, ok)

	// An expired lock still counts as one that was held.
	setExpiry(t, stream, perspective, "-1 second")
	forced, err = l.ForceRelease(ctx, stream, perspective)
	require.NoError(t, err)
	require.True(t, forced)
	requireUnlocked(t, stream, perspective)

	// Nothing held: a row without lock, then no row at all.
	forced, err = l.ForceRelease(ctx, stream, perspective)
	require.NoError(t, err)
	require.False(t, forced)
	noRow := uuid.New()
	forced, err = l.ForceRelease(ctx, noRow, perspective)
	require.NoError(t, err)
	require.False(t, forced)
	require.Equal(t, 0, rowCount(t, noRow))
}

// ---------------------------------------------------------------------------------------
// Bad input and cancellation.
// ---------------------------------------------------------------------------------------

func TestInvalidArguments(t *testing.T) {
	t.Parallel()
	l := newLocker(t, locker.Options{})
	long201 := strings.Repeat("p", 201)
	reason51 := locker.Reason(strings.Repeat("r", 51))

	type input struct {
		stream      uuid.UUID
		perspective string
		instance    uuid.UUID
		reason      locker.Reason
	}
	ops := []struct {
		name                  string
		takesInstance, reason bool
		call                  func(ctx context.Context, in input) error
	}{
		{"TryAcquire", true, true, func(ctx context.Context, in input) error {
			ok, err := l.TryAcquire(ctx, in.stream, in.perspective, in.instance, in.reason)
			if ok {
				return fmt.Errorf("TryAcquire reported success with error %v", err)
			}
			return err
		}},
		{"Renew", true, false, func(ctx context.Context, in input) error {
			held, err := l.Renew(ctx, in.stream, in.perspective, in.instance)
			if held {
				return fmt.Errorf("Renew reported held with error %v", err)
			}
			return err
		}},
		{"Release", true, false, func(ctx context.Context, in input) error {
			return l.Release(ctx, in.stream, in.perspective, in.instance)
		}},
		{"Get", false, false, func(ctx context.Context, in input) error {
			_, found, err := l.Get(ctx, in.stream, in.perspective)
			if found {
				return fmt.Errorf("Get reported a lock with error %v", err)
			}
			return err
		}},
		{"ForceRelease", false, false, func(ctx context.Context, in input) error {
			forced, err := l.ForceRelease(ctx, in.stream, in.perspective)
			if forced {
				return fmt.Errorf("ForceRelease reported a release with error %v", err)
			}
			return err
		}},
	}
	cases := []struct {
		name      string
		nilStream bool
		mutate    func(*input)
		// onlyWithInstance / onlyWithReason limit the case to operations taking that argument.
		onlyWithInstance, onlyWithReason bool
		wantMsg                          string
	}{
		{name: "nil stream", nilStream: true, wantMsg: "stream ID is the nil UUID"},
		{name: "empty perspective", mutate: func(in *input) { in.perspective = "" }, wantMsg: "perspective name is empty"},
		{name: "perspective of 201 characters", mutate: func(in *input) { in.perspective = long201 }, wantMsg: "perspective name is 201 characters, more than 200"},
		{name: "nil instance", mutate: func(in *input) { in.instance = uuid.Nil }, onlyWithInstance: true, wantMsg: "instance ID is the nil UUID"},
		{name: "empty reason", mutate: func(in *input) { in.reason = "" }, onlyWithReason: true, wantMsg: "reason is empty"},
		{name: "reason of 51 characters", mutate: func(in *input) { in.reason = reason51 }, onlyWithReason: true, wantMsg: "reason is 51 characters, more than 50"},
	}

	for _, op := range ops {
		for _, tc := range cases {
			if (tc.onlyWithInstance && !op.takesInstance) || (tc.onlyWithReason && !op.reason) {
				continue
			}
			t.Run(op.name+"/"+tc.name, func(t *testing.T) {
				t.Parallel()
				in := input{stream: uuid.New(), perspective: perspective, instance: uuid.New(), reason: locker.ReasonRewind}
				if tc.nilStream {
					in.stream = uuid.Nil
				}
				if tc.mutate != nil {
					tc.mutate(&in)
				}
				err := op.call(testCtx(t), in)
				require.ErrorIs(t, err, locker.ErrInvalidArgument)
				require.ErrorContains(t, err, tc.wantMsg)
				require.Equal(t, 0, rowCount(t, in.stream), "nothing may be written")
			})
		}
	}
}

func TestBoundaryLengthsAccepted(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	l := newLocker(t, locker.Options{})
	inst := uuid.New()

	// A 50-character reason and a 200-character perspective name are accepted and stored.
	stream := uuid.New()
	name200 := strings.Repeat("p", 200)
	reason50 := locker.Reason(strings.Repeat("r", 50))
	ok, err := l.TryAcquire(ctx, stream, name200, inst, reason50)
	require.NoError(t, err)
	require.True(t, ok)
	requireHeldBy(t, stream, name200, inst, reason50)

	// Lengths are characters, not bytes: 50 two-byte characters fit varchar(50).
	stream = uuid.New()
	reasonRunes := locker.Reason(strings.Repeat("é", 50))
	nameRunes := strings.Repeat("ü", 200)
	ok, err = l.TryAcquire(ctx, stream, nameRunes, inst, reasonRunes)
	require.NoError(t, err)
	require.True(t, ok)
	requireHeldBy(t, stream, nameRunes, inst, reasonRunes)
	lock, found, err := l.Get(ctx, stream, nameRunes)
	require.NoError(t, err)
	require.True(t, found)
	require.Equal(t, reasonRunes, lock.Reason)

	// 51 two-byte characters are refused before any SQL.
	stream = uuid.New()
	_, err = l.TryAcquire(ctx, stream, perspective, inst, locker.Reason(strings.Repeat("é", 51)))
	require.ErrorIs(t, err, locker.ErrInvalidArgument)
	require.Equal(t, 0, rowCount(t, stream))
}

func TestCancelledContext(t *testing.T) {
	t.Parallel()
	l := newLocker(t, locker.Options{})
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	ctx := testCtx(t)

	t.Run("TryAcquire", func(t *testing.T) {
		stream, inst := uuid.New(), uuid.New()
		ok, err := l.TryAcquire(cancelled, stream, perspective, inst, locker.ReasonRewind)
		require.ErrorIs(t, err, context.Canceled)
		require.False(t, ok)
		require.Equal(t, 0, rowCount(t, stream))
		// The pair is still free for anyone.
		ok, err = l.TryAcquire(ctx, stream, perspective, uuid.New(), locker.ReasonRewind)
		require.NoError(t, err)
		require.True(t, ok)
	})
	t.Run("TryAcquire on unlocked row", func(t *testing.T) {
		stream, inst := uuid.New(), uuid.New()
		insertCursor(t, stream, perspective)
		_, err := l.TryAcquire(cancelled, stream, perspective, inst, locker.ReasonRewind)
		require.ErrorIs(t, err, context.Canceled)
		requireUnlocked(t, stream, perspective)
	})
	t.Run("Renew", func(t *testing.T) {
		stream, inst := uuid.New(), uuid.New()
		ok, err := l.TryAcquire(ctx, stream, perspective, inst, locker.ReasonRewind)
		require.NoError(t, err)
		require.True(t, ok)
		setExpiry(t, stream, perspective, "3 seconds")
		before := readLock(t, stream, perspective)
		held, err := l.Renew(cancelled, stream, perspective, inst)
		require.ErrorIs(t, err, context.Canceled)
		require.False(t, held)
		after := readLock(t, stream, perspective)
		require.True(t, before.Expiry.Equal(*after.Expiry), "a cancelled renewal must not move the expiry")
	})
	t.Run("Release", func(t *testing.T) {
		stream, inst := uuid.New(), uuid.New()
		ok, err := l.TryAcquire(ctx, stream, perspective, inst, locker.ReasonRewind)
		require.NoError(t, err)
		require.True(t, ok)
		err = l.Release(cancelled, stream, perspective, inst)
		require.ErrorIs(t, err, context.Canceled)
		requireHeldBy(t, stream, perspective, inst, locker.ReasonRewind)
	})
	t.Run("Release of a free pair", func(t *testing.T) {
		stream := uuid.New()
		require.ErrorIs(t, l.Release(cancelled, stream, perspective, uuid.New()), context.Canceled)
		require.Equal(t, 0, rowCount(t, stream))
	})
	t.Run("Get, List, ForceRelease", func(t *testing.T) {
		stream, inst := uuid.New(), uuid.New()
		ok, err := l.TryAcquire(ctx, stream, perspective, inst, locker.ReasonRewind)
		require.NoError(t, err)
		require.True(t, ok)
		_, found, err := l.Get(cancelled, stream, perspective)
		require.ErrorIs(t, err, context.Canceled)
		require.False(t, found)
		_, err = l.List(cancelled)
		require.ErrorIs(t, err, context.Canceled)
		forced, err := l.ForceRelease(cancelled, stream, perspective)
		require.ErrorIs(t, err, context.Canceled)
		require.False(t, forced)
		requireHeldBy(t, stream, perspective, inst, locker.ReasonRewind)
	})
}

// ---------------------------------------------------------------------------------------
// Lock history: holds of one pair never overlap on the database clock.
// ---------------------------------------------------------------------------------------

type hold struct {
	instance   uuid.UUID
	start, end time.Time // clock_timestamp() right after acquiring and right before releasing
}

func TestLockHistoryHasNoOverlap(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	l := newLocker(t, locker.Options{})
	const workers, iterations = 6, 40
	streams := [2]uuid.UUID{uuid.New(), uuid.New()}

	var mu sync.Mutex
	holds := [2][]hold{}
	record := func(p int, h hold) {
		mu.Lock()
		defer mu.Unlock()
		holds[p] = append(holds[p], h)
	}

	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			inst := uuid.New()
			for i := range iterations {
				p := (w + i) % 2
				ok, err := l.TryAcquire(ctx, streams[p], perspective, inst, locker.ReasonRewind)
				if !assert.NoError(t, err) {
					return
				}
				if !ok {
					continue
				}
				var h hold
				h.instance = inst
				var holder uuid.UUID
				var left float64
				if !assert.NoError(t, testDB.Pool.QueryRow(ctx,
					`SELECT clock_timestamp(), stream_lock_instance_id,
					        extract(epoch FROM stream_lock_expiry - now())::float8
					   FROM wh_perspective_cursors WHERE stream_id = $1 AND perspective_name = $2`,
					streams[p], perspective).Scan(&h.start, &holder, &left)) {
					return
				}
				assert.Equal(t, inst, holder, "the row must name the instance that won")
				assert.InDelta(t, locker.DefaultLockTimeout.Seconds(), left, 1.0)

				held, err := l.Renew(ctx, streams[p], perspective, inst)
				if !assert.NoError(t, err) {
					return
				}
				assert.True(t, held, "the holder's renewal must succeed")

				if !assert.NoError(t, testDB.Pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&h.end)) {
					return
				}
				record(p, h)
				if !assert.NoError(t, l.Release(ctx, streams[p], perspective, inst)) {
					return
				}
			}
		})
	}
	wg.Wait()
	require.False(t, t.Failed())

	for p := range 2 {
		hs := holds[p]
		require.NotEmpty(t, hs, "pair %d was never held", p)
		sort.Slice(hs, func(i, j int) bool { return hs[i].start.Before(hs[j].start) })
		for i := 1; i < len(hs); i++ {
			require.False(t, hs[i].start.Before(hs[i-1].end),
				"pair %d: hold by %s [%s, %s] overlaps hold by %s [%s, %s]", p,
				hs[i].instance, hs[i].start.Format(time.RFC3339Nano), hs[i].end.Format(time.RFC3339Nano),
				hs[i-1].instance, hs[i-1].start.Format(time.RFC3339Nano), hs[i-1].end.Format(time.RFC3339Nano))
		}
		t.Logf("pair %d: %d non-overlapping holds", p, len(hs))
		requireUnlocked(t, streams[p], perspective)
	}
}

// ---------------------------------------------------------------------------------------
// Row-lock waits: a lock statement that waits behind another writer of the cursor row (a
// worker's apply transaction holds it FOR UPDATE) must judge and set expiry by the time it
// takes effect, not by the time it started.
// ---------------------------------------------------------------------------------------

// blockRow begins a transaction that holds the cursor row FOR UPDATE, as another writer
// would, and returns it with its backend pid. The transaction is rolled back at cleanup.
func blockRow(t *testing.T, ctx context.Context, stream uuid.UUID, persp string) (pgx.Tx, int32) {
	t.Helper()
	tx, err := testDB.Pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	var pid int32
	require.NoError(t, tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid))
	tag, err := tx.Exec(ctx,
		`SELECT 1 FROM wh_perspective_cursors WHERE stream_id = $1 AND perspective_name = $2 FOR UPDATE`,
		stream, persp)
	require.NoError(t, err)
	require.Equal(t, int64(1), tag.RowsAffected())
	return tx, pid
}

// waitBlockedBy polls pg_stat_activity until some backend waits on blocker's locks.
func waitBlockedBy(t *testing.T, ctx context.Context, blocker int32) {
	t.Helper()
	require.Eventually(t, func() bool {
		var n int
		err := testDB.Pool.QueryRow(ctx,
			`SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))`, blocker).Scan(&n)
		return err == nil && n > 0
	}, 10*time.Second, 2*time.Millisecond)
}

type opResult struct {
	ok  bool
	err error
}

// TestRenewDoesNotReviveLockThatLapsedDuringRowLockWait: Renew starts while the lock is
// live, waits behind another writer of the row, and the lock lapses before Renew can take
// effect. Renew must report false and leave the lock lapsed.
func TestRenewDoesNotReviveLockThatLapsedDuringRowLockWait(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	l := newLocker(t, locker.Options{})
	stream, inst := uuid.New(), uuid.New()
	ok, err := l.TryAcquire(ctx, stream, perspective, inst, locker.ReasonRewind)
	require.NoError(t, err)
	require.True(t, ok)

	tx, pid := blockRow(t, ctx, stream, perspective)
	done := make(chan opResult, 1)
	go func() {
		held, err := l.Renew(ctx, stream, perspective, inst)
		done <- opResult{held, err}
	}()
	waitBlockedBy(t, ctx, pid)
	// While Renew waits, the lock lapses: the other writer sets its expiry to the current
	// instant (what the passing of LockTimeout would do), then commits.
	_, err = tx.Exec(ctx,
		`UPDATE wh_perspective_cursors SET stream_lock_expiry = clock_timestamp() WHERE stream_id = $1 AND perspective_name = $2`,
		stream, perspective)
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))

	r := <-done
	require.NoError(t, r.err)
	require.False(t, r.ok, "a lock that lapsed before Renew took effect must not be revived")
	require.Less(t, secondsLeft(t, stream, perspective), 0.0)
}

// TestTryAcquireLeaseRunsFromAcquisitionAfterRowLockWait: TryAcquire waits behind another
// writer of the row; the lease it gets must be LockTimeout from when it took the lock, not
// from when the statement started (else a wait longer than LockTimeout hands out a lock
// that has already lapsed, which another instance can take at once).
func TestTryAcquireLeaseRunsFromAcquisitionAfterRowLockWait(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	l := newLocker(t, locker.Options{})
	stream, inst := uuid.New(), uuid.New()
	insertCursor(t, stream, perspective)

	tx, pid := blockRow(t, ctx, stream, perspective)
	done := make(chan opResult, 1)
	go func() {
		ok, err := l.TryAcquire(ctx, stream, perspective, inst, locker.ReasonRewind)
		done <- opResult{ok, err}
	}()
	waitBlockedBy(t, ctx, pid)
	// The other writer keeps the row a while (this waits for no expiry: the lock is 30s).
	time.Sleep(500 * time.Millisecond)
	var released time.Time
	require.NoError(t, tx.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&released))
	require.NoError(t, tx.Commit(ctx))

	r := <-done
	require.NoError(t, r.err)
	require.True(t, r.ok)
	c := requireHeldBy(t, stream, perspective, inst, locker.ReasonRewind)
	// TryAcquire took effect after the writer's commit, so its lease ends no earlier than
	// released + LockTimeout.
	lease := c.Expiry.Sub(released)
	require.GreaterOrEqual(t, lease, locker.DefaultLockTimeout-100*time.Millisecond,
		"lease measured from the end of the row-lock wait")
}

func TestAcquireReportsTakeover(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	l := newLocker(t, locker.Options{})
	stream, a, b := uuid.New(), uuid.New(), uuid.New()

	r, err := l.Acquire(ctx, stream, perspective, a, locker.ReasonRewind)
	require.NoError(t, err)
	require.Equal(t, locker.AcquireResult{Acquired: true}, r, "a free pair is no takeover")
	r, err = l.Acquire(ctx, stream, perspective, a, locker.ReasonBootstrap)
	require.NoError(t, err)
	require.Equal(t, locker.AcquireResult{Acquired: true}, r, "re-acquiring one's own lock is no takeover")
	r, err = l.Acquire(ctx, stream, perspective, b, locker.ReasonRewind)
	require.NoError(t, err)
	require.Equal(t, locker.AcquireResult{}, r, "a live lock is refused")

	_, err = testDB.Pool.Exec(ctx, `UPDATE wh_perspective_cursors SET stream_lock_expiry = now() - interval '1 second'
		WHERE stream_id = $1 AND perspective_name = $2`, stream, perspective)
	require.NoError(t, err)
	r, err = l.Acquire(ctx, stream, perspective, b, locker.ReasonRewind)
	require.NoError(t, err)
	require.Equal(t, locker.AcquireResult{Acquired: true, TookOver: true}, r, "an expired lock of another instance is taken over")

	require.NoError(t, l.Release(ctx, stream, perspective, b))
	r, err = l.Acquire(ctx, stream, perspective, a, locker.ReasonRewind)
	require.NoError(t, err)
	require.Equal(t, locker.AcquireResult{Acquired: true}, r, "a released pair is no takeover")
}
