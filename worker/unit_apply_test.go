package worker_test

// Unit tests of the normal path's decisions, on mocks (no database). A StoreMock's Apply
// hands the PairStates a test builds to the worker's decide and keeps the PairWrites it
// returns; they are checked against the in-memory fold [1 2 3 …] of utPerspective. What
// the Store then does with a PairWrite (rows written, deleted, backed off) is SQL, tested
// on PostgreSQL in group_sql_test.go.
//
// This file also holds the fixture the other unit files (unit_rewind_test.go,
// unit_ops_test.go) use: uFix, and the event and state builders.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/mocks"
	"github.com/perspectives-go/perspectives/worker"
)

// ---------------------------------------------------------------------------------------
// The fixture.

// uFix is a worker on a StoreMock and, optionally, a LockerMock that grants every lock.
// Its Store's Apply passes decide the states set with set (of the pairs it is asked for),
// reports the pairs set with setBusy as busy, and keeps what decide returned.
type uFix struct {
	t        *testing.T
	instance uuid.UUID
	store    *mocks.StoreMock
	locker   *mocks.LockerMock // nil: the worker has no locker
	logs     *utLogBuf
	w        *worker.Worker

	mu       sync.Mutex
	hook     func(n int) error // run by the perspective before it applies event n
	appliedN []int             // every n the perspective was asked to apply, in order
	// evHook, when set, is run instead of hook with the event too; appliedOf is every n
	// applied, by stream
	evHook    func(ev worker.Event, n int) error
	appliedOf map[uuid.UUID][]int
	states    map[worker.Pair]worker.PairState // what Apply reads for a pair
	busy      map[worker.Pair]bool             // pairs Apply reports as held by another transaction
	applyErr  func(pairs []worker.Pair) error  // Apply's error after decide (nil: none)
	writes    [][]worker.PairWrite             // what decide returned, per Apply call
	releases  []uRelease                       // how each Release was called
}

// uRelease is how the worker called Release: the context as it was at the call.
type uRelease struct {
	ctxErr   error // the context's error
	deadline bool  // whether it had a deadline
	writes   int   // Store writes (RewindCommit, Bootstrap, Purge) made before it
}

// newUFix builds the fixture; cfg, when not nil, adjusts the worker's Config.
func newUFix(t *testing.T, withLocker bool, cfg func(c *worker.Config)) *uFix {
	t.Helper()
	f := &uFix{
		t:        t,
		instance: utNewID(t),
		logs:     &utLogBuf{},
		states:   map[worker.Pair]worker.PairState{},
		busy:     map[worker.Pair]bool{},
	}
	f.store = &mocks.StoreMock{
		ApplyFunc:   f.apply,
		ReleaseFunc: func(context.Context, worker.ReleaseRequest) error { return nil },
		LeasedFunc:  func(context.Context, uuid.UUID) ([]worker.Pair, error) { return nil, nil },
		MarkFailedFunc: func(context.Context, worker.Pair, worker.Failure, func(int) worker.FailureAction) (worker.FailureAction, error) {
			return worker.FailureRetry, nil
		},
		BootstrapFunc:    func(context.Context, worker.Pair) (bool, error) { return true, nil },
		PurgeFunc:        func(context.Context, worker.Pair, uuid.UUID) error { return nil },
		RewindCommitFunc: func(context.Context, worker.RewindCommit) error { return nil },
	}
	c := worker.Config{
		InstanceID: f.instance,
		Perspectives: []worker.Perspective{utPerspectiveOf(utName, func(ev worker.Event, n int) error {
			f.mu.Lock()
			f.appliedN = append(f.appliedN, n)
			if f.appliedOf == nil {
				f.appliedOf = map[uuid.UUID][]int{}
			}
			f.appliedOf[ev.StreamID] = append(f.appliedOf[ev.StreamID], n)
			hook, evHook := f.hook, f.evHook
			f.mu.Unlock()
			if evHook != nil {
				return evHook(ev, n)
			}
			if hook != nil {
				return hook(n)
			}
			return nil
		})},
		Logger: utLogger(f.logs),
	}
	if withLocker {
		f.locker = &mocks.LockerMock{
			TryAcquireFunc: func(context.Context, uuid.UUID, string, uuid.UUID, locker.Reason) (bool, error) {
				return true, nil
			},
			RenewFunc: func(context.Context, uuid.UUID, string, uuid.UUID) (bool, error) { return true, nil },
			ReleaseFunc: func(ctx context.Context, _ uuid.UUID, _ string, _ uuid.UUID) error {
				_, hasDeadline := ctx.Deadline()
				r := uRelease{ctxErr: ctx.Err(), deadline: hasDeadline,
					writes: len(f.store.RewindCommitCalls()) + len(f.store.BootstrapCalls()) + len(f.store.PurgeCalls())}
				f.mu.Lock()
				f.releases = append(f.releases, r)
				f.mu.Unlock()
				return nil
			},
		}
		c.Locker = f.locker
	}
	if cfg != nil {
		cfg(&c)
	}
	w, err := worker.NewWithStore(f.store, c)
	require.NoError(t, err)
	f.w = w
	return f
}

// apply is the StoreMock's Apply: decide over the states of the pairs asked for.
func (f *uFix) apply(ctx context.Context, req worker.ApplyRequest, decide func([]worker.PairState) []worker.PairWrite) ([]worker.Pair, error) {
	pairs := req.Pairs
	if err := ctx.Err(); err != nil {
		return nil, err // a transaction cannot begin on an ended context
	}
	f.mu.Lock()
	var states []worker.PairState
	var busy []worker.Pair
	for _, p := range pairs {
		if f.busy[p] {
			busy = append(busy, p)
		} else if st, ok := f.states[p]; ok {
			states = append(states, st)
		}
	}
	applyErr := f.applyErr
	f.mu.Unlock()
	writes := decide(states)
	f.mu.Lock()
	f.writes = append(f.writes, writes)
	f.mu.Unlock()
	if applyErr != nil {
		if err := applyErr(pairs); err != nil {
			return nil, err
		}
	}
	return busy, nil
}

// set makes Apply read these states for their pairs.
func (f *uFix) set(states ...worker.PairState) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, st := range states {
		f.states[st.Pair] = st
	}
}

func (f *uFix) setBusy(pairs ...worker.Pair) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, p := range pairs {
		f.busy[p] = true
	}
}

func (f *uFix) setHook(hook func(n int) error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.hook = hook
}

// appliedNs is every n the perspective was asked to apply, in order.
func (f *uFix) appliedNs() []int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.appliedN)
}

// allWrites is every PairWrite decide returned, in order.
func (f *uFix) allWrites() []worker.PairWrite {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Concat(f.writes...)
}

// write is p's one PairWrite.
func (f *uFix) write(p worker.Pair) worker.PairWrite {
	f.t.Helper()
	var out []worker.PairWrite
	for _, wr := range f.allWrites() {
		if wr.Pair == p {
			out = append(out, wr)
		}
	}
	require.Len(f.t, out, 1, "one write for pair %v", p)
	return out[0]
}

// noWrite checks that decide wrote nothing for p.
func (f *uFix) noWrite(p worker.Pair, msg string) {
	f.t.Helper()
	for _, wr := range f.allWrites() {
		assert.NotEqual(f.t, p, wr.Pair, msg)
	}
}

// applyCalls is the pairs of each Store.Apply call.
func (f *uFix) applyCalls() [][]worker.Pair {
	var out [][]worker.Pair
	for _, c := range f.store.ApplyCalls() {
		out = append(out, c.Req.Pairs)
	}
	return out
}

// releasedOnce checks one Release of p by this instance, with a live, bounded context,
// and returns how it was called.
func (f *uFix) releasedOnce(p worker.Pair) uRelease {
	f.t.Helper()
	calls := f.locker.ReleaseCalls()
	require.Len(f.t, calls, 1, "the stream lock is released exactly once")
	assert.Equal(f.t, p.Stream, calls[0].StreamID)
	assert.Equal(f.t, p.Perspective, calls[0].PerspectiveName)
	assert.Equal(f.t, f.instance, calls[0].InstanceID)
	f.mu.Lock()
	r := f.releases[0]
	f.mu.Unlock()
	assert.NoError(f.t, r.ctxErr, "Release runs with a context that is not cancelled")
	assert.True(f.t, r.deadline, "Release runs with a fresh, bounded context")
	return r
}

// acquired checks one TryAcquire of p by this instance, for reason.
func (f *uFix) acquired(p worker.Pair, reason locker.Reason) {
	f.t.Helper()
	calls := f.locker.TryAcquireCalls()
	require.Len(f.t, calls, 1, "one stream lock taken")
	assert.Equal(f.t, reason, calls[0].Reason)
	assert.Equal(f.t, p.Stream, calls[0].StreamID)
	assert.Equal(f.t, p.Perspective, calls[0].PerspectiveName)
	assert.Equal(f.t, f.instance, calls[0].InstanceID)
}

// noLockTaken checks that the locker was not asked for anything.
func (f *uFix) noLockTaken() {
	f.t.Helper()
	if f.locker != nil {
		assert.Empty(f.t, f.locker.TryAcquireCalls(), "no stream lock")
		assert.Empty(f.t, f.locker.ReleaseCalls())
	}
}

// failed checks one MarkFailed of p whose cause contains each of want.
func (f *uFix) failed(p worker.Pair, want ...string) {
	f.t.Helper()
	calls := f.store.MarkFailedCalls()
	require.Len(f.t, calls, 1, "the failure is recorded once")
	assert.Equal(f.t, p, calls[0].P)
	for _, s := range want {
		assert.Contains(f.t, calls[0].F.Cause, s)
	}
}

// settled checks that the job left no coordinator entry behind.
func (f *uFix) settled() {
	f.t.Helper()
	assert.Zero(f.t, f.w.CoordinatorSize(), "the apply coordinator's entries are freed")
}

// ---------------------------------------------------------------------------------------
// Builders.

func uPair(t testing.TB) worker.Pair { return worker.Pair{Stream: utNewID(t), Perspective: utName} }

// uEvents makes n events of stream with data {"n": i}, i = 1…n, and UUIDv7 IDs in
// ascending order: folded in ID order they give [1 2 … n].
func uEvents(t testing.TB, stream uuid.UUID, n int) []worker.Event {
	t.Helper()
	ids := make([]uuid.UUID, n)
	for i := range ids {
		ids[i] = utNewID(t)
	}
	ids = utSorted(ids)
	evs := make([]worker.Event, n)
	for i, id := range ids {
		evs[i] = worker.Event{ID: id, StreamID: stream, Type: "n", Data: json.RawMessage(fmt.Sprintf(`{"n":%d}`, i+1))}
	}
	return evs
}

func uIDs(evs []worker.Event) []uuid.UUID {
	out := make([]uuid.UUID, len(evs))
	for i, ev := range evs {
		out[i] = ev.ID
	}
	return out
}

// uSeq is [from … to].
func uSeq(from, to int) []int {
	var out []int
	for n := from; n <= to; n++ {
		out = append(out, n)
	}
	return out
}

// uModel is utPerspective's model of seq.
func uModel(t testing.TB, seq []int) json.RawMessage {
	t.Helper()
	raw, err := json.Marshal(utSeq{Seq: seq})
	require.NoError(t, err)
	return raw
}

// uState is p as Apply reads it when the first applied events of evs are in its model
// (the cursor at the last of them, all counted since the last snapshot; no snapshot) and
// the others are queued.
func uState(t testing.TB, p worker.Pair, evs []worker.Event, applied int) worker.PairState {
	st := worker.PairState{Pair: p, Events: slices.Clone(evs[applied:])}
	if applied > 0 {
		last := evs[applied-1].ID
		st.LastEventID = uuid.NullUUID{UUID: last, Valid: true}
		st.Model, st.ModelAt = uModel(t, uSeq(1, applied)), last
		st.SinceSnapshot = applied
	}
	return st
}

func uValid(id uuid.UUID) uuid.NullUUID { return uuid.NullUUID{UUID: id, Valid: true} }

func uLess(a, b uuid.UUID) bool { return bytes.Compare(a[:], b[:]) < 0 }

// uJobs is one job of kind per pair, as JobReport.Next lists follow-ups.
func uJobs(kind string, pairs ...worker.Pair) []worker.JobSpec {
	var out []worker.JobSpec
	for _, p := range pairs {
		out = append(out, worker.JobSpec{Kind: kind, Pairs: []worker.Pair{p}})
	}
	return out
}

// uFolded checks that wr applied evs[from:to] onto the model of evs[:from].
func uFolded(t *testing.T, wr worker.PairWrite, evs []worker.Event, from, to int) {
	t.Helper()
	assert.Equal(t, uIDs(evs[from:to]), wr.Applied, "Applied lists exactly the events applied, in ID order")
	if assert.NotEmpty(t, wr.Model) {
		assert.Equal(t, uSeq(1, to), utDecode(t, wr.Model), "the model is the fold of every event up to the last applied, in ID order")
	}
	assert.Equal(t, evs[to-1].ID, wr.LastEventID, "the cursor moves to the last applied event")
}

// uSnapshotsOf checks that snaps are at exactly the events evs[i] for i in at (oldest
// first), each holding the fold up to its event.
func uSnapshotsOf(t *testing.T, snaps []worker.Snapshot, evs []worker.Event, at ...int) {
	t.Helper()
	var got, want []uuid.UUID
	for _, s := range snaps {
		got = append(got, s.EventID)
	}
	for _, i := range at {
		want = append(want, evs[i].ID)
	}
	require.Equal(t, want, got, "snapshot positions")
	for k, i := range at {
		assert.Equal(t, uSeq(1, i+1), utDecode(t, snaps[k].Model), "the snapshot at event %d holds the model as of it", i+1)
	}
}

// uRetention gives a retention table row's expectations: the indexes of the events with a
// stored new snapshot (store lists them 1-based, oldest first), and the IDs of the existing
// snapshots deleted (drop lists them 1-based, newest first).
func uRetention(t *testing.T, ids []uuid.UUID, store, drop []int) (at []int, dropIDs []uuid.UUID) {
	t.Helper()
	for _, n := range store {
		at = append(at, n-1)
	}
	for _, n := range drop {
		dropIDs = append(dropIDs, ids[n-1])
	}
	return at, dropIDs
}

// uByRule checks a retention table row against worker.SnapshotsToDrop: of the new
// snapshots at taken (1-based, oldest first) and the existing ones at existing (newest
// first), it keeps the new ones of store and drops the existing ones of drop.
func uByRule(t *testing.T, ids []uuid.UUID, taken, existing []int, max int, store, drop []int) {
	t.Helper()
	var all []uuid.UUID // newest first
	for _, n := range slices.Backward(taken) {
		all = append(all, ids[n-1])
	}
	for _, n := range existing {
		all = append(all, ids[n-1])
	}
	dropped := worker.SnapshotsToDrop(all, max)
	var kept, gone []int
	for _, n := range taken {
		if !slices.Contains(dropped, ids[n-1]) {
			kept = append(kept, n)
		}
	}
	for _, n := range existing {
		if slices.Contains(dropped, ids[n-1]) {
			gone = append(gone, n)
		}
	}
	require.Equal(t, store, kept, "the table agrees with SnapshotsToDrop: new snapshots kept")
	require.Equal(t, drop, gone, "the table agrees with SnapshotsToDrop: existing snapshots dropped")
}

// ---------------------------------------------------------------------------------------
// The normal path.

// Every pair of the group is decided in one Apply call: its queued events are folded in
// ID order onto its model, and the write names exactly them, the new cursor and the count
// of events since the last snapshot.
func TestUnitApplyFoldsQueuedEventsOntoTheModel(t *testing.T) {
	t.Parallel()
	f := newUFix(t, true, func(c *worker.Config) { c.BatchSize = 7 })
	fresh, cont := uPair(t), uPair(t)
	freshEvs, contEvs := uEvents(t, fresh.Stream, 3), uEvents(t, cont.Stream, 5)
	contSt := uState(t, cont, contEvs, 2) // 1, 2 applied; 3, 4, 5 queued
	contSt.SinceSnapshot, contSt.Snapshots = 1, []uuid.UUID{contEvs[0].ID}
	f.set(uState(t, fresh, freshEvs, 0), contSt)

	rep := f.w.RunApply(context.Background(), fresh, cont)

	calls := f.store.ApplyCalls()
	require.Len(t, calls, 1, "one transaction for the group")
	assert.Equal(t, []worker.Pair{fresh, cont}, calls[0].Req.Pairs)
	assert.Equal(t, 7, calls[0].Req.PerPair, "at most BatchSize queued events per pair")

	wr := f.write(fresh)
	uFolded(t, wr, freshEvs, 0, 3)
	assert.Equal(t, 3, wr.SinceSnapshot)
	wr = f.write(cont)
	uFolded(t, wr, contEvs, 2, 5)
	assert.Equal(t, 1+3, wr.SinceSnapshot, "the count goes on from the stored one")
	for _, wr := range f.allWrites() {
		assert.Empty(t, wr.Snapshots, "EveryNEvents (100) not reached")
		assert.Empty(t, wr.DropSnapshots)
		assert.Empty(t, wr.Failure.Cause)
	}
	assert.Equal(t, []int{1, 2, 3, 3, 4, 5}, f.appliedNs(), "only the queued events are applied, each once")
	assert.Empty(t, rep.Next)
	assert.Empty(t, rep.Busy)
	assert.Empty(t, rep.Contended)
	assert.Empty(t, f.store.MarkFailedCalls())
	f.noLockTaken()
	f.settled()
}

// A pair whose batch was full (BatchSize events applied) keeps its lease for its next
// batch, read above the last event applied, for up to 10 batches in a row; then, or after a
// batch that was not full, its lease is released once (and it is claimed again in its turn).
func TestUnitApplyFullBatchesKeepTheLease(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name                     string
		queued, batches, applied int
	}{
		{"drained in four batches", 350, 4, 350},
		{"three full batches and an empty one", 300, 4, 300},
		{"ten batches in a row at most", 1500, 10, 1000},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newUFix(t, false, func(c *worker.Config) { c.BatchSize = 100; c.Snapshots.Disabled = true })
			p := uPair(t)
			evs := uEvents(t, p.Stream, tc.queued)
			applied := 0
			f.store.ApplyFunc = func(_ context.Context, req worker.ApplyRequest, decide func([]worker.PairState) []worker.PairWrite) ([]worker.Pair, error) {
				st := uState(t, p, evs, applied)
				st.Events = st.Events[:min(req.PerPair, len(st.Events))]
				for _, wr := range decide([]worker.PairState{st}) {
					applied += len(wr.Applied)
				}
				return nil, nil
			}

			f.w.ProcessPair(context.Background(), p.Stream, p.Perspective)

			assert.Equal(t, tc.applied, applied)
			calls := f.store.ApplyCalls()
			require.Len(t, calls, tc.batches, "one transaction per batch")
			assert.Empty(t, calls[0].Req.After, "the claimed job reads from the lowest queued event")
			for i, c := range calls[1:] {
				assert.Equal(t, map[worker.Pair]uuid.UUID{p: evs[100*(i+1)-1].ID}, c.Req.After,
					"batch %d is read above the last event of the one before", i+2)
			}
			releases := f.store.ReleaseCalls()
			require.Len(t, releases, 1, "the lease is kept between the batches and released after the last")
			assert.Equal(t, []worker.Pair{p}, releases[0].Req.Pairs)
			f.settled()
		})
	}
}

// A full batch keeps the lease for the next only while less than half of it (LockTimeout)
// has passed since the claim: a chain never outlives the lease it runs under.
func TestUnitApplyFullBatchKeepsTheLeaseForHalfOfIt(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		ago  time.Duration
		kept bool
	}{
		{"claimed a second ago", time.Second, true},
		{"claimed 16 s ago, the lease 30 s", 16 * time.Second, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newUFix(t, false, func(c *worker.Config) { c.BatchSize = 100; c.Snapshots.Disabled = true })
			p := uPair(t)
			f.set(uState(t, p, uEvents(t, p.Stream, 100), 0)) // a full batch

			rep := f.w.RunClaimedApply(context.Background(), time.Now().Add(-tc.ago), p)

			require.Len(t, f.store.ApplyCalls(), 1)
			if tc.kept {
				assert.Equal(t, uJobs("apply", p), rep.Next, "the next batch follows under the lease")
				assert.Empty(t, f.store.ReleaseCalls())
			} else {
				assert.Empty(t, rep.Next, "released, to be claimed again")
				require.Len(t, f.store.ReleaseCalls(), 1)
				assert.Equal(t, []worker.Pair{p}, f.store.ReleaseCalls()[0].Req.Pairs)
			}
			f.settled()
		})
	}
}

// After a group transaction that failed, those of its pairs (applied one at a time) whose
// batches were full follow as one group again, not as a job each.
func TestUnitApplyFullBatchesAfterTheFallbackFollowAsOneGroup(t *testing.T) {
	t.Parallel()
	f := newUFix(t, false, func(c *worker.Config) { c.BatchSize = 3; c.Snapshots.Disabled = true })
	a, b, c := uPair(t), uPair(t), uPair(t)
	f.set(uState(t, a, uEvents(t, a.Stream, 3), 0), uState(t, b, uEvents(t, b.Stream, 2), 0), uState(t, c, uEvents(t, c.Stream, 3), 0))
	f.applyErr = func(pairs []worker.Pair) error {
		if len(pairs) > 1 {
			return errors.New("the group's write failed")
		}
		return nil
	}

	rep := f.w.RunApply(context.Background(), a, b, c)

	assert.Equal(t, [][]worker.Pair{{a, b, c}, {a}, {b}, {c}}, f.applyCalls())
	full := []worker.Pair{a, c}
	slices.SortFunc(full, func(x, y worker.Pair) int { return bytes.Compare(x.Stream[:], y.Stream[:]) })
	assert.Equal(t, []worker.JobSpec{{Kind: "apply", Pairs: full}}, rep.Next, "a and c, whose batches were full, follow in one group")
	f.settled()
}

// A snapshot is due each time EveryNEvents events have been applied since the last one,
// counting those applied in earlier batches (SinceSnapshot).
func TestUnitApplySnapshotEveryNEventsAcrossBatches(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name      string
		since     int   // stored count, of the 2 applied events
		queued    int   // events queued after them
		at        []int // indexes of the events with a snapshot
		wantSince int
	}{
		{"the count carries over: due at the first queued", 2, 4, []int{2, 5}, 0},
		{"due at the last queued", 0, 3, []int{4}, 0},
		{"not due", 0, 2, nil, 2},
		{"several in one batch", 1, 7, []int{3, 6}, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newUFix(t, false, func(c *worker.Config) { c.Snapshots.EveryNEvents = 3 })
			p := uPair(t)
			evs := uEvents(t, p.Stream, 2+tc.queued)
			st := uState(t, p, evs, 2)
			st.SinceSnapshot, st.Snapshots = tc.since, []uuid.UUID{evs[0].ID}
			f.set(st)

			rep := f.w.RunApply(context.Background(), p)

			wr := f.write(p)
			uFolded(t, wr, evs, 2, len(evs))
			uSnapshotsOf(t, wr.Snapshots, evs, tc.at...)
			assert.Equal(t, tc.wantSince, wr.SinceSnapshot, "events applied since the last snapshot")
			assert.Empty(t, wr.DropSnapshots, "MaxPerStream (5) not reached")
			assert.Empty(t, rep.Next)
		})
	}
}

// Snapshot retention: with the snapshots the pair has and those the batch takes, the
// newest MaxPerStream-1 and the oldest are kept (only the newest when MaxPerStream is 1),
// as worker.SnapshotsToDrop says.
func TestUnitApplySnapshotRetention(t *testing.T) {
	t.Parallel()
	// Events 1-6 applied, with snapshots at 2, 4 and 6; 7-12 queued: with EveryNEvents 2,
	// snapshots are due at 8, 10 and 12.
	for _, tc := range []struct {
		max   int
		store []int // events (1-based) of the new snapshots stored, oldest first
		drop  []int // events of the existing snapshots deleted, newest first
	}{
		{1, []int{12}, []int{6, 4, 2}},
		{2, []int{12}, []int{6, 4}},
		{3, []int{10, 12}, []int{6, 4}},
		{5, []int{8, 10, 12}, []int{4}},
		{10, []int{8, 10, 12}, nil},
	} {
		t.Run(fmt.Sprintf("MaxPerStream %d", tc.max), func(t *testing.T) {
			t.Parallel()
			f := newUFix(t, false, func(c *worker.Config) {
				c.Snapshots = worker.SnapshotOptions{EveryNEvents: 2, MaxPerStream: tc.max}
			})
			p := uPair(t)
			evs := uEvents(t, p.Stream, 12)
			ids := uIDs(evs)
			st := uState(t, p, evs, 6)
			st.SinceSnapshot, st.Snapshots = 0, []uuid.UUID{ids[5], ids[3], ids[1]}
			f.set(st)

			f.w.RunApply(context.Background(), p)

			at, wantDrop := uRetention(t, ids, tc.store, tc.drop)
			uByRule(t, ids, []int{8, 10, 12}, []int{6, 4, 2}, tc.max, tc.store, tc.drop)

			wr := f.write(p)
			uFolded(t, wr, evs, 6, 12)
			uSnapshotsOf(t, wr.Snapshots, evs, at...)
			assert.Equal(t, wantDrop, wr.DropSnapshots, "the existing snapshots the retention drops")
			assert.Zero(t, wr.SinceSnapshot)
		})
	}
}

// Without a new snapshot, nothing is pruned, however many snapshots the pair has (the
// retention runs when a snapshot is written).
func TestUnitApplyNoNewSnapshotPrunesNothing(t *testing.T) {
	t.Parallel()
	f := newUFix(t, false, func(c *worker.Config) {
		c.Snapshots = worker.SnapshotOptions{EveryNEvents: 10, MaxPerStream: 1}
	})
	p := uPair(t)
	evs := uEvents(t, p.Stream, 6)
	st := uState(t, p, evs, 4)
	st.SinceSnapshot, st.Snapshots = 1, []uuid.UUID{evs[2].ID, evs[1].ID, evs[0].ID}
	f.set(st)

	f.w.RunApply(context.Background(), p)

	wr := f.write(p)
	uFolded(t, wr, evs, 4, 6)
	assert.Empty(t, wr.Snapshots)
	assert.Empty(t, wr.DropSnapshots, "no snapshot written: none pruned")
}

// A queued event not newer than the cursor arrived late (or is already in the model): the
// pair is left for a rewind and nothing is written for it; the rest of the group is.
func TestUnitApplyLateEventLeadsToRewind(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		applied []int // indexes of the events in the model
		queued  []int // indexes of the queued events
	}{
		{"older than the cursor", []int{0, 1, 3, 4}, []int{2, 5}},
		{"at the cursor (already applied)", []int{0, 1}, []int{1, 2}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newUFix(t, true, nil)
			late, ord := uPair(t), uPair(t)
			evs := uEvents(t, late.Stream, 6)
			cursor := evs[tc.applied[len(tc.applied)-1]].ID
			st := worker.PairState{Pair: late, LastEventID: uValid(cursor), SinceSnapshot: 200, // a bootstrap would be due too
				Model: uModel(t, []int{1, 2}), ModelAt: cursor}
			for _, i := range tc.queued {
				st.Events = append(st.Events, evs[i])
			}
			ordEvs := uEvents(t, ord.Stream, 2)
			f.set(st, uState(t, ord, ordEvs, 0))

			rep := f.w.RunApply(context.Background(), late, ord)

			assert.Equal(t, uJobs("rewind", late), rep.Next, "a rewind, not a bootstrap")
			f.noWrite(late, "nothing is written for a pair that needs a rewind")
			uFolded(t, f.write(ord), ordEvs, 0, 2)
			assert.Equal(t, []int{1, 2}, f.appliedNs(), "only the other pair's events are applied")
			assert.Empty(t, f.store.MarkFailedCalls())
			f.noLockTaken()
			f.settled()
		})
	}
}

// A bootstrap follows only for a pair with a model, no snapshot and at least EveryNEvents
// events since (a history long enough for a snapshot to pay), snapshots enabled. Every
// other pair is applied at once.
func TestUnitApplyBootstrapOnlyForLongHistoryWithoutSnapshot(t *testing.T) {
	t.Parallel()
	const every = 4
	for _, tc := range []struct {
		name      string
		applied   int  // events in the model
		since     int  // counted since the last snapshot
		snapshot  bool // the pair has one
		disabled  bool
		bootstrap bool
	}{
		{"long history, no snapshot", 5, 5, false, false, true},
		{"exactly EveryNEvents, no snapshot", every, every, false, false, true},
		{"short history (EveryNEvents-1), no snapshot", every - 1, every - 1, false, false, false},
		{"long history with a snapshot", 9, 5, true, false, false},
		{"snapshots disabled", 9, 9, false, true, false},
		{"brand-new pair", 0, 0, false, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newUFix(t, true, func(c *worker.Config) {
				c.Snapshots = worker.SnapshotOptions{Disabled: tc.disabled, EveryNEvents: every}
			})
			p := uPair(t)
			evs := uEvents(t, p.Stream, tc.applied+1) // one queued event
			st := uState(t, p, evs, tc.applied)
			st.SinceSnapshot = tc.since
			if tc.snapshot {
				st.Snapshots = []uuid.UUID{evs[tc.applied-tc.since-1].ID}
			}
			f.set(st)

			rep := f.w.RunApply(context.Background(), p)

			if tc.bootstrap {
				assert.Equal(t, uJobs("bootstrap", p), rep.Next)
				f.noWrite(p, "the pair waits for its bootstrap")
				assert.Empty(t, f.appliedNs())
			} else {
				assert.Empty(t, rep.Next, "no follow-up")
				wr := f.write(p)
				uFolded(t, wr, evs, tc.applied, tc.applied+1)
				if tc.disabled {
					assert.Empty(t, wr.Snapshots, "snapshots disabled: none taken")
				}
			}
			f.noLockTaken() // the bootstrap's lock is its own job's
			assert.Empty(t, f.store.BootstrapCalls(), "the apply job does not bootstrap itself")
		})
	}
}

// One group of four pairs: the ordinary one is written; the one with a late event and the
// one due for a bootstrap are left to follow-ups, in the group's order; the one under
// another instance's lock is left alone.
func TestUnitApplyMixedGroup(t *testing.T) {
	t.Parallel()
	f := newUFix(t, true, func(c *worker.Config) { c.Snapshots.EveryNEvents = 3 })
	late := f.late()
	boot, locked, ord := uPair(t), uPair(t), uPair(t)
	bootEvs, lockedEvs, ordEvs := uEvents(t, boot.Stream, 4), uEvents(t, locked.Stream, 2), uEvents(t, ord.Stream, 3)
	lockedSt := uState(t, locked, lockedEvs, 0)
	lockedSt.LockHolder = utNewID(t)
	ordSt := uState(t, ord, ordEvs, 1)
	ordSt.SinceSnapshot, ordSt.Snapshots = 0, []uuid.UUID{ordEvs[0].ID}
	f.set(uLateState(t, late), uState(t, boot, bootEvs, 3), lockedSt, ordSt)

	rep := f.w.RunApply(context.Background(), late.p, boot, locked, ord)

	assert.Equal(t, [][]worker.Pair{{late.p, boot, locked, ord}}, f.applyCalls(), "one transaction")
	assert.Equal(t, append(uJobs("rewind", late.p), uJobs("bootstrap", boot)...), rep.Next)
	require.Len(t, f.allWrites(), 1, "only the ordinary pair is written")
	uFolded(t, f.write(ord), ordEvs, 1, 3)
	assert.Equal(t, []int{2, 3}, f.appliedNs())
	assert.Empty(t, f.store.MarkFailedCalls())
	f.noLockTaken()
	f.settled()
}

// A pair under another instance's stream lock receives no live events, and gets no
// follow-up (whoever holds the lock is rewinding, bootstrapping or purging it); one under
// this instance's own lock is applied.
func TestUnitApplyPairLockedByAnotherInstanceIsNotWritten(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		holder  func(f *uFix) uuid.UUID
		late    bool // a late event is queued too
		written bool
	}{
		{"another instance", func(f *uFix) uuid.UUID { return utNewID(f.t) }, false, false},
		{"another instance, a late event queued", func(f *uFix) uuid.UUID { return utNewID(f.t) }, true, false},
		{"this instance", func(f *uFix) uuid.UUID { return f.instance }, false, true},
		{"nobody", func(*uFix) uuid.UUID { return uuid.Nil }, false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newUFix(t, true, nil)
			p, other := uPair(t), uPair(t)
			evs, otherEvs := uEvents(t, p.Stream, 3), uEvents(t, other.Stream, 1)
			st := uState(t, p, evs, 1)
			if tc.late {
				sc := f.late()
				p, st = sc.p, uLateState(t, sc)
			}
			st.LockHolder = tc.holder(f)
			f.set(st, uState(t, other, otherEvs, 0))

			rep := f.w.RunApply(context.Background(), p, other)

			if tc.written {
				uFolded(t, f.write(p), evs, 1, 3)
			} else {
				f.noWrite(p, "a pair locked elsewhere is left alone, its events queued")
				assert.Equal(t, []int{1}, f.appliedNs(), "its events are not applied")
			}
			uFolded(t, f.write(other), otherEvs, 0, 1)
			assert.Empty(t, rep.Next, "no follow-up either")
			assert.Empty(t, f.store.MarkFailedCalls(), "being locked elsewhere is not a failure")
			f.noLockTaken()
		})
	}
}

// An Apply that fails (error, panic, a model that is not JSON) on event k ends its pair's
// batch: the events before k are written, k and the later ones are not applied, and the
// failure, naming k, is written with them. The other pairs of the group are not affected.
func TestUnitApplyErrorCommitsTheEventsBeforeIt(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		failAt int // 1-based
		panics bool
		want   string
	}{
		{"error on the third", 3, false, "bad event 3"},
		{"panic on the third", 3, true, "bad event 3"},
		{"error on the first", 1, false, "bad event 1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newUFix(t, false, nil)
			bad, fine := uPair(t), uPair(t)
			evs, fineEvs := uEvents(t, bad.Stream, 5), uEvents(t, fine.Stream, 4)
			f.set(uState(t, bad, evs, 0), uState(t, fine, fineEvs, 0))
			f.mu.Lock()
			f.evHook = func(ev worker.Event, n int) error {
				if ev.StreamID == bad.Stream && n == tc.failAt {
					if tc.panics {
						panic(fmt.Sprintf("bad event %d", n))
					}
					return fmt.Errorf("bad event %d", n)
				}
				return nil
			}
			f.mu.Unlock()

			rep := f.w.RunApply(context.Background(), bad, fine)

			wr := f.write(bad)
			k := tc.failAt - 1
			if k > 0 {
				uFolded(t, wr, evs, 0, k)
				assert.Equal(t, k, wr.SinceSnapshot)
			} else {
				assert.Empty(t, wr.Applied, "nothing applied before the failing event")
			}
			assert.NotContains(t, wr.Applied, evs[k].ID, "the failing event is not committed")
			assert.Contains(t, wr.Failure.Cause, tc.want, "the failure is recorded with the pair's write")
			assert.Contains(t, wr.Failure.Cause, evs[k].ID.String(), "the failure names the event")
			// A run of events applied in one call (JSONPerspective's ApplyBatch) that fails is
			// applied again event by event, which finds the failing one: the events before it
			// may be applied twice, the ones after it never.
			f.mu.Lock()
			badApplied, fineApplied := slices.Clone(f.appliedOf[bad.Stream]), slices.Clone(f.appliedOf[fine.Stream])
			f.mu.Unlock()
			assert.LessOrEqual(t, slices.Max(badApplied), tc.failAt, "the events after the failing one are not applied")
			slices.Sort(badApplied)
			assert.Equal(t, uSeq(1, tc.failAt), slices.Compact(badApplied), "every event up to the failing one is applied")
			assert.Equal(t, uSeq(1, 4), fineApplied, "the other pair's events are applied once, in order")
			uFolded(t, f.write(fine), fineEvs, 0, 4)
			assert.Empty(t, f.write(fine).Failure.Cause)
			assert.Empty(t, f.store.MarkFailedCalls(), "recorded in the apply transaction, not apart")
			assert.Len(t, f.store.ApplyCalls(), 1, "one transaction: a failing event does not fail the group")
			assert.Empty(t, rep.Next)
			assert.Contains(t, f.logs.String(), tc.want, "the failure is logged")
		})
	}
	// Only the models the worker stores (the last of a batch, and snapshots) are checked to
	// be JSON; when one is not, the fold runs again checking each, to name the event at fault.
	notJSON := func(badAt int) *mocks.PerspectiveMock {
		return &mocks.PerspectiveMock{
			NameFunc: func() string { return utName },
			ApplyFunc: func(_ context.Context, _ json.RawMessage, ev worker.Event) (json.RawMessage, error) {
				if string(ev.Data) == fmt.Sprintf(`{"n":%d}`, badAt) {
					return json.RawMessage(`{"seq":[1,2`), nil
				}
				return json.RawMessage(`{"seq":[1]}`), nil
			},
		}
	}
	t.Run("stored model that is not JSON", func(t *testing.T) {
		t.Parallel()
		persp := notJSON(3)
		f := newUFix(t, false, func(c *worker.Config) { c.Perspectives = []worker.Perspective{persp} })
		p := uPair(t)
		evs := uEvents(t, p.Stream, 3)
		f.set(uState(t, p, evs, 0))

		f.w.RunApply(context.Background(), p)

		wr := f.write(p)
		assert.Equal(t, uIDs(evs[:2]), wr.Applied)
		assert.JSONEq(t, `{"seq":[1]}`, string(wr.Model), "the model before the bad one")
		assert.Contains(t, wr.Failure.Cause, "not valid JSON")
		assert.Contains(t, wr.Failure.Cause, evs[2].ID.String())
		assert.Len(t, persp.ApplyCalls(), 6, "a second, checking pass finds the event at fault")
	})
	t.Run("intermediate model that is not JSON", func(t *testing.T) {
		t.Parallel()
		persp := notJSON(2)
		f := newUFix(t, false, func(c *worker.Config) { c.Perspectives = []worker.Perspective{persp} })
		p := uPair(t)
		evs := uEvents(t, p.Stream, 3)
		f.set(uState(t, p, evs, 0))

		f.w.RunApply(context.Background(), p)

		wr := f.write(p)
		assert.Equal(t, uIDs(evs), wr.Applied, "a model never stored is not checked: the next Apply replaced it")
		assert.Empty(t, wr.Failure.Cause)
		assert.Len(t, persp.ApplyCalls(), 3)
	})
}

// A model that does not match the cursor (behind it, or missing) is not built on: the pair
// gets a write with only the failure.
func TestUnitApplyModelInconsistentWithCursorIsAFailure(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		corrupt func(st *worker.PairState, evs []worker.Event)
	}{
		{"model behind the cursor", func(st *worker.PairState, evs []worker.Event) { st.ModelAt = evs[0].ID }},
		{"model missing", func(st *worker.PairState, _ []worker.Event) { st.Model, st.ModelAt = nil, uuid.Nil }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newUFix(t, false, nil)
			bad, ord := uPair(t), uPair(t)
			evs, ordEvs := uEvents(t, bad.Stream, 3), uEvents(t, ord.Stream, 2)
			st := uState(t, bad, evs, 2)
			tc.corrupt(&st, evs)
			f.set(st, uState(t, ord, ordEvs, 1))

			rep := f.w.RunApply(context.Background(), bad, ord)

			assert.Equal(t, worker.PairWrite{Pair: bad, Failure: f.write(bad).Failure}, f.write(bad),
				"a write with the failure only: no model, cursor, snapshot or applied event")
			assert.Contains(t, f.write(bad).Failure.Cause, "model is at event")
			assert.Equal(t, []int{2}, f.appliedNs(), "the bad pair's events are not applied")
			uFolded(t, f.write(ord), ordEvs, 1, 2)
			assert.Empty(t, rep.Next)
			assert.Contains(t, f.logs.String(), "model is at event")
		})
	}
}

// The pairs Apply found held by another transaction are reported busy (the next claim
// skips them); the others are written.
func TestUnitApplyBusyPairsAreReported(t *testing.T) {
	t.Parallel()
	f := newUFix(t, false, nil)
	held, free := uPair(t), uPair(t)
	freeEvs := uEvents(t, free.Stream, 2)
	f.set(uState(t, held, uEvents(t, held.Stream, 2), 0), uState(t, free, freeEvs, 0))
	f.setBusy(held)

	rep := f.w.RunApply(context.Background(), held, free)

	assert.Equal(t, []worker.Pair{held}, rep.Busy)
	f.noWrite(held, "a busy pair is not written")
	uFolded(t, f.write(free), freeEvs, 0, 2)
	assert.Len(t, f.store.ApplyCalls(), 1, "a busy pair is not retried at once")
	assert.Empty(t, f.store.MarkFailedCalls(), "being busy is not a failure")
}

// A group whose transaction fails wrote nothing: each of its pairs is then applied in a
// transaction of its own, and only a pair whose own transaction fails is marked failed.
func TestUnitApplyFailedGroupIsRetriedOnePairAtATime(t *testing.T) {
	t.Parallel()
	for _, panics := range []bool{false, true} {
		t.Run(fmt.Sprintf("panic %v", panics), func(t *testing.T) {
			t.Parallel()
			f := newUFix(t, false, nil)
			a, b, c := uPair(t), uPair(t), uPair(t)
			aEvs, bEvs, cEvs := uEvents(t, a.Stream, 2), uEvents(t, b.Stream, 3), uEvents(t, c.Stream, 1)
			f.set(uState(t, a, aEvs, 0), uState(t, b, bEvs, 1), uState(t, c, cEvs, 0))
			f.applyErr = func(pairs []worker.Pair) error {
				switch {
				case len(pairs) > 1 && panics:
					panic("driver bug in the group write")
				case len(pairs) > 1:
					return errors.New("connection reset")
				case pairs[0] == b:
					return errors.New("b breaks its transaction")
				}
				return nil
			}

			rep := f.w.RunApply(context.Background(), a, b, c)

			assert.Equal(t, [][]worker.Pair{{a, b, c}, {a}, {b}, {c}}, f.applyCalls(),
				"the group once, then each pair alone, in order")
			f.mu.Lock()
			last := slices.Concat(f.writes[1:]...) // what the single transactions decided
			f.mu.Unlock()
			require.Len(t, last, 3)
			uFolded(t, last[0], aEvs, 0, 2)
			uFolded(t, last[2], cEvs, 0, 1)
			f.failed(b, "b breaks its transaction")
			assert.Contains(t, f.logs.String(), "group transaction failed")
			if panics {
				assert.Contains(t, f.logs.String(), "driver bug in the group write", "the panic is logged")
			}
			assert.Empty(t, rep.Next)
			f.settled()
		})
	}
	t.Run("a single pair is not retried", func(t *testing.T) {
		t.Parallel()
		f := newUFix(t, false, nil)
		p := uPair(t)
		f.set(uState(t, p, uEvents(t, p.Stream, 2), 0))
		f.applyErr = func([]worker.Pair) error { return errors.New("connection reset") }

		f.w.RunApply(context.Background(), p)

		assert.Len(t, f.store.ApplyCalls(), 1)
		f.failed(p, "connection reset")
	})
}

// A database that went away (a restart, a failover) is no pair's failure: nothing is
// recorded (no backoff), a group is not retried pair by pair, and the pairs are claimed
// again at the next claim. A failure of the pair's own stays one.
func TestUnitApplyDatabaseUnavailableIsNoPairsFailure(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		err  error
	}{
		{"admin shutdown", &pgconn.PgError{Code: "57P01", Message: "terminating connection due to administrator command"}},
		{"crash shutdown", fmt.Errorf("write models: %w", &pgconn.PgError{Code: "57P02"})},
		{"starting up", &pgconn.PgError{Code: "57P03", Message: "the database system is starting up"}},
		{"connection exception", &pgconn.PgError{Code: "08006"}},
		{"standby not yet promoted", &pgconn.PgError{Code: "25006", Message: "cannot execute UPDATE in a read-only transaction"}},
		{"connection lost mid-statement", fmt.Errorf("read the queue: %w", io.ErrUnexpectedEOF)},
		{"closed connection", fmt.Errorf("lock: %w", pgconn.ErrConnClosed)},
		{"refused", &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}},
	} {
		for _, n := range []int{1, 3} {
			t.Run(fmt.Sprintf("%s, %d pairs", tc.name, n), func(t *testing.T) {
				t.Parallel()
				f := newUFix(t, false, nil)
				pairs := f.queuedPairs(t, n)
				f.applyErr = func([]worker.Pair) error { return tc.err }

				rep := f.w.RunApply(context.Background(), pairs...)

				assert.Len(t, f.store.ApplyCalls(), 1, "not retried pair by pair")
				assert.Empty(t, f.store.MarkFailedCalls(), "no backoff")
				assert.Contains(t, f.logs.String(), "database unavailable")
				assert.Empty(t, rep.Next)
				assert.Empty(t, rep.Busy)
				assert.ElementsMatch(t, pairs, rep.CutOff, "reported to the loop, which counts them")
			})
		}
	}
	t.Run("a pair cut off too often in a row fails", func(t *testing.T) {
		t.Parallel()
		f := newUFix(t, false, nil)
		a, b := uPair(t), uPair(t)
		f.set(uState(t, a, uEvents(t, a.Stream, 2), 0), uState(t, b, uEvents(t, b.Stream, 2), 0))
		f.applyErr = func([]worker.Pair) error { return fmt.Errorf("apply: %w", io.ErrUnexpectedEOF) }

		rep := f.w.RunApplyStrict(context.Background(), []worker.Pair{a}, a, b)

		assert.Equal(t, [][]worker.Pair{{a, b}, {a}, {b}}, f.applyCalls(), "a strict pair in the group: each pair alone")
		f.failed(a, "unexpected EOF")
		for _, c := range f.store.MarkFailedCalls() {
			assert.Equal(t, a, c.P, "only the strict pair is backed off")
		}
		assert.Equal(t, []worker.Pair{b}, rep.CutOff)
	})
	t.Run("a perspective's error is still a failure", func(t *testing.T) {
		t.Parallel()
		f := newUFix(t, false, nil)
		p := uPair(t)
		f.set(uState(t, p, uEvents(t, p.Stream, 2), 0))
		f.applyErr = func([]worker.Pair) error { return &pgconn.PgError{Code: "22P02", Message: "invalid input syntax"} }
		f.w.RunApply(context.Background(), p)
		f.failed(p, "invalid input syntax")
	})
}

// queuedPairs is n new pairs, each with two queued events and no model.
func (f *uFix) queuedPairs(t *testing.T, n int) []worker.Pair {
	t.Helper()
	var pairs []worker.Pair
	for range n {
		p := uPair(t)
		f.set(uState(t, p, uEvents(t, p.Stream, 2), 0))
		pairs = append(pairs, p)
	}
	return pairs
}

// A cancelled context (shutdown) is no pair's failure: nothing is recorded, and a group is
// not retried pair by pair.
func TestUnitApplyCancelledRecordsNoFailure(t *testing.T) {
	t.Parallel()
	for _, n := range []int{1, 3} {
		t.Run(fmt.Sprintf("%d pairs", n), func(t *testing.T) {
			t.Parallel()
			f := newUFix(t, false, nil)
			pairs := f.queuedPairs(t, n)
			ctx, cancel := context.WithCancel(context.Background())
			cancel()

			f.w.RunApply(ctx, pairs...)

			assert.Len(t, f.store.ApplyCalls(), 1, "no retry of a cancelled group")
			assert.Empty(t, f.store.MarkFailedCalls(), "a shutdown is not a failure")
			f.settled()
		})
	}
}

// A pair of a perspective this worker does not run is left alone, whether in the job or
// in what the Store read.
func TestUnitApplyIgnoresPerspectivesItDoesNotRun(t *testing.T) {
	t.Parallel()
	t.Run("only unknown pairs: no transaction", func(t *testing.T) {
		t.Parallel()
		f := newUFix(t, false, nil)
		rep := f.w.RunApply(context.Background(), worker.Pair{Stream: utNewID(t), Perspective: "other"})
		assert.Empty(t, f.store.ApplyCalls())
		assert.Empty(t, rep.Busy)
		f.settled()
	})
	t.Run("mixed: only the known pair", func(t *testing.T) {
		t.Parallel()
		f := newUFix(t, false, nil)
		known := uPair(t)
		unknown := worker.Pair{Stream: utNewID(t), Perspective: "other"}
		evs := uEvents(t, known.Stream, 1)
		f.set(uState(t, known, evs, 0))

		f.w.RunApply(context.Background(), known, unknown)

		assert.Equal(t, [][]worker.Pair{{known}}, f.applyCalls())
		uFolded(t, f.write(known), evs, 0, 1)
	})
	t.Run("a state of an unknown perspective is not decided", func(t *testing.T) {
		t.Parallel()
		f := newUFix(t, false, nil)
		known := uPair(t)
		unknown := worker.Pair{Stream: utNewID(t), Perspective: "other"}
		evs := uEvents(t, known.Stream, 1)
		unknownSt := uState(t, unknown, uEvents(t, unknown.Stream, 1), 0)
		f.store.ApplyFunc = func(_ context.Context, _ worker.ApplyRequest, decide func([]worker.PairState) []worker.PairWrite) ([]worker.Pair, error) {
			writes := decide([]worker.PairState{unknownSt, uState(t, known, evs, 0)})
			f.mu.Lock()
			f.writes = append(f.writes, writes)
			f.mu.Unlock()
			return nil, nil
		}

		f.w.RunApply(context.Background(), known)

		f.noWrite(unknown, "not this worker's perspective")
		uFolded(t, f.write(known), evs, 0, 1)
	})
}

// What counts as the database going away, and what stays the pair's failure: anything a
// perspective's Apply returned (even an io.EOF of its own decoder or a timeout of a call it
// made), and a context's end.
func TestUnitConnectionErrorClassification(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		err  error
		want bool
	}{
		{"admin shutdown", &pgconn.PgError{Code: "57P01"}, true},
		{"connection failure", fmt.Errorf("claim: %w", &pgconn.PgError{Code: "08006"}), true},
		{"standby", &pgconn.PgError{Code: "25006"}, true},
		{"lost mid-statement", fmt.Errorf("read: %w", io.ErrUnexpectedEOF), true},
		{"closed connection", fmt.Errorf("lock: %w", pgconn.ErrConnClosed), true},
		{"dial refused", &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}, true},
		{"a statement's error", &pgconn.PgError{Code: "23505"}, false},
		{"deadline", fmt.Errorf("rewind: %w", context.DeadlineExceeded), false},
		{"cancelled", context.Canceled, false},
		{"Apply's own EOF", fmt.Errorf("replay event: %w", worker.PerspectiveError(io.EOF)), false},
		{"Apply's own timeout", worker.PerspectiveError(&net.OpError{Op: "read", Err: syscall.ECONNRESET}), false},
		{"Apply's own deadline", worker.PerspectiveError(context.DeadlineExceeded), false},
		{"nil", nil, false},
	} {
		assert.Equal(t, tc.want, worker.IsConnectionError(tc.err), tc.name)
	}
}
