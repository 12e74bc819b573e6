package worker

import (
	"context"
	"fmt"
	"time"

	"github.com/google/uuid"
)

// PerspectiveVersion names one version of a perspective.
type PerspectiveVersion struct {
	Name    string
	Version int
}

// Instance is a worker instance as its heartbeats recorded it (wh_instances). A running
// worker writes its row at Start and every HeartbeatInterval, and deletes it at Stop; the row
// of an instance that was killed stays, and shows it gone.
type Instance struct {
	ID                uuid.UUID
	Host              string // os.Hostname of its process
	PID               int
	Started           time.Time
	LastSeen          time.Time            // its last heartbeat
	SinceSeen         time.Duration        // how long ago LastSeen was, on the database clock
	HeartbeatInterval time.Duration        // the interval it writes heartbeats at
	Alive             bool                 // its last heartbeat is less than three intervals old (database clock)
	Perspectives      []PerspectiveVersion // the perspectives it runs, each with its version
	// Rates are the events it applied per second over its last heartbeat interval, per
	// Perspectives[i].
	Rates []float64
}

// Runs reports whether the instance runs that version of the perspective.
func (i Instance) Runs(perspective string, version int) bool {
	for _, p := range i.Perspectives {
		if p.Name == perspective && p.Version == version {
			return true
		}
	}
	return false
}

// Instances reports every worker instance recorded in the database, oldest first, alive or
// gone (an instance not seen for a day is forgotten by the holder of the instances lease,
// at one of its looks at the builds).
func (a *Admin) Instances(ctx context.Context) ([]Instance, error) {
	rows, err := a.store.q.InstancesList(ctx)
	if err != nil {
		return nil, fmt.Errorf("worker: instances: %w", err)
	}
	out := make([]Instance, len(rows))
	for i, r := range rows {
		ps := make([]PerspectiveVersion, 0, len(r.Perspectives))
		for k, name := range r.Perspectives {
			v := 0
			if k < len(r.Versions) {
				v = int(r.Versions[k])
			}
			ps = append(ps, PerspectiveVersion{Name: name, Version: v})
		}
		out[i] = Instance{
			ID: r.InstanceID, Host: r.Host, PID: int(r.Pid), Started: r.StartedAt, LastSeen: r.LastSeenAt,
			SinceSeen: micros(r.SeenAgoMicros), HeartbeatInterval: micros(r.HeartbeatMicros), Alive: r.Alive,
			Perspectives: ps, Rates: make([]float64, len(ps)),
		}
		copy(out[i].Rates, r.Rates)
	}
	return out, nil
}

var _ instanceRecorder = (*pgStore)(nil)

// Health is the verdict on a build that tells idle from stuck (perspectives status and the
// dashboard say it in words).
type Health int

// The verdicts, from the most to the least urgent of a build's states; BuildStatus.Health
// gives the first that holds.
const (
	HealthStuckParked     Health = iota // pairs are parked: an operator must retry or skip
	HealthStuckNoInstance               // events queued, or a catch-up to do, and no live instance runs its version
	HealthRetrying                      // pairs are failing, retried with backoff
	HealthCatchingUp                    // its catch-up from the store is under way
	HealthApplying                      // events are queued, and live instances apply them
	HealthIdleNoInstance                // nothing to do, and no live instance runs its version
	HealthIdle                          // nothing to do
)

// Health says whether the build is idle, busy or stuck.
func (b BuildStatus) Health() Health {
	switch {
	case b.Parked > 0:
		return HealthStuckParked
	case b.LiveInstances == 0 && (b.Queued > 0 || !b.CatchUpDone):
		return HealthStuckNoInstance
	case b.Failing > 0:
		return HealthRetrying
	case !b.CatchUpDone:
		return HealthCatchingUp
	case b.Queued > 0:
		return HealthApplying
	case b.LiveInstances == 0:
		return HealthIdleNoInstance
	}
	return HealthIdle
}
