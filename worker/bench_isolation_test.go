package worker_test

// Isolation: the throughput of other streams while one stream is under a long rewind,
// against their throughput with no rewind, measured in the same run, interleaved. The
// perspective is slow (2 ms per event) for one stream, and only while armed; the late event
// sits before that stream's oldest snapshot, so the rewind replays its 1500 events (≈3 s).
// The other streams' backlog (100 streams × 50 events) is appended once the replay has
// started; throughput is its events over the time from the first Append to the worker's
// events.applied counter covering them (PollInterval 10ms).

import (
	"context"
	"encoding/json"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/worker"
)

const (
	isoName      = "bench_isolation"
	isoSlowLen   = 1500
	isoSlowDelay = 2 * time.Millisecond
	isoStreams   = 100
	isoPerStream = 50
	isoRounds    = 2 // per run; each round measures both phases
)

// isoSlowPerspective is sumPerspective, slowed down for one stream while armed; the first
// slowed Apply closes started.
type isoSlowPerspective struct {
	worker.Perspective
	stream  uuid.UUID
	armed   atomic.Bool
	mu      sync.Mutex
	started chan struct{}
}

func (p *isoSlowPerspective) arm() <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.started = make(chan struct{})
	p.armed.Store(true)
	return p.started
}

func (p *isoSlowPerspective) Apply(ctx context.Context, model json.RawMessage, ev worker.Event) (json.RawMessage, error) {
	if ev.StreamID == p.stream && p.armed.Load() {
		p.mu.Lock()
		if p.started != nil {
			close(p.started)
			p.started = nil
		}
		p.mu.Unlock()
		time.Sleep(isoSlowDelay)
	}
	return p.Perspective.Apply(ctx, model, ev)
}

var iso struct {
	slow    uuid.UUID
	ids     seqIDs
	n, late int
}

var isoRound int

// BenchmarkIsolation reports the other streams' events/s with and without the long rewind
// and their ratio.
func BenchmarkIsolation(b *testing.B) {
	ctx := context.Background()
	build := benchClaim(b, "isolation")
	if build {
		iso.slow, iso.ids, iso.n, iso.late = uuid.New(), newSeqIDs(), isoSlowLen, 0
	}
	persp := &isoSlowPerspective{Perspective: sumPerspective(isoName), stream: iso.slow}
	m := newBenchMetrics()
	tracer := newStmtTracer()
	w := benchStartOn(b, benchPool(b, testDB.URL, tracer), worker.Config{
		Perspectives:  []worker.Perspective{persp},
		Locker:        benchLocker(b, locker.Options{}),
		PollInterval:  10 * time.Millisecond,
		MeterProvider: m.mp,
	})
	defer benchStop(b, w)
	if build {
		benchAppend(b, seqStream(iso.slow, iso.ids, isoSlowLen))
		benchWait(b, 5*time.Minute, 20*time.Millisecond, "the slow stream to be applied", func() bool {
			return benchCount(b, isoName, iso.slow) == iso.n
		})
	}
	b.ResetTimer()
	var normal, during, covered, claims, rewindMS []float64
	for range b.N {
		for range isoRounds {
			for j := range 2 {
				if (isoRound+j)%2 == 0 {
					normal = append(normal, isoDrain(b, m, func() {}))
					continue
				}
				started := persp.arm()
				iso.late++
				done0 := m.counter(b, "perspectives.rewind.completed")
				t0 := time.Now()
				require.NoError(b, worker.Append(ctx, testDB.Pool, amountEvent(iso.slow, iso.ids.id(5, iso.late), 1)))
				select {
				case <-started:
				case <-time.After(30 * time.Second):
					b.Fatal("the rewind did not start")
				}
				tracer.take()
				time.Sleep(100 * time.Millisecond) // the replay is under way
				var rewound time.Time
				var claimsDuring int
				watch := func() {
					if rewound.IsZero() && m.counter(b, "perspectives.rewind.completed") > done0 {
						rewound = time.Now()
						claimsDuring = tracer.take()["PairsClaim"].n
					}
				}
				rate := isoDrain(b, m, watch)
				drained := time.Now()
				benchWait(b, 5*time.Minute, time.Millisecond, "the rewind", func() bool { watch(); return !rewound.IsZero() })
				benchWaitCount(b, isoName, iso.slow, iso.n+1, time.Minute)
				iso.n++
				persp.armed.Store(false)
				during = append(during, rate)
				// 1 when the drain ended before the rewind did (fully "during" it); less when
				// the drain ran on after the rewind.
				covered = append(covered, min(1, float64(rewound.Sub(t0))/float64(drained.Sub(t0))))
				claims = append(claims, float64(claimsDuring))
				rewindMS = append(rewindMS, ms(rewound.Sub(t0)))
			}
			isoRound++
		}
	}
	b.StopTimer()
	b.ReportMetric(medianOf(normal), "normal-events/s")
	b.ReportMetric(medianOf(during), "during-rewind-events/s")
	b.ReportMetric(medianOf(during)/medianOf(normal), "during/normal")
	b.ReportMetric(medianOf(covered), "rewind-covers-drain")
	b.ReportMetric(medianOf(rewindMS), "rewind-ms")
	// Polls of the queue (PairsClaim) the worker made while the rewind replayed.
	b.ReportMetric(medianOf(claims), "claims-during-rewind")
}

// isoDrain appends the other streams' backlog and returns its events/s.
func isoDrain(b *testing.B, m *benchMetrics, watch func()) float64 {
	const total = isoStreams * isoPerStream
	before := m.counter(b, "perspectives.events.applied")
	evs := make([]worker.Event, 0, total)
	for range isoStreams {
		evs = append(evs, events(uuid.New(), newIDs(b, isoPerStream))...)
	}
	t0 := time.Now()
	benchAppend(b, evs)
	benchWait(b, 5*time.Minute, time.Millisecond, "the other streams to be applied", func() bool {
		watch()
		return m.counter(b, "perspectives.events.applied") >= before+total
	})
	return total / time.Since(t0).Seconds()
}
