package locker

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/perspectives-go/perspectives/db"
	"github.com/perspectives-go/perspectives/internal/pgq"
)

// queries is the part of db.Querier the Postgres locker uses.
type queries interface {
	StreamLockAcquireFree(ctx context.Context, arg db.StreamLockAcquireFreeParams) (int64, error)
	StreamLockAcquire(ctx context.Context, arg db.StreamLockAcquireParams) (bool, error)
	StreamLockRenew(ctx context.Context, arg db.StreamLockRenewParams) (int64, error)
	StreamLockRelease(ctx context.Context, arg db.StreamLockReleaseParams) (int64, error)
	StreamLockForceRelease(ctx context.Context, arg db.StreamLockForceReleaseParams) (int64, error)
	StreamLockGet(ctx context.Context, arg db.StreamLockGetParams) (db.StreamLockGetRow, error)
	StreamLockList(ctx context.Context) ([]db.StreamLockListRow, error)
}

// Postgres is the Locker kept on wh_perspective_cursors. Each operation is atomic (one
// statement; Acquire tries a cheaper one first); expiry is set and compared with the
// database clock.
type Postgres struct {
	q    queries
	opts Options
}

var _ CursorRowLocker = (*Postgres)(nil)

// LocksCursorRows implements CursorRowLocker: Postgres keeps its locks on the cursor rows.
func (p *Postgres) LocksCursorRows() {}

// NewPostgres returns a locker on pool. Zero option fields take their defaults; invalid
// options are refused with an error wrapping ErrInvalidOptions.
func NewPostgres(pool *pgxpool.Pool, opts Options) (*Postgres, error) {
	if pool == nil {
		return nil, fmt.Errorf("locker: new postgres locker: %w: pool is nil", ErrInvalidArgument)
	}
	if err := opts.Validate(); err != nil {
		return nil, fmt.Errorf("locker: new postgres locker: %w", err)
	}
	return &Postgres{q: pgq.New(pool), opts: opts.WithDefaults()}, nil
}

// Options returns the options in force (defaults filled in).
func (p *Postgres) Options() Options { return p.opts }

func (p *Postgres) timeoutSeconds() float64 { return p.opts.LockTimeout.Seconds() }

// TryAcquire implements Locker. It creates the cursor row when none exists yet.
func (p *Postgres) TryAcquire(ctx context.Context, streamID uuid.UUID, perspectiveName string, instanceID uuid.UUID, reason Reason) (bool, error) {
	r, err := p.Acquire(ctx, streamID, perspectiveName, instanceID, reason)
	return r.Acquired, err
}

// AcquireResult is the outcome of Acquire.
type AcquireResult struct {
	Acquired bool // the caller holds the lock now
	TookOver bool // it replaced another instance's expired lock (for metrics; see the query)
}

// Acquire is TryAcquire that also reports whether the lock was taken over from another
// instance whose lock had expired.
func (p *Postgres) Acquire(ctx context.Context, streamID uuid.UUID, perspectiveName string, instanceID uuid.UUID, reason Reason) (AcquireResult, error) {
	if err := validateHolder(streamID, perspectiveName, instanceID); err != nil {
		return AcquireResult{}, fmt.Errorf("locker: acquire: %w", err)
	}
	if err := validateReason(reason); err != nil {
		return AcquireResult{}, fmt.Errorf("locker: acquire: %w", err)
	}
	// Most acquires find the pair unlocked: one statement with no takeover to report.
	n, err := p.q.StreamLockAcquireFree(ctx, db.StreamLockAcquireFreeParams{
		StreamID:           streamID,
		PerspectiveName:    perspectiveName,
		InstanceID:         instanceID,
		LockTimeoutSeconds: p.timeoutSeconds(),
		Reason:             string(reason),
	})
	if err != nil {
		return AcquireResult{}, fmt.Errorf("locker: acquire: %w", err)
	}
	if n == 1 {
		return AcquireResult{Acquired: true}, nil
	}
	tookOver, err := p.q.StreamLockAcquire(ctx, db.StreamLockAcquireParams{
		StreamID:           streamID,
		PerspectiveName:    perspectiveName,
		InstanceID:         instanceID,
		LockTimeoutSeconds: p.timeoutSeconds(),
		Reason:             string(reason),
	})
	if errors.Is(err, pgx.ErrNoRows) {
		return AcquireResult{}, nil
	}
	if err != nil {
		return AcquireResult{}, fmt.Errorf("locker: acquire: %w", err)
	}
	return AcquireResult{Acquired: true, TookOver: tookOver}, nil
}

// Renew implements Locker.
func (p *Postgres) Renew(ctx context.Context, streamID uuid.UUID, perspectiveName string, instanceID uuid.UUID) (bool, error) {
	if err := validateHolder(streamID, perspectiveName, instanceID); err != nil {
		return false, fmt.Errorf("locker: renew: %w", err)
	}
	n, err := p.q.StreamLockRenew(ctx, db.StreamLockRenewParams{
		StreamID:           streamID,
		PerspectiveName:    perspectiveName,
		InstanceID:         instanceID,
		LockTimeoutSeconds: p.timeoutSeconds(),
	})
	if err != nil {
		return false, fmt.Errorf("locker: renew: %w", err)
	}
	return n == 1, nil
}

// Release implements Locker.
func (p *Postgres) Release(ctx context.Context, streamID uuid.UUID, perspectiveName string, instanceID uuid.UUID) error {
	if err := validateHolder(streamID, perspectiveName, instanceID); err != nil {
		return fmt.Errorf("locker: release: %w", err)
	}
	if _, err := p.q.StreamLockRelease(ctx, db.StreamLockReleaseParams{
		StreamID:        streamID,
		PerspectiveName: perspectiveName,
		InstanceID:      instanceID,
	}); err != nil {
		return fmt.Errorf("locker: release: %w", err)
	}
	return nil
}

// Get returns the unexpired lock on (streamID, perspectiveName), if any.
func (p *Postgres) Get(ctx context.Context, streamID uuid.UUID, perspectiveName string) (Lock, bool, error) {
	if err := ValidatePair(streamID, perspectiveName); err != nil {
		return Lock{}, false, fmt.Errorf("locker: get: %w", err)
	}
	row, err := p.q.StreamLockGet(ctx, db.StreamLockGetParams{StreamID: streamID, PerspectiveName: perspectiveName})
	if errors.Is(err, pgx.ErrNoRows) {
		return Lock{}, false, nil
	}
	if err != nil {
		return Lock{}, false, fmt.Errorf("locker: get: %w", err)
	}
	return Lock{
		StreamID:        row.StreamID,
		PerspectiveName: row.PerspectiveName,
		InstanceID:      row.InstanceID,
		Reason:          Reason(row.Reason),
		Expiry:          row.Expiry,
	}, true, nil
}

// LockStatus is a held lock with the time left before it lapses, measured on the database
// clock when it was read.
type LockStatus struct {
	Lock
	ExpiresIn time.Duration
}

// List returns every unexpired lock, soonest expiry first.
func (p *Postgres) List(ctx context.Context) ([]Lock, error) {
	st, err := p.ListStatus(ctx)
	if err != nil {
		return nil, err
	}
	locks := make([]Lock, len(st))
	for i, s := range st {
		locks[i] = s.Lock
	}
	return locks, nil
}

// ListStatus returns every unexpired lock with the time it has left, soonest expiry first.
func (p *Postgres) ListStatus(ctx context.Context) ([]LockStatus, error) {
	rows, err := p.q.StreamLockList(ctx)
	if err != nil {
		return nil, fmt.Errorf("locker: list: %w", err)
	}
	out := make([]LockStatus, len(rows))
	for i, r := range rows {
		out[i] = LockStatus{
			Lock: Lock{
				StreamID:        r.StreamID,
				PerspectiveName: r.PerspectiveName,
				InstanceID:      r.InstanceID,
				Reason:          Reason(r.Reason),
				Expiry:          r.Expiry,
			},
			ExpiresIn: time.Duration(r.ExpiresInMicros) * time.Microsecond,
		}
	}
	return out, nil
}

// ForceRelease clears the lock on (streamID, perspectiveName) whoever holds it, and reports
// whether there was one (expired or not). It is an operator's tool: the holder, if alive,
// finds out at its next renewal and its final write is refused.
func (p *Postgres) ForceRelease(ctx context.Context, streamID uuid.UUID, perspectiveName string) (bool, error) {
	if err := ValidatePair(streamID, perspectiveName); err != nil {
		return false, fmt.Errorf("locker: force release: %w", err)
	}
	n, err := p.q.StreamLockForceRelease(ctx, db.StreamLockForceReleaseParams{StreamID: streamID, PerspectiveName: perspectiveName})
	if err != nil {
		return false, fmt.Errorf("locker: force release: %w", err)
	}
	return n == 1, nil
}
