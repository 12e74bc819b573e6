package worker

import (
	"context"
	"fmt"
	"time"

	"github.com/google/uuid"

	"github.com/perspectives-go/perspectives/db"
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
// gone (an instance not seen for a day is forgotten when another starts).
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

func (s *pgStore) beat(ctx context.Context, r instanceRecord) error {
	names, versions := make([]string, len(r.Perspectives)), make([]int32, len(r.Perspectives))
	for i, p := range r.Perspectives {
		names[i], versions[i] = p.Name, int32(p.Version)
	}
	return s.q.InstanceBeat(ctx, db.InstanceBeatParams{
		InstanceID: r.ID, Host: r.Host, Pid: int32(r.PID), HeartbeatSeconds: r.Interval.Seconds(),
		Perspectives: names, Versions: versions, Rates: append(make([]float64, 0, len(names)), r.Rates...),
	})
}

func (s *pgStore) forget(ctx context.Context, id uuid.UUID) error {
	return s.q.InstanceDelete(ctx, id)
}

func (s *pgStore) forgetGone(ctx context.Context, after time.Duration) (int64, error) {
	return s.q.InstancesForget(ctx, after.Seconds())
}
