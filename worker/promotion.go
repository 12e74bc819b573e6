package worker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
)

// Promotion checks: a maintenance service. At each look at the builds, the holder of a
// version's promotion lease (leasePromotion) asks the Store to promote each caught-up build
// of that version that is building, unless ManualPromotion; the Store promotes it when its
// queue is no further behind than the active build's (caughtUp), fenced by the lease.

// queuePromotions queues a promotion check for each build of set that is caught up and
// building, of a version whose promotion lease this instance holds.
func (w *Worker) queuePromotions(s *schedule, set *buildSet) {
	if w.cfg.ManualPromotion {
		return
	}
	for _, key := range set.keys {
		b := set.byKey[key]
		if b.CatchUpDone && b.State == BuildBuilding && w.lead.holds(leasePromotion(b.Perspective, b.Version)) {
			s.queueBuildJob(job{kind: jobPromote, key: key})
		}
	}
}

// promote makes build key active when it has caught up, and says whether it did.
func (w *Worker) promote(ctx context.Context, key string) (bool, error) {
	b := w.buildOf(key)
	lease := leasePromotion(b.Perspective, b.Version)
	if !w.lead.holds(lease) {
		return false, nil // lost since the look that queued it
	}
	ok, err := w.store.Promote(ctx, b.Perspective, key, false, w.lead.fence(lease))
	if errors.Is(err, ErrNotLeader) {
		w.log.Warn("promotion refused: the leader lease lapsed", slog.String("perspective", b.Perspective),
			slog.Int("version", b.Version), slog.String("lease", lease))
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("promote %s version %d: %w", b.Perspective, b.Version, err)
	}
	if ok {
		w.log.Info("perspective version promoted", slog.String("perspective", b.Perspective),
			slog.Int("version", b.Version), slog.Int("build", b.N))
	}
	return ok, nil
}
