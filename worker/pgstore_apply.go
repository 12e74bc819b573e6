package worker

// The normal path's transaction on PostgreSQL: lock a group's cursor rows, read their
// queued events and models, write what the worker decided.

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"slices"

	"github.com/google/uuid"

	"github.com/perspectives-go/perspectives/db"
)

func (s *pgStore) Apply(ctx context.Context, pairs []Pair, perPair int, decide func([]PairState) []PairWrite) ([]Pair, error) {
	var busy []Pair
	err := s.inTx(ctx, func(q *db.Queries) error {
		states, held, err := lockPairs(ctx, q, pairs)
		busy = held
		if err != nil || len(states) == 0 {
			return err
		}
		if err := readPairs(ctx, q, states, perPair); err != nil {
			return err
		}
		return s.writePairs(ctx, q, decide(states), nil)
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
		// A pair not returned is held by another transaction, or has no cursor row (Append
		// and registration create it; this covers a row removed by hand). Tell them apart
		// with a read that never waits, and create only the missing rows, in key order (two
		// transactions never insert the same rows in opposite orders).
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
		absent, err := q.CursorsMissing(ctx, db.CursorsMissingParams{StreamIds: streams, PerspectiveNames: names})
		if err != nil {
			return nil, nil, fmt.Errorf("find missing cursors: %w", err)
		}
		missing := make([]Pair, len(absent))
		for i, a := range absent {
			missing[i] = Pair{Stream: a.StreamID, Perspective: a.PerspectiveName}
		}
		slices.SortFunc(missing, comparePairs)
		created := map[Pair]bool{}
		if len(missing) > 0 {
			streams, names := pairArrays(missing)
			rows, err := q.CursorsEnsure(ctx, db.CursorsEnsureParams{StreamIds: streams, PerspectiveNames: names})
			if err != nil {
				return nil, nil, fmt.Errorf("create cursors: %w", err)
			}
			for _, c := range rows {
				created[Pair{Stream: c.StreamID, Perspective: c.PerspectiveName}] = true
			}
		}
		var fresh []Pair
		for _, p := range notLocked {
			if created[p] {
				fresh = append(fresh, p)
			} else {
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
// in ID order) and the models of those that have events and a cursor position.
func readPairs(ctx context.Context, q *db.Queries, states []PairState, perPair int) error {
	byPair := make(map[Pair]*PairState, len(states))
	for i := range states {
		byPair[states[i].Pair] = &states[i]
	}
	streams, names := pairArrays(pairsOf(states))
	rows, err := q.QueueEventsForPairs(ctx, db.QueueEventsForPairsParams{
		StreamIds: streams, PerspectiveNames: names, PerPairLimit: int32(perPair),
	})
	if err != nil {
		return fmt.Errorf("read queue: %w", err)
	}
	for _, r := range rows {
		st := byPair[Pair{Stream: r.WhEventStore.StreamID, Perspective: r.PerspectiveName}]
		if st == nil {
			return fmt.Errorf("queue returned event %s of a pair not asked for", r.WhEventStore.EventID)
		}
		st.Events = append(st.Events, eventOf(r.WhEventStore))
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

func pairsOf(states []PairState) []Pair {
	pairs := make([]Pair, len(states))
	for i, st := range states {
		pairs[i] = st.Pair
	}
	return pairs
}

// writePairs writes every model, cursor and queue deletion of writes in one statement,
// then their snapshots, then their failures. The queue rows of the applied events are
// deleted: all of them (each must exist) when queued is nil, else those in queued.
func (s *pgStore) writePairs(ctx context.Context, q *db.Queries, writes []PairWrite, queued map[uuid.UUID]bool) error {
	var (
		commit db.PairsApplyCommitParams
		snaps  db.SnapshotsInsertParams
		drop   db.SnapshotsDeleteParams
		failed db.PairsMarkFailedParams
	)
	for _, wr := range writes {
		if len(wr.Applied) > 0 {
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

// addFailure adds f, a failure of p, to arg.
func addFailure(arg *db.PairsMarkFailedParams, p Pair, f Failure) {
	arg.StreamIds = append(arg.StreamIds, p.Stream)
	arg.PerspectiveNames = append(arg.PerspectiveNames, p.Perspective)
	arg.Errors = append(arg.Errors, f.Cause)
	arg.EventIds = append(arg.EventIds, f.Event)
	arg.Actions = append(arg.Actions, string(cmp.Or(f.Action, FailureRetry)))
}

// markFailed records the failures of arg with the store's backoff.
func (s *pgStore) markFailed(ctx context.Context, q *db.Queries, arg db.PairsMarkFailedParams) error {
	arg.BaseSeconds, arg.MaxSeconds = s.retryBase.Seconds(), s.retryMax.Seconds()
	arg.SkippedBy = cmp.Or(s.skippedBy, "worker")
	if _, err := q.PairsMarkFailed(ctx, arg); err != nil {
		return fmt.Errorf("record failure: %w", err)
	}
	return nil
}
