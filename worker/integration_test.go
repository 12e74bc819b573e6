package worker_test

import (
	"context"
	"log/slog"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/db"
	"github.com/perspectives-go/perspectives/internal/pgq"
	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/worker"
)

func TestSingleInstanceAppliesInOrder(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := "single_" + uuid.NewString()[:8]
	startWorker(t, worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(name)}})

	stream := uuid.New()
	evs := events(stream, newIDs(t, 12))
	require.NoError(t, worker.Append(ctx, testDB.Pool, evs...))
	want := expectedLedger(t, evs)
	eventually(t, 10*time.Second, "model complete", func() bool {
		m, _ := loadLedger(t, ctx, name, stream)
		return len(m.IDs) == len(evs)
	})
	m, _ := loadLedger(t, ctx, name, stream)
	require.Equal(t, want, m)
	require.Empty(t, queued(t, ctx, name, stream))
}

func TestMultiInstanceShuffledEventsConverge(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := "multi_" + uuid.NewString()[:8]
	lockOpts := locker.Options{LockTimeout: 3 * time.Second, KeepAliveInterval: time.Second}
	logs := &logCapture{}
	for range 3 {
		lk, err := locker.NewPostgres(testDB.Pool, lockOpts)
		require.NoError(t, err)
		startWorker(t, worker.Config{
			Perspectives: []worker.Perspective{ledgerPerspective(name)},
			Locker:       lk,
			LockOptions:  lockOpts,
			BatchSize:    5,
			Snapshots:    worker.SnapshotOptions{EveryNEvents: 3, MaxPerStream: 3},
			Logger:       slog.New(logs),
		})
	}
	rng := rand.New(rand.NewPCG(1, 2))
	const streams, perStream = 12, 25
	all := map[uuid.UUID][]worker.Event{}
	var pending, heldBack []worker.Event
	for i := range streams {
		s := uuid.New()
		all[s] = events(s, newIDs(t, perStream))
		if i < 4 {
			// The first event of four streams arrives only after the rest of the stream
			// was applied: a rewind is certain, whatever the timing of the shuffle.
			heldBack = append(heldBack, all[s][0])
			pending = append(pending, all[s][1:]...)
		} else {
			pending = append(pending, all[s]...)
		}
	}
	rng.Shuffle(len(pending), func(i, j int) { pending[i], pending[j] = pending[j], pending[i] })
	for len(pending) > 0 {
		n := min(len(pending), 1+rng.IntN(6))
		require.NoError(t, worker.Append(ctx, testDB.Pool, pending[:n]...))
		pending = pending[n:]
		if rng.IntN(4) == 0 {
			time.Sleep(time.Duration(rng.IntN(15)) * time.Millisecond) // let workers interleave with appends
		}
	}
	for _, ev := range heldBack {
		eventually(t, 60*time.Second, "stream applied before its late event", func() bool {
			m, _ := loadLedger(t, ctx, name, ev.StreamID)
			return len(m.IDs) == perStream-1
		})
		require.NoError(t, worker.Append(ctx, testDB.Pool, ev))
	}
	for s, evs := range all {
		want := expectedLedger(t, evs)
		eventually(t, 60*time.Second, "stream converged", func() bool {
			m, _ := loadLedger(t, ctx, name, s)
			return len(queued(t, ctx, name, s)) == 0 && len(m.IDs) == len(evs)
		})
		m, _ := loadLedger(t, ctx, name, s)
		require.Equal(t, want, m, "stream %s", s)
		cur, err := pgq.New(testDB.Pool).CursorGet(ctx, db.CursorGetParams{StreamID: s, PerspectiveName: name})
		require.NoError(t, err)
		require.Equal(t, evs[len(evs)-1].ID, cur.LastEventID.UUID)
	}
	require.Positive(t, logs.count("rewind completed"), "shuffled appends must have caused rewinds")
	t.Logf("%d streams x %d events, %d rewinds", streams, perStream, logs.count("rewind completed"))
}
