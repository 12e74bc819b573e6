package ui

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/google/uuid"

	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/worker"
)

// overviewPage is the perspectives page: every version that is not retired, with the
// counts the header cards show.
type overviewPage struct {
	Builds         []buildRow
	StoredEvents   int64
	Estimated      bool
	InstancesAlive int
	InstancesGone  int
	Locks          int
	Failing        int64
	Parked         int64
	Queued         int64
}

// buildRow is one version of a perspective as the overview shows it.
type buildRow struct {
	worker.BuildStatus
	Percent  float64 // catch-up progress, 0 to 100
	Progress string  // its words
	Rate     string  // catch-up events per second since it began ("" when not catching up)
	ETA      string
	Health   string
	Level    string // ok, warn, bad: the colour of Health
}

func (h *handler) overview(ctx context.Context, _ *http.Request) (string, string, any, error) {
	const title = "Perspectives"
	v, err := h.admin.Versions(ctx)
	if err != nil {
		return "", title, nil, err
	}
	ins, err := h.admin.Instances(ctx)
	if err != nil {
		return "", title, nil, err
	}
	locks, err := h.locks.ListStatus(ctx)
	if err != nil {
		return "", title, nil, err
	}
	p := overviewPage{StoredEvents: v.StoredEvents, Estimated: v.Estimated, Locks: len(locks)}
	for _, in := range ins {
		if in.Alive {
			p.InstancesAlive++
		} else {
			p.InstancesGone++
		}
	}
	now := time.Now()
	for _, b := range v.Builds {
		if b.State == worker.BuildRetired {
			continue
		}
		row := buildRow{BuildStatus: b}
		row.Percent, row.Progress, row.Rate, row.ETA = catchUp(b, v, now)
		row.Health, row.Level = health(b)
		p.Builds = append(p.Builds, row)
		p.Failing += b.Failing
		p.Parked += b.Parked
		p.Queued += b.Queued
	}
	return "overview", title, p, nil
}

// catchUp gives a build's catch-up progress and, while it runs, its rate and the time it
// still needs (from the events read since it began: no sampling).
func catchUp(b worker.BuildStatus, v worker.Versions, now time.Time) (pct float64, progress, rate, eta string) {
	if b.CatchUpDone {
		return 100, fmt.Sprintf("caught up (%s %s, %s %s)", count(b.CatchUpEvents), plural(b.CatchUpEvents, "event", "events"),
			count(b.CatchUpStreams), plural(b.CatchUpStreams, "stream", "streams")), "", ""
	}
	if v.StoredEvents > 0 {
		pct = min(100, 100*float64(b.CatchUpEvents)/float64(v.StoredEvents))
	}
	progress = fmt.Sprintf("%s of %s events, %s %s", count(b.CatchUpEvents), count(v.StoredEvents),
		count(b.CatchUpStreams), plural(b.CatchUpStreams, "stream", "streams"))
	if b.CatchUpStarted == nil || b.CatchUpEvents == 0 {
		return pct, progress, "", ""
	}
	elapsed := now.Sub(*b.CatchUpStarted).Seconds()
	if elapsed <= 0 {
		return pct, progress, "", ""
	}
	perSec := float64(b.CatchUpEvents) / elapsed
	left := max(v.StoredEvents-b.CatchUpEvents, 0)
	r := count(int64(perSec))
	if perSec < 10 {
		r = strconv.FormatFloat(perSec, 'f', 1, 64)
	}
	return pct, progress, r + " events/s", duration(time.Duration(float64(left)/perSec) * time.Second)
}

// health is the verdict that tells idle from stuck (BuildStatus.Health), in words and the
// level of its badge.
func health(b worker.BuildStatus) (string, string) {
	switch b.Health() {
	case worker.HealthStuckParked:
		return fmt.Sprintf("stuck: %d parked", b.Parked), "bad"
	case worker.HealthStuckNoInstance:
		return "stuck: no live instance runs it", "bad"
	case worker.HealthRetrying:
		return fmt.Sprintf("retrying %d failing", b.Failing), "warn"
	case worker.HealthCatchingUp:
		return "catching up", "info"
	case worker.HealthApplying:
		return "applying", "info"
	case worker.HealthIdleNoInstance:
		return "idle (no live instance)", "muted"
	default:
		return "idle", "ok"
	}
}

type instancesPage struct {
	Instances []worker.Instance
	Alive     int
}

func (h *handler) instances(ctx context.Context, _ *http.Request) (string, string, any, error) {
	const title = "Instances"
	ins, err := h.admin.Instances(ctx)
	if err != nil {
		return "", title, nil, err
	}
	p := instancesPage{Instances: ins}
	for _, in := range ins {
		if in.Alive {
			p.Alive++
		}
	}
	return "instances", title, p, nil
}

type locksPage struct {
	Locks   []lockRow
	Timeout time.Duration
}

type lockRow struct {
	locker.LockStatus
	Holder string // the holder's host and PID, when it is a recorded instance
	Alive  bool
}

func (h *handler) locksPage(ctx context.Context, _ *http.Request) (string, string, any, error) {
	const title = "Stream locks"
	locks, err := h.locks.ListStatus(ctx)
	if err != nil {
		return "", title, nil, err
	}
	ins, err := h.admin.Instances(ctx)
	if err != nil {
		return "", title, nil, err
	}
	byID := make(map[uuid.UUID]worker.Instance, len(ins))
	for _, in := range ins {
		byID[in.ID] = in
	}
	p := locksPage{Timeout: h.locks.Options().LockTimeout}
	for _, l := range locks {
		row := lockRow{LockStatus: l}
		if in, ok := byID[l.InstanceID]; ok {
			row.Holder, row.Alive = fmt.Sprintf("%s pid %d", in.Host, in.PID), in.Alive
		}
		p.Locks = append(p.Locks, row)
	}
	return "locks", title, p, nil
}

type failedPage struct {
	Parked    []worker.FailedPair
	Failing   []worker.FailedPair
	Skipped   []worker.SkippedEvent
	Truncated bool // more failing pairs than listed
	MaxFailed int
}

func (h *handler) failed(ctx context.Context, _ *http.Request) (string, string, any, error) {
	const title = "Failures"
	pairs, err := h.admin.Failed(ctx, "", maxFailed)
	if err != nil {
		return "", title, nil, err
	}
	skipped, err := h.admin.Skipped(ctx, "", maxSkipped)
	if err != nil {
		return "", title, nil, err
	}
	p := failedPage{Skipped: skipped, Truncated: len(pairs) == maxFailed, MaxFailed: maxFailed}
	for _, fp := range pairs {
		if fp.Parked {
			p.Parked = append(p.Parked, fp)
		} else {
			p.Failing = append(p.Failing, fp)
		}
	}
	return "failed", title, p, nil
}

// skipPage confirms a skip: the event, the pair's failure when it is its failing event,
// and the operator's name.
type skipPage struct {
	Stream      uuid.UUID
	Perspective string
	Event       uuid.UUID
	Pair        *worker.FailedPair // nil: the event is not the pair's failing event
}

func (h *handler) skipConfirm(ctx context.Context, r *http.Request) (string, string, any, error) {
	const title = "Skip an event"
	q := r.URL.Query()
	stream, name, event, err := pairArgs(q.Get("stream"), q.Get("perspective"), q.Get("event"), true)
	if err != nil {
		return "", title, nil, err
	}
	p := skipPage{Stream: stream, Perspective: name, Event: event}
	pairs, err := h.admin.Failed(ctx, name, worker.MaxListed)
	if err != nil {
		return "", title, nil, err
	}
	for i := range pairs {
		if pairs[i].Stream == stream && pairs[i].Event == event {
			p.Pair = &pairs[i]
			break
		}
	}
	return "skip", title, p, nil
}

// pairArgs parses a stream, a perspective name and (when withEvent) an event ID given by a
// form or a query; the error wraps locker.ErrInvalidArgument.
func pairArgs(stream, perspective, event string, withEvent bool) (uuid.UUID, string, uuid.UUID, error) {
	sid, err := uuid.Parse(stream)
	if err != nil {
		return uuid.Nil, "", uuid.Nil, fmt.Errorf("%w: stream %q is not a UUID", locker.ErrInvalidArgument, stream)
	}
	if err := locker.ValidatePair(sid, perspective); err != nil {
		return uuid.Nil, "", uuid.Nil, err
	}
	if !withEvent {
		return sid, perspective, uuid.Nil, nil
	}
	eid, err := uuid.Parse(event)
	if err != nil {
		return uuid.Nil, "", uuid.Nil, fmt.Errorf("%w: event %q is not a UUID", locker.ErrInvalidArgument, event)
	}
	return sid, perspective, eid, nil
}
