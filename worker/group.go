package worker

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"runtime/debug"
	"slices"
	"strings"

	"github.com/google/uuid"

	"github.com/perspectives-go/perspectives/db"
)

// The group path: the normal path for many pairs in one transaction. A group costs a
// handful of statements and one commit (one WAL flush) whatever its size: lock the cursor
// rows, read the queued events, read the models that are needed, write every model, cursor
// and queue row, and write the snapshots taken. Each pair keeps the normal path's rules;
// a pair that needs more (a rewind, a bootstrap) or that the group cannot handle is left
// to the single-pair path after the group has committed.

// groupOutcome is what a group transaction committed and what it left to the single-pair
// path.
type groupOutcome struct {
	applied map[pairKey]int          // events applied and committed, per pair
	failed  map[pairKey]error        // an Apply failure, recorded with backoff (the events before it applied)
	follow  map[pairKey]normalResult // a rewind or a bootstrap to run next
	single  []pairKey                // to process again alone (see applyGroup)
	held    []pairKey                // cursor row held by another transaction: skipped
}

// pairWork is one pair's part of a group transaction.
type pairWork struct {
	k      pairKey
	cur    db.PairsLockForApplyRow
	events []Event
}

// processGroup applies a group of due pairs. It takes the pairs that no other goroutine of
// this process holds, applies them in one transaction, and then runs what that left to the
// single-pair path (rewinds, bootstraps) one pair at a time; the pairs held elsewhere are
// processed last, waiting for their holder. finished is called once per pair as soon as
// its work is over, so that the claim may take it again while the rest of the group goes on.
func (w *Worker) processGroup(ctx context.Context, keys []pairKey, finished func(pairKey)) {
	releases := make(map[pairKey]func(), len(keys))
	var mine, waiting []pairKey // taken here; held by another goroutine of this process
	for _, k := range keys {
		if w.persp[k.Perspective] == nil {
			finished(k)
			continue
		}
		if release, ok := w.coord.tryLock(k); ok {
			releases[k] = release
			mine = append(mine, k)
		} else {
			waiting = append(waiting, k)
		}
	}
	done := func(k pairKey) {
		releases[k]()
		finished(k)
	}
	if len(mine) > 0 {
		out, err := w.applyGroupGuarded(ctx, mine)
		switch {
		case err != nil && ctx.Err() != nil:
			for _, k := range mine {
				done(k)
			}
			for _, k := range waiting {
				finished(k)
			}
			return
		case err != nil:
			// Nothing of the group was written. Alone, each pair's failure (a poison pair)
			// is recorded on that pair only.
			w.log.Warn("group transaction failed; processing its pairs one at a time",
				slog.Int("pairs", len(mine)), slog.Any("error", err))
			for _, k := range mine {
				w.runPair(ctx, k, func() error { return w.processPair(ctx, k, w.persp[k.Perspective]) })
				done(k)
			}
		default:
			w.reportGroup(ctx, out)
			w.skipNextClaim(out.held)
			single := make(map[pairKey]bool, len(out.single))
			for _, k := range out.single {
				single[k] = true
			}
			var rest []pairKey
			for _, k := range mine {
				if _, ok := out.follow[k]; ok || single[k] {
					rest = append(rest, k)
					continue
				}
				done(k)
			}
			if len(rest) > 0 {
				w.Notify() // the pairs done may have new events; this slot stays busy a while
			}
			w.runFollowUps(rest, func(k pairKey) {
				persp := w.persp[k.Perspective]
				if res, ok := out.follow[k]; ok {
					w.runPair(ctx, k, func() error { return w.continuePair(ctx, k, persp, res) })
				} else {
					w.runPair(ctx, k, func() error { return w.processPair(ctx, k, persp) })
				}
				done(k)
			})
		}
	}
	for _, k := range waiting {
		w.process(ctx, k)
		finished(k)
	}
}

// runFollowUps runs run for each of keys, the pairs a group left to the single-pair path
// (rewinds, bootstraps). Each but the last takes a free Concurrency slot of its own when
// there is one, so that several rewinds of one group run side by side, as they would had
// the pairs been claimed apart; without a free slot it runs in the group's own slot. It
// returns when the keys it ran itself are done.
func (w *Worker) runFollowUps(keys []pairKey, run func(pairKey)) {
	for i, k := range keys {
		if i < len(keys)-1 && w.trySlot() {
			w.runInSlot(func() { run(k) }) // from the group's own counted job
			continue
		}
		run(k)
		if i < len(keys)-1 {
			w.Notify() // k is done, and this slot stays busy with the next one
		}
	}
}

// applyGroupGuarded runs applyGroup, turning a panic into an error.
func (w *Worker) applyGroupGuarded(ctx context.Context, keys []pairKey) (out groupOutcome, err error) {
	defer func() {
		if r := recover(); r != nil {
			w.log.Error("panic while applying a group", slog.Int("pairs", len(keys)),
				slog.Any("panic", r), slog.String("stack", string(debug.Stack())))
			err = fmt.Errorf("panic: %v", r)
		}
	}()
	return w.applyGroup(ctx, keys)
}

// applyGroup applies the queued events of keys in one transaction, each pair as the normal
// path would (applyNormal). A pair is skipped, its events staying queued, when another
// transaction holds its cursor row or another instance holds its stream lock. A pair that
// needs a rewind or a bootstrap is returned in follow, and one whose model does not match
// its cursor in single (the single-pair path reports it); neither is written here.
func (w *Worker) applyGroup(ctx context.Context, keys []pairKey) (groupOutcome, error) {
	var out groupOutcome
	err := w.store.InTx(ctx, func(q db.Querier) error {
		out = groupOutcome{applied: map[pairKey]int{}, failed: map[pairKey]error{}, follow: map[pairKey]normalResult{}}
		work, held, err := w.lockGroup(ctx, q, keys)
		out.held = held
		if err != nil || len(work) == 0 {
			return err
		}
		if err := w.readGroupEvents(ctx, q, work); err != nil {
			return err
		}

		// Decide per pair, and find the models to read.
		var ready, withModel []*pairWork
		for _, p := range work {
			if len(p.events) == 0 {
				continue
			}
			if next, ok := w.followUp(p.cur.LastEventID, p.cur.HasSnapshot, p.events[0].ID); ok {
				out.follow[p.k] = next
				continue
			}
			ready = append(ready, p)
			if p.cur.LastEventID.Valid {
				withModel = append(withModel, p)
			}
		}
		models := make(map[pairKey]db.ModelsGetRow, len(withModel))
		if len(withModel) > 0 {
			// Read after the row locks, in a statement of its own (see PairLockForApply).
			streams, names := pairArrays(withModel)
			rows, err := q.ModelsGet(ctx, db.ModelsGetParams{StreamIds: streams, PerspectiveNames: names})
			if err != nil {
				return fmt.Errorf("load models: %w", err)
			}
			for _, r := range rows {
				models[pairKey{Stream: r.StreamID, Perspective: r.PerspectiveName}] = r
			}
		}

		// Apply, and gather every write of the group.
		var (
			commit    db.PairsApplyCommitParams
			snaps     db.SnapshotsInsertManyParams
			snapPairs []*pairWork
		)
		for _, p := range ready {
			var model json.RawMessage
			if p.cur.LastEventID.Valid {
				m, ok := models[p.k]
				if !ok || m.LastEventID != p.cur.LastEventID.UUID {
					out.single = append(out.single, p.k) // inconsistent: the single path reports it
					continue
				}
				model = json.RawMessage(m.Model)
			}
			f := w.fold(ctx, w.persp[p.k.Perspective], model, int(p.cur.EventsSinceSnapshot), p.events)
			if f.err != nil {
				out.failed[p.k] = f.err
			}
			if len(f.applied) == 0 {
				continue
			}
			out.applied[p.k] = len(f.applied)
			commit.StreamIds = append(commit.StreamIds, p.k.Stream)
			commit.PerspectiveNames = append(commit.PerspectiveNames, p.k.Perspective)
			commit.Models = append(commit.Models, []byte(f.model))
			commit.LastEventIds = append(commit.LastEventIds, f.applied[len(f.applied)-1])
			commit.EventsSinceSnapshot = append(commit.EventsSinceSnapshot, int32(f.since))
			for _, id := range f.applied {
				commit.AppliedStreamIds = append(commit.AppliedStreamIds, p.k.Stream)
				commit.AppliedPerspectiveNames = append(commit.AppliedPerspectiveNames, p.k.Perspective)
				commit.AppliedEventIds = append(commit.AppliedEventIds, id)
			}
			for _, s := range f.snaps {
				snaps.StreamIds = append(snaps.StreamIds, p.k.Stream)
				snaps.PerspectiveNames = append(snaps.PerspectiveNames, p.k.Perspective)
				snaps.SnapshotEventIds = append(snaps.SnapshotEventIds, s.eventID)
				snaps.Models = append(snaps.Models, []byte(s.model))
			}
			if len(f.snaps) > 0 {
				snapPairs = append(snapPairs, p)
			}
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
		if len(snapPairs) > 0 {
			if err := q.SnapshotsInsertMany(ctx, snaps); err != nil {
				return fmt.Errorf("write snapshots: %w", err)
			}
			streams, names := pairArrays(snapPairs)
			if _, err := q.SnapshotsPrune(ctx, db.SnapshotsPruneParams{
				StreamIds: streams, PerspectiveNames: names, MaxPerStream: int32(w.cfg.Snapshots.MaxPerStream),
			}); err != nil {
				return fmt.Errorf("prune snapshots: %w", err)
			}
		}
		for _, p := range ready {
			if err := out.failed[p.k]; err != nil {
				if err := w.markFailed(ctx, q, p.k, err); err != nil {
					return fmt.Errorf("record failure: %w", err)
				}
			}
		}
		return nil
	})
	if err != nil {
		return groupOutcome{}, fmt.Errorf("apply group: %w", err)
	}
	return out, nil
}

// lockGroup locks the cursor rows of keys (creating the missing ones) and returns the pairs
// this transaction may apply (not locked by another instance), and the pairs whose row
// another transaction holds.
func (w *Worker) lockGroup(ctx context.Context, q db.Querier, keys []pairKey) (work []*pairWork, held []pairKey, err error) {
	streams, names := keyArrays(keys)
	rows, err := q.PairsLockForApply(ctx, db.PairsLockForApplyParams{StreamIds: streams, PerspectiveNames: names})
	if err != nil {
		return nil, nil, fmt.Errorf("lock cursors: %w", err)
	}
	if len(rows) < len(keys) {
		// A pair not returned is held by another transaction, or has no cursor row (Append
		// and registration create it; this covers a row removed by hand). Tell them apart
		// with a read that never waits, and create only the missing rows, in key order (two
		// groups never insert the same rows in opposite orders).
		got := make(map[pairKey]bool, len(rows))
		for _, r := range rows {
			got[pairKey{Stream: r.StreamID, Perspective: r.PerspectiveName}] = true
		}
		var notLocked []pairKey
		for _, k := range keys {
			if !got[k] {
				notLocked = append(notLocked, k)
			}
		}
		streams, names := keyArrays(notLocked)
		absent, err := q.CursorsMissing(ctx, db.CursorsMissingParams{StreamIds: streams, PerspectiveNames: names})
		if err != nil {
			return nil, nil, fmt.Errorf("find missing cursors: %w", err)
		}
		missing := make([]pairKey, len(absent))
		for i, a := range absent {
			missing[i] = pairKey{Stream: a.StreamID, Perspective: a.PerspectiveName}
		}
		slices.SortFunc(missing, comparePairs)
		var created []db.CursorsEnsureRow
		if len(missing) > 0 {
			streams, names := keyArrays(missing)
			if created, err = q.CursorsEnsure(ctx, db.CursorsEnsureParams{StreamIds: streams, PerspectiveNames: names}); err != nil {
				return nil, nil, fmt.Errorf("create cursors: %w", err)
			}
		}
		fresh := make([]pairKey, len(created))
		isFresh := make(map[pairKey]bool, len(created))
		for i, c := range created {
			fresh[i] = pairKey{Stream: c.StreamID, Perspective: c.PerspectiveName}
			isFresh[fresh[i]] = true
		}
		for _, k := range notLocked {
			if !isFresh[k] {
				held = append(held, k)
			}
		}
		if len(fresh) > 0 {
			streams, names := keyArrays(fresh)
			more, err := q.PairsLockForApply(ctx, db.PairsLockForApplyParams{StreamIds: streams, PerspectiveNames: names})
			if err != nil {
				return nil, nil, fmt.Errorf("lock cursors: %w", err)
			}
			rows = append(rows, more...)
		}
	}
	work = make([]*pairWork, 0, len(rows))
	for _, r := range rows {
		if w.lockedElsewhere(r.StreamLockInstanceID, r.LockLive) {
			continue // another instance holds the stream lock: its events stay queued
		}
		work = append(work, &pairWork{k: pairKey{Stream: r.StreamID, Perspective: r.PerspectiveName}, cur: r})
	}
	return work, held, nil
}

// readGroupEvents reads the queued events of work (after the row locks), at most BatchSize
// per pair, each pair's in event-ID order.
func (w *Worker) readGroupEvents(ctx context.Context, q db.Querier, work []*pairWork) error {
	streams, names := pairArrays(work)
	rows, err := q.QueueEventsForPairs(ctx, db.QueueEventsForPairsParams{
		StreamIds: streams, PerspectiveNames: names, PerPairLimit: int32(w.cfg.BatchSize),
	})
	if err != nil {
		return fmt.Errorf("read queue: %w", err)
	}
	byKey := make(map[pairKey]*pairWork, len(work))
	for _, p := range work {
		byKey[p.k] = p
	}
	for _, r := range rows {
		p := byKey[pairKey{Stream: r.StreamID, Perspective: r.PerspectiveName}]
		if p == nil {
			return fmt.Errorf("queue returned event %s of a pair not asked for", r.EventID)
		}
		p.events = append(p.events, Event{ID: r.EventID, StreamID: r.StreamID, Type: r.EventType, Data: json.RawMessage(r.Data), CreatedAt: r.CreatedAt})
	}
	for _, p := range work {
		slices.SortFunc(p.events, func(a, b Event) int { return compareIDs(a.ID, b.ID) })
	}
	return nil
}

// reportGroup records the metrics and logs of a committed group, pair by pair.
func (w *Worker) reportGroup(ctx context.Context, out groupOutcome) {
	for k, n := range out.applied {
		w.reportApplied(ctx, k, n, out.failed[k])
	}
	for k, err := range out.failed {
		if out.applied[k] == 0 {
			w.reportApplied(ctx, k, 0, err)
		}
	}
}

// comparePairs orders pairs by stream, then perspective.
func comparePairs(a, b pairKey) int {
	if c := compareIDs(a.Stream, b.Stream); c != 0 {
		return c
	}
	return strings.Compare(a.Perspective, b.Perspective)
}

// keyArrays and pairArrays give pairs as the parallel arrays the group statements take.
func keyArrays(keys []pairKey) ([]uuid.UUID, []string) {
	streams, names := make([]uuid.UUID, len(keys)), make([]string, len(keys))
	for i, k := range keys {
		streams[i], names[i] = k.Stream, k.Perspective
	}
	return streams, names
}

func pairArrays(work []*pairWork) ([]uuid.UUID, []string) {
	keys := make([]pairKey, len(work))
	for i, p := range work {
		keys[i] = p.k
	}
	return keyArrays(keys)
}
