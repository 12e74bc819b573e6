package worker

import (
	"context"
	"errors"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
)

// A ListenConnect offered for a pool dials its notifier's first session: the notifier's
// goroutine never dials with the pool's ConnConfig when a ListenConnect was offered before
// the first subscription. Neither dial reaches a server (both fail at once, the notifier
// backs off); the test counts which was tried first, on fresh pools, many times, since the
// notifier's goroutine races the rest of subscribe.
func TestUnitNotifierFirstSessionIsTheFirstSubscribersListenConnect(t *testing.T) {
	for i := range 200 {
		type dial struct{ viaPool bool }
		dials := make(chan dial, 2)
		pool := unreachablePool(t, func() { dials <- dial{viaPool: true} })
		var connects atomic.Int32
		offerListenConnect(pool, func(context.Context) (*pgx.Conn, error) {
			connects.Add(1)
			dials <- dial{}
			return nil, errors.New("no server: ListenConnect")
		}, t)
		sub := subscribe(pool, "wh_test_topic")
		select {
		case d := <-dials:
			require.False(t, d.viaPool, "subscription %d: the notifier dialled with the pool's ConnConfig, not the subscriber's ListenConnect", i)
		case <-time.After(time.Minute):
			t.Fatalf("subscription %d: the notifier dialled nothing within a minute", i)
		}
		sub.close()
		withdrawListenConnect(pool, t)
		pool.Close()
		require.Equal(t, int32(1), connects.Load(), "subscription %d: one session tried before the backoff", i)
	}
}

// A subscriber that joins while the notifier waits out its backoff after a failed session
// is told at once why the last session was lost (the worker's loop then claims every
// reconnectInterval), not only at the notifier's next failure, up to 30 s later.
func TestUnitNotifierTellsALateSubscriberWhyItHasNoSession(t *testing.T) {
	pool := unreachablePool(t, nil)
	dialErr := errors.New("no server: ListenConnect")
	offerListenConnect(pool, func(context.Context) (*pgx.Conn, error) { return nil, dialErr }, t)
	defer withdrawListenConnect(pool, t)
	first := subscribe(pool, "wh_test_topic")
	defer first.close()
	select {
	case <-first.c:
	case <-time.After(time.Minute):
		t.Fatal("the first subscriber heard nothing of the failed session within a minute")
	}
	require.ErrorIs(t, first.take().err, dialErr, "the first subscriber is told why")

	late := subscribe(pool, "wh_test_topic_late") // within the notifier's first backoff (1 s)
	defer late.close()
	select {
	case <-late.c:
	case <-time.After(notifierRetryMin / 2):
		t.Fatal("the late subscriber was not told that the notifier has no session")
	}
	nt := late.take()
	require.Zero(t, nt.session)
	require.ErrorIs(t, nt.err, dialErr, "the late subscriber is told why")
}

// Of the ListenConnects offered for a pool, the earliest that stands serves: once the first
// worker's offer is withdrawn (it stopped), a notifier that starts afterwards dials the next
// worker's, not the pool's ConnConfig. No dial reaches a server.
func TestUnitNotifierStartsWithTheEarliestOfferThatStands(t *testing.T) {
	dials := make(chan string, 8)
	pool := unreachablePool(t, func() { dials <- "pool" })
	offer := func(name string) func(context.Context) (*pgx.Conn, error) { return failingOffer(dials, name) }
	first, second := new(int), new(int) // two owners
	offerListenConnect(pool, offer("first"), first)
	offerListenConnect(pool, offer("second"), second)
	defer withdrawListenConnect(pool, second)
	firstDial := func() string {
		sub := subscribe(pool, "wh_test_topic")
		defer sub.close()
		select {
		case d := <-dials:
			return d
		case <-time.After(time.Minute):
			t.Fatal("the notifier dialled nothing within a minute")
			return ""
		}
	}
	require.Equal(t, "first", firstDial(), "both offers stand: the earliest serves")
	withdrawListenConnect(pool, first)
	require.Equal(t, "second", firstDial(), "the first offer withdrawn: the next one serves")
	withdrawListenConnect(pool, second)
	require.Equal(t, "pool", firstDial(), "no offer stands: the pool's ConnConfig")
}

// A running notifier whose ListenConnect is withdrawn (its worker stopped) dials the next
// offer that stands for its next session, not the withdrawn one. No dial reaches a server.
func TestUnitNotifierDialsTheNextOfferOnceItsOwnIsWithdrawn(t *testing.T) {
	pool := unreachablePool(t, nil)
	dials := make(chan string, 16)
	offer := func(name string) func(context.Context) (*pgx.Conn, error) { return failingOffer(dials, name) }
	first, second := new(int), new(int) // two owners
	offerListenConnect(pool, offer("first"), first)
	sub := subscribe(pool, "wh_test_topic")
	defer sub.close()
	require.Equal(t, "first", <-dials)
	offerListenConnect(pool, offer("second"), second)
	defer withdrawListenConnect(pool, second)
	withdrawListenConnect(pool, first)
	select {
	case d := <-dials: // after the notifier's backoff (1 s)
		require.Equal(t, "second", d, "the session after the withdrawal dials the offer that stands")
	case <-time.After(notifierRetryMin + 10*time.Second):
		t.Fatal("the notifier dialled no second session")
	}
}

// failingOffer is a ListenConnect that says on dials that it was tried, as name, and fails.
func failingOffer(dials chan<- string, name string) func(context.Context) (*pgx.Conn, error) {
	return func(context.Context) (*pgx.Conn, error) {
		dials <- name
		return nil, errors.New("no server: " + name)
	}
}

// unreachablePool is a pool of a server that does not exist, closed when the test ends (or
// before, by the test). Every dial with its ConnConfig fails at once, after calling dialled
// when it is not nil.
func unreachablePool(t *testing.T, dialled func()) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig("postgres://127.0.0.1:1/none?sslmode=disable&connect_timeout=1")
	require.NoError(t, err)
	if dialled != nil {
		cfg.ConnConfig.DialFunc = func(context.Context, string, string) (net.Conn, error) {
			dialled()
			return nil, errors.New("no server: the pool's ConnConfig")
		}
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}
