package worker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/metric"

	"github.com/perspectives-go/perspectives/locker"
)

// releaseTimeout bounds the fresh context used to release a stream lock, and how long Stop
// waits for cancelled operations to end.
const releaseTimeout = 5 * time.Second

// Worker applies queued events to its perspectives. Create it with New, run it with Start
// and Stop.
type Worker struct {
	cfg   Config
	store Store
	persp map[string]Perspective
	names []string
	coord *coordinator
	log   *slog.Logger
	tel   *telemetry
	wake  chan struct{}

	// buildSet is the builds this instance applies: set by Start, then replaced by the
	// loop only (adopt); jobs read it.
	buildSet atomic.Pointer[buildSet]
	// counts are the events applied per perspective (w.names' order) since the instance
	// started, and its sinks' time: what the heartbeat reports.
	counts []perspectiveCounter
	idle   map[string]bool // the loop's: the perspectives of which this instance applies nothing (logged once each)

	// startMu guards starting and stopAsked, which Stop sets before it takes mu: a Stop
	// during a Start ends the Start's registration (which can wait for the appending
	// transactions in flight) rather than wait for it.
	startMu   sync.Mutex
	starting  context.CancelCauseFunc // cancels the registration of the Start in progress
	stopAsked bool

	mu        sync.Mutex // guards the lifecycle fields below
	started   bool
	stopped   bool
	stopLoop  context.CancelFunc  // graceful stop: no new work
	cancelOps context.CancelFunc  // hard stop: cancels the operations in progress
	done      chan struct{}       // closed when the loop and the listener have returned
	stopEnded chan struct{}       // closed when the first Stop returns
	gauges    metric.Registration // queue gauges, while started
	beats     *heartbeat          // this instance's heartbeats, while started (nil: the Store records none)
	// lead says which leader leases this instance holds (maintenance services), from Start
	// on; until then it holds none that a Store keeping leases would grant.
	lead *elector
	// maintainNow asks the loop to look at the builds at once (a leader lease was won).
	maintainNow atomic.Bool
	// unheard says that the loop's subscription to the queue's notification is lost (see
	// listen): the loop claims every reconnectInterval meanwhile.
	unheard   atomic.Bool
	beatEvery time.Duration // HeartbeatInterval (tests shorten it)
}

// New validates cfg (including LockOptions) and returns a worker on pool. It does not
// touch the database; Start does.
//
// cfg.Locker, when set, must keep its locks in the lock columns of wh_perspective_cursors,
// as locker.Postgres does: the worker pauses live application of a pair, and fences a
// rewind's or purge's final write, by reading those columns in the same transaction. Any
// other Locker is refused with an error wrapping ErrInvalidConfig (see
// locker.CursorRowLocker).
func New(pool *pgxpool.Pool, cfg Config) (*Worker, error) {
	if pool == nil {
		return nil, fmt.Errorf("worker: %w: pool is nil", ErrInvalidConfig)
	}
	if cfg.Locker != nil && !isNil(cfg.Locker) {
		if _, ok := cfg.Locker.(locker.CursorRowLocker); !ok {
			return nil, invalid("Locker is a %T, which does not keep its locks on the cursor rows: the worker "+
				"fences commits against the lock columns of wh_perspective_cursors, so it needs locker.Postgres "+
				"(or a Locker wrapping it that implements locker.CursorRowLocker)", cfg.Locker)
		}
	}
	cfg, err := cfg.resolve()
	if err != nil {
		return nil, err
	}
	store := newPGStore(pool, cfg.RetryBackoff, cfg.MaxRetryBackoff)
	store.listenConnect = cfg.ListenConnect
	store.skippedBy = "worker " + cfg.InstanceID.String()
	w, err := newWorker(store, cfg)
	if err != nil {
		return nil, err
	}
	store.w, store.log = w, w.log
	return w, nil
}

// newWorker builds a worker on store; cfg is resolved.
func newWorker(store Store, cfg Config) (*Worker, error) {
	w := &Worker{
		cfg:   cfg,
		store: store,
		persp: make(map[string]Perspective, len(cfg.Perspectives)),
		coord: newCoordinator(),
		log:   cfg.Logger.With(slog.String("instance", cfg.InstanceID.String())),
		wake:  make(chan struct{}, 1),
		idle:  map[string]bool{},

		beatEvery: HeartbeatInterval,
	}
	// A Store that keeps no leases (nil): this instance holds them all; else none before Start.
	ls, _ := store.(leaderStore)
	w.lead = &elector{store: ls}
	w.buildSet.Store(&buildSet{byKey: map[string]*build{}})
	w.counts = make([]perspectiveCounter, len(cfg.Perspectives))
	var err error
	if w.tel, err = newTelemetry(cfg.MeterProvider, cfg.TracerProvider); err != nil {
		return nil, err
	}
	for _, p := range cfg.Perspectives {
		w.persp[p.Name()] = p
		w.names = append(w.names, p.Name())
	}
	return w, nil
}

// InstanceID is this worker's identity as a stream-lock holder.
func (w *Worker) InstanceID() uuid.UUID { return w.cfg.InstanceID }

// Start registers the perspectives and starts the loop in the background; the loop is not
// tied to ctx (Stop ends it). Registration is a few short statements whatever the size of
// the event store: a new perspective, or a new version of one, is caught up from the store
// in the background (docs/concepts.md, "The life of a build").
func (w *Worker) Start(ctx context.Context) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.stopped {
		return errors.New("worker: start: worker was stopped")
	}
	if w.started {
		return errors.New("worker: start: already started")
	}
	rctx, cancelRegister := context.WithCancelCause(ctx)
	defer cancelRegister(nil)
	w.startMu.Lock()
	if w.stopAsked {
		w.startMu.Unlock()
		return errors.New("worker: start: worker was stopped")
	}
	w.starting = cancelRegister
	w.startMu.Unlock()
	defer func() {
		w.startMu.Lock()
		w.starting = nil
		w.startMu.Unlock()
	}()
	var all []Build
	for _, name := range w.names {
		builds, err := w.store.Register(rctx, name, versionOf(w.persp[name]))
		if err != nil {
			if cause := context.Cause(rctx); errors.Is(cause, errStoppedDuringStart) {
				err = cause
			}
			return fmt.Errorf("worker: register perspective %q: %w", name, err)
		}
		all = append(all, builds...)
	}
	w.buildSet.Store(&buildSet{byKey: map[string]*build{}}) // nothing applied before Start
	w.adopt(all)
	gauges, err := w.tel.observeBuilds(w.store, w.names)
	if err != nil {
		return fmt.Errorf("worker: start: %w", err)
	}
	if bs, ok := w.store.(backgroundStore); ok {
		// Before the heartbeat and the elector: a failure here leaves nothing running.
		if err := bs.startBackground(ctx); err != nil {
			return errors.Join(fmt.Errorf("worker: start: %w", err), gauges.Unregister())
		}
	}
	w.gauges = gauges
	if rec, ok := w.store.(instanceRecorder); ok {
		w.beats = startHeartbeat(ctx, rec, newInstanceRecord(w.cfg.InstanceID, w.beatEvery, w.running()), w.perspectiveCounts, w.log)
	}
	ls, _ := w.store.(leaderStore)
	opts := w.cfg.LockOptions
	w.lead = startElector(ctx, ls, leaseNames(w.running()), w.cfg.InstanceID, opts.LockTimeout, opts.KeepAliveInterval,
		leaseMargin(opts), w.log, func() { w.maintainNow.Store(true); w.Notify() })
	base := context.WithoutCancel(ctx)
	opsCtx, cancelOps := context.WithCancel(base)
	loopCtx, stopLoop := context.WithCancel(opsCtx)
	w.stopLoop, w.cancelOps = stopLoop, cancelOps
	w.done = make(chan struct{})
	w.started = true
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); w.loop(loopCtx, opsCtx) }()
	if !w.cfg.PollOnly {
		wg.Add(1)
		go func() { defer wg.Done(); w.listen(loopCtx) }()
	}
	go func() { wg.Wait(); close(w.done) }()
	w.log.Info("perspective worker started", slog.Any("perspectives", w.names))
	return nil
}

// Stop stops the worker. It claims no new work at once, resigns its leader leases (so that
// another instance takes its maintenance over at once), and lets the operations in
// progress finish until ctx ends; then it cancels them and waits up to 5 seconds more for
// them to end. Each operation releases its own stream lock when it ends (with a fresh
// short context); Stop never releases a lock whose operation is still running: such a lock
// lapses after LockTimeout. The leases on pairs that a finished job left to a follow-up (a
// rewind, a bootstrap, a next batch) not started are released. Then it stops the background
// services under ctx: a catch-up page read ahead is let finish until ctx ends, then
// cancelled, and the instance's catch-up leases are let go under ctx (another instance
// continues at once); the instance's last heartbeat and the deletion of its row run under ctx
// (bounded by 2 and 5 seconds: with ctx already ended, the row is left to lapse after three
// heartbeat intervals). So Stop returns by ctx's deadline plus at most those 5 seconds and
// one bounded statement, with no goroutine left running, unless an operation outlasts them
// (an Apply that ignores its context): Stop then logs a warning and returns, and the
// operation ends on its own, its lock lapsing. It returns ctx's error when ctx ended first,
// joined with the error of unregistering its queue gauges if that fails. A Stop during a
// Start ends the Start's registration (Start returns an error). It is idempotent: a Stop
// while another runs waits for that one to return, or for its own ctx to end.
func (w *Worker) Stop(ctx context.Context) error {
	w.startMu.Lock()
	w.stopAsked = true
	if w.starting != nil {
		w.starting(errStoppedDuringStart)
	}
	w.startMu.Unlock()
	w.mu.Lock()
	if w.stopped || !w.started {
		w.stopped = true
		ended := w.stopEnded
		w.mu.Unlock()
		if ended == nil {
			return nil
		}
		select { // another Stop is under way: wait for it
		case <-ended:
			return nil
		case <-ctx.Done():
			return fmt.Errorf("worker: stop: %w", ctx.Err())
		}
	}
	w.stopped = true
	ended := make(chan struct{})
	w.stopEnded = ended
	defer close(ended)
	w.stopLoop()
	done := w.done
	w.mu.Unlock()
	// Resign the leader leases at once: the other instances take the maintenance over at
	// their next attempt, and a maintenance write still running here is refused by its fence.
	w.lead.stop(ctx)

	var err error
	select {
	case <-done:
	case <-ctx.Done():
		err = fmt.Errorf("worker: stop: %w", ctx.Err())
		w.cancelOps()
		select {
		case <-done:
		case <-time.After(releaseTimeout):
			w.log.Warn("operations still running after stop; their stream locks will lapse")
		}
	}
	w.cancelOps()
	if bs, ok := w.store.(backgroundStore); ok {
		if serr := bs.stopBackground(ctx); serr != nil && err == nil {
			err = fmt.Errorf("worker: stop: %w", serr)
		}
	}
	if w.beats != nil {
		w.beats.stop(ctx) // after the loop and its operations: the row goes when the work has
	}
	if w.gauges != nil {
		if uerr := w.gauges.Unregister(); uerr != nil {
			err = errors.Join(err, fmt.Errorf("worker: stop: unregister the queue gauges: %w", uerr))
		}
	}
	w.log.Info("perspective worker stopped")
	return err
}

// errStoppedDuringStart is why a Start's registration ended when Stop was called meanwhile.
var errStoppedDuringStart = errors.New("stopped during start")

// backgroundStore is a Store with background work of its own (the pgStore's catch-up
// read-aheads): started by the worker's Start, stopped by its Stop once the loop has ended.
type backgroundStore interface {
	startBackground(ctx context.Context) error
	stopBackground(ctx context.Context) error
}

// Notify wakes the loop at once, as when new events are known to be queued.
func (w *Worker) Notify() {
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

// listen wakes the loop on every committed Append, and when its subscription takes effect
// (events may have been appended before). While the subscription is lost (the notifier opens
// another session after a backoff), unheard is set, the interruption is said once, and the
// loop claims every reconnectInterval; polling every PollInterval covers whatever else it
// misses.
func (w *Worker) listen(ctx context.Context) {
	err := w.store.Listen(ctx, w.Notify, func(err error) {
		if err == nil {
			w.unheard.Store(false)
		} else if !w.unheard.Swap(true) {
			w.log.Warn("queue notifications interrupted; polling until resubscribed", slog.Any("error", err))
		}
		w.Notify()
	})
	w.unheard.Store(false)
	if errors.Is(err, ErrNotificationsLost) {
		w.log.Warn("LISTEN receives no notifications on this connection (it goes through a connection pooler such as PgBouncer): "+
			"polling every PollInterval instead; set Config.ListenConnect to a direct connection for the wake-up",
			slog.Duration("poll_interval", w.cfg.PollInterval))
	}
}
