package worker

// Promotion: a caught-up build made its perspective's active one, by the holder of its
// version's promotion lease (queries/promotion.sql).

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"github.com/jackc/pgx/v5"

	"github.com/perspectives-go/perspectives/db"
)

// Promotion checks: a maintenance service. At each look at the builds, the holder of a
// version's promotion lease (leasePromotion) asks the Store to promote each caught-up build
// of that version that is building, unless ManualPromotion; the Store promotes it when
// nothing its catch-up handed to the queue waits (but in a stream parked in both builds) and
// its queue is no further behind than the active build's (caughtUp), fenced by the lease. A
// build whose promotion an operator requested (Admin.Promote of a sink's perspective) is
// promoted whatever ManualPromotion says and however far its queue is behind, as
// Admin.Promote does.

// queuePromotions queues a promotion check for each build of set that is caught up and
// building, of a version whose promotion lease this instance holds.
func (w *Worker) queuePromotions(s *schedule, set *buildSet) {
	for _, key := range set.keys {
		b := set.byKey[key]
		if w.cfg.ManualPromotion && !b.PromotionRequested {
			continue
		}
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
	ok, err := w.store.Promote(ctx, b.Perspective, key, b.PromotionRequested, w.lead.fence(lease))
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

func (s *pgStore) Promote(ctx context.Context, perspective, key string, force bool, fence LeaderLease) (bool, error) {
	// The checks that read the queue run first, outside any transaction: the oldest queued
	// event of each build, through its index (BuildQueueAge). The candidate is behind when
	// its oldest is older than the active build's by more than promoteLag, or while a pair
	// of it has an event queued by the end of its catch-up (what the catch-up handed to the
	// queue is history, however recently queued), unless that stream is parked in both
	// builds (BuildCatchUpLeftWaiting, only when the oldest is that old). Only the flip
	// holds the append lock's exclusive side, for which Appends wait: a few key lookups that
	// re-check what may have changed since (the states, the catch-up, which build is
	// active), and the updates. The queue ages are not read again there: an Append queues
	// its events for both builds alike, and an age that shrank meanwhile only means the
	// active build applied its backlog, which promoteLag allows for at the next look.
	cand, active, _, err := s.promotionBuilds(ctx, s.q, perspective, key)
	if err != nil || cand == nil {
		return false, err
	}
	if active != nil && !force && !olderBuild(*cand, *active) {
		candAge, err := s.q.BuildQueueAge(ctx, cand.Key)
		if err != nil {
			return false, err
		}
		activeAge, err := s.q.BuildQueueAge(ctx, active.Key)
		if err != nil {
			return false, err
		}
		if !caughtUp(micros(candAge.OldestMicros), micros(activeAge.OldestMicros)) {
			return false, nil
		}
		if candAge.FromCatchup {
			waiting, err := s.q.BuildCatchUpLeftWaiting(ctx, db.BuildCatchUpLeftWaitingParams{BuildKey: cand.Key, ActiveKey: active.Key})
			if err != nil || waiting {
				return false, err
			}
		}
	}
	measured := active
	promoted := false
	// Serialized with registration (and other promotions) by the append lock's exclusive
	// side, held for these few statements.
	err = s.underAppendLock(ctx, func(tx pgx.Tx, q *db.Queries) error {
		promoted = false // from an attempt that did not commit
		if err := leaderHold(ctx, q, fence); err != nil {
			return err
		}
		cand, active, older, err := s.promotionBuilds(ctx, q, perspective, key)
		if err != nil || cand == nil {
			return err
		}
		if (active == nil) != (measured == nil) || active != nil && active.Key != measured.Key {
			return nil // another build became active meanwhile: the next look checks again
		}
		// An Append whose snapshot predates the retirements below (REPEATABLE READ,
		// SERIALIZABLE) would queue for the builds they retire, after their cleanup maybe: it
		// fails instead, to be retried (see wh_registration).
		if err := q.RegistrationBump(ctx); err != nil {
			return err
		}
		if active != nil && olderBuild(*cand, *active) {
			// Versions only go up: a build older than the active one is retired, never
			// promoted.
			return q.BuildSetState(ctx, db.BuildSetStateParams{State: BuildRetired, BuildKey: cand.Key})
		}
		if active != nil {
			older = append(older, *active)
		}
		for _, b := range older {
			if err := q.BuildSetState(ctx, db.BuildSetStateParams{State: BuildRetired, BuildKey: b.Key}); err != nil {
				return err
			}
		}
		if err := q.BuildSetState(ctx, db.BuildSetStateParams{State: BuildActive, BuildKey: cand.Key}); err != nil {
			return err
		}
		to := *cand
		to.State = BuildActive
		var from *Build
		if active != nil {
			retired := *active
			retired.State = BuildRetired
			from = &retired
		}
		if err := s.w.promoteSinks(ctx, tx, from, to); err != nil {
			return err
		}
		promoted = true
		return nil
	})
	return promoted, err
}

// promotionBuilds reads the builds of the perspective (a lookup of its key) and returns the
// build key, when it is building and caught up (nil otherwise), the active build (nil:
// none), and the other building builds older than key's (olderBuild), which its promotion
// retires: an older version, or an earlier rebuild, left building would take every Append's
// events for ever, and could later be promoted over it. It is an error when the perspective
// has no build key.
func (s *pgStore) promotionBuilds(ctx context.Context, q *db.Queries, perspective, key string) (cand, active *Build, older []Build, err error) {
	builds, err := buildsOf(ctx, q, []string{perspective})
	if err != nil {
		return nil, nil, nil, err
	}
	for _, b := range builds {
		switch {
		case b.Key == key:
			cand = &b
		case b.State == BuildActive:
			active = &b
		}
	}
	if cand == nil {
		return nil, nil, nil, fmt.Errorf("perspective %q has no build %q", perspective, key)
	}
	if cand.State != BuildBuilding || !cand.CatchUpDone {
		return nil, active, nil, nil
	}
	for _, b := range builds {
		if b.State == BuildBuilding && b.Key != cand.Key && olderBuild(b, *cand) {
			older = append(older, b)
		}
	}
	return cand, active, older, nil
}

// olderBuild says whether build a is older than b: of a lower version, or an earlier build
// (rebuild) of the same version.
func olderBuild(a, b Build) bool {
	return a.Version < b.Version || a.Version == b.Version && a.N < b.N
}

// PromotionStore is what a promotion asks of the database.
type PromotionStore interface {
	// Promote makes the build key the perspective's active one and retires the active
	// one (and the building builds older than key's), in one transaction, when key's
	// catch-up is done and (unless forced) no event queued by the end of its catch-up waits
	// (but in a stream parked in both builds) and its queue is no further behind than the
	// active build's. A build older than the active one is retired instead. It reports
	// whether it promoted. The queue check runs before that transaction, which holds the
	// exclusive side of the append lock for key lookups and the flip only. Fenced by fence
	// (see LeaderLease): ErrNotLeader, and nothing written, unless its holder holds the
	// lease.
	Promote(ctx context.Context, perspective, key string, force bool, fence LeaderLease) (bool, error)
}
