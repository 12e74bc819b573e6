package worker

// The normal path: one transaction locks a group's cursor rows, reads their queued events
// and models, folds them in Go and writes the models, cursors and snapshots
// (queries/apply.sql).

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"runtime/debug"
	"slices"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/perspectives-go/perspectives/db"
)

// applyPairs runs the normal path for pairs in one transaction. When that transaction
// fails as a whole, nothing of it was written: each pair is then applied alone, so that a
// pair whose failure breaks the transaction has it recorded on itself only.
func (w *Worker) applyPairs(ctx context.Context, pairs []Pair, r *jobResult) {
	out, err := w.applyGroup(ctx, pairs, r.job.after)
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
	for _, next := range out.next {
		next.claimed, next.chain = r.job.claimed, r.job.chain // under the same lease
		r.next = append(r.next, next)
	}
	for _, rep := range out.reports {
		w.reportApplied(ctx, rep)
		if rep.err == nil && rep.applied == w.cfg.BatchSize {
			if r.full == nil {
				r.full = map[Pair]uuid.UUID{}
			}
			r.full[rep.pair] = rep.last
		}
	}
	r.busy = append(r.busy, out.busy...)
}

// maxChain is how many batches in a row a pair keeps its lease for (see continuation).
const maxChain = 10

// continuation is the apply job that follows j for full, its pairs whose batch was full
// (BatchSize events applied, none failed) and their last event applied, unless they have
// had maxChain batches in a row or half their lease has passed: they keep their lease,
// without a release and a claim in between, and their next batch is read above the last
// event applied, past the queue rows applied before it. Then they are released and claimed
// again in their turn; that job reads from the lowest queued event, and finds an event
// queued late meanwhile (below the cursor, so not read by a continuation).
func (w *Worker) continuation(j job, full map[Pair]uuid.UUID) (job, bool) {
	if len(full) == 0 || j.chain+1 >= maxChain ||
		(!j.claimed.IsZero() && time.Since(j.claimed) >= w.cfg.LockOptions.LockTimeout/2) {
		return job{}, false
	}
	next := job{kind: jobApply, chain: j.chain + 1, claimed: j.claimed, after: full}
	for p := range full {
		next.pairs = append(next.pairs, p)
	}
	slices.SortFunc(next.pairs, comparePairs) // a group's pairs, and so its row locks, in one order
	return next, true
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
	last    uuid.UUID     // the last event applied (when applied > 0)
	err     error         // the failure that stopped it, if any
	action  FailureAction // what err did to the pair
}

// applyGroup is the normal path: in one transaction it applies the queued events of
// pairs, in ID order, at most BatchSize per pair. A pair is left alone, its events staying
// queued, when another transaction holds its cursor row or another instance holds its
// stream lock; one that needs a rewind or a bootstrap is returned as a follow-up. An event
// whose Apply fails ends its pair's batch: the events before it are committed, it and the
// ones after stay queued, and the failure is recorded for a retry with backoff.
func (w *Worker) applyGroup(ctx context.Context, pairs []Pair, after map[Pair]uuid.UUID) (out applyOutcome, err error) {
	defer func() {
		if rec := recover(); rec != nil {
			w.log.Error("panic while applying a group", slog.Int("pairs", len(pairs)),
				slog.Any("panic", rec), slog.String("stack", string(debug.Stack())))
			err = fmt.Errorf("panic: %v", rec)
		}
	}()
	busy, err := w.store.Apply(ctx, ApplyRequest{Pairs: pairs, PerPair: w.cfg.BatchSize, After: after}, func(states []PairState) []PairWrite {
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
		wr, err := w.foldWrite(ctx, b, st, model, st.Events)
		writes = append(writes, wr)
		out.reports = append(out.reports, pairReport{pair: st.Pair, applied: len(wr.Applied), last: wr.LastEventID, err: err, action: wr.Failure.Action})
	}
	return writes
}

// foldWrite folds events into model, the pair st's, and returns what to write: the model,
// the cursor, the snapshots to keep and to drop, and the failure that stopped the fold, if
// one did (and its error).
func (w *Worker) foldWrite(ctx context.Context, b *build, st PairState, model json.RawMessage, events []Event) (PairWrite, error) {
	f := w.fold(ctx, b.persp, model, st.SinceSnapshot, events)
	wr := PairWrite{Pair: st.Pair, Applied: f.applied, Model: f.model, SinceSnapshot: f.since}
	if len(f.applied) > 0 {
		wr.LastEventID = f.applied[len(f.applied)-1]
	}
	wr.Snapshots, wr.DropSnapshots = w.retain(f.snaps, st.Snapshots)
	if f.err != nil {
		wr.Failure = w.failure(b, st, f.err)
	}
	return wr, f.err
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

func (s *pgStore) Apply(ctx context.Context, req ApplyRequest, decide func([]PairState) []PairWrite) ([]Pair, error) {
	var busy []Pair
	err := s.inTx(ctx, func(tx pgx.Tx, q *db.Queries) error {
		states, held, err := lockPairs(ctx, q, req.Pairs)
		busy = held
		if err != nil || len(states) == 0 {
			return err
		}
		if err := readPairs(ctx, q, states, req.PerPair, req.After); err != nil {
			return err
		}
		return s.writePairs(ctx, tx, q, decide(states), nil, live)
	})
	if err != nil {
		return nil, err
	}
	return busy, nil
}

// lockPairs locks the cursor rows of pairs (creating the missing ones) and returns the
// state of each locked pair, and the pairs whose row another transaction holds.
func lockPairs(ctx context.Context, q *db.Queries, pairs []Pair) ([]PairState, []Pair, error) {
	streams, names := pairArrays(pairs)
	rows, err := q.PairsLockForApply(ctx, db.PairsLockForApplyParams{StreamIds: streams, PerspectiveNames: names})
	if err != nil {
		return nil, nil, fmt.Errorf("lock cursors: %w", err)
	}
	var busy []Pair
	if len(rows) < len(pairs) {
		// A pair not returned is held by another transaction, or has no cursor row (Append and
		// registration create it; this covers a row removed by hand). The missing rows are
		// created, without waiting for a row that exists, and locked.
		got := make(map[Pair]bool, len(rows))
		for _, r := range rows {
			got[Pair{Stream: r.StreamID, Perspective: r.PerspectiveName}] = true
		}
		var notLocked []Pair
		for _, p := range pairs {
			if !got[p] {
				notLocked = append(notLocked, p)
			}
		}
		streams, names := pairArrays(notLocked)
		created, err := q.CursorsEnsure(ctx, db.CursorsEnsureParams{StreamIds: streams, PerspectiveNames: names})
		if err != nil {
			return nil, nil, fmt.Errorf("create cursors: %w", err)
		}
		fresh := make([]Pair, len(created))
		for i, c := range created {
			fresh[i] = Pair{Stream: c.StreamID, Perspective: c.PerspectiveName}
		}
		for _, p := range notLocked {
			if !slices.Contains(fresh, p) {
				busy = append(busy, p)
			}
		}
		if len(fresh) > 0 {
			streams, names := pairArrays(fresh)
			more, err := q.PairsLockForApply(ctx, db.PairsLockForApplyParams{StreamIds: streams, PerspectiveNames: names})
			if err != nil {
				return nil, nil, fmt.Errorf("lock cursors: %w", err)
			}
			rows = append(rows, more...)
		}
	}
	states := make([]PairState, len(rows))
	for i, r := range rows {
		states[i] = PairState{
			Pair:          Pair{Stream: r.StreamID, Perspective: r.PerspectiveName},
			LastEventID:   r.LastEventID,
			SinceSnapshot: int(r.EventsSinceSnapshot),
			Failures:      int(r.Attempts),
			FailedEvent:   r.FailedEventID.UUID,
			Snapshots:     r.SnapshotIds,
			LockHolder:    r.LockHolder,
		}
	}
	return states, busy, nil
}

// readPairs reads, after the row locks, the queued events of states (at most perPair each,
// in ID order: above after[p] for a pair whose cursor is still there) and the models of
// those that have events and a cursor position.
func readPairs(ctx context.Context, q *db.Queries, states []PairState, perPair int, after map[Pair]uuid.UUID) error {
	byPair := make(map[Pair]*PairState, len(states))
	above := make([]uuid.UUID, len(states))
	streams, names := make([]uuid.UUID, len(states)), make([]string, len(states))
	for i := range states {
		st := &states[i]
		byPair[st.Pair] = st
		streams[i], names[i] = st.Stream, st.Perspective
		if a, ok := after[st.Pair]; ok && st.LastEventID == (uuid.NullUUID{UUID: a, Valid: true}) {
			above[i] = a
		}
	}
	rows, err := q.QueueEventsForPairs(ctx, db.QueueEventsForPairsParams{
		StreamIds: streams, PerspectiveNames: names, AfterEventIds: above, PerPairLimit: int32(perPair),
	})
	if err != nil {
		return fmt.Errorf("read queue: %w", err)
	}
	for _, r := range rows {
		st := byPair[Pair{Stream: r.StreamID, Perspective: r.PerspectiveName}]
		if st == nil {
			return fmt.Errorf("queue returned event %s of a pair not asked for", r.EventID)
		}
		st.Events = append(st.Events, eventOf(db.WhEventStore{
			EventID: r.EventID, StreamID: r.StreamID, EventType: r.EventType, Data: r.Data, CreatedAt: r.CreatedAt,
		}))
	}
	var withModel []Pair
	for i := range states {
		st := &states[i]
		slices.SortFunc(st.Events, func(a, b Event) int { return compareIDs(a.ID, b.ID) })
		if len(st.Events) > 0 && st.LastEventID.Valid {
			withModel = append(withModel, st.Pair)
		}
	}
	if len(withModel) == 0 {
		return nil
	}
	// Read after the row locks, in a statement of its own (see PairsLockForApply).
	streams, names = pairArrays(withModel)
	models, err := q.ModelsGet(ctx, db.ModelsGetParams{StreamIds: streams, PerspectiveNames: names})
	if err != nil {
		return fmt.Errorf("load models: %w", err)
	}
	for _, m := range models {
		if st := byPair[Pair{Stream: m.StreamID, Perspective: m.PerspectiveName}]; st != nil {
			st.Model, st.ModelAt = json.RawMessage(m.Model), m.LastEventID
		}
	}
	return nil
}

// live and replayed say whether a write's change is a replay (see Change.Replay): never on
// the normal path, always for a rewind.
func live(PairWrite) bool     { return false }
func replayed(PairWrite) bool { return true }

// writePairs writes every model, cursor and queue deletion of writes in one statement,
// then their snapshots, then their failures. The queue rows of the applied events are
// deleted: all of them (each must exist) when queued is nil, else those in queued. The
// changed models go to the sinks first, on tx (replay says which changes are replays); a
// sink's error is returned, and the caller's transaction rolls back.
func (s *pgStore) writePairs(ctx context.Context, tx pgx.Tx, q *db.Queries, writes []PairWrite, queued map[uuid.UUID]bool, replay func(PairWrite) bool) error {
	var (
		commit  db.PairsApplyCommitParams
		snaps   db.SnapshotsInsertParams
		drop    db.SnapshotsDeleteParams
		failed  db.PairsMarkFailedParams
		changes []pairChange
	)
	for _, wr := range writes {
		if len(wr.Applied) > 0 {
			changes = append(changes, pairChange{Pair: wr.Pair, Model: wr.Model, LastEventID: wr.LastEventID, Replay: replay(wr)})
			commit.StreamIds = append(commit.StreamIds, wr.Stream)
			commit.PerspectiveNames = append(commit.PerspectiveNames, wr.Perspective)
			commit.Models = append(commit.Models, string(wr.Model))
			commit.LastEventIds = append(commit.LastEventIds, wr.LastEventID)
			commit.EventsSinceSnapshot = append(commit.EventsSinceSnapshot, int32(wr.SinceSnapshot))
			for _, id := range wr.Applied {
				if queued != nil && !queued[id] {
					continue
				}
				commit.AppliedStreamIds = append(commit.AppliedStreamIds, wr.Stream)
				commit.AppliedPerspectiveNames = append(commit.AppliedPerspectiveNames, wr.Perspective)
				commit.AppliedEventIds = append(commit.AppliedEventIds, id)
			}
		}
		for _, sn := range wr.Snapshots {
			snaps.StreamIds = append(snaps.StreamIds, wr.Stream)
			snaps.PerspectiveNames = append(snaps.PerspectiveNames, wr.Perspective)
			snaps.SnapshotEventIds = append(snaps.SnapshotEventIds, sn.EventID)
			snaps.Models = append(snaps.Models, string(sn.Model))
		}
		for _, id := range wr.DropSnapshots {
			drop.StreamIds = append(drop.StreamIds, wr.Stream)
			drop.PerspectiveNames = append(drop.PerspectiveNames, wr.Perspective)
			drop.SnapshotEventIds = append(drop.SnapshotEventIds, id)
		}
		if wr.Failure.Cause != "" {
			addFailure(&failed, wr.Pair, wr.Failure)
		}
	}
	if err := s.w.writeSinks(ctx, tx, changes); err != nil {
		return err
	}
	if len(commit.StreamIds) > 0 {
		deleted, err := q.PairsApplyCommit(ctx, commit)
		if err != nil {
			return fmt.Errorf("write models: %w", err)
		}
		if int(deleted) != len(commit.AppliedEventIds) {
			return fmt.Errorf("deleted %d queue rows for %d applied events", deleted, len(commit.AppliedEventIds))
		}
	}
	if len(snaps.StreamIds) > 0 {
		if err := q.SnapshotsInsert(ctx, snaps); err != nil {
			return fmt.Errorf("write snapshots: %w", err)
		}
	}
	if len(drop.StreamIds) > 0 {
		if _, err := q.SnapshotsDelete(ctx, drop); err != nil {
			return fmt.Errorf("prune snapshots: %w", err)
		}
	}
	if len(failed.StreamIds) > 0 {
		return s.markFailed(ctx, q, failed)
	}
	return nil
}

// ApplyStore is what the normal path asks of the database.
type ApplyStore interface {
	// Apply runs one transaction over req.Pairs: it locks their cursor rows (skipping, and
	// returning as busy, those another transaction holds), reads each locked pair's state
	// (at most req.PerPair queued events, and its model), passes the states to decide and
	// writes what decide returns. An error rolls everything back.
	Apply(ctx context.Context, req ApplyRequest, decide func([]PairState) []PairWrite) (busy []Pair, err error)
}

// ApplyRequest asks Store.Apply for one transaction of the normal path.
type ApplyRequest struct {
	Pairs   []Pair
	PerPair int // at most this many queued events of each pair, the lowest IDs
	// After holds pairs whose events up to an ID are applied (a job following the pair's
	// full batch): while the cursor is still at that ID, only events above it are read.
	After map[Pair]uuid.UUID
}
