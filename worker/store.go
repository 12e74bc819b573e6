package worker

//go:generate go tool moq -rm -out ../mocks/store.go -pkg mocks . Store

import (
	"context"
	"encoding/json"
	"errors"
	"time"

	"github.com/google/uuid"
)

// Store is what the worker does with the database, one method per thing it does: claim due
// pairs, apply a group of pairs in one transaction, rewind, bootstrap, purge, record a
// failure, wait for notifications. The worker decides; the Store runs the statements. The
// worker's own implementation runs the sqlc queries of queries/ on a pgx pool; unit tests
// replace it with a mock (mocks.StoreMock).
type Store interface {
	// Register records a perspective, and the build an instance running its version
	// applies (planRegistration decides, under the exclusive append lock, without scanning
	// anything). It returns every build of the perspective afterwards.
	Register(ctx context.Context, perspective string, version int) ([]Build, error)
	// Builds returns every build of the perspectives.
	Builds(ctx context.Context, perspectives []string) ([]Build, error)
	// CatchUp runs one page of a build's catch-up in one transaction: it takes or renews
	// the build's catch-up lease (req.Instance, for req.Lease), reads the next req.PageSize
	// stored events after the build's position in (stream, event) order, passes them to fold,
	// writes what fold returns (deleting the queue rows of the applied events that were
	// queued, and queueing a failed stream's events from its failing one on), and moves the
	// position under the fencing check. With no event left it ends the catch-up.
	CatchUp(ctx context.Context, req CatchUpRequest, fold func(CatchUpPage) []PairWrite) (CatchUpResult, error)
	// Promote makes the build key the perspective's active one and retires the active
	// one, in one transaction, when key's catch-up is done and (unless forced) its queue is
	// no further behind than the active build's. It reports whether it promoted. The queue
	// check runs before that transaction, which holds the exclusive side of the append lock
	// for key lookups and the flip only. Fenced by fence (see LeaderLease): ErrNotLeader,
	// and nothing written, unless its holder holds the lease.
	Promote(ctx context.Context, perspective, key string, force bool, fence LeaderLease) (bool, error)
	// Cleanup deletes the rows of up to batch pairs of a retired build of the perspectives,
	// retired at least grace ago. It reports whether any such build has rows left. Fenced
	// by fence, as Promote.
	Cleanup(ctx context.Context, perspectives []string, grace time.Duration, batch int, fence LeaderLease) (more bool, err error)
	// Claim leases up to req.Limit due pairs, oldest due first (one statement: see
	// PairsClaim), for req.Lease on the database clock. It also says when the next pair of
	// those builds that is not due yet becomes due (the zero time: none is waiting).
	Claim(ctx context.Context, req ClaimRequest) (Claimed, error)
	// Release ends req.Instance's leases on pairs whose job has ended: a pair with nothing
	// queued loses its due row, the others are due at their oldest queued event, or
	// req.Later[p] from now when given. It never leaves a queued event without a due row,
	// even while an Append to the pair is in flight (see wh_pairs_release).
	Release(ctx context.Context, req ReleaseRequest) error
	// Apply runs one transaction over pairs: it locks their cursor rows (skipping, and
	// returning as busy, those another transaction holds), reads each locked pair's state
	// (at most perPair queued events, and its model), passes the states to decide and
	// writes what decide returns. An error rolls everything back.
	Apply(ctx context.Context, pairs []Pair, perPair int, decide func([]PairState) []PairWrite) (busy []Pair, err error)
	// RewindStart reads what a rewind starts from (not in a transaction).
	RewindStart(ctx context.Context, p Pair) (RewindStart, error)
	// Replay returns up to limit events of the pair's stream after the event after
	// (exclusive) and up to upto (inclusive), in ID order, without those the pair skipped.
	Replay(ctx context.Context, p Pair, after, upto uuid.UUID, limit int) ([]Event, error)
	// RewindCommit writes a rewind's result in one transaction that holds the pair's cursor
	// row, after the fencing check: it returns ErrLockLost, writing nothing, unless
	// c.Holder (when not nil) holds an unexpired stream lock on the pair, and
	// ErrCursorMoved unless the cursor's version is still c.Version.
	RewindCommit(ctx context.Context, c RewindCommit) error
	// Bootstrap stores the pair's model, read together with its cursor under the cursor row
	// lock, as a snapshot at the cursor's position. It reports whether it wrote one (not
	// when the pair has no model).
	Bootstrap(ctx context.Context, p Pair) (bool, error)
	// Purge deletes the pair's model and snapshots and resets its cursor, in one
	// transaction holding the cursor row. When holder is not nil it first checks that
	// holder holds an unexpired stream lock on the pair, and returns ErrLockLost otherwise.
	Purge(ctx context.Context, p Pair, holder uuid.UUID) error
	// MarkFailed records a failure of the pair in one transaction: under its cursor row lock
	// it passes the pair's failures of f.Event so far to decide, which returns what it does
	// (retry with backoff, park, skip f.Event: see FailureAction), and writes f with that
	// action. It returns the action written.
	MarkFailed(ctx context.Context, p Pair, f Failure, decide func(failures int) FailureAction) (FailureAction, error)
	// Listen calls notify once subscribed to the queue's notification (which every committed
	// Append that queued rows sends, and every other statement that makes pairs due), and
	// then for each notification, until ctx ends or the subscription fails. It returns
	// ErrNotificationsLost when the connection cannot receive notifications at all (it goes
	// through a pooler): the worker then polls only, and says so once.
	Listen(ctx context.Context, notify func()) error
	// Status reports every build with its catch-up progress and queue (metrics).
	Status(ctx context.Context) ([]BuildStatus, error)
}

// ErrCursorMoved means the cursor changed while a long operation ran (another writer got
// there first): its write is refused, and the next cycle retries.
var ErrCursorMoved = errors.New("cursor moved during the operation")

// Pair names one (stream, perspective).
type Pair struct {
	Stream      uuid.UUID
	Perspective string
}

// ClaimRequest asks Store.Claim for due pairs.
type ClaimRequest struct {
	Instance     uuid.UUID     // the lease holder
	Perspectives []string      // the build keys this instance runs
	Limit        int           // at most this many pairs
	Lease        time.Duration // how long the lease lasts: the pairs are due again then if not released
}

// Claimed is what Store.Claim leased.
type Claimed struct {
	Pairs []Pair
	// NextDue is when the first pair of those builds that is not due yet becomes due (a
	// backoff ending, a lease lapsing); the zero time: none is waiting.
	NextDue time.Time
}

// ReleaseRequest asks Store.Release to end leases.
type ReleaseRequest struct {
	Instance uuid.UUID
	Pairs    []Pair
	// Later holds the pairs due again only after a wait (held by another transaction; a
	// failure that could not be recorded), and that wait.
	Later map[Pair]time.Duration
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

// Failure is a failed operation on a pair, to record on it.
type Failure struct {
	Cause  string        // the error, as recorded (empty: no failure)
	Event  uuid.UUID     // the event whose Apply failed (uuid.Nil: not one event's failure)
	Action FailureAction // what it does to the pair (Store.MarkFailed: its decide says)
}

// FailureAction is what a recorded failure does to its pair: the pair's failure policy
// decides it from the failures in a row so far.
type FailureAction string

// The failure actions.
const (
	FailureRetry FailureAction = "retry" // retried after the backoff
	FailurePark  FailureAction = "park"  // parked: waits for an operator (retry or skip)
	FailureSkip  FailureAction = "skip"  // Failure.Event is skipped (recorded); the pair goes on
)

// RewindStart is what a rewind starts from.
type RewindStart struct {
	Version     int64         // the cursor's version: the commit is refused if it changed
	LastEventID uuid.NullUUID // the cursor's position
	Queued      []uuid.UUID   // the pair's queued event IDs, ascending
	From        *Snapshot     // the newest snapshot strictly before Queued[0]; nil: none
	Snapshots   []uuid.UUID   // every snapshot position before Queued[0], newest first
}

// RewindCommit is a rewind's result, written by Store.RewindCommit.
type RewindCommit struct {
	Write    PairWrite // the replayed model; Applied are the queued events the replay covered
	Version  int64     // fencing: the cursor version the rewind started from
	Holder   uuid.UUID // fencing: the instance that must hold the stream lock; uuid.Nil: no locker
	DropFrom uuid.UUID // snapshots at or after this event (the late one) are invalid
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
}

// CatchUpRequest asks Store.CatchUp for one page.
type CatchUpRequest struct {
	Key      string        // the build
	Instance uuid.UUID     // the lease holder
	Lease    time.Duration // how long the lease lasts after this page
	PageSize int           // events per page
}

// CatchUpPage is one page of a catch-up, as fold receives it.
type CatchUpPage struct {
	Key    string
	Events []Event // in (stream, event) order
	// Streams is the state of each stream of the page, read under its cursor row lock
	// (a stream missing from it is held by another transaction): its stream lock, and for
	// Continued its model, cursor and snapshots.
	Streams map[uuid.UUID]PairState
	// Continued is the stream the previous page left unfinished (uuid.Nil: none): the
	// page's first, whose first events are already applied.
	Continued uuid.UUID
}

// CatchUpResult is what one Store.CatchUp call did.
type CatchUpResult struct {
	NotHeld bool // another instance holds the catch-up (or it is done): nothing read
	Done    bool // no event was left: the catch-up is over
	Events  int  // events read
	Applied int  // events applied (the others were queued, or failed)
}

// ErrNotificationsLost is returned by Store.Listen when its connection cannot receive the
// notifications it would subscribe to: it goes through a pooler (see Config.ListenConnect).
var ErrNotificationsLost = errors.New("LISTEN receives no notifications on this connection")
