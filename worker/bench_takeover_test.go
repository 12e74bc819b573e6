package worker_test

// Takeover latency: another instance takes the stream lock of a pair
// and disappears (its lock is left to expire: LockTimeout 2s); a late event for that pair
// is appended at once. The latency is the time from the foreign acquire returning to the
// model including the late event (LoadModel polled every 5 ms); the bound is
// LockTimeout + PollInterval + 1s. PollInterval 1s (the default) and 100ms.

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/worker"
)

const (
	takeoverName    = "bench_takeover"
	takeoverSamples = 2 // per poll interval and run
	takeoverLen     = 20
)

var takeoverOpts = locker.Options{LockTimeout: 2 * time.Second, KeepAliveInterval: 500 * time.Millisecond}

var takeover struct {
	stream  uuid.UUID
	ids     seqIDs
	n, late int
}

// BenchmarkTakeover reports the median takeover latency (ms), the bound and their ratio,
// per PollInterval.
func BenchmarkTakeover(b *testing.B) {
	for _, poll := range []time.Duration{time.Second, 100 * time.Millisecond} {
		b.Run(fmt.Sprintf("poll=%s", poll), func(b *testing.B) { benchTakeover(b, poll) })
	}
}

func benchTakeover(b *testing.B, poll time.Duration) {
	ctx := context.Background()
	build := benchClaim(b, "takeover")
	if build {
		takeover.stream, takeover.ids, takeover.n, takeover.late = uuid.New(), newSeqIDs(), takeoverLen, 0
	}
	m := newBenchMetrics()
	lk := benchLocker(b, takeoverOpts)
	w := benchStart(b, worker.Config{
		Perspectives:  []worker.Perspective{sumPerspective(takeoverName)},
		Locker:        lk,
		LockOptions:   takeoverOpts,
		PollInterval:  poll,
		MeterProvider: m.mp,
	})
	defer benchStop(b, w)
	if build {
		benchAppend(b, seqStream(takeover.stream, takeover.ids, takeoverLen))
		benchWaitCount(b, takeoverName, takeover.stream, takeoverLen, time.Minute)
	}
	bound := takeoverOpts.LockTimeout + poll + time.Second
	b.ResetTimer()
	var lat []float64
	for range b.N {
		for range takeoverSamples {
			// The worker releases its own lock just after the previous rewind committed.
			foreign := uuid.New()
			benchWait(b, 10*time.Second, time.Millisecond, "the foreign lock", func() bool {
				ok, err := lk.TryAcquire(ctx, takeover.stream, takeoverName, foreign, locker.ReasonRewind)
				require.NoError(b, err)
				return ok
			})
			t0 := time.Now() // the holder disappears now
			takeover.late++
			require.NoError(b, worker.Append(ctx, testDB.Pool, amountEvent(takeover.stream, takeover.ids.id(takeoverLen/2, takeover.late), 1)))
			var seen time.Time
			benchWait(b, 30*time.Second, 5*time.Millisecond, "the takeover", func() bool {
				seen = time.Now()
				return benchCount(b, takeoverName, takeover.stream) > takeover.n
			})
			takeover.n++
			lat = append(lat, ms(seen.Sub(t0)))
		}
	}
	b.StopTimer()
	b.ReportMetric(medianOf(lat), "takeover-ms")
	b.ReportMetric(slicesMax(lat), "max-takeover-ms")
	b.ReportMetric(ms(bound), "bound-ms")
	b.ReportMetric(medianOf(lat)/ms(bound), "takeover/bound")
	b.ReportMetric(float64(m.counter(b, "perspectives.lock.takeovers")), "takeovers")
}

func slicesMax(xs []float64) float64 {
	var m float64
	for _, x := range xs {
		m = max(m, x)
	}
	return m
}
