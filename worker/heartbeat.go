package worker

// The heartbeat: each instance's row in wh_instances, refreshed every HeartbeatInterval
// (queries/heartbeat.sql).

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"

	"github.com/perspectives-go/perspectives/db"
)

// HeartbeatInterval is how often a running worker records in wh_instances that it is alive.
// The interval is stored in the row: readers judge an instance gone when its row is older
// than three intervals, on the database clock (Admin.Instances, perspectives status).
const HeartbeatInterval = 5 * time.Second

// heartbeatTimeout bounds each heartbeat write (and the wait for a pool connection): a
// heartbeat never holds a connection for long.
const heartbeatTimeout = 2 * time.Second

// instanceForgetAfter is how long the row of an instance that never stopped cleanly (it was
// killed) is kept after it was last seen: the holder of the instances lease deletes older
// ones (forget.go).
const instanceForgetAfter = 24 * time.Hour

// errInstanceRowGone is a heartbeat's error when the instance's row was deleted while it
// runs (by hand, or by another instance after instanceForgetAfter without a heartbeat).
var errInstanceRowGone = errors.New("the instance's row was deleted while it runs: it is written again at the next heartbeat")

// instanceRecord is what the heartbeat records of an instance.
type instanceRecord struct {
	ID           uuid.UUID
	Host         string
	PID          int
	Interval     time.Duration
	Perspectives []PerspectiveVersion
	Rates        []float64 // events applied per second over the last interval, per Perspectives[i]
	SinkMillis   []float64 // mean time of a sink's Write per commit over the last interval, per Perspectives[i] (0: none)
}

// instanceRecorder is where heartbeats are written: the pgStore. A Store without it (a unit
// test's mock) records no heartbeats.
type instanceRecorder interface {
	// beat inserts or refreshes the instance's row, last seen now (database clock).
	beat(ctx context.Context, r instanceRecord) error
	// refresh refreshes the instance's row, and never inserts it: false when there is none.
	refresh(ctx context.Context, r instanceRecord) (bool, error)
	// forget deletes the instance's row.
	forget(ctx context.Context, id uuid.UUID) error
	// forgetGone deletes the rows of instances not seen for longer than after, fenced by
	// fence (see LeaderLease).
	forgetGone(ctx context.Context, after time.Duration, fence LeaderLease) (int64, error)
}

// heartbeat records an instance every interval until stopped, then deletes its row. A
// failed write is logged (a warning the first time, then debug until one succeeds again)
// and never stops the worker.
type heartbeat struct {
	rec instanceRecorder
	row instanceRecord
	log *slog.Logger

	// counts is what the instance did per perspective (per row.Perspectives[i]) since it
	// started; nil: none counted. Each write turns it into row.Rates and row.SinkMillis.
	counts func() []perspectiveCount
	last   []perspectiveCount
	lastAt time.Time

	mu       sync.Mutex // one write at a time
	failing  bool       // the last write failed
	recorded bool       // the row was written: later writes only refresh it

	svc service // runs the periodic writes
}

// newInstanceRecord is this process's record for instance id running perspectives.
func newInstanceRecord(id uuid.UUID, interval time.Duration, perspectives []PerspectiveVersion) instanceRecord {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "unknown"
	}
	return instanceRecord{ID: id, Host: host, PID: os.Getpid(), Interval: interval, Perspectives: perspectives}
}

// startHeartbeat records row at once (bounded by heartbeatTimeout), and keeps recording row
// every row.Interval in the background, as a service: the writes are not tied to ctx (stop
// ends them).
func startHeartbeat(ctx context.Context, rec instanceRecorder, row instanceRecord, counts func() []perspectiveCount, log *slog.Logger) *heartbeat {
	h := &heartbeat{rec: rec, row: row, log: log, counts: counts}
	bg := context.WithoutCancel(ctx)
	h.write(bg)
	_ = h.svc.Start(bg) // a fresh service: it starts
	h.svc.Go(h.run)
	return h
}

// run writes the row every interval until stopping; the write in progress when it stops
// ends first (bounded by heartbeatTimeout), cut short only by a hard stop (ctx).
func (h *heartbeat) run(ctx, stopping context.Context) {
	tick := time.NewTicker(h.row.Interval)
	defer tick.Stop()
	for {
		select {
		case <-stopping.Done():
			return
		case <-tick.C:
			h.write(ctx)
		}
	}
}

// write records the row once, bounded by heartbeatTimeout.
func (h *heartbeat) write(ctx context.Context) {
	h.mu.Lock()
	defer h.mu.Unlock()
	now := time.Now()
	h.rates(now)
	// Only the first write inserts the row (and the one after a refresh found none). A
	// refresh that runs on the server after its client gave up on it cannot bring back the
	// row that stop deletes next, which would show the instance alive for three more
	// intervals.
	wctx, cancel := context.WithTimeout(ctx, heartbeatTimeout)
	var err error
	if h.recorded {
		var found bool
		if found, err = h.rec.refresh(wctx, h.row); err == nil && !found {
			h.recorded = false
			err = errInstanceRowGone
		}
	} else {
		err = h.rec.beat(wctx, h.row)
		h.recorded = err == nil
	}
	cancel()
	was := h.failing
	h.failing = err != nil
	switch {
	case err != nil && !was:
		h.log.Warn("heartbeat not recorded; will retry (readers may take this instance for gone)",
			slog.Any("error", err), slog.Duration("interval", h.row.Interval))
	case err != nil:
		h.log.Debug("heartbeat not recorded", slog.Any("error", err))
	case was:
		h.log.Info("heartbeat recorded again")
	}
}

// rates sets row.Rates to the events applied per second since the last write, and
// row.SinkMillis to the mean time of a sink's Write per commit meanwhile (zero at the first).
func (h *heartbeat) rates(now time.Time) {
	if h.counts == nil {
		return
	}
	cur := h.counts()
	rates, sinks := make([]float64, len(cur)), make([]float64, len(cur))
	if secs := now.Sub(h.lastAt).Seconds(); h.last != nil && secs > 0 {
		for i, c := range cur {
			rates[i] = float64(c.applied-h.last[i].applied) / secs
			if writes := c.sinkWrites - h.last[i].sinkWrites; writes > 0 {
				sinks[i] = float64(c.sinkNanos-h.last[i].sinkNanos) / float64(writes) / 1e6
			}
		}
	}
	h.row.Rates, h.row.SinkMillis, h.last, h.lastAt = rates, sinks, cur, now
}

// stop ends the heartbeats and deletes the instance's row, under ctx and bounded by
// releaseTimeout: it returns by ctx's deadline plus at most the write in progress
// (heartbeatTimeout). A write in progress ends first, not cancelled unless ctx ends; one
// that its client gave up on and that runs on the server after the deletion only refreshes
// (see write), so it cannot bring the row back.
func (h *heartbeat) stop(ctx context.Context) {
	_ = h.svc.Stop(ctx)
	ctx, cancel := context.WithTimeout(ctx, releaseTimeout)
	defer cancel()
	if err := h.rec.forget(ctx, h.row.ID); err != nil {
		h.log.Warn("instance row not deleted at stop; readers will see it gone after three heartbeat intervals",
			slog.Any("error", err))
	}
}

// running is the perspectives this worker runs, each with its version.
func (w *Worker) running() []PerspectiveVersion {
	out := make([]PerspectiveVersion, len(w.names))
	for i, name := range w.names {
		out[i] = PerspectiveVersion{Name: name, Version: versionOf(w.persp[name])}
	}
	return out
}

// perspectiveCounter counts what the instance did for one perspective since it started.
type perspectiveCounter struct {
	applied    atomic.Int64 // events applied
	sinkNanos  atomic.Int64 // time in its sink's Write
	sinkWrites atomic.Int64 // its sink's Writes that succeeded
}

// perspectiveCount is a perspectiveCounter read at one time.
type perspectiveCount struct{ applied, sinkNanos, sinkWrites int64 }

// counter is the counter of the build key's perspective (nil: not one this instance runs).
func (w *Worker) counter(key string) *perspectiveCounter {
	if i := slices.Index(w.names, w.buildOf(key).Perspective); i >= 0 {
		return &w.counts[i]
	}
	return nil
}

// countApplied adds n events applied to a pair of the build key to its perspective's count.
func (w *Worker) countApplied(key string, n int) {
	if c := w.counter(key); c != nil && n > 0 {
		c.applied.Add(int64(n))
	}
}

// countSink adds a successful Write of the build key's sink that took d.
func (w *Worker) countSink(key string, d time.Duration) {
	if c := w.counter(key); c != nil {
		c.sinkNanos.Add(int64(d))
		c.sinkWrites.Add(1)
	}
}

// perspectiveCounts returns what the instance did per perspective since it started, in the
// order of w.running().
func (w *Worker) perspectiveCounts() []perspectiveCount {
	out := make([]perspectiveCount, len(w.counts))
	for i := range w.counts {
		c := &w.counts[i]
		out[i] = perspectiveCount{applied: c.applied.Load(), sinkNanos: c.sinkNanos.Load(), sinkWrites: c.sinkWrites.Load()}
	}
	return out
}

func (s *pgStore) beat(ctx context.Context, r instanceRecord) error {
	return s.q.InstanceBeat(ctx, db.InstanceBeatParams(instanceParams(r)))
}

func (s *pgStore) refresh(ctx context.Context, r instanceRecord) (bool, error) {
	n, err := s.q.InstanceRefresh(ctx, instanceParams(r))
	return n > 0, err
}

// instanceParams is r as InstanceRefresh's (and InstanceBeat's) parameters.
func instanceParams(r instanceRecord) db.InstanceRefreshParams {
	names, versions := make([]string, len(r.Perspectives)), make([]int32, len(r.Perspectives))
	for i, p := range r.Perspectives {
		names[i], versions[i] = p.Name, int32(p.Version)
	}
	return db.InstanceRefreshParams{
		InstanceID: r.ID, Host: r.Host, Pid: int32(r.PID), HeartbeatSeconds: r.Interval.Seconds(),
		Perspectives: names, Versions: versions, Rates: append(make([]float64, 0, len(names)), r.Rates...),
		SinkMs: append(make([]float64, 0, len(names)), r.SinkMillis...),
	}
}
