package worker

import (
	"context"
	"log/slog"
	"time"

	"github.com/google/uuid"

	"github.com/perspectives-go/perspectives/locker"
)

// Test-only access to the worker's internals, for the worker_test package.

// NewWithStore builds a worker on any Store (a mock in unit tests). Any Locker is
// accepted: the Store decides what fencing means.
func NewWithStore(s Store, cfg Config) (*Worker, error) {
	cfg, err := cfg.resolve()
	if err != nil {
		return nil, err
	}
	return newWorker(s, cfg)
}

// JobReport is what a job reported to the loop.
type JobReport struct {
	Next      []JobSpec // follow-ups
	Busy      []Pair    // skipped by the next claim
	Contended []Pair    // stream lock refused
}

// JobSpec is one job: its kind ("apply", "rewind", "bootstrap") and pairs.
type JobSpec struct {
	Kind  string
	Pairs []Pair
}

func report(r jobResult) JobReport {
	out := JobReport{Busy: r.busy, Contended: r.contended}
	for _, j := range r.next {
		out.Next = append(out.Next, JobSpec{Kind: j.kind.String(), Pairs: j.pairs})
	}
	return out
}

// RunApply runs the normal path for pairs as one job, as a slot of the loop would.
func (w *Worker) RunApply(ctx context.Context, pairs ...Pair) JobReport {
	return report(w.runJob(ctx, job{kind: jobApply, pairs: pairs}))
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

func (c *Coordinator) Size() int { return c.c.size() }

// CoordinatorSize is the number of live coordinator entries of w.
func (w *Worker) CoordinatorSize() int { return w.coord.size() }

// KeepAlive exposes the keepalive.
type KeepAlive struct{ ka *keepAlive }

// StartKeepAlive starts a keepalive for a lock acquired (sent) at acquired.
func StartKeepAlive(ctx context.Context, l locker.Locker, stream uuid.UUID, perspective string, instance uuid.UUID, opts locker.Options, acquired time.Time, log *slog.Logger) (context.Context, *KeepAlive) {
	c, ka := startKeepAlive(ctx, l, Pair{Stream: stream, Perspective: perspective}, instance, opts.WithDefaults(), acquired, log, keepAliveHooks{})
	return c, &KeepAlive{ka: ka}
}

func (k *KeepAlive) Stop() { k.ka.stop() }

// LeaseMargin is how long before its lease ends a holder stops trusting it.
func LeaseMargin(opts locker.Options) time.Duration { return leaseMargin(opts.WithDefaults()) }

// SnapshotsToDrop exposes the retention rule.
var SnapshotsToDrop = snapshotsToDrop
