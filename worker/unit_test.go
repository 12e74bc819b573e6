package worker_test

// Unit tests of the worker's logic (normal path, rewind, bootstrap, purge, failure
// isolation) against the moq mocks in mocks/: no database. The StoreMock is wired to a
// small in-memory model of the tables (utFake) so that each test states its starting rows
// and checks both the calls the worker made and the rows it left behind. Transactions are
// modelled: InTx runs fn on the same mock and restores the rows when fn returns an error
// or panics.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/db"
	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/mocks"
	"github.com/perspectives-go/perspectives/worker"
)

const utName = "seq"

// ---------------------------------------------------------------------------------------
// A perspective whose model is the list of the events' "n" values, in application order.
// Events are created with n = 1, 2, 3, … in ID order, so the fold of a stream in ID order
// is [1 2 3 …]: any gap, duplicate or reordering shows.

type utSeq struct {
	Seq []int `json:"seq"`
}

func utPerspective(name string, hook func(n int) error) worker.Perspective {
	return worker.JSONPerspective(name, func(m utSeq, ev worker.Event) (utSeq, error) {
		var d struct {
			N int `json:"n"`
		}
		if err := json.Unmarshal(ev.Data, &d); err != nil {
			return m, err
		}
		if hook != nil {
			if err := hook(d.N); err != nil {
				return m, err
			}
		}
		m.Seq = append(m.Seq, d.N)
		return m, nil
	})
}

// utCount is a constant-size fold for long streams: how many events, the last n, and
// whether any event came out of order, twice or after a gap.
type utCount struct {
	Count  int  `json:"count"`
	Last   int  `json:"last"`
	Broken bool `json:"broken"`
}

func utCountPerspective(name string) worker.Perspective {
	return worker.JSONPerspective(name, func(m utCount, ev worker.Event) (utCount, error) {
		var d struct {
			N int `json:"n"`
		}
		if err := json.Unmarshal(ev.Data, &d); err != nil {
			return m, err
		}
		m.Broken = m.Broken || d.N != m.Last+1
		m.Count++
		m.Last = d.N
		return m, nil
	})
}

func utDecode(t testing.TB, raw []byte) []int {
	t.Helper()
	var m utSeq
	require.NoError(t, json.Unmarshal(raw, &m), "model %s", raw)
	return m.Seq
}

// utLogBuf is a goroutine-safe log sink (the keepalive logs from its own goroutine).
type utLogBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *utLogBuf) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *utLogBuf) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func utLogger(buf *utLogBuf) *slog.Logger {
	return slog.New(slog.NewTextHandler(buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

func utLess(a, b uuid.UUID) bool { return bytes.Compare(a[:], b[:]) < 0 }

func utSorted(ids []uuid.UUID) []uuid.UUID {
	out := slices.Clone(ids)
	slices.SortFunc(out, func(a, b uuid.UUID) int { return bytes.Compare(a[:], b[:]) })
	return out
}

// ---------------------------------------------------------------------------------------
// The in-memory tables behind the StoreMock and the LockerMock.

type utKey struct {
	stream uuid.UUID
	name   string
}

// utPair is everything stored for one (stream, perspective): the cursor row (with the
// stream lock columns), the model, the snapshots and the queue rows.
type utPair struct {
	cursor   bool // the cursor row exists
	last     uuid.NullUUID
	version  int64
	since    int32
	attempts int32
	status   string
	lastErr  *string
	nextAt   time.Time // next_attempt_at; zero is NULL
	lockInst uuid.NullUUID
	lockLive bool
	model    *db.ModelGetRow
	snaps    map[uuid.UUID][]byte
	queue    map[uuid.UUID]bool
	qFail    map[uuid.UUID]utQueueFail // the failure columns of the queue rows that have any
}

// utQueueFail is what QueueMarkFailed writes on a queue row.
type utQueueFail struct {
	attempts int32
	lastErr  *string
	nextAt   time.Time
}

func (p *utPair) clone() *utPair {
	c := *p
	if p.model != nil {
		m := *p.model
		c.model = &m
	}
	c.snaps = make(map[uuid.UUID][]byte, len(p.snaps))
	for k, v := range p.snaps {
		c.snaps[k] = v
	}
	c.queue = make(map[uuid.UUID]bool, len(p.queue))
	for k, v := range p.queue {
		c.queue[k] = v
	}
	c.qFail = make(map[uuid.UUID]utQueueFail, len(p.qFail))
	for k, v := range p.qFail {
		c.qFail[k] = v
	}
	return &c
}

// dequeue deletes the queue rows ids and returns how many existed.
func (p *utPair) dequeue(ids []uuid.UUID) int64 {
	var n int64
	for _, id := range ids {
		if p.queue[id] {
			delete(p.queue, id)
			delete(p.qFail, id)
			n++
		}
	}
	return n
}

// commit is the cursor part of PairApplyCommit and PairsApplyCommit: the model at last,
// the cursor (when its row exists) advanced and cleared of any failure.
func (p *utPair) commit(model []byte, last uuid.UUID, since int32) {
	p.model = &db.ModelGetRow{Model: slices.Clone(model), LastEventID: last}
	if p.cursor {
		p.last, p.since, p.version = uuid.NullUUID{UUID: last, Valid: true}, since, p.version+1
		p.status, p.lastErr, p.attempts, p.nextAt = "ok", nil, 0, time.Time{}
	}
}

func (p *utPair) lockRow() db.CursorLockRow {
	return db.CursorLockRow{
		LastEventID: p.last, Version: p.version, EventsSinceSnapshot: p.since, Attempts: p.attempts,
		StreamLockInstanceID: p.lockInst, LockLive: p.lockLive && p.lockInst.Valid,
	}
}

func (p *utPair) queued() []uuid.UUID {
	ids := make([]uuid.UUID, 0, len(p.queue))
	for id := range p.queue {
		ids = append(ids, id)
	}
	return utSorted(ids)
}

type utFake struct {
	t        *testing.T
	instance uuid.UUID
	logs     *utLogBuf
	store    *mocks.StoreMock
	locker   *mocks.LockerMock
	hook     func(n int) error // called by the perspective's Apply before folding event n
	compact  bool              // the worker runs utCountPerspective instead of the utSeq one

	mu        sync.Mutex
	events    map[uuid.UUID][]db.WhEventStore // per stream, ID order
	byID      map[uuid.UUID]db.WhEventStore
	pairs     map[utKey]*utPair
	commits   int
	rollbacks int
	// releaseCtxErr records, for each Release, the error of its context at the time of the call.
	releaseCtxErr []error
	// releaseDeadline records whether each Release's context had a deadline.
	releaseDeadline []bool
}

func utNewID(t testing.TB) uuid.UUID {
	t.Helper()
	id, err := uuid.NewV7()
	require.NoError(t, err)
	return id
}

func newUTFake(t *testing.T) *utFake {
	f := &utFake{
		t:        t,
		instance: utNewID(t),
		logs:     &utLogBuf{},
		events:   map[uuid.UUID][]db.WhEventStore{},
		byID:     map[uuid.UUID]db.WhEventStore{},
		pairs:    map[utKey]*utPair{},
	}
	f.wireStore()
	f.wireLocker()
	return f
}

// p returns the pair's rows, creating an empty entry (no cursor row). Callers hold f.mu or
// run when the worker is idle.
func (f *utFake) p(stream uuid.UUID, name string) *utPair {
	k := utKey{stream, name}
	p := f.pairs[k]
	if p == nil {
		p = &utPair{status: "ok", snaps: map[uuid.UUID][]byte{}, queue: map[uuid.UUID]bool{}, qFail: map[uuid.UUID]utQueueFail{}}
		f.pairs[k] = p
	}
	return p
}

// pair is p for tests, under the mutex.
func (f *utFake) pair(stream uuid.UUID) *utPair {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.p(stream, utName)
}

func (f *utFake) clonePairs() map[utKey]*utPair {
	out := make(map[utKey]*utPair, len(f.pairs))
	for k, p := range f.pairs {
		out[k] = p.clone()
	}
	return out
}

// newEvents stores n new events of stream with increasing IDs and n = 1, 2, … continuing
// the stream's numbering.
func (f *utFake) newEvents(stream uuid.UUID, n int) []uuid.UUID {
	f.mu.Lock()
	defer f.mu.Unlock()
	ids := make([]uuid.UUID, n)
	for i := range ids {
		ids[i] = utNewID(f.t)
		if i > 0 {
			require.True(f.t, utLess(ids[i-1], ids[i]), "UUIDv7s must be created in increasing order")
		}
		e := db.WhEventStore{
			EventID: ids[i], StreamID: stream, EventType: "Numbered",
			Data: []byte(fmt.Sprintf(`{"n":%d}`, len(f.events[stream])+1)), CreatedAt: time.Now(),
		}
		f.events[stream] = append(f.events[stream], e)
		f.byID[ids[i]] = e
	}
	return ids
}

// ns is the "n" of each event, sorted by event ID: the expected fold.
func (f *utFake) ns(ids ...uuid.UUID) []int {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make([]int, 0, len(ids))
	for _, id := range utSorted(ids) {
		var d struct {
			N int `json:"n"`
		}
		require.NoError(f.t, json.Unmarshal(f.byID[id].Data, &d))
		out = append(out, d.N)
	}
	return out
}

func (f *utFake) foldJSON(ids ...uuid.UUID) []byte {
	b, err := json.Marshal(utSeq{Seq: f.ns(ids...)})
	require.NoError(f.t, err)
	return b
}

// applied sets the pair's cursor and model as if ids had been applied.
func (f *utFake) applied(stream uuid.UUID, ids ...uuid.UUID) {
	model := f.foldJSON(ids...)
	last := utSorted(ids)[len(ids)-1]
	f.mu.Lock()
	defer f.mu.Unlock()
	p := f.p(stream, utName)
	p.cursor = true
	p.last = uuid.NullUUID{UUID: last, Valid: true}
	p.version = 10
	p.since = int32(len(ids))
	p.model = &db.ModelGetRow{Model: model, LastEventID: last}
}

func (f *utFake) enqueue(stream uuid.UUID, ids ...uuid.UUID) {
	f.mu.Lock()
	defer f.mu.Unlock()
	p := f.p(stream, utName)
	for _, id := range ids {
		p.queue[id] = true
	}
}

// snapshot stores a snapshot at `at` holding the fold of ids.
func (f *utFake) snapshot(stream uuid.UUID, at uuid.UUID, ids ...uuid.UUID) {
	model := f.foldJSON(ids...)
	f.mu.Lock()
	defer f.mu.Unlock()
	f.p(stream, utName).snaps[at] = model
}

// worker builds a worker on the fake. With withLocker false, Config.Locker stays nil.
func (f *utFake) worker(withLocker bool, mod func(*worker.Config)) *worker.Worker {
	cfg := worker.Config{
		InstanceID: f.instance,
		Perspectives: []worker.Perspective{utPerspective(utName, func(n int) error {
			if f.hook != nil {
				return f.hook(n)
			}
			return nil
		})},
		Logger: utLogger(f.logs),
	}
	if f.compact {
		cfg.Perspectives = []worker.Perspective{utCountPerspective(utName)}
	}
	if withLocker {
		cfg.Locker = f.locker
	}
	if mod != nil {
		mod(&cfg)
	}
	w, err := worker.NewWithStore(f.store, cfg)
	require.NoError(f.t, err)
	return w
}

func (f *utFake) wireStore() {
	s := &mocks.StoreMock{}
	f.store = s
	lock := func(ctx context.Context) (func(), error) {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		f.mu.Lock()
		return f.mu.Unlock, nil
	}

	s.InTxFunc = func(ctx context.Context, fn func(q db.Querier) error) error {
		if err := ctx.Err(); err != nil {
			return err
		}
		f.mu.Lock()
		saved := f.clonePairs()
		f.mu.Unlock()
		committed := false
		defer func() {
			if committed {
				return
			}
			// An error or a panic: roll back (pgx.BeginFunc rolls back on both).
			f.mu.Lock()
			f.pairs = saved
			f.rollbacks++
			f.mu.Unlock()
		}()
		if err := fn(s); err != nil {
			return err
		}
		committed = true
		f.mu.Lock()
		f.commits++
		f.mu.Unlock()
		return nil
	}

	// Cursors.
	s.CursorEnsureFunc = func(ctx context.Context, a db.CursorEnsureParams) error {
		unlock, err := lock(ctx)
		if err != nil {
			return err
		}
		defer unlock()
		f.p(a.StreamID, a.PerspectiveName).cursor = true
		return nil
	}
	s.CursorLockFunc = func(ctx context.Context, a db.CursorLockParams) (db.CursorLockRow, error) {
		unlock, err := lock(ctx)
		if err != nil {
			return db.CursorLockRow{}, err
		}
		defer unlock()
		p := f.p(a.StreamID, a.PerspectiveName)
		if !p.cursor {
			return db.CursorLockRow{}, pgx.ErrNoRows
		}
		return p.lockRow(), nil
	}
	s.CursorGetFunc = func(ctx context.Context, a db.CursorGetParams) (db.CursorGetRow, error) {
		unlock, err := lock(ctx)
		if err != nil {
			return db.CursorGetRow{}, err
		}
		defer unlock()
		p := f.p(a.StreamID, a.PerspectiveName)
		if !p.cursor {
			return db.CursorGetRow{}, pgx.ErrNoRows
		}
		r := p.lockRow()
		return db.CursorGetRow{
			StreamID: a.StreamID, PerspectiveName: a.PerspectiveName, LastEventID: r.LastEventID,
			Version: r.Version, Status: p.status, LastError: p.lastErr, Attempts: r.Attempts,
			EventsSinceSnapshot: r.EventsSinceSnapshot, StreamLockInstanceID: r.StreamLockInstanceID, LockLive: r.LockLive,
		}, nil
	}
	s.CursorMarkFailedFunc = func(ctx context.Context, a db.CursorMarkFailedParams) (db.CursorMarkFailedRow, error) {
		unlock, err := lock(ctx)
		if err != nil {
			return db.CursorMarkFailedRow{}, err
		}
		defer unlock()
		p := f.p(a.StreamID, a.PerspectiveName)
		if !p.cursor {
			return db.CursorMarkFailedRow{}, pgx.ErrNoRows
		}
		p.status, p.lastErr = "failed", a.LastError
		p.attempts++
		p.nextAt = time.Now().Add(time.Duration(a.BackoffSeconds * float64(time.Second)))
		return db.CursorMarkFailedRow{Attempts: p.attempts, NextAttemptAt: p.nextAt}, nil
	}
	s.CursorResetFunc = func(ctx context.Context, a db.CursorResetParams) error {
		unlock, err := lock(ctx)
		if err != nil {
			return err
		}
		defer unlock()
		p := f.p(a.StreamID, a.PerspectiveName)
		if p.cursor {
			p.last, p.since, p.version = uuid.NullUUID{}, 0, p.version+1
			p.status, p.lastErr, p.attempts, p.nextAt = "ok", nil, 0, time.Time{}
		}
		return nil
	}

	// The normal path's fused statements.
	s.PairLockForApplyFunc = func(ctx context.Context, a db.PairLockForApplyParams) (db.PairLockForApplyRow, error) {
		unlock, err := lock(ctx)
		if err != nil {
			return db.PairLockForApplyRow{}, err
		}
		defer unlock()
		p := f.p(a.StreamID, a.PerspectiveName)
		if !p.cursor {
			return db.PairLockForApplyRow{}, pgx.ErrNoRows
		}
		r := p.lockRow()
		row := db.PairLockForApplyRow{
			LastEventID: r.LastEventID, Version: r.Version, EventsSinceSnapshot: r.EventsSinceSnapshot,
			Attempts: r.Attempts, StreamLockInstanceID: r.StreamLockInstanceID, LockLive: r.LockLive,
			HasSnapshot: len(p.snaps) > 0,
		}
		return row, nil
	}
	s.PairApplyCommitFunc = func(ctx context.Context, a db.PairApplyCommitParams) (int64, error) {
		unlock, err := lock(ctx)
		if err != nil {
			return 0, err
		}
		defer unlock()
		p := f.p(a.StreamID, a.PerspectiveName)
		p.commit(a.Model, a.LastEventID, a.EventsSinceSnapshot)
		return p.dequeue(a.EventIds), nil
	}

	// Models.
	s.ModelGetFunc = func(ctx context.Context, a db.ModelGetParams) (db.ModelGetRow, error) {
		unlock, err := lock(ctx)
		if err != nil {
			return db.ModelGetRow{}, err
		}
		defer unlock()
		p := f.p(a.StreamID, a.PerspectiveName)
		if p.model == nil {
			return db.ModelGetRow{}, pgx.ErrNoRows
		}
		return *p.model, nil
	}
	s.ModelDeleteFunc = func(ctx context.Context, a db.ModelDeleteParams) (int64, error) {
		unlock, err := lock(ctx)
		if err != nil {
			return 0, err
		}
		defer unlock()
		p := f.p(a.StreamID, a.PerspectiveName)
		if p.model == nil {
			return 0, nil
		}
		p.model = nil
		return 1, nil
	}

	// Queue.
	s.QueueEventsForPairFunc = func(ctx context.Context, a db.QueueEventsForPairParams) ([]db.QueueEventsForPairRow, error) {
		unlock, err := lock(ctx)
		if err != nil {
			return nil, err
		}
		defer unlock()
		var out []db.QueueEventsForPairRow
		for _, id := range f.p(a.StreamID, a.PerspectiveName).queued() {
			if len(out) >= int(a.RowLimit) {
				break
			}
			e := f.byID[id]
			out = append(out, db.QueueEventsForPairRow{EventID: id, EventType: e.EventType, Data: e.Data, CreatedAt: e.CreatedAt})
		}
		return out, nil
	}
	s.QueueIDsForPairFunc = func(ctx context.Context, a db.QueueIDsForPairParams) ([]uuid.UUID, error) {
		unlock, err := lock(ctx)
		if err != nil {
			return nil, err
		}
		defer unlock()
		return f.p(a.StreamID, a.PerspectiveName).queued(), nil
	}
	s.QueueMarkFailedFunc = func(ctx context.Context, a db.QueueMarkFailedParams) (int64, error) {
		unlock, err := lock(ctx)
		if err != nil {
			return 0, err
		}
		defer unlock()
		p := f.p(a.StreamID, a.PerspectiveName)
		for id := range p.queue {
			q := p.qFail[id]
			p.qFail[id] = utQueueFail{attempts: q.attempts + 1, lastErr: a.LastError, nextAt: a.NextAttemptAt}
		}
		return int64(len(p.queue)), nil
	}

	// Snapshots.
	s.SnapshotIDsFunc = func(ctx context.Context, a db.SnapshotIDsParams) ([]uuid.UUID, error) {
		unlock, err := lock(ctx)
		if err != nil {
			return nil, err
		}
		defer unlock()
		var ids []uuid.UUID
		for id := range f.p(a.StreamID, a.PerspectiveName).snaps {
			ids = append(ids, id)
		}
		ids = utSorted(ids)
		slices.Reverse(ids)
		return ids, nil
	}
	s.SnapshotInsertFunc = func(ctx context.Context, a db.SnapshotInsertParams) error {
		unlock, err := lock(ctx)
		if err != nil {
			return err
		}
		defer unlock()
		f.p(a.StreamID, a.PerspectiveName).snaps[a.SnapshotEventID] = slices.Clone(a.Model)
		return nil
	}
	s.SnapshotLatestBeforeFunc = func(ctx context.Context, a db.SnapshotLatestBeforeParams) (db.SnapshotLatestBeforeRow, error) {
		unlock, err := lock(ctx)
		if err != nil {
			return db.SnapshotLatestBeforeRow{}, err
		}
		defer unlock()
		var best *db.SnapshotLatestBeforeRow
		for id, m := range f.p(a.StreamID, a.PerspectiveName).snaps {
			if utLess(id, a.BeforeEventID) && (best == nil || utLess(best.SnapshotEventID, id)) {
				best = &db.SnapshotLatestBeforeRow{SnapshotEventID: id, Model: m}
			}
		}
		if best == nil {
			return db.SnapshotLatestBeforeRow{}, pgx.ErrNoRows
		}
		return *best, nil
	}
	s.SnapshotsDeleteFunc = func(ctx context.Context, a db.SnapshotsDeleteParams) (int64, error) {
		unlock, err := lock(ctx)
		if err != nil {
			return 0, err
		}
		defer unlock()
		p := f.p(a.StreamID, a.PerspectiveName)
		var n int64
		for _, id := range a.SnapshotEventIds {
			if _, ok := p.snaps[id]; ok {
				delete(p.snaps, id)
				n++
			}
		}
		return n, nil
	}
	s.SnapshotsDeleteAllFunc = func(ctx context.Context, a db.SnapshotsDeleteAllParams) (int64, error) {
		unlock, err := lock(ctx)
		if err != nil {
			return 0, err
		}
		defer unlock()
		p := f.p(a.StreamID, a.PerspectiveName)
		n := int64(len(p.snaps))
		p.snaps = map[uuid.UUID][]byte{}
		return n, nil
	}
	s.SnapshotsDeleteFromFunc = func(ctx context.Context, a db.SnapshotsDeleteFromParams) (int64, error) {
		unlock, err := lock(ctx)
		if err != nil {
			return 0, err
		}
		defer unlock()
		p := f.p(a.StreamID, a.PerspectiveName)
		var n int64
		for id := range p.snaps {
			if !utLess(id, a.FromEventID) {
				delete(p.snaps, id)
				n++
			}
		}
		return n, nil
	}

	// The group path's statements: the pairs come as parallel arrays, as in the SQL.
	s.PairsLockForApplyFunc = func(ctx context.Context, a db.PairsLockForApplyParams) ([]db.PairsLockForApplyRow, error) {
		keys, err := utKeys(a.StreamIds, a.PerspectiveNames)
		if err != nil {
			return nil, err
		}
		unlock, err := lock(ctx)
		if err != nil {
			return nil, err
		}
		defer unlock()
		// Row locks are not modelled (as in PairLockForApply): only a missing cursor row
		// leaves a pair out.
		out := []db.PairsLockForApplyRow{}
		for _, k := range keys {
			p := f.p(k.stream, k.name)
			if !p.cursor {
				continue
			}
			r := p.lockRow()
			out = append(out, db.PairsLockForApplyRow{
				StreamID: k.stream, PerspectiveName: k.name, LastEventID: r.LastEventID,
				EventsSinceSnapshot: r.EventsSinceSnapshot, StreamLockInstanceID: r.StreamLockInstanceID,
				LockLive: r.LockLive, HasSnapshot: len(p.snaps) > 0,
			})
		}
		return out, nil
	}
	s.CursorsMissingFunc = func(ctx context.Context, a db.CursorsMissingParams) ([]db.CursorsMissingRow, error) {
		keys, err := utKeys(a.StreamIds, a.PerspectiveNames)
		if err != nil {
			return nil, err
		}
		unlock, err := lock(ctx)
		if err != nil {
			return nil, err
		}
		defer unlock()
		out := []db.CursorsMissingRow{}
		for _, k := range keys {
			if !f.p(k.stream, k.name).cursor {
				out = append(out, db.CursorsMissingRow{StreamID: k.stream, PerspectiveName: k.name})
			}
		}
		return out, nil
	}
	s.CursorsEnsureFunc = func(ctx context.Context, a db.CursorsEnsureParams) ([]db.CursorsEnsureRow, error) {
		keys, err := utKeys(a.StreamIds, a.PerspectiveNames)
		if err != nil {
			return nil, err
		}
		unlock, err := lock(ctx)
		if err != nil {
			return nil, err
		}
		defer unlock()
		out := []db.CursorsEnsureRow{}
		for _, k := range keys {
			if p := f.p(k.stream, k.name); !p.cursor {
				p.cursor = true
				out = append(out, db.CursorsEnsureRow{StreamID: k.stream, PerspectiveName: k.name})
			}
		}
		return out, nil
	}
	s.QueueEventsForPairsFunc = func(ctx context.Context, a db.QueueEventsForPairsParams) ([]db.QueueEventsForPairsRow, error) {
		keys, err := utKeys(a.StreamIds, a.PerspectiveNames)
		if err != nil {
			return nil, err
		}
		unlock, err := lock(ctx)
		if err != nil {
			return nil, err
		}
		defer unlock()
		out := []db.QueueEventsForPairsRow{}
		for _, k := range keys {
			ids := f.p(k.stream, k.name).queued()
			for _, id := range ids[:min(len(ids), max(int(a.PerPairLimit), 0))] {
				e, ok := f.byID[id]
				if !ok {
					continue // the join with the event store drops it
				}
				out = append(out, db.QueueEventsForPairsRow{
					StreamID: k.stream, PerspectiveName: k.name, EventID: id,
					EventType: e.EventType, Data: e.Data, CreatedAt: e.CreatedAt,
				})
			}
		}
		// The SQL promises no order across pairs: hand them back interleaved, newest first.
		slices.SortStableFunc(out, func(x, y db.QueueEventsForPairsRow) int { return bytes.Compare(y.EventID[:], x.EventID[:]) })
		return out, nil
	}
	s.ModelsGetFunc = func(ctx context.Context, a db.ModelsGetParams) ([]db.ModelsGetRow, error) {
		keys, err := utKeys(a.StreamIds, a.PerspectiveNames)
		if err != nil {
			return nil, err
		}
		unlock, err := lock(ctx)
		if err != nil {
			return nil, err
		}
		defer unlock()
		out := []db.ModelsGetRow{}
		for _, k := range keys {
			if m := f.p(k.stream, k.name).model; m != nil {
				out = append(out, db.ModelsGetRow{
					StreamID: k.stream, PerspectiveName: k.name, Model: slices.Clone(m.Model), LastEventID: m.LastEventID,
				})
			}
		}
		return out, nil
	}
	s.PairsApplyCommitFunc = func(ctx context.Context, a db.PairsApplyCommitParams) (int64, error) {
		keys, err := utKeys(a.StreamIds, a.PerspectiveNames)
		if err != nil {
			return 0, err
		}
		if len(a.Models) != len(keys) || len(a.LastEventIds) != len(keys) || len(a.EventsSinceSnapshot) != len(keys) {
			return 0, fmt.Errorf("fake PairsApplyCommit: %d pairs but %d models, %d last event IDs, %d counters",
				len(keys), len(a.Models), len(a.LastEventIds), len(a.EventsSinceSnapshot))
		}
		if err := utDistinct(keys); err != nil {
			return 0, fmt.Errorf("fake PairsApplyCommit: ON CONFLICT DO UPDATE command cannot affect row a second time: %w", err)
		}
		applied, err := utKeys(a.AppliedStreamIds, a.AppliedPerspectiveNames)
		if err != nil {
			return 0, err
		}
		if len(a.AppliedEventIds) != len(applied) {
			return 0, fmt.Errorf("fake PairsApplyCommit: %d applied pairs but %d applied event IDs", len(applied), len(a.AppliedEventIds))
		}
		unlock, err := lock(ctx)
		if err != nil {
			return 0, err
		}
		defer unlock()
		for i, k := range keys {
			f.p(k.stream, k.name).commit(a.Models[i], a.LastEventIds[i], a.EventsSinceSnapshot[i])
		}
		var n int64
		for i, k := range applied {
			n += f.p(k.stream, k.name).dequeue(a.AppliedEventIds[i : i+1])
		}
		return n, nil
	}
	s.SnapshotsInsertManyFunc = func(ctx context.Context, a db.SnapshotsInsertManyParams) error {
		keys, err := utKeys(a.StreamIds, a.PerspectiveNames)
		if err != nil {
			return err
		}
		if len(a.SnapshotEventIds) != len(keys) || len(a.Models) != len(keys) {
			return fmt.Errorf("fake SnapshotsInsertMany: %d pairs but %d snapshot IDs, %d models", len(keys), len(a.SnapshotEventIds), len(a.Models))
		}
		seen := make(map[utKey]map[uuid.UUID]bool, len(keys))
		for i, k := range keys {
			if seen[k] == nil {
				seen[k] = map[uuid.UUID]bool{}
			}
			if seen[k][a.SnapshotEventIds[i]] {
				return fmt.Errorf("fake SnapshotsInsertMany: ON CONFLICT DO UPDATE command cannot affect row a second time (%s at %s)", k.stream, a.SnapshotEventIds[i])
			}
			seen[k][a.SnapshotEventIds[i]] = true
		}
		unlock, err := lock(ctx)
		if err != nil {
			return err
		}
		defer unlock()
		for i, k := range keys {
			f.p(k.stream, k.name).snaps[a.SnapshotEventIds[i]] = slices.Clone(a.Models[i])
		}
		return nil
	}
	s.SnapshotsPruneFunc = func(ctx context.Context, a db.SnapshotsPruneParams) (int64, error) {
		keys, err := utKeys(a.StreamIds, a.PerspectiveNames)
		if err != nil {
			return 0, err
		}
		unlock, err := lock(ctx)
		if err != nil {
			return 0, err
		}
		defer unlock()
		// Per pair, newest first, the row at position pos (from 1) of total goes when
		// pos >= max(max_per_stream, 2) and (max_per_stream = 1 or pos < total).
		maxPer := int(a.MaxPerStream)
		var n int64
		done := map[utKey]bool{}
		for _, k := range keys {
			if done[k] {
				continue
			}
			done[k] = true
			p := f.p(k.stream, k.name)
			ids := make([]uuid.UUID, 0, len(p.snaps))
			for id := range p.snaps {
				ids = append(ids, id)
			}
			ids = utSorted(ids)
			slices.Reverse(ids)
			for i, id := range ids {
				pos := i + 1
				if pos >= max(maxPer, 2) && (maxPer == 1 || pos < len(ids)) {
					delete(p.snaps, id)
					n++
				}
			}
		}
		return n, nil
	}

	// Events.
	s.EventsReplayPageFunc = func(ctx context.Context, a db.EventsReplayPageParams) ([]db.WhEventStore, error) {
		unlock, err := lock(ctx)
		if err != nil {
			return nil, err
		}
		defer unlock()
		var out []db.WhEventStore
		for _, e := range f.events[a.StreamID] {
			if utLess(a.AfterEventID, e.EventID) && !utLess(a.UptoEventID, e.EventID) {
				if len(out) >= int(a.PageSize) {
					break
				}
				out = append(out, e)
			}
		}
		return out, nil
	}
}

// utKeys zips the parallel arrays of a group statement. Arrays of different lengths are an
// error here (unnest would pad the shorter with NULLs).
func utKeys(streams []uuid.UUID, names []string) ([]utKey, error) {
	if len(streams) != len(names) {
		return nil, fmt.Errorf("fake: %d stream IDs but %d perspective names", len(streams), len(names))
	}
	keys := make([]utKey, len(streams))
	for i := range streams {
		keys[i] = utKey{streams[i], names[i]}
	}
	return keys, nil
}

// utDistinct reports a pair given twice.
func utDistinct(keys []utKey) error {
	seen := make(map[utKey]bool, len(keys))
	for _, k := range keys {
		if seen[k] {
			return fmt.Errorf("pair %s/%s given twice", k.stream, k.name)
		}
		seen[k] = true
	}
	return nil
}

// wireLocker makes the LockerMock act on the lock columns of the fake cursor rows, as the
// Postgres locker does: acquire when free, expired or already ours (creating the cursor
// row), renew only a live lock we hold, release only our own lock.
func (f *utFake) wireLocker() {
	f.locker = &mocks.LockerMock{
		TryAcquireFunc: func(ctx context.Context, stream uuid.UUID, name string, inst uuid.UUID, _ locker.Reason) (bool, error) {
			f.mu.Lock()
			defer f.mu.Unlock()
			p := f.p(stream, name)
			if p.lockInst.Valid && p.lockLive && p.lockInst.UUID != inst {
				return false, nil
			}
			p.cursor = true
			p.lockInst, p.lockLive = uuid.NullUUID{UUID: inst, Valid: true}, true
			return true, nil
		},
		RenewFunc: func(ctx context.Context, stream uuid.UUID, name string, inst uuid.UUID) (bool, error) {
			f.mu.Lock()
			defer f.mu.Unlock()
			p := f.p(stream, name)
			return p.lockInst.Valid && p.lockLive && p.lockInst.UUID == inst, nil
		},
		ReleaseFunc: func(ctx context.Context, stream uuid.UUID, name string, inst uuid.UUID) error {
			_, hasDeadline := ctx.Deadline()
			f.mu.Lock()
			defer f.mu.Unlock()
			f.releaseCtxErr = append(f.releaseCtxErr, ctx.Err())
			f.releaseDeadline = append(f.releaseDeadline, hasDeadline)
			p := f.p(stream, name)
			if p.lockInst.Valid && p.lockInst.UUID == inst {
				p.lockInst, p.lockLive = uuid.NullUUID{}, false
			}
			return nil
		},
	}
}

// lockedBy marks the pair as locked by inst (live or expired).
func (f *utFake) lockedBy(stream uuid.UUID, inst uuid.UUID, live bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	p := f.p(stream, utName)
	p.cursor = true
	p.lockInst, p.lockLive = uuid.NullUUID{UUID: inst, Valid: true}, live
}

// assertReleasedOnce checks exactly one Release, for this pair and instance, made with a
// live context that has a deadline (a fresh, short one).
func (f *utFake) assertReleasedOnce(t *testing.T, w *worker.Worker, stream uuid.UUID) {
	t.Helper()
	calls := f.locker.ReleaseCalls()
	require.Len(t, calls, 1, "Release must be called exactly once")
	assert.Equal(t, stream, calls[0].StreamID)
	assert.Equal(t, utName, calls[0].PerspectiveName)
	assert.Equal(t, f.instance, calls[0].InstanceID)
	f.mu.Lock()
	defer f.mu.Unlock()
	assert.NoError(t, f.releaseCtxErr[0], "Release must run with a context that is not cancelled")
	assert.True(t, f.releaseDeadline[0], "Release must run with a fresh, bounded context")
	assert.Zero(t, w.HeldLocks(), "no stream lock may stay recorded as held")
}

// lateScenario: a stream of 6 events; the pair applied 1,2,4,5 (cursor at event 5) and
// event 3 arrived late; event 6 is new. Both 3 and 6 are queued.
type lateScenario struct {
	stream uuid.UUID
	ids    []uuid.UUID
	late   uuid.UUID
}

func (f *utFake) lateScenario() lateScenario {
	s := lateScenario{stream: utNewID(f.t)}
	s.ids = f.newEvents(s.stream, 6)
	s.late = s.ids[2]
	f.applied(s.stream, s.ids[0], s.ids[1], s.ids[3], s.ids[4])
	f.enqueue(s.stream, s.late, s.ids[5])
	return s
}

func utDisabled(c *worker.Config) { c.Snapshots.Disabled = true }

// ---------------------------------------------------------------------------------------
// 1. A queued event older than the cursor triggers a rewind from it.

func TestUnitRewindLateEventReplaysFromSnapshotBeforeIt(t *testing.T) {
	f := newUTFake(t)
	sc := f.lateScenario()
	ids := sc.ids
	// A snapshot before the late event (after event 2) and one it invalidates (after 4).
	f.snapshot(sc.stream, ids[1], ids[0], ids[1])
	f.snapshot(sc.stream, ids[3], ids[0], ids[1], ids[3])
	w := f.worker(true, nil)

	w.ProcessPair(context.Background(), sc.stream, utName)

	sl := f.store.SnapshotLatestBeforeCalls()
	require.Len(t, sl, 1)
	assert.Equal(t, sc.late, sl[0].Arg.BeforeEventID, "the restore point must be strictly before the late event")

	rp := f.store.EventsReplayPageCalls()
	require.NotEmpty(t, rp, "the stream must be replayed")
	assert.Equal(t, ids[1], rp[0].Arg.AfterEventID, "replay starts right after the restored snapshot")
	assert.Equal(t, ids[5], rp[0].Arg.UptoEventID, "replay runs up to the newest queued event")

	up := f.store.PairApplyCommitCalls()
	require.Len(t, up, 1)
	assert.Equal(t, []int{1, 2, 3, 4, 5, 6}, utDecode(t, up[0].Arg.Model), "model must be the fold of every event in ID order")
	assert.Equal(t, ids[5], up[0].Arg.LastEventID)

	qd := f.store.PairApplyCommitCalls()
	require.Len(t, qd, 1)
	assert.ElementsMatch(t, []uuid.UUID{sc.late, ids[5]}, qd[0].Arg.EventIds)

	sdf := f.store.SnapshotsDeleteFromCalls()
	require.Len(t, sdf, 1)
	assert.Equal(t, sc.late, sdf[0].Arg.FromEventID)

	p := f.pair(sc.stream)
	assert.Empty(t, p.queue)
	assert.Equal(t, ids[5], p.last.UUID)
	assert.Contains(t, p.snaps, ids[1], "the snapshot before the late event is kept")
	assert.NotContains(t, p.snaps, ids[3], "the snapshot the late event invalidated is dropped")
	assert.Empty(t, f.store.CursorMarkFailedCalls(), "a successful rewind records no failure")
	assert.Zero(t, w.CoordinatorSize())
}

func TestUnitRewindWithoutSnapshotReplaysWholeStreamInPages(t *testing.T) {
	f := newUTFake(t)
	f.compact = true
	stream := utNewID(t)
	const n = 1203 // more than two replay pages
	ids := f.newEvents(stream, n)
	late := ids[1]
	appliedIDs := slices.Concat(ids[:1], ids[2:])
	f.applied(stream, appliedIDs...)
	f.enqueue(stream, late)
	w := f.worker(true, utDisabled)

	w.ProcessPair(context.Background(), stream, utName)

	assert.Empty(t, f.store.SnapshotLatestBeforeCalls(), "snapshots disabled: no restore point is read")
	rp := f.store.EventsReplayPageCalls()
	require.Len(t, rp, 3, "1203 events are read in pages")
	assert.Equal(t, uuid.Nil, rp[0].Arg.AfterEventID)
	assert.Equal(t, ids[rp[0].Arg.PageSize-1], rp[1].Arg.AfterEventID, "the next page starts after the last event read")
	for _, c := range rp {
		assert.Equal(t, ids[n-1], c.Arg.UptoEventID, "replay runs up to the cursor")
		assert.Less(t, int(c.Arg.PageSize), n, "a page must not hold the whole stream")
	}
	up := f.store.PairApplyCommitCalls()
	require.Len(t, up, 1)
	var got utCount
	require.NoError(t, json.Unmarshal(up[0].Arg.Model, &got))
	assert.Equal(t, utCount{Count: n, Last: n}, got, "every event folded once, in ID order")
	assert.Equal(t, ids[n-1], up[0].Arg.LastEventID)
	qd := f.store.PairApplyCommitCalls()
	require.Len(t, qd, 1)
	assert.Equal(t, []uuid.UUID{late}, qd[0].Arg.EventIds)
}

// A queued event equal to the cursor is already in the model: it must not be applied again.
func TestUnitQueuedEventAtCursorIsNotAppliedTwice(t *testing.T) {
	f := newUTFake(t)
	stream := utNewID(t)
	ids := f.newEvents(stream, 3)
	f.applied(stream, ids[0], ids[1])
	f.enqueue(stream, ids[1], ids[2]) // a stale row for the cursor's own event, and a new one
	w := f.worker(true, nil)

	w.ProcessPair(context.Background(), stream, utName)

	up := f.store.PairApplyCommitCalls()
	require.Len(t, up, 1)
	assert.Equal(t, []int{1, 2, 3}, utDecode(t, up[0].Arg.Model), "no event may be folded twice")
	assert.Equal(t, ids[2], up[0].Arg.LastEventID)
	assert.Empty(t, f.pair(stream).queue)
}

// ---------------------------------------------------------------------------------------
// 2. Every queued event newer than the cursor: the normal path, no rewind.

func TestUnitNormalPathAppliesWithoutRewind(t *testing.T) {
	f := newUTFake(t)
	stream := utNewID(t)
	ids := f.newEvents(stream, 4)
	f.applied(stream, ids[0], ids[1])
	f.snapshot(stream, ids[1], ids[0], ids[1])
	f.enqueue(stream, ids[2], ids[3])
	w := f.worker(true, nil)

	w.ProcessPair(context.Background(), stream, utName)

	assert.Empty(t, f.locker.TryAcquireCalls(), "the normal path takes no stream lock")
	assert.Empty(t, f.store.EventsReplayPageCalls(), "the normal path does not replay")
	assert.Empty(t, f.store.SnapshotLatestBeforeCalls())
	up := f.store.PairApplyCommitCalls()
	require.Len(t, up, 1)
	assert.Equal(t, []int{1, 2, 3, 4}, utDecode(t, up[0].Arg.Model))
	assert.Equal(t, ids[3], up[0].Arg.LastEventID)
	qd := f.store.PairApplyCommitCalls()
	require.Len(t, qd, 1)
	assert.Equal(t, []uuid.UUID{ids[2], ids[3]}, qd[0].Arg.EventIds)
	ca := f.store.PairApplyCommitCalls()
	require.Len(t, ca, 1)
	assert.Equal(t, ids[3], ca[0].Arg.LastEventID)
	assert.Empty(t, f.pair(stream).queue)
}

// ---------------------------------------------------------------------------------------
// 3. A rewind takes the lock with reason rewind and releases it once, after its commit.

func TestUnitRewindTakesAndReleasesStreamLock(t *testing.T) {
	f := newUTFake(t)
	sc := f.lateScenario()
	w := f.worker(true, nil)
	var upsertsAtRelease = -1
	release := f.locker.ReleaseFunc
	f.locker.ReleaseFunc = func(ctx context.Context, s uuid.UUID, n string, i uuid.UUID) error {
		upsertsAtRelease = len(f.store.PairApplyCommitCalls())
		return release(ctx, s, n, i)
	}

	w.ProcessPair(context.Background(), sc.stream, utName)

	ta := f.locker.TryAcquireCalls()
	require.Len(t, ta, 1)
	assert.Equal(t, locker.ReasonRewind, ta[0].Reason)
	assert.Equal(t, sc.stream, ta[0].StreamID)
	assert.Equal(t, utName, ta[0].PerspectiveName)
	assert.Equal(t, f.instance, ta[0].InstanceID)
	f.assertReleasedOnce(t, w, sc.stream)
	assert.Equal(t, 1, upsertsAtRelease, "the lock is released only after the rewind committed")
	assert.False(t, f.pair(sc.stream).lockInst.Valid, "the lock columns are cleared")
}

// ---------------------------------------------------------------------------------------
// 4. Lock not acquired: nothing happens, the rows stay queued.

func TestUnitRewindSkippedWhenLockNotAcquired(t *testing.T) {
	t.Run("TryAcquire refuses", func(t *testing.T) {
		f := newUTFake(t)
		sc := f.lateScenario()
		w := f.worker(true, nil)
		// Another instance takes the lock between the normal path's look and the rewind.
		f.locker.TryAcquireFunc = func(context.Context, uuid.UUID, string, uuid.UUID, locker.Reason) (bool, error) {
			return false, nil
		}
		before := f.pair(sc.stream).clone()

		w.ProcessPair(context.Background(), sc.stream, utName)

		require.Len(t, f.locker.TryAcquireCalls(), 1)
		assert.Equal(t, locker.ReasonRewind, f.locker.TryAcquireCalls()[0].Reason)
		assert.Empty(t, f.store.EventsReplayPageCalls(), "no replay without the lock")
		assert.Empty(t, f.locker.ReleaseCalls(), "a lock not taken is not released")
		assert.Empty(t, f.store.PairApplyCommitCalls())
		assert.Empty(t, f.store.PairApplyCommitCalls())
		assert.Empty(t, f.store.CursorMarkFailedCalls(), "a refused lock is not a failure")
		after := f.pair(sc.stream)
		assert.Equal(t, before.queued(), after.queued(), "the rows stay queued")
		assert.Equal(t, before.model, after.model)
		assert.Zero(t, w.HeldLocks())
	})
	t.Run("pair visibly locked by another instance", func(t *testing.T) {
		f := newUTFake(t)
		stream := utNewID(t)
		ids := f.newEvents(stream, 3)
		f.applied(stream, ids[0])
		f.snapshot(stream, ids[0], ids[0])
		f.enqueue(stream, ids[1], ids[2])
		f.lockedBy(stream, utNewID(t), true)
		w := f.worker(true, nil)

		w.ProcessPair(context.Background(), stream, utName)

		assert.Empty(t, f.store.PairApplyCommitCalls(), "a locked pair receives no live events")
		assert.Empty(t, f.store.PairApplyCommitCalls())
		assert.Empty(t, f.locker.TryAcquireCalls())
		assert.Len(t, f.pair(stream).queue, 2)
	})
}

// ---------------------------------------------------------------------------------------
// 5, 6, 7, 13. Bootstrap of the first snapshot.

func TestUnitBootstrapWritesFirstSnapshot(t *testing.T) {
	f := newUTFake(t)
	stream := utNewID(t)
	ids := f.newEvents(stream, 4)
	f.applied(stream, ids[0], ids[1], ids[2])
	f.enqueue(stream, ids[3])
	w := f.worker(true, nil)

	w.ProcessPair(context.Background(), stream, utName)

	assert.NotEmpty(t, f.store.PairLockForApplyCalls())
	si := f.store.SnapshotInsertCalls()
	require.Len(t, si, 1, "exactly the bootstrap snapshot (EveryNEvents not reached)")
	assert.Equal(t, ids[2], si[0].Arg.SnapshotEventID, "the snapshot is at the model's LastEventID")
	assert.Equal(t, []int{1, 2, 3}, utDecode(t, si[0].Arg.Model), "the snapshot holds the model at that position")
	ta := f.locker.TryAcquireCalls()
	require.Len(t, ta, 1)
	assert.Equal(t, locker.ReasonBootstrap, ta[0].Reason)
	f.assertReleasedOnce(t, w, stream)
	// The queued event is applied after the bootstrap.
	up := f.store.PairApplyCommitCalls()
	require.Len(t, up, 1)
	assert.Equal(t, []int{1, 2, 3, 4}, utDecode(t, up[0].Arg.Model))
	assert.Empty(t, f.pair(stream).queue)
}

func TestUnitBootstrapProceedsWhenLockRefused(t *testing.T) {
	for _, tc := range []struct {
		name string
		ok   bool
		err  error
	}{
		{"refused", false, nil},
		{"locker error", false, errors.New("locker unavailable")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newUTFake(t)
			stream := utNewID(t)
			ids := f.newEvents(stream, 3)
			f.applied(stream, ids[0], ids[1])
			f.enqueue(stream, ids[2])
			f.locker.TryAcquireFunc = func(context.Context, uuid.UUID, string, uuid.UUID, locker.Reason) (bool, error) {
				return tc.ok, tc.err
			}
			w := f.worker(true, nil)

			w.ProcessPair(context.Background(), stream, utName)

			ta := f.locker.TryAcquireCalls()
			require.Len(t, ta, 1)
			assert.Equal(t, locker.ReasonBootstrap, ta[0].Reason)
			si := f.store.SnapshotInsertCalls()
			require.Len(t, si, 1, "bootstrap proceeds without the lock")
			assert.Equal(t, ids[1], si[0].Arg.SnapshotEventID)
			assert.Equal(t, []int{1, 2}, utDecode(t, si[0].Arg.Model))
			assert.Empty(t, f.locker.ReleaseCalls(), "a lock not taken is not released")
			assert.Zero(t, w.HeldLocks())
			assert.Equal(t, []int{1, 2, 3}, utDecode(t, f.pair(stream).model.Model))
		})
	}
}

func TestUnitNoBootstrapWhenSnapshotExists(t *testing.T) {
	t.Run("fewer than EveryNEvents", func(t *testing.T) {
		f := newUTFake(t)
		stream := utNewID(t)
		ids := f.newEvents(stream, 5)
		f.applied(stream, ids[0], ids[1], ids[2]) // since = 3
		f.snapshot(stream, ids[1], ids[0], ids[1])
		f.enqueue(stream, ids[3], ids[4])
		w := f.worker(true, func(c *worker.Config) { c.Snapshots.EveryNEvents = 10 })

		w.ProcessPair(context.Background(), stream, utName)

		assert.Len(t, f.store.PairLockForApplyCalls(), 1)
		assert.Empty(t, f.store.SnapshotInsertCalls(), "no bootstrap and no periodic snapshot")
		assert.Empty(t, f.locker.TryAcquireCalls())
		ca := f.store.PairApplyCommitCalls()
		require.Len(t, ca, 1)
		assert.Equal(t, int32(5), ca[0].Arg.EventsSinceSnapshot, "the counter carries over across batches")
		assert.Equal(t, []int{1, 2, 3, 4, 5}, utDecode(t, f.pair(stream).model.Model))
	})
	t.Run("EveryNEvents reached", func(t *testing.T) {
		f := newUTFake(t)
		stream := utNewID(t)
		ids := f.newEvents(stream, 6)
		f.applied(stream, ids[0], ids[1], ids[2]) // since = 3
		f.snapshot(stream, ids[1], ids[0], ids[1])
		f.enqueue(stream, ids[3], ids[4], ids[5])
		w := f.worker(true, func(c *worker.Config) { c.Snapshots.EveryNEvents = 5 })

		w.ProcessPair(context.Background(), stream, utName)

		si := f.store.SnapshotInsertCalls()
		require.Len(t, si, 1, "one periodic snapshot, at the 5th event since the last one")
		assert.Equal(t, ids[4], si[0].Arg.SnapshotEventID)
		assert.Equal(t, []int{1, 2, 3, 4, 5}, utDecode(t, si[0].Arg.Model))
		ca := f.store.PairApplyCommitCalls()
		require.Len(t, ca, 1)
		assert.Equal(t, int32(1), ca[0].Arg.EventsSinceSnapshot)
	})
}

func TestUnitBrandNewPairNoBootstrap(t *testing.T) {
	f := newUTFake(t)
	stream := utNewID(t)
	ids := f.newEvents(stream, 3)
	f.enqueue(stream, ids...) // no cursor row yet
	w := f.worker(true, nil)

	w.ProcessPair(context.Background(), stream, utName)

	assert.NotEmpty(t, f.store.CursorEnsureCalls(), "the missing cursor row is created")
	assert.Empty(t, f.store.SnapshotInsertCalls())
	assert.Empty(t, f.store.ModelGetCalls())
	assert.Empty(t, f.locker.TryAcquireCalls())
	up := f.store.PairApplyCommitCalls()
	require.Len(t, up, 1)
	assert.Equal(t, []int{1, 2, 3}, utDecode(t, up[0].Arg.Model))
	assert.Equal(t, ids[2], up[0].Arg.LastEventID)
}

// ---------------------------------------------------------------------------------------
// 8. Applied rows, and only they, leave the queue.

func TestUnitAppliedRowsLeaveQueue(t *testing.T) {
	t.Run("normal path, batch smaller than the queue", func(t *testing.T) {
		f := newUTFake(t)
		stream := utNewID(t)
		ids := f.newEvents(stream, 5)
		f.enqueue(stream, ids...)
		w := f.worker(true, func(c *worker.Config) { c.BatchSize = 3 })

		w.ProcessPair(context.Background(), stream, utName)

		qd := f.store.PairApplyCommitCalls()
		require.Len(t, qd, 1)
		assert.Equal(t, ids[:3], qd[0].Arg.EventIds)
		assert.Equal(t, ids[3:], f.pair(stream).queued(), "rows beyond the batch stay queued")

		w.ProcessPair(context.Background(), stream, utName)

		qd = f.store.PairApplyCommitCalls()
		require.Len(t, qd, 2)
		assert.Equal(t, ids[3:], qd[1].Arg.EventIds)
		assert.Empty(t, f.pair(stream).queue)
		assert.Equal(t, []int{1, 2, 3, 4, 5}, utDecode(t, f.pair(stream).model.Model))
	})
	t.Run("rewind keeps a row that arrived during it", func(t *testing.T) {
		f := newUTFake(t)
		sc := f.lateScenario()
		w := f.worker(true, nil)
		var arrived uuid.UUID
		replay := f.store.EventsReplayPageFunc
		f.store.EventsReplayPageFunc = func(ctx context.Context, a db.EventsReplayPageParams) ([]db.WhEventStore, error) {
			if arrived == uuid.Nil {
				arrived = f.newEvents(sc.stream, 1)[0]
				f.enqueue(sc.stream, arrived)
			}
			return replay(ctx, a)
		}

		w.ProcessPair(context.Background(), sc.stream, utName)

		qd := f.store.PairApplyCommitCalls()
		require.Len(t, qd, 1)
		assert.ElementsMatch(t, []uuid.UUID{sc.late, sc.ids[5]}, qd[0].Arg.EventIds, "a rewind deletes exactly the rows it replayed")
		assert.Equal(t, []uuid.UUID{arrived}, f.pair(sc.stream).queued())
		assert.Equal(t, []int{1, 2, 3, 4, 5, 6}, utDecode(t, f.pair(sc.stream).model.Model))
	})
}

// ---------------------------------------------------------------------------------------
// 9. A failing rewind is logged and recorded, and the worker carries on.

func TestUnitFailedRewindIsLoggedRecordedAndIsolated(t *testing.T) {
	f := newUTFake(t)
	sc := f.lateScenario()
	other := utNewID(t)
	otherIDs := f.newEvents(other, 2)
	f.enqueue(other, otherIDs...)
	w := f.worker(true, nil)
	replay := f.store.EventsReplayPageFunc
	f.store.EventsReplayPageFunc = func(ctx context.Context, a db.EventsReplayPageParams) ([]db.WhEventStore, error) {
		if a.StreamID == sc.stream {
			return nil, errors.New("replay exploded: disk on fire")
		}
		return replay(ctx, a)
	}

	w.ProcessPair(context.Background(), sc.stream, utName)

	assert.Contains(t, f.logs.String(), "disk on fire", "the failure must be logged with its error")
	cm := f.store.CursorMarkFailedCalls()
	require.Len(t, cm, 1, "the failure is recorded on the cursor")
	assert.Equal(t, sc.stream, cm[0].Arg.StreamID)
	require.NotNil(t, cm[0].Arg.LastError)
	assert.Contains(t, *cm[0].Arg.LastError, "disk on fire")
	assert.Len(t, f.store.QueueMarkFailedCalls(), 1, "the queue rows are pushed back for a retry")
	assert.Empty(t, f.store.PairApplyCommitCalls())
	assert.Empty(t, f.store.PairApplyCommitCalls())
	assert.Len(t, f.pair(sc.stream).queue, 2, "the rows stay queued")
	assert.Equal(t, "failed", f.pair(sc.stream).status)
	f.assertReleasedOnce(t, w, sc.stream)

	w.ProcessPair(context.Background(), other, utName)

	up := f.store.PairApplyCommitCalls()
	require.Len(t, up, 1, "another pair is applied normally afterwards")
	assert.Equal(t, other, up[0].Arg.StreamID)
	assert.Equal(t, []int{1, 2}, utDecode(t, up[0].Arg.Model))
	assert.Empty(t, f.pair(other).queue)
	assert.Zero(t, w.CoordinatorSize())
}

// ---------------------------------------------------------------------------------------
// 11. Lock lost mid-rewind: the operation is cancelled and nothing is committed.

func TestUnitLockLostMidRewindCommitsNothing(t *testing.T) {
	assertNothingCommitted := func(t *testing.T, f *utFake, sc lateScenario, before *utPair) {
		t.Helper()
		assert.Empty(t, f.store.PairApplyCommitCalls(), "no model may be written after the lock is lost")
		assert.Empty(t, f.store.PairApplyCommitCalls())
		assert.Empty(t, f.store.PairApplyCommitCalls())
		assert.Empty(t, f.store.SnapshotsDeleteFromCalls())
		after := f.pair(sc.stream)
		assert.Equal(t, before.model, after.model)
		assert.Equal(t, before.queued(), after.queued(), "the rows stay queued")
		assert.Equal(t, before.last, after.last)
	}

	t.Run("renewal reports the lock lost", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			f := newUTFake(t)
			sc := f.lateScenario()
			before := f.pair(sc.stream).clone()
			w := f.worker(true, func(c *worker.Config) {
				c.LockOptions = locker.Options{LockTimeout: 30 * time.Second, KeepAliveInterval: 10 * time.Second}
			})
			taker := utNewID(t)
			var causeSeen error
			replay := f.store.EventsReplayPageFunc
			f.store.EventsReplayPageFunc = func(ctx context.Context, a db.EventsReplayPageParams) ([]db.WhEventStore, error) {
				page, err := replay(ctx, a)
				// The lock lapses and another instance takes it while the replay runs.
				f.lockedBy(sc.stream, taker, true)
				time.Sleep(11 * time.Second) // one keepalive tick
				causeSeen = context.Cause(ctx)
				return page, err
			}

			w.ProcessPair(context.Background(), sc.stream, utName)

			assert.ErrorIs(t, causeSeen, worker.ErrLockLost, "the renewal that reports the lock lost cancels the operation at once")
			assert.Len(t, f.locker.RenewCalls(), 1)
			assertNothingCommitted(t, f, sc, before)
			f.assertReleasedOnce(t, w, sc.stream)
			assert.Equal(t, taker, f.pair(sc.stream).lockInst.UUID, "releasing never clears the new holder's lock")
		})
	})
	t.Run("fencing: another instance holds the lock at commit", func(t *testing.T) {
		f := newUTFake(t)
		sc := f.lateScenario()
		before := f.pair(sc.stream).clone()
		w := f.worker(true, nil)
		replay := f.store.EventsReplayPageFunc
		f.store.EventsReplayPageFunc = func(ctx context.Context, a db.EventsReplayPageParams) ([]db.WhEventStore, error) {
			page, err := replay(ctx, a)
			f.lockedBy(sc.stream, utNewID(t), true)
			return page, err
		}

		w.ProcessPair(context.Background(), sc.stream, utName)

		assertNothingCommitted(t, f, sc, before)
		assert.NotZero(t, f.rollbacks, "the commit transaction must be rolled back")
		f.assertReleasedOnce(t, w, sc.stream)
	})
	t.Run("fencing: our lock expired before commit", func(t *testing.T) {
		f := newUTFake(t)
		sc := f.lateScenario()
		before := f.pair(sc.stream).clone()
		w := f.worker(true, nil)
		replay := f.store.EventsReplayPageFunc
		f.store.EventsReplayPageFunc = func(ctx context.Context, a db.EventsReplayPageParams) ([]db.WhEventStore, error) {
			page, err := replay(ctx, a)
			f.lockedBy(sc.stream, f.instance, false) // still ours, but expired
			return page, err
		}

		w.ProcessPair(context.Background(), sc.stream, utName)

		assertNothingCommitted(t, f, sc, before)
		assert.NotZero(t, f.rollbacks, "the commit transaction must be rolled back")
		f.assertReleasedOnce(t, w, sc.stream)
	})
}

// ---------------------------------------------------------------------------------------
// 12. The stream lock is released exactly once, with a live context, however the rewind ends.

func TestUnitRewindReleasesLockOnErrorPanicAndShutdown(t *testing.T) {
	run := func(t *testing.T, setup func(f *utFake, sc lateScenario, cancel context.CancelFunc)) (*utFake, *worker.Worker) {
		f := newUTFake(t)
		sc := f.lateScenario()
		w := f.worker(true, nil)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		setup(f, sc, cancel)
		w.ProcessPair(ctx, sc.stream, utName)
		assert.Empty(t, f.store.PairApplyCommitCalls(), "nothing is committed")
		assert.Empty(t, f.store.PairApplyCommitCalls())
		assert.Len(t, f.pair(sc.stream).queue, 2, "the rows stay queued")
		f.assertReleasedOnce(t, w, sc.stream)
		assert.Zero(t, w.CoordinatorSize(), "the apply coordinator entry is freed")
		return f, w
	}

	t.Run("replay error", func(t *testing.T) {
		run(t, func(f *utFake, _ lateScenario, _ context.CancelFunc) {
			f.store.EventsReplayPageFunc = func(context.Context, db.EventsReplayPageParams) ([]db.WhEventStore, error) {
				return nil, errors.New("connection reset")
			}
		})
	})
	t.Run("Apply panics during replay", func(t *testing.T) {
		f, _ := run(t, func(f *utFake, _ lateScenario, _ context.CancelFunc) {
			f.hook = func(n int) error {
				if n == 3 {
					panic("perspective bug")
				}
				return nil
			}
		})
		cm := f.store.CursorMarkFailedCalls()
		require.Len(t, cm, 1, "the panic is recorded as a failure of this pair")
		assert.Contains(t, *cm[0].Arg.LastError, "perspective bug")
	})
	t.Run("store panics during replay", func(t *testing.T) {
		f, _ := run(t, func(f *utFake, _ lateScenario, _ context.CancelFunc) {
			f.store.EventsReplayPageFunc = func(context.Context, db.EventsReplayPageParams) ([]db.WhEventStore, error) {
				panic("driver bug")
			}
		})
		assert.Contains(t, f.logs.String(), "driver bug", "the panic is logged")
		assert.Len(t, f.store.CursorMarkFailedCalls(), 1, "the panic is recorded as a failure of this pair")
	})
	t.Run("shutdown cancels the parent context mid-replay", func(t *testing.T) {
		run(t, func(f *utFake, _ lateScenario, cancel context.CancelFunc) {
			replay := f.store.EventsReplayPageFunc
			f.store.EventsReplayPageFunc = func(ctx context.Context, a db.EventsReplayPageParams) ([]db.WhEventStore, error) {
				page, err := replay(ctx, a)
				cancel()
				return page, err
			}
		})
	})
}

// ---------------------------------------------------------------------------------------
// 15. Without a locker the rewind still runs; the version check alone guards its commit.

func TestUnitNilLockerRewind(t *testing.T) {
	t.Run("commits", func(t *testing.T) {
		f := newUTFake(t)
		sc := f.lateScenario()
		w := f.worker(false, nil)

		w.ProcessPair(context.Background(), sc.stream, utName)

		up := f.store.PairApplyCommitCalls()
		require.Len(t, up, 1)
		assert.Equal(t, []int{1, 2, 3, 4, 5, 6}, utDecode(t, up[0].Arg.Model))
		assert.Equal(t, sc.ids[5], up[0].Arg.LastEventID)
		assert.Empty(t, f.pair(sc.stream).queue)
		assert.Empty(t, f.locker.TryAcquireCalls(), "no locker configured")
		assert.Zero(t, w.HeldLocks())
	})
	t.Run("cursor moved during the rewind: nothing written", func(t *testing.T) {
		f := newUTFake(t)
		sc := f.lateScenario()
		before := f.pair(sc.stream).clone()
		w := f.worker(false, nil)
		get := f.store.CursorGetFunc
		f.store.CursorGetFunc = func(ctx context.Context, a db.CursorGetParams) (db.CursorGetRow, error) {
			row, err := get(ctx, a)
			// Another writer commits right after the rewind read the cursor.
			f.mu.Lock()
			f.p(a.StreamID, a.PerspectiveName).version++
			f.mu.Unlock()
			return row, err
		}

		w.ProcessPair(context.Background(), sc.stream, utName)

		require.NotEmpty(t, f.store.CursorLockCalls(), "the commit re-reads the cursor under its row lock")
		assert.Empty(t, f.store.PairApplyCommitCalls(), "a moved cursor refuses the write")
		assert.Empty(t, f.store.PairApplyCommitCalls())
		assert.NotZero(t, f.rollbacks)
		after := f.pair(sc.stream)
		assert.Equal(t, before.model, after.model)
		assert.Equal(t, before.queued(), after.queued())
	})
}

// ---------------------------------------------------------------------------------------
// 16. Purge.

func TestUnitPurge(t *testing.T) {
	setup := func(t *testing.T) (*utFake, uuid.UUID) {
		f := newUTFake(t)
		stream := utNewID(t)
		ids := f.newEvents(stream, 3)
		f.applied(stream, ids[0], ids[1])
		f.snapshot(stream, ids[1], ids[0], ids[1])
		f.enqueue(stream, ids[2])
		return f, stream
	}
	t.Run("with the lock", func(t *testing.T) {
		f, stream := setup(t)
		w := f.worker(true, nil)

		require.NoError(t, w.Purge(context.Background(), stream, utName))

		ta := f.locker.TryAcquireCalls()
		require.Len(t, ta, 1)
		assert.Equal(t, locker.ReasonPurge, ta[0].Reason)
		assert.Len(t, f.store.ModelDeleteCalls(), 1)
		assert.Len(t, f.store.SnapshotsDeleteAllCalls(), 1)
		assert.Len(t, f.store.CursorResetCalls(), 1)
		f.assertReleasedOnce(t, w, stream)
		p := f.pair(stream)
		assert.Nil(t, p.model)
		assert.Empty(t, p.snaps)
		assert.False(t, p.last.Valid, "the cursor is reset")
		assert.Len(t, p.queue, 1, "queued events are kept, to be applied to a fresh model")
		assert.Zero(t, w.CoordinatorSize())
	})
	t.Run("refused", func(t *testing.T) {
		f, stream := setup(t)
		f.lockedBy(stream, utNewID(t), true)
		w := f.worker(true, nil)

		err := w.Purge(context.Background(), stream, utName)

		require.ErrorIs(t, err, worker.ErrLocked)
		assert.Len(t, f.locker.TryAcquireCalls(), 1)
		assert.Equal(t, locker.ReasonPurge, f.locker.TryAcquireCalls()[0].Reason)
		assert.Empty(t, f.store.ModelDeleteCalls())
		assert.Empty(t, f.store.SnapshotsDeleteAllCalls())
		assert.Empty(t, f.store.CursorResetCalls())
		assert.Empty(t, f.locker.ReleaseCalls())
		assert.NotNil(t, f.pair(stream).model)
	})
	t.Run("lock lost before commit", func(t *testing.T) {
		f, stream := setup(t)
		acquire := f.locker.TryAcquireFunc
		f.locker.TryAcquireFunc = func(ctx context.Context, s uuid.UUID, n string, i uuid.UUID, r locker.Reason) (bool, error) {
			ok, err := acquire(ctx, s, n, i, r)
			f.lockedBy(stream, utNewID(t), true) // lapsed and taken over at once
			return ok, err
		}
		w := f.worker(true, nil)

		err := w.Purge(context.Background(), stream, utName)

		require.ErrorIs(t, err, worker.ErrLockLost)
		assert.Empty(t, f.store.ModelDeleteCalls())
		assert.NotNil(t, f.pair(stream).model)
		f.assertReleasedOnce(t, w, stream)
	})
	t.Run("unknown perspective", func(t *testing.T) {
		f, stream := setup(t)
		w := f.worker(true, nil)

		err := w.Purge(context.Background(), stream, "no-such-perspective")

		require.ErrorIs(t, err, locker.ErrInvalidArgument)
		assert.Contains(t, err.Error(), "no-such-perspective")
		assert.Empty(t, f.locker.TryAcquireCalls())
		assert.Empty(t, f.store.InTxCalls())
	})
	t.Run("nil stream", func(t *testing.T) {
		f, _ := setup(t)
		w := f.worker(true, nil)

		err := w.Purge(context.Background(), uuid.Nil, utName)

		require.ErrorIs(t, err, locker.ErrInvalidArgument)
		assert.Empty(t, f.locker.TryAcquireCalls())
		assert.Empty(t, f.store.InTxCalls())
	})
}

// ---------------------------------------------------------------------------------------
// 17. An Apply error ends the batch: what came before commits, the rest stays queued.

func TestUnitApplyErrorKeepsFailedAndLaterEventsQueued(t *testing.T) {
	for _, mode := range []string{"error", "panic"} {
		t.Run(mode, func(t *testing.T) {
			f := newUTFake(t)
			stream := utNewID(t)
			ids := f.newEvents(stream, 5)
			f.enqueue(stream, ids...)
			f.hook = func(n int) error {
				if n == 3 {
					if mode == "panic" {
						panic("bad event three")
					}
					return errors.New("bad event three")
				}
				return nil
			}
			w := f.worker(true, nil)

			w.ProcessPair(context.Background(), stream, utName)

			up := f.store.PairApplyCommitCalls()
			require.Len(t, up, 1)
			assert.Equal(t, []int{1, 2}, utDecode(t, up[0].Arg.Model), "the events before the failing one are committed")
			assert.Equal(t, ids[1], up[0].Arg.LastEventID)
			qd := f.store.PairApplyCommitCalls()
			require.Len(t, qd, 1)
			assert.Equal(t, ids[:2], qd[0].Arg.EventIds)
			cm := f.store.CursorMarkFailedCalls()
			require.Len(t, cm, 1)
			require.NotNil(t, cm[0].Arg.LastError)
			assert.Contains(t, *cm[0].Arg.LastError, "bad event three")
			assert.Equal(t, 1.0, cm[0].Arg.BackoffSeconds, "first retry after RetryBackoff")
			qm := f.store.QueueMarkFailedCalls()
			require.Len(t, qm, 1)
			assert.Equal(t, cm[0].Arg.LastError, qm[0].Arg.LastError)
			p := f.pair(stream)
			assert.Equal(t, ids[2:], p.queued(), "the failing event and the ones after it stay queued")
			assert.Equal(t, ids[1], p.last.UUID)
			assert.Equal(t, "failed", p.status)
			assert.Contains(t, f.logs.String(), "bad event three")

			// The retry fails again: the backoff doubles.
			w.ProcessPair(context.Background(), stream, utName)
			cm = f.store.CursorMarkFailedCalls()
			require.Len(t, cm, 2)
			assert.Equal(t, 2.0, cm[1].Arg.BackoffSeconds)
			assert.Len(t, f.store.PairApplyCommitCalls(), 1, "nothing new is applied")

			// Fixed: the rest is applied in order.
			f.hook = nil
			w.ProcessPair(context.Background(), stream, utName)
			assert.Equal(t, []int{1, 2, 3, 4, 5}, utDecode(t, f.pair(stream).model.Model))
			assert.Empty(t, f.pair(stream).queue)
			assert.Equal(t, "ok", f.pair(stream).status)
		})
	}
}

// ---------------------------------------------------------------------------------------
// The apply coordinator inside the worker: work on one pair is serialized in-process,
// work on other pairs is not held up by it.

func TestUnitProcessPairSerializedPerPair(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newUTFake(t)
		s1, s2 := utNewID(t), utNewID(t)
		ids1 := f.newEvents(s1, 2)
		ids2 := f.newEvents(s2, 1)
		f.enqueue(s1, ids1[0])
		f.enqueue(s2, ids2...)
		w := f.worker(true, nil)

		gate := make(chan struct{})
		var gated atomic.Bool // not sync.Once: a goroutine waiting on a mutex would stall synctest.Wait
		queue := f.store.QueueEventsForPairFunc
		f.store.QueueEventsForPairFunc = func(ctx context.Context, a db.QueueEventsForPairParams) ([]db.QueueEventsForPairRow, error) {
			if a.StreamID == s1 && gated.CompareAndSwap(false, true) {
				<-gate // the first apply of s1 is slow
			}
			return queue(ctx, a)
		}
		lockCalls := func(stream uuid.UUID) int {
			n := 0
			for _, c := range f.store.PairLockForApplyCalls() {
				if c.Arg.StreamID == stream {
					n++
				}
			}
			return n
		}

		var wg sync.WaitGroup
		wg.Go(func() { w.ProcessPair(context.Background(), s1, utName) })
		synctest.Wait()
		first := lockCalls(s1)
		require.NotZero(t, first, "the first apply is under way")
		f.enqueue(s1, ids1[1])
		wg.Go(func() { w.ProcessPair(context.Background(), s1, utName) })
		synctest.Wait()
		assert.Equal(t, first, lockCalls(s1), "the second apply of the same pair waits for the first")
		assert.Equal(t, 1, w.CoordinatorSize(), "one entry: held by the first apply, awaited by the second")

		w.ProcessPair(context.Background(), s2, utName) // another pair is not blocked
		assert.Equal(t, []int{1}, utDecode(t, f.pair(s2).model.Model))

		close(gate)
		wg.Wait()
		assert.Equal(t, []int{1, 2}, utDecode(t, f.pair(s1).model.Model), "both applies ran, one after the other")
		assert.Empty(t, f.pair(s1).queue)
		assert.Zero(t, w.CoordinatorSize())
	})
}
