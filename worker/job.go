package worker

// The jobs: what each does, what it reports to the loop, and the dispatch that runs one
// under the apply coordinator. Each kind's work lives in its own file (apply.go, rewind.go,
// bootstrap.go, catchup.go, promotion.go, cleanup.go, forget.go).

import (
	"context"
	"fmt"
	"log/slog"
	"runtime/debug"
	"time"

	"github.com/google/uuid"
)

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

// job is one unit of work in one Concurrency slot.
type job struct {
	kind      jobKind
	pairs     []Pair    // apply, rewind, bootstrap
	key       string    // catch-up, promote: the build; cleanup: the perspective
	notBefore time.Time // a follow-up waits for a slot until then (a paced catch-up)
	// afterClaim: a catch-up's next page, which waits for the loop's next claim before it
	// takes a slot, so that live work and pages take turns (see schedule.claimTurn)
	afterClaim bool
	// claimed: when the claim that leased an apply's pairs was sent (the zero time: not
	// from a claim). chain and after: an apply following its pairs' full batches (see
	// continuation): how many batches in a row came before it, and each pair's last event
	// applied.
	claimed time.Time
	chain   int
	after   map[Pair]uuid.UUID
	// cutOffFails: pairs whose work was cut off by a lost connection cutOffLimit times in a row
	// while the database answered claims. A connection error is then recorded as their
	// failure (with backoff) rather than left for the next claim: something about the pair
	// (a transaction a pooler's timeout ends) may be what cuts the connection.
	cutOffFails map[Pair]bool
	// unrecorded: pairs whose last failures could not be recorded (see schedule.held), and
	// how many in a row: another is logged at debug (said once for the spell), and the pair
	// waits longer before it is due again.
	unrecorded map[Pair]int
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
	next      []job  // follow-ups (a rewind, a bootstrap, an apply after a bootstrap or a full batch)
	busy      []Pair // held by another transaction or goroutine: due again after busyWait
	contended []Pair // the stream lock was refused: another instance holds it
	cutOff    []Pair // work cut off by a lost connection and left queued (not failed)
	refresh   bool   // the builds changed (a catch-up ended, a build was promoted)
	// full: an apply's pairs whose batch was full, and their last event applied (see
	// continuation)
	full map[Pair]uuid.UUID

	// unrecorded: pairs whose failure could not be recorded (Store.MarkFailed failed): due
	// again only after a backoff (schedule.held counts them)
	unrecorded []Pair
	releaseCut bool // a lost connection (or the release's timeout) failed the release of the job's pairs (see release)
}

// runJob runs one job and reports to the loop. A pair job then releases its pairs' leases,
// but those a follow-up keeps (see release).
func (w *Worker) runJob(ctx context.Context, j job) jobResult {
	r := w.run(ctx, j)
	if len(j.pairs) > 0 {
		r.releaseCut = w.release(ctx, r)
	}
	return r
}

// run runs one job under the apply coordinator. A pair that another goroutine of this
// process holds (a Purge) is skipped and reported busy.
func (w *Worker) run(ctx context.Context, j job) jobResult {
	r := jobResult{job: j}
	switch j.kind {
	case jobCatchUp:
		started := time.Now()
		more, done, err := w.catchUp(ctx, j.key)
		if err != nil && ctx.Err() == nil {
			w.log.Error("catch-up failed; retried at the next look at the builds", slog.Any("error", err))
		}
		if more {
			took := time.Since(started)
			r.next = append(r.next, job{kind: jobCatchUp, key: j.key, notBefore: started.Add(took + w.pacing(j.key, took)), afterClaim: true})
		}
		r.refresh = done // a build to promote, maybe: look again at once (else at the next poll)
		return r
	case jobPromote:
		promoted, err := w.promote(ctx, j.key)
		if err != nil && ctx.Err() == nil {
			w.log.Error("promotion failed", slog.Any("error", err))
		}
		r.refresh = promoted
		return r
	case jobCleanup:
		if w.cleanup(ctx, j.key) {
			r.next = append(r.next, job{kind: jobCleanup, key: j.key})
		}
		return r
	case jobForget:
		w.forgetGone(ctx)
		return r
	}
	var mine []Pair
	for _, p := range j.pairs {
		if w.builds().byKey[p.Perspective] == nil {
			continue // not (any more) a build this instance applies
		}
		release, ok := w.coord.tryLock(p)
		if !ok {
			r.busy = append(r.busy, p)
			continue
		}
		defer release()
		mine = append(mine, p)
	}
	if len(mine) == 0 {
		return r
	}
	switch j.kind {
	case jobApply:
		w.applyPairs(ctx, mine, &r)
		if next, ok := w.continuation(j, r.full); ok {
			r.next = append(r.next, next)
		}
	case jobRewind:
		p := mine[0]
		var contended bool
		err := w.recovered(p, func() (err error) {
			contended, err = w.rewind(ctx, p)
			return err
		})
		if contended {
			r.contended = append(r.contended, p)
		}
		if err != nil {
			w.fail(ctx, p, err, &r)
		}
	case jobBootstrap:
		p := mine[0]
		if err := w.recovered(p, func() error { return w.bootstrap(ctx, p) }); err != nil {
			w.fail(ctx, p, err, &r)
			break
		}
		r.next = append(r.next, job{kind: jobApply, pairs: []Pair{p}, claimed: j.claimed, chain: j.chain})
	}
	return r
}

// recovered runs fn, work on p, turning a panic into an error.
func (w *Worker) recovered(p Pair, fn func() error) (err error) {
	defer func() {
		if rec := recover(); rec != nil {
			w.log.Error("panic while processing pair",
				w.logPair(p, slog.Any("panic", rec), slog.String("stack", string(debug.Stack())))...)
			err = fmt.Errorf("panic: %v", rec)
		}
	}()
	return fn()
}
