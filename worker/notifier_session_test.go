package worker

// The notifier's session against a real server: topics subscribed and dropped while
// subscribers come and go, and the wait while it polls behind a pooler.

import (
	"bytes"
	"context"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/internal/pgtest"
)

// slowUnlisten is a connection whose answer to its next UNLISTEN of wh_applied, once armed,
// reaches the notifier 300 ms late: the server has run the UNLISTEN; the notifier has not
// heard so yet.
type slowUnlisten struct {
	net.Conn
	armed, written *atomic.Bool
}

func (c slowUnlisten) Write(b []byte) (int, error) {
	if c.armed.Load() && bytes.Contains(b, []byte("UNLISTEN wh_applied")) {
		c.written.Store(true)
	}
	return c.Conn.Write(b)
}

func (c slowUnlisten) Read(b []byte) (int, error) {
	if c.written.CompareAndSwap(true, false) {
		c.armed.Store(false)
		time.Sleep(300 * time.Millisecond)
	}
	return c.Conn.Read(b)
}

// nextSession waits for s to be told of a session serving it.
func nextSession(t *testing.T, s *subscription) uint64 {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		select {
		case <-s.c:
			if nt := s.take(); nt.session != 0 {
				return nt.session
			}
		case <-deadline:
			t.Fatal("no session served the subscription within 10 s")
			return 0
		}
	}
}

// A subscriber that comes while its topic's UNLISTEN (its last subscriber left) is under way
// is not told that the session serves it before the session LISTENs again: it is told once
// it does, and hears what is sent from then on (before, it heard nothing until its next
// re-check).
func TestNotifierSubscriberDuringAnUnlistenIsToldOnceListenedAgain(t *testing.T) {
	url := pgtest.ServerURL()
	pool, err := pgxpool.New(context.Background(), url)
	require.NoError(t, err)
	defer pool.Close()
	var armed, written atomic.Bool
	owner := new(int)
	offerListenConnect(pool, func(ctx context.Context) (*pgx.Conn, error) {
		cfg, err := pgx.ParseConfig(url)
		if err != nil {
			return nil, err
		}
		var d net.Dialer
		cfg.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
			c, err := d.DialContext(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			return slowUnlisten{Conn: c, armed: &armed, written: &written}, nil
		}
		return pgx.ConnectConfig(ctx, cfg)
	}, owner)
	defer withdrawListenConnect(pool, owner)

	keep := subscribe(pool, topicQueue) // keeps the notifier and its session
	defer keep.close()
	first := subscribe(pool, topicApplied)
	session := nextSession(t, first)

	armed.Store(true)
	first.close() // the session UNLISTENs wh_applied; the answer comes 300 ms late
	pgtest.Eventually(t, 5*time.Second, "the UNLISTEN sent", func() bool { return !armed.Load() })
	late := subscribe(pool, topicApplied)
	defer late.close()
	require.Equal(t, session, nextSession(t, late), "the same session serves the late subscriber")
	_, err = pool.Exec(context.Background(), `SELECT pg_notify('wh_applied', 'after')`)
	require.NoError(t, err)
	select {
	case <-late.c:
		require.True(t, late.take().notified, "the late subscriber hears the notification")
	case <-time.After(5 * time.Second):
		t.Fatal("the late subscriber did not hear a notification sent after it was told it is served")
	}
}

// Behind a transaction pooler with no ListenConnect offered, the notifier polls, and only an
// offer ends that: a topic's last subscriber leaving does not make it open another session
// through the pooler to find out again. Every dial with the pool's ConnConfig is counted.
func TestNotifierPollingIsEndedByAnOfferOnly(t *testing.T) {
	cfg, err := pgxpool.ParseConfig(pgtest.WithExecMode(pgtest.StartPooler(t, "postgres"), "exec"))
	require.NoError(t, err)
	var dials atomic.Int32
	var d net.Dialer
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		dials.Add(1)
		return d.DialContext(ctx, network, addr)
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	defer pool.Close()

	stays := subscribe(pool, "wh_test_topic")
	defer stays.close()
	leaves := subscribe(pool, "wh_test_topic_other")
	pgtest.Eventually(t, 10*time.Second, "the notifier polling", func() bool {
		select {
		case <-stays.c:
			return stays.take().polling
		default:
			return false
		}
	})
	require.Equal(t, int32(1), dials.Load(), "one session opened, found behind the pooler")
	leaves.close()
	time.Sleep(time.Second)
	require.Equal(t, int32(1), dials.Load(), "no session opened again after a subscriber left")
}
