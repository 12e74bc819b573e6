package worker

// Builds on PostgreSQL: registration, catch-up pages, promotion, cleanup, status.

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/perspectives-go/perspectives/db"
)

// maxUUID sorts after every event ID: a catch-up position at (stream, maxUUID) has passed
// the whole stream.
var maxUUID = uuid.UUID{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}

func buildOfRow(r db.BuildsOfRow) Build {
	return Build{Key: r.BuildKey, Perspective: r.PerspectiveName, Version: int(r.Version), N: int(r.Build), State: r.State, CatchUpDone: r.CatchupDone}
}

func (s *pgStore) Builds(ctx context.Context, perspectives []string) ([]Build, error) {
	rows, err := s.q.BuildsOf(ctx, perspectives)
	if err != nil {
		return nil, err
	}
	out := make([]Build, len(rows))
	for i, r := range rows {
		out[i] = buildOfRow(r)
	}
	return out, nil
}

func (s *pgStore) Register(ctx context.Context, perspective string, version int) ([]Build, error) {
	builds, _, err := s.addBuild(ctx, perspective, func(builds []Build) (*Build, error) {
		return planRegistration(perspective, version, builds), nil
	})
	return builds, err
}

// addBuild adds the build plan asks for, given the perspective's builds (none: nothing to
// add), and returns the builds afterwards and the one it added. plan runs first on a plain
// read, then again under the exclusive side of the append lock when it asks for a build:
// every Append in flight commits first (its events are in the store when the catch-up
// reads it), every later one queues its events for the new build. The lock is held only
// for these few statements, so no Append waits on a scan, and it is waited for in short
// bounds (underAppendLock), so no Append waits on a transaction that appended and stays open.
func (s *pgStore) addBuild(ctx context.Context, perspective string, plan func([]Build) (*Build, error)) ([]Build, *Build, error) {
	builds, err := s.Builds(ctx, []string{perspective})
	if err != nil {
		return nil, nil, err
	}
	if b, err := plan(builds); err != nil || b == nil {
		return builds, nil, err
	}
	var added *Build
	err = s.underAppendLock(ctx, func(q *db.Queries) error {
		added = nil // from an attempt that did not commit
		if _, err := q.PerspectiveRegister(ctx, perspective); err != nil {
			return err
		}
		rows, err := q.BuildsOf(ctx, []string{perspective})
		if err != nil {
			return err
		}
		builds = builds[:0]
		for _, r := range rows {
			builds = append(builds, buildOfRow(r))
		}
		b, err := plan(builds)
		if err != nil || b == nil {
			return err // another instance added it meanwhile
		}
		taken, err := q.BuildKeyTaken(ctx, b.Key)
		if err != nil {
			return err
		}
		if taken {
			return fmt.Errorf("perspective %q: its build key %q is already another perspective's: rename one of them", perspective, b.Key)
		}
		if err := q.BuildCreate(ctx, db.BuildCreateParams{
			BuildKey: b.Key, PerspectiveName: perspective, Version: int32(b.Version), Build: int32(b.N), State: b.State,
		}); err != nil {
			return err
		}
		builds, added = append(builds, *b), b
		return q.RegistrationBump(ctx)
	})
	if err != nil {
		return nil, nil, err
	}
	return builds, added, nil
}

// The exclusive side of the append lock is waited for in bounds: while an exclusive request
// waits, every Append that comes waits behind it (see RegisterLock in queries/events.sql).
// The first wait lasts appendLockFirstWait, time enough for the Appends in flight to commit.
// When a wait runs out, the transactions that hold the lock just after (the blockers: one
// that appended and stays open, say) are waited out without queueing: every appendLockPoll
// the lock is only tried, which never queues, until they have all ended or a try gets it.
// Then it is waited for again, each bound twice the last (up to appendLockMaxWait), for when
// overlapping Appends keep it held. An Append waits for one registration at most that bound,
// when a wait begins (several waiting at once can add theirs up), never for the transactions
// it waits out. Append transactions that each stay open longer than appendLockMaxWait and
// keep overlapping hold a registration off until there is a gap between them. After
// appendLockWarnAfter the wait is logged once, naming the holders.
const (
	appendLockFirstWait = 50 * time.Millisecond
	appendLockMaxWait   = time.Second
	appendLockPoll      = 50 * time.Millisecond
	appendLockWarnAfter = 5 * time.Second
)

// errAppendLockTaken is a try of the append lock that found it held.
var errAppendLockTaken = errors.New("the append lock is held")

// unknownHolders stands for the holders of the append lock when a wait ran out and they could
// not be looked up: the next look-up's holders take their place.
const unknownHolders = "?"

// underAppendLock runs fn in a transaction that holds the exclusive side of the append lock
// (queries/events.sql): every Append in flight has committed, and every later one waits for
// this transaction. It tries again, in a new transaction, until it has the lock or ctx ends,
// so fn may run more than once and must not keep what an attempt that did not commit set.
// A statement of fn that outlasts the session's lock_timeout, if it has one, is tried again
// the same way.
func (s *pgStore) underAppendLock(ctx context.Context, fn func(q *db.Queries) error) error {
	began, wait, warned := time.Now(), appendLockFirstWait, false
	var blockers map[string]bool // the transactions that held the lock just after the last wait ran out
	for {
		locked, try := false, len(blockers) > 0
		err := s.inTx(ctx, func(q *db.Queries) error {
			if try {
				if ok, err := q.RegisterLockTry(ctx); err != nil || !ok {
					return cmp.Or(err, errAppendLockTaken)
				}
			} else if err := q.RegisterLock(ctx, int32(wait.Milliseconds())); err != nil {
				return err
			}
			locked = true
			return fn(q)
		})
		switch {
		case err == nil:
			return nil
		case !locked && ctx.Err() != nil:
			return s.appendLockGivenUp(ctx)
		case !errors.Is(err, errAppendLockTaken) && !isLockTimeout(err):
			return err
		}
		hctx, cancel := context.WithTimeout(ctx, appendLockHoldersTimeout)
		holders, herr := s.q.AppendLockHolders(hctx)
		cancel()
		held := make(map[string]bool, len(holders))
		for _, h := range holders {
			held[h.Transaction] = true
		}
		ranOut := !try && !locked // a bounded wait ran out: wait its holders out, then wait longer
		switch {
		case ranOut && herr != nil:
			blockers, wait = map[string]bool{unknownHolders: true}, min(2*wait, appendLockMaxWait)
		case ranOut:
			blockers, wait = held, min(2*wait, appendLockMaxWait)
		case herr != nil:
			// Keep trying: the look-up only names whom it waits for; a database that keeps
			// failing fails the lock statement too, which returns its error.
		case blockers[unknownHolders]: // the holders not seen when the wait ran out: those seen now
			blockers = held
		default:
			for t := range blockers {
				if !held[t] {
					delete(blockers, t)
				}
			}
		}
		if !warned && time.Since(began) >= appendLockWarnAfter && s.log != nil && herr == nil {
			warned = true
			s.log.Warn("waiting for transactions that appended events to end (registering, rebuilding or promoting a build "+
				"waits until every Append in flight has committed; Appends are not held up meanwhile)",
				slog.Duration("waited", time.Since(began)), slog.String("holders", holderNames(holders)))
		}
		select {
		case <-ctx.Done():
			return s.appendLockGivenUp(ctx)
		case <-time.After(appendLockPoll*3/4 + rand.N(appendLockPoll/2)):
		}
	}
}

// appendLockHoldersTimeout bounds the look-up of the append lock's holders.
const appendLockHoldersTimeout = time.Second

// appendLockGivenUp is the error of a wait for the append lock that ctx ended.
func (s *pgStore) appendLockGivenUp(ctx context.Context) error {
	hctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), appendLockHoldersTimeout)
	defer cancel()
	var names string
	if holders, err := s.q.AppendLockHolders(hctx); err == nil {
		names = holderNames(holders)
	} else {
		names = "not known: " + err.Error()
	}
	return fmt.Errorf("wait for the append lock (held by transactions that appended events and are still open: %s): %w", names, ctx.Err())
}

// holderNames names the transactions holding the append lock, and how long each has been
// open, for a log line or an error.
func holderNames(holders []db.AppendLockHoldersRow) string {
	if len(holders) == 0 {
		return "none now"
	}
	names := make([]string, len(holders))
	for i, h := range holders {
		if h.Pid == 0 {
			names[i] = "a prepared transaction " + h.Transaction
		} else {
			names[i] = fmt.Sprintf("server pid %d", h.Pid)
		}
		if h.XactAgeMicros >= 0 {
			names[i] += fmt.Sprintf(" (open %s)", (time.Duration(h.XactAgeMicros) * time.Microsecond).Round(time.Millisecond))
		}
	}
	return strings.Join(names, ", ")
}

func (s *pgStore) CatchUp(ctx context.Context, req CatchUpRequest, fold func(CatchUpPage) []PairWrite) (CatchUpResult, error) {
	var res CatchUpResult
	err := s.inTx(ctx, func(q *db.Queries) error {
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
		at := db.CatchUpPageParams{AfterStreamID: pos.CatchupStreamID.UUID, AfterEventID: pos.CatchupEventID.UUID, PageSize: int32(req.PageSize)}
		rows, err := s.readPage(ctx, q, req.Key, at)
		if err != nil {
			return fmt.Errorf("read the store: %w", err)
		}
		if len(rows) == req.PageSize {
			// Read the next page while this one is folded and written.
			last := rows[len(rows)-1]
			s.readNext(req.Key, db.CatchUpPageParams{AfterStreamID: last.StreamID, AfterEventID: last.EventID, PageSize: at.PageSize})
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
		page := CatchUpPage{Key: req.Key, Events: make([]Event, len(rows)), Streams: map[uuid.UUID]PairState{}}
		var pairs []Pair
		for i, r := range rows {
			page.Events[i] = eventOf(r)
			if i == 0 || r.StreamID != rows[i-1].StreamID {
				pairs = append(pairs, Pair{Stream: r.StreamID, Perspective: req.Key})
			}
		}
		// Under the cursor row locks: a stream another instance has locked is left to the
		// normal path (fold queues its events). Most of the page's pairs are new to the
		// build: their rows are created first, in key order.
		streams, names := pairArrays(pairs)
		if _, err := q.CursorsEnsure(ctx, db.CursorsEnsureParams{StreamIds: streams, PerspectiveNames: names}); err != nil {
			return fmt.Errorf("create cursors: %w", err)
		}
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

		writes := fold(page)
		to := page.Events[len(page.Events)-1]
		toEvent := to.ID
		for _, wr := range writes {
			res.Applied += len(wr.Applied)
			if wr.EnqueueFrom == uuid.Nil {
				continue
			}
			// Queued before the writes, so that a failure recorded with them marks these
			// rows too (PairsMarkFailed sets every queued row's retry time).
			if _, err := q.QueueEnqueueStreamFrom(ctx, db.QueueEnqueueStreamFromParams{
				BuildKey: req.Key, StreamID: wr.Stream, FromEventID: wr.EnqueueFrom,
			}); err != nil {
				return fmt.Errorf("queue a stream for the normal path: %w", err)
			}
			if wr.Stream == to.StreamID {
				toEvent = maxUUID // its later events are queued now: pass the whole stream
			}
		}
		if err := s.writePairs(ctx, q, writes, queued); err != nil {
			return err
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
	if err != nil {
		return CatchUpResult{}, err
	}
	return res, nil
}

// pageRead is a catch-up page read ahead.
type pageRead struct {
	at   db.CatchUpPageParams
	done chan struct{} // closed when rows and err are set
	rows []db.WhEventStore
	err  error
}

// readPage reads the catch-up page of build key at at: the page read ahead when there is
// one for exactly that position (a page is plain stored events: reading it outside the
// page's transaction is as good as inside, since every event committed after the build's
// registration is queued for it anyway), else with q.
func (s *pgStore) readPage(ctx context.Context, q *db.Queries, key string, at db.CatchUpPageParams) ([]db.WhEventStore, error) {
	s.readAheadMu.Lock()
	p := s.readAhead[key]
	delete(s.readAhead, key)
	s.readAheadMu.Unlock()
	if p != nil && p.at == at {
		select {
		case <-p.done:
			if p.err == nil {
				return p.rows, nil
			}
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	return q.CatchUpPage(ctx, at)
}

// readNext reads the catch-up page of build key at at in the background, for readPage.
func (s *pgStore) readNext(key string, at db.CatchUpPageParams) {
	s.readAheadWith(key, at, func(ctx context.Context) ([]db.WhEventStore, error) { return s.q.CatchUpPage(ctx, at) })
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

// readAheadTimeout bounds a read-ahead query.
const readAheadTimeout = 30 * time.Second

func (s *pgStore) Promote(ctx context.Context, perspective, key string, force bool, fence LeaderLease) (bool, error) {
	// The checks that read the queue run first, outside any transaction: the oldest queued
	// event of each build, through its index (BuildQueueAge). Only the flip holds the append
	// lock's exclusive side, for which Appends wait: a few key lookups that re-check what
	// may have changed since (the states, the catch-up, which build is active), and the two
	// updates. The queue ages are not read again there: an Append queues its events for both
	// builds alike, and an age that shrank meanwhile only means the active build applied its
	// backlog, which promoteLag allows for at the next look.
	cand, active, err := s.promotionBuilds(ctx, s.q, perspective, key)
	if err != nil || cand == nil {
		return false, err
	}
	if active != nil && !force {
		candAge, err := s.q.BuildQueueAge(ctx, cand.Key)
		if err != nil {
			return false, err
		}
		activeAge, err := s.q.BuildQueueAge(ctx, active.Key)
		if err != nil {
			return false, err
		}
		if !caughtUp(micros(candAge), micros(activeAge)) {
			return false, nil
		}
	}
	measured := active
	promoted := false
	// Serialized with registration (and other promotions) by the append lock's exclusive
	// side, held for these few statements.
	err = s.underAppendLock(ctx, func(q *db.Queries) error {
		promoted = false // from an attempt that did not commit
		if err := leaderHold(ctx, q, fence); err != nil {
			return err
		}
		cand, active, err := s.promotionBuilds(ctx, q, perspective, key)
		if err != nil || cand == nil {
			return err
		}
		if (active == nil) != (measured == nil) || active != nil && active.Key != measured.Key {
			return nil // another build became active meanwhile: the next look checks again
		}
		if active != nil {
			if err := q.BuildSetState(ctx, db.BuildSetStateParams{State: BuildRetired, BuildKey: active.Key}); err != nil {
				return err
			}
		}
		if err := q.BuildSetState(ctx, db.BuildSetStateParams{State: BuildActive, BuildKey: cand.Key}); err != nil {
			return err
		}
		promoted = true
		return nil
	})
	return promoted, err
}

// promotionBuilds reads the builds of the perspective (a lookup of its key) and returns the
// build key, when it is building and caught up (nil otherwise), and the active build (nil:
// none). It is an error when the perspective has no build key.
func (s *pgStore) promotionBuilds(ctx context.Context, q *db.Queries, perspective, key string) (cand, active *Build, err error) {
	rows, err := q.BuildsOf(ctx, []string{perspective})
	if err != nil {
		return nil, nil, err
	}
	for _, r := range rows {
		b := buildOfRow(r)
		switch {
		case b.Key == key:
			cand = &b
		case b.State == BuildActive:
			active = &b
		}
	}
	if cand == nil {
		return nil, nil, fmt.Errorf("perspective %q has no build %q", perspective, key)
	}
	if cand.State != BuildBuilding || !cand.CatchUpDone {
		return nil, active, nil
	}
	return cand, active, nil
}

// micros is a queue age in microseconds as a duration (-1: nothing queued, 0).
func micros(us int64) time.Duration { return time.Duration(max(us, 0)) * time.Microsecond }

func (s *pgStore) Cleanup(ctx context.Context, perspectives []string, grace time.Duration, batch int, fence LeaderLease) (bool, error) {
	keys, err := s.q.BuildsToClean(ctx, db.BuildsToCleanParams{PerspectiveNames: perspectives, GraceSeconds: grace.Seconds()})
	if err != nil || len(keys) == 0 {
		return false, err
	}
	more := true
	err = s.inTx(ctx, func(q *db.Queries) error {
		if err := leaderHold(ctx, q, fence); err != nil {
			return err
		}
		n, err := q.BuildCleanupBatch(ctx, db.BuildCleanupBatchParams{BuildKey: keys[0], BatchSize: int32(batch)})
		if err != nil || n > 0 {
			return err
		}
		more = len(keys) > 1
		return q.BuildMarkCleaned(ctx, keys[0])
	})
	if err != nil {
		return false, err
	}
	return more, nil
}

func (s *pgStore) Status(ctx context.Context) ([]BuildStatus, error) {
	rows, err := s.q.BuildsStatus(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]BuildStatus, len(rows))
	for i, r := range rows {
		out[i] = BuildStatus{
			Build: Build{Key: r.BuildKey, Perspective: r.PerspectiveName, Version: int(r.Version), N: int(r.Build),
				State: r.State, CatchUpDone: r.CatchupDone},
			CatchUpStarted: r.CatchupStartedAt, CatchUpEvents: r.CatchupEvents, CatchUpStreams: r.CatchupStreams,
			Queued: r.Queued, OldestQueued: micros(r.OldestQueuedMicros),
			Failing: r.Failing, Parked: r.Parked, LiveInstances: r.LiveInstances, EventsPerSecond: r.EventsPerSecond,
		}
	}
	return out, nil
}
