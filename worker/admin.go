package worker

import (
	"context"
	"errors"
	"fmt"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/perspectives-go/perspectives/db"
	"github.com/perspectives-go/perspectives/locker"
)

// Admin runs operators' actions on a database without running any perspective: purging a
// pair or rebuilding it (under the stream lock), rebuilding a whole perspective beside its
// active version, promoting a version, reporting the builds. Running workers do the work.
// Purge and Rebuild are refused for a perspective that writes to a sink (Sink), and
// Promote is carried out by its workers: only its code can keep the application's tables
// equal to its models.
type Admin struct {
	store    *pgStore
	locker   locker.Locker
	instance uuid.UUID
}

// NewAdmin returns an Admin on pool. l is the locker the workers use (nil: none); like the
// worker's, it must keep its locks on the cursor rows (locker.CursorRowLocker). The Admin
// takes stream locks under its own new instance ID.
func NewAdmin(pool *pgxpool.Pool, l locker.Locker) (*Admin, error) {
	if pool == nil {
		return nil, fmt.Errorf("worker: admin: %w: pool is nil", locker.ErrInvalidArgument)
	}
	if l != nil && isNil(l) {
		return nil, fmt.Errorf("worker: admin: %w: locker is a nil %T: pass a locker, or nil for none", locker.ErrInvalidArgument, l)
	}
	if _, ok := l.(locker.CursorRowLocker); l != nil && !ok {
		return nil, fmt.Errorf("worker: admin: %w: locker is a %T, which does not keep its locks on the cursor rows (see locker.CursorRowLocker)", locker.ErrInvalidArgument, l)
	}
	id, err := uuid.NewV7()
	if err != nil {
		return nil, fmt.Errorf("worker: admin: %w", err)
	}
	return &Admin{store: newPGStore(pool, DefaultRetryBackoff, DefaultMaxRetryBackoff), locker: l, instance: id}, nil
}

// Purge is Worker.Purge from outside any worker: the pair is purged in every build of the
// perspective that is not retired.
func (a *Admin) Purge(ctx context.Context, streamID uuid.UUID, perspectiveName string) error {
	return a.eachBuild(ctx, streamID, perspectiveName, "purge", "purge it with Worker.Purge, in the application", func(k Pair, holder uuid.UUID) error {
		return a.store.Purge(ctx, k, holder)
	})
}

// Rebuild rebuilds one stream: it purges (streamID, perspectiveName) in every build of the
// perspective that is not retired and queues every stored event of the stream for it again,
// so that running workers rebuild the model from the start (readers meanwhile see no model
// for that stream). Each build's purge and queueing commit together. It returns the number
// of events queued. To rebuild a whole perspective without a gap, use RebuildPerspective.
func (a *Admin) Rebuild(ctx context.Context, streamID uuid.UUID, perspectiveName string) (int64, error) {
	var queued int64
	err := a.eachBuild(ctx, streamID, perspectiveName, "rebuild",
		"rebuild the whole perspective (RebuildPerspective: its workers build it beside the active version)", func(k Pair, holder uuid.UUID) error {
			var n int64
			err := a.store.inTx(ctx, func(tx pgx.Tx, q *db.Queries) error {
				if err := a.store.purgeIn(ctx, tx, q, k, holder); err != nil {
					return err
				}
				var err error
				n, err = queueStream(ctx, q, k, uuid.Nil)
				if err != nil {
					return fmt.Errorf("queue the stream: %w", err)
				}
				return nil
			})
			if err == nil {
				queued += n
			}
			return err
		})
	return queued, err
}

// RebuildPerspective starts a new build of the perspective's active version beside it: the
// workers running that version catch it up from the event store and promote it when it has
// caught up (readers see the active build's models meanwhile). When such a build is already
// under way it returns that one. created says whether it started one.
func (a *Admin) RebuildPerspective(ctx context.Context, perspectiveName string) (b Build, created bool, err error) {
	if err := locker.ValidatePerspectiveName(perspectiveName); err != nil {
		return Build{}, false, fmt.Errorf("worker: rebuild: %w", err)
	}
	builds, nb, err := a.store.addBuild(ctx, perspectiveName, func(builds []Build) (*Build, error) {
		return planRebuild(perspectiveName, builds)
	})
	if err != nil {
		return Build{}, false, fmt.Errorf("worker: rebuild: %w", err)
	}
	if nb != nil {
		return *nb, true, nil
	}
	for _, b := range builds {
		if b.State == BuildBuilding {
			return b, false, nil
		}
	}
	return Build{}, false, fmt.Errorf("worker: rebuild: perspective %q has no build under way", perspectiveName)
}

// Promote makes version of the perspective active: its newest build, which must be
// building and caught up with the store (its queue may still be behind: the operator's
// call). The active build is retired. For a perspective that writes to a sink, whose
// Promoter only its workers run, it requests the promotion instead: the returned build is
// still building, with PromotionRequested, and the worker holding the version's promotion
// lease promotes it at its next look at the builds (within PollInterval).
func (a *Admin) Promote(ctx context.Context, perspectiveName string, version int) (Build, error) {
	if err := locker.ValidatePerspectiveName(perspectiveName); err != nil {
		return Build{}, fmt.Errorf("worker: promote: %w", err)
	}
	builds, err := a.store.Builds(ctx, []string{perspectiveName})
	if err != nil {
		return Build{}, fmt.Errorf("worker: promote: %w", err)
	}
	var cand, active *Build
	for i, b := range builds {
		if b.Version == version && b.State != BuildRetired {
			cand = &builds[i]
		}
		if b.State == BuildActive {
			active = &builds[i]
		}
	}
	switch {
	case len(builds) == 0:
		return Build{}, fmt.Errorf("worker: promote: %w: perspective %q is not registered", locker.ErrInvalidArgument, perspectiveName)
	case cand == nil:
		return Build{}, fmt.Errorf("worker: promote: %w: perspective %q has no build of version %d", locker.ErrInvalidArgument, perspectiveName, version)
	case cand.State == BuildActive:
		return *cand, fmt.Errorf("worker: promote: version %d of %q is already active", version, perspectiveName)
	case active != nil && olderBuild(*cand, *active):
		return *cand, fmt.Errorf("worker: promote: version %d of %q is older than its active version %d: versions only go up", version, perspectiveName, active.Version)
	case !cand.CatchUpDone:
		return *cand, fmt.Errorf("worker: promote: version %d of %q has not caught up with the event store yet (see: perspectives versions)", version, perspectiveName)
	}

	sink, err := a.store.q.PerspectiveSink(ctx, perspectiveName)
	if err != nil {
		return *cand, fmt.Errorf("worker: promote: %w", err)
	}
	if sink {
		// Only a worker runs the sink's Promoter in the promotion transaction: ask the
		// workers running the version to promote it.
		n, err := a.store.q.BuildRequestPromotion(ctx, cand.Key)
		if err != nil {
			return *cand, fmt.Errorf("worker: promote: %w", err)
		}
		if n == 0 {
			return *cand, fmt.Errorf("worker: promote: version %d of %q changed meanwhile; look again (perspectives versions)", version, perspectiveName)
		}
		cand.PromotionRequested = true
		return *cand, nil
	}
	ok, err := a.store.Promote(ctx, perspectiveName, cand.Key, true, LeaderLease{})
	if err != nil {
		return *cand, fmt.Errorf("worker: promote: %w", err)
	}
	if !ok {
		return *cand, fmt.Errorf("worker: promote: version %d of %q changed meanwhile; look again (perspectives versions)", version, perspectiveName)
	}
	cand.State = BuildActive
	return *cand, nil
}

// refuseSink refuses op on a perspective that writes to a sink (worker.Sink): the
// application's tables it writes follow its models only through its code, which an Admin
// does not run. instead says what to do.
func (a *Admin) refuseSink(ctx context.Context, perspectiveName, op, instead string) error {
	sink, err := a.store.q.PerspectiveSink(ctx, perspectiveName)
	if err != nil {
		return fmt.Errorf("worker: %s: %w", op, err)
	}
	if sink {
		return fmt.Errorf("worker: %s: %w: perspective %q writes to a sink (the application's own tables), which only its code can keep equal to its models: %s",
			op, locker.ErrInvalidArgument, perspectiveName, instead)
	}
	return nil
}

// Versions is every build of every perspective with its progress and queue, and the size
// of the event store a catch-up reads.
type Versions struct {
	Builds       []BuildStatus
	StoredEvents int64 // events in the store
	Estimated    bool  // StoredEvents is the planner's estimate (a large store is not counted)
}

// exactCountBelow is the estimated store size up to which Versions counts the events.
const exactCountBelow = 5_000_000

// Versions reports every build of every perspective with its progress and queue.
func (a *Admin) Versions(ctx context.Context) (Versions, error) {
	var v Versions
	var err error
	if v.Builds, err = a.store.Status(ctx); err != nil {
		return v, fmt.Errorf("worker: versions: %w", err)
	}
	if v.StoredEvents, err = a.store.q.EventStoreEstimate(ctx); err != nil {
		return v, fmt.Errorf("worker: versions: %w", err)
	}
	v.Estimated = v.StoredEvents >= exactCountBelow
	if !v.Estimated {
		if v.StoredEvents, err = a.store.q.EventCount(ctx); err != nil {
			return v, fmt.Errorf("worker: versions: %w", err)
		}
	}
	return v, nil
}

// eachBuild runs fn on the pair (streamID, build) of every build of the perspective that is
// not retired, each under the stream lock (reason purge) when the Admin has a locker; fn gets
// the holder to fence its write with (uuid.Nil without a locker). It refuses a perspective
// that writes to a sink, saying what to do instead (refuseSink).
func (a *Admin) eachBuild(ctx context.Context, streamID uuid.UUID, perspectiveName, op, instead string, fn func(k Pair, holder uuid.UUID) error) error {
	if err := locker.ValidatePair(streamID, perspectiveName); err != nil {
		return fmt.Errorf("worker: %s: %w", op, err)
	}
	builds, err := a.store.Builds(ctx, []string{perspectiveName})
	if err != nil {
		return fmt.Errorf("worker: %s: %w", op, err)
	}
	if len(builds) == 0 {
		return fmt.Errorf("worker: %s: %w: perspective %q is not registered", op, locker.ErrInvalidArgument, perspectiveName)
	}
	if err := a.refuseSink(ctx, perspectiveName, op, instead); err != nil {
		return err
	}
	for _, b := range builds {
		if b.State == BuildRetired {
			continue
		}
		if err := a.withLock(ctx, Pair{Stream: streamID, Perspective: b.Key}, fn); err != nil {
			return fmt.Errorf("worker: %s: %s version %d: %w", op, perspectiveName, b.Version, err)
		}
	}
	return nil
}

// withLock runs fn on k under its stream lock when the Admin has a locker. A release that
// fails is part of its error (the lock lapses after LockTimeout; until then the workers leave
// the pair alone), whether fn succeeded or not. Once the lock is released, the workers are
// told when the pair is due (fn made it due while their claims skipped it), so that they
// claim it at once rather than at their next poll; a failure to tell them is part of the
// error too.
func (a *Admin) withLock(ctx context.Context, k Pair, fn func(k Pair, holder uuid.UUID) error) (err error) {
	if a.locker == nil {
		return fn(k, uuid.Nil)
	}
	ok, err := a.locker.TryAcquire(ctx, k.Stream, k.Perspective, a.instance, locker.ReasonPurge)
	if err != nil {
		err = fmt.Errorf("acquire stream lock: %w", err)
		if cutOff(ctx, err) {
			// It may have committed as the connection went or its context ended: released
			// rather than left to pause the pair until it lapses (fenced by this Admin's ID).
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), releaseTimeout)
			defer cancel()
			if rerr := a.locker.Release(rctx, k.Stream, k.Perspective, a.instance); rerr != nil {
				err = errors.Join(err, fmt.Errorf("release stream lock: %w", rerr))
			}
		}
		return err
	}
	if !ok {
		return fmt.Errorf("stream %s: %w", k.Stream, ErrLocked)
	}
	defer func() {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), releaseTimeout)
		defer cancel()
		if rerr := a.locker.Release(rctx, k.Stream, k.Perspective, a.instance); rerr != nil {
			err = errors.Join(err, fmt.Errorf("release stream lock: %w", rerr))
			return
		}
		if nerr := a.store.notifyIfDue(rctx, k); nerr != nil {
			err = errors.Join(err, fmt.Errorf("tell the workers the pair is due: %w", nerr))
		}
	}()
	return fn(k, a.instance)
}
