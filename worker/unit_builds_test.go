package worker_test

// Unit tests of versions and builds, on mocks (no database): the build decisions
// (registration, rebuild, the promotion lag), the catch-up's fold of a page as a StoreMock
// hands it over, the loop's look at the builds every PollInterval (maintain, driven by
// Start inside a testing/synctest bubble), and the Config rules of versions and catch-up
// pages. What the Store then does with a catch-up page's writes is SQL, tested on
// PostgreSQL.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"testing/synctest"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/mocks"
	"github.com/perspectives-go/perspectives/worker"
)

// ---------------------------------------------------------------------------------------
// Helpers.

// ubVersioned is a perspective with a Version method.
type ubVersioned struct {
	worker.Perspective
	v int
}

func (p ubVersioned) Version() int { return p.v }

// ubPersp is utPerspective at version v: without a Version method for v = 0 (version 1).
func ubPersp(name string, v int) worker.Perspective {
	p := utPerspective(name, nil)
	if v == 0 {
		return p
	}
	return ubVersioned{Perspective: p, v: v}
}

// ubBuild is build n of version v of utName, in state, caught up when done.
func ubBuild(v, n int, state string, done bool) worker.Build {
	return worker.Build{Key: worker.BuildKey(utName, v, n), Perspective: utName, Version: v, N: n, State: state, CatchUpDone: done}
}

// ubRecorder is utPerspective that records the events it is asked to apply, per stream,
// and fails ("error") or panics ("panic") on the events of fail. With yield it lets other
// goroutines run between events.
type ubRecorder struct {
	inner worker.Perspective
	yield bool

	mu      sync.Mutex
	applied map[uuid.UUID][]uuid.UUID
	fail    map[uuid.UUID]string
}

func newUBRecorder() *ubRecorder {
	return &ubRecorder{inner: utPerspective(utName, nil), applied: map[uuid.UUID][]uuid.UUID{}, fail: map[uuid.UUID]string{}}
}

func (r *ubRecorder) Name() string { return utName }

func (r *ubRecorder) Apply(ctx context.Context, model json.RawMessage, ev worker.Event) (json.RawMessage, error) {
	r.mu.Lock()
	r.applied[ev.StreamID] = append(r.applied[ev.StreamID], ev.ID)
	how := r.fail[ev.ID]
	r.mu.Unlock()
	if r.yield {
		runtime.Gosched()
	}
	switch how {
	case "error":
		return nil, fmt.Errorf("bad event %s", ev.ID)
	case "panic":
		panic(fmt.Sprintf("bad event %s", ev.ID))
	}
	return r.inner.Apply(ctx, model, ev)
}

func (r *ubRecorder) failOn(id uuid.UUID, how string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.fail[id] = how
}

// appliedTo is the events of stream the perspective was asked to apply, in order.
func (r *ubRecorder) appliedTo(stream uuid.UUID) []uuid.UUID {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.applied[stream])
}

// ubCatchUp is a worker on a StoreMock whose CatchUp hands fold the page set with serve
// (its Key the request's) and keeps the writes fold returns.
type ubCatchUp struct {
	t        *testing.T
	instance uuid.UUID
	persp    *ubRecorder
	store    *mocks.StoreMock
	logs     *utLogBuf
	w        *worker.Worker

	mu     sync.Mutex
	page   worker.CatchUpPage
	noFold bool // CatchUp reads nothing (NotHeld)
	result worker.CatchUpResult
	err    error
	writes [][]worker.PairWrite
}

func newUBCatchUp(t *testing.T, cfg func(c *worker.Config)) *ubCatchUp {
	t.Helper()
	f := &ubCatchUp{t: t, instance: utNewID(t), persp: newUBRecorder(), logs: &utLogBuf{}}
	f.store = &mocks.StoreMock{
		CatchUpFunc: func(ctx context.Context, req worker.CatchUpRequest, fold func(worker.CatchUpPage) []worker.PairWrite) (worker.CatchUpResult, error) {
			f.mu.Lock()
			page, noFold, res, err := f.page, f.noFold, f.result, f.err
			f.mu.Unlock()
			page.Key = req.Key
			if !noFold {
				writes := fold(page)
				f.mu.Lock()
				f.writes = append(f.writes, writes)
				f.mu.Unlock()
			}
			return res, err
		},
		MarkFailedFunc: func(context.Context, worker.Pair, worker.Failure, func(int) worker.FailureAction) (worker.FailureAction, error) {
			return worker.FailureRetry, nil
		},
	}
	c := worker.Config{
		InstanceID:   f.instance,
		Perspectives: []worker.Perspective{f.persp},
		Logger:       utLogger(f.logs),
	}
	if cfg != nil {
		cfg(&c)
	}
	w, err := worker.NewWithStore(f.store, c)
	require.NoError(t, err)
	f.w = w
	return f
}

// serve makes CatchUp hand fold a page of the streams' events (each stream's in ID order,
// the streams in the order given), with their states; continued names the stream the
// previous page left unfinished.
func (f *ubCatchUp) serve(states map[uuid.UUID]worker.PairState, continued uuid.UUID, streams ...[]worker.Event) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.page = worker.CatchUpPage{Events: slices.Concat(streams...), Streams: states, Continued: continued}
}

func (f *ubCatchUp) returns(res worker.CatchUpResult, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.result, f.err = res, err
}

// pageWrites is the writes of the one page folded.
func (f *ubCatchUp) pageWrites() []worker.PairWrite {
	f.t.Helper()
	f.mu.Lock()
	defer f.mu.Unlock()
	require.Len(f.t, f.writes, 1, "one page folded")
	return f.writes[0]
}

// write is the one write of stream in the page.
func (f *ubCatchUp) write(stream uuid.UUID) worker.PairWrite {
	f.t.Helper()
	var out []worker.PairWrite
	for _, wr := range f.pageWrites() {
		if wr.Stream == stream {
			out = append(out, wr)
		}
	}
	require.Len(f.t, out, 1, "one write for stream %s", stream)
	assert.Equal(f.t, utName, out[0].Perspective, "the write is keyed by the build key")
	return out[0]
}

// ubFree is the state of a stream the catch-up may fold: locked by this transaction, no
// stream lock, no cursor position.
func ubFree(stream uuid.UUID) worker.PairState {
	return worker.PairState{Pair: worker.Pair{Stream: stream, Perspective: utName}}
}

// ubQueuedOnly checks that wr queues the stream from from on and writes nothing else.
func ubQueuedOnly(t *testing.T, wr worker.PairWrite, from uuid.UUID) {
	t.Helper()
	assert.Equal(t, worker.PairWrite{Pair: wr.Pair, EnqueueFrom: from}, wr,
		"only EnqueueFrom: the stream is left to the normal path")
}

// ubMinV7 is the lowest UUIDv7 there can be (time 0, version 7, variant 10, all else 0).
var ubMinV7 = uuid.UUID{6: 0x70, 8: 0x80}

// ---------------------------------------------------------------------------------------
// Build decisions.

// A build's key is the perspective's name for its first build of version 1, else
// name@v<version>.<n>; no two builds share a key.
func TestUnitBuildKey(t *testing.T) {
	t.Parallel()
	assert.Equal(t, "seq", worker.BuildKey("seq", 1, 1))
	assert.Equal(t, "seq@v1.2", worker.BuildKey("seq", 1, 2))
	assert.Equal(t, "seq@v2.1", worker.BuildKey("seq", 2, 1))
	assert.Equal(t, "seq@v12.3", worker.BuildKey("seq", 12, 3))
	seen := map[string][2]int{}
	for v := 1; v <= 25; v++ {
		for n := 1; n <= 25; n++ {
			k := worker.BuildKey("seq", v, n)
			prev, dup := seen[k]
			assert.False(t, dup, "key %q of v%d.%d is also v%d.%d's", k, v, n, prev[0], prev[1])
			seen[k] = [2]int{v, n}
		}
	}
	assert.NotEqual(t, worker.BuildKey("a", 1, 2), worker.BuildKey("b", 1, 2), "the name is part of the key")
}

// Registration adds the version's next build unless one of it is building or active, or
// a newer version is active: active at once when nothing is active, else building beside
// the active one.
func TestUnitBuildPlanRegistration(t *testing.T) {
	t.Parallel()
	const (
		act = worker.BuildActive
		bld = worker.BuildBuilding
		ret = worker.BuildRetired
	)
	for _, tc := range []struct {
		name    string
		version int
		builds  []worker.Build
		want    *worker.Build // nil: none
	}{
		{"first registration of version 1", 1, nil, &worker.Build{Key: "seq", Perspective: utName, Version: 1, N: 1, State: act}},
		{"first registration of version 3", 3, nil, &worker.Build{Key: "seq@v3.1", Perspective: utName, Version: 3, N: 1, State: act}},
		{"new version beside the active one", 2, []worker.Build{ubBuild(1, 1, act, true)},
			&worker.Build{Key: "seq@v2.1", Perspective: utName, Version: 2, N: 1, State: bld}},
		{"new version beside an active rebuild", 2, []worker.Build{ubBuild(1, 1, ret, true), ubBuild(1, 2, act, true)},
			&worker.Build{Key: "seq@v2.1", Perspective: utName, Version: 2, N: 1, State: bld}},
		{"version already building", 2, []worker.Build{ubBuild(1, 1, act, true), ubBuild(2, 1, bld, false)}, nil},
		{"version already building, caught up", 2, []worker.Build{ubBuild(2, 1, bld, true), ubBuild(1, 1, act, true)}, nil},
		{"version already active", 2, []worker.Build{ubBuild(1, 1, ret, true), ubBuild(2, 1, act, true)}, nil},
		{"version 1 already active", 1, []worker.Build{ubBuild(1, 1, act, false)}, nil},
		{"a rebuild of the version is building", 1, []worker.Build{ubBuild(1, 1, act, true), ubBuild(1, 2, bld, false)}, nil},
		{"newer version active", 2, []worker.Build{ubBuild(3, 1, act, true)}, nil},
		{"newer version active, this one retired", 1, []worker.Build{ubBuild(1, 1, ret, true), ubBuild(2, 1, act, true)}, nil},
		{"newer version active, older building", 2, []worker.Build{ubBuild(3, 1, act, true), ubBuild(2, 1, ret, true), ubBuild(1, 1, ret, true)}, nil},
		{"retired build of the version, another active", 2, []worker.Build{ubBuild(2, 1, ret, true), ubBuild(1, 1, act, true)},
			&worker.Build{Key: "seq@v2.2", Perspective: utName, Version: 2, N: 2, State: bld}},
		{"retired build of the version, none active", 2, []worker.Build{ubBuild(2, 1, ret, true)},
			&worker.Build{Key: "seq@v2.2", Perspective: utName, Version: 2, N: 2, State: act}},
		{"the highest retired build counts, not how many", 1, []worker.Build{ubBuild(1, 3, ret, true), ubBuild(1, 1, ret, true)},
			&worker.Build{Key: "seq@v1.4", Perspective: utName, Version: 1, N: 4, State: act}},
		{"older retired versions do not count", 3, []worker.Build{ubBuild(1, 5, ret, true), ubBuild(2, 2, act, true)},
			&worker.Build{Key: "seq@v3.1", Perspective: utName, Version: 3, N: 1, State: bld}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			before := slices.Clone(tc.builds)
			got := worker.PlanRegistration(utName, tc.version, tc.builds)
			assert.Equal(t, before, tc.builds, "the builds are not changed")
			if tc.want == nil {
				assert.Nil(t, got, "no build added")
				return
			}
			require.NotNil(t, got)
			assert.Equal(t, *tc.want, *got, "a new build needs its catch-up (CatchUpDone false)")
			assert.Equal(t, worker.BuildKey(utName, tc.want.Version, tc.want.N), got.Key)
			for _, b := range tc.builds {
				assert.NotEqual(t, b.Key, got.Key, "the new build's key is its own")
			}
		})
	}
}

// A rebuild is the next build of the active version, building; none while one of it is
// building; an unregistered perspective is invalid input, one with nothing active an error.
func TestUnitBuildPlanRebuild(t *testing.T) {
	t.Parallel()
	const (
		act = worker.BuildActive
		bld = worker.BuildBuilding
		ret = worker.BuildRetired
	)
	for _, tc := range []struct {
		name     string
		builds   []worker.Build
		want     *worker.Build
		err      bool
		argument bool // the error wraps locker.ErrInvalidArgument
	}{
		{"first rebuild", []worker.Build{ubBuild(1, 1, act, true)},
			&worker.Build{Key: "seq@v1.2", Perspective: utName, Version: 1, N: 2, State: bld}, false, false},
		{"rebuild of a later version", []worker.Build{ubBuild(1, 1, ret, true), ubBuild(2, 1, act, true)},
			&worker.Build{Key: "seq@v2.2", Perspective: utName, Version: 2, N: 2, State: bld}, false, false},
		{"after retired rebuilds: the highest number counts", []worker.Build{ubBuild(2, 4, ret, true), ubBuild(2, 3, act, true), ubBuild(2, 1, ret, true)},
			&worker.Build{Key: "seq@v2.5", Perspective: utName, Version: 2, N: 5, State: bld}, false, false},
		{"another version building does not stop it", []worker.Build{ubBuild(1, 1, act, true), ubBuild(2, 1, bld, false)},
			&worker.Build{Key: "seq@v1.2", Perspective: utName, Version: 1, N: 2, State: bld}, false, false},
		{"rebuild under way", []worker.Build{ubBuild(1, 1, act, true), ubBuild(1, 2, bld, false)}, nil, false, false},
		{"caught-up rebuild waiting for promotion", []worker.Build{ubBuild(1, 2, bld, true), ubBuild(1, 1, act, true)}, nil, false, false},
		{"not registered", nil, nil, true, true},
		{"nothing active", []worker.Build{ubBuild(1, 1, ret, true), ubBuild(2, 1, bld, false)}, nil, true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got, err := worker.PlanRebuild(utName, tc.builds)
			if tc.err {
				require.Error(t, err)
				assert.Nil(t, got)
				assert.Contains(t, err.Error(), utName, "the error names the perspective")
				if tc.argument {
					assert.ErrorIs(t, err, locker.ErrInvalidArgument)
				}
				return
			}
			require.NoError(t, err)
			if tc.want == nil {
				assert.Nil(t, got, "no second rebuild")
				return
			}
			require.NotNil(t, got)
			assert.Equal(t, *tc.want, *got)
			for _, b := range tc.builds {
				assert.NotEqual(t, b.Key, got.Key, "the rebuild's key is its own")
			}
		})
	}
}

// A build has caught up when its oldest queued event is at most a second older than the
// active build's.
func TestUnitBuildCaughtUp(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		cand, active time.Duration
		want         bool
	}{
		{0, 0, true},
		{time.Second, 0, true},
		{time.Second + time.Nanosecond, 0, false},
		{5 * time.Second, 4 * time.Second, true},
		{5*time.Second + time.Nanosecond, 4 * time.Second, false},
		{time.Minute, 0, false},
		{0, time.Minute, true},
		{30 * time.Second, time.Minute, true},
	} {
		assert.Equal(t, tc.want, worker.CaughtUp(tc.cand, tc.active), "candidate %s, active %s", tc.cand, tc.active)
	}
}

// ---------------------------------------------------------------------------------------
// The catch-up's fold of a page.

// Each stream of a page is folded from nothing, in ID order, into its own model; the
// write carries the events, the model, the cursor and the count since a snapshot.
func TestUnitCatchUpFoldsEachStreamInOrder(t *testing.T) {
	t.Parallel()
	f := newUBCatchUp(t, func(c *worker.Config) { c.Snapshots.EveryNEvents = 4 })
	a, b, c := utNewID(t), utNewID(t), utNewID(t)
	evA, evB, evC := uEvents(t, a, 3), uEvents(t, b, 9), uEvents(t, c, 1)
	f.serve(map[uuid.UUID]worker.PairState{a: ubFree(a), b: ubFree(b), c: ubFree(c)}, uuid.Nil, evA, evB, evC)
	f.returns(worker.CatchUpResult{Events: 13, Applied: 13}, nil)

	f.w.RunCatchUp(context.Background(), utName)

	require.Len(t, f.pageWrites(), 3, "one write per stream")
	for _, tc := range []struct {
		stream uuid.UUID
		evs    []worker.Event
		snaps  []int
		since  int
	}{{a, evA, nil, 3}, {b, evB, []int{3, 7}, 1}, {c, evC, nil, 1}} {
		wr := f.write(tc.stream)
		uFolded(t, wr, tc.evs, 0, len(tc.evs))
		uSnapshotsOf(t, wr.Snapshots, tc.evs, tc.snaps...)
		assert.Equal(t, tc.since, wr.SinceSnapshot)
		assert.Empty(t, wr.DropSnapshots)
		assert.Empty(t, wr.Failure.Cause)
		assert.Equal(t, uuid.Nil, wr.EnqueueFrom, "nothing queued")
		assert.Equal(t, uIDs(tc.evs), f.persp.appliedTo(tc.stream), "each event applied once, in ID order")
	}
	assert.Empty(t, f.store.MarkFailedCalls())
}

// The stream the previous page left unfinished goes on from its model, its count since a
// snapshot and its snapshots (the retention counts them).
func TestUnitCatchUpContinuesTheUnfinishedStream(t *testing.T) {
	t.Parallel()
	// Events 1-6 applied by the previous page, with snapshots at 2, 4 and 6; 7-12 on this
	// page: with EveryNEvents 2, snapshots are due at 8, 10 and 12.
	for _, tc := range []struct {
		max   int
		store []int // events (1-based) of the new snapshots stored, oldest first
		drop  []int // events of the existing snapshots deleted, newest first
	}{
		{1, []int{12}, []int{6, 4, 2}},
		{3, []int{10, 12}, []int{6, 4}},
		{5, []int{8, 10, 12}, []int{4}},
		{10, []int{8, 10, 12}, nil},
	} {
		t.Run(fmt.Sprintf("MaxPerStream %d", tc.max), func(t *testing.T) {
			t.Parallel()
			f := newUBCatchUp(t, func(c *worker.Config) {
				c.Snapshots = worker.SnapshotOptions{EveryNEvents: 2, MaxPerStream: tc.max}
			})
			cont, next := utNewID(t), utNewID(t)
			evs, nextEvs := uEvents(t, cont, 12), uEvents(t, next, 3)
			ids := uIDs(evs)
			st := uState(t, worker.Pair{Stream: cont, Perspective: utName}, evs, 6)
			st.Events = nil
			st.SinceSnapshot, st.Snapshots = 0, []uuid.UUID{ids[5], ids[3], ids[1]}
			f.serve(map[uuid.UUID]worker.PairState{cont: st, next: ubFree(next)}, cont, evs[6:], nextEvs)

			f.w.RunCatchUp(context.Background(), utName)

			at, wantDrop := uRetention(t, ids, tc.store, tc.drop)
			wr := f.write(cont)
			uFolded(t, wr, evs, 6, 12)
			uSnapshotsOf(t, wr.Snapshots, evs, at...)
			assert.Equal(t, wantDrop, wr.DropSnapshots, "the existing snapshots the retention drops")
			assert.Zero(t, wr.SinceSnapshot)
			assert.Equal(t, uuid.Nil, wr.EnqueueFrom)
			assert.Equal(t, ids[6:], f.persp.appliedTo(cont), "only the page's events are applied")
			uFolded(t, f.write(next), nextEvs, 0, 3)
		})
	}
	t.Run("count since the snapshot carries over", func(t *testing.T) {
		t.Parallel()
		f := newUBCatchUp(t, func(c *worker.Config) { c.Snapshots.EveryNEvents = 5 })
		cont := utNewID(t)
		evs := uEvents(t, cont, 7)
		st := uState(t, worker.Pair{Stream: cont, Perspective: utName}, evs, 3)
		st.Events = nil
		st.SinceSnapshot, st.Snapshots = 3, []uuid.UUID{evs[0].ID}
		f.serve(map[uuid.UUID]worker.PairState{cont: st}, cont, evs[3:])

		f.w.RunCatchUp(context.Background(), utName)

		wr := f.write(cont)
		uFolded(t, wr, evs, 3, 7)
		uSnapshotsOf(t, wr.Snapshots, evs, 4) // 3 + 2 = 5 at event 5
		assert.Equal(t, 2, wr.SinceSnapshot)
	})
}

// A stream the catch-up may not fold is left to the normal path: its events from the
// page's first on are queued, and nothing else is written for it. The other streams of
// the page are folded.
func TestUnitCatchUpLeavesHeldStreamsToTheNormalPath(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name      string
		continued bool // the stream is the page's Continued one
		state     func(f *ubCatchUp, st worker.PairState, evs []worker.Event) (worker.PairState, bool)
		folded    bool
	}{
		{"row held by another transaction", false, func(_ *ubCatchUp, st worker.PairState, _ []worker.Event) (worker.PairState, bool) {
			return st, false
		}, false},
		{"continued stream's row held by another transaction", true, func(_ *ubCatchUp, st worker.PairState, _ []worker.Event) (worker.PairState, bool) {
			return st, false
		}, false},
		{"stream locked by another instance", false, func(_ *ubCatchUp, st worker.PairState, _ []worker.Event) (worker.PairState, bool) {
			st.LockHolder = uuid.New()
			return st, true
		}, false},
		{"continued stream locked by another instance", true, func(_ *ubCatchUp, st worker.PairState, _ []worker.Event) (worker.PairState, bool) {
			st.LockHolder = uuid.New()
			return st, true
		}, false},
		{"stream with a cursor position already", false, func(_ *ubCatchUp, st worker.PairState, evs []worker.Event) (worker.PairState, bool) {
			st.LastEventID = uValid(evs[0].ID)
			st.Model, st.ModelAt = json.RawMessage(`{"seq":[1]}`), evs[0].ID
			return st, true
		}, false},
		{"stream locked by this instance", false, func(f *ubCatchUp, st worker.PairState, _ []worker.Event) (worker.PairState, bool) {
			st.LockHolder = f.instance
			return st, true
		}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newUBCatchUp(t, nil)
			held, before, after := utNewID(t), utNewID(t), utNewID(t)
			evs := uEvents(t, held, 4)
			bEvs, aEvs := uEvents(t, before, 2), uEvents(t, after, 3)
			states := map[uuid.UUID]worker.PairState{before: ubFree(before), after: ubFree(after)}
			st, present := tc.state(f, ubFree(held), evs)
			if present {
				states[held] = st
			}
			page, continued := [][]worker.Event{bEvs, evs[1:], aEvs}, uuid.Nil
			if tc.continued {
				page, continued = [][]worker.Event{evs[1:], bEvs, aEvs}, held
			}
			f.serve(states, continued, page...)

			f.w.RunCatchUp(context.Background(), utName)

			require.Len(t, f.pageWrites(), 3)
			wr := f.write(held)
			if tc.folded {
				assert.Equal(t, uIDs(evs[1:]), wr.Applied)
				assert.Equal(t, uuid.Nil, wr.EnqueueFrom)
			} else {
				ubQueuedOnly(t, wr, evs[1].ID)
				assert.Empty(t, f.persp.appliedTo(held), "the perspective is not asked to apply its events")
			}
			uFolded(t, f.write(before), bEvs, 0, 2)
			uFolded(t, f.write(after), aEvs, 0, 3)
		})
	}
}

// The unfinished stream of the previous page that has no position, no model or a model
// that does not match its cursor (purged meanwhile) is queued whole: from an ID before
// every stored event.
func TestUnitCatchUpRequeuesAContinuedStreamThatChanged(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		corrupt func(st *worker.PairState, evs []worker.Event)
	}{
		{"no position", func(st *worker.PairState, _ []worker.Event) {
			st.LastEventID, st.Model, st.ModelAt, st.SinceSnapshot = uuid.NullUUID{}, nil, uuid.Nil, 0
		}},
		{"no model", func(st *worker.PairState, _ []worker.Event) { st.Model, st.ModelAt = nil, uuid.Nil }},
		{"model behind the cursor", func(st *worker.PairState, evs []worker.Event) { st.ModelAt = evs[0].ID }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newUBCatchUp(t, nil)
			cont, other := utNewID(t), utNewID(t)
			evs, oEvs := uEvents(t, cont, 5), uEvents(t, other, 2)
			st := uState(t, worker.Pair{Stream: cont, Perspective: utName}, evs, 2)
			st.Events = nil
			tc.corrupt(&st, evs)
			f.serve(map[uuid.UUID]worker.PairState{cont: st, other: ubFree(other)}, cont, evs[2:], oEvs)

			f.w.RunCatchUp(context.Background(), utName)

			wr := f.write(cont)
			require.NotEqual(t, uuid.Nil, wr.EnqueueFrom, "the stream is queued")
			ubQueuedOnly(t, wr, wr.EnqueueFrom)
			assert.True(t, uLess(wr.EnqueueFrom, ubMinV7), "EnqueueFrom %s sorts before every UUIDv7: the whole stream", wr.EnqueueFrom)
			for _, ev := range evs {
				assert.True(t, uLess(wr.EnqueueFrom, ev.ID), "before the stream's first event too")
			}
			assert.Empty(t, f.persp.appliedTo(cont), "nothing folded onto a model that does not match")
			uFolded(t, f.write(other), oEvs, 0, 2)
		})
	}
	assert.True(t, uLess(ubMinV7, uuid.Must(uuid.NewV7())), "ubMinV7 is below real UUIDv7s")
}

// An Apply that fails on event k of a stream keeps the events before it, records the
// failure (naming event k) with the stream's write and queues the stream from event k; the
// streams after it are folded all the same.
func TestUnitCatchUpApplyFailureQueuesFromTheFailingEvent(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name      string
		failAt    int // 1-based, of the page's events of the stream
		how       string
		continued bool
	}{
		{"error on the third", 3, "error", false},
		{"panic on the third", 3, "panic", false},
		{"error on the first", 1, "error", false},
		{"error on the last", 5, "error", false},
		{"error on the continued stream's first of the page", 1, "error", true},
		{"error on the continued stream's second of the page", 2, "error", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newUBCatchUp(t, nil)
			bad, later := utNewID(t), utNewID(t)
			pre := 0 // events of bad applied by the previous page
			if tc.continued {
				pre = 2
			}
			evs, lEvs := uEvents(t, bad, pre+5), uEvents(t, later, 4)
			st := ubFree(bad)
			continued := uuid.Nil
			if tc.continued {
				st = uState(t, worker.Pair{Stream: bad, Perspective: utName}, evs, pre)
				st.Events, continued = nil, bad
			}
			k := pre + tc.failAt - 1 // index in evs of the failing event
			f.persp.failOn(evs[k].ID, tc.how)
			f.serve(map[uuid.UUID]worker.PairState{bad: st, later: ubFree(later)}, continued, evs[pre:], lEvs)

			f.w.RunCatchUp(context.Background(), utName)

			wr := f.write(bad)
			if k > pre {
				uFolded(t, wr, evs, pre, k)
				assert.Equal(t, k, wr.SinceSnapshot)
			} else {
				assert.Empty(t, wr.Applied, "nothing applied before the failing event")
			}
			assert.NotContains(t, wr.Applied, evs[k].ID, "the failing event is not applied")
			assert.Contains(t, wr.Failure.Cause, "bad event", "the failure is recorded with the write")
			assert.Contains(t, wr.Failure.Cause, evs[k].ID.String(), "the failure names the event")
			assert.Equal(t, evs[k].ID, wr.EnqueueFrom, "the stream is queued from the failing event on")
			assert.Equal(t, uIDs(evs[pre:k+1]), f.persp.appliedTo(bad), "the events after the failing one are not tried")
			uFolded(t, f.write(later), lEvs, 0, 4)
			assert.Empty(t, f.write(later).Failure.Cause)
			assert.Empty(t, f.store.MarkFailedCalls(), "recorded by the page's transaction, not apart")
			assert.Contains(t, f.logs.String(), "event application failed")
		})
	}
}

// A page applies at most CatchUpStreamShare events of one stream: a longer stream's rest is
// queued for the normal path from its first event past the share on, and the streams after it
// on the page are caught up as usual.
func TestUnitCatchUpBoundsOneStreamsShareOfAPage(t *testing.T) {
	t.Parallel()
	f := newUBCatchUp(t, nil)
	long, later := utNewID(t), utNewID(t)
	n := worker.CatchUpStreamShare
	evs, lEvs := uEvents(t, long, n+5), uEvents(t, later, 3)
	f.serve(map[uuid.UUID]worker.PairState{long: ubFree(long), later: ubFree(later)}, uuid.Nil, evs, lEvs)

	f.w.RunCatchUp(context.Background(), utName)

	wr := f.write(long)
	uFolded(t, wr, evs, 0, n)
	assert.Equal(t, evs[n].ID, wr.EnqueueFrom, "the rest of the long stream goes to the normal path")
	assert.Empty(t, wr.Failure.Cause)
	assert.Equal(t, uIDs(evs[:n]), f.persp.appliedTo(long), "the events past its share are not applied here")
	uFolded(t, f.write(later), lEvs, 0, 3)
	assert.Equal(t, uuid.Nil, f.write(later).EnqueueFrom)
}

// Many streams on one page, folded side by side, each into its own model in its own
// order, whatever the interleaving (run with -race).
func TestUnitCatchUpManyStreamsSideBySide(t *testing.T) {
	t.Parallel()
	f := newUBCatchUp(t, func(c *worker.Config) { c.Snapshots.EveryNEvents = 3 })
	f.persp.yield = true
	states := map[uuid.UUID]worker.PairState{}
	var page [][]worker.Event
	byStream := map[uuid.UUID][]worker.Event{}
	for i := range 300 {
		s := utNewID(t)
		evs := uEvents(t, s, 1+i%11)
		states[s], byStream[s] = ubFree(s), evs
		page = append(page, evs)
	}
	f.serve(states, uuid.Nil, page...)

	f.w.RunCatchUp(context.Background(), utName)

	writes := f.pageWrites()
	require.Len(t, writes, len(page), "one write per stream")
	for i, wr := range writes {
		evs := byStream[wr.Stream]
		require.NotNil(t, evs, "write %d is for a stream of the page", i)
		assert.Equal(t, page[i][0].StreamID, wr.Stream, "writes in the page's order")
		uFolded(t, wr, evs, 0, len(evs))
		assert.Equal(t, len(evs)%3, wr.SinceSnapshot)
		assert.Len(t, wr.Snapshots, len(evs)/3)
		assert.Equal(t, uIDs(evs), f.persp.appliedTo(wr.Stream))
	}
}

// The job's report: another page of the same build while the store says there is more;
// none when it is done, held by another instance, refused or failed.
func TestUnitCatchUpReportsTheNextPage(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		res    worker.CatchUpResult
		err    error
		noFold bool
		more   bool
		log    string
	}{
		{"more to read", worker.CatchUpResult{Events: 2, Applied: 2}, nil, false, true, ""},
		{"more, all queued", worker.CatchUpResult{Events: 2}, nil, false, true, ""},
		{"done", worker.CatchUpResult{Done: true}, nil, false, false, "catch-up done"},
		{"done with a last page", worker.CatchUpResult{Done: true, Events: 2, Applied: 2}, nil, false, false, "catch-up done"},
		{"held by another instance", worker.CatchUpResult{NotHeld: true}, nil, true, false, ""},
		{"lease lost at commit", worker.CatchUpResult{}, worker.ErrLockLost, false, false, "catch-up page refused"},
		{"lease lost, wrapped", worker.CatchUpResult{}, fmt.Errorf("commit: %w", worker.ErrLockLost), false, false, "catch-up page refused"},
		{"store error", worker.CatchUpResult{}, errors.New("connection reset"), false, false, "connection reset"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newUBCatchUp(t, nil)
			s := utNewID(t)
			f.serve(map[uuid.UUID]worker.PairState{s: ubFree(s)}, uuid.Nil, uEvents(t, s, 2))
			f.returns(tc.res, tc.err)
			f.mu.Lock()
			f.noFold = tc.noFold
			f.mu.Unlock()

			var rep worker.JobReport
			require.NotPanics(t, func() { rep = f.w.RunCatchUp(context.Background(), utName) })

			require.Len(t, f.store.CatchUpCalls(), 1, "one page per job")
			if tc.more {
				assert.Equal(t, []worker.JobSpec{{Kind: "catch-up", Key: utName}}, rep.Next, "the next page of the same build")
			} else {
				assert.Empty(t, rep.Next, "no next page")
			}
			assert.Empty(t, rep.Busy)
			assert.Empty(t, rep.Contended)
			if tc.log != "" {
				assert.Contains(t, f.logs.String(), tc.log)
			}
		})
	}
}

// A catch-up page is asked for with this instance as the lease holder, LockTimeout as the
// lease and CatchUpPageSize events; a build this instance does not apply is not asked for.
func TestUnitCatchUpRequest(t *testing.T) {
	t.Parallel()
	f := newUBCatchUp(t, func(c *worker.Config) {
		c.LockOptions = locker.Options{LockTimeout: 17 * time.Second, KeepAliveInterval: 4 * time.Second}
		c.CatchUpPageSize = 345
	})
	f.returns(worker.CatchUpResult{Done: true}, nil)

	f.w.RunCatchUp(context.Background(), utName)
	rep := f.w.RunCatchUp(context.Background(), "seq@v9.1")

	calls := f.store.CatchUpCalls()
	require.Len(t, calls, 1, "a build not applied here is not caught up")
	assert.Equal(t, worker.CatchUpRequest{Key: utName, Instance: f.instance, Lease: 17 * time.Second, PageSize: 345}, calls[0].Req)
	assert.Empty(t, rep.Next)
}

// ---------------------------------------------------------------------------------------
// The loop's look at the builds (maintain), inside a synctest bubble.

// ubLoop is a worker running version (0: a perspective without a Version method) of
// utName on a StoreMock whose Register and Builds return the builds set; Claim returns
// nothing, Cleanup finds nothing; CatchUp and Promote call catchUp and promote (by default:
// done, not promoted).
//
// A loop that runs the builds' jobs again and again without time passing would keep a
// synctest bubble from ever settling: past ubSpinLimit calls of Builds, CatchUp and
// Promote at one instant, the mock notes the busy loop (busyLooped) and blocks until the
// call's context ends or stop, so that the test goes on and fails on what it asserts.
type ubLoop struct {
	store   *mocks.StoreMock
	logs    *utLogBuf
	w       *worker.Worker
	catchUp func(ctx context.Context, req worker.CatchUpRequest) (worker.CatchUpResult, error)
	promote func(ctx context.Context, perspective, key string) (bool, error)
	unstall chan struct{} // closed by stop

	mu      sync.Mutex
	builds  []worker.Build
	lookAt  time.Time // the instant of the last call
	looksAt int       // calls at that instant
	spun    bool      // more than ubSpinLimit calls at one instant
	stopped bool
}

const ubSpinLimit = 50

func newUBLoop(t *testing.T, version int, builds []worker.Build, cfg func(c *worker.Config)) *ubLoop {
	t.Helper()
	f := &ubLoop{logs: &utLogBuf{}, builds: builds, unstall: make(chan struct{})}
	f.catchUp = func(context.Context, worker.CatchUpRequest) (worker.CatchUpResult, error) {
		return worker.CatchUpResult{Done: true}, nil
	}
	f.promote = func(context.Context, string, string) (bool, error) { return false, nil }
	f.store = &mocks.StoreMock{
		RegisterFunc: func(context.Context, string, int) ([]worker.Build, error) { return f.current(), nil },
		BuildsFunc: func(ctx context.Context, _ []string) ([]worker.Build, error) {
			if err := f.stall(ctx); err != nil {
				return nil, err
			}
			return f.current(), nil
		},
		StatusFunc: func(context.Context) ([]worker.BuildStatus, error) { return nil, nil },
		LeasedFunc: func(context.Context, uuid.UUID) ([]worker.Pair, error) { return nil, nil },
		CleanupFunc: func(context.Context, []string, time.Duration, int, worker.LeaderLease) (bool, error) {
			return false, nil
		},
		ClaimFunc: func(context.Context, worker.ClaimRequest) (worker.Claimed, error) { return worker.Claimed{}, nil },
		CatchUpFunc: func(ctx context.Context, req worker.CatchUpRequest, _ func(worker.CatchUpPage) []worker.PairWrite) (worker.CatchUpResult, error) {
			if err := f.stall(ctx); err != nil {
				return worker.CatchUpResult{}, err
			}
			return f.catchUp(ctx, req)
		},
		PromoteFunc: func(ctx context.Context, perspective, key string, force bool, _ worker.LeaderLease) (bool, error) {
			if err := f.stall(ctx); err != nil {
				return false, err
			}
			return f.promote(ctx, perspective, key)
		},
	}
	c := worker.Config{
		Perspectives: []worker.Perspective{ubPersp(utName, version)},
		PollOnly:     true,
		PollInterval: time.Second,
		Logger:       utLogger(f.logs),
	}
	if cfg != nil {
		cfg(&c)
	}
	w, err := worker.NewWithStore(f.store, c)
	require.NoError(t, err)
	f.w = w
	return f
}

// stall counts a call and, once the loop is found busy looping, blocks it until ctx ends
// or stop; it then returns an error.
func (f *ubLoop) stall(ctx context.Context) error {
	f.mu.Lock()
	if now := time.Now(); now.Equal(f.lookAt) {
		f.looksAt++
	} else {
		f.lookAt, f.looksAt = now, 1
	}
	if f.looksAt > ubSpinLimit {
		f.spun = true
	}
	spun := f.spun
	f.mu.Unlock()
	if !spun {
		return nil
	}
	select {
	case <-ctx.Done():
	case <-f.unstall:
	}
	return errors.New("busy loop stalled by the test")
}

func (f *ubLoop) busyLooped() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.spun
}

// stop releases the stalled calls and stops the worker.
func (f *ubLoop) stop(t *testing.T) {
	t.Helper()
	f.mu.Lock()
	if !f.stopped {
		f.stopped = true
		close(f.unstall)
	}
	f.mu.Unlock()
	require.NoError(t, f.w.Stop(context.Background()))
}

func (f *ubLoop) current() []worker.Build {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.builds)
}

func (f *ubLoop) setBuilds(builds ...worker.Build) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.builds = builds
}

// markDone records that build key's catch-up is done.
func (f *ubLoop) markDone(key string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i := range f.builds {
		if f.builds[i].Key == key {
			f.builds[i].CatchUpDone = true
		}
	}
}

// claimed is the Perspectives of each Claim from the i-th on.
func (f *ubLoop) claimed(from int) [][]string {
	var out [][]string
	for _, c := range f.store.ClaimCalls()[from:] {
		out = append(out, c.Req.Perspectives)
	}
	return out
}

// idle lets the loop look at the builds n more times (n PollIntervals) and waits until it
// waits again.
func ubIdle(n int) {
	time.Sleep(time.Duration(n) * time.Second)
	synctest.Wait()
}

// ubLine is the first log line that contains msg ("": none).
func ubLine(logs, msg string) string {
	for line := range strings.Lines(logs) {
		if strings.Contains(line, msg) {
			return line
		}
	}
	return ""
}

const (
	ubRetiredMsg    = "perspective version retired: this instance no longer applies it"
	ubNotAppliedMsg = "perspective version not applied: a newer version is active (versions only go up)"
)

// Each build of the worker's version that has not caught up is caught up one page after
// the other, never two pages of the same build at once, however often the loop looks at
// the builds meanwhile; builds of other versions are not touched; the chain ends when the
// store says it is done, and a caught-up building build is then promoted.
func TestUnitMaintainCatchUpOneChainPerBuild(t *testing.T) {
	t.Parallel()
	const (
		act = worker.BuildActive
		bld = worker.BuildBuilding
	)
	for _, tc := range []struct {
		name    string
		version int
		builds  []worker.Build
		chains  []string // builds caught up
		promote []string // builds promoted after
	}{
		{"new version beside the active one", 2,
			[]worker.Build{ubBuild(1, 1, act, false), ubBuild(2, 1, bld, false)},
			[]string{"seq@v2.1"}, []string{"seq@v2.1"}},
		{"first build and a rebuild at once", 0,
			[]worker.Build{ubBuild(1, 1, act, false), ubBuild(1, 2, bld, false), ubBuild(2, 1, bld, false)},
			[]string{"seq", "seq@v1.2"}, []string{"seq@v1.2"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			synctest.Test(t, func(t *testing.T) {
				f := newUBLoop(t, tc.version, tc.builds, nil)
				gate := make(chan struct{})
				var mu sync.Mutex
				running, calls := map[string]int{}, map[string]int{}
				overlap := 0
				f.catchUp = func(_ context.Context, req worker.CatchUpRequest) (worker.CatchUpResult, error) {
					mu.Lock()
					running[req.Key]++
					if running[req.Key] > 1 {
						overlap++
					}
					calls[req.Key]++
					n := calls[req.Key]
					mu.Unlock()
					defer func() {
						mu.Lock()
						running[req.Key]--
						mu.Unlock()
					}()
					if n == 1 {
						<-gate // the first page of each build lasts while the loop looks again
					}
					if n < 4 {
						return worker.CatchUpResult{Events: 10, Applied: 10}, nil
					}
					f.markDone(req.Key)
					return worker.CatchUpResult{Done: true}, nil
				}
				require.NoError(t, f.w.Start(context.Background()))
				synctest.Wait() // each chain's first page waits at the gate

				looks := len(f.store.BuildsCalls())
				ubIdle(10)
				assert.GreaterOrEqual(t, len(f.store.BuildsCalls()), looks+10, "the loop looked at the builds every PollInterval")
				mu.Lock()
				for _, key := range tc.chains {
					assert.Equal(t, 1, calls[key], "one page of %s at a time, whatever the looks meanwhile", key)
				}
				mu.Unlock()
				close(gate)
				// The chains run to their end: the active build's at once, a building one's
				// after the pause as long as its 10-second first page (yieldToLive).
				ubIdle(15)
				f.stop(t)

				mu.Lock()
				defer mu.Unlock()
				assert.Zero(t, overlap, "never two CatchUp calls of the same build at once")
				for _, key := range tc.chains {
					assert.Equal(t, 4, calls[key], "%s: pages until the store said done, then none", key)
				}
				assert.Len(t, calls, len(tc.chains), "only the builds of the worker's version: %v", calls)
				var promoted []string
				for _, c := range f.store.PromoteCalls() {
					assert.Equal(t, utName, c.Perspective)
					assert.False(t, c.Force, "promoted only when caught up")
					if !slices.Contains(promoted, c.Key) {
						promoted = append(promoted, c.Key)
					}
				}
				assert.Equal(t, tc.promote, promoted, "the caught-up building build is promoted, the active one not")
				for _, c := range f.store.CatchUpCalls() {
					assert.Equal(t, f.w.InstanceID(), c.Req.Instance)
				}
				assert.NotContains(t, f.logs.String(), ubNotAppliedMsg)
				assert.NotContains(t, f.logs.String(), ubRetiredMsg)
			})
		})
	}
}

// A build beside an active version (building) pauses after each page as long as the page
// took, leaving half the time to live application; the perspective's first build (active,
// nothing to serve yet) runs its pages back to back.
func TestUnitMaintainCatchUpBesideAnActiveVersionIsPaced(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		builds []worker.Build
		key    string
		gap    time.Duration // from the end of one page to the start of the next
	}{
		{"first build", []worker.Build{ubBuild(1, 1, worker.BuildActive, false)}, "seq", 0},
		{"rebuild beside the active build", []worker.Build{ubBuild(1, 1, worker.BuildActive, true), ubBuild(1, 2, worker.BuildBuilding, false)}, "seq@v1.2", 3 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			synctest.Test(t, func(t *testing.T) {
				f := newUBLoop(t, 0, tc.builds, nil)
				var mu sync.Mutex
				var starts, ends []time.Time
				f.catchUp = func(_ context.Context, req worker.CatchUpRequest) (worker.CatchUpResult, error) {
					require.Equal(t, tc.key, req.Key)
					mu.Lock()
					starts = append(starts, time.Now())
					n := len(starts)
					mu.Unlock()
					time.Sleep(3 * time.Second) // the page's work
					mu.Lock()
					ends = append(ends, time.Now())
					mu.Unlock()
					if n < 4 {
						return worker.CatchUpResult{Events: 10, Applied: 10}, nil
					}
					f.markDone(req.Key)
					return worker.CatchUpResult{Done: true}, nil
				}
				require.NoError(t, f.w.Start(context.Background()))
				ubIdle(60)
				f.stop(t)
				mu.Lock()
				defer mu.Unlock()
				require.Len(t, starts, 4, "pages until the store said done")
				for i := 1; i < len(starts); i++ {
					assert.Equal(t, tc.gap, starts[i].Sub(ends[i-1]), "page %d started after the previous one ended", i+1)
				}
			})
		})
	}
}

// A caught-up building build of the worker's version is promoted (not forced) at each
// look, unless ManualPromotion; the active build and other versions' builds are not.
func TestUnitMaintainPromotesCaughtUpBuilds(t *testing.T) {
	t.Parallel()
	const (
		act = worker.BuildActive
		bld = worker.BuildBuilding
		ret = worker.BuildRetired
	)
	for _, tc := range []struct {
		name    string
		version int
		manual  bool
		builds  []worker.Build
		want    string // the key promoted; "": none
	}{
		{"new version", 2, false, []worker.Build{ubBuild(1, 1, act, true), ubBuild(2, 1, bld, true)}, "seq@v2.1"},
		{"new version, manual promotion", 2, true, []worker.Build{ubBuild(1, 1, act, true), ubBuild(2, 1, bld, true)}, ""},
		{"rebuild", 0, false, []worker.Build{ubBuild(1, 1, act, true), ubBuild(1, 2, bld, true)}, "seq@v1.2"},
		{"rebuild, manual promotion", 1, true, []worker.Build{ubBuild(1, 1, act, true), ubBuild(1, 2, bld, true)}, ""},
		{"another version's build", 1, false, []worker.Build{ubBuild(1, 1, act, true), ubBuild(2, 1, bld, true)}, ""},
		{"only the active build", 2, false, []worker.Build{ubBuild(1, 1, ret, true), ubBuild(2, 1, act, true)}, ""},
		{"not caught up", 2, false, []worker.Build{ubBuild(1, 1, act, true), ubBuild(2, 1, bld, false)}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			synctest.Test(t, func(t *testing.T) {
				f := newUBLoop(t, tc.version, tc.builds, func(c *worker.Config) { c.ManualPromotion = tc.manual })
				f.catchUp = func(context.Context, worker.CatchUpRequest) (worker.CatchUpResult, error) {
					return worker.CatchUpResult{NotHeld: true}, nil // another instance catches up
				}
				require.NoError(t, f.w.Start(context.Background()))
				synctest.Wait()
				ubIdle(3)
				f.stop(t)

				calls := f.store.PromoteCalls()
				if tc.want == "" {
					assert.Empty(t, calls, "nothing promoted")
					return
				}
				assert.GreaterOrEqual(t, len(calls), 3, "asked again at each look while it is not promoted")
				for _, c := range calls {
					assert.Equal(t, utName, c.Perspective)
					assert.Equal(t, tc.want, c.Key)
					assert.False(t, c.Force, "never forced by the worker")
				}
				assert.Empty(t, f.store.CatchUpCalls(), "a caught-up build is not caught up again")
			})
		})
	}
}

// A promotion is seen at once: the next claim is for the new active build only, and a
// rebuild's promotion does not stop the instance applying its version.
func TestUnitMaintainPromotionSwitchesTheClaimedBuild(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		f := newUBLoop(t, 0, []worker.Build{ubBuild(1, 1, worker.BuildActive, true), ubBuild(1, 2, worker.BuildBuilding, true)}, nil)
		f.promote = func(context.Context, string, string) (bool, error) {
			f.setBuilds(ubBuild(1, 1, worker.BuildRetired, true), ubBuild(1, 2, worker.BuildActive, true))
			return true, nil
		}
		require.NoError(t, f.w.Start(context.Background()))
		synctest.Wait() // no time passes: promoted, looked again, claimed

		claims := f.claimed(0)
		require.NotEmpty(t, claims)
		assert.ElementsMatch(t, []string{"seq", "seq@v1.2"}, claims[0], "both builds of the version are applied while one builds")
		assert.Equal(t, []string{"seq@v1.2"}, claims[len(claims)-1], "after the promotion, only the new build")
		assert.Len(t, f.store.PromoteCalls(), 1)
		ubIdle(3)
		f.stop(t)
		for _, c := range f.claimed(len(claims)) {
			assert.Equal(t, []string{"seq@v1.2"}, c)
		}
		assert.Len(t, f.store.PromoteCalls(), 1, "an active build is not promoted again")
		assert.Contains(t, f.logs.String(), "perspective version promoted")
		assert.NotContains(t, f.logs.String(), ubRetiredMsg, "the version is still applied: only a build was retired")
	})
}

// Each look at the builds cleans up retired builds, with a 30 s grace and batches of 1000
// pairs, at once again while the store says more is left.
func TestUnitMaintainCleanup(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		f := newUBLoop(t, 0, utBuilds(), nil)
		var mu sync.Mutex
		more := 2 // batches left after the first
		f.store.CleanupFunc = func(context.Context, []string, time.Duration, int, worker.LeaderLease) (bool, error) {
			mu.Lock()
			defer mu.Unlock()
			if more > 0 {
				more--
				return true, nil
			}
			return false, nil
		}
		require.NoError(t, f.w.Start(context.Background()))
		synctest.Wait()
		assert.Len(t, f.store.CleanupCalls(), 3, "batches follow each other at once while more is left, then stop")
		ubIdle(3)
		f.stop(t)

		calls := f.store.CleanupCalls()
		assert.GreaterOrEqual(t, len(calls), 3+3, "one more at each look")
		for _, c := range calls {
			assert.Equal(t, 30*time.Second, c.Grace, "retired builds are kept 30 s")
			assert.Equal(t, 1000, c.Batch, "1000 pairs per statement")
			assert.Equal(t, []string{utName}, c.Perspectives)
		}
	})
}

// When the worker's version is retired (another instance promoted a newer one), the
// instance says so once, however often it looks again, and claims nothing of it.
func TestUnitMaintainRetiredVersionIsNoLongerApplied(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		f := newUBLoop(t, 0, []worker.Build{ubBuild(1, 1, worker.BuildActive, true), ubBuild(2, 1, worker.BuildBuilding, false)}, nil)
		require.NoError(t, f.w.Start(context.Background()))
		synctest.Wait()
		ubIdle(3)
		before := f.claimed(0)
		require.NotEmpty(t, before)
		for _, c := range before {
			assert.Equal(t, []string{utName}, c, "version 1 is applied (and only it)")
		}
		assert.NotContains(t, f.logs.String(), ubRetiredMsg)

		f.setBuilds(ubBuild(1, 1, worker.BuildRetired, true), ubBuild(2, 1, worker.BuildActive, true))
		ubIdle(1) // the next look sees it
		logs := f.logs.String()
		assert.Equal(t, 1, strings.Count(logs, ubRetiredMsg), "said at the look that sees it:\n%s", logs)
		n := len(f.store.ClaimCalls())
		ubIdle(5)
		f.stop(t)

		logs = f.logs.String()
		assert.Equal(t, 1, strings.Count(logs, ubRetiredMsg), "said once, not at every look:\n%s", logs)
		assert.NotContains(t, logs, ubNotAppliedMsg)
		line := ubLine(logs, ubRetiredMsg)
		assert.Contains(t, line, "perspective="+utName)
		assert.Contains(t, line, "version=1")
		assert.Contains(t, line, "active_version=2")
		after := f.claimed(n)
		require.NotEmpty(t, after, "the loop still polls")
		for _, c := range after {
			assert.NotContains(t, c, utName, "the retired version's pairs are not claimed")
			assert.NotContains(t, c, "seq@v2.1", "nor the newer version's")
		}
		assert.Empty(t, f.store.ApplyCalls())
		assert.Empty(t, f.store.CatchUpCalls(), "another version is not caught up here")
		assert.Empty(t, f.store.PromoteCalls())
	})
}

// A worker whose version is older than the active one says so once, at Start, and applies
// nothing of the perspective.
func TestUnitMaintainOlderVersionIsNotApplied(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		f := newUBLoop(t, 2, []worker.Build{ubBuild(1, 1, worker.BuildRetired, true), ubBuild(2, 1, worker.BuildRetired, true),
			ubBuild(3, 1, worker.BuildActive, false)}, nil)
		require.NoError(t, f.w.Start(context.Background()))
		assert.Equal(t, 1, strings.Count(f.logs.String(), ubNotAppliedMsg), "said at Start:\n%s", f.logs.String())
		synctest.Wait()
		ubIdle(5)
		f.stop(t)

		logs := f.logs.String()
		assert.Equal(t, 1, strings.Count(logs, ubNotAppliedMsg), "said once:\n%s", logs)
		assert.NotContains(t, logs, ubRetiredMsg, "it was never applied here")
		line := ubLine(logs, ubNotAppliedMsg)
		assert.Contains(t, line, "version=2")
		assert.Contains(t, line, "active_version=3")
		regs := f.store.RegisterCalls()
		require.Len(t, regs, 1)
		assert.Equal(t, utName, regs[0].Perspective)
		assert.Equal(t, 2, regs[0].Version, "registered as the version it runs")
		claims := f.claimed(0)
		for _, c := range claims {
			assert.Empty(t, c, "no build of the perspective is claimed")
		}
		assert.Empty(t, f.store.CatchUpCalls(), "the newer version is not caught up by this instance")
		assert.Empty(t, f.store.PromoteCalls())
		assert.Empty(t, f.store.ApplyCalls())
	})
}

// A look at the builds that changes nothing (a catch-up another instance holds, or that
// failed or lost its lease; a promotion refused or failed) is tried again at the next
// look, a PollInterval later: not at once, over and over, without pause.
func TestUnitMaintainWaitsAfterAFruitlessLook(t *testing.T) {
	t.Parallel()
	const (
		act = worker.BuildActive
		bld = worker.BuildBuilding
	)
	for _, tc := range []struct {
		name    string
		builds  []worker.Build
		catchUp func() (worker.CatchUpResult, error)
		promote func() (bool, error)
	}{
		{"catch-up held by another instance", []worker.Build{ubBuild(1, 1, act, true), ubBuild(1, 2, bld, false)},
			func() (worker.CatchUpResult, error) { return worker.CatchUpResult{NotHeld: true}, nil }, nil},
		{"catch-up failed", []worker.Build{ubBuild(1, 1, act, true), ubBuild(1, 2, bld, false)},
			func() (worker.CatchUpResult, error) { return worker.CatchUpResult{}, errors.New("connection reset") }, nil},
		{"catch-up lease lost", []worker.Build{ubBuild(1, 1, act, true), ubBuild(1, 2, bld, false)},
			func() (worker.CatchUpResult, error) { return worker.CatchUpResult{}, worker.ErrLockLost }, nil},
		{"promotion refused: not caught up", []worker.Build{ubBuild(1, 1, act, true), ubBuild(1, 2, bld, true)},
			nil, func() (bool, error) { return false, nil }},
		{"promotion failed", []worker.Build{ubBuild(1, 1, act, true), ubBuild(1, 2, bld, true)},
			nil, func() (bool, error) { return false, errors.New("connection reset") }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			synctest.Test(t, func(t *testing.T) {
				f := newUBLoop(t, 0, tc.builds, nil)
				if tc.catchUp != nil {
					f.catchUp = func(context.Context, worker.CatchUpRequest) (worker.CatchUpResult, error) {
						return tc.catchUp()
					}
				}
				if tc.promote != nil {
					f.promote = func(context.Context, string, string) (bool, error) { return tc.promote() }
				}
				require.NoError(t, f.w.Start(context.Background()))
				synctest.Wait()
				atStart := len(f.store.BuildsCalls())
				ubIdle(5)
				f.stop(t)

				assert.False(t, f.busyLooped(), "the loop looked at the builds more than %d times without time passing", ubSpinLimit)
				assert.LessOrEqual(t, atStart, 2, "looks at the builds at Start, before any time passed")
				tries := len(f.store.CatchUpCalls()) + len(f.store.PromoteCalls())
				assert.GreaterOrEqual(t, tries, 5, "tried again at each look")
				assert.LessOrEqual(t, tries, 5+2, "about once per PollInterval")
				assert.LessOrEqual(t, len(f.store.BuildsCalls()), 5+3, "about one look per PollInterval")
			})
		})
	}
}

// ---------------------------------------------------------------------------------------
// Config.

// A Version() that is not positive is refused, naming the perspective and the value.
func TestUnitConfigVersionMustBePositive(t *testing.T) {
	t.Parallel()
	for _, v := range []int{0, -1, -42} {
		t.Run(fmt.Sprint(v), func(t *testing.T) {
			t.Parallel()
			_, err := worker.NewWithStore(&mocks.StoreMock{}, worker.Config{
				Perspectives: []worker.Perspective{ubPersp("fine", 3), ubVersioned{Perspective: utPerspective("orders", nil), v: v}},
			})
			require.ErrorIs(t, err, worker.ErrInvalidConfig)
			assert.Contains(t, err.Error(), `"orders"`, "names the perspective")
			assert.Contains(t, err.Error(), "Version()")
			assert.Contains(t, err.Error(), fmt.Sprintf("got %d", v), "names the value")
		})
	}
	for _, v := range []int{1, 2, 1000} {
		_, err := worker.NewWithStore(&mocks.StoreMock{}, worker.Config{Perspectives: []worker.Perspective{ubPersp("orders", v)}})
		assert.NoError(t, err, "version %d", v)
	}
}

// CatchUpPageSize: zero takes the default, 1 to MaxCatchUpPageSize are taken as they are,
// anything else is refused naming the field and the value.
func TestUnitCatchUpPageSizeValidation(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		size int
		want int // the page size asked for; 0: refused
	}{
		{0, worker.DefaultCatchUpPageSize},
		{1, 1},
		{worker.MaxCatchUpPageSize, worker.MaxCatchUpPageSize},
		{-1, 0},
		{worker.MaxCatchUpPageSize + 1, 0},
	} {
		t.Run(fmt.Sprint(tc.size), func(t *testing.T) {
			t.Parallel()
			cfg := func(c *worker.Config) { c.CatchUpPageSize = tc.size }
			if tc.want == 0 {
				c := worker.Config{Perspectives: []worker.Perspective{utPerspective(utName, nil)}}
				cfg(&c)
				_, err := worker.NewWithStore(&mocks.StoreMock{}, c)
				require.ErrorIs(t, err, worker.ErrInvalidConfig)
				assert.True(t, strings.HasPrefix(strings.TrimPrefix(err.Error(), "worker: "+worker.ErrInvalidConfig.Error()+": "), "CatchUpPageSize"),
					"the message begins with the field: %v", err)
				assert.Contains(t, err.Error(), fmt.Sprint(tc.size), "names the value")
				return
			}
			f := newUBCatchUp(t, cfg)
			f.returns(worker.CatchUpResult{Done: true}, nil)
			f.w.RunCatchUp(context.Background(), utName)
			calls := f.store.CatchUpCalls()
			require.Len(t, calls, 1)
			assert.Equal(t, tc.want, calls[0].Req.PageSize)
		})
	}
}

// While the database does not answer (a restart, a failover), the loop claims every 100ms
// instead of every PollInterval, says so once, and says when it answers again; a failure
// that is not about the connection waits for the next poll.
func TestUnitLoopClaimsSoonWhileTheDatabaseIsUnreachable(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		err      error
		claims   int // from the first failing claim on, in 950ms
		warnings int
	}{
		{"connection refused", &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}, 10, 1}, // at 0, 100, …, 900ms
		{"a statement's error", errors.New("relation does not exist"), 1, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			synctest.Test(t, func(t *testing.T) {
				f := newUBLoop(t, 0, []worker.Build{ubBuild(1, 1, worker.BuildActive, true)}, func(c *worker.Config) {
					c.PollInterval = 10 * time.Second
				})
				var mu sync.Mutex
				var at []time.Time
				failing := true
				f.store.ClaimFunc = func(context.Context, worker.ClaimRequest) (worker.Claimed, error) {
					mu.Lock()
					defer mu.Unlock()
					at = append(at, time.Now())
					if failing {
						return worker.Claimed{}, tc.err
					}
					return worker.Claimed{}, nil
				}
				require.NoError(t, f.w.Start(context.Background()))
				synctest.Wait()
				start := time.Now()
				time.Sleep(950 * time.Millisecond)
				synctest.Wait()
				mu.Lock()
				n := 0
				for _, a := range at {
					if !a.Before(start) {
						n++
					}
				}
				failing = false
				mu.Unlock()
				assert.Equal(t, tc.claims, n, "claims while failing")
				time.Sleep(time.Second)
				synctest.Wait()
				f.stop(t)
				logs := f.logs.String()
				assert.Equal(t, tc.warnings, strings.Count(logs, "database unavailable"), logs)
				assert.Equal(t, tc.warnings, strings.Count(logs, "database answers again"), logs)
				if tc.warnings == 0 {
					assert.Contains(t, logs, "poll queue failed")
				}
			})
		})
	}
}

// While the wake-up's subscription is down (the notifier opens a session again after its
// backoff), the loop claims every 100ms rather than every PollInterval: an event appended
// meanwhile is not left for a whole poll, even when a notification came with the loss.
// Once subscribed again, it claims when notified.
func TestUnitLoopClaimsSoonWhileNotSubscribed(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		f := newUBLoop(t, 0, []worker.Build{ubBuild(1, 1, worker.BuildActive, true)}, func(c *worker.Config) {
			c.PollInterval = time.Hour
			c.PollOnly = false
		})
		subscribed := make(chan struct{})
		f.store.ListenFunc = func(ctx context.Context, notify func(), state func(error)) error {
			state(nil)
			state(errors.New("unexpected EOF"))
			notify()                            // a notification received with the loss: still not subscribed
			state(errors.New("unexpected EOF")) // told again: one warning for the spell
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-subscribed:
			}
			state(nil)
			<-ctx.Done()
			return ctx.Err()
		}
		require.NoError(t, f.w.Start(context.Background()))
		synctest.Wait()
		before := len(f.store.ClaimCalls())
		time.Sleep(950 * time.Millisecond)
		synctest.Wait()
		assert.Equal(t, 9, len(f.store.ClaimCalls())-before, "a claim every 100ms while not subscribed")
		close(subscribed)
		synctest.Wait()
		before = len(f.store.ClaimCalls())
		time.Sleep(10 * time.Second)
		synctest.Wait()
		assert.Equal(t, 0, len(f.store.ClaimCalls())-before, "subscribed again: no claim until notified or PollInterval")
		f.stop(t)
		assert.Equal(t, 1, strings.Count(f.logs.String(), "queue notifications interrupted; polling until resubscribed"), f.logs.String())
	})
}

// While claims fail (not for a lost connection) and back off, a catch-up's next page does
// not wait for a claim the loop does not make: the catch-up goes on page after page.
func TestUnitCatchUpGoesOnWhileClaimsBackOff(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newUBLoop(t, 0, []worker.Build{ubBuild(1, 1, worker.BuildActive, false)}, func(c *worker.Config) {
			c.RetryBackoff, c.MaxRetryBackoff = time.Second, 30*time.Second
		})
		f.store.ClaimFunc = func(context.Context, worker.ClaimRequest) (worker.Claimed, error) {
			return worker.Claimed{}, errors.New("ERROR: canceling statement due to statement timeout (SQLSTATE 57014)")
		}
		var pages atomic.Int64
		f.catchUp = func(ctx context.Context, req worker.CatchUpRequest) (worker.CatchUpResult, error) {
			pages.Add(1)
			time.Sleep(10 * time.Millisecond)
			return worker.CatchUpResult{Events: 10, Applied: 10}, nil
		}
		require.NoError(t, f.w.Start(context.Background()))
		time.Sleep(60 * time.Second)
		synctest.Wait()
		f.stop(t)
		require.Greater(t, pages.Load(), int64(1000), "pages of 10 ms in 60 s while claims fail")
		require.Less(t, len(f.store.ClaimCalls()), 20, "the claims back off")
	})
}
