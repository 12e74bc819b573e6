package worker_test

// Unit tests of the group path (many pairs applied in one transaction) against the moq
// mocks and the in-memory tables of unit_test.go: which pairs the group transaction
// writes, which it leaves to the single-pair path, and with how many statements.

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/db"
	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/worker"
)

// withCursor creates the pair's cursor row, as Append does.
func (f *utFake) withCursor(stream uuid.UUID) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.p(stream, utName).cursor = true
}

// freshPair is a new stream of n events, all queued, with its cursor row and no model.
func (f *utFake) freshPair(n int) (uuid.UUID, []uuid.UUID) {
	stream := utNewID(f.t)
	ids := f.newEvents(stream, n)
	f.enqueue(stream, ids...)
	f.withCursor(stream)
	return stream, ids
}

// continuingPair is a stream of applied+queued events: the first applied ones in the model,
// with a snapshot at the last of them, and the rest queued.
func (f *utFake) continuingPair(applied, queued int) (uuid.UUID, []uuid.UUID) {
	stream := utNewID(f.t)
	ids := f.newEvents(stream, applied+queued)
	f.applied(stream, ids[:applied]...)
	f.snapshot(stream, ids[applied-1], ids[:applied]...)
	f.enqueue(stream, ids[applied:]...)
	return stream, ids
}

// setPair changes the pair's rows under the fake's mutex.
func (f *utFake) setPair(stream uuid.UUID, fn func(p *utPair)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	fn(f.p(stream, utName))
}

// utCommitted is what one PairsApplyCommit call wrote: per stream, its applied event IDs.
func utCommitted(t *testing.T, a db.PairsApplyCommitParams) map[uuid.UUID][]uuid.UUID {
	t.Helper()
	require.Len(t, a.AppliedStreamIds, len(a.AppliedEventIds))
	require.Len(t, a.AppliedPerspectiveNames, len(a.AppliedEventIds))
	out := map[uuid.UUID][]uuid.UUID{}
	for i, s := range a.AppliedStreamIds {
		assert.Equal(t, utName, a.AppliedPerspectiveNames[i])
		out[s] = append(out[s], a.AppliedEventIds[i])
	}
	return out
}

// utModelSeq is the pair's model decoded, or nil (a failed assertion) when it has none.
func utModelSeq(t *testing.T, p *utPair) []int {
	t.Helper()
	if !assert.NotNil(t, p.model, "the pair has no model") {
		return nil
	}
	return utDecode(t, p.model.Model)
}

// utSeqTo is [1 2 … n], the fold of a stream's first n events.
func utSeqTo(n int) []int {
	out := make([]int, n)
	for i := range out {
		out[i] = i + 1
	}
	return out
}

// ---------------------------------------------------------------------------------------
// A group of fresh pairs: one transaction, one lock statement, one write statement.

func TestUnitGroupFreshPairsOneTransaction(t *testing.T) {
	t.Parallel()
	f := newUTFake(t)
	sizes := []int{1, 3, 2, 4}
	streams := make([]uuid.UUID, len(sizes))
	ids := make([][]uuid.UUID, len(sizes))
	for i, n := range sizes {
		streams[i], ids[i] = f.freshPair(n)
	}
	w := f.worker(true, nil)

	order := w.ProcessGroup(context.Background(), utName, streams...)

	assert.Equal(t, streams, order, "every pair finishes with the group, in the group's order")
	assert.Len(t, f.store.InTxCalls(), 1, "one transaction for the whole group")
	pl := f.store.PairsLockForApplyCalls()
	require.Len(t, pl, 1, "one statement locks every cursor")
	assert.Equal(t, streams, pl[0].Arg.StreamIds)
	assert.Equal(t, slices.Repeat([]string{utName}, len(streams)), pl[0].Arg.PerspectiveNames)
	assert.Empty(t, f.store.CursorsEnsureCalls(), "every cursor row exists")
	qe := f.store.QueueEventsForPairsCalls()
	require.Len(t, qe, 1, "one statement reads every pair's queue")
	assert.Equal(t, int32(worker.DefaultBatchSize), qe[0].Arg.PerPairLimit)
	assert.Empty(t, f.store.ModelsGetCalls(), "fresh pairs have no model to read")
	pc := f.store.PairsApplyCommitCalls()
	require.Len(t, pc, 1, "one statement writes every model, cursor and queue row")
	assert.ElementsMatch(t, streams, pc[0].Arg.StreamIds)
	committed := utCommitted(t, pc[0].Arg)
	assert.Empty(t, f.store.SnapshotsInsertManyCalls(), "EveryNEvents not reached")
	assert.Empty(t, f.store.PairLockForApplyCalls(), "no pair goes to the single path")
	assert.Empty(t, f.store.PairApplyCommitCalls())
	assert.Empty(t, f.locker.TryAcquireCalls())
	assert.Equal(t, 1, f.commits)

	for i, s := range streams {
		assert.Equal(t, ids[i], committed[s], "pair %d: every queued event applied, in ID order", i)
		p := f.pair(s)
		require.NotNil(t, p.model, "pair %d", i)
		assert.Equal(t, utSeqTo(sizes[i]), utModelSeq(t, p), "pair %d: the model is the fold", i)
		assert.Equal(t, ids[i][sizes[i]-1], p.model.LastEventID)
		assert.Empty(t, p.queue, "pair %d: queue emptied", i)
		assert.Equal(t, uuid.NullUUID{UUID: ids[i][sizes[i]-1], Valid: true}, p.last, "pair %d: cursor advanced", i)
		assert.Equal(t, int64(1), p.version, "pair %d: cursor version bumped once", i)
		assert.Equal(t, int32(sizes[i]), p.since)
		assert.Equal(t, "ok", p.status)
	}
	assert.Zero(t, w.CoordinatorSize())
}

func TestUnitGroupBatchSizePerPair(t *testing.T) {
	t.Parallel()
	f := newUTFake(t)
	s1, ids1 := f.freshPair(5)
	s2, ids2 := f.freshPair(2)
	w := f.worker(true, func(c *worker.Config) {
		c.BatchSize = 3
		c.Snapshots.Disabled = true // else the second group leaves s1 to a bootstrap
	})

	w.ProcessGroup(context.Background(), utName, s1, s2)

	qe := f.store.QueueEventsForPairsCalls()
	require.Len(t, qe, 1)
	assert.Equal(t, int32(3), qe[0].Arg.PerPairLimit)
	pc := f.store.PairsApplyCommitCalls()
	require.Len(t, pc, 1)
	committed := utCommitted(t, pc[0].Arg)
	assert.Equal(t, ids1[:3], committed[s1], "at most BatchSize events of a pair, the oldest")
	assert.Equal(t, ids2, committed[s2])
	assert.Equal(t, ids1[3:], f.pair(s1).queued(), "the rest stays queued")
	assert.Equal(t, []int{1, 2, 3}, utModelSeq(t, f.pair(s1)))
	assert.Equal(t, []int{1, 2}, utModelSeq(t, f.pair(s2)))

	w.ProcessGroup(context.Background(), utName, s1, s2)

	assert.Equal(t, utSeqTo(5), utModelSeq(t, f.pair(s1)), "the next group continues from the model")
	assert.Empty(t, f.pair(s1).queue)
	pc = f.store.PairsApplyCommitCalls()
	require.Len(t, pc, 2)
	assert.Equal(t, map[uuid.UUID][]uuid.UUID{s1: ids1[3:]}, utCommitted(t, pc[1].Arg))
	assert.Empty(t, f.store.PairApplyCommitCalls(), "no pair goes to the single path")
}

// ---------------------------------------------------------------------------------------
// A mixed group: the ordinary pair commits in the group; the rewind and the bootstrap run
// afterwards on the single path; the pair locked by another instance is left alone.

func TestUnitGroupMixedRewindBootstrapLockedOrdinary(t *testing.T) {
	t.Parallel()
	f := newUTFake(t)
	rew := f.lateScenario() // cursor at event 5, events 3 (late) and 6 queued, no snapshot
	boot := utNewID(t)
	bootIDs := f.newEvents(boot, 4)
	f.applied(boot, bootIDs[:3]...) // a model but no snapshot
	f.enqueue(boot, bootIDs[3])
	locked, lockedIDs := f.freshPair(2)
	other := utNewID(t)
	f.lockedBy(locked, other, true)
	ord, ordIDs := f.continuingPair(1, 2)
	w := f.worker(true, nil)

	// When the first follow-up takes its stream lock, the group must have committed.
	var groupCommitsAtAcquire, ordQueuedAtAcquire atomic.Int64
	groupCommitsAtAcquire.Store(-1)
	acquire := f.locker.TryAcquireFunc
	f.locker.TryAcquireFunc = func(ctx context.Context, s uuid.UUID, n string, i uuid.UUID, r locker.Reason) (bool, error) {
		if groupCommitsAtAcquire.Load() < 0 {
			groupCommitsAtAcquire.Store(int64(len(f.store.PairsApplyCommitCalls())))
			ordQueuedAtAcquire.Store(int64(len(f.pair(ord).queue)))
		}
		return acquire(ctx, s, n, i, r)
	}

	order := w.ProcessGroup(context.Background(), utName, rew.stream, boot, locked, ord)

	assert.Equal(t, []uuid.UUID{locked, ord, rew.stream, boot}, order,
		"the pairs the group settled finish first, the follow-ups after")

	// The group transaction.
	qe := f.store.QueueEventsForPairsCalls()
	require.Len(t, qe, 1)
	assert.ElementsMatch(t, []uuid.UUID{rew.stream, boot, ord}, qe[0].Arg.StreamIds,
		"the queue of the pair locked by another instance is not read")
	mg := f.store.ModelsGetCalls()
	require.Len(t, mg, 1)
	assert.Equal(t, []uuid.UUID{ord}, mg[0].Arg.StreamIds, "only the pair applied in the group needs its model")
	pc := f.store.PairsApplyCommitCalls()
	require.Len(t, pc, 1, "one group write")
	assert.Equal(t, []uuid.UUID{ord}, pc[0].Arg.StreamIds, "the group writes the ordinary pair only")
	assert.Equal(t, map[uuid.UUID][]uuid.UUID{ord: ordIDs[1:]}, utCommitted(t, pc[0].Arg))
	assert.Equal(t, int64(1), groupCommitsAtAcquire.Load(), "the follow-ups run after the group wrote")
	assert.Zero(t, ordQueuedAtAcquire.Load(), "the ordinary pair is applied before the follow-ups")

	// The follow-ups, on the single path, with their stream locks.
	ta := f.locker.TryAcquireCalls()
	require.Len(t, ta, 2, "a stream lock for the rewind and one for the bootstrap, none for the others")
	assert.Equal(t, rew.stream, ta[0].StreamID)
	assert.Equal(t, locker.ReasonRewind, ta[0].Reason)
	assert.Equal(t, boot, ta[1].StreamID)
	assert.Equal(t, locker.ReasonBootstrap, ta[1].Reason)
	assert.Len(t, f.locker.ReleaseCalls(), 2)
	assert.Zero(t, w.HeldLocks())
	assert.NotEmpty(t, f.store.EventsReplayPageCalls(), "the late event is handled by a rewind")

	p := f.pair(rew.stream)
	assert.Equal(t, utSeqTo(6), utModelSeq(t, p), "rewound: every event in ID order")
	assert.Equal(t, rew.ids[5], p.last.UUID)
	assert.Empty(t, p.queue)

	p = f.pair(boot)
	assert.Contains(t, p.snaps, bootIDs[2], "the bootstrap snapshot is at the model's position")
	assert.Equal(t, utSeqTo(3), utDecode(t, p.snaps[bootIDs[2]]))
	assert.Equal(t, utSeqTo(4), utModelSeq(t, p), "bootstrapped, then applied")
	assert.Empty(t, p.queue)

	p = f.pair(locked)
	assert.Nil(t, p.model, "nothing written for the pair locked by another instance")
	assert.False(t, p.last.Valid)
	assert.Equal(t, lockedIDs, p.queued(), "its events stay queued")
	assert.Equal(t, other, p.lockInst.UUID, "its lock is untouched")
	assert.Equal(t, "ok", p.status, "being locked elsewhere is not a failure")

	p = f.pair(ord)
	assert.Equal(t, utSeqTo(3), utModelSeq(t, p))
	assert.Empty(t, p.queue)

	assert.Empty(t, f.store.CursorMarkFailedCalls())
	assert.Zero(t, w.CoordinatorSize())
}

// ---------------------------------------------------------------------------------------
// An Apply error ends that pair's batch inside the group; the other pairs are unaffected.

func TestUnitGroupApplyErrorRecordedOnItsPair(t *testing.T) {
	t.Parallel()
	f := newUTFake(t)
	failing, failIDs := f.freshPair(5)        // events 1, 2 apply; 3 fails
	stuck, stuckIDs := f.continuingPair(2, 1) // its only queued event (3) fails
	prevErr := "earlier failure"
	f.setPair(stuck, func(p *utPair) { p.status, p.lastErr, p.attempts = "failed", &prevErr, 2 })
	fine, fineIDs := f.freshPair(2)
	f.hook = func(n int) error {
		if n == 3 {
			return errors.New("bad event three")
		}
		return nil
	}
	w := f.worker(true, nil)

	before := time.Now()
	order := w.ProcessGroup(context.Background(), utName, failing, stuck, fine)
	after := time.Now()

	assert.Equal(t, []uuid.UUID{failing, stuck, fine}, order, "a recorded failure is settled by the group")
	assert.Len(t, f.store.InTxCalls(), 1, "the failures are recorded in the group transaction")
	assert.Empty(t, f.store.PairLockForApplyCalls(), "no pair goes to the single path")
	assert.Empty(t, f.store.PairApplyCommitCalls())
	pc := f.store.PairsApplyCommitCalls()
	require.Len(t, pc, 1)
	assert.Equal(t, map[uuid.UUID][]uuid.UUID{failing: failIDs[:2], fine: fineIDs}, utCommitted(t, pc[0].Arg),
		"the events before the failing one are committed; a pair with none applied is not written")

	cm := f.store.CursorMarkFailedCalls()
	require.Len(t, cm, 2)
	backoff := map[uuid.UUID]float64{}
	for _, c := range cm {
		backoff[c.Arg.StreamID] = c.Arg.BackoffSeconds
		require.NotNil(t, c.Arg.LastError)
		assert.Contains(t, *c.Arg.LastError, "bad event three")
	}
	assert.Equal(t, map[uuid.UUID]float64{failing: 1, stuck: 4}, backoff,
		"RetryBackoff after a commit reset the attempts; doubled per earlier attempt otherwise")

	checkFailed := func(stream uuid.UUID, queued []uuid.UUID, attempts int32, delay time.Duration) {
		t.Helper()
		p := f.pair(stream)
		assert.Equal(t, "failed", p.status)
		require.NotNil(t, p.lastErr)
		assert.Contains(t, *p.lastErr, "bad event three")
		assert.Equal(t, attempts, p.attempts)
		assert.False(t, p.nextAt.Before(before.Add(delay)), "next attempt after the backoff")
		assert.False(t, p.nextAt.After(after.Add(delay)), "next attempt after the backoff")
		assert.Equal(t, queued, p.queued(), "the failing event and the ones after it stay queued")
		for _, id := range queued {
			qf, ok := p.qFail[id]
			require.True(t, ok, "queue row %s marked failed", id)
			assert.Equal(t, int32(1), qf.attempts)
			assert.Equal(t, p.lastErr, qf.lastErr)
			assert.Equal(t, p.nextAt, qf.nextAt, "queue rows pushed back to the cursor's retry time")
		}
	}
	checkFailed(failing, failIDs[2:], 1, time.Second)
	checkFailed(stuck, stuckIDs[2:], 3, 4*time.Second)

	p := f.pair(failing)
	assert.Equal(t, []int{1, 2}, utModelSeq(t, p))
	assert.Equal(t, failIDs[1], p.last.UUID)
	p = f.pair(stuck)
	assert.Equal(t, []int{1, 2}, utModelSeq(t, p), "nothing applied")
	assert.Equal(t, stuckIDs[1], p.last.UUID)

	p = f.pair(fine)
	assert.Equal(t, []int{1, 2}, utModelSeq(t, p))
	assert.Empty(t, p.queue)
	assert.Equal(t, "ok", p.status)
	assert.Empty(t, p.qFail)
	assert.Contains(t, f.logs.String(), "bad event three")
	assert.Zero(t, w.CoordinatorSize())
}

// ---------------------------------------------------------------------------------------
// A pair without a cursor row gets one and is applied in the same transaction.

func TestUnitGroupCreatesMissingCursor(t *testing.T) {
	t.Parallel()
	f := newUTFake(t)
	bare := utNewID(t)
	bareIDs := f.newEvents(bare, 3)
	f.enqueue(bare, bareIDs...) // no cursor row
	withRow, withRowIDs := f.freshPair(1)
	w := f.worker(true, nil)

	order := w.ProcessGroup(context.Background(), utName, bare, withRow)

	assert.Equal(t, []uuid.UUID{bare, withRow}, order)
	assert.Len(t, f.store.InTxCalls(), 1, "one transaction")
	cm := f.store.CursorsMissingCalls()
	require.Len(t, cm, 1)
	assert.Equal(t, []uuid.UUID{bare}, cm[0].Arg.StreamIds, "only the pair not locked is looked up")
	ce := f.store.CursorsEnsureCalls()
	require.Len(t, ce, 1)
	assert.Equal(t, []uuid.UUID{bare}, ce[0].Arg.StreamIds, "only the missing cursor is created")
	assert.Equal(t, []string{utName}, ce[0].Arg.PerspectiveNames)
	pl := f.store.PairsLockForApplyCalls()
	require.Len(t, pl, 2)
	assert.Equal(t, []uuid.UUID{bare, withRow}, pl[0].Arg.StreamIds)
	assert.Equal(t, []uuid.UUID{bare}, pl[1].Arg.StreamIds, "the created cursor is then locked")
	pc := f.store.PairsApplyCommitCalls()
	require.Len(t, pc, 1)
	assert.Equal(t, map[uuid.UUID][]uuid.UUID{bare: bareIDs, withRow: withRowIDs}, utCommitted(t, pc[0].Arg))
	assert.Empty(t, f.store.CursorEnsureCalls(), "not the single path's statement")
	assert.Empty(t, f.store.PairLockForApplyCalls())

	p := f.pair(bare)
	assert.True(t, p.cursor)
	assert.Equal(t, uuid.NullUUID{UUID: bareIDs[2], Valid: true}, p.last, "the new cursor is advanced")
	assert.Equal(t, utSeqTo(3), utModelSeq(t, p))
	assert.Empty(t, p.queue)
	assert.Equal(t, []int{1}, utModelSeq(t, f.pair(withRow)))
}

// ---------------------------------------------------------------------------------------
// Snapshots taken in a group are written by one statement and pruned by one, with the
// retention of snapshotsToDrop.

func TestUnitGroupSnapshotsInsertAndPrune(t *testing.T) {
	t.Parallel()
	for _, keep := range []int{1, 3, 5} {
		t.Run(fmt.Sprintf("MaxPerStream %d", keep), func(t *testing.T) {
			t.Parallel()
			f := newUTFake(t)
			// snap: events 1-4 applied with snapshots at 2 and 4; 5-9 queued: with
			// EveryNEvents 2, snapshots are due at 6 and 8.
			snap := utNewID(t)
			ids := f.newEvents(snap, 9)
			f.applied(snap, ids[:4]...)
			f.snapshot(snap, ids[1], ids[:2]...)
			f.snapshot(snap, ids[3], ids[:4]...)
			f.setPair(snap, func(p *utPair) { p.since = 0 })
			f.enqueue(snap, ids[4:]...)
			// quiet: one event, not enough for a snapshot.
			quiet, quietIDs := f.continuingPair(1, 1)
			f.setPair(quiet, func(p *utPair) { p.since = 0 })
			w := f.worker(true, func(c *worker.Config) {
				c.Snapshots = worker.SnapshotOptions{EveryNEvents: 2, MaxPerStream: keep}
			})

			w.ProcessGroup(context.Background(), utName, snap, quiet)

			si := f.store.SnapshotsInsertManyCalls()
			require.Len(t, si, 1, "one statement writes the group's snapshots")
			assert.Equal(t, []uuid.UUID{snap, snap}, si[0].Arg.StreamIds)
			assert.Equal(t, []string{utName, utName}, si[0].Arg.PerspectiveNames)
			assert.Equal(t, []uuid.UUID{ids[5], ids[7]}, si[0].Arg.SnapshotEventIds)
			require.Len(t, si[0].Arg.Models, 2)
			assert.Equal(t, utSeqTo(6), utDecode(t, si[0].Arg.Models[0]), "the model as of the snapshot's event")
			assert.Equal(t, utSeqTo(8), utDecode(t, si[0].Arg.Models[1]))
			sp := f.store.SnapshotsPruneCalls()
			require.Len(t, sp, 1, "one statement prunes")
			assert.Equal(t, []uuid.UUID{snap}, sp[0].Arg.StreamIds, "only the pairs that took snapshots")
			assert.Equal(t, int32(keep), sp[0].Arg.MaxPerStream)

			newestFirst := []uuid.UUID{ids[7], ids[5], ids[3], ids[1]}
			drop := worker.SnapshotsToDrop(newestFirst, keep)
			var want []uuid.UUID
			for _, id := range newestFirst {
				if !slices.Contains(drop, id) {
					want = append(want, id)
				}
			}
			explicit := map[int][]uuid.UUID{
				1: {ids[7]},
				3: {ids[7], ids[5], ids[1]}, // the newest two and the oldest
				5: newestFirst,
			}[keep]
			require.Equal(t, explicit, want, "snapshotsToDrop's retention")
			var got []uuid.UUID
			for id := range f.pair(snap).snaps {
				got = append(got, id)
			}
			assert.ElementsMatch(t, want, got, "the snapshots left are those snapshotsToDrop keeps")
			if m, ok := f.pair(snap).snaps[ids[7]]; assert.True(t, ok) {
				assert.Equal(t, utSeqTo(8), utDecode(t, m))
			}
			assert.Equal(t, []uuid.UUID{quietIDs[0]}, slices.Collect(maps.Keys(f.pair(quiet).snaps)), "a pair without a new snapshot is not pruned")

			pc := f.store.PairsApplyCommitCalls()
			require.Len(t, pc, 1)
			since := map[uuid.UUID]int32{}
			for i, s := range pc[0].Arg.StreamIds {
				since[s] = pc[0].Arg.EventsSinceSnapshot[i]
			}
			assert.Equal(t, map[uuid.UUID]int32{snap: 1, quiet: 1}, since, "the counter restarts at each snapshot")
			assert.Equal(t, utSeqTo(9), utModelSeq(t, f.pair(snap)))
			assert.Empty(t, f.store.SnapshotInsertCalls(), "not the single path's statements")
			assert.Empty(t, f.store.SnapshotIDsCalls())
			assert.Empty(t, f.store.SnapshotsDeleteCalls())
		})
	}
}

// ---------------------------------------------------------------------------------------
// The group transaction fails: it writes nothing, and each pair is processed alone.

func TestUnitGroupTransactionFailureFallsBackToSinglePath(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"error", "panic"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			f := newUTFake(t)
			a, aIDs := f.freshPair(2)
			b, bIDs := f.continuingPair(1, 2)
			c, cIDs := f.freshPair(1)
			streams := []uuid.UUID{a, b, c}
			initial := map[uuid.UUID]*utPair{}
			for _, s := range streams {
				initial[s] = f.pair(s).clone()
			}
			w := f.worker(true, nil)

			var failed atomic.Bool
			commit := f.store.PairsApplyCommitFunc
			f.store.PairsApplyCommitFunc = func(ctx context.Context, arg db.PairsApplyCommitParams) (int64, error) {
				n, err := commit(ctx, arg) // written, then the transaction fails
				if failed.CompareAndSwap(false, true) {
					if mode == "panic" {
						panic("driver bug in the group write")
					}
					return 0, errors.New("connection reset")
				}
				return n, err
			}
			// The state the single path starts from.
			var atFallback map[uuid.UUID]*utPair
			lockOne := f.store.PairLockForApplyFunc
			f.store.PairLockForApplyFunc = func(ctx context.Context, arg db.PairLockForApplyParams) (db.PairLockForApplyRow, error) {
				if atFallback == nil {
					atFallback = map[uuid.UUID]*utPair{}
					for _, s := range streams {
						atFallback[s] = f.pair(s).clone()
					}
				}
				return lockOne(ctx, arg)
			}

			order := w.ProcessGroup(context.Background(), utName, streams...)

			assert.Equal(t, streams, order)
			require.Len(t, f.store.PairsApplyCommitCalls(), 1, "the group write was tried once")
			assert.Equal(t, 1, f.rollbacks, "the group transaction is rolled back")
			require.NotNil(t, atFallback, "the pairs are then processed alone")
			for _, s := range streams {
				assert.Equal(t, initial[s].model, atFallback[s].model, "the failed group wrote no model")
				assert.Equal(t, initial[s].queued(), atFallback[s].queued(), "the failed group deleted no queue row")
				assert.Equal(t, initial[s].last, atFallback[s].last, "the failed group moved no cursor")
				assert.Equal(t, initial[s].version, atFallback[s].version)
			}
			pl := f.store.PairLockForApplyCalls()
			require.Len(t, pl, 3, "each pair alone")
			for i, s := range streams {
				assert.Equal(t, s, pl[i].Arg.StreamID)
			}
			assert.Len(t, f.store.PairApplyCommitCalls(), 3)
			assert.Equal(t, utSeqTo(2), utModelSeq(t, f.pair(a)))
			assert.Equal(t, utSeqTo(3), utModelSeq(t, f.pair(b)))
			assert.Equal(t, utSeqTo(1), utModelSeq(t, f.pair(c)))
			assert.Equal(t, aIDs[1], f.pair(a).last.UUID)
			assert.Equal(t, bIDs[2], f.pair(b).last.UUID)
			assert.Equal(t, cIDs[0], f.pair(c).last.UUID)
			for _, s := range streams {
				assert.Empty(t, f.pair(s).queue)
				assert.Equal(t, "ok", f.pair(s).status)
			}
			assert.Empty(t, f.store.CursorMarkFailedCalls(), "a transient group failure is no pair's failure")
			assert.Contains(t, f.logs.String(), "group transaction failed")
			if mode == "panic" {
				assert.Contains(t, f.logs.String(), "driver bug in the group write")
			}
			assert.Zero(t, w.CoordinatorSize())
		})
	}
}

// ---------------------------------------------------------------------------------------
// A pair another goroutine of this process holds does not hold up the group.

func TestUnitGroupDoesNotWaitForHeldPair(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		f := newUTFake(t)
		held, heldIDs := f.freshPair(2)
		f.setPair(held, func(p *utPair) { delete(p.queue, heldIDs[1]) }) // only event 1 queued yet
		a, _ := f.freshPair(2)
		b, _ := f.freshPair(1)
		w := f.worker(true, nil)

		gate := make(chan struct{})
		var gated atomic.Bool
		queue := f.store.QueueEventsForPairFunc
		f.store.QueueEventsForPairFunc = func(ctx context.Context, arg db.QueueEventsForPairParams) ([]db.QueueEventsForPairRow, error) {
			rows, err := queue(ctx, arg)
			if arg.StreamID == held && gated.CompareAndSwap(false, true) {
				<-gate // the holder's apply is slow, after reading the queue
			}
			return rows, err
		}

		var wg sync.WaitGroup
		wg.Go(func() { w.ProcessPair(context.Background(), held, utName) })
		synctest.Wait()
		require.True(t, gated.Load(), "the holder is applying the pair")
		f.enqueue(held, heldIDs[1]) // arrives while the holder works

		var order []uuid.UUID
		wg.Go(func() { order = w.ProcessGroup(context.Background(), utName, held, a, b) })
		synctest.Wait()

		// Only assertions until the gate opens: a failed require would leave the holder blocked.
		if pl := f.store.PairsLockForApplyCalls(); assert.Len(t, pl, 1) {
			assert.Equal(t, []uuid.UUID{a, b}, pl[0].Arg.StreamIds, "the held pair is not in the group transaction")
		}
		assert.Equal(t, []int{1, 2}, utModelSeq(t, f.pair(a)), "the other pairs are applied while the pair is held")
		assert.Equal(t, []int{1}, utModelSeq(t, f.pair(b)))
		assert.Nil(t, f.pair(held).model, "the holder has not committed yet")
		assert.Equal(t, 1, w.CoordinatorSize(), "the held pair's entry: held, and awaited by the group")

		close(gate)
		wg.Wait()

		assert.Equal(t, []uuid.UUID{a, b, held}, order, "the held pair finishes last")
		var heldCommits [][]uuid.UUID
		for _, c := range f.store.PairApplyCommitCalls() {
			if c.Arg.StreamID == held {
				heldCommits = append(heldCommits, c.Arg.EventIds)
			}
		}
		assert.Equal(t, [][]uuid.UUID{{heldIDs[0]}, {heldIDs[1]}}, heldCommits,
			"the holder applied event 1; the group, after the release, event 2")
		assert.Equal(t, []int{1, 2}, utModelSeq(t, f.pair(held)))
		assert.Empty(t, f.pair(held).queue)
		assert.Zero(t, w.CoordinatorSize())
	})
}

// ---------------------------------------------------------------------------------------
// A model that does not match its cursor is not written by the group; the single path
// reports it as the pair's failure.

func TestUnitGroupInconsistentModelGoesToSinglePath(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		corrupt func(p *utPair, ids []uuid.UUID)
		msg     string
	}{
		{"model behind the cursor", func(p *utPair, ids []uuid.UUID) { p.model.LastEventID = ids[0] }, "model is at event"},
		{"model missing", func(p *utPair, _ []uuid.UUID) { p.model = nil }, "load model"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newUTFake(t)
			bad, badIDs := f.continuingPair(2, 1)
			f.setPair(bad, func(p *utPair) { tc.corrupt(p, badIDs) })
			before := f.pair(bad).clone()
			ord, ordIDs := f.continuingPair(1, 1)
			w := f.worker(true, nil)

			order := w.ProcessGroup(context.Background(), utName, bad, ord)

			assert.Equal(t, []uuid.UUID{ord, bad}, order, "the pair left to the single path finishes after the group")
			mg := f.store.ModelsGetCalls()
			require.Len(t, mg, 1)
			assert.Equal(t, []uuid.UUID{bad, ord}, mg[0].Arg.StreamIds)
			pc := f.store.PairsApplyCommitCalls()
			require.Len(t, pc, 1)
			assert.Equal(t, map[uuid.UUID][]uuid.UUID{ord: ordIDs[1:]}, utCommitted(t, pc[0].Arg), "the group writes the consistent pair only")
			pl := f.store.PairLockForApplyCalls()
			require.Len(t, pl, 1, "the inconsistent pair is processed alone")
			assert.Equal(t, bad, pl[0].Arg.StreamID)
			assert.Empty(t, f.store.PairApplyCommitCalls(), "and not written there either")

			cm := f.store.CursorMarkFailedCalls()
			require.Len(t, cm, 1, "the inconsistency is recorded as the pair's failure")
			assert.Equal(t, bad, cm[0].Arg.StreamID)
			require.NotNil(t, cm[0].Arg.LastError)
			assert.Contains(t, *cm[0].Arg.LastError, tc.msg)
			p := f.pair(bad)
			assert.Equal(t, "failed", p.status)
			assert.Equal(t, int32(1), p.attempts)
			assert.False(t, p.nextAt.IsZero())
			assert.Equal(t, before.model, p.model, "the model is untouched")
			assert.Equal(t, before.last, p.last)
			assert.Equal(t, badIDs[2:], p.queued(), "its events stay queued")
			for _, id := range badIDs[2:] {
				assert.Equal(t, p.nextAt, p.qFail[id].nextAt)
			}

			assert.Equal(t, []int{1, 2}, utModelSeq(t, f.pair(ord)))
			assert.Empty(t, f.pair(ord).queue)
			assert.Zero(t, w.CoordinatorSize())
		})
	}
}

// ---------------------------------------------------------------------------------------
// A pair whose cursor row another transaction holds (SKIP LOCKED passes it over) is left
// alone, and kept out of the next claim only, so that the instance turns to other pairs.

func TestUnitGroupPairHeldByAnotherTransactionSkippedForOneClaim(t *testing.T) {
	t.Parallel()
	f := newUTFake(t)
	held, heldIDs := f.freshPair(2)
	free, freeIDs := f.freshPair(1)
	lock := f.store.PairsLockForApplyFunc
	f.store.PairsLockForApplyFunc = func(ctx context.Context, a db.PairsLockForApplyParams) ([]db.PairsLockForApplyRow, error) {
		rows, err := lock(ctx, a)
		// The row of held is locked elsewhere: FOR UPDATE SKIP LOCKED does not return it.
		return slices.DeleteFunc(rows, func(r db.PairsLockForApplyRow) bool { return r.StreamID == held }), err
	}
	w := f.worker(true, nil)

	order := w.ProcessGroup(context.Background(), utName, held, free)

	assert.Equal(t, []uuid.UUID{held, free}, order, "the held pair is done at once: nothing to wait for")
	cm := f.store.CursorsMissingCalls()
	require.Len(t, cm, 1)
	assert.Equal(t, []uuid.UUID{held}, cm[0].Arg.StreamIds, "a row not returned could be a missing cursor")
	assert.Empty(t, f.store.CursorsEnsureCalls(), "it is not: nothing to create (and no insert that could wait)")
	pc := f.store.PairsApplyCommitCalls()
	require.Len(t, pc, 1)
	assert.Equal(t, map[uuid.UUID][]uuid.UUID{free: freeIDs}, utCommitted(t, pc[0].Arg), "only the free pair is written")
	assert.ElementsMatch(t, heldIDs, f.pair(held).queued(), "the held pair's events stay queued")
	assert.Nil(t, f.pair(held).model)
	assert.Empty(t, f.store.PairLockForApplyCalls(), "no single-path retry of a held pair")

	assert.Equal(t, []string{held.String() + "/" + utName}, w.ClaimExclusions(), "kept out of the next claim")
	assert.Empty(t, w.ClaimExclusions(), "and only the next one")
}

// ---------------------------------------------------------------------------------------
// The rewinds a group leaves behind take free slots of their own and run side by side; with
// every other slot busy they run one after the other in the group's slot.

func TestUnitGroupFollowUpsTakeFreeSlots(t *testing.T) {
	for _, free := range []bool{true, false} {
		t.Run(fmt.Sprintf("free slots %v", free), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				f := newUTFake(t)
				late := []lateScenario{f.lateScenario(), f.lateScenario(), f.lateScenario()}
				w := f.worker(true, nil) // Concurrency 4
				gate := make(chan struct{})
				var replaying, most atomic.Int32
				replay := f.store.EventsReplayPageFunc
				f.store.EventsReplayPageFunc = func(ctx context.Context, a db.EventsReplayPageParams) ([]db.WhEventStore, error) {
					n := replaying.Add(1)
					defer replaying.Add(-1)
					for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
					}
					<-gate
					return replay(ctx, a)
				}
				streams := []uuid.UUID{late[0].stream, late[1].stream, late[2].stream}
				done := make(chan []uuid.UUID, 1)
				go func() {
					if free {
						done <- w.ProcessGroupWithFreeSlots(context.Background(), utName, streams...)
					} else {
						done <- w.ProcessGroup(context.Background(), utName, streams...)
					}
				}()
				synctest.Wait() // every rewind that could start waits at the gate
				inFlight := replaying.Load()
				close(gate)
				order := <-done

				if free {
					assert.EqualValues(t, 3, inFlight, "two rewinds in slots of their own, one in the group's")
				} else {
					assert.EqualValues(t, 1, inFlight, "one rewind at a time in the group's slot")
					assert.Equal(t, streams, order)
				}
				assert.EqualValues(t, inFlight, most.Load())
				assert.ElementsMatch(t, streams, order, "every pair finished once")
				for _, s := range late {
					assert.Equal(t, utSeqTo(6), utModelSeq(t, f.pair(s.stream)), "rewound with the late event")
					assert.Empty(t, f.pair(s.stream).queue)
				}
				assert.Zero(t, w.HeldLocks(), "every stream lock released")
			})
		})
	}
}
