package worker

//go:generate go tool moq -rm -out ../mocks/store.go -pkg mocks . Store

import (
	"encoding/json"
	"errors"
	"time"

	"github.com/google/uuid"
)

// Store is what the worker does with the database: one small interface per job, each
// declared in its job's file (claim.go, apply.go, rewind.go, …) with the worker's decisions
// and the pgStore methods that run its statements (queries/<job>.sql). The worker decides;
// the Store runs the statements. The worker's own implementation runs the sqlc queries of
// queries/ on a pgx pool; unit tests replace it with a mock (mocks.StoreMock).
type Store interface {
	ClaimStore
	ApplyStore
	RewindStore
	BootstrapStore
	PurgeStore
	FailureStore
	BuildStore
	CatchUpStore
	PromotionStore
	CleanupStore
	NotificationStore
}

// ErrCursorMoved means the cursor changed while a long operation ran (another writer got
// there first): its write is refused, and the next cycle retries.
var ErrCursorMoved = errors.New("cursor moved during the operation")

// Pair names one (stream, perspective).
type Pair struct {
	Stream      uuid.UUID
	Perspective string
}

// PairState is one pair as Store.Apply read it under its cursor row lock.
type PairState struct {
	Pair
	LastEventID   uuid.NullUUID   // the cursor: the last event the model includes (invalid: none yet)
	SinceSnapshot int             // events applied since the pair's last snapshot
	Snapshots     []uuid.UUID     // the pair's snapshot positions, newest first
	LockHolder    uuid.UUID       // the instance holding an unexpired stream lock on it; uuid.Nil: none
	Failures      int             // its failures in a row so far, of FailedEvent (0: it is not failing)
	FailedEvent   uuid.UUID       // the event that failed (uuid.Nil: none, or not one event's failure)
	Events        []Event         // its queued events, in ID order
	Model         json.RawMessage // its model (read only when it has events and a cursor position); nil: none
	ModelAt       uuid.UUID       // the last event Model includes
}

// Snapshot is a model as of an event (inclusive).
type Snapshot struct {
	EventID uuid.UUID
	Model   json.RawMessage
}

// PairWrite is what one pair's transaction writes.
type PairWrite struct {
	Pair
	// Applied are the events now in the model (their queue rows are deleted). When empty,
	// Model, LastEventID and SinceSnapshot are not written.
	Applied       []uuid.UUID
	Model         json.RawMessage
	LastEventID   uuid.UUID // the cursor's new position
	SinceSnapshot int
	Snapshots     []Snapshot  // snapshots to store
	DropSnapshots []uuid.UUID // snapshots to delete (the retention's victims)
	Failure       Failure     // when Failure.Cause is not empty: a failure to record
	// EnqueueFrom (catch-up only): queue the stream's stored events from this one on, for
	// the normal path to retry (uuid.Nil: none).
	EnqueueFrom uuid.UUID
}

// Build is one build of a perspective: a version, built once or rebuilt. Its pairs are
// keyed by Key wherever the tables say perspective_name.
type Build struct {
	Key         string
	Perspective string // the perspective's name
	Version     int
	N           int    // 1 for a version's first build, one more for each rebuild
	State       string // BuildBuilding, BuildActive or BuildRetired
	CatchUpDone bool   // the catch-up has read the whole store: the normal path has every pair
	// PromotionRequested: an operator asked for its promotion (Admin.Promote of a sink's
	// perspective), which the workers running its version carry out.
	PromotionRequested bool
}

// The states of a build.
const (
	BuildBuilding = "building" // catching up beside the active build
	BuildActive   = "active"   // read by LoadModel
	BuildRetired  = "retired"  // replaced; its rows are deleted in the background
)

// BuildStatus is a build with its progress and queue.
type BuildStatus struct {
	Build
	CatchUpStarted *time.Time    // when its catch-up began (nil: not yet)
	CatchUpEvents  int64         // events the catch-up has read
	CatchUpStreams int64         // streams it has passed
	Queued         int64         // events queued for the build
	OldestQueued   time.Duration // age of the oldest, on the database clock (0: none)
	Failing        int64         // pairs whose last attempt failed, retried with backoff (cursor status failed)
	Parked         int64         // pairs parked after repeated failures, waiting for an operator (status parked)
	LiveInstances  int64         // worker instances alive (heartbeats, database clock) that run the build's version
	// EventsPerSecond is the throughput of those instances: the events they applied to the
	// perspective per second over their last heartbeat interval, summed.
	EventsPerSecond float64
	// SinkMillis is the mean time of the perspective's sink's Write per committing
	// transaction on those instances over their last heartbeat interval, in milliseconds
	// (0: no sink, or nothing committed).
	SinkMillis float64
}
