package worker

import (
	"slices"

	"github.com/google/uuid"
)

// The snapshot retention, the one rule every writer of snapshots applies: of a pair's
// snapshots, newest first, keep the newest MaxPerStream-1 and the oldest (so that a very
// late event still finds a restore point), or only the newest when MaxPerStream is 1.

// snapshotsToDrop takes snapshot positions newest first and returns those the retention
// drops.
func snapshotsToDrop(newestFirst []uuid.UUID, max int) []uuid.UUID {
	if len(newestFirst) <= max {
		return nil
	}
	if max == 1 {
		return newestFirst[1:]
	}
	return newestFirst[max-1 : len(newestFirst)-1]
}

// retain applies the retention to a pair that has the snapshots existing (newest first)
// and takes the new ones taken (oldest first, all newer than every existing one). It
// returns the new snapshots to store and the existing ones to delete.
func (w *Worker) retain(taken []Snapshot, existing []uuid.UUID) (store []Snapshot, drop []uuid.UUID) {
	if len(taken) == 0 {
		return nil, nil
	}
	all := make([]uuid.UUID, 0, len(taken)+len(existing))
	for i := len(taken) - 1; i >= 0; i-- {
		all = append(all, taken[i].EventID)
	}
	all = append(all, existing...)
	dropped := snapshotsToDrop(all, w.cfg.Snapshots.MaxPerStream)
	if len(dropped) == 0 {
		return taken, nil
	}
	store = make([]Snapshot, 0, len(taken))
	for _, s := range taken {
		if !slices.Contains(dropped, s.EventID) {
			store = append(store, s)
		}
	}
	for _, id := range existing {
		if slices.Contains(dropped, id) {
			drop = append(drop, id)
		}
	}
	return store, drop
}
