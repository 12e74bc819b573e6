package worker

// Builds: the versions of a perspective and their rebuilds, as the worker runs them. A
// build's pairs are keyed by its build key (Pair.Perspective); logs and metrics name the
// perspective and the version instead.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

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
		if old != nil && len(old.keys) > 0 {
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

// catchUp runs one page of build key's catch-up, and says whether to run another at once
// (more) and whether the catch-up is over (done).
func (w *Worker) catchUp(ctx context.Context, key string) (more, done bool, err error) {
	b := w.buildOf(key)
	if b.persp == nil {
		return false, false, nil // no longer applied here
	}
	attrs := []any{slog.String("perspective", b.Perspective), slog.Int("version", b.Version)}
	res, err := w.store.CatchUp(ctx, CatchUpRequest{
		Key: key, Instance: w.cfg.InstanceID, Lease: w.cfg.LockOptions.LockTimeout, PageSize: w.cfg.CatchUpPageSize,
	}, func(page CatchUpPage) []PairWrite { return w.foldPage(ctx, b, page) })
	if errors.Is(err, ErrLockLost) {
		w.log.Warn("catch-up page refused: its lease was taken over", attrs...)
		return false, false, nil
	}
	if err != nil {
		return false, false, fmt.Errorf("catch-up of %s version %d: %w", b.Perspective, b.Version, err)
	}
	if res.Events > 0 {
		set := metric.WithAttributes(attrPerspective.String(b.Perspective), attrVersion.Int(b.Version))
		w.tel.catchUpEvents.Add(ctx, int64(res.Events), set)
		if res.Applied > 0 {
			w.tel.eventsApplied.Add(ctx, int64(res.Applied), set)
			w.countApplied(key, res.Applied)
		}
	}
	if res.Done {
		w.log.Info("catch-up done", attrs...)
	}
	return !res.Done && !res.NotHeld, res.Done, nil
}

// foldPage folds a catch-up page into one write per stream, the streams side by side (on
// up to GOMAXPROCS goroutines: Apply already runs concurrently for different pairs). A
// stream that another instance has locked (or another transaction holds), or that the
// build already has a position in (other than the one the previous page left unfinished),
// is left to the normal path: its events from the page's first on are queued. A stream
// whose Apply fails keeps the events before the failure; the failure is recorded on it and
// its events from the failing one on are queued, so that the normal path retries them with
// backoff. The catch-up goes on with the next stream either way.
func (w *Worker) foldPage(ctx context.Context, b *build, page CatchUpPage) []PairWrite {
	var runs [][]Event
	for events := page.Events; len(events) > 0; {
		n := 1
		for n < len(events) && events[n].StreamID == events[0].StreamID {
			n++
		}
		runs, events = append(runs, events[:n]), events[n:]
	}
	writes := make([]PairWrite, len(runs))
	var next atomic.Int64
	var wg sync.WaitGroup
	for range min(runtime.GOMAXPROCS(0), len(runs)) {
		wg.Go(func() {
			for i := int(next.Add(1)) - 1; i < len(runs); i = int(next.Add(1)) - 1 {
				writes[i] = w.foldRun(ctx, b, page, runs[i])
			}
		})
	}
	wg.Wait()
	for _, wr := range writes {
		if wr.Failure.Cause != "" {
			w.reportApplied(ctx, pairReport{pair: wr.Pair, applied: len(wr.Applied), err: eventError{event: wr.Failure.Event, err: errors.New(wr.Failure.Cause)}, action: wr.Failure.Action})
		}
	}
	return writes
}

// catchUpStreamShare is the most events of one stream a catch-up page applies. A stream with
// more in the page has the rest of its history queued for the normal path (as a failing
// stream's is), whose claims take it a batch at a time beside every other pair, and the
// catch-up passes it: one long stream never holds back the streams after it.
const catchUpStreamShare = 1000

// foldRun folds the events run of one stream of a catch-up page (see foldPage), at most
// catchUpStreamShare of them.
func (w *Worker) foldRun(ctx context.Context, b *build, page CatchUpPage, run []Event) PairWrite {
	stream := run[0].StreamID
	k := Pair{Stream: stream, Perspective: page.Key}
	st, locked := page.Streams[stream]
	continued := stream == page.Continued
	switch {
	case !locked || w.lockedElsewhere(st.LockHolder), st.LastEventID.Valid && !continued:
		return PairWrite{Pair: k, EnqueueFrom: run[0].ID}
	case continued && (!st.LastEventID.Valid || st.Model == nil || st.ModelAt != st.LastEventID.UUID):
		// Purged (or inconsistent) since the previous page: the whole stream is queued.
		return PairWrite{Pair: k, EnqueueFrom: firstEventID}
	}
	var rest uuid.UUID // the first event left to the normal path (a long stream's share ends)
	if len(run) > catchUpStreamShare {
		run, rest = run[:catchUpStreamShare], run[catchUpStreamShare].ID
	}
	f := w.fold(ctx, b.persp, st.Model, st.SinceSnapshot, run)
	wr := PairWrite{Pair: k, Applied: f.applied, Model: f.model, SinceSnapshot: f.since, EnqueueFrom: rest}
	if len(f.applied) > 0 {
		wr.LastEventID = f.applied[len(f.applied)-1]
	}
	wr.Snapshots, wr.DropSnapshots = w.retain(f.snaps, st.Snapshots)
	if f.err != nil {
		wr.Failure = w.failure(b, st, f.err)
		wr.EnqueueFrom = run[len(f.applied)].ID
	}
	return wr
}
