package worker_test

// Wake-up latency: the time to the model including the event, from the caller's clock
// (before Append is called: "call") and from Append returning, measured through the public
// API only (Append, then LoadModel polled every millisecond), with an idle worker at the
// default PollInterval (1 s) and the Postgres locker. "idle": a new event at the end of a
// stream that is up to date. "late": an event older than the stream's cursor, which the
// worker must rewind for (lock, replay of the ~20-event stream, fenced commit, release).

import (
	"context"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/worker"
)

const (
	wakeupName    = "bench_wakeup"
	wakeupSamples = 15 // per kind and run
	wakeupLen     = 20 // events in each stream before the samples
)

var wakeup struct {
	idle, late uuid.UUID
	lateIDs    seqIDs
	lateSeq    int // late events appended so far
}

// BenchmarkWakeupLatency reports the median and p90 latency (ms) of idle and late events.
func BenchmarkWakeupLatency(b *testing.B) {
	ctx := context.Background()
	build := benchClaim(b, "wakeup")
	// PollInterval zero: the default, 1s.
	w := benchStart(b, worker.Config{Perspectives: []worker.Perspective{sumPerspective(wakeupName)}, Locker: benchLocker(b, locker.Options{})})
	defer benchStop(b, w)
	if build {
		wakeupSetup(b, ctx)
	}
	var idle, late, idleCall, lateCall []float64
	for range b.N {
		for i := range 2 * wakeupSamples {
			// Let the worker fall idle, at a random phase of its poll.
			time.Sleep(time.Duration(20+rand.IntN(100)) * time.Millisecond)
			if i%2 == 0 {
				n := benchCount(b, wakeupName, wakeup.idle)
				ev := amountEvent(wakeup.idle, uuid.Nil, 1)
				call := time.Now()
				require.NoError(b, worker.Append(ctx, testDB.Pool, ev))
				t0 := time.Now()
				seen := benchWaitCount(b, wakeupName, wakeup.idle, n+1, 30*time.Second)
				idle = append(idle, ms(seen.Sub(t0)))
				idleCall = append(idleCall, ms(seen.Sub(call)))
			} else {
				n := benchCount(b, wakeupName, wakeup.late)
				wakeup.lateSeq++
				ev := amountEvent(wakeup.late, wakeup.lateIDs.id(wakeupLen/2, wakeup.lateSeq), 1)
				call := time.Now()
				require.NoError(b, worker.Append(ctx, testDB.Pool, ev))
				t0 := time.Now()
				seen := benchWaitCount(b, wakeupName, wakeup.late, n+1, 30*time.Second)
				late = append(late, ms(seen.Sub(t0)))
				lateCall = append(lateCall, ms(seen.Sub(call)))
			}
		}
	}
	b.ReportMetric(medianOf(idle), "idle-p50-ms")
	b.ReportMetric(percentile(idle, 0.9), "idle-p90-ms")
	b.ReportMetric(medianOf(late), "late-p50-ms")
	b.ReportMetric(percentile(late, 0.9), "late-p90-ms")
	b.ReportMetric(medianOf(idleCall), "idle-call-p50-ms")
	b.ReportMetric(medianOf(lateCall), "late-call-p50-ms")
}

// wakeupSetup appends the two streams and waits until they are applied; the idle stream
// gets one more event, so that its first snapshot is bootstrapped before the samples.
func wakeupSetup(b *testing.B, _ context.Context) {
	wakeup.idle, wakeup.late = uuid.New(), uuid.New()
	wakeup.lateIDs, wakeup.lateSeq = newSeqIDs(), 0
	benchAppend(b, append(events(wakeup.idle, newIDs(b, wakeupLen)), seqStream(wakeup.late, wakeup.lateIDs, wakeupLen)...))
	benchWaitCount(b, wakeupName, wakeup.idle, wakeupLen, time.Minute)
	benchWaitCount(b, wakeupName, wakeup.late, wakeupLen, time.Minute)
	benchAppend(b, []worker.Event{amountEvent(wakeup.idle, uuid.Nil, 1)})
	benchWaitCount(b, wakeupName, wakeup.idle, wakeupLen+1, time.Minute)
}
