package worker

// Forgetting gone instances: the rows of instances whose heartbeats stopped, deleted by the
// holder of the instances lease (queries/forget.sql).

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/perspectives-go/perspectives/db"
)

// Forgetting gone instances: a maintenance service. At each look at the builds, the holder
// of the instances lease (leaseInstances) deletes the rows of the instances not seen for
// instanceForgetAfter (killed without a clean stop), fenced by the lease.

// queueForget queues the forgetting of gone instances when this instance holds its lease
// and records instances.
func (w *Worker) queueForget(s *schedule) {
	if _, ok := w.store.(instanceRecorder); ok && w.lead.holds(leaseInstances) {
		s.queueBuildJob(job{kind: jobForget})
	}
}

// forgetGone deletes the rows of the instances gone for instanceForgetAfter.
func (w *Worker) forgetGone(ctx context.Context) {
	rec, ok := w.store.(instanceRecorder)
	if !ok || !w.lead.holds(leaseInstances) {
		return
	}
	n, err := rec.forgetGone(ctx, instanceForgetAfter, w.lead.fence(leaseInstances))
	switch {
	case errors.Is(err, ErrNotLeader):
		w.log.Debug("forgetting gone instances refused: the leader lease lapsed")
	case err != nil:
		if ctx.Err() == nil && !isConnectionError(err) {
			w.log.Warn("forgetting gone instances failed", slog.Any("error", err))
		}
	case n > 0:
		w.log.Info("forgot instances gone for a day", slog.Int64("instances", n))
	}
}

func (s *pgStore) forget(ctx context.Context, id uuid.UUID) error {
	return s.q.InstanceDelete(ctx, id)
}

func (s *pgStore) forgetGone(ctx context.Context, after time.Duration, fence LeaderLease) (int64, error) {
	var n int64
	err := s.inTx(ctx, func(_ pgx.Tx, q *db.Queries) error {
		if err := leaderHold(ctx, q, fence); err != nil {
			return err
		}
		var err error
		n, err = q.InstancesForget(ctx, after.Seconds())
		return err
	})
	return n, err
}
