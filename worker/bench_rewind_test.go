package worker_test

// Rewind cost against stream length: one late event 50 events before the
// end of streams of 1k, 10k and 100k events, snapshots every 100 events. Reported per
// length: the time from Append returning to the model including the late event (LoadModel
// polled every millisecond; PollInterval 10ms as a fallback, the wake-up is LISTEN/NOTIFY),
// the worker's own rewind duration (its perspectives.rewind.duration histogram), and the
// Go heap during that time: its peak above the value at the start (runtime/metrics
// /memory/classes/heap/objects:bytes sampled every 200µs, after a GC) and the bytes
// allocated. Ratios are against the 1k stream, measured in the same run, interleaved.

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/worker"
)

const (
	rewindName    = "bench_rewind"
	rewindSamples = 5 // per length and run
)

var rewindLengths = []int{1_000, 10_000, 100_000}

type rewindStream struct {
	id   uuid.UUID
	ids  seqIDs
	n    int // events in the stream, late ones included
	late int // late events appended so far
}

var rewindStreams []*rewindStream

// rewindFigures are the samples of one set of measurements, per stream length.
type rewindFigures struct{ e2e, dur, peak, alloc [][]float64 }

func newRewindFigures() *rewindFigures {
	n := len(rewindLengths)
	return &rewindFigures{make([][]float64, n), make([][]float64, n), make([][]float64, n), make([][]float64, n)}
}

// rewindAsBuilt are the figures measured right after the streams were applied, before
// the VACUUM (autovacuum is off on the test cluster).
var rewindAsBuilt *rewindFigures

// BenchmarkRewindCost reports, per stream length, the median end-to-end and worker rewind
// times (ms), peak heap and allocations (KiB), and the 100k/1k ratios. The main figures
// are taken after a VACUUM of the tables, which is what autovacuum does after the 100k
// deletes of queue rows that applying the streams caused; the asbuilt-* figures are taken
// before it (measured once, when the streams are built).
//
// PERSPECTIVES_BENCH_VERBOSE=1 logs every rewind's statements (count and time by name).
func BenchmarkRewindCost(b *testing.B) {
	ctx := context.Background()
	build := benchClaim(b, "rewind")
	m := newBenchMetrics()
	tracer := newStmtTracer()
	w := benchStartOn(b, benchPool(b, testDB.URL, tracer), worker.Config{
		Perspectives:  []worker.Perspective{sumPerspective(rewindName)},
		Locker:        benchLocker(b, locker.Options{}),
		Snapshots:     worker.SnapshotOptions{EveryNEvents: 100},
		PollInterval:  10 * time.Millisecond,
		MeterProvider: m.mp,
	})
	defer benchStop(b, w)
	if build {
		rewindSetup(b)
		rewindAsBuilt = newRewindFigures()
		rewindMeasure(b, m, tracer, rewindAsBuilt)
		_, err := testDB.Pool.Exec(ctx, `VACUUM (ANALYZE) wh_perspective_events, wh_perspective_cursors, wh_perspective_models, wh_perspective_snapshots, wh_event_store`)
		require.NoError(b, err)
	}
	b.ResetTimer()
	f := newRewindFigures()
	for range b.N {
		rewindMeasure(b, m, tracer, f)
	}
	b.StopTimer()
	for i, n := range rewindLengths {
		k := fmt.Sprintf("%dk", n/1000)
		b.ReportMetric(medianOf(f.e2e[i]), k+"-e2e-ms")
		b.ReportMetric(medianOf(f.dur[i]), k+"-rewind-ms")
		b.ReportMetric(medianOf(f.peak[i]), k+"-peak-heap-KiB")
		b.ReportMetric(medianOf(f.alloc[i]), k+"-alloc-KiB")
	}
	last := len(rewindLengths) - 1
	ratio := func(xs [][]float64) float64 { return medianOf(xs[last]) / medianOf(xs[0]) }
	b.ReportMetric(ratio(f.e2e), "100k/1k-e2e")
	b.ReportMetric(ratio(f.dur), "100k/1k-rewind")
	b.ReportMetric(ratio(f.peak), "100k/1k-peak-heap")
	b.ReportMetric(medianOf(rewindAsBuilt.dur[0]), "asbuilt-1k-rewind-ms")
	b.ReportMetric(medianOf(rewindAsBuilt.dur[last]), "asbuilt-100k-rewind-ms")
	b.ReportMetric(ratio(rewindAsBuilt.e2e), "asbuilt-100k/1k-e2e")
	b.ReportMetric(ratio(rewindAsBuilt.dur), "asbuilt-100k/1k-rewind")
	b.ReportMetric(ratio(rewindAsBuilt.peak), "asbuilt-100k/1k-peak-heap")
}

// rewindMeasure appends rewindSamples late events to every stream, interleaved across the
// lengths in a rotating order, and records each rewind into f.
func rewindMeasure(b *testing.B, m *benchMetrics, tracer *stmtTracer, f *rewindFigures) {
	ctx := context.Background()
	verbose := os.Getenv("PERSPECTIVES_BENCH_VERBOSE") != ""
	for round := range rewindSamples {
		for j := range rewindLengths {
			i := (round + j) % len(rewindLengths)
			s := rewindStreams[i]
			s.late++
			// Between the events 51 and 50 before the original end (after the earlier late
			// events): the newest snapshot before it is 100 events from the end.
			ev := amountEvent(s.id, s.ids.id(rewindLengths[i]-51, s.late), 1)
			n0, sum0 := m.histogram(b, "perspectives.rewind.duration")
			tracer.take()
			heap := startHeapSampler()
			require.NoError(b, worker.Append(ctx, testDB.Pool, ev))
			t0 := time.Now()
			seen := benchWaitCount(b, rewindName, s.id, s.n+1, time.Minute)
			p, a := heap.end()
			s.n++
			var n1 uint64
			var sum1 float64
			benchWait(b, 10*time.Second, time.Millisecond, "the rewind to be recorded", func() bool {
				n1, sum1 = m.histogram(b, "perspectives.rewind.duration")
				return n1 > n0
			})
			if verbose {
				fmt.Fprintf(os.Stderr, "rewind of the %d-event stream: %.2f ms end to end, %.2f ms in the worker; statements:\n%s",
					rewindLengths[i], ms(seen.Sub(t0)), (sum1-sum0)*1000, stmtReport(tracer.take()))
			}
			f.e2e[i] = append(f.e2e[i], ms(seen.Sub(t0)))
			f.dur[i] = append(f.dur[i], (sum1-sum0)*1000)
			f.peak[i] = append(f.peak[i], float64(p)/1024)
			f.alloc[i] = append(f.alloc[i], float64(a)/1024)
		}
	}
}

// rewindSetup appends the three streams in batches of 1000 while the worker applies them,
// and waits until it has.
func rewindSetup(b *testing.B) {
	rewindStreams = nil
	for _, n := range rewindLengths {
		s := &rewindStream{id: uuid.New(), ids: newSeqIDs(), n: n}
		rewindStreams = append(rewindStreams, s)
		benchAppend(b, seqStream(s.id, s.ids, n))
	}
	for _, s := range rewindStreams {
		benchWait(b, 5*time.Minute, 50*time.Millisecond, "the streams to be applied", func() bool {
			return benchCount(b, rewindName, s.id) == s.n
		})
	}
}
