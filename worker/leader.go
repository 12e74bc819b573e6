package worker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/perspectives-go/perspectives/db"
)

// The leader leases. Each periodic maintenance service runs on one instance at a time: the
// one holding the service's lease in wh_leader (queries/leader.sql). An instance attempts
// its leases at Start and every KeepAliveInterval (taking those that are free or expired,
// renewing its own for LockTimeout, on the database clock), trusts a lease only until
// LockTimeout less leaseMargin after the attempt that won it was sent, and resigns them at
// Stop, so that the others take over at their next attempt; a killed holder's leases are
// taken over once they expire. Every maintenance write is fenced: it commits only while its
// instance still holds the unexpired lease (LeaderHold, in its own transaction).
//
// The leases are per scope, so that a service runs on an instance that has what it needs:
// forgetting gone instances on any one instance; the cleanup of a perspective's retired
// builds on one instance running the perspective; the promotion checks of a version's builds
// on one instance running that version (ManualPromotion is that instance's).

// ErrNotLeader is a maintenance write refused because its instance does not hold the leader
// lease it was fenced by (it lapsed, or another instance took it over): nothing was written.
var ErrNotLeader = errors.New("this instance does not hold the leader lease")

// LeaderLease names the leader lease a maintenance write is fenced by: it commits only
// while Holder holds the unexpired lease Name. The zero LeaderLease fences nothing (an
// operator's action, such as Admin.Promote).
type LeaderLease struct {
	Name   string
	Holder uuid.UUID
}

// leaseInstances is the lease of forgetting gone instances.
const leaseInstances = "instances"

// leaseCleanup is the lease of the cleanup of the perspective's retired builds.
func leaseCleanup(perspective string) string { return "cleanup:" + perspective }

// leasePromotion is the lease of the promotion checks of the builds of a version of the
// perspective.
func leasePromotion(perspective string, version int) string {
	return fmt.Sprintf("promotion:%s@v%d", perspective, version)
}

// leaseNames is every lease an instance running perspectives attempts, sorted.
func leaseNames(perspectives []PerspectiveVersion) []string {
	names := []string{leaseInstances}
	for _, p := range perspectives {
		names = append(names, leaseCleanup(p.Name), leasePromotion(p.Name, p.Version))
	}
	slices.Sort(names)
	return slices.Compact(names)
}

// leaderStore is where the leases are kept: the pgStore. A Store without it (a unit test's
// mock) has no other instance to share the maintenance with: the worker holds every lease.
type leaderStore interface {
	// leaderAttempt takes the named leases that are free or expired and renews those holder
	// holds, for ttl from now (database clock); it returns the names holder holds.
	leaderAttempt(ctx context.Context, names []string, holder uuid.UUID, ttl time.Duration) ([]string, error)
	// leaderResign deletes the named leases holder holds.
	leaderResign(ctx context.Context, names []string, holder uuid.UUID) error
}

// elector attempts an instance's leases every interval until stopped, and says which it
// holds. With no store it holds every lease.
type elector struct {
	store  leaderStore
	names  []string
	holder uuid.UUID
	ttl    time.Duration // how long a lease lasts after an attempt
	every  time.Duration // how often it attempts (well within ttl)
	margin time.Duration // trusted until ttl less this after the attempt was sent
	log    *slog.Logger
	gained func() // called when an attempt won a lease this instance did not hold

	mu      sync.Mutex
	until   map[string]time.Time // the leases held, each trusted until then (local clock)
	failing bool                 // the last attempt failed

	svc service // the attempts after the first
}

// startElector attempts the leases at once (with ctx, bounded by every and by
// heartbeatTimeout: Start does not wait long for it), then every every in the background
// (a service) until stop; with no store it holds every lease and runs nothing.
func startElector(ctx context.Context, store leaderStore, names []string, holder uuid.UUID, ttl, every, margin time.Duration, log *slog.Logger, gained func()) *elector {
	e := &elector{store: store, names: names, holder: holder, ttl: ttl, every: every, margin: margin, log: log,
		gained: gained, until: map[string]time.Time{}}
	if store == nil {
		return e
	}
	e.attempt(ctx, min(every, heartbeatTimeout))
	_ = e.svc.Start(ctx) // a fresh service: it starts
	e.svc.Go(e.run)
	return e
}

// holds says whether the instance holds the lease name and may trust it now.
func (e *elector) holds(name string) bool {
	if e.store == nil {
		return true
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	return time.Now().Before(e.until[name])
}

// fence is the LeaderLease a write under the lease name is fenced by (none without a store).
func (e *elector) fence(name string) LeaderLease {
	if e.store == nil {
		return LeaderLease{}
	}
	return LeaderLease{Name: name, Holder: e.holder}
}

// run attempts the leases every every until stopping ends; an attempt under way is let
// finish (bounded by every) unless ctx ends.
func (e *elector) run(ctx, stopping context.Context) {
	tick := time.NewTicker(e.every)
	defer tick.Stop()
	for {
		select {
		case <-stopping.Done():
			return
		case <-tick.C:
			e.attempt(ctx, e.every)
		}
	}
}

// attempt attempts the leases once, bounded by bound. A lease won is trusted until ttl less
// margin after the attempt was sent; a failed attempt changes nothing (the leases held lapse
// at their deadlines unless a later attempt renews them).
func (e *elector) attempt(ctx context.Context, bound time.Duration) {
	sent := time.Now()
	actx, cancel := context.WithTimeout(ctx, bound)
	held, err := e.store.leaderAttempt(actx, e.names, e.holder, e.ttl)
	cancel()
	e.mu.Lock()
	was := e.failing
	e.failing = err != nil
	if err != nil {
		e.mu.Unlock()
		if !was {
			e.log.Warn("leader lease attempt failed; retried every KeepAliveInterval (maintenance waits meanwhile)",
				slog.Any("error", err))
		} else {
			e.log.Debug("leader lease attempt failed", slog.Any("error", err))
		}
		return
	}
	now, until := time.Now(), sent.Add(e.ttl-e.margin)
	var gained, lost []string
	for _, name := range held {
		if !now.Before(e.until[name]) {
			gained = append(gained, name)
		}
		e.until[name] = until
	}
	for name, t := range e.until {
		if !slices.Contains(held, name) {
			if now.Before(t) {
				lost = append(lost, name)
			}
			delete(e.until, name)
		}
	}
	e.mu.Unlock()
	if was {
		e.log.Info("leader lease attempt succeeded again")
	}
	if len(gained) > 0 {
		slices.Sort(gained)
		e.log.Info("leader lease won: this instance runs its maintenance", slog.Any("leases", gained))
		if e.gained != nil {
			e.gained()
		}
	}
	if len(lost) > 0 {
		slices.Sort(lost)
		e.log.Warn("leader lease lost to another instance", slog.Any("leases", lost))
	}
}

// stop ends the attempts (one under way is cancelled when ctx ends), stops trusting every
// lease, and resigns them with ctx, bounded by releaseTimeout: the other instances take them
// over at their next attempt.
func (e *elector) stop(ctx context.Context) {
	if e.store == nil {
		return
	}
	_ = e.svc.Stop(ctx) // its only error is ctx's end, which Worker.Stop reports
	e.mu.Lock()
	clear(e.until)
	e.mu.Unlock()
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), releaseTimeout)
	defer cancel()
	if err := e.store.leaderResign(rctx, e.names, e.holder); err != nil {
		e.log.Warn("leader leases not resigned at stop; the other instances take them over when they expire",
			slog.Any("error", err), slog.Duration("lease", e.ttl))
	}
}

var _ leaderStore = (*pgStore)(nil)

func (s *pgStore) leaderAttempt(ctx context.Context, names []string, holder uuid.UUID, ttl time.Duration) ([]string, error) {
	return s.q.LeaderAttempt(ctx, db.LeaderAttemptParams{LeaderID: holder, TtlSeconds: ttl.Seconds(), Names: names})
}

func (s *pgStore) leaderResign(ctx context.Context, names []string, holder uuid.UUID) error {
	_, err := s.q.LeaderResign(ctx, db.LeaderResignParams{LeaderID: holder, Names: names})
	return err
}

// leaderHold is the fence of a maintenance write, first in its transaction q: ErrNotLeader
// unless f.Holder holds the unexpired lease f.Name (whose row it then locks until the
// transaction ends). The zero LeaderLease passes.
func leaderHold(ctx context.Context, q *db.Queries, f LeaderLease) error {
	if f.Name == "" {
		return nil
	}
	_, err := q.LeaderHold(ctx, db.LeaderHoldParams{Name: f.Name, LeaderID: f.Holder})
	if errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("%w %q", ErrNotLeader, f.Name)
	}
	return err
}
