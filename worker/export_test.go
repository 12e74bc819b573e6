package worker

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/google/uuid"

	"github.com/perspectives-go/perspectives/locker"
)

// Test-only access to the worker's internals, for the worker_test package.

// NewWithStore builds a worker on any Store (a mock in unit tests).
func NewWithStore(s Store, cfg Config) (*Worker, error) { return newWorker(s, cfg) }

// ProcessPair runs one pair's work exactly as one loop cycle would.
func (w *Worker) ProcessPair(ctx context.Context, stream uuid.UUID, perspective string) {
	w.process(ctx, pairKey{Stream: stream, Perspective: perspective})
}

// HeldLocks is the number of stream locks the worker records as held.
func (w *Worker) HeldLocks() int {
	w.heldMu.Lock()
	defer w.heldMu.Unlock()
	return len(w.held)
}

// Coordinator exposes the apply coordinator.
type Coordinator struct{ c *coordinator }

func NewCoordinator() *Coordinator { return &Coordinator{c: newCoordinator()} }

func (c *Coordinator) Lock(ctx context.Context, stream uuid.UUID, perspective string) (func(), error) {
	return c.c.lock(ctx, pairKey{Stream: stream, Perspective: perspective})
}

func (c *Coordinator) TryLock(stream uuid.UUID, perspective string) (func(), bool) {
	return c.c.tryLock(pairKey{Stream: stream, Perspective: perspective})
}

func (c *Coordinator) Size() int { return c.c.size() }

// WorkerCoordinatorSize is the number of live coordinator entries of w.
func (w *Worker) CoordinatorSize() int { return w.coord.size() }

// KeepAlive exposes the keepalive.
type KeepAlive struct{ ka *keepAlive }

func StartKeepAlive(ctx context.Context, l locker.Locker, stream uuid.UUID, perspective string, instance uuid.UUID, interval time.Duration, log *slog.Logger) (context.Context, *KeepAlive) {
	c, ka := startKeepAlive(ctx, l, pairKey{Stream: stream, Perspective: perspective}, instance, interval, log, keepAliveHooks{})
	return c, &KeepAlive{ka: ka}
}

func (k *KeepAlive) Stop() { k.ka.stop() }

// SnapshotsToDrop exposes the retention rule.
var SnapshotsToDrop = snapshotsToDrop

// ProcessGroup runs the pairs (stream, perspective) of streams as one group, exactly as a
// dispatched slot would while every other slot is busy (so its follow-ups run in turn, in
// its own slot), and returns the streams in the order their work finished.
func (w *Worker) ProcessGroup(ctx context.Context, perspective string, streams ...uuid.UUID) []uuid.UUID {
	for range cap(w.slots) {
		w.slots <- struct{}{}
	}
	defer func() {
		for range cap(w.slots) {
			<-w.slots
		}
	}()
	return w.ProcessGroupWithFreeSlots(ctx, perspective, streams...)
}

// ProcessGroupWithFreeSlots is ProcessGroup with the worker's free slots left free for
// the group's follow-ups to take; it returns when every follow-up is done.
func (w *Worker) ProcessGroupWithFreeSlots(ctx context.Context, perspective string, streams ...uuid.UUID) []uuid.UUID {
	keys := make([]pairKey, len(streams))
	for i, s := range streams {
		keys[i] = pairKey{Stream: s, Perspective: perspective}
	}
	var mu sync.Mutex
	var order []uuid.UUID
	w.jobs.Add(1) // the group's own job, as dispatch counts it
	w.processGroup(ctx, keys, func(k pairKey) {
		mu.Lock()
		defer mu.Unlock()
		order = append(order, k.Stream)
	})
	w.jobs.Done()
	w.jobs.Wait()
	return order
}

// ClaimExclusions is what the next claim would skip (and consumes the one-claim skips).
func (w *Worker) ClaimExclusions() []string { return w.claimExclusions() }
