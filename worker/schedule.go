package worker

import (
	"context"
	"log/slog"
	"slices"
	"time"
)

// The loop and the state it keeps about pairs. One goroutine, the loop, owns all of it: the
// pairs in flight, the pairs the next claim skips, the follow-up jobs waiting for a slot,
// and the pairs whose stream lock another instance holds. Jobs run in their own goroutines
// and report back on a channel; they never touch this state or start other jobs.

// jobKind is what a job does.
type jobKind int

const (
	jobApply     jobKind = iota // the normal path for a group of pairs
	jobRewind                   // rewind one pair (a late event)
	jobBootstrap                // write one pair's first snapshot, then apply it
	jobCatchUp                  // one page of a build's catch-up
	jobPromote                  // promote a caught-up build
	jobCleanup                  // delete a batch of a retired build's rows
	jobForget                   // forget gone instances
)

func (k jobKind) String() string {
	return [...]string{"apply", "rewind", "bootstrap", "catch-up", "promote", "cleanup", "forget"}[k]
}

// job is one unit of work in one Concurrency slot.
type job struct {
	kind      jobKind
	pairs     []Pair    // apply, rewind, bootstrap
	key       string    // catch-up, promote: the build; cleanup: the perspective
	notBefore time.Time // a follow-up waits for a slot until then (a paced catch-up)
	// cutOffFails: pairs whose work was cut off by a lost connection cutOffLimit times in a row
	// while the database answered claims. A connection error is then recorded as their
	// failure (with backoff) rather than left for the next claim: something about the pair
	// (a transaction a pooler's timeout ends) may be what cuts the connection.
	cutOffFails map[Pair]bool
	// backingOff: pairs whose last failure could not be recorded (see schedule.held): a
	// failure to record this one is logged at debug, once said for the spell.
	backingOff map[Pair]bool
}

// cutOffLimit is how many times in a row a pair's work may be cut off by a lost connection
// before the next one counts as its failure.
const cutOffLimit = 3

// buildJob names a job about builds, of which one of a kind runs per build at a time.
type buildJob struct {
	kind jobKind
	key  string
}

// jobResult is what a job reports to the loop when it ends.
type jobResult struct {
	job       job
	next      []job  // follow-ups (a rewind, a bootstrap, an apply after a bootstrap)
	busy      []Pair // held by another transaction or goroutine: the next claim skips them
	contended []Pair // the stream lock was refused: another instance holds it
	cutOff    []Pair // work cut off by a lost connection and left queued (not failed)
	refresh   bool   // the builds changed (a catch-up ended, a build was promoted)

	// unrecorded: pairs whose failure could not be recorded (Store.MarkFailed failed): they
	// back off here (schedule.held)
	unrecorded []Pair
}

// contention is how long a pair's stream lock has been refused to this instance.
type contention struct {
	first, last time.Time
	warned      bool
}

// schedule is the loop's state about pairs. Only the loop goroutine uses it.
type schedule struct {
	inflight    map[Pair]bool        // in a running or waiting job: never claimed meanwhile
	inflightDue map[Pair]time.Time   // the due time of the group each pair in flight was claimed at
	recheck     map[QueuedGroup]bool // groups of pairs whose jobs ended since the last claim: it looks them up
	skip        []Pair               // found busy: skipped by the next claim only
	pending     []job                // follow-ups waiting for a free slot (served before new claims)
	buildJobs   map[buildJob]bool    // build jobs waiting or running
	contended   map[Pair]contention
	cutOff      map[Pair]int  // pairs whose last jobs were cut off by a lost connection: how many in a row
	from        QueuePosition // where the next claim starts (see claimFrom)
	oldestAt    time.Time     // when the last claim that started at the oldest row began (and succeeded)
	window      time.Duration // LockTimeout: contention longer than this is warned of
	log         *slog.Logger
	logPair     func(Pair, ...any) []any // how a pair is named in the log

	// held: the pairs whose failure could not be recorded, backing off (see unrecorded);
	// retry: the backoff each starts with (RetryBackoff, MaxRetryBackoff).
	held  map[Pair]*backoff
	retry backoff
}

func newSchedule(lockTimeout time.Duration, log *slog.Logger, logPair func(Pair, ...any) []any) *schedule {
	return &schedule{inflight: map[Pair]bool{}, inflightDue: map[Pair]time.Time{}, recheck: map[QueuedGroup]bool{},
		buildJobs: map[buildJob]bool{}, contended: map[Pair]contention{}, cutOff: map[Pair]int{}, held: map[Pair]*backoff{},
		window: lockTimeout, log: log, logPair: logPair}
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

// claimSkips returns the pairs the next claim must skip: those in flight, with the due time
// each was claimed at, and those found busy (then forgotten: they are skipped by one claim
// only).
func (s *schedule) claimSkips() (inflight map[Pair]time.Time, skip []Pair) {
	inflight = make(map[Pair]time.Time, len(s.inflight))
	for p := range s.inflight {
		inflight[p] = s.inflightDue[p]
	}
	for _, p := range s.skip {
		if !s.inflight[p] {
			skip = append(skip, p)
		}
	}
	s.skip = s.skip[:0]
	return inflight, skip
}

// started records the pairs of a job about to run, and marks those cut off too often in a
// row (job.cutOffFails).
func (s *schedule) started(j *job) {
	for _, p := range j.pairs {
		s.inflight[p] = true
		if s.cutOff[p] >= cutOffLimit {
			if j.cutOffFails == nil {
				j.cutOffFails = map[Pair]bool{}
			}
			j.cutOffFails[p] = true
		}
		if s.held[p] != nil {
			if j.backingOff == nil {
				j.backingOff = map[Pair]bool{}
			}
			j.backingOff[p] = true
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
		delete(s.inflight, p)
		if cut[p] {
			s.cutOff[p]++
		} else {
			delete(s.cutOff, p)
		}
	}
	if len(r.job.pairs) == 0 {
		delete(s.buildJobs, buildJob{kind: r.job.kind, key: r.job.key})
	}
	for _, next := range r.next {
		if len(next.pairs) == 0 {
			s.queueBuildJob(next)
			continue
		}
		s.started(&next)
		s.pending = append(s.pending, next)
	}
	s.leave(r.job.pairs)
	s.skip = append(s.skip, r.busy...)
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

// leave takes the pairs of a job that ended and left the flight (a follow-up keeps the
// others). The claims since it was claimed may have started past its group, passing it as
// held (Claimed.Next), so the next claim looks the group up again (ClaimRequest.Recheck):
// for what the job left there (more than BatchSize rows, a lock refused, a failure not
// recorded) and for the rows of the Appends that stamped them with that group's due time
// (wh_append) after the job had read the pair's rows, and committed before that claim. Those
// that commit after it are found by their notification (notified). Looked up at every claim
// instead, the group was probed by a dozen claims or more, each passing the dead index
// entries of the rows the job had applied: two thirds of a claim's time in
// BenchmarkInstances.
func (s *schedule) leave(pairs []Pair) {
	for _, p := range pairs {
		if s.inflight[p] {
			continue // in a follow-up
		}
		at, known := s.inflightDue[p]
		delete(s.inflightDue, p)
		if !known {
			s.from = QueuePosition{} // not claimed here (no such job): from the oldest row
			continue
		}
		s.recheck[QueuedGroup{Pair: p, At: at}] = true
	}
}

// claimRechecks returns the groups the next claim looks up again (see leave).
func (s *schedule) claimRechecks() []QueuedGroup {
	out := make([]QueuedGroup, 0, len(s.recheck))
	for g := range s.recheck {
		out = append(out, g)
	}
	return out
}

// notified takes the earliest due time named by the queue notifications received since the
// last claim (the zero time: unknown): the next claim starts there at the latest. An Append
// whose transaction was running while a claim ran may have queued its rows before that
// claim's Next (the statement began before, or the rows joined a group it passed as held, a
// job's here or another instance's). The notification arrives once they are visible: the
// claim that starts there finds them, or passes them as held by a job here, which looks its
// group up again when it ends (leave).
func (s *schedule) notified(from time.Time) {
	if from.After(s.from.At) {
		return
	}
	s.from = QueuePosition{At: from} // before every group due at that time
}

// claimFrom is where a claim at now starts: at the oldest row once every interval (for the
// rows queued behind a claim's Next whose notification this instance did not hear: not
// listening, the subscription down, another instance's stream it takes on), else at the
// last claim's Next (moved back by notifications): no due row the claim can return precedes
// it but in the groups it looks up again (leave), and it need not step through the groups
// being applied nor the dead index entries of the rows applied since (thousands after a large
// drain, until vacuumed). fromOldest says which. The interval runs from the last claim from
// the oldest row that succeeded (claimed): one that failed is tried again by the next claim,
// so that such a row waits no longer than that.
func (s *schedule) claimFrom(now time.Time, interval time.Duration) (from QueuePosition, fromOldest bool) {
	if now.Sub(s.oldestAt) >= interval {
		return QueuePosition{}, true
	}
	return s.from, false
}

// claimed takes a claim that began at now: its Next (zero: it passed no group) as the next
// claim's start, the positions of the pairs it returned, and the look-ups it made
// (claimRechecks). The interval of a claim from the oldest row (claimFrom) runs from when it
// began, not when it ended: a row committed while a slow one ran waits no longer than the
// interval.
func (s *schedule) claimed(c Claimed, fromOldest bool, now time.Time) {
	if fromOldest {
		s.oldestAt = now
	}
	if fromOldest || !c.Next.At.IsZero() {
		s.from = c.Next
	}
	clear(s.recheck)
	for p, at := range c.At {
		s.inflightDue[p] = at
	}
}

// popPending returns the first follow-up waiting for a slot that is due at now.
func (s *schedule) popPending(now time.Time) (job, bool) {
	for i, j := range s.pending {
		if !j.notBefore.After(now) {
			s.pending = slices.Delete(s.pending, i, i+1)
			return j, true
		}
	}
	return job{}, false
}

// nextDue is how long after now the first follow-up not yet due becomes due (0: none waits).
func (s *schedule) nextDue(now time.Time) time.Duration {
	var d time.Duration
	for _, j := range s.pending {
		if w := j.notBefore.Sub(now); w > 0 && (d == 0 || w < d) {
			d = w
		}
	}
	return d
}

// loop runs jobs in Concurrency slots: follow-ups first, then due pairs claimed from the
// queue, in groups of at most GroupSize pairs. It claims when woken (an Append's
// notification, a finished job) or every PollInterval, but not while a claim that failed
// (not for a lost connection) backs off (claimBackoff), and never waits for a job: one long
// rewind occupies one slot while the others go on. When loopCtx ends it starts nothing
// more and returns once the running jobs have reported. opsCtx is the context of its own
// claims and reads as well as of the jobs: a graceful stop lets a claim under way finish
// (and runs what it claimed) rather than cancel it. A cancelled query costs its pooled
// connection, and pgx then sends the server a cancel request, which PgBouncer before 1.21
// can exit on (docs/postgresql.md, "Behind PgBouncer in transaction mode").
func (w *Worker) loop(loopCtx, opsCtx context.Context) {
	s := newSchedule(w.cfg.LockOptions.LockTimeout, w.log, w.logPair)
	s.retry = backoff{first: w.cfg.RetryBackoff, max: w.cfg.MaxRetryBackoff}
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
	unreachable := false // the last claim could not reach the database: retry it soon
	// claims that fail otherwise (the database refuses the statement) back off
	claims := w.claimBackoff()
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
			if poll && running < w.cfg.Concurrency && loopCtx.Err() == nil && claims.waiting(time.Now()) == 0 {
				var err error
				poll, err = w.claimAndStart(opsCtx, s, w.cfg.Concurrency-running, start)
				unreachable = w.noteReachable(opsCtx, unreachable, err)
				w.noteClaimFailure(opsCtx, &claims, err)
				if poll {
					continue // the claim returned its limit and slots are still free
				}
			}
		} else if running == 0 {
			return
		}
		wait := w.cfg.PollInterval
		if unreachable {
			wait = min(wait, reconnectInterval)
		}
		if !stopping {
			now := time.Now()
			for _, d := range []time.Duration{s.nextDue(now), claims.waiting(now), s.nextRetry(now)} {
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
			// A finished pair job: claim for what the last claim left behind, and for the
			// pairs that were in flight. A catch-up page leaves nothing to claim but the
			// events that waited for it to pass their stream: those wait for the next poll.
			poll = poll || len(r.job.pairs) > 0 || r.refresh
		case <-w.wake:
			poll = true
		case <-timer.C:
			poll = true
		}
	}
}

// reconnectInterval is how often the loop claims while the database does not answer (a
// restart, a failover), so that it resumes within that long of the server answering.
const reconnectInterval = 100 * time.Millisecond

// noteReachable takes a claim's outcome: it logs a lost connection, once for a spell of the
// database not answering and again when it answers, and says whether it is unreachable.
func (w *Worker) noteReachable(ctx context.Context, unreachable bool, err error) bool {
	switch {
	case err == nil:
		if unreachable {
			w.log.Info("database answers again; claiming")
		}
		return false
	case ctx.Err() != nil:
		return unreachable
	case isConnectionError(err):
		if !unreachable {
			w.log.Warn("database unavailable; claiming again every 100ms until it answers", slog.Any("error", err))
		}
		return true
	default: // logged by noteClaimFailure
		return false
	}
}

// claimAndStart claims due pairs for free slots and starts them, in groups. It reports
// whether to claim again at once (the claim returned its limit), and the claim's error.
func (w *Worker) claimAndStart(ctx context.Context, s *schedule, free int, start func(job)) (bool, error) {
	limit := free * w.cfg.GroupSize
	inflight, skip := s.claimSkips()
	skip = append(skip, s.backingOff(time.Now())...)
	if from, ok := w.takeNotified(); ok {
		s.notified(from)
	}
	began := time.Now()
	from, fromOldest := s.claimFrom(began, w.cfg.PollInterval)
	claimed, err := w.store.Claim(ctx, ClaimRequest{
		Instance:     w.cfg.InstanceID,
		Perspectives: w.builds().keys,
		InFlight:     inflight,
		Skip:         skip,
		Recheck:      s.claimRechecks(),
		Limit:        limit,
		// At most enough queued groups for the pairs it skips, twice the pairs it wants and
		// the pairs other instances are applying (passed over by their claim marks), so a
		// claim stays cheap when many due groups cannot be claimed (a build's pairs waiting
		// for its catch-up), yet one instance does not come back empty-handed, to wait a
		// whole PollInterval, from behind the pairs the others hold. The statement adds
		// Limit groups per other instance it shares the streams with (QueueDuePairs).
		MaxSteps: len(inflight) + len(skip) + 2*limit + claimPassHeld,
		From:     from,
	})
	if err != nil {
		return false, err
	}
	w.noteClaim()
	s.claimed(claimed, fromOldest, began)
	pairs := claimed.Pairs
	for _, group := range splitGroups(pairs, free) {
		j := job{kind: jobApply, pairs: group}
		s.started(&j)
		start(j)
	}
	return len(pairs) >= limit, nil
}

// claimPassHeld is how many queued groups a claim may pass beyond its own needs: room for
// the pairs other instances' apply transactions hold (Concurrency × GroupSize each: 200 by
// default).
const claimPassHeld = 1000

// splitGroups divides pairs into at most n groups of nearly equal size, in order.
func splitGroups(pairs []Pair, n int) [][]Pair {
	if len(pairs) == 0 || n <= 0 {
		return nil
	}
	n = min(n, len(pairs))
	size := (len(pairs) + n - 1) / n
	groups := make([][]Pair, 0, n)
	for len(pairs) > 0 {
		m := min(size, len(pairs))
		groups = append(groups, pairs[:m:m])
		pairs = pairs[m:]
	}
	return groups
}
