package worker

import (
	"context"
	"log/slog"
	"slices"
	"time"
)

// The loop and the state it keeps about pairs. One goroutine, the loop, owns all of it: the
// pairs in flight here, the follow-up jobs waiting for a slot, and the pairs whose stream
// lock another instance holds. Which pairs are due, and who applies them, lives in the
// database (a due row per pair, leased by a claim: PairsClaim); the loop keeps no claim
// position. Jobs run in their own goroutines and report back on a channel; they never touch
// this state or start other jobs.

// contention is how long a pair's stream lock has been refused to this instance.
type contention struct {
	first, last time.Time
	warned      bool
}

// schedule is the loop's state about pairs. Only the loop goroutine uses it.
type schedule struct {
	inflight  map[Pair]int      // in how many running or waiting jobs here (two: claimed again before a job's report)
	pending   []job             // follow-ups waiting for a free slot (served before new claims; see claimTurn)
	buildJobs map[buildJob]bool // build jobs waiting or running
	contended map[Pair]contention
	cutOff    map[Pair]int             // pairs whose last jobs were cut off by a lost connection: how many in a row
	held      map[Pair]unrecordedSpell // pairs whose last failures could not be recorded
	// heldFor is how long after its last such failure a pair that no job here ran since is
	// forgotten (twice MaxRetryBackoff, the longest it waits: it went elsewhere).
	heldFor time.Duration
	// unknown: since the last look at this instance's leases, a lost connection cut off a
	// claim or a release, so the instance may lease pairs no job here holds (releaseUnknown)
	unknown bool
	nextDue time.Time // when the first pair not due at the last claim becomes due (zero: none)
	// nextDueMissed: a nextDue had passed when the loop looked, and no claim since returned
	// one still ahead (see loop)
	nextDueMissed bool
	window        time.Duration // LockTimeout: contention longer than this is warned of
	log           *slog.Logger
	logPair       func(Pair, ...any) []any // how a pair is named in the log
}

func newSchedule(lockTimeout time.Duration, log *slog.Logger, logPair func(Pair, ...any) []any) *schedule {
	return &schedule{inflight: map[Pair]int{}, buildJobs: map[buildJob]bool{}, contended: map[Pair]contention{},
		cutOff: map[Pair]int{}, held: map[Pair]unrecordedSpell{}, window: lockTimeout, log: log, logPair: logPair}
}

// queueBuildJob queues j unless the same job about the same build waits or runs already.
func (s *schedule) queueBuildJob(j job) {
	id := buildJob{kind: j.kind, key: j.key}
	if s.buildJobs[id] {
		return
	}
	s.buildJobs[id] = true
	s.pending = append(s.pending, j)
}

// started records the pairs of a job about to run, and marks those cut off too often in a
// row (job.cutOffFails).
func (s *schedule) started(j *job) {
	for _, p := range j.pairs {
		s.inflight[p]++
		if s.cutOff[p] >= cutOffLimit {
			if j.cutOffFails == nil {
				j.cutOffFails = map[Pair]bool{}
			}
			j.cutOffFails[p] = true
		}
		if h, ok := s.held[p]; ok {
			if j.unrecorded == nil {
				j.unrecorded = map[Pair]int{}
			}
			j.unrecorded[p] = h.failures
		}
	}
}

// finish takes a job's report at time now: its pairs leave the flight unless a follow-up
// keeps them, the follow-ups wait for a slot, and contention is noted or cleared.
func (s *schedule) finish(r jobResult, now time.Time) {
	cut := make(map[Pair]bool, len(r.cutOff))
	for _, p := range r.cutOff {
		cut[p] = true
	}
	for _, p := range r.job.pairs {
		if s.inflight[p]--; s.inflight[p] <= 0 {
			delete(s.inflight, p)
		}
		if cut[p] {
			s.cutOff[p]++
		} else {
			delete(s.cutOff, p)
		}
	}
	if len(r.job.pairs) == 0 {
		delete(s.buildJobs, buildJob{kind: r.job.kind, key: r.job.key})
	}
	s.unknown = s.unknown || r.releaseCut
	for _, next := range r.next {
		if len(next.pairs) == 0 {
			s.queueBuildJob(next)
			continue
		}
		s.started(&next)
		s.pending = append(s.pending, next)
	}
	refused := make(map[Pair]bool, len(r.contended))
	for _, p := range r.contended {
		refused[p] = true
		s.noteContention(p, now)
	}
	if r.job.kind == jobRewind {
		for _, p := range r.job.pairs {
			if !refused[p] {
				delete(s.contended, p) // the lock was taken (or not needed): contention over
			}
		}
	}
	for p, c := range s.contended {
		if now.Sub(c.last) > s.window {
			delete(s.contended, p) // not refused for a whole lease: that contention is over
		}
	}
	s.unrecorded(r, now)
}

// noteContention records that p's stream lock was refused at now, and warns once when
// that has gone on for longer than LockTimeout (an instance holding it that long is
// renewing it: a long operation, or one that is stuck).
func (s *schedule) noteContention(p Pair, now time.Time) {
	c, seen := s.contended[p]
	if !seen || now.Sub(c.last) > s.window {
		c = contention{first: now}
	}
	c.last = now
	if !c.warned && now.Sub(c.first) > s.window {
		c.warned = true
		s.log.Warn("stream lock contended for longer than LockTimeout",
			s.logPair(p, slog.Duration("duration", now.Sub(c.first)))...)
	}
	s.contended[p] = c
}

// releasePending ends, in one statement, the leases that the pair jobs still waiting for a
// slot kept (a rewind, a bootstrap, a next batch) when the loop stops, and those an outage
// left here unknown (releaseUnknown), so that another instance can take their pairs at once
// rather than when the leases lapse.
func (w *Worker) releasePending(ctx context.Context, s *schedule) {
	var pairs []Pair
	for _, j := range s.pending {
		pairs = append(pairs, j.pairs...)
	}
	if _, err := w.releaseUnknown(ctx, s, pairs...); err != nil {
		// The error says which step failed: the look at the leases (the follow-ups' pairs
		// were released all the same) or the release.
		w.log.Warn("releasing this instance's leases at stop failed; the pairs not released are due again when their leases lapse",
			slog.Duration("lease", w.cfg.LockOptions.LockTimeout), slog.Any("error", err))
	}
}

// popPending returns the first follow-up waiting for a slot that is due at now, but for
// those waiting for a claim (afterClaim).
func (s *schedule) popPending(now time.Time) (job, bool) {
	for i, j := range s.pending {
		if !j.afterClaim && !j.notBefore.After(now) {
			s.pending = slices.Delete(s.pending, i, i+1)
			return j, true
		}
	}
	return job{}, false
}

// pageWaits says whether a catch-up page waits for a claim (see claimTurn).
func (s *schedule) pageWaits() bool {
	return slices.ContainsFunc(s.pending, func(j job) bool { return j.afterClaim })
}

// claimTurn lets the catch-up pages that waited for a claim (afterClaim) take the slots
// that claim left, and says whether one waited. A page's next page waits for one claim: with
// one slot, pages and claimed groups take turns, so that a catch-up (a first build's is not
// paced) holds up no live application, and live application no catch-up.
func (s *schedule) claimTurn() bool {
	waited := false
	for i := range s.pending {
		waited = waited || s.pending[i].afterClaim
		s.pending[i].afterClaim = false
	}
	return waited
}

// followUpWait is how long after now the first follow-up not yet due becomes due (0: none
// waits).
func (s *schedule) followUpWait(now time.Time) time.Duration {
	var d time.Duration
	for _, j := range s.pending {
		if w := j.notBefore.Sub(now); w > 0 && (d == 0 || w < d) {
			d = w
		}
	}
	return d
}

// loop runs jobs in Concurrency slots: follow-ups first (but a catch-up's next page after
// the next claim: schedule.claimTurn), then due pairs claimed from the queue, in groups of
// at most GroupSize pairs. It claims when woken (an Append's
// notification, a finished job), when the next pair the last claim saw waiting becomes due
// (a backoff's end), or every PollInterval, but not while a claim that failed
// (not for a lost connection) backs off (claimHealth), and never waits for a job: one long
// rewind occupies one slot while the others go on. When loopCtx ends it starts nothing
// more and returns once the running jobs have reported. opsCtx is the context of its own
// claims and reads as well as of the jobs: a graceful stop lets a claim under way finish
// (and runs what it claimed) rather than cancel it. A cancelled query costs its pooled
// connection, and pgx then sends the server a cancel request, which PgBouncer before 1.21
// can exit on (docs/postgresql.md, "Behind PgBouncer in transaction mode").
func (w *Worker) loop(loopCtx, opsCtx context.Context) {
	s := newSchedule(w.cfg.LockOptions.LockTimeout, w.log, w.logPair)
	s.heldFor = 2 * w.cfg.MaxRetryBackoff
	var maintained time.Time // when maintain last ran: every PollInterval
	results := make(chan jobResult)
	running := 0
	start := func(j job) {
		running++
		go func() { results <- w.runJob(opsCtx, j) }()
	}
	timer := time.NewTimer(w.cfg.PollInterval)
	defer timer.Stop()
	poll, stopping := true, false
	claims := w.newClaimHealth()
	done := loopCtx.Done()
	for {
		if !stopping && loopCtx.Err() != nil {
			stopping, done = true, nil // between two steps: start nothing more
		}
		if !stopping {
			if w.maintainNow.Swap(false) {
				maintained = time.Time{} // a leader lease was won: its maintenance at once
			}
			if time.Since(maintained) >= w.cfg.PollInterval {
				w.maintain(opsCtx, s)
				maintained = time.Now()
				if loopCtx.Err() != nil {
					continue // stopped during the read: start nothing it queued
				}
			}
			for running < w.cfg.Concurrency {
				j, ok := s.popPending(time.Now())
				if !ok {
					break
				}
				start(j)
			}
			if (poll || s.pageWaits()) && running < w.cfg.Concurrency && loopCtx.Err() == nil && claims.refused.waiting(time.Now()) == 0 {
				var err error
				poll, err = w.claimAndStart(opsCtx, s, w.cfg.Concurrency-running, start)
				w.noteClaim(opsCtx, &claims, err)
				pages := s.claimTurn()
				if err == nil && s.unknown {
					// The database answers: the leases an outage cut off are released.
					released, err := w.releaseUnknown(opsCtx, s)
					if err != nil {
						w.log.Warn("releasing the leases of pairs no job here holds failed; tried again after the next claim",
							slog.Any("error", err))
					}
					poll = poll || released
				}
				if poll || pages && running < w.cfg.Concurrency {
					continue // the claim returned its limit, or a page waited for it: slots are free
				}
			} else if claims.refused.waiting(time.Now()) > 0 && s.claimTurn() && running < w.cfg.Concurrency {
				continue // claims back off after a failure: the pages that waited for one go on
			}
		} else if running == 0 {
			w.releasePending(opsCtx, s)
			return
		}
		wait := w.cfg.PollInterval
		if claims.unreachable || w.unheard.Load() {
			// No event appended while the database is away or the subscription is down (a
			// restart, a failover) waits for a whole PollInterval.
			wait = min(wait, reconnectInterval)
		}
		if !stopping {
			now := time.Now()
			if !s.nextDue.IsZero() && !now.Before(s.nextDue) {
				// The pair the last claim saw due soon is due already (a backoff of a few
				// milliseconds can pass before this): claim as soon as a slot is free, not
				// after PollInterval. Once only: when the claim that follows says the same
				// (the database's clock behind this host's), PollInterval it is.
				s.nextDue = time.Time{}
				if !s.nextDueMissed {
					s.nextDueMissed, poll = true, true
					if running < w.cfg.Concurrency {
						continue
					}
				}
			}
			for _, d := range []time.Duration{s.followUpWait(now), claims.refused.waiting(now), s.nextDue.Sub(now)} {
				if d > 0 {
					wait = min(wait, d)
				}
			}
		}
		timer.Reset(wait)
		select {
		case <-done:
			stopping, done = true, nil // start nothing more; wait for the running jobs
		case r := <-results:
			running--
			s.finish(r, time.Now())
			if r.refresh {
				maintained = time.Time{} // the builds changed: look at them again at once
			}
			// A finished pair job released pairs (due again if rows are left; not those its
			// follow-ups keep), a catch-up page passed streams whose pairs waited for it, or
			// the builds changed: claim.
			poll = poll || len(r.released()) > 0 || r.job.kind == jobCatchUp || r.refresh
		case <-w.wake:
			poll = true
		case <-timer.C:
			poll = true
		}
	}
}
