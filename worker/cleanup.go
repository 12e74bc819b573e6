package worker

// Cleanup: a retired build's rows deleted in bounded batches, by the holder of its
// perspective's cleanup lease (queries/cleanup.sql).

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"

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
	rows, err := s.q.BuildsToClean(ctx, db.BuildsToCleanParams{PerspectiveNames: perspectives, GraceSeconds: grace.Seconds()})
	if err != nil || len(rows) == 0 {
		return false, err
	}
	r := rows[0]
	b := Build{Key: r.BuildKey, Perspective: r.PerspectiveName, Version: int(r.Version), N: int(r.Build), State: r.State, CatchUpDone: r.CatchupDone}
	var n int64
	err = s.inTx(ctx, func(_ pgx.Tx, q *db.Queries) error {
		if err := leaderHold(ctx, q, fence); err != nil {
			return err
		}
		n, err = q.BuildCleanupBatch(ctx, db.BuildCleanupBatchParams{BuildKey: b.Key, BatchSize: int32(batch)})
		return err
	})
	if err != nil || n > 0 {
		return n > 0 && err == nil, err
	}
	// None deleted: those left, if any, are held by another transaction (a rewind of the
	// build that began before its retirement, committing): deleted at the next look, and
	// the sink's Retired runs only once they are gone (a Write after it would leave its rows).
	left, err := s.q.BuildCursorsLeft(ctx, b.Key)
	if err != nil || left {
		return false, err
	}
	// The build's own rows are gone: its sink's rows next (Retired, on the pool, in as many
	// transactions as it likes), then the build is marked cleaned.
	if err := s.w.retireSinks(ctx, s.pool, b); err != nil {
		return false, err // tried again at the next look at the builds
	}
	err = s.inTx(ctx, func(_ pgx.Tx, q *db.Queries) error {
		if err := leaderHold(ctx, q, fence); err != nil {
			return err
		}
		return q.BuildMarkCleaned(ctx, b.Key)
	})
	if err != nil {
		return false, err
	}
	return len(rows) > 1, nil
}

// CleanupStore is what the cleanup of retired builds asks of the database.
type CleanupStore interface {
	// Cleanup deletes the rows of up to batch pairs of a retired build of the perspectives,
	// retired at least grace ago. It reports whether any such build has rows left. Fenced
	// by fence, as Promote.
	Cleanup(ctx context.Context, perspectives []string, grace time.Duration, batch int, fence LeaderLease) (more bool, err error)
}
