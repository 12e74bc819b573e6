package locker

import (
	"fmt"
	"time"
)

// Default option values.
const (
	DefaultLockTimeout       = 30 * time.Second
	DefaultKeepAliveInterval = 10 * time.Second
)

// Options configure stream locks. A zero field means its default.
type Options struct {
	// LockTimeout is how long a lock stays valid after it is acquired or renewed, on the
	// database clock. Default 30s. Must be positive.
	LockTimeout time.Duration
	// KeepAliveInterval is how often a holder renews its lock while it works. Default 10s.
	// Must be positive and less than LockTimeout/2, so that one missed renewal never lets
	// the lock lapse.
	KeepAliveInterval time.Duration
}

// DefaultOptions returns the defaults: LockTimeout 30s, KeepAliveInterval 10s.
func DefaultOptions() Options {
	return Options{LockTimeout: DefaultLockTimeout, KeepAliveInterval: DefaultKeepAliveInterval}
}

// WithDefaults returns o with every zero field set to its default.
func (o Options) WithDefaults() Options {
	if o.LockTimeout == 0 {
		o.LockTimeout = DefaultLockTimeout
	}
	if o.KeepAliveInterval == 0 {
		o.KeepAliveInterval = DefaultKeepAliveInterval
	}
	return o
}

// Validate reports whether the options (zero fields taken as their defaults) are usable.
// The error wraps ErrInvalidOptions and names the field and the values involved.
func (o Options) Validate() error {
	o = o.WithDefaults()
	if o.LockTimeout < 0 {
		return fmt.Errorf("%w: LockTimeout must be positive, got %s", ErrInvalidOptions, o.LockTimeout)
	}
	if o.KeepAliveInterval < 0 {
		return fmt.Errorf("%w: KeepAliveInterval must be positive, got %s", ErrInvalidOptions, o.KeepAliveInterval)
	}
	if o.KeepAliveInterval >= o.LockTimeout-o.KeepAliveInterval { // 2*KeepAliveInterval >= LockTimeout, without overflow
		return fmt.Errorf("%w: KeepAliveInterval (%s) must be less than LockTimeout/2 (LockTimeout is %s)",
			ErrInvalidOptions, o.KeepAliveInterval, o.LockTimeout)
	}
	return nil
}
