package worker_test

import (
	"bytes"
	"context"
	"encoding/json"
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

// fastFailures is a config whose failures back off for milliseconds.
func fastFailures(name string, policy worker.FailurePolicy) worker.Config {
	return worker.Config{
		Perspectives:  []worker.Perspective{poisonPerspective(name)},
		RetryBackoff:  5 * time.Millisecond,
		FailurePolicy: policy,
		// A long poll: what is retried or skipped is found by notification, not by polling.
		MaxRetryBackoff: 10 * time.Millisecond,
	}
}

// skippedOf returns the skipped events of stream (the perspective's catch-up also meets
// the poison events of the other tests' streams).
func skippedOf(t *testing.T, a *worker.Admin, name string, stream uuid.UUID) []worker.SkippedEvent {
	t.Helper()
	all, err := a.Skipped(context.Background(), name, worker.MaxListed)
	require.NoError(t, err)
	var out []worker.SkippedEvent
	for _, s := range all {
		if s.Stream == stream {
			out = append(out, s)
		}
	}
	return out
}

// failedPair returns the pair's entry in Admin.Failed (nil: it is not failing).
func failedPair(t *testing.T, a *worker.Admin, name string, stream uuid.UUID) *worker.FailedPair {
	t.Helper()
	all, err := a.Failed(context.Background(), name, worker.MaxListed)
	require.NoError(t, err)
	for i := range all {
		if all[i].Stream == stream {
			return &all[i]
		}
	}
	return nil
}

func waitParked(t *testing.T, a *worker.Admin, name string, stream uuid.UUID, attempts int) worker.FailedPair {
	t.Helper()
	var fp *worker.FailedPair
	eventually(t, 20*time.Second, "pair parked", func() bool {
		fp = failedPair(t, a, name, stream)
		return fp != nil && fp.Parked && fp.Attempts >= attempts
	})
	return *fp
}

// A poison event parks its pair after the policy's attempts: the events before it are
// applied, it and the ones after wait, later events queue behind it, a late event that sorts
// before it is still applied, other streams flow. Retry tries it once more (and it parks
// again); Skip records the skip and applies the rest.
func TestPoisonEventParksItsPairUntilRetriedOrSkipped(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := uniqueName("park")
	startWorker(t, fastFailures(name, worker.FailurePolicy{Attempts: 3}))
	admin := newAdmin(t)

	bad, good := uuid.New(), uuid.New()
	ids := newIDs(t, 6)
	evs := events(bad, ids)
	evs[3].Type = "poison"
	// ids[1] is held back (late), ids[5] comes after the pair is parked.
	require.NoError(t, worker.Append(ctx, testDB.Pool, evs[0], evs[2], evs[3], evs[4]))
	goodEvs := events(good, newIDs(t, 3))
	require.NoError(t, worker.Append(ctx, testDB.Pool, goodEvs...))
	require.Equal(t, expectedLedger(t, goodEvs), waitModel(t, ctx, name, good, 3), "other pairs flow")

	fp := waitParked(t, admin, name, bad, 3)
	require.Equal(t, 3, fp.Attempts, "parked at the policy's third failure, not retried after it")
	require.Equal(t, ids[3], fp.Event)
	require.Equal(t, "poison", fp.EventType)
	require.Contains(t, fp.LastError, "poison event refused")
	require.Equal(t, 1, fp.Version)
	require.True(t, fp.NextAttempt.IsZero(), "a parked pair has no retry time")
	m, _ := loadLedger(t, ctx, name, bad)
	require.Equal(t, expectedLedger(t, []worker.Event{evs[0], evs[2]}), m, "the events before the poison one are applied")

	// A new event waits behind the parked pair; a late one before the poison is applied.
	require.NoError(t, worker.Append(ctx, testDB.Pool, evs[5]))
	require.NoError(t, worker.Append(ctx, testDB.Pool, evs[1]))
	eventually(t, 20*time.Second, "late event applied", func() bool {
		m, _ = loadLedger(t, ctx, name, bad)
		return len(m.IDs) == 3
	})
	require.Equal(t, expectedLedger(t, evs[:3]), m)
	require.Equal(t, []uuid.UUID{ids[3], ids[4], ids[5]}, queued(t, ctx, name, bad))
	// The late event's rewind met the poison event once more: one more failure of the same
	// event, and parked at once (the count is not reset by the events applied before it).
	fp = waitParked(t, admin, name, bad, 4)
	require.Equal(t, ids[3], fp.Event, "parked again at the poison event")
	require.Equal(t, 4, fp.Attempts)
	time.Sleep(100 * time.Millisecond) // 20 backoffs
	require.Equal(t, 4, failedPair(t, admin, name, bad).Attempts, "not retried while parked")

	// Retry: tried once more at once, and parked again.
	n, err := admin.Retry(ctx, bad, name)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	eventually(t, 20*time.Second, "retried", func() bool {
		p := failedPair(t, admin, name, bad)
		return p != nil && p.Parked && p.Attempts == 5
	})
	n, err = admin.Retry(ctx, good, name)
	require.NoError(t, err)
	require.Zero(t, n, "a pair that is not failing is not retried")

	// Skip: recorded, and the rest is applied.
	versions, err := admin.Skip(ctx, bad, name, ids[3], "alice")
	require.NoError(t, err)
	require.Equal(t, []int{1}, versions)
	rest := []worker.Event{evs[0], evs[1], evs[2], evs[4], evs[5]}
	require.Equal(t, expectedLedger(t, rest), waitModel(t, ctx, name, bad, len(rest)))
	require.Nil(t, failedPair(t, admin, name, bad), "the pair's failure cleared")
	skipped := skippedOf(t, admin, name, bad)
	require.Len(t, skipped, 1)
	require.Equal(t, ids[3], skipped[0].Event)
	require.Equal(t, "alice", skipped[0].By)
	require.False(t, skipped[0].ByPolicy)
	require.Equal(t, "poison", skipped[0].EventType)
	require.Contains(t, skipped[0].LastError, "poison event refused")
	require.Equal(t, 5, skipped[0].Attempts)

	// A late event after the skip: its rewind replays the stream without the skipped event.
	late := events(bad, newIDs(t, 1))[0]
	late.ID = between(t, ids[0], ids[1])
	require.NoError(t, worker.Append(ctx, testDB.Pool, late))
	rest = append(rest, late)
	require.Equal(t, expectedLedger(t, rest), waitModel(t, ctx, name, bad, len(rest)))
}

// between returns an event ID that sorts between a and b (b must be more than a few
// microseconds after a).
func between(t *testing.T, a, b uuid.UUID) uuid.UUID {
	t.Helper()
	id := a
	id[15]++ // the random tail: after a, and before b whose timestamp is later
	if id[15] == 0 {
		id[14]++
	}
	require.Negative(t, compareUUID(a, id))
	require.Negative(t, compareUUID(id, b))
	return id
}

// The skip policy skips the poison event after its attempts, records it, and goes on.
func TestSkipPolicySkipsThePoisonEventAndGoesOn(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := uniqueName("skippol")
	cfg := fastFailures(name, worker.FailurePolicy{})
	cfg.FailurePolicies = map[string]worker.FailurePolicy{name: {Attempts: 2, Skip: true}}
	startWorker(t, cfg)
	admin := newAdmin(t)

	stream := uuid.New()
	evs := events(stream, newIDs(t, 4))
	evs[1].Type = "poison"
	require.NoError(t, worker.Append(ctx, testDB.Pool, evs...))
	rest := []worker.Event{evs[0], evs[2], evs[3]}
	require.Equal(t, expectedLedger(t, rest), waitModel(t, ctx, name, stream, 3))
	skipped := skippedOf(t, admin, name, stream)
	require.Len(t, skipped, 1)
	require.Equal(t, evs[1].ID, skipped[0].Event)
	require.True(t, skipped[0].ByPolicy)
	require.Contains(t, skipped[0].By, "worker ")
	require.Equal(t, 2, skipped[0].Attempts, "skipped at the policy's second failure")
	require.Nil(t, failedPair(t, admin, name, stream))
}

// A late event that is itself the poison: its rewind cannot commit anything (the cursor
// would go back), so the pair parks at it with its model as it was; skipping it clears the
// pair, and the events queued after it are applied.
func TestLatePoisonEventParksAndSkippingItResumes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := uniqueName("latepoison")
	startWorker(t, fastFailures(name, worker.FailurePolicy{Attempts: 2}))
	admin := newAdmin(t)

	stream := uuid.New()
	ids := newIDs(t, 4)
	evs := events(stream, ids)
	evs[1].Type = "poison"
	require.NoError(t, worker.Append(ctx, testDB.Pool, evs[0], evs[2]))
	waitModel(t, ctx, name, stream, 2)
	require.NoError(t, worker.Append(ctx, testDB.Pool, evs[1])) // late, and poison
	fp := waitParked(t, admin, name, stream, 2)
	require.Equal(t, ids[1], fp.Event)
	m, _ := loadLedger(t, ctx, name, stream)
	require.Equal(t, expectedLedger(t, []worker.Event{evs[0], evs[2]}), m, "the model is untouched")
	require.NoError(t, worker.Append(ctx, testDB.Pool, evs[3]))

	_, err := admin.Skip(ctx, stream, name, ids[1], "bob")
	require.NoError(t, err)
	rest := []worker.Event{evs[0], evs[2], evs[3]}
	require.Equal(t, expectedLedger(t, rest), waitModel(t, ctx, name, stream, 3))
}

// Bad input to Failed, Retry, Skip and Promote is refused with locker.ErrInvalidArgument,
// and Skip writes nothing.
func TestAdminFailureActionsRefuseBadInput(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := uniqueName("failbad")
	startWorker(t, fastFailures(name, worker.FailurePolicy{Attempts: 1}))
	admin := newAdmin(t)
	stream := uuid.New()
	evs := events(stream, newIDs(t, 2))
	evs[0].Type = "poison"
	require.NoError(t, worker.Append(ctx, testDB.Pool, evs...))
	waitParked(t, admin, name, stream, 1)

	for _, tc := range []struct {
		what string
		err  error
		want string
	}{
		{"not queued", func() error {
			_, err := admin.Skip(ctx, stream, name, uuid.New(), "alice")
			return err
		}(), "neither queued"},
		{"no one", func() error { _, err := admin.Skip(ctx, stream, name, evs[0].ID, " "); return err }(), "by is empty"},
		{"by with a NUL byte", func() error { _, err := admin.Skip(ctx, stream, name, evs[0].ID, "al\x00ice"); return err }(), "by is not text"},
		{"by not UTF-8", func() error { _, err := admin.Skip(ctx, stream, name, evs[0].ID, "al\xffice"); return err }(), "by is not text"},
		{"promote a bad name", func() error { _, err := admin.Promote(ctx, "bad\x00name", 2); return err }(), "perspective name"},
		{"nil event", func() error { _, err := admin.Skip(ctx, stream, name, uuid.Nil, "alice"); return err }(), "nil UUID"},
		{"unknown perspective", func() error {
			_, err := admin.Skip(ctx, stream, name+"_nope", evs[0].ID, "alice")
			return err
		}(), "not registered"},
		{"retry unknown", func() error { _, err := admin.Retry(ctx, uuid.Nil, name+"_nope"); return err }(), "not registered"},
		{"limit", func() error { _, err := admin.Failed(ctx, name, 0); return err }(), "limit"},
		{"bad name", func() error { _, err := admin.Skipped(ctx, "bad\x00name", 1); return err }(), "perspective name"},
	} {
		require.ErrorIs(t, tc.err, locker.ErrInvalidArgument, tc.what)
		require.ErrorContains(t, tc.err, tc.want, tc.what)
	}
	require.Empty(t, skippedOf(t, admin, name, stream), "a refused skip writes nothing")
	fp := failedPair(t, admin, name, stream)
	require.NotNil(t, fp)
	require.True(t, fp.Parked, "still parked")

	// Retry of the whole perspective (uuid.Nil): every failing pair (the catch-up also met
	// the poison events of other tests' streams, and parallel tests may add more meanwhile:
	// with one attempt, every failing pair is parked and stays so until retried).
	all, err := admin.Failed(ctx, name, worker.MaxListed)
	require.NoError(t, err)
	n, err := admin.Retry(ctx, uuid.Nil, name)
	require.NoError(t, err)
	require.GreaterOrEqual(t, n, len(all))
	eventually(t, 20*time.Second, "this test's pair retried once more and parked again", func() bool {
		p := failedPair(t, admin, name, stream)
		return p != nil && p.Parked && p.Attempts == 2
	})
}

// The failure policies are validated by New.
func TestFailurePolicyValidation(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		cfg  func(*worker.Config)
		want string
	}{
		{func(c *worker.Config) { c.FailurePolicy.Attempts = -1 }, "FailurePolicy.Attempts must be between 1 and 1000, got -1"},
		{func(c *worker.Config) { c.FailurePolicy.Attempts = 1001 }, "FailurePolicy.Attempts must be between 1 and 1000"},
		{func(c *worker.Config) {
			c.FailurePolicies = map[string]worker.FailurePolicy{"nope": {}}
		}, `FailurePolicies["nope"]: no perspective of that name`},
		{func(c *worker.Config) {
			c.FailurePolicies = map[string]worker.FailurePolicy{"valid": {Attempts: -2}}
		}, `FailurePolicies["valid"].Attempts must be between 1 and 1000, got -2`},
	} {
		cfg := worker.Config{Perspectives: []worker.Perspective{ledgerPerspective("valid")}}
		tc.cfg(&cfg)
		_, err := worker.New(testDB.Pool, cfg)
		require.ErrorIs(t, err, worker.ErrInvalidConfig)
		require.ErrorContains(t, err, tc.want)
	}
}

// A failing pair is retried once its backoff is over, however short, without waiting for a
// poll (an hour away here): the claim after the failure sees it due soon, and the loop
// claims again then, or at once when that moment has passed by the time it looks.
func TestAFailingPairIsRetriedAfterItsBackoffWithoutAPoll(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := uniqueName("retry_wake")
	cfg := fastFailures(name, worker.FailurePolicy{Attempts: 4})
	cfg.PollInterval, cfg.RetryBackoff, cfg.MaxRetryBackoff = time.Hour, time.Millisecond, time.Millisecond
	startWorker(t, cfg)
	admin := newAdmin(t)
	for range 8 {
		stream := uuid.New()
		evs := events(stream, newIDs(t, 2))
		evs[0].Type = "poison"
		require.NoError(t, worker.Append(ctx, testDB.Pool, evs...))
		var fp *worker.FailedPair
		eventually(t, 10*time.Second, "the pair retried to its fourth failure", func() bool {
			fp = failedPair(t, admin, name, stream)
			return fp != nil && fp.Parked
		})
		require.Equal(t, 4, fp.Attempts)
	}
}

// An event an operator skips while a rebuild of the perspective is under way is skipped in
// the rebuild too, whose catch-up has not reached the stream yet: the catch-up leaves it
// out, as the normal path and a rewind's replay do, and the promoted build's model holds the
// events around it.
func TestSkipDuringARebuildIsHonouredByItsCatchUp(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := uniqueName("skip_rebuild")
	cfg := worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(name)}}
	w := startWorker(t, cfg)
	s := uuid.New()
	evs := events(s, newIDs(t, 3))
	require.NoError(t, worker.Append(ctx, testDB.Pool, evs[0]))
	waitModel(t, ctx, name, s, 1)
	sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	require.NoError(t, w.Stop(sctx))

	admin := newAdmin(t)
	rebuild, created, err := admin.RebuildPerspective(ctx, name)
	require.NoError(t, err)
	require.True(t, created)
	require.NoError(t, worker.Append(ctx, testDB.Pool, evs[1])) // queued for both builds
	versions, err := admin.Skip(ctx, s, name, evs[1].ID, "alice")
	require.NoError(t, err)
	require.Equal(t, []int{1, 1}, versions, "skipped in the active build and in the rebuild")
	require.NoError(t, worker.Append(ctx, testDB.Pool, evs[2]))

	startWorker(t, cfg)
	eventually(t, 30*time.Second, "the rebuild promoted", func() bool {
		return buildState(t, ctx, testDB.Pool, rebuild.Key) == worker.BuildActive
	})
	waitModel(t, ctx, name, s, 2)
	m, ok := loadLedger(t, ctx, name, s)
	require.True(t, ok)
	require.Equal(t, expectedLedger(t, []worker.Event{evs[0], evs[2]}), m, "the skipped event is not in the rebuilt model")
}

// A rewind whose stream lock is lost while its replay re-applies an event already applied
// (an Apply that honours its context fails with it) records the lost lock, not a failure of
// that event, and the lost lock does not count towards the failure policy: with a policy that
// skips an event (or would park the pair) at its first failure, the pair is retried after
// its backoff, no event is skipped, and the rewind retried applies the late event.
func TestALockLostDuringARewindIsNoFailureOfTheEventReplayed(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := uniqueName("rewind_lost")
	opts := locker.Options{LockTimeout: 2 * time.Second, KeepAliveInterval: 100 * time.Millisecond}
	lk, err := locker.NewPostgres(testDB.Pool, opts)
	require.NoError(t, err)
	g := newGated(name)
	g.honourCtx = true
	startWorker(t, worker.Config{
		Perspectives: []worker.Perspective{g}, Locker: lk, LockOptions: opts,
		FailurePolicy: worker.FailurePolicy{Attempts: 1, Skip: true},
		RetryBackoff:  time.Second, MaxRetryBackoff: time.Second,
	})
	admin := newAdmin(t)
	s := uuid.New()
	evs := events(s, newIDs(t, 3))
	require.NoError(t, worker.Append(ctx, testDB.Pool, evs[0], evs[2]))
	waitModel(t, ctx, name, s, 2)

	entered, release := g.arm(evs[0].ID) // the rewind's replay re-applies it
	defer release()
	require.NoError(t, worker.Append(ctx, testDB.Pool, evs[1])) // late: a rewind
	select {
	case <-entered:
	case <-time.After(10 * time.Second):
		t.Fatal("the rewind did not reach the gated event")
	}
	ok, err := lk.ForceRelease(ctx, s, name) // an operator's force release, or a lapse
	require.NoError(t, err)
	require.True(t, ok)

	var fp *worker.FailedPair
	eventually(t, 10*time.Second, "the lost lock recorded", func() bool {
		fp = failedPair(t, admin, name, s)
		return fp != nil
	})
	require.Equal(t, uuid.Nil, fp.Event, "no event's failure: %s", fp.LastError)
	require.Contains(t, fp.LastError, worker.ErrLockLost.Error())
	require.False(t, fp.Parked, "retried")
	m := waitModel(t, ctx, name, s, 3)
	require.Equal(t, expectedLedger(t, evs), m, "the rewind retried")
	require.Empty(t, skippedOf(t, admin, name, s), "no event skipped")
}

// An operator's skip of an event that an apply transaction is committing at that moment
// waits for the pair's cursor row, then finds the event applied, not queued: it is refused
// and writes nothing (a skip that read the queue as of before that commit recorded the skip
// of an event in the model).
func TestSkipOfAnEventBeingAppliedIsRefusedOnceItIsApplied(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := uniqueName("skip_race")
	_, err := psStore(testDB).Register(ctx, name, 1)
	require.NoError(t, err)
	s := uuid.New()
	evs := events(s, newIDs(t, 1))
	require.NoError(t, worker.Append(ctx, testDB.Pool, evs...))
	require.Equal(t, []uuid.UUID{evs[0].ID}, queued(t, ctx, name, s))

	// The normal path's apply transaction, by its own statements: lock the cursor row,
	// write the model with the event and delete its queue row; not committed yet.
	tx, err := testDB.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.Background()) }()
	var pid int
	require.NoError(t, tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid))
	q := pgq.New(tx)
	_, err = q.PairsLockForApply(ctx, db.PairsLockForApplyParams{StreamIds: []uuid.UUID{s}, PerspectiveNames: []string{name}})
	require.NoError(t, err)
	model, err := json.Marshal(expectedLedger(t, evs))
	require.NoError(t, err)
	deleted, err := q.PairsApplyCommit(ctx, db.PairsApplyCommitParams{
		StreamIds: []uuid.UUID{s}, PerspectiveNames: []string{name}, Models: []string{string(model)},
		LastEventIds: []uuid.UUID{evs[0].ID}, EventsSinceSnapshot: []int32{1},
		AppliedStreamIds: []uuid.UUID{s}, AppliedPerspectiveNames: []string{name}, AppliedEventIds: []uuid.UUID{evs[0].ID},
	})
	require.NoError(t, err)
	require.EqualValues(t, 1, deleted)

	admin := newAdmin(t)
	skipped := make(chan error, 1)
	go func() {
		_, err := admin.Skip(ctx, s, name, evs[0].ID, "alice")
		skipped <- err
	}()
	eventually(t, 10*time.Second, "the skip waits for the apply transaction", func() bool {
		var n int
		require.NoError(t, testDB.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))`, pid).Scan(&n))
		return n > 0
	})
	require.NoError(t, tx.Commit(ctx))
	err = <-skipped
	require.ErrorIs(t, err, locker.ErrInvalidArgument, "the event is applied, not queued")
	require.ErrorContains(t, err, "neither queued")
	require.Empty(t, skippedOf(t, admin, name, s), "nothing written")
	wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	require.NoError(t, worker.WaitFor(wctx, testDB.Pool, name, s, evs[0].ID), "the event is in the model")
}

// A pair whose cursor has a position but whose model row is gone (deleted by hand, say) and
// whose history asks for a first snapshot fails its bootstrap, and is retried and parked
// by its failure policy, saying why: it does not go from apply to bootstrap and back for
// ever under one lease.
func TestAPairWithAPositionButNoModelFailsItsBootstrap(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := uniqueName("boot_nomodel")
	s := uuid.New()
	w := startWorker(t, worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(name)}, Snapshots: worker.SnapshotOptions{Disabled: true}})
	require.NoError(t, worker.Append(ctx, testDB.Pool, events(s, newIDs(t, 150))...))
	waitModel(t, ctx, name, s, 150)
	sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	require.NoError(t, w.Stop(sctx))
	gsExec(t, ctx, testDB.Pool, `DELETE FROM wh_perspective_models WHERE stream_id = $1 AND perspective_name = $2`, s, name)
	require.NoError(t, worker.Append(ctx, testDB.Pool, events(s, newIDs(t, 1))...))

	m := newMetrics(t)
	startWorker(t, worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(name)}, MeterProvider: m.mp,
		FailurePolicy: worker.FailurePolicy{Attempts: 2}, RetryBackoff: 5 * time.Millisecond, MaxRetryBackoff: 10 * time.Millisecond})
	admin := newAdmin(t)
	fp := waitParked(t, admin, name, s, 2)
	require.Contains(t, fp.LastError, "has no model")
	require.LessOrEqual(t, m.sum("perspectives.bootstrap.count"), int64(2), "one bootstrap per attempt")
}

// An operator's skip that comes after a catch-up page was read, but before the page's
// transaction (here: the page read ahead while the one before it folds), is honoured by that
// page: the skipped events are read under the page's cursor row locks.
func TestSkipAfterACatchUpPageWasReadIsHonouredByIt(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newSkipRebuild(t, "skip_readahead")
	d, name, b, evB, late, rebuild, admin := f.d, f.name, f.b, f.evB, f.late, f.rebuild, f.admin
	entered := f.entered
	select {
	case <-entered:
	case <-time.After(20 * time.Second):
		t.Fatal("the first page is not folding")
	}
	eventually(t, 10*time.Second, "the second page (stream b) read ahead", func() bool {
		var n int
		require.NoError(t, d.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND query LIKE '%name: CatchUpPage %' AND state = 'idle'`).Scan(&n))
		return n > 0
	})
	_, err := admin.Skip(ctx, b, name, late.ID, "alice") // in the rebuild (and the active build, unless applied there by now)
	require.NoError(t, err)
	require.Equal(t, 1, lcCount(t, d, `SELECT count(*) FROM wh_skipped_events WHERE perspective_name = $1 AND event_id = $2`, rebuild.Key, late.ID),
		"skipped in the rebuild")
	f.release()

	eventually(t, 30*time.Second, "the rebuild promoted", func() bool {
		return buildState(t, ctx, d.Pool, rebuild.Key) == worker.BuildActive
	})
	require.Equal(t, expectedLedger(t, evB), loadLedgerIn(t, d, name, b), "the skipped event is not in the rebuilt model")
}

// An operator's skip that holds a stream's cursor row while a catch-up page comes to it
// (the page cannot lock the row, and hands the stream over to the queue from its first
// event): the hand-over's insert waits for the skip's deletion of the same queue row, and
// once the skip commits, the skipped event is not queued again.
func TestASkipRacingACatchUpPageThatHandsTheStreamOverStays(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newSkipRebuild(t, "skip_handover")
	d, name, b, evB, late, rebuild := f.d, f.name, f.b, f.evB, f.late, f.rebuild
	entered, release := f.entered, f.release
	select {
	case <-entered:
	case <-time.After(20 * time.Second):
		t.Fatal("the first page is not folding")
	}
	// An operator's skip of late in the rebuild, as Admin.Skip does it (cursor row first),
	// its transaction still open.
	tx, err := d.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.Background()) }()
	_, err = tx.Exec(ctx, `SELECT 1 FROM wh_perspective_cursors WHERE stream_id = $1 AND perspective_name = $2 FOR UPDATE`, b, rebuild.Key)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `INSERT INTO wh_skipped_events (stream_id, perspective_name, event_id, skipped_by, reason, attempts)
		VALUES ($1, $2, $3, 'alice', 'operator', 0)`, b, rebuild.Key, late.ID)
	require.NoError(t, err)
	tag, err := tx.Exec(ctx, `DELETE FROM wh_perspective_events WHERE stream_id = $1 AND perspective_name = $2 AND event_id = $3`, b, rebuild.Key, late.ID)
	require.NoError(t, err)
	require.EqualValues(t, 1, tag.RowsAffected())
	release()
	eventually(t, 20*time.Second, "the page queueing stream b waits for the skip", func() bool {
		var n int
		require.NoError(t, d.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND query LIKE '%name: QueueEnqueueStreamFrom %' AND wait_event_type = 'Lock'`).Scan(&n))
		return n > 0
	})
	require.NoError(t, tx.Commit(ctx))
	eventually(t, 30*time.Second, "the rebuild promoted", func() bool {
		return buildState(t, ctx, d.Pool, rebuild.Key) == worker.BuildActive
	})
	require.Zero(t, lcCount(t, d, `SELECT count(*) FROM wh_perspective_events WHERE perspective_name = $1 AND event_id = $2`, rebuild.Key, late.ID),
		"the skipped event is not queued again")
	require.Equal(t, expectedLedger(t, evB), loadLedgerIn(t, d, name, b), "the skipped event is not in the rebuilt model")
}

// skipRebuild is a perspective with two streams a < b applied by a stopped worker, a rebuild
// started, an event late of b appended (queued for both builds), and a worker with pages of
// two events whose catch-up of the rebuild stops at a's first event until release.
type skipRebuild struct {
	d       *pgtest.DB
	name    string
	b       uuid.UUID
	evB     []worker.Event
	late    worker.Event
	rebuild worker.Build
	admin   *worker.Admin
	entered <-chan struct{}
	release func()
}

func newSkipRebuild(t *testing.T, prefix string) skipRebuild {
	t.Helper()
	ctx := context.Background()
	d := isolatedDB(t)
	name := uniqueName(prefix)
	a, b := uuid.New(), uuid.New()
	if bytes.Compare(a[:], b[:]) > 0 {
		a, b = b, a
	}
	ids := newIDs(t, 4)
	evA, evB := events(a, ids[:2]), events(b, ids[2:3])
	w := startWorkerIn(t, d, worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(name)}})
	require.NoError(t, worker.Append(ctx, d.Pool, evA...))
	require.NoError(t, worker.Append(ctx, d.Pool, evB...))
	waitModelIn(t, d, name, b, 1)
	require.NoError(t, w.Stop(ctx))

	admin, err := worker.NewAdmin(d.Pool, nil)
	require.NoError(t, err)
	rebuild, created, err := admin.RebuildPerspective(ctx, name)
	require.NoError(t, err)
	require.True(t, created)
	late := events(b, ids[3:])[0]
	require.NoError(t, worker.Append(ctx, d.Pool, late)) // queued for both builds

	g := newGated(name)
	entered, release := g.arm(evA[0].ID) // only the rebuild's catch-up applies it again
	startWorkerIn(t, d, worker.Config{Perspectives: []worker.Perspective{g}, CatchUpPageSize: 2})
	t.Cleanup(release) // before the worker's stop (cleanups run last first)
	return skipRebuild{d: d, name: name, b: b, evB: evB, late: late, rebuild: rebuild, admin: admin, entered: entered, release: release}
}
