// Package worker applies stored events to perspectives (read models), in event-ID order,
// on any number of instances sharing one PostgreSQL database.
//
// A late-arriving event (older than a pair's cursor) makes the worker rewind that
// (stream, perspective): under a stream lock it restores the newest snapshot before the
// event, replays the stream and commits under a fencing check. Normal application of a
// locked pair pauses on every instance; its events keep queueing and are applied after.
package worker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/metric"

	"github.com/perspectives-go/perspectives/db"
	"github.com/perspectives-go/perspectives/locker"
)

// releaseTimeout bounds the fresh context used to release a stream lock.
const releaseTimeout = 5 * time.Second

// Worker applies queued events to its perspectives. Create it with New, run it with Start
// and Stop.
type Worker struct {
	cfg    Config
	store  Store
	locker locker.Locker
	persp  map[string]Perspective
	names  []string
	coord  *coordinator
	log    *slog.Logger
	tel    *telemetry
	gauges metric.Registration // queue gauges, while started

	contendedMu sync.Mutex
	contended   map[pairKey]time.Time // first refused acquire of a pair still contended

	slots      chan struct{} // one token per group being processed (Concurrency)
	inflightMu sync.Mutex
	inflight   map[pairKey]bool // pairs being processed now: not claimed again meanwhile
	skip       []pairKey        // pairs found held by another transaction: not claimed by the next claim
	jobs       sync.WaitGroup   // the goroutines processing groups

	mu      sync.Mutex
	started bool
	stopped bool
	cancel  context.CancelFunc
	done    chan struct{} // closed when the loop and the listener have returned
	wake    chan struct{}

	heldMu sync.Mutex
	held   map[pairKey]struct{} // stream locks this instance holds now
}

// New validates cfg (including LockOptions) and returns a worker on pool. It does not
// touch the database; Start does.
func New(pool *pgxpool.Pool, cfg Config) (*Worker, error) {
	if pool == nil {
		return nil, fmt.Errorf("worker: %w: pool is nil", ErrInvalidConfig)
	}
	return newWorker(newPGStore(pool), cfg)
}

func newWorker(store Store, cfg Config) (*Worker, error) {
	cfg, err := cfg.resolve()
	if err != nil {
		return nil, err
	}
	w := &Worker{
		cfg:    cfg,
		store:  store,
		locker: cfg.Locker,
		persp:  make(map[string]Perspective, len(cfg.Perspectives)),
		coord:  newCoordinator(),
		log:    cfg.Logger.With(slog.String("instance", cfg.InstanceID.String())),
		wake:   make(chan struct{}, 1),
		held:   make(map[pairKey]struct{}),

		contended: make(map[pairKey]time.Time),
		inflight:  make(map[pairKey]bool),
	}
	if w.tel, err = newTelemetry(cfg.MeterProvider, cfg.TracerProvider); err != nil {
		return nil, err
	}
	w.slots = make(chan struct{}, cfg.Concurrency)
	for _, p := range cfg.Perspectives {
		w.persp[p.Name()] = p
		w.names = append(w.names, p.Name())
	}
	return w, nil
}

// InstanceID is this worker's identity as a stream-lock holder.
func (w *Worker) InstanceID() uuid.UUID { return w.cfg.InstanceID }

// Start registers the perspectives (a newly registered one gets every stored event queued,
// so it catches up) and starts the loop in the background. It returns once registration is
// done; the loop is not tied to ctx (Stop ends it).
func (w *Worker) Start(ctx context.Context) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.stopped {
		return errors.New("worker: start: worker was stopped")
	}
	if w.started {
		return errors.New("worker: start: already started")
	}
	for _, name := range w.names {
		if err := w.register(ctx, name); err != nil {
			return err
		}
	}
	gauges, err := w.tel.observeQueue(w.store, w.names)
	if err != nil {
		return fmt.Errorf("worker: start: %w", err)
	}
	w.gauges = gauges
	loopCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	w.cancel = cancel
	w.done = make(chan struct{})
	w.started = true
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); w.loop(loopCtx) }()
	if !w.cfg.PollOnly {
		wg.Add(1)
		go func() { defer wg.Done(); w.listen(loopCtx) }()
	}
	go func() { wg.Wait(); close(w.done) }()
	w.log.Info("perspective worker started", slog.Any("perspectives", w.names))
	return nil
}

// register records a perspective and, the first time, enqueues every stored event for it.
// It holds the exclusive side of the append lock so that no Append commits in between.
func (w *Worker) register(ctx context.Context, name string) error {
	err := w.store.InTx(ctx, func(q db.Querier) error {
		if err := q.RegisterLock(ctx); err != nil {
			return err
		}
		n, err := q.PerspectiveRegister(ctx, name)
		if err != nil || n == 0 {
			return err
		}
		queued, err := q.PerspectiveEnqueueBacklog(ctx, name)
		if err != nil {
			return err
		}
		w.log.Info("perspective registered", slog.String("perspective", name), slog.Int64("backlog", queued))
		return nil
	})
	if err != nil {
		return fmt.Errorf("worker: register perspective %q: %w", name, err)
	}
	return nil
}

// Stop stops the loop, waits for the operation in progress to end (or ctx), and releases
// every stream lock this instance still holds. It is idempotent.
func (w *Worker) Stop(ctx context.Context) error {
	w.mu.Lock()
	if w.stopped || !w.started {
		w.stopped = true
		w.mu.Unlock()
		return nil
	}
	w.stopped = true
	w.cancel()
	done := w.done
	w.mu.Unlock()

	var err error
	select {
	case <-done:
	case <-ctx.Done():
		err = fmt.Errorf("worker: stop: %w", ctx.Err())
	}
	w.releaseAll()
	if w.gauges != nil {
		_ = w.gauges.Unregister()
	}
	w.log.Info("perspective worker stopped")
	return err
}

// Notify wakes the loop at once, as when new events are known to be queued.
func (w *Worker) Notify() {
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

// loop polls when woken (a notification, a finished pair) or every PollInterval, and
// dispatches due pairs to the free slots.
func (w *Worker) loop(ctx context.Context) {
	defer w.jobs.Wait() // the pairs in flight end with ctx
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-timer.C:
		case <-w.wake:
		}
		if w.dispatch(ctx) {
			timer.Reset(0)
		} else {
			timer.Reset(w.cfg.PollInterval)
		}
	}
}

// listen wakes the loop on every committed Append, resubscribing after a failure; polling
// covers whatever it misses.
func (w *Worker) listen(ctx context.Context) {
	first := min(w.cfg.PollInterval, time.Second)
	wait := first
	for {
		started := time.Now()
		err := w.store.Listen(ctx, w.Notify)
		if ctx.Err() != nil {
			return
		}
		if time.Since(started) > time.Minute {
			wait = first // it had been working: not a persistent failure
		}
		w.log.Warn("queue notifications interrupted; polling until resubscribed",
			slog.Any("error", err), slog.Duration("retry_in", wait))
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
		wait = min(2*wait, 30*time.Second)
	}
}

// dispatch polls the queue once, skipping the pairs in flight, and hands the due pairs to
// the free slots (Concurrency), in groups of at most GroupSize pairs that each apply in one
// transaction. It never waits for a group to finish, so one long rewind occupies one slot
// while the other slots go on. Every freed slot wakes the loop to poll again: for what this
// poll left behind, and for events queued meanwhile for the pairs that were in flight (the
// poll skipped them, and their Append's wake-up came while they were). It reports whether
// to poll again at once (the poll was full and slots are free).
func (w *Worker) dispatch(ctx context.Context) bool {
	free := cap(w.slots) - len(w.slots)
	if free <= 0 {
		return false // every slot busy: poll when one frees
	}
	limit := free * w.cfg.GroupSize
	pairs, err := w.claim(ctx, limit)
	if err != nil {
		if ctx.Err() == nil {
			w.log.Error("poll queue failed", slog.Any("error", err))
		}
		return false
	}
	full := len(pairs) >= limit
	for _, group := range splitGroups(pairs, free) {
		if !w.trySlot() { // a group's follow-up may have taken one meanwhile
			return false // no free slot: the rest is claimed again when one frees
		}
		w.inflightMu.Lock()
		for _, k := range group {
			w.inflight[k] = true
		}
		w.inflightMu.Unlock()
		w.runInSlot(func() {
			w.processGroup(ctx, group, w.finished) // finishes every pair, some in follow-up jobs
		})
	}
	return full && len(w.slots) < cap(w.slots)
}

// trySlot takes a free Concurrency slot, if there is one.
func (w *Worker) trySlot() bool {
	select {
	case w.slots <- struct{}{}:
		return true
	default:
		return false
	}
}

// runInSlot runs fn as a job (w.jobs) in a slot the caller took with trySlot, and frees
// the slot when fn returns. The loop, and a job that is itself counted, may call it.
func (w *Worker) runInSlot(fn func()) {
	w.jobs.Add(1)
	go func() {
		defer w.releaseSlot()
		fn()
	}()
}

// releaseSlot frees a slot taken for a job counted in w.jobs, and wakes the loop to fill it
// (see dispatch).
func (w *Worker) releaseSlot() {
	<-w.slots
	w.jobs.Done()
	w.Notify()
}

// splitGroups divides pairs into at most n groups of nearly equal size, in order.
func splitGroups(pairs []pairKey, n int) [][]pairKey {
	if len(pairs) == 0 || n <= 0 {
		return nil
	}
	n = min(n, len(pairs))
	size := (len(pairs) + n - 1) / n
	groups := make([][]pairKey, 0, n)
	for len(pairs) > 0 {
		m := min(size, len(pairs))
		groups = append(groups, pairs[:m:m])
		pairs = pairs[m:]
	}
	return groups
}

// finished marks k as no longer in flight, so that the claim may take it again.
func (w *Worker) finished(k pairKey) {
	w.inflightMu.Lock()
	delete(w.inflight, k)
	w.inflightMu.Unlock()
}

// skipNextClaim keeps keys, pairs whose cursor row another transaction held (another
// instance applying them, most likely), out of the next claim only, so that this instance
// turns to other pairs instead of claiming the same ones again while that transaction runs.
func (w *Worker) skipNextClaim(keys []pairKey) {
	if len(keys) == 0 {
		return
	}
	w.inflightMu.Lock()
	w.skip = append(w.skip, keys...)
	w.inflightMu.Unlock()
}

// claimExclusions lists the pairs the claim must skip, as 'stream/perspective': those in
// flight, and those noted by skipNextClaim since the last claim (which it forgets).
func (w *Worker) claimExclusions() []string {
	w.inflightMu.Lock()
	defer w.inflightMu.Unlock()
	out := make([]string, 0, len(w.inflight)+len(w.skip))
	for k := range w.inflight {
		out = append(out, k.Stream.String()+"/"+k.Perspective)
	}
	for _, k := range w.skip {
		if !w.inflight[k] {
			out = append(out, k.Stream.String()+"/"+k.Perspective)
		}
	}
	w.skip = w.skip[:0]
	return out
}

// claim returns up to limit due pairs, each once, the pair with the oldest due row first.
// It passes at most enough queued groups for the pairs it skips and twice the pairs it wants,
// so it stays cheap when a few pairs have many separately queued events; pairs beyond that
// are claimed as the head of the queue drains.
func (w *Worker) claim(ctx context.Context, limit int) ([]pairKey, error) {
	skip := w.claimExclusions()
	due, err := w.store.QueueDuePairs(ctx, db.QueueDuePairsParams{
		InstanceID:       w.cfg.InstanceID,
		PerspectiveNames: w.names,
		BusyPairs:        skip,
		PairLimit:        int32(limit),
		MaxSteps:         int32(len(skip) + 2*limit),
	})
	if err != nil {
		return nil, err
	}
	pairs := make([]pairKey, len(due))
	for i, r := range due {
		pairs[i] = pairKey{Stream: r.StreamID, Perspective: r.PerspectiveName}
	}
	return pairs, nil
}

// process runs one pair's work under the apply coordinator, isolating its failures.
func (w *Worker) process(ctx context.Context, k pairKey) {
	persp := w.persp[k.Perspective]
	if persp == nil {
		return
	}
	release, err := w.coord.lock(ctx, k)
	if err != nil {
		return
	}
	defer release()
	w.runPair(ctx, k, func() error { return w.processPair(ctx, k, persp) })
}

// runPair runs fn, work on k, recording its error or panic as k's failure.
func (w *Worker) runPair(ctx context.Context, k pairKey, fn func() error) {
	if err := w.guard(k, fn); err != nil {
		w.fail(ctx, k, err)
	}
}

// guard runs fn and turns a panic into an error.
func (w *Worker) guard(k pairKey, fn func() error) (err error) {
	defer func() {
		if r := recover(); r != nil {
			w.log.Error("panic while processing pair",
				slog.String("perspective", k.Perspective), slog.String("stream", k.Stream.String()),
				slog.Any("panic", r), slog.String("stack", string(debug.Stack())))
			err = fmt.Errorf("panic: %v", r)
		}
	}()
	return fn()
}

// processPair runs the normal path for k alone, and what it finds necessary.
func (w *Worker) processPair(ctx context.Context, k pairKey, persp Perspective) error {
	res, err := w.applyNormal(ctx, k, persp)
	if err != nil {
		return err
	}
	return w.continuePair(ctx, k, persp, res)
}

// continuePair runs what the normal path found necessary: a rewind, or a bootstrap and the
// normal path again.
func (w *Worker) continuePair(ctx context.Context, k pairKey, persp Perspective, res normalResult) error {
	switch {
	case res.rewindFrom != uuid.Nil:
		return w.rewind(ctx, k, persp, res.rewindFrom)
	case res.needsBootstrap:
		if err := w.bootstrap(ctx, k); err != nil {
			return err
		}
		_, err := w.applyNormal(ctx, k, persp)
		return err
	}
	return nil
}

// fail records a failed operation on the pair's cursor and queue rows (retried with backoff),
// unless it is a shutdown or a lost race that the next cycle retries anyway.
func (w *Worker) fail(ctx context.Context, k pairKey, cause error) {
	attrs := []any{slog.String("perspective", k.Perspective), slog.String("stream", k.Stream.String()), slog.Any("error", cause)}
	if ctx.Err() != nil {
		w.log.Info("operation interrupted by shutdown", attrs...)
		return
	}
	if errors.Is(cause, ErrLockLost) || errors.Is(cause, errCursorMoved) {
		w.log.Warn("operation refused at commit; will retry", attrs...)
		return
	}
	w.log.Error("processing failed; will retry with backoff", attrs...)
	err := w.store.InTx(ctx, func(q db.Querier) error {
		return w.markFailed(ctx, q, k, cause)
	})
	if err != nil && ctx.Err() == nil {
		w.log.Error("recording failure failed", append(attrs, slog.Any("record_error", err))...)
	}
}

// markFailed records cause on the cursor and every queued row of k. It runs in a
// transaction; it ensures the cursor row exists.
func (w *Worker) markFailed(ctx context.Context, q db.Querier, k pairKey, cause error) error {
	if err := q.CursorEnsure(ctx, db.CursorEnsureParams{StreamID: k.Stream, PerspectiveName: k.Perspective}); err != nil {
		return err
	}
	cur, err := q.CursorLock(ctx, db.CursorLockParams{StreamID: k.Stream, PerspectiveName: k.Perspective})
	if err != nil {
		return err
	}
	w.tel.applyErrors.Add(ctx, 1, perspAttrs(k))
	msg := truncate(cause.Error(), 2000)
	backoff := w.backoff(int(cur.Attempts))
	row, err := q.CursorMarkFailed(ctx, db.CursorMarkFailedParams{
		StreamID:        k.Stream,
		PerspectiveName: k.Perspective,
		LastError:       &msg,
		BackoffSeconds:  backoff.Seconds(),
	})
	if err != nil {
		return err
	}
	_, err = q.QueueMarkFailed(ctx, db.QueueMarkFailedParams{
		StreamID:        k.Stream,
		PerspectiveName: k.Perspective,
		LastError:       &msg,
		NextAttemptAt:   row.NextAttemptAt,
	})
	return err
}

// backoff is RetryBackoff doubled per earlier attempt, capped at MaxRetryBackoff.
func (w *Worker) backoff(previousAttempts int) time.Duration {
	d := w.cfg.RetryBackoff
	for i := 0; i < previousAttempts && d < w.cfg.MaxRetryBackoff; i++ {
		d *= 2
	}
	return min(d, w.cfg.MaxRetryBackoff)
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n]
}

// acquirer is implemented by lockers that report takeovers (locker.Postgres).
type acquirer interface {
	Acquire(ctx context.Context, streamID uuid.UUID, perspectiveName string, instanceID uuid.UUID, reason locker.Reason) (locker.AcquireResult, error)
}

// acquire takes the stream lock for reason when a locker is configured. It returns whether
// the lock is held, and the function that releases it (always safe to call).
func (w *Worker) acquire(ctx context.Context, k pairKey, reason locker.Reason) (bool, func(), error) {
	if w.locker == nil {
		return false, func() {}, nil
	}
	var res locker.AcquireResult
	var err error
	if a, ok := w.locker.(acquirer); ok {
		res, err = a.Acquire(ctx, k.Stream, k.Perspective, w.cfg.InstanceID, reason)
	} else {
		res.Acquired, err = w.locker.TryAcquire(ctx, k.Stream, k.Perspective, w.cfg.InstanceID, reason)
	}
	if err != nil {
		return false, func() {}, err
	}
	attrs := lockAttrs(k, reason)
	if !res.Acquired {
		w.tel.lockContended.Add(ctx, 1, attrs)
		w.noteContention(k, reason)
		return false, func() {}, nil
	}
	w.clearContention(k)
	w.tel.lockAcquired.Add(ctx, 1, attrs)
	if res.TookOver {
		w.tel.lockTakeovers.Add(ctx, 1, attrs)
		w.log.Info("took over an expired stream lock", slog.String("perspective", k.Perspective),
			slog.String("stream", k.Stream.String()), slog.String("reason", string(reason)))
	}
	w.heldMu.Lock()
	w.held[k] = struct{}{}
	w.heldMu.Unlock()
	since := time.Now()
	var once sync.Once
	return true, func() {
		once.Do(func() {
			if w.releaseLock(ctx, k) {
				w.tel.lockReleased.Add(context.WithoutCancel(ctx), 1, attrs)
			}
			w.tel.lockHold.Record(context.WithoutCancel(ctx), time.Since(since).Seconds(), attrs)
		})
	}, nil
}

// noteContention remembers when a pair was first found locked by another instance and
// warns when that lasts longer than LockTimeout.
func (w *Worker) noteContention(k pairKey, reason locker.Reason) {
	w.contendedMu.Lock()
	first, seen := w.contended[k]
	if !seen {
		w.contended[k] = time.Now()
	}
	w.contendedMu.Unlock()
	if seen && time.Since(first) > w.cfg.LockOptions.LockTimeout {
		w.log.Warn("stream lock contended for longer than LockTimeout",
			slog.String("perspective", k.Perspective), slog.String("stream", k.Stream.String()),
			slog.String("reason", string(reason)), slog.Duration("duration", time.Since(first)))
	}
}

func (w *Worker) clearContention(k pairKey) {
	w.contendedMu.Lock()
	delete(w.contended, k)
	w.contendedMu.Unlock()
}

// releaseLock releases k with a fresh short context, so that it happens even when the
// operation's context is cancelled (shutdown, lost lock). It reports whether it did.
func (w *Worker) releaseLock(ctx context.Context, k pairKey) bool {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), releaseTimeout)
	defer cancel()
	if err := w.locker.Release(rctx, k.Stream, k.Perspective, w.cfg.InstanceID); err != nil {
		w.log.Warn("stream lock release failed; it will expire",
			slog.String("perspective", k.Perspective), slog.String("stream", k.Stream.String()), slog.Any("error", err))
		return false
	}
	w.heldMu.Lock()
	delete(w.held, k)
	w.heldMu.Unlock()
	return true
}

// releaseAll releases every lock still recorded as held.
func (w *Worker) releaseAll() {
	if w.locker == nil {
		return
	}
	w.heldMu.Lock()
	keys := make([]pairKey, 0, len(w.held))
	for k := range w.held {
		keys = append(keys, k)
	}
	w.heldMu.Unlock()
	for _, k := range keys {
		w.releaseLock(context.Background(), k)
	}
}
