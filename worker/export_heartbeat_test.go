package worker

import (
	"context"
	"time"
)

// SetHeartbeatInterval sets the worker's heartbeat interval (HeartbeatInterval by default);
// call it before Start.
func (w *Worker) SetHeartbeatInterval(d time.Duration) { w.beatEvery = d }

// BeatNow writes the started worker's heartbeat once, as the periodic heartbeat does.
func (w *Worker) BeatNow() { w.beats.write(context.Background()) }
