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

// The first subscriber's ListenConnect dials the notifier's first session: the notifier's
// goroutine never dials with the pool's ConnConfig before the subscription's ListenConnect
// is the notifier's. Neither dial reaches a server (both fail at once, the notifier backs
// off); the test counts which was tried first, on fresh pools, many times, since the
// notifier's goroutine races the rest of subscribe.
func TestUnitNotifierFirstSessionIsTheFirstSubscribersListenConnect(t *testing.T) {
	for i := range 200 {
		cfg, err := pgxpool.ParseConfig("postgres://127.0.0.1:1/none?sslmode=disable&connect_timeout=1")
		require.NoError(t, err)
		type dial struct{ viaPool bool }
		dials := make(chan dial, 2)
		cfg.ConnConfig.DialFunc = func(context.Context, string, string) (net.Conn, error) {
			dials <- dial{viaPool: true}
			return nil, errors.New("no server: the pool's ConnConfig")
		}
		pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
		require.NoError(t, err)
		var connects atomic.Int32
		sub := subscribe(pool, "wh_test_topic", func(context.Context) (*pgx.Conn, error) {
			connects.Add(1)
			dials <- dial{}
			return nil, errors.New("no server: ListenConnect")
		})
		select {
		case d := <-dials:
			require.False(t, d.viaPool, "subscription %d: the notifier dialled with the pool's ConnConfig, not the subscriber's ListenConnect", i)
		case <-time.After(time.Minute):
			t.Fatalf("subscription %d: the notifier dialled nothing within a minute", i)
		}
		sub.close()
		pool.Close()
		require.Equal(t, int32(1), connects.Load(), "subscription %d: one session tried before the backoff", i)
	}
}
