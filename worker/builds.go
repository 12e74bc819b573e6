package worker

// Builds: the versions of a perspective and their rebuilds, as the worker runs them. A
// build's pairs are keyed by its build key (Pair.Perspective); logs and metrics name the
// perspective and the version instead.

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/perspectives-go/perspectives/db"
	"github.com/perspectives-go/perspectives/locker"
)

// Versioned is implemented by a Perspective that is a given version of its Name. Versions
// are positive; a Perspective without the method is version 1.
type Versioned interface {
	Version() int
}

// versionOf is p's version.
func versionOf(p Perspective) int {
	if v, ok := p.(Versioned); ok {
		return v.Version()
	}
	return 1
}

// buildKey is the key of build n of version of the perspective name: the name itself for
// the first build of version 1.
func buildKey(name string, version, n int) string {
	if version == 1 && n == 1 {
		return name
	}
	return fmt.Sprintf("%s@v%d.%d", name, version, n)
}

// planRegistration says which build an instance running version of the perspective name
// must add, given the perspective's builds: none when a build of that version is building
// or active, or when a newer version is active (versions only go up: the instance then
// applies nothing of the perspective); otherwise the version's next build, active at once
// when the perspective has no active build (its first), else building beside the active.
func planRegistration(name string, version int, builds []Build) *Build {
	var active *Build
	n := 0
	for i, b := range builds {
		if b.State == BuildActive {
			active = &builds[i]
		}
		if b.Version != version {
			continue
		}
		if b.State != BuildRetired {
			return nil
		}
		n = max(n, b.N)
	}
	if active != nil && active.Version > version {
		return nil
	}
	b := &Build{Perspective: name, Version: version, N: n + 1, State: BuildBuilding}
	if active == nil {
		b.State = BuildActive
	}
	b.Key = buildKey(name, version, b.N)
	return b
}

// planRebuild says which build rebuilds the perspective name: the next build of its active
// version, building beside it; none when one is already under way.
func planRebuild(name string, builds []Build) (*Build, error) {
	var active *Build
	for i, b := range builds {
		if b.State == BuildActive {
			active = &builds[i]
		}
	}
	if active == nil {
		if len(builds) == 0 {
			return nil, fmt.Errorf("%w: perspective %q is not registered", locker.ErrInvalidArgument, name)
		}
		return nil, fmt.Errorf("perspective %q has no active version to rebuild", name)
	}
	n := 0
	for _, b := range builds {
		if b.Version != active.Version {
			continue
		}
		if b.State == BuildBuilding {
			return nil, nil
		}
		n = max(n, b.N)
	}
	return &Build{Key: buildKey(name, active.Version, n+1), Perspective: name, Version: active.Version, N: n + 1, State: BuildBuilding}, nil
}

// promoteLag is how far behind the active build a caught-up build's queue may be when it is
// promoted (its oldest queued event, against the active build's).
const promoteLag = time.Second

// caughtUp says whether a build whose oldest queued event has waited candAge is as current
// as the active build, whose oldest has waited activeAge (0: nothing queued).
func caughtUp(candAge, activeAge time.Duration) bool { return candAge <= activeAge+promoteLag }

// retireGrace is how long after its retirement a build's rows are deleted: long enough for
// every instance to have seen the retirement (they look every PollInterval) and for the
// transactions they had begun on it to have ended.
const retireGrace = 30 * time.Second

// cleanupBatch is how many pairs of a retired build one cleanup statement deletes.
const cleanupBatch = 1000

// firstEventID sorts before every stored event ID (the nil UUID is never stored: Append
// gives it a new ID): EnqueueFrom firstEventID queues a whole stream.
var firstEventID = uuid.UUID{15: 1}

// build is a build this instance applies, with the perspective code that applies it.
type build struct {
	Build
	persp Perspective
}

// buildSet is the builds this instance applies. The loop replaces it whole; jobs read it.
type buildSet struct {
	byKey map[string]*build
	keys  []string // sorted
}

// builds is the current build set.
func (w *Worker) builds() *buildSet { return w.buildSet.Load() }

// adopt makes the builds of all (every build of the worker's perspectives) that this
// instance applies its build set: of each perspective, the builds of the version it runs
// that are not retired. It logs, once each, a version that stops being applied here and a
// perspective of which this instance applies nothing.
func (w *Worker) adopt(all []Build) {
	set := &buildSet{byKey: map[string]*build{}}
	applied := map[string]bool{}
	active := map[string]Build{}
	for _, b := range all {
		p := w.persp[b.Perspective]
		if b.State == BuildActive {
			active[b.Perspective] = b
		}
		if p == nil || b.State == BuildRetired || b.Version != versionOf(p) {
			continue
		}
		set.byKey[b.Key] = &build{Build: b, persp: p}
		set.keys = append(set.keys, b.Key)
		applied[b.Perspective] = true
	}
	slices.Sort(set.keys)
	old := w.buildSet.Swap(set)
	for _, name := range w.names {
		if applied[name] {
			delete(w.idle, name)
			continue
		}
		if w.idle[name] {
			continue
		}
		w.idle[name] = true
		version := versionOf(w.persp[name])
		attrs := []any{slog.String("perspective", name), slog.Int("version", version)}
		if a, ok := active[name]; ok {
			attrs = append(attrs, slog.Int("active_version", a.Version))
		}
		if len(old.keys) > 0 {
			w.log.Warn("perspective version retired: this instance no longer applies it", attrs...)
		} else {
			w.log.Warn("perspective version not applied: a newer version is active (versions only go up)", attrs...)
		}
	}
}

// buildOf is the build of key, or a stand-in named after the key when this instance does
// not apply it (any more).
func (w *Worker) buildOf(key string) *build {
	if b := w.builds().byKey[key]; b != nil {
		return b
	}
	return &build{Build: Build{Key: key, Perspective: key, Version: 1}}
}

// logPair names a pair in logs: its perspective, version and stream; more follow.
func (w *Worker) logPair(k Pair, more ...any) []any {
	b := w.buildOf(k.Perspective)
	return append([]any{slog.String("perspective", b.Perspective), slog.Int("version", b.Version),
		slog.String("stream", k.Stream.String())}, more...)
}

// metricPair is a measurement's attributes for a pair: its perspective and version (never
// the stream), and more.
func (w *Worker) metricPair(k Pair, more ...attribute.KeyValue) metric.MeasurementOption {
	b := w.buildOf(k.Perspective)
	return metric.WithAttributes(append([]attribute.KeyValue{
		attrPerspective.String(b.Perspective), attrVersion.Int(b.Version)}, more...)...)
}

// maintain looks at the builds (every PollInterval, from the loop) and queues the work
// they need: a catch-up for each build not caught up and, of the maintenance services, those
// whose leader lease this instance holds: the promotion checks (promotion.go), the cleanup of
// retired builds (cleanup.go), forgetting gone instances (forget.go).
func (w *Worker) maintain(ctx context.Context, s *schedule) {
	all, err := w.store.Builds(ctx, w.names)
	if err != nil {
		// A database that does not answer is said by the claim, once per spell.
		if ctx.Err() == nil && !isConnectionError(err) {
			w.log.Error("reading the builds failed", slog.Any("error", err))
		}
		return
	}
	w.adopt(all)
	set := w.builds()
	for _, key := range set.keys {
		if !set.byKey[key].CatchUpDone {
			s.queueBuildJob(job{kind: jobCatchUp, key: key})
		}
	}
	w.queuePromotions(s, set)
	w.queueCleanups(s)
	w.queueForget(s)
}

// buildsOf reads the builds of perspectives through q (the pool's, or a transaction's).
func buildsOf(ctx context.Context, q *db.Queries, perspectives []string) ([]Build, error) {
	rows, err := q.BuildsOf(ctx, perspectives)
	if err != nil {
		return nil, err
	}
	out := make([]Build, len(rows))
	for i, r := range rows {
		out[i] = Build{Key: r.BuildKey, Perspective: r.PerspectiveName, Version: int(r.Version), N: int(r.Build), State: r.State,
			CatchUpDone: r.CatchupDone, PromotionRequested: r.PromotionRequested}
	}
	return out, nil
}

func (s *pgStore) Builds(ctx context.Context, perspectives []string) ([]Build, error) {
	return buildsOf(ctx, s.q, perspectives)
}

func (s *pgStore) Register(ctx context.Context, perspective string, version int) ([]Build, error) {
	builds, _, err := s.addBuild(ctx, perspective, func(builds []Build) (*Build, error) {
		return planRegistration(perspective, version, builds), nil
	})
	if err != nil || s.w == nil {
		return builds, err
	}
	err = s.q.PerspectiveSinkSet(ctx, db.PerspectiveSinkSetParams{PerspectiveName: perspective, Sink: s.w.hasSink(perspective)})
	return builds, err
}

// addBuild adds the build plan asks for, given the perspective's builds (none: nothing to
// add), and returns the builds afterwards and the one it added. plan runs first on a plain
// read, then again under the exclusive side of the append lock when it asks for a build:
// every Append in flight commits first (its events are in the store when the catch-up
// reads it), every later one queues its events for the new build. The lock is held only
// for these few statements, so no Append waits on a scan, and it is waited for in short
// bounds (underAppendLock), so no Append waits on a transaction that appended and stays open.
func (s *pgStore) addBuild(ctx context.Context, perspective string, plan func([]Build) (*Build, error)) ([]Build, *Build, error) {
	builds, err := s.Builds(ctx, []string{perspective})
	if err != nil {
		return nil, nil, err
	}
	if b, err := plan(builds); err != nil || b == nil {
		return builds, nil, err
	}
	var added *Build
	err = s.underAppendLock(ctx, func(tx pgx.Tx, q *db.Queries) error {
		added = nil // from an attempt that did not commit
		if _, err := q.PerspectiveRegister(ctx, perspective); err != nil {
			return err
		}
		if builds, err = buildsOf(ctx, q, []string{perspective}); err != nil {
			return err
		}
		b, err := plan(builds)
		if err != nil || b == nil {
			return err // another instance added it meanwhile
		}
		taken, err := q.BuildKeyTaken(ctx, b.Key)
		if err != nil {
			return err
		}
		if taken {
			return fmt.Errorf("perspective %q: its build key %q is already another perspective's: rename one of them", perspective, b.Key)
		}
		if err := q.BuildCreate(ctx, db.BuildCreateParams{
			BuildKey: b.Key, PerspectiveName: perspective, Version: int32(b.Version), Build: int32(b.N), State: b.State,
		}); err != nil {
			return err
		}
		if b.State == BuildActive {
			// A perspective's first build is active from its registration: its sink's
			// promotion, from none, is this transaction.
			if err := s.w.promoteSinks(ctx, tx, nil, *b); err != nil {
				return err
			}
		}
		builds, added = append(builds, *b), b
		return q.RegistrationBump(ctx)
	})
	if err != nil {
		return nil, nil, err
	}
	return builds, added, nil
}

// The exclusive side of the append lock is waited for in bounds: while an exclusive request
// waits, every Append that comes waits behind it (see RegisterLock in queries/builds.sql).
// The first wait lasts appendLockFirstWait, time enough for the Appends in flight to commit.
// When a wait runs out, the transactions that hold the lock just after (the blockers: one
// that appended and stays open, say) are waited out without queueing: every appendLockPoll
// the lock is only tried, which never queues, until they have all ended or a try gets it.
// Then it is waited for again, each bound twice the last (up to appendLockMaxWait), for when
// overlapping Appends keep it held. An Append waits for one registration at most that bound,
// when a wait begins (several waiting at once can add theirs up), never for the transactions
// it waits out. Append transactions that each stay open longer than appendLockMaxWait and
// keep overlapping hold a registration off until there is a gap between them. After
// appendLockWarnAfter the wait is logged once, naming the holders.
const (
	appendLockFirstWait = 50 * time.Millisecond
	appendLockMaxWait   = time.Second
	appendLockPoll      = 50 * time.Millisecond
	appendLockWarnAfter = 5 * time.Second
)

// errAppendLockTaken is a try of the append lock that found it held.
var errAppendLockTaken = errors.New("the append lock is held")

// unknownHolders stands for the holders of the append lock when a wait ran out and they could
// not be looked up: the next look-up's holders take their place.
const unknownHolders = "?"

// underAppendLock runs fn in a transaction that holds the exclusive side of the append lock
// (queries/builds.sql): every Append in flight has committed, and every later one waits for
// this transaction. It tries again, in a new transaction, until it has the lock or ctx ends,
// so fn may run more than once and must not keep what an attempt that did not commit set.
// A statement of fn that outlasts the session's lock_timeout, if it has one, is tried again
// the same way.
func (s *pgStore) underAppendLock(ctx context.Context, fn func(tx pgx.Tx, q *db.Queries) error) error {
	began, wait, warned := time.Now(), appendLockFirstWait, false
	var blockers map[string]bool // the transactions that held the lock just after the last wait ran out
	for {
		locked, try := false, len(blockers) > 0
		err := s.inTx(ctx, func(tx pgx.Tx, q *db.Queries) error {
			if try {
				if ok, err := q.RegisterLockTry(ctx); err != nil || !ok {
					return cmp.Or(err, errAppendLockTaken)
				}
			} else if err := q.RegisterLock(ctx, int32(wait.Milliseconds())); err != nil {
				return err
			}
			locked = true
			return fn(tx, q)
		})
		switch {
		case err == nil:
			return nil
		case !locked && ctx.Err() != nil:
			return s.appendLockGivenUp(ctx)
		case !errors.Is(err, errAppendLockTaken) && !isLockTimeout(err):
			return err
		}
		hctx, cancel := context.WithTimeout(ctx, appendLockHoldersTimeout)
		holders, herr := s.q.AppendLockHolders(hctx)
		cancel()
		held := make(map[string]bool, len(holders))
		for _, h := range holders {
			held[h.Transaction] = true
		}
		ranOut := !try && !locked // a bounded wait ran out: wait its holders out, then wait longer
		switch {
		case ranOut && herr != nil:
			blockers, wait = map[string]bool{unknownHolders: true}, min(2*wait, appendLockMaxWait)
		case ranOut:
			blockers, wait = held, min(2*wait, appendLockMaxWait)
		case herr != nil:
			// Keep trying: the look-up only names whom it waits for; a database that keeps
			// failing fails the lock statement too, which returns its error.
		case blockers[unknownHolders]: // the holders not seen when the wait ran out: those seen now
			blockers = held
		default:
			for t := range blockers {
				if !held[t] {
					delete(blockers, t)
				}
			}
		}
		if !warned && time.Since(began) >= appendLockWarnAfter && s.log != nil && herr == nil {
			warned = true
			s.log.Warn("waiting for transactions that appended events to end (registering, rebuilding or promoting a build "+
				"waits until every Append in flight has committed; Appends are not held up meanwhile)",
				slog.Duration("waited", time.Since(began)), slog.String("holders", holderNames(holders)))
		}
		select {
		case <-ctx.Done():
			return s.appendLockGivenUp(ctx)
		case <-time.After(appendLockPoll*3/4 + rand.N(appendLockPoll/2)):
		}
	}
}

// appendLockHoldersTimeout bounds the look-up of the append lock's holders.
const appendLockHoldersTimeout = time.Second

// appendLockGivenUp is the error of a wait for the append lock that ctx ended.
func (s *pgStore) appendLockGivenUp(ctx context.Context) error {
	hctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), appendLockHoldersTimeout)
	defer cancel()
	var names string
	if holders, err := s.q.AppendLockHolders(hctx); err == nil {
		names = holderNames(holders)
	} else {
		names = "not known: " + err.Error()
	}
	return fmt.Errorf("wait for the append lock (held by transactions that appended events and are still open: %s): %w", names, ctx.Err())
}

// holderNames names the transactions holding the append lock, and how long each has been
// open, for a log line or an error.
func holderNames(holders []db.AppendLockHoldersRow) string {
	if len(holders) == 0 {
		return "none now"
	}
	names := make([]string, len(holders))
	for i, h := range holders {
		if h.Pid == 0 {
			names[i] = "a prepared transaction " + h.Transaction
		} else {
			names[i] = fmt.Sprintf("server pid %d", h.Pid)
		}
		if h.XactAgeMicros >= 0 {
			names[i] += fmt.Sprintf(" (open %s)", (time.Duration(h.XactAgeMicros) * time.Microsecond).Round(time.Millisecond))
		}
	}
	return strings.Join(names, ", ")
}

// readAheadTimeout bounds a read-ahead query.
const readAheadTimeout = 30 * time.Second

// micros is a queue age in microseconds as a duration (-1: nothing queued, 0).
func micros(us int64) time.Duration { return time.Duration(max(us, 0)) * time.Microsecond }

func (s *pgStore) Status(ctx context.Context) ([]BuildStatus, error) {
	rows, err := s.q.BuildsStatus(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]BuildStatus, len(rows))
	for i, r := range rows {
		out[i] = BuildStatus{
			Build: Build{Key: r.BuildKey, Perspective: r.PerspectiveName, Version: int(r.Version), N: int(r.Build),
				State: r.State, CatchUpDone: r.CatchupDone},
			CatchUpStarted: r.CatchupStartedAt, CatchUpEvents: r.CatchupEvents, CatchUpStreams: r.CatchupStreams,
			Queued: r.Queued, OldestQueued: micros(r.OldestQueuedMicros),
			Failing: r.Failing, Parked: r.Parked, LiveInstances: r.LiveInstances, EventsPerSecond: r.EventsPerSecond,
			SinkMillis: r.SinkMs,
		}
	}
	return out, nil
}

// BuildStore is what registration and the look at the builds ask of the database, and the metrics' status.
type BuildStore interface {
	// Register records a perspective, and the build an instance running its version
	// applies (planRegistration decides, under the exclusive append lock, without scanning
	// anything). It returns every build of the perspective afterwards.
	Register(ctx context.Context, perspective string, version int) ([]Build, error)
	// Builds returns every build of the perspectives.
	Builds(ctx context.Context, perspectives []string) ([]Build, error)
	// Status reports every build with its catch-up progress and queue (metrics).
	Status(ctx context.Context) ([]BuildStatus, error)
}
