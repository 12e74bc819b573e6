package worker

import (
	"context"
	"sync"
)

// coordinator is the in-process apply coordinator: a mutex per (stream, perspective) around
// every apply, rewind, bootstrap and purge. Entries are reference-counted and removed when
// no goroutine holds or waits for them.
type coordinator struct {
	mu      sync.Mutex
	entries map[Pair]*coordEntry
}

type coordEntry struct {
	sem  chan struct{} // capacity 1: holding the slot is holding the pair
	refs int           // holders plus waiters
}

func newCoordinator() *coordinator {
	return &coordinator{entries: make(map[Pair]*coordEntry)}
}

// lock waits for the pair and returns the function that releases it. It gives up with the
// context's error when ctx ends first.
func (c *coordinator) lock(ctx context.Context, k Pair) (func(), error) {
	e := c.ref(k)
	select {
	case e.sem <- struct{}{}:
	case <-ctx.Done():
		c.unref(k, e)
		return nil, ctx.Err()
	}
	return c.releaser(k, e), nil
}

// tryLock takes the pair when it is free, without waiting: it returns the function that
// releases it, or false when another goroutine holds the pair.
func (c *coordinator) tryLock(k Pair) (func(), bool) {
	e := c.ref(k)
	select {
	case e.sem <- struct{}{}:
		return c.releaser(k, e), true
	default:
		c.unref(k, e)
		return nil, false
	}
}

// ref returns k's entry, created when missing, counting the caller in.
func (c *coordinator) ref(k Pair) *coordEntry {
	c.mu.Lock()
	defer c.mu.Unlock()
	e := c.entries[k]
	if e == nil {
		e = &coordEntry{sem: make(chan struct{}, 1)}
		c.entries[k] = e
	}
	e.refs++
	return e
}

// releaser is the idempotent release of a held entry.
func (c *coordinator) releaser(k Pair, e *coordEntry) func() {
	var once sync.Once
	return func() {
		once.Do(func() {
			<-e.sem
			c.unref(k, e)
		})
	}
}

func (c *coordinator) unref(k Pair, e *coordEntry) {
	c.mu.Lock()
	e.refs--
	if e.refs == 0 {
		delete(c.entries, k)
	}
	c.mu.Unlock()
}
