package worker

import (
	"context"
	"errors"
	"log/slog"
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
