package worker_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/db"
	"github.com/perspectives-go/perspectives/worker"
)

// appendBacklog stores streams × perStream events (in ID order per stream).
func appendBacklog(b testing.TB, ctx context.Context, streams, perStream int) {
	b.Helper()
	batch := make([]worker.Event, 0, 1000)
	for range streams {
		s := uuid.New()
		for i, id := range newIDs(b, perStream) {
			batch = append(batch, worker.Event{ID: id, StreamID: s, Type: "amount", Data: json.RawMessage(`{"n":` + itoa(i+1) + `}`)})
			if len(batch) == cap(batch) {
				require.NoError(b, worker.Append(ctx, testDB.Pool, batch...))
				batch = batch[:0]
			}
		}
	}
	if len(batch) > 0 {
		require.NoError(b, worker.Append(ctx, testDB.Pool, batch...))
	}
}

// BenchmarkWorkerDrain measures events applied per second by one instance draining a
// backlog of 1000 streams × 50 events.
func BenchmarkWorkerDrain(b *testing.B) {
	ctx := context.Background()
	const streams, perStream = 1000, 50
	b.StopTimer()
	for range b.N {
		testDB.Truncate(ctx, b)
		name := uniqueName("drain")
		appendBacklog(b, ctx, streams, perStream)
		w, err := worker.New(testDB.Pool, worker.Config{Perspectives: []worker.Perspective{sumPerspective(name)}, Logger: quietLogger(), PollInterval: 5 * time.Millisecond})
		require.NoError(b, err)
		b.StartTimer()
		start := time.Now()
		require.NoError(b, w.Start(ctx))
		q := db.New(testDB.Pool)
		for {
			n, err := q.QueueCount(ctx)
			require.NoError(b, err)
			if n == 0 {
				break
			}
			time.Sleep(5 * time.Millisecond)
		}
		el := time.Since(start)
		b.StopTimer()
		require.NoError(b, w.Stop(ctx))
		b.ReportMetric(float64(streams*perStream)/el.Seconds(), "events/s")
	}
}

type sumModel struct {
	Count int `json:"c"`
	Sum   int `json:"s"`
}

// sumPerspective is a cheap perspective, so benchmarks measure the worker, not the fold.
func sumPerspective(name string) worker.Perspective {
	return worker.JSONPerspective(name, func(m sumModel, ev worker.Event) (sumModel, error) {
		var a amount
		if err := json.Unmarshal(ev.Data, &a); err != nil {
			return m, err
		}
		m.Count++
		m.Sum += a.N
		return m, nil
	})
}
