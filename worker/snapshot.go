package worker

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/google/uuid"

	"github.com/perspectives-go/perspectives/db"
)

// snapshot is a model as of an event (inclusive).
type snapshot struct {
	eventID uuid.UUID
	model   json.RawMessage
}

// writeSnapshots stores snaps and prunes the pair's snapshots to MaxPerStream.
func (w *Worker) writeSnapshots(ctx context.Context, q db.Querier, k pairKey, snaps []snapshot) error {
	if len(snaps) == 0 {
		return nil
	}
	for _, s := range snaps {
		if err := q.SnapshotInsert(ctx, db.SnapshotInsertParams{
			StreamID: k.Stream, PerspectiveName: k.Perspective, SnapshotEventID: s.eventID, Model: []byte(s.model),
		}); err != nil {
			return fmt.Errorf("write snapshot: %w", err)
		}
	}
	return w.pruneSnapshots(ctx, q, k)
}

// pruneSnapshots keeps the newest MaxPerStream-1 snapshots and the oldest one, so that a
// very late event still finds a restore point.
func (w *Worker) pruneSnapshots(ctx context.Context, q db.Querier, k pairKey) error {
	ids, err := q.SnapshotIDs(ctx, db.SnapshotIDsParams{StreamID: k.Stream, PerspectiveName: k.Perspective})
	if err != nil {
		return fmt.Errorf("list snapshots: %w", err)
	}
	drop := snapshotsToDrop(ids, w.cfg.Snapshots.MaxPerStream)
	if len(drop) == 0 {
		return nil
	}
	if _, err := q.SnapshotsDelete(ctx, db.SnapshotsDeleteParams{
		StreamID: k.Stream, PerspectiveName: k.Perspective, SnapshotEventIds: drop,
	}); err != nil {
		return fmt.Errorf("prune snapshots: %w", err)
	}
	return nil
}

// snapshotsToDrop takes snapshot IDs newest first and returns those beyond the retention:
// the newest max-1 and the oldest are kept (only the newest when max is 1).
func snapshotsToDrop(newestFirst []uuid.UUID, max int) []uuid.UUID {
	if len(newestFirst) <= max {
		return nil
	}
	if max == 1 {
		return newestFirst[1:]
	}
	return newestFirst[max-1 : len(newestFirst)-1]
}
