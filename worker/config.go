package worker

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/perspectives-go/perspectives/locker"
)

// ErrInvalidConfig is wrapped by every error of New that refuses a Config.
var ErrInvalidConfig = errors.New("invalid worker config")

// Defaults of Config and SnapshotOptions.
const (
	DefaultPollInterval         = time.Second
	DefaultBatchSize            = 100
	DefaultSnapshotEveryNEvents = 100
	DefaultSnapshotMaxPerStream = 5
	DefaultRetryBackoff         = time.Second
	DefaultMaxRetryBackoff      = 5 * time.Minute
	MaxBatchSize                = 10000
	DefaultConcurrency          = 4
	MaxConcurrency              = 64
	DefaultGroupSize            = 50
	MaxGroupSize                = 1000
	DefaultCatchUpPageSize      = 20000
	MaxCatchUpPageSize          = 100000
)

// MaxPerspectiveNameLength is the longest name of a worker's perspective: the stream locks
// of its builds are named after their build keys (name@v<version>.<build>: buildKey), which
// must fit in locker.MaxPerspectiveNameLength with the longest version and build numbers.
const MaxPerspectiveNameLength = locker.MaxPerspectiveNameLength - len("@v2147483647.2147483647")

// SnapshotOptions control the restore points that make rewinds cheap.
type SnapshotOptions struct {
	// Disabled turns snapshots off: rewinds replay the whole stream. Default false.
	Disabled bool
	// EveryNEvents takes a snapshot each time this many events have been applied to a
	// (stream, perspective) (counted persistently, across batches). Default 100; must not
	// be negative.
	EveryNEvents int
	// MaxPerStream is how many snapshots are kept per (stream, perspective): the newest
	// MaxPerStream-1 and the oldest, so a very late event still finds a restore point.
	// Default 5; must not be negative; 1 keeps only the newest.
	MaxPerStream int
}

// Config configures a Worker. Zero fields take their defaults.
type Config struct {
	InstanceID   uuid.UUID      // zero: a new UUIDv7
	Perspectives []Perspective  // required, unique non-empty names
	Locker       locker.Locker  // nil: no cross-instance stream locks (the in-process coordinator still serializes)
	LockOptions  locker.Options // zero: the locker's own options (locker.Postgres), else defaults (30s, 10s); validated
	Snapshots    SnapshotOptions
	PollInterval time.Duration // default 1s; how often the queue is polled when idle
	BatchSize    int           // default 100, at most 10000: queued events of one pair applied per transaction
	Logger       *slog.Logger  // nil: slog.Default()

	// RetryBackoff is the first delay before a failed (stream, perspective) is retried;
	// it doubles with each further failure up to MaxRetryBackoff. Default 1s. A claim that
	// fails with an error other than a lost connection waits as long before the next one,
	// doubling up to 30s (MaxRetryBackoff when less).
	RetryBackoff time.Duration
	// MaxRetryBackoff caps the retry delay. Default 5m.
	MaxRetryBackoff time.Duration
	// MeterProvider receives the worker's metrics (docs/operations.md lists the instruments).
	// nil: otel.GetMeterProvider(), a no-op unless the application installs one.
	MeterProvider metric.MeterProvider
	// TracerProvider receives spans around rewinds, bootstraps and purges.
	// nil: otel.GetTracerProvider(), a no-op unless the application installs one.
	TracerProvider trace.TracerProvider
	// PollOnly turns off the LISTEN/NOTIFY wake-up: the worker then finds new events only
	// by polling every PollInterval. Default false: each committed Append wakes idle workers
	// at once, and polling remains the fallback.
	PollOnly bool
	// ListenConnect opens the session the worker LISTENs on for that wake-up, which every
	// WaitFor on the same pool in the process shares. LISTEN needs a session of its own, which a transaction pooler (PgBouncer in transaction mode) does not
	// keep: behind one, give it a direct connection to PostgreSQL, e.g.
	//
	//	ListenConnect: func(ctx context.Context) (*pgx.Conn, error) { return pgx.Connect(ctx, directURL) }
	//
	// Default nil: a connection of its own opened with the pool's ConnConfig (the pool's
	// BeforeConnect and AfterConnect hooks do not run for it), unless it goes through a pooler (its
	// server backend is not the one it was opened with): the worker then does not LISTEN
	// (PgBouncer 1.18 stops on notifications for a connection it has handed back), says so
	// once in the log and polls every PollInterval. Each time it subscribes, the worker also
	// checks that a notification it sends itself arrives within 2 seconds; when none does, it
	// polls and subscribes again later (with the backoff of a failed subscription).
	ListenConnect func(ctx context.Context) (*pgx.Conn, error)
	// Concurrency is how many groups of pairs (see GroupSize) one instance processes at
	// once; a long rewind holds one while the others go on. Default 4, at most 64. Each
	// takes a pool connection while it works.
	Concurrency int
	// CatchUpPageSize is how many stored events one page of a catch-up (a new perspective,
	// version or rebuild reading the event store) reads and applies in one transaction.
	// Default 20000, at most 100000. A build beside an active version (a new version, a
	// rebuild) pauses after each page as long as the page took, so that it uses at most half
	// the time and live application of the active version keeps the rest; a perspective's
	// first build (nothing to serve yet) runs flat out.
	CatchUpPageSize int
	// ManualPromotion leaves a caught-up new version (or rebuild) of a perspective building
	// until an operator promotes it (perspectives promote, or Admin.Promote). Default false:
	// it is promoted as soon as it has caught up, by the instance running the version that
	// holds the version's leader lease: set it alike on every instance of a version.
	ManualPromotion bool
	// FailurePolicy is what happens to a (stream, perspective) whose processing keeps
	// failing, for every perspective not in FailurePolicies. Zero fields take their
	// defaults: park after 8 failures in a row (see FailurePolicy).
	FailurePolicy FailurePolicy
	// FailurePolicies overrides FailurePolicy per perspective name (each must name one of
	// Perspectives); zero fields take their defaults.
	FailurePolicies map[string]FailurePolicy
	// GroupSize is how many (stream, perspective) pairs the normal path applies in one
	// transaction: a handful of statements and one commit for the whole group. A poll claims
	// up to GroupSize pairs per free Concurrency slot. Default 50, at most 1000; 1 applies
	// each pair in a transaction of its own.
	GroupSize int
}

func invalid(format string, args ...any) error {
	return fmt.Errorf("worker: %w: "+format, append([]any{ErrInvalidConfig}, args...)...)
}

// resolve returns cfg with its defaults filled in, validated.
func (cfg Config) resolve() (Config, error) {
	if cfg.Locker != nil && isNil(cfg.Locker) {
		return cfg, invalid("Locker is a nil %T: pass a locker, or leave Locker nil for none", cfg.Locker)
	}
	// The keepalive must renew within the lease the locker grants: with a locker that
	// reports its options, zero LockOptions take them, and different ones are refused.
	var lockerOpts *locker.Options
	if o, ok := cfg.Locker.(interface{ Options() locker.Options }); ok {
		lo := o.Options().WithDefaults()
		lockerOpts = &lo
		if cfg.LockOptions == (locker.Options{}) {
			cfg.LockOptions = lo
		}
	}
	if err := cfg.LockOptions.Validate(); err != nil { // before defaults: names the zero-free fields
		return cfg, fmt.Errorf("worker: %w: LockOptions: %w", ErrInvalidConfig, err)
	}
	cfg = cfg.withDefaults()
	if lockerOpts != nil && cfg.LockOptions != *lockerOpts {
		return cfg, invalid("LockOptions (LockTimeout %s, KeepAliveInterval %s) differ from the locker's (LockTimeout %s, KeepAliveInterval %s): leave LockOptions zero to use the locker's",
			cfg.LockOptions.LockTimeout, cfg.LockOptions.KeepAliveInterval, lockerOpts.LockTimeout, lockerOpts.KeepAliveInterval)
	}
	if err := cfg.validate(); err != nil {
		return cfg, err
	}
	if cfg.InstanceID == uuid.Nil {
		id, err := uuid.NewV7()
		if err != nil {
			return cfg, fmt.Errorf("worker: new instance ID: %w", err)
		}
		cfg.InstanceID = id
	}
	return cfg, nil
}

// withDefaults fills every zero field with its default (negative values stay, for validate).
func (cfg Config) withDefaults() Config {
	cfg.LockOptions = cfg.LockOptions.WithDefaults()
	cfg.Snapshots.EveryNEvents = cmp.Or(cfg.Snapshots.EveryNEvents, DefaultSnapshotEveryNEvents)
	cfg.Snapshots.MaxPerStream = cmp.Or(cfg.Snapshots.MaxPerStream, DefaultSnapshotMaxPerStream)
	cfg.PollInterval = cmp.Or(cfg.PollInterval, DefaultPollInterval)
	cfg.BatchSize = cmp.Or(cfg.BatchSize, DefaultBatchSize)
	cfg.RetryBackoff = cmp.Or(cfg.RetryBackoff, DefaultRetryBackoff)
	cfg.MaxRetryBackoff = cmp.Or(cfg.MaxRetryBackoff, DefaultMaxRetryBackoff)
	cfg.Concurrency = cmp.Or(cfg.Concurrency, DefaultConcurrency)
	cfg.GroupSize = cmp.Or(cfg.GroupSize, DefaultGroupSize)
	cfg.CatchUpPageSize = cmp.Or(cfg.CatchUpPageSize, DefaultCatchUpPageSize)
	cfg.FailurePolicy = cfg.FailurePolicy.withDefaults()
	if cfg.FailurePolicies != nil {
		policies := make(map[string]FailurePolicy, len(cfg.FailurePolicies))
		for name, p := range cfg.FailurePolicies {
			policies[name] = p.withDefaults()
		}
		cfg.FailurePolicies = policies
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return cfg
}

// validate checks a Config with its defaults filled in; each message begins with the field.
func (cfg Config) validate() error {
	if len(cfg.Perspectives) == 0 {
		return invalid("Perspectives is empty: at least one perspective is required")
	}
	names := make(map[string]bool, len(cfg.Perspectives))
	for i, p := range cfg.Perspectives {
		if p == nil {
			return invalid("Perspectives[%d] is nil", i)
		}
		name := p.Name()
		if err := locker.ValidatePerspectiveName(name); err != nil {
			return invalid("Perspectives[%d]: %v", i, err)
		}
		if v := versionOf(p); v < 1 {
			return invalid("Perspectives[%d]: %q: Version() must be positive, got %d", i, name, v)
		}
		if n := len([]rune(name)); n > MaxPerspectiveNameLength {
			return invalid("Perspectives[%d]: name is %d characters, more than %d: its builds' stream locks are named NAME@vVERSION.BUILD, within locker.MaxPerspectiveNameLength (%d)",
				i, n, MaxPerspectiveNameLength, locker.MaxPerspectiveNameLength)
		}
		if names[name] {
			return invalid("Perspectives[%d]: name %q is used twice", i, name)
		}
		names[name] = true
	}
	switch {
	case cfg.Snapshots.EveryNEvents < 0:
		return invalid("Snapshots.EveryNEvents must not be negative, got %d", cfg.Snapshots.EveryNEvents)
	case cfg.Snapshots.MaxPerStream < 0:
		return invalid("Snapshots.MaxPerStream must not be negative, got %d", cfg.Snapshots.MaxPerStream)
	case cfg.PollInterval < 0:
		return invalid("PollInterval must not be negative, got %s", cfg.PollInterval)
	case cfg.BatchSize < 1 || cfg.BatchSize > MaxBatchSize:
		return invalid("BatchSize must be between 1 and %d, got %d", MaxBatchSize, cfg.BatchSize)
	case cfg.RetryBackoff < 0:
		return invalid("RetryBackoff must not be negative, got %s", cfg.RetryBackoff)
	case cfg.MaxRetryBackoff < 0:
		return invalid("MaxRetryBackoff must not be negative, got %s", cfg.MaxRetryBackoff)
	case cfg.MaxRetryBackoff < cfg.RetryBackoff:
		return invalid("MaxRetryBackoff (%s) must not be less than RetryBackoff (%s)", cfg.MaxRetryBackoff, cfg.RetryBackoff)
	case cfg.Concurrency < 1 || cfg.Concurrency > MaxConcurrency:
		return invalid("Concurrency must be between 1 and %d, got %d", MaxConcurrency, cfg.Concurrency)
	case cfg.GroupSize < 1 || cfg.GroupSize > MaxGroupSize:
		return invalid("GroupSize must be between 1 and %d, got %d", MaxGroupSize, cfg.GroupSize)
	case cfg.CatchUpPageSize < 1 || cfg.CatchUpPageSize > MaxCatchUpPageSize:
		return invalid("CatchUpPageSize must be between 1 and %d, got %d", MaxCatchUpPageSize, cfg.CatchUpPageSize)
	}
	if p := cfg.FailurePolicy.problem(); p != "" {
		return invalid("FailurePolicy.%s", p)
	}
	for _, name := range slices.Sorted(maps.Keys(cfg.FailurePolicies)) {
		if !names[name] {
			return invalid("FailurePolicies[%q]: no perspective of that name is in Perspectives", name)
		}
		if p := cfg.FailurePolicies[name].problem(); p != "" {
			return invalid("FailurePolicies[%q].%s", name, p)
		}
	}
	return nil
}
