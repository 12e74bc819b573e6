package worker

import (
	"context"
	"log/slog"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/perspectives-go/perspectives/db"
	"github.com/perspectives-go/perspectives/locker"
)

// Test-only access to the worker's internals, for the worker_test package.

// NewWithStore builds a worker on any Store (a mock in unit tests). Any Locker is
// accepted: the Store decides what fencing means. Until Start, the worker applies each
// perspective's first build of its version, active and caught up (its key is the
// perspective's name for version 1).
func NewWithStore(s Store, cfg Config) (*Worker, error) {
	cfg, err := cfg.resolve()
	if err != nil {
		return nil, err
	}
	w, err := newWorker(s, cfg)
	if err != nil {
		return nil, err
	}
	var builds []Build
	for _, p := range cfg.Perspectives {
		v := versionOf(p)
		builds = append(builds, Build{Key: buildKey(p.Name(), v, 1), Perspective: p.Name(), Version: v, N: 1, State: BuildActive, CatchUpDone: true})
	}
	w.adopt(builds)
	return w, nil
}

// BuildKey is the key of build n of version of the perspective name.
var BuildKey = buildKey

// PlanRegistration and PlanRebuild expose the build decisions.
var (
	PlanRegistration = planRegistration
	PlanRebuild      = planRebuild
	CaughtUp         = caughtUp
)

// RunCatchUp runs one catch-up page of build key as one job.
func (w *Worker) RunCatchUp(ctx context.Context, key string) JobReport {
	return report(w.runJob(ctx, job{kind: jobCatchUp, key: key}))
}

// JobReport is what a job reported to the loop.
type JobReport struct {
	Next      []JobSpec // follow-ups
	Busy      []Pair    // skipped by the next claim
	Contended []Pair    // stream lock refused
	CutOff    []Pair    // work cut off by a lost connection, left queued
}

// RunApplyStrict runs the normal path for pairs as one job in which strict pairs' lost
// connections count as their failures (see job.cutOffFails).
func (w *Worker) RunApplyStrict(ctx context.Context, strict []Pair, pairs ...Pair) JobReport {
	j := job{kind: jobApply, pairs: pairs, cutOffFails: map[Pair]bool{}}
	for _, p := range strict {
		j.cutOffFails[p] = true
	}
	return report(w.runJob(ctx, j))
}

// JobSpec is one job: its kind ("apply", "rewind", "bootstrap") and pairs.
type JobSpec struct {
	Kind  string
	Pairs []Pair
	Key   string // catch-up, promote: the build
}

func report(r jobResult) JobReport {
	out := JobReport{Busy: r.busy, Contended: r.contended, CutOff: r.cutOff}
	for _, j := range r.next {
		kind := [...]string{"apply", "rewind", "bootstrap", "catch-up", "promote", "cleanup", "forget"}[j.kind]
		out.Next = append(out.Next, JobSpec{Kind: kind, Pairs: j.pairs, Key: j.key})
	}
	return out
}

// RunApply runs the normal path for pairs as one job, as a slot of the loop would.
func (w *Worker) RunApply(ctx context.Context, pairs ...Pair) JobReport {
	return report(w.runJob(ctx, job{kind: jobApply, pairs: pairs}))
}

// RunClaimedApply runs the normal path for pairs as one job of a claim sent at claimed.
func (w *Worker) RunClaimedApply(ctx context.Context, claimed time.Time, pairs ...Pair) JobReport {
	return report(w.runJob(ctx, job{kind: jobApply, pairs: pairs, claimed: claimed}))
}

// RunRewind runs a rewind of p as one job.
func (w *Worker) RunRewind(ctx context.Context, p Pair) JobReport {
	return report(w.runJob(ctx, job{kind: jobRewind, pairs: []Pair{p}}))
}

// RunBootstrap runs a bootstrap of p as one job.
func (w *Worker) RunBootstrap(ctx context.Context, p Pair) JobReport {
	return report(w.runJob(ctx, job{kind: jobBootstrap, pairs: []Pair{p}}))
}

// ProcessPair runs the normal path for one pair and then, one after the other, every
// follow-up it leads to, as the loop would with nothing else to do.
func (w *Worker) ProcessPair(ctx context.Context, stream uuid.UUID, perspective string) {
	queue := []job{{kind: jobApply, pairs: []Pair{{Stream: stream, Perspective: perspective}}}}
	for len(queue) > 0 {
		r := w.runJob(ctx, queue[0])
		queue = append(queue[1:], r.next...)
	}
}

// Coordinator exposes the apply coordinator.
type Coordinator struct{ c *coordinator }

func NewCoordinator() *Coordinator { return &Coordinator{c: newCoordinator()} }

func (c *Coordinator) Lock(ctx context.Context, stream uuid.UUID, perspective string) (func(), error) {
	return c.c.lock(ctx, Pair{Stream: stream, Perspective: perspective})
}

func (c *Coordinator) TryLock(stream uuid.UUID, perspective string) (func(), bool) {
	return c.c.tryLock(Pair{Stream: stream, Perspective: perspective})
}

func (c *Coordinator) Size() int { return coordinatorSize(c.c) }

// CoordinatorSize is the number of live coordinator entries of w.
func (w *Worker) CoordinatorSize() int { return coordinatorSize(w.coord) }

// coordinatorSize is the number of live entries of c (held or awaited pairs).
func coordinatorSize(c *coordinator) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.entries)
}

// KeepAlive exposes the keepalive.
type KeepAlive struct{ ka *keepAlive }

// StartKeepAlive starts a keepalive for a lock acquired (sent) at acquired.
func StartKeepAlive(ctx context.Context, l locker.Locker, stream uuid.UUID, perspective string, instance uuid.UUID, opts locker.Options, acquired time.Time, log *slog.Logger) (context.Context, *KeepAlive) {
	c, ka := startKeepAlive(ctx, l, Pair{Stream: stream, Perspective: perspective}, instance, opts.WithDefaults(), acquired, log,
		[]any{slog.String("perspective", perspective), slog.String("stream", stream.String())}, keepAliveHooks{})
	return c, &KeepAlive{ka: ka}
}

func (k *KeepAlive) Stop() { k.ka.stop() }

// LeaseMargin is how long before its lease ends a holder stops trusting it.
func LeaseMargin(opts locker.Options) time.Duration { return leaseMargin(opts.WithDefaults()) }

// SnapshotsToDrop exposes the retention rule.
var SnapshotsToDrop = snapshotsToDrop

// NewPGStore is the worker's Store on pool (the SQL behind each method, for tests against
// PostgreSQL), with the failure backoff given.
func NewPGStore(pool *pgxpool.Pool, retryBase, retryMax time.Duration) Store {
	return newPGStore(pool, retryBase, retryMax)
}

// IsConnectionError is isConnectionError.
var IsConnectionError = isConnectionError

// PerspectiveError wraps err as an error of a perspective's Apply.
func PerspectiveError(err error) error { return perspectiveError{err} }

// GraceAfter is graceAfter: a context that ends grace after ctx ends.
var GraceAfter = graceAfter

// ReadAheadWith starts a catch-up read-ahead on w's store (a worker of New, started) whose
// statement is stmt; the channel is closed when it has ended (nil: the store reads nothing
// ahead now).
func ReadAheadWith(w *Worker, stmt func(ctx context.Context) error) <-chan struct{} {
	p := w.store.(*pgStore).readAheadWith("read-ahead test", db.CatchUpPageParams{}, func(ctx context.Context) ([]db.WhEventStore, error) {
		return nil, stmt(ctx)
	})
	if p == nil {
		return nil
	}
	return p.done
}

// CatchUpStreamShare is the most events of one stream a catch-up page applies.
const CatchUpStreamShare = catchUpStreamShare

// FailureLost is the action fail records for an operation whose stream lock was lost.
const FailureLost = failureLost

// QueueStream is queueStream: a stream queued for a pair in q's transaction, its due row held.
var QueueStream = queueStream
