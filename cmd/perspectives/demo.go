package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"net/url"
	"os"
	"os/exec"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/perspectives-go/perspectives/db"
	"github.com/perspectives-go/perspectives/internal/pgq"
	"github.com/perspectives-go/perspectives/internal/shortid"
	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/schema"
	"github.com/perspectives-go/perspectives/worker"
)

// demoDatabase is the database the demo creates (and drops) next to the one it is given.
const demoDatabase = "perspectives_demo"

type demoConfig struct {
	instances   int
	streams     int
	events      int
	late        float64
	lockTimeout time.Duration
	applyDelay  time.Duration
	roundGap    time.Duration
	keep        bool
	seed        uint64
	dbName      string
}

func defineDemo(fs *flag.FlagSet) runFunc {
	var c demoConfig
	fs.IntVar(&c.instances, "instances", 3, "worker instances (separate processes)")
	fs.IntVar(&c.streams, "streams", 120, "streams")
	fs.IntVar(&c.events, "events", 40, "events per stream")
	fs.Float64Var(&c.late, "late", 0.1, "share of events that arrive late (after newer events of their stream)")
	fs.DurationVar(&c.lockTimeout, "lock-timeout", 4*time.Second, "stream lock timeout (a killed holder's locks lapse after it)")
	fs.DurationVar(&c.applyDelay, "apply-delay", time.Millisecond, "time each instance spends per applied event")
	fs.DurationVar(&c.roundGap, "round-gap", 300*time.Millisecond, "pause between the 40 rounds of appends")
	fs.BoolVar(&c.keep, "keep", false, "keep the "+demoDatabase+" database afterwards")
	fs.StringVar(&c.dbName, "demo-database", demoDatabase, "name of the database the demo creates and drops")
	fs.Uint64Var(&c.seed, "seed", uint64(time.Now().UnixNano()), "random seed")
	return func(ctx context.Context, dbURL string, stdout, stderr io.Writer) error {
		switch {
		case c.instances < 2:
			return errors.New("--instances must be at least 2 (one is killed)")
		case c.streams < 1 || c.events < 2:
			return errors.New("--streams must be at least 1 and --events at least 2")
		case c.late < 0 || c.late >= 1:
			return errors.New("--late must be in [0, 1)")
		case c.lockTimeout <= 0:
			return fmt.Errorf("--lock-timeout must be positive, got %s", c.lockTimeout)
		}
		// The instances take it, with a keepalive every quarter of it: refused here, before
		// the demo database is made, rather than by every instance at its start.
		if err := (locker.Options{LockTimeout: c.lockTimeout, KeepAliveInterval: c.lockTimeout / 4}).Validate(); err != nil {
			return fmt.Errorf("--lock-timeout: %w", err)
		}
		d := &demo{cfg: c, out: stdout, errw: &syncWriter{w: stderr}, rng: rand.New(rand.NewPCG(c.seed, 1))}
		return d.run(ctx, dbURL)
	}
}

type demo struct {
	cfg  demoConfig
	out  io.Writer
	errw io.Writer
	rng  *rand.Rand
	pool *pgxpool.Pool

	// locks is the locker on pool, to watch the locks.
	locks *locker.Postgres

	procs []*demoProc
	lateN int // events appended in a later round than their successors
}

type demoProc struct {
	id     uuid.UUID
	cmd    *exec.Cmd
	stdout *bytes.Buffer
	ready  chan struct{}
	exited chan error
	killed bool
}

func (d *demo) logf(format string, args ...any) {
	fmt.Fprintf(d.out, "demo: "+format+"\n", args...)
}

// warnf says what went wrong on the side, on stderr (safe from several goroutines).
func (d *demo) warnf(format string, args ...any) {
	fmt.Fprintf(d.errw, "demo: "+format+"\n", args...)
}

func (d *demo) run(ctx context.Context, dbURL string) (err error) {
	start := time.Now()
	demoURL, cleanup, err := createDemoDatabase(ctx, dbURL, d.cfg.dbName, d.cfg.keep)
	if err != nil {
		return err
	}
	defer func() {
		if derr := cleanup(); derr != nil {
			d.warnf("dropping database %s: %v", d.cfg.dbName, derr)
		}
	}()
	if d.pool, err = connect(ctx, demoURL); err != nil {
		return err
	}
	defer d.pool.Close()
	if d.locks, err = locker.NewPostgres(d.pool, locker.Options{}); err != nil {
		return err
	}
	if err := schema.Migrate(ctx, d.pool); err != nil {
		return err
	}
	d.logf("database %s migrated; seed %d", d.cfg.dbName, d.cfg.seed)

	if err := d.startInstances(ctx, demoURL); err != nil {
		d.stopAll()
		return err
	}
	defer d.stopAll()
	d.logf("%d worker instances running (lock timeout %s)", len(d.procs), d.cfg.lockTimeout)

	all, rounds := d.plan()
	victim := d.procs[0]
	killCtx, stopKill := context.WithCancel(ctx)
	killDone := make(chan killReport, 1)
	var appended int
	for r, batch := range rounds {
		if r == len(rounds)/3 {
			go func() { killDone <- d.killMidRewind(killCtx, victim) }()
		}
		for i := 0; i < len(batch); i += 50 {
			if err := worker.Append(ctx, d.pool, batch[i:min(i+50, len(batch))]...); err != nil {
				stopKill()
				return err
			}
		}
		appended += len(batch)
		select {
		case <-ctx.Done():
			stopKill()
			return ctx.Err()
		case <-time.After(d.cfg.roundGap):
		}
	}
	d.logf("appended %d events to %d streams (%d arrived late)", appended, d.cfg.streams, d.lateN)
	var kill killReport
	select { // the victim may still be caught mid-rewind while the late events are applied
	case kill = <-killDone:
	case <-time.After(5 * time.Second):
		stopKill()
		kill = <-killDone
	}
	stopKill()
	if kill.midRewind {
		d.logf("killed instance %s with SIGKILL while it held %d stream lock(s) mid-rewind", shortid.String(victim.id), len(kill.held))
	} else {
		d.logf("killed instance %s with SIGKILL (no rewind caught in progress)", shortid.String(victim.id))
	}

	if err := d.waitDrained(ctx, 3*time.Minute); err != nil {
		return err
	}
	takeovers, err := d.takeovers(ctx, kill.held)
	if err != nil {
		return err
	}
	changed, err := d.changeVersion(ctx, demoURL)
	if err != nil {
		return err
	}
	poison, err := d.poison(ctx, all)
	if err != nil {
		return err
	}
	stats := d.stopSurvivors()
	matched, total, mismatches, err := d.check(ctx, all, 2)
	if err != nil {
		return err
	}

	var sum demoStats
	for _, s := range stats {
		sum.EventsApplied += s.EventsApplied
		sum.Rewinds += s.Rewinds
		sum.Contended += s.Contended
		sum.Refused += s.Refused
		sum.Bootstraps += s.Bootstraps
		sum.Failures += s.Failures
		sum.Retired += s.Retired
	}
	fmt.Fprintln(d.out)
	fmt.Fprintln(d.out, "report")
	fmt.Fprintf(d.out, "  events appended           %d (%d late)\n", appended, d.lateN)
	fmt.Fprintf(d.out, "  events applied (live)     %d by the %d surviving instances\n", sum.EventsApplied, len(stats))
	fmt.Fprintf(d.out, "  rewinds                   %d completed, %d refused at commit\n", sum.Rewinds, sum.Refused)
	fmt.Fprintf(d.out, "  lock contention           %d rewinds skipped (lock held elsewhere), retried later\n", sum.Contended)
	fmt.Fprintf(d.out, "  takeovers                 %d of %d locks left by the killed instance\n", takeovers, len(kill.held))
	fmt.Fprintf(d.out, "  snapshot bootstraps       %d\n", sum.Bootstraps)
	fmt.Fprintf(d.out, "  version change            version 2 built beside version 1 and promoted in %s; %d version-1 instances retired it\n",
		changed.Round(10*time.Millisecond), sum.Retired)
	fmt.Fprintf(d.out, "  poison event              stream %s parked after %d failures in %s; skipped by the operator, the event after it applied\n",
		shortid.String(poison.stream), poison.attempts, poison.parkedIn.Round(10*time.Millisecond))
	fmt.Fprintf(d.out, "  elapsed                   %s\n", time.Since(start).Round(100*time.Millisecond))
	fmt.Fprintf(d.out, "consistent: %d of %d models match\n", matched, total)
	if matched != total {
		for _, m := range mismatches {
			fmt.Fprintln(d.errw, "  mismatch:", m)
		}
		return fmt.Errorf("%d of %d models differ from the fold of their sorted events", total-matched, total)
	}
	return nil
}

// createDemoDatabase (re)creates the demo database on the server of dbURL and returns its
// URL and the function that drops it (unless keep).
func createDemoDatabase(ctx context.Context, dbURL, name string, keep bool) (string, func() error, error) {
	admin, err := connectOne(ctx, dbURL)
	if err != nil {
		return "", nil, err
	}
	defer admin.Close(context.Background()) // its only error is the socket's, once the statements' outcome is known
	ident := pgx.Identifier{name}.Sanitize()
	if _, err := admin.Exec(ctx, "DROP DATABASE IF EXISTS "+ident+" WITH (FORCE)"); err != nil {
		return "", nil, fmt.Errorf("drop old demo database: %w", err)
	}
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+ident); err != nil {
		return "", nil, fmt.Errorf("create demo database (the demo needs CREATE DATABASE rights): %w", err)
	}
	u, err := url.Parse(dbURL)
	if err != nil {
		return "", nil, fmt.Errorf("invalid database URL: %w", err)
	}
	u.Path = "/" + name
	drop := func() error {
		if keep {
			return nil
		}
		dctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		a, err := connectOne(dctx, dbURL)
		if err != nil {
			return err
		}
		defer a.Close(dctx) // its only error is the socket's, once the statement's outcome is known
		_, err = a.Exec(dctx, "DROP DATABASE IF EXISTS "+ident+" WITH (FORCE)")
		return err
	}
	return u.String(), drop, nil
}

func connectOne(ctx context.Context, dbURL string) (*pgx.Conn, error) {
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	c, err := pgx.Connect(cctx, dbURL)
	if err != nil {
		return nil, &connectError{url: redact(dbURL), err: err}
	}
	return c, nil
}

// startInstances starts the worker processes and waits until each is ready.
func (d *demo) startInstances(ctx context.Context, demoURL string) error {
	exe, err := os.Executable()
	if err != nil {
		return fmt.Errorf("find own executable: %w", err)
	}
	for range d.cfg.instances {
		if err := d.startInstance(exe, demoURL, 1); err != nil {
			return err
		}
	}
	return d.waitReady(ctx, d.procs)
}

// startInstance starts one worker instance running version of the demo perspective.
func (d *demo) startInstance(exe, demoURL string, version int) error {
	p := &demoProc{id: uuid.Must(uuid.NewV7()), stdout: &bytes.Buffer{}, ready: make(chan struct{}), exited: make(chan error, 1)}
	p.cmd = exec.Command(exe, demoWorkerCommand, "--database-url", demoURL, "--instance", p.id.String(),
		"--lock-timeout", d.cfg.lockTimeout.String(), "--apply-delay", d.cfg.applyDelay.String(),
		"--version", strconv.Itoa(version))
	p.cmd.Stderr = d.errw
	out, err := p.cmd.StdoutPipe()
	if err != nil {
		return err
	}
	if err := p.cmd.Start(); err != nil {
		return fmt.Errorf("start worker instance: %w", err)
	}
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			if sc.Text() == "ready" {
				close(p.ready)
				continue
			}
			p.stdout.Write(append(sc.Bytes(), '\n'))
		}
		p.exited <- p.cmd.Wait()
	}()
	d.procs = append(d.procs, p)
	return nil
}

// waitReady waits until every instance of procs has started.
func (d *demo) waitReady(ctx context.Context, procs []*demoProc) error {
	for _, p := range procs {
		select {
		case <-p.ready:
		case err := <-p.exited:
			p.killed = true // it has exited: stopAll does not wait for it again
			return fmt.Errorf("worker instance %s exited at start: %v", shortid.String(p.id), err)
		case <-time.After(60 * time.Second):
			return fmt.Errorf("worker instance %s did not start within 60s", shortid.String(p.id))
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// plan makes the events of every stream (IDs ascending, so ID order is the true order)
// and the rounds in which they are appended: each on time, or a few rounds late.
func (d *demo) plan() (map[uuid.UUID][]worker.Event, [][]worker.Event) {
	const nRounds = 40
	all := make(map[uuid.UUID][]worker.Event, d.cfg.streams)
	rounds := make([][]worker.Event, nRounds)
	for range d.cfg.streams {
		s := uuid.Must(uuid.NewV7())
		evs := make([]worker.Event, d.cfg.events)
		for i := range evs {
			evs[i] = worker.Event{ID: uuid.Must(uuid.NewV7()), StreamID: s, Type: "amount",
				Data: json.RawMessage(fmt.Sprintf(`{"n":%d}`, d.rng.IntN(1000)))}
		}
		sort.Slice(evs, func(i, j int) bool { return bytes.Compare(evs[i].ID[:], evs[j].ID[:]) < 0 })
		all[s] = evs
		for i, ev := range evs {
			r := i * nRounds / len(evs)
			if i > 0 && d.rng.Float64() < d.cfg.late {
				r = min(nRounds-1, r+2+d.rng.IntN(4))
				d.lateN++
			}
			rounds[r] = append(rounds[r], ev)
		}
	}
	return all, rounds
}

type killReport struct {
	midRewind bool
	held      []locker.Lock
}

// killMidRewind waits until the victim holds a rewind lock, then SIGKILLs it (no release,
// no cleanup). It kills it anyway when ctx ends first.
func (d *demo) killMidRewind(ctx context.Context, victim *demoProc) killReport {
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	var rep killReport
	listFailed := false
	for {
		locks, err := d.locks.List(context.WithoutCancel(ctx))
		if err != nil && !listFailed {
			listFailed = true // said once: it tries again every tick
			d.warnf("listing the locks to find a rewind to kill failed: %v", err)
		}
		if err == nil {
			var mine []locker.Lock
			rewinding := false
			for _, l := range locks {
				if l.InstanceID == victim.id {
					mine = append(mine, l)
					rewinding = rewinding || l.Reason == locker.ReasonRewind
				}
			}
			if rewinding {
				rep = killReport{midRewind: true, held: mine}
				break
			}
		}
		select {
		case <-tick.C:
			continue
		case <-ctx.Done():
		}
		break
	}
	d.signal(victim, syscall.SIGKILL)
	victim.killed = true
	<-victim.exited
	return rep
}

// waitDrained waits until no event is queued and no lock is held.
func (d *demo) waitDrained(ctx context.Context, timeout time.Duration) error {
	q := pgq.New(d.pool)
	deadline := time.Now().Add(timeout)
	last := time.Time{}
	for {
		n, err := q.QueueCount(ctx)
		if err != nil {
			return err
		}
		locks, err := d.locks.List(ctx)
		if err != nil {
			return err
		}
		if n == 0 && len(locks) == 0 {
			d.logf("queue drained")
			return nil
		}
		if time.Since(last) > 2*time.Second {
			d.logf("waiting: %d events queued, %d locks held", n, len(locks))
			last = time.Now()
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("queue not drained after %s: %d events queued, %d locks held", timeout, n, len(locks))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// takeovers counts the pairs the killed instance held that other instances finished.
func (d *demo) takeovers(ctx context.Context, held []locker.Lock) (int, error) {
	q := pgq.New(d.pool)
	n := 0
	for _, l := range held {
		c, err := q.CursorGet(ctx, db.CursorGetParams{StreamID: l.StreamID, PerspectiveName: l.PerspectiveName})
		if err != nil {
			return 0, err
		}
		left, err := q.QueueCountFor(ctx, db.QueueCountForParams{PerspectiveName: l.PerspectiveName, StreamID: uuid.NullUUID{UUID: l.StreamID, Valid: true}})
		if err != nil {
			return 0, err
		}
		if left == 0 && c.LastEventID.Valid && (!c.StreamLockInstanceID.Valid || c.StreamLockInstanceID.UUID != l.InstanceID) {
			n++
		}
	}
	return n, nil
}

// stopSurvivors SIGTERMs the live instances and collects their stats.
func (d *demo) stopSurvivors() []demoStats {
	var out []demoStats
	for _, p := range d.procs {
		if p.killed {
			continue
		}
		d.signal(p, syscall.SIGTERM)
		select {
		case <-p.exited:
		case <-time.After(30 * time.Second):
			d.signal(p, syscall.SIGKILL)
			<-p.exited
		}
		p.killed = true
		var s demoStats
		if err := json.Unmarshal(bytes.TrimSpace(p.stdout.Bytes()), &s); err != nil {
			d.warnf("instance %s left no stats (the report leaves it out): %v", shortid.String(p.id), err)
			continue
		}
		out = append(out, s)
	}
	return out
}

// stopAll kills whatever instance is still running (error paths).
func (d *demo) stopAll() {
	var wg sync.WaitGroup
	for _, p := range d.procs {
		if p.killed {
			continue
		}
		p.killed = true
		wg.Add(1)
		go func() {
			defer wg.Done()
			d.signal(p, syscall.SIGKILL)
			<-p.exited
		}()
	}
	wg.Wait()
}

// signal sends sig to p's process, saying so when that fails but for a process that has
// exited already.
func (d *demo) signal(p *demoProc, sig syscall.Signal) {
	if err := p.cmd.Process.Signal(sig); err != nil && !errors.Is(err, os.ErrProcessDone) {
		d.warnf("signalling instance %s (%s): %v", shortid.String(p.id), sig, err)
	}
}

// changeVersion deploys version 2 of the demo perspective as a rolling deployment would: one
// instance running it joins those running version 1; it builds version 2 from the event store
// beside version 1, and is promoted once caught up. It returns how long that took.
func (d *demo) changeVersion(ctx context.Context, demoURL string) (time.Duration, error) {
	exe, err := os.Executable()
	if err != nil {
		return 0, err
	}
	start := time.Now()
	if err := d.startInstance(exe, demoURL, 2); err != nil {
		return 0, err
	}
	if err := d.waitReady(ctx, d.procs[len(d.procs)-1:]); err != nil {
		return 0, err
	}
	d.logf("deployed version 2 of %s on a new instance, beside version 1", demoPerspectiveName)
	admin, err := worker.NewAdmin(d.pool, nil)
	if err != nil {
		return 0, err
	}
	deadline := time.Now().Add(2 * time.Minute)
	for {
		v, err := admin.Versions(ctx)
		if err != nil {
			return 0, err
		}
		for _, b := range v.Builds {
			if b.Perspective == demoPerspectiveName && b.Version == 2 && b.State == worker.BuildActive {
				took := time.Since(start)
				d.logf("version 2 caught up with the store (%d events) and was promoted; readers get it now", b.CatchUpEvents)
				time.Sleep(500 * time.Millisecond) // the version-1 instances notice at their next look
				return took, nil
			}
		}
		if time.Now().After(deadline) {
			return 0, fmt.Errorf("version 2 was not promoted within 2 minutes")
		}
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// check compares every stream's model with the fold, by version of the perspective, of its
// stored events sorted by ID.
func (d *demo) check(ctx context.Context, all map[uuid.UUID][]worker.Event, version int) (matched, total int, mismatches []string, err error) {
	q := pgq.New(d.pool)
	admin, err := worker.NewAdmin(d.pool, nil)
	if err != nil {
		return 0, 0, nil, err
	}
	skips, err := admin.Skipped(ctx, demoPerspectiveName, worker.MaxListed)
	if err != nil {
		return 0, 0, nil, err
	}
	skipped := map[uuid.UUID]bool{}
	for _, s := range skips {
		skipped[s.Event] = true
	}
	for s := range all {
		total++
		stored, err := q.EventsForStream(ctx, s) // ORDER BY event_id
		if err != nil {
			return 0, 0, nil, err
		}
		var want demoModel
		for _, e := range stored {
			if skipped[e.EventID] {
				continue // recorded as skipped by an operator: not in the model
			}
			if want, err = foldDemo(version, want, worker.Event{ID: e.EventID, StreamID: e.StreamID, Type: e.EventType, Data: e.Data}); err != nil {
				return 0, 0, nil, err
			}
		}
		raw, ok, err := worker.LoadModel(ctx, d.pool, demoPerspectiveName, s)
		if err != nil {
			return 0, 0, nil, err
		}
		var got demoModel
		if ok {
			if err := json.Unmarshal(raw, &got); err != nil {
				return 0, 0, nil, err
			}
		}
		if ok && got == want && want.Count == len(all[s]) {
			matched++
		} else {
			mismatches = append(mismatches, fmt.Sprintf("stream %s: model %+v, expected %+v", s, got, want))
		}
	}
	return matched, total, mismatches, nil
}

// poisoned is what the poison event did.
type poisoned struct {
	stream   uuid.UUID
	attempts int
	parkedIn time.Duration
}

// poison appends an event the perspective cannot apply, and one after it, to a stream; waits
// until the workers park the pair (their failure policy: three tries), shows it as
// perspectives failed would, and skips the event as an operator would (perspectives skip),
// then waits until the event after it is applied. The event after it joins all (the
// consistency check expects it); the skipped one is left out by the check.
func (d *demo) poison(ctx context.Context, all map[uuid.UUID][]worker.Event) (poisoned, error) {
	admin, err := worker.NewAdmin(d.pool, nil)
	if err != nil {
		return poisoned{}, err
	}
	streams := slices.SortedFunc(maps.Keys(all), func(a, b uuid.UUID) int { return strings.Compare(a.String(), b.String()) })
	p := poisoned{stream: streams[0]}
	bad := worker.Event{ID: uuid.Must(uuid.NewV7()), StreamID: p.stream, Type: "amount", Data: json.RawMessage(`{"n":"poison"}`)}
	after := worker.Event{ID: uuid.Must(uuid.NewV7()), StreamID: p.stream, Type: "amount", Data: json.RawMessage(`{"n":1}`)}
	start := time.Now()
	if err := worker.Append(ctx, d.pool, bad, after); err != nil {
		return p, err
	}
	all[p.stream] = append(all[p.stream], after)
	deadline := time.Now().Add(30 * time.Second)
	for {
		failed, err := admin.Failed(ctx, demoPerspectiveName, 10)
		if err != nil {
			return p, err
		}
		if i := slices.IndexFunc(failed, func(f worker.FailedPair) bool { return f.Stream == p.stream && f.Parked }); i >= 0 {
			f := failed[i]
			p.attempts, p.parkedIn = f.Attempts, time.Since(start)
			d.logf("poison event %s parked stream %s (version %d) after %d failures: %s", shortid.String(f.Event), shortid.String(p.stream), f.Version, f.Attempts, clip(f.LastError, 100))
			break
		}
		if time.Now().After(deadline) {
			return p, fmt.Errorf("the poison event's pair was not parked within 30s")
		}
		select {
		case <-ctx.Done():
			return p, ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
	if _, err := admin.Skip(ctx, p.stream, demoPerspectiveName, bad.ID, "demo operator"); err != nil {
		return p, err
	}
	d.logf("operator skipped event %s (perspectives skip); the event after it is applied next", shortid.String(bad.ID))
	return p, d.waitDrained(ctx, time.Minute)
}

// syncWriter serializes writes from the instances' output copiers.
type syncWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (s *syncWriter) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.w.Write(p)
}
