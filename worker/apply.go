package worker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"slices"
	"time"

	"github.com/google/uuid"
)

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

// runJob runs one job and reports to the loop. A pair job then releases its pairs' leases,
// but those a follow-up keeps (see release).
func (w *Worker) runJob(ctx context.Context, j job) jobResult {
	r := w.run(ctx, j)
	if len(j.pairs) > 0 {
		w.release(ctx, r)
	}
	return r
}

// busyWait is how long a pair found held by another transaction or goroutine (a purge, a
// failure being recorded, a catch-up page) waits before it is due again.
const busyWait = 100 * time.Millisecond

// release ends the leases of r's pairs that no follow-up keeps: each is due again at its
// oldest queued event (its row goes when nothing is queued), a busy one after busyWait, one
// whose failure could not be recorded after its backoff (unrecordedWait). It runs under a
// fresh context bounded by releaseTimeout, so that a stop does not leave the leases to lapse;
// when it fails they do lapse, and the pairs are due again after LockTimeout.
func (w *Worker) release(ctx context.Context, r jobResult) {
	kept := map[Pair]bool{}
	for _, next := range r.next {
		for _, p := range next.pairs {
			kept[p] = true
		}
	}
	req := ReleaseRequest{Instance: w.cfg.InstanceID, Later: map[Pair]time.Duration{}}
	for _, p := range r.job.pairs {
		if !kept[p] {
			req.Pairs = append(req.Pairs, p)
		}
	}
	if len(req.Pairs) == 0 {
		return
	}
	for _, p := range r.busy {
		req.Later[p] = busyWait
	}
	for _, p := range r.unrecorded {
		req.Later[p] = w.unrecordedWait(r.job.unrecorded[p] + 1)
	}
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), releaseTimeout)
	defer cancel()
	if err := w.store.Release(rctx, req); err != nil {
		w.log.Warn("releasing the pairs' leases failed; they are due again when the leases lapse",
			slog.Int("pairs", len(req.Pairs)), slog.Duration("lease", w.cfg.LockOptions.LockTimeout), slog.Any("error", err))
	}
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
			r.next = append(r.next, job{kind: jobCatchUp, key: j.key, notBefore: started.Add(took + w.pacing(j.key, took))})
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
		r.next = append(r.next, job{kind: jobApply, pairs: []Pair{p}})
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

// applyPairs runs the normal path for pairs in one transaction. When that transaction
// fails as a whole, nothing of it was written: each pair is then applied alone, so that a
// pair whose failure breaks the transaction has it recorded on itself only.
func (w *Worker) applyPairs(ctx context.Context, pairs []Pair, r *jobResult) {
	out, err := w.applyGroup(ctx, pairs)
	if err != nil {
		if ctx.Err() != nil {
			return
		}
		if len(pairs) == 1 {
			w.fail(ctx, pairs[0], err, r)
			return
		}
		if isConnectionError(err) && !slices.ContainsFunc(pairs, func(p Pair) bool { return r.job.cutOffFails[p] }) {
			// Each pair alone would fail the same: they all stay queued (see fail).
			w.log.Warn("database unavailable; the pairs stay queued and are retried at the next claim",
				slog.Int("pairs", len(pairs)), slog.Any("error", err))
			r.cutOff = append(r.cutOff, pairs...)
			return
		}
		w.log.Warn("group transaction failed; applying its pairs one at a time",
			slog.Int("pairs", len(pairs)), slog.Any("error", err))
		for _, p := range pairs {
			w.applyPairs(ctx, []Pair{p}, r)
		}
		return
	}
	for _, rep := range out.reports {
		w.reportApplied(ctx, rep)
	}
	r.next = append(r.next, out.next...)
	r.busy = append(r.busy, out.busy...)
}

// applyOutcome is what one apply transaction committed and left to do.
type applyOutcome struct {
	reports []pairReport // per pair that applied events or failed
	next    []job        // rewinds and bootstraps to run next
	busy    []Pair       // cursor row held by another transaction: skipped
}

// pairReport is one pair's committed application.
type pairReport struct {
	pair    Pair
	applied int
	err     error         // the failure that stopped it, if any
	action  FailureAction // what err did to the pair
}

// failure is err, a failure of the pair st of b, to record, with what b's failure policy
// makes of it.
func (w *Worker) failure(b *build, st PairState, err error) Failure {
	ev := failedEvent(err)
	before := failuresOf(ev, st.FailedEvent, st.Failures)
	return Failure{Cause: failureText(err), Event: ev, Action: w.policy(b.Perspective).action(before, ev)}
}

// applyGroup is the normal path: in one transaction it applies the queued events of
// pairs, in ID order, at most BatchSize per pair. A pair is left alone, its events staying
// queued, when another transaction holds its cursor row or another instance holds its
// stream lock; one that needs a rewind or a bootstrap is returned as a follow-up. An event
// whose Apply fails ends its pair's batch: the events before it are committed, it and the
// ones after stay queued, and the failure is recorded for a retry with backoff.
func (w *Worker) applyGroup(ctx context.Context, pairs []Pair) (out applyOutcome, err error) {
	defer func() {
		if rec := recover(); rec != nil {
			w.log.Error("panic while applying a group", slog.Int("pairs", len(pairs)),
				slog.Any("panic", rec), slog.String("stack", string(debug.Stack())))
			err = fmt.Errorf("panic: %v", rec)
		}
	}()
	busy, err := w.store.Apply(ctx, pairs, w.cfg.BatchSize, func(states []PairState) []PairWrite {
		out = applyOutcome{}
		return w.decide(ctx, states, &out)
	})
	if err != nil {
		return applyOutcome{}, fmt.Errorf("apply: %w", err)
	}
	out.busy = busy
	return out, nil
}

// decide folds each pair's queued events into its model, and says what to write.
func (w *Worker) decide(ctx context.Context, states []PairState, out *applyOutcome) []PairWrite {
	writes := make([]PairWrite, 0, len(states))
	set := w.builds()
	for _, st := range states {
		b := set.byKey[st.Perspective]
		if b == nil || len(st.Events) == 0 || w.lockedElsewhere(st.LockHolder) {
			continue // another instance holds the stream lock: its events stay queued
		}
		if next, ok := w.followUp(st); ok {
			out.next = append(out.next, next)
			continue
		}
		var model json.RawMessage
		if st.LastEventID.Valid {
			if st.Model == nil || st.ModelAt != st.LastEventID.UUID {
				err := fmt.Errorf("model is at event %s but the cursor is at %s", st.ModelAt, st.LastEventID.UUID)
				fl := w.failure(b, st, err)
				writes = append(writes, PairWrite{Pair: st.Pair, Failure: fl})
				out.reports = append(out.reports, pairReport{pair: st.Pair, err: err, action: fl.Action})
				continue
			}
			model = st.Model
		}
		f := w.fold(ctx, b.persp, model, st.SinceSnapshot, st.Events)
		wr := PairWrite{Pair: st.Pair, Applied: f.applied, Model: f.model, SinceSnapshot: f.since}
		if len(f.applied) > 0 {
			wr.LastEventID = f.applied[len(f.applied)-1]
		}
		wr.Snapshots, wr.DropSnapshots = w.retain(f.snaps, st.Snapshots)
		if f.err != nil {
			wr.Failure = w.failure(b, st, f.err)
		}
		writes = append(writes, wr)
		out.reports = append(out.reports, pairReport{pair: st.Pair, applied: len(f.applied), err: f.err, action: wr.Failure.Action})
	}
	return writes
}

// lockedElsewhere says whether a stream lock's holder is another instance.
func (w *Worker) lockedElsewhere(holder uuid.UUID) bool {
	return holder != uuid.Nil && holder != w.cfg.InstanceID
}

// followUp says what a pair needs before its queued events can be applied to its model: a
// rewind when the first is not newer than the cursor (it arrived late), a bootstrap when the
// pair's history is long enough for a snapshot to pay (EveryNEvents events since the last
// one) but it has none.
func (w *Worker) followUp(st PairState) (job, bool) {
	switch {
	case st.LastEventID.Valid && compareIDs(st.LastEventID.UUID, st.Events[0].ID) >= 0:
		return job{kind: jobRewind, pairs: []Pair{st.Pair}}, true
	case st.LastEventID.Valid && !w.cfg.Snapshots.Disabled && len(st.Snapshots) == 0 &&
		st.SinceSnapshot >= w.cfg.Snapshots.EveryNEvents:
		return job{kind: jobBootstrap, pairs: []Pair{st.Pair}}, true
	}
	return job{}, false
}

// reportApplied records the metrics and logs of one pair's committed application.
func (w *Worker) reportApplied(ctx context.Context, rep pairReport) {
	k := rep.pair
	if rep.err != nil {
		w.tel.applyErrors.Add(ctx, 1, w.metricPair(k))
		w.logFailure(k, rep.action, rep.err, slog.Int("applied_before_failure", rep.applied))
	}
	if rep.applied > 0 {
		w.tel.eventsApplied.Add(ctx, int64(rep.applied), w.metricPair(k))
		w.countApplied(k.Perspective, rep.applied)
		if rep.err == nil {
			w.log.Debug("events applied", w.logPair(k, slog.Int("events", rep.applied))...)
		}
	}
}

// fail records a failed operation on the pair (retried with backoff), unless it is a
// shutdown, a race that another writer won or a database that could not be reached (the
// next claim retries those at once, and r notes the last: see job.cutOffFails).
func (w *Worker) fail(ctx context.Context, k Pair, cause error, r *jobResult) {
	attrs := w.logPair(k, slog.Any("error", cause))
	if ctx.Err() != nil {
		w.log.Info("operation interrupted by shutdown", attrs...)
		return
	}
	if errors.Is(cause, ErrCursorMoved) {
		w.log.Warn("operation refused at commit; will retry", attrs...)
		return
	}
	if isConnectionError(cause) && !r.job.cutOffFails[k] {
		// Nothing about the pair: it stays queued and is claimed again once the database
		// answers (a restart, a failover), without the backoff meant for failing perspectives.
		w.log.Warn("database unavailable; the pair stays queued and is retried at the next claim", attrs...)
		r.cutOff = append(r.cutOff, k)
		return
	}
	w.tel.applyErrors.Add(context.WithoutCancel(ctx), 1, w.metricPair(k))
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), releaseTimeout)
	defer cancel()
	f := Failure{Cause: failureText(cause), Event: failedEvent(cause)}
	policy := w.policy(w.buildOf(k.Perspective).Perspective) // a build retired meanwhile: the default
	action, err := w.store.MarkFailed(rctx, k, f, func(before int) FailureAction { return policy.action(before, f.Event) })
	if err != nil {
		// The pair backs off in the loop (its rows stay due): said once for the spell.
		r.unrecorded = append(r.unrecorded, k)
		level := slog.LevelError
		if r.job.unrecorded[k] > 0 {
			level = slog.LevelDebug
		}
		w.log.Log(rctx, level, "recording failure failed; the pair is retried with backoff",
			append(attrs, slog.Any("record_error", err))...)
		return
	}
	w.logFailure(k, action, cause)
}

// logFailure logs a recorded failure of k, saying what it did to the pair.
func (w *Worker) logFailure(k Pair, action FailureAction, cause error, attrs ...any) {
	if ev := failedEvent(cause); ev != uuid.Nil {
		attrs = append(attrs, slog.String("event_id", ev.String()))
	}
	attrs = w.logPair(k, append(attrs, slog.Any("error", cause))...)
	switch {
	case action == FailurePark:
		w.log.Error("pair parked after repeated failures: its failing event and the ones after it wait for perspectives retry or skip", attrs...)
	case action == FailureSkip:
		w.log.Error("event skipped after repeated failures, as the perspective's failure policy says (recorded in wh_skipped_events); the pair goes on", attrs...)
	case errors.Is(cause, ErrLockLost):
		w.log.Warn("stream lock lost: the operation's work was refused; will retry with backoff", attrs...)
	case failedEvent(cause) != uuid.Nil:
		w.log.Error("event application failed; will retry with backoff", attrs...)
	default:
		w.log.Error("processing failed; will retry with backoff", attrs...)
	}
}

// failureText is the error recorded on a failed pair (its column has no length limit; a
// bound keeps one poison event from writing megabytes per attempt).
func failureText(err error) string {
	s := err.Error()
	if len(s) > 2000 {
		s = s[:2000]
	}
	return s
}

// folded is the outcome of applying a pair's events in order.
type folded struct {
	model   json.RawMessage // the model after the applied events
	applied []uuid.UUID     // the events applied, in order
	snaps   []Snapshot      // the snapshots due among them, oldest first
	since   int             // events since the last snapshot, after the applied ones
	err     error           // the Apply failure that ended the fold (its event and later ones not applied)
}

// fold applies events (in ID order) to model, taking a snapshot each time
// Snapshots.EveryNEvents events have been applied since the last one (since of them before
// the first event). The first event whose Apply fails, or returns a model that is not JSON,
// ends it. Only the models it returns (the last one and the snapshots) are checked to be
// valid JSON; when one is not, the fold runs again checking every model, to find the event
// at fault.
func (w *Worker) fold(ctx context.Context, persp Perspective, model json.RawMessage, since int, events []Event) folded {
	f := w.foldEvents(ctx, persp, model, since, events, false)
	valid := len(f.applied) == 0 || json.Valid(f.model)
	for _, s := range f.snaps {
		valid = valid && json.Valid(s.Model)
	}
	if !valid {
		return w.foldEvents(ctx, persp, model, since, events, true)
	}
	return f
}

// foldEvents is fold; checkJSON checks every model Apply returns.
func (w *Worker) foldEvents(ctx context.Context, persp Perspective, model json.RawMessage, since int, events []Event, checkJSON bool) folded {
	f := folded{model: model, since: since, applied: make([]uuid.UUID, 0, len(events))}
	for _, ev := range events {
		next, err := w.applyOne(ctx, persp, f.model, ev, checkJSON)
		if err != nil {
			f.err = eventError{event: ev.ID, err: fmt.Errorf("apply event %s (%s): %w", ev.ID, ev.Type, err)}
			break
		}
		f.model = next
		f.applied = append(f.applied, ev.ID)
		f.since++
		if !w.cfg.Snapshots.Disabled && f.since >= w.cfg.Snapshots.EveryNEvents {
			f.snaps = append(f.snaps, Snapshot{EventID: ev.ID, Model: f.model})
			f.since = 0
		}
	}
	return f
}

// perspectiveError is an error of a perspective's Apply: the pair's failure, whatever it
// wraps (an io.EOF of its own decoder, a timeout of a call it made), never the database's.
type perspectiveError struct{ err error }

func (e perspectiveError) Error() string { return e.err.Error() }
func (e perspectiveError) Unwrap() error { return e.err }

// applyOne runs the perspective's Apply, turning a panic or an empty model (or, when
// checkJSON, one that is not valid JSON) into an error.
func (w *Worker) applyOne(ctx context.Context, persp Perspective, model json.RawMessage, ev Event, checkJSON bool) (next json.RawMessage, err error) {
	defer func() {
		if r := recover(); r != nil {
			err = perspectiveError{fmt.Errorf("panic in Apply: %v", r)}
		}
	}()
	next, err = persp.Apply(ctx, model, ev)
	if err != nil {
		return nil, perspectiveError{err}
	}
	if len(next) == 0 || checkJSON && !json.Valid(next) {
		return nil, fmt.Errorf("perspective %s returned a model that is not valid JSON", persp.Name())
	}
	return next, nil
}
