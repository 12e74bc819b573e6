package worker

// Cleanup: a retired build's rows deleted in bounded batches, by the holder of its
// perspective's cleanup lease (queries/cleanup.sql).

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/perspectives-go/perspectives/db"
)

// Retired-build cleanup: a maintenance service. At each look at the builds, the holder of a
// perspective's cleanup lease (leaseCleanup) deletes the rows of the perspective's retired
// builds, retireGrace after their retirement, cleanupBatch pairs per statement, one batch
// after the other while rows are left, each fenced by the lease.

// queueCleanups queues a cleanup of each perspective whose cleanup lease this instance holds.
func (w *Worker) queueCleanups(s *schedule) {
	for _, name := range w.names {
		if w.lead.holds(leaseCleanup(name)) {
			s.queueBuildJob(job{kind: jobCleanup, key: name})
		}
	}
}

// cleanup deletes one batch of the rows of the perspective's retired builds, and says
// whether rows are left.
func (w *Worker) cleanup(ctx context.Context, perspective string) bool {
	lease := leaseCleanup(perspective)
	if !w.lead.holds(lease) {
		return false // lost since the look that queued it
	}
	more, err := w.store.Cleanup(ctx, []string{perspective}, retireGrace, cleanupBatch, w.lead.fence(lease))
	switch {
	case errors.Is(err, ErrNotLeader):
		w.log.Warn("cleanup of a retired build refused: the leader lease lapsed", slog.String("perspective", perspective))
		return false
	case err != nil && ctx.Err() == nil:
		w.log.Error("cleanup of a retired build failed", slog.String("perspective", perspective), slog.Any("error", err))
	}
	return more
}

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

// CleanupStore is what the cleanup of retired builds asks of the database.
type CleanupStore interface {
	// Cleanup deletes the rows of up to batch pairs of a retired build of the perspectives,
	// retired at least grace ago. It reports whether any such build has rows left. Fenced
	// by fence, as Promote.
	Cleanup(ctx context.Context, perspectives []string, grace time.Duration, batch int, fence LeaderLease) (more bool, err error)
}
