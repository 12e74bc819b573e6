package worker

// A build's catch-up: pages of the event store folded into the build's models, each page
// one transaction under the build's catch-up lease (queries/catchup.sql), read ahead while
// the previous one is folded.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/metric"

	"github.com/perspectives-go/perspectives/db"
)

// catchUp runs one page of build key's catch-up, and says whether to run another at once
// (more) and whether the catch-up is over (done).
func (w *Worker) catchUp(ctx context.Context, key string) (more, done bool, err error) {
	b := w.buildOf(key)
	if b.persp == nil {
		return false, false, nil // no longer applied here
	}
	attrs := []any{slog.String("perspective", b.Perspective), slog.Int("version", b.Version)}
	res, err := w.store.CatchUp(ctx, CatchUpRequest{
		Key: key, Instance: w.cfg.InstanceID, Lease: w.cfg.LockOptions.LockTimeout, PageSize: w.cfg.CatchUpPageSize,
	}, func(page CatchUpPage) []PairWrite { return w.foldPage(ctx, b, page) })
	if errors.Is(err, ErrLockLost) {
		w.log.Warn("catch-up page refused: its lease was taken over", attrs...)
		return false, false, nil
	}
	if err != nil {
		return false, false, fmt.Errorf("catch-up of %s version %d: %w", b.Perspective, b.Version, err)
	}
	if res.Events > 0 {
		set := metric.WithAttributes(attrPerspective.String(b.Perspective), attrVersion.Int(b.Version))
		w.tel.catchUpEvents.Add(ctx, int64(res.Events), set)
		if res.Applied > 0 {
			w.tel.eventsApplied.Add(ctx, int64(res.Applied), set)
			w.countApplied(key, res.Applied)
		}
	}
	if res.Done {
		w.log.Info("catch-up done", attrs...)
	}
	return !res.Done && !res.NotHeld, res.Done, nil
}

// foldPage folds a catch-up page into one write per stream, the streams side by side (on
// up to GOMAXPROCS goroutines: Apply already runs concurrently for different pairs). A
// stream that another instance has locked (or another transaction holds), or that the
// build already has a position in (other than the one the previous page left unfinished),
// is left to the normal path: its events from the page's first on are queued. A stream
// whose Apply fails keeps the events before the failure; the failure is recorded on it and
// its events from the failing one on are queued, so that the normal path retries them with
// backoff. The catch-up goes on with the next stream either way.
func (w *Worker) foldPage(ctx context.Context, b *build, page CatchUpPage) []PairWrite {
	var runs [][]Event
	for events := page.Events; len(events) > 0; {
		n := 1
		for n < len(events) && events[n].StreamID == events[0].StreamID {
			n++
		}
		runs, events = append(runs, events[:n]), events[n:]
	}
	writes := make([]PairWrite, len(runs))
	var next atomic.Int64
	var wg sync.WaitGroup
	for range min(runtime.GOMAXPROCS(0), len(runs)) {
		wg.Go(func() {
			for i := int(next.Add(1)) - 1; i < len(runs); i = int(next.Add(1)) - 1 {
				writes[i] = w.foldRun(ctx, b, page, runs[i])
			}
		})
	}
	wg.Wait()
	if ctx.Err() != nil {
		return writes // a fold interrupted: nothing of the page is written (see CatchUp)
	}
	for _, wr := range writes {
		if wr.Failure.Cause != "" {
			w.reportApplied(ctx, pairReport{pair: wr.Pair, applied: len(wr.Applied), err: eventError{event: wr.Failure.Event, err: errors.New(wr.Failure.Cause)}, action: wr.Failure.Action})
		}
	}
	return writes
}

// catchUpStreamShare is the most events of one stream a catch-up page applies. A stream with
// more in the page has the rest of its history queued for the normal path (as a failing
// stream's is), whose claims take it a batch at a time beside every other pair, and the
// catch-up passes it: one long stream never holds back the streams after it.
const catchUpStreamShare = 1000

// foldRun folds the events run of one stream of a catch-up page (see foldPage), at most
// catchUpStreamShare of them.
func (w *Worker) foldRun(ctx context.Context, b *build, page CatchUpPage, run []Event) PairWrite {
	stream := run[0].StreamID
	k := Pair{Stream: stream, Perspective: page.Key}
	st, locked := page.Streams[stream]
	continued := stream == page.Continued
	switch {
	case !locked || w.lockedElsewhere(st.LockHolder), st.LastEventID.Valid && !continued:
		return PairWrite{Pair: k, EnqueueFrom: run[0].ID}
	case continued && (!st.LastEventID.Valid || st.Model == nil || st.ModelAt != st.LastEventID.UUID):
		// Purged (or inconsistent) since the previous page: the whole stream is queued.
		return PairWrite{Pair: k, EnqueueFrom: firstEventID}
	}
	var rest uuid.UUID // the first event left to the normal path (a long stream's share ends)
	if len(run) > catchUpStreamShare {
		run, rest = run[:catchUpStreamShare], run[catchUpStreamShare].ID
	}
	st.Pair = k
	wr, err := w.foldWrite(ctx, b, st, st.Model, run)
	wr.EnqueueFrom = rest
	if err != nil {
		wr.EnqueueFrom = run[len(wr.Applied)].ID
	}
	return wr
}

// pacing is how long a catch-up beside an active version waits before its next page: as
// long as the page took. Such a build (a new version, a rebuild) is background work, so it
// runs at most half the time and leaves the machine to live application of the version
// readers see; the wait holds no slot. A perspective's first build (there is nothing to
// serve yet) is not paced. Measured in BenchmarkLifecycle (BENCHMARKS.md): without it,
// Append → active model took 3–4× its idle time on two cores while a version built; with
// it, within 2×.
func (w *Worker) pacing(key string, took time.Duration) time.Duration {
	if w.buildOf(key).State == BuildBuilding {
		return took
	}
	return 0
}

// CatchUpRequest asks Store.CatchUp for one page.
type CatchUpRequest struct {
	Key      string        // the build
	Instance uuid.UUID     // the lease holder
	Lease    time.Duration // how long the lease lasts after this page
	PageSize int           // events per page
}

// CatchUpPage is one page of a catch-up, as fold receives it.
type CatchUpPage struct {
	Key    string
	Events []Event // in (stream, event) order, without those skipped for the build
	// Streams is the state of each stream of the page, read under its cursor row lock
	// (a stream missing from it is held by another transaction): its stream lock, and for
	// Continued its model, cursor and snapshots.
	Streams map[uuid.UUID]PairState
	// Continued is the stream the previous page left unfinished (uuid.Nil: none): the
	// page's first, whose first events are already applied.
	Continued uuid.UUID
}

// CatchUpResult is what one Store.CatchUp call did.
type CatchUpResult struct {
	NotHeld bool // another instance holds the catch-up (or it is done): nothing read
	Done    bool // no event was left: the catch-up is over
	Events  int  // events read
	Applied int  // events applied (the others were queued, or failed)
}

func (s *pgStore) CatchUp(ctx context.Context, req CatchUpRequest, fold func(CatchUpPage) []PairWrite) (CatchUpResult, error) {
	// Before the page's transaction, without waiting for any: the position, the page's
	// events, and the cursor rows of its streams that the build has not got yet, created and
	// committed. An Append to a stream whose cursor row an open transaction inserted waits
	// for that transaction: inserted by the page's, every Append to its streams would wait
	// for the whole fold.
	start, err := s.q.BuildCatchUpPosition(ctx, db.BuildCatchUpPositionParams{BuildKey: req.Key, InstanceID: req.Instance})
	if errors.Is(err, pgx.ErrNoRows) {
		s.dropReadAhead(req.Key) // a page read ahead for a catch-up that another took over, or that ended
		return CatchUpResult{NotHeld: true}, nil
	}
	if err != nil {
		return CatchUpResult{}, fmt.Errorf("read the catch-up position: %w", err)
	}
	at := db.CatchUpPageParams{AfterStreamID: start.CatchupStreamID.UUID, AfterEventID: start.CatchupEventID.UUID, PageSize: int32(req.PageSize)}
	rows, err := s.readPage(ctx, req.Key, at)
	if err != nil {
		return CatchUpResult{}, fmt.Errorf("read the store: %w", err)
	}
	var pairs []Pair
	for i, r := range rows {
		if i == 0 || r.StreamID != rows[i-1].StreamID {
			pairs = append(pairs, Pair{Stream: r.StreamID, Perspective: req.Key})
		}
	}
	if len(pairs) > 0 {
		streams, names := pairArrays(pairs)
		if _, err := s.q.CursorsEnsure(ctx, db.CursorsEnsureParams{StreamIds: streams, PerspectiveNames: names}); err != nil {
			return CatchUpResult{}, fmt.Errorf("create cursors: %w", err)
		}
	}
	if len(rows) == req.PageSize {
		// Read the next page while this one is folded and written.
		last := rows[len(rows)-1]
		next := db.CatchUpPageParams{AfterStreamID: last.StreamID, AfterEventID: last.EventID, PageSize: at.PageSize}
		s.readAheadWith(req.Key, next, func(ctx context.Context) ([]db.WhEventStore, error) { return s.q.CatchUpPage(ctx, next) })
	}

	var res CatchUpResult
	err = s.inTx(ctx, func(tx pgx.Tx, q *db.Queries) error {
		res = CatchUpResult{}
		pos, err := q.BuildCatchUpAcquire(ctx, db.BuildCatchUpAcquireParams{
			InstanceID: req.Instance, LeaseSeconds: req.Lease.Seconds(), BuildKey: req.Key,
		})
		if errors.Is(err, pgx.ErrNoRows) {
			res.NotHeld = true
			return nil
		}
		if err != nil {
			return fmt.Errorf("take the catch-up lease: %w", err)
		}
		if pos.CatchupStreamID != start.CatchupStreamID || pos.CatchupEventID != start.CatchupEventID {
			res.NotHeld = true // another instance took the lease over and moved on meanwhile
			return nil
		}
		fence := func(n int64, err error) error {
			if err != nil {
				return fmt.Errorf("move the catch-up position: %w", err)
			}
			if n != 1 {
				return ErrLockLost // the lease lapsed and another instance took over
			}
			return nil
		}
		if len(rows) == 0 {
			res.Done = true
			return fence(q.BuildCatchUpAdvance(ctx, db.BuildCatchUpAdvanceParams{
				Done: true, BuildKey: req.Key, InstanceID: req.Instance, FromStreamID: pos.CatchupStreamID, FromEventID: pos.CatchupEventID,
			}))
		}
		res.Events = len(rows)
		page := CatchUpPage{Key: req.Key, Streams: map[uuid.UUID]PairState{}}
		// Under the cursor row locks: a stream another instance has locked, or whose row
		// another transaction holds, is left to the normal path (fold queues its events).
		states, _, err := lockPairs(ctx, q, pairs)
		if err != nil {
			return err
		}
		for _, st := range states {
			page.Streams[st.Stream] = st
		}
		if pos.CatchupStreamID.Valid && pos.CatchupStreamID.UUID == pairs[0].Stream {
			page.Continued = pairs[0].Stream
			if st, ok := page.Streams[page.Continued]; ok && st.LastEventID.Valid {
				models, err := q.ModelsGet(ctx, db.ModelsGetParams{StreamIds: []uuid.UUID{page.Continued}, PerspectiveNames: []string{req.Key}})
				if err != nil {
					return fmt.Errorf("load model: %w", err)
				}
				if len(models) == 1 {
					st.Model, st.ModelAt = json.RawMessage(models[0].Model), models[0].LastEventID
				}
				page.Streams[page.Continued] = st
			}
		}
		first, last := pairs[0].Stream, pairs[len(pairs)-1].Stream
		queuedRows, err := q.CatchUpQueued(ctx, db.CatchUpQueuedParams{FirstStreamID: first, LastStreamID: last, BuildKey: req.Key})
		if err != nil {
			return fmt.Errorf("read the queue: %w", err)
		}
		queued := make(map[uuid.UUID]bool, len(queuedRows))
		for _, r := range queuedRows {
			queued[r.EventID] = true
		}
		// The events skipped for the build are left out, read under the cursor row locks
		// (not with the page, which was read before them).
		skippedRows, err := q.CatchUpSkipped(ctx, db.CatchUpSkippedParams{FirstStreamID: first, LastStreamID: last, BuildKey: req.Key})
		if err != nil {
			return fmt.Errorf("read the skipped events: %w", err)
		}
		skipped := make(map[uuid.UUID]bool, len(skippedRows))
		for _, r := range skippedRows {
			skipped[r.EventID] = true
		}
		page.Events = make([]Event, 0, len(rows))
		for _, r := range rows {
			if !skipped[r.EventID] {
				page.Events = append(page.Events, eventOf(r))
			}
		}

		writes := fold(page)
		if err := ctx.Err(); err != nil {
			return err // the fold was interrupted (Stop): nothing of the page is written
		}
		err = s.writePage(ctx, tx, q, req.Key, writes, queued)
		if se := (sinkError{}); errors.As(err, &se) {
			// A sink refused the page: it is written without the build's models, every
			// stream of it handed to the normal path, where a failing pair is retried and
			// parked on its own while the others commit.
			if s.log != nil {
				s.log.Warn("a sink failed on a catch-up page; its streams go to the normal path",
					slog.String("build", req.Key), slog.Int("streams", len(writes)), slog.Any("error", err))
			}
			writes = handOver(writes)
			err = s.writePage(ctx, tx, q, req.Key, writes, queued)
		}
		if err != nil {
			return err
		}
		to := rows[len(rows)-1] // the position moves past the skipped events too
		toEvent := to.EventID
		for _, wr := range writes {
			res.Applied += len(wr.Applied)
			if wr.EnqueueFrom != uuid.Nil && wr.Stream == to.StreamID {
				toEvent = maxUUID // its later events are queued now: pass the whole stream
			}
		}
		// Streams passed: those the page ends (all but its last, unless that one is passed
		// whole), and the previous page's last when this page starts with another.
		passed := int64(len(pairs) - 1)
		if toEvent == maxUUID {
			passed++
		}
		if pos.CatchupStreamID.Valid && pos.CatchupStreamID.UUID != pairs[0].Stream && pos.CatchupEventID.UUID != maxUUID {
			passed++
		}
		return fence(q.BuildCatchUpAdvance(ctx, db.BuildCatchUpAdvanceParams{
			StreamID: uuid.NullUUID{UUID: to.StreamID, Valid: true}, EventID: uuid.NullUUID{UUID: toEvent, Valid: true},
			Events: int64(len(rows)), Streams: passed,
			LeaseSeconds: req.Lease.Seconds(), BuildKey: req.Key, InstanceID: req.Instance,
			FromStreamID: pos.CatchupStreamID, FromEventID: pos.CatchupEventID,
		}))
	})
	if err != nil || res.NotHeld {
		s.dropReadAhead(req.Key) // this instance may not read the next page
	}
	if err != nil {
		return CatchUpResult{}, err
	}
	return res, nil
}

// writePage writes a catch-up page's writes in a savepoint of tx: first the streams handed to
// the normal path are queued from their EnqueueFrom on (before the writes, so that a failure
// recorded with them finds the rows), then the models (writePairs, with the sinks). On an
// error the savepoint is rolled back, and tx can go on.
func (s *pgStore) writePage(ctx context.Context, tx pgx.Tx, q *db.Queries, key string, writes []PairWrite, queued map[uuid.UUID]bool) error {
	return pgx.BeginFunc(ctx, tx, func(sp pgx.Tx) error {
		for _, wr := range writes {
			if wr.EnqueueFrom == uuid.Nil {
				continue
			}
			if _, err := queueStream(ctx, q, Pair{Stream: wr.Stream, Perspective: key}, wr.EnqueueFrom); err != nil {
				return fmt.Errorf("queue a stream for the normal path: %w", err)
			}
		}
		// A stream's change is a replay unless the page applied an event appended since the
		// build was registered (queued for it): such an event is live, whoever applies it.
		replay := func(wr PairWrite) bool {
			for _, id := range wr.Applied {
				if queued[id] {
					return false
				}
			}
			return true
		}
		return s.writePairs(ctx, sp, q, writes, queued, replay)
	})
}

// queueStream queues the stored events of p's stream from the event from on (inclusive; the
// nil UUID: all of them) for p's build, but those skipped for it (QueueUnqueueSkipped too:
// see there), in the transaction of q, and holds the pair's due row until it ends (see
// PairDueHold). It returns the rows queued.
func queueStream(ctx context.Context, q *db.Queries, p Pair, from uuid.UUID) (int64, error) {
	n, err := q.QueueEnqueueStreamFrom(ctx, db.QueueEnqueueStreamFromParams{BuildKey: p.Perspective, StreamID: p.Stream, FromEventID: from})
	if err != nil || n == 0 {
		return n, err
	}
	unqueued, err := q.QueueUnqueueSkipped(ctx, db.QueueUnqueueSkippedParams{StreamID: p.Stream, PerspectiveName: p.Perspective})
	if err != nil {
		return n, err
	}
	n -= unqueued
	for {
		held, err := q.PairDueHold(ctx, db.PairDueHoldParams{StreamID: p.Stream, PerspectiveName: p.Perspective})
		if err != nil || len(held) > 0 {
			return n, err
		}
		if err := q.PairDueEnsure(ctx, db.PairDueEnsureParams{StreamID: p.Stream, PerspectiveName: p.Perspective}); err != nil {
			return n, err
		}
	}
}

// handOver turns a page's writes into hand-overs: each stream queued for the normal path from
// its first event of the page, nothing applied.
func handOver(writes []PairWrite) []PairWrite {
	out := make([]PairWrite, 0, len(writes))
	for _, wr := range writes {
		from := wr.EnqueueFrom
		if len(wr.Applied) > 0 {
			from = wr.Applied[0]
		}
		if from != uuid.Nil {
			out = append(out, PairWrite{Pair: wr.Pair, EnqueueFrom: from})
		}
	}
	return out
}

// pageRead is a catch-up page read ahead.
type pageRead struct {
	at   db.CatchUpPageParams
	done chan struct{} // closed when rows and err are set
	rows []db.WhEventStore
	err  error
}

// readPage reads the catch-up page of build key at at: the page read ahead when there is
// one for exactly that position, else now. A page is plain stored events, read outside the
// page's transaction: as good as inside, since every event committed after the build's
// registration is queued for it anyway.
func (s *pgStore) readPage(ctx context.Context, key string, at db.CatchUpPageParams) ([]db.WhEventStore, error) {
	if p := s.dropReadAhead(key); p != nil && p.at == at {
		select {
		case <-p.done:
			if p.err == nil {
				return p.rows, nil
			}
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	return s.q.CatchUpPage(ctx, at)
}

// dropReadAhead removes the page read ahead for build key, if any, and returns it.
func (s *pgStore) dropReadAhead(key string) *pageRead {
	s.readAheadMu.Lock()
	defer s.readAheadMu.Unlock()
	p := s.readAhead[key]
	delete(s.readAhead, key)
	return p
}

// readAheadWith reads the page of build key at at with read, in a goroutine of the store's
// read-ahead service: Stop lets it finish until Stop's context ends, then cancels it (each
// read is bounded by readAheadTimeout). It reads nothing ahead when the service is not
// running (an Admin's store, a worker stopping).
func (s *pgStore) readAheadWith(key string, at db.CatchUpPageParams, read func(context.Context) ([]db.WhEventStore, error)) *pageRead {
	p := &pageRead{at: at, done: make(chan struct{})}
	if !s.readAheads.Go(func(ctx, _ context.Context) {
		defer close(p.done)
		rctx, cancel := context.WithTimeout(ctx, readAheadTimeout)
		defer cancel()
		p.rows, p.err = read(rctx)
	}) {
		return nil
	}
	s.readAheadMu.Lock()
	s.readAhead[key] = p
	s.readAheadMu.Unlock()
	return p
}

// maxUUID sorts after every event ID: a catch-up position at (stream, maxUUID) has passed
// the whole stream.
var maxUUID = uuid.UUID{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}

// CatchUpStore is what a catch-up asks of the database.
type CatchUpStore interface {
	// CatchUp runs one page of a build's catch-up: it reads the next req.PageSize stored
	// events after the build's position in (stream, event) order and creates the cursor rows
	// of their streams that the build has not got (committed at once: an Append waits for
	// none of its transactions); then, in one transaction, it takes or renews the build's
	// catch-up lease (req.Instance, for req.Lease), passes the events to fold, writes what
	// fold returns (deleting the queue rows of the applied events that were queued, and
	// queueing a failed stream's events from its failing one on), and moves the position
	// under the fencing check. With no event left it ends the catch-up. It never waits for
	// another instance's page: NotHeld.
	CatchUp(ctx context.Context, req CatchUpRequest, fold func(CatchUpPage) []PairWrite) (CatchUpResult, error)
}
