package worker_test

// Operator actions against the backlog: on a database created for the run, a pair whose
// perspective fails at its first events, parked at the first failure by its failure policy,
// with 200,000 events queued behind them, and a pair with one event behind them. With one
// default worker running, each sample retries the parked pair (Admin.Retry), which the worker
// parks again at once (the same failure), and skips the failing event (Admin.Skip), after
// which the worker parks the pair at the next failing event. Meanwhile a goroutine appends
// one event at a time to other streams. Every action writes one row per pair whatever its
// backlog (docs/internals.md): its time must not grow with the events queued behind it, nor
// hold up the Appends.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/worker"
)

const (
	opsName    = "bench_ops"
	opsBehind  = 200000 // events queued behind the failing ones, on the large pair
	opsSamples = 5      // retries and skips of each pair
	opsOthers  = 50     // the streams the appender appends to
)

// opsPerspective sums the amounts of its events and fails at every "poison" event.
func opsPerspective(name string) worker.Perspective {
	return worker.JSONPerspective(name, func(m sumModel, ev worker.Event) (sumModel, error) {
		if ev.Type == "poison" {
			return m, errors.New("poison event")
		}
		var a amount
		if err := json.Unmarshal(ev.Data, &a); err != nil {
			return m, err
		}
		m.Count++
		m.Sum += a.N
		return m, nil
	})
}

// opsPair is a pair of the benchmark: its stream, its failing events (the first ones, in
// order) and the events queued behind them.
type opsPair struct {
	name   string // figure prefix: "" (200,000 behind) or "-1" (1 behind)
	stream uuid.UUID
	poison []uuid.UUID
	behind int
}

// opsSpans records when each Append of the appender ran.
type opsSpans struct {
	mu    sync.Mutex
	spans [][2]time.Time
}

func (s *opsSpans) add(start, end time.Time) {
	s.mu.Lock()
	s.spans = append(s.spans, [2]time.Time{start, end})
	s.mu.Unlock()
}

// slowest is the longest Append that ran at some time between from and to.
func (s *opsSpans) slowest(from, to time.Time) time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	var d time.Duration
	for _, sp := range s.spans {
		if sp[0].Before(to) && sp[1].After(from) {
			d = max(d, sp[1].Sub(sp[0]))
		}
	}
	return d
}

func (s *opsSpans) all() []float64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]float64, len(s.spans))
	for i, sp := range s.spans {
		out[i] = ms(sp[1].Sub(sp[0]))
	}
	return out
}

// waitParkedAt waits (looking every millisecond) until the pair is parked at event, and
// returns when it saw it.
func waitParkedAt(b *testing.B, ctx context.Context, pool *pgxpool.Pool, p opsPair, event uuid.UUID) time.Time {
	b.Helper()
	var seen time.Time
	benchWait(b, time.Minute, time.Millisecond, "the pair to be parked", func() bool {
		var parked bool
		require.NoError(b, pool.QueryRow(ctx, `SELECT COALESCE((SELECT status = 'parked' AND failed_event_id = $3
			FROM wh_perspective_cursors WHERE stream_id = $1 AND perspective_name = $2), false)`,
			p.stream, opsName, event).Scan(&parked))
		seen = time.Now()
		return parked
	})
	return seen
}

// BenchmarkOperatorActions reports the median time of Admin.Retry and Admin.Skip of a parked
// pair with 200,000 events queued behind its failing event and of one with 1, of the
// statement that parks it again (PairsMarkFailed) and from the retry to the pair seen parked
// again, and the slowest Append of another stream during those actions.
//
// PERSPECTIVES_BENCH_VERBOSE=1 logs the worker's statements (count and time by name).
func BenchmarkOperatorActions(b *testing.B) {
	ctx := context.Background()
	fig := map[string][]float64{}
	for range b.N {
		d := freshDB(b, "ops")
		cfg := worker.Config{
			Perspectives:    []worker.Perspective{opsPerspective(opsName)},
			FailurePolicies: map[string]worker.FailurePolicy{opsName: {Attempts: 1}}, // park at the first failure
		}
		register(b, d.Pool, cfg)
		pairs := []opsPair{{name: "", behind: opsBehind}, {name: "-1", behind: 1}}
		for i := range pairs {
			p := &pairs[i]
			p.stream, p.poison = uuid.New(), newIDs(b, opsSamples+1)
			evs := make([]worker.Event, len(p.poison))
			for j, id := range p.poison {
				evs[j] = worker.Event{ID: id, StreamID: p.stream, Type: "poison", Data: json.RawMessage(`{}`)}
			}
			require.NoError(b, worker.Append(ctx, d.Pool, evs...))
			for left := p.behind; left > 0; left -= 1000 {
				require.NoError(b, worker.Append(ctx, d.Pool, events(p.stream, newIDs(b, min(left, 1000)))...))
			}
		}
		_, err := d.Pool.Exec(ctx, `ANALYZE`) // as autovacuum would after the load
		require.NoError(b, err)
		admin, err := worker.NewAdmin(d.Pool, nil)
		require.NoError(b, err)

		tracer := newStmtTracer()
		w := benchStartOn(b, benchPool(b, d.URL, tracer), cfg)
		for _, p := range pairs {
			waitParkedAt(b, ctx, d.Pool, p, p.poison[0])
		}

		others := make([]uuid.UUID, opsOthers)
		for i := range others {
			others[i] = uuid.New()
		}
		var spans opsSpans
		stop := make(chan struct{})
		appended := make([]int, opsOthers)
		var appendErr error
		var wg sync.WaitGroup
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				t0 := time.Now()
				if err := worker.Append(ctx, d.Pool, amountEvent(others[i%opsOthers], uuid.Nil, 1)); err != nil {
					appendErr = err
					return
				}
				spans.add(t0, time.Now())
				appended[i%opsOthers]++
			}
		})

		appendMax := map[string]time.Duration{}
		for i := range opsSamples {
			for k := range pairs {
				p := pairs[(i+k)%len(pairs)]
				tracer.take()
				t0 := time.Now()
				n, err := admin.Retry(ctx, p.stream, opsName)
				retried := time.Now()
				require.NoError(b, err)
				require.Equal(b, 1, n, "the retry made the pair due")
				reparked := waitParkedAt(b, ctx, d.Pool, p, p.poison[i])
				st := tracer.take()
				require.Positive(b, st["PairsMarkFailed"].n, "the worker parked the pair again")
				appendMax[p.name] = max(appendMax[p.name], spans.slowest(t0, reparked))
				fig["retry"+p.name] = append(fig["retry"+p.name], ms(retried.Sub(t0)))
				fig["repark"+p.name] = append(fig["repark"+p.name], ms(reparked.Sub(retried)))
				fig["park"+p.name] = append(fig["park"+p.name], ms(st["PairsMarkFailed"].max))

				s0 := time.Now()
				versions, err := admin.Skip(ctx, p.stream, opsName, p.poison[i], "bench")
				skipped := time.Now()
				require.NoError(b, err)
				require.Equal(b, []int{1}, versions, "the skip skipped the event in version 1")
				parked := waitParkedAt(b, ctx, d.Pool, p, p.poison[i+1])
				skipSt := tracer.take()
				require.Positive(b, skipSt["PairsMarkFailed"].n, "the worker parked the pair at its next failing event")
				appendMax[p.name] = max(appendMax[p.name], spans.slowest(s0, parked))
				fig["skip"+p.name] = append(fig["skip"+p.name], ms(skipped.Sub(s0)))
				fig["park"+p.name] = append(fig["park"+p.name], ms(skipSt["PairsMarkFailed"].max))
				if os.Getenv("PERSPECTIVES_BENCH_VERBOSE") != "" {
					fmt.Fprintf(os.Stderr, "pair with %d behind, sample %d: retry %.1f ms, parked again %.1f ms later; skip %.1f ms, parked at the next %.1f ms later; slowest Append %.1f ms, %.1f ms; statements from the retry to the park:\n%s",
						p.behind, i, ms(retried.Sub(t0)), ms(reparked.Sub(retried)), ms(skipped.Sub(s0)), ms(parked.Sub(skipped)),
						ms(spans.slowest(t0, reparked)), ms(spans.slowest(s0, parked)), stmtReport(st))
				}
			}
		}
		close(stop)
		wg.Wait()
		require.NoError(b, appendErr)
		for _, p := range pairs {
			fig["append-max"+p.name] = append(fig["append-max"+p.name], ms(appendMax[p.name]))
		}
		fig["append-p50"] = append(fig["append-p50"], medianOf(spans.all()))

		// Each pair parked at its last failing event, with every other event still queued,
		// nothing applied and every failing event before it skipped; the Appends applied.
		for _, p := range pairs {
			var queued, skippedEvents int
			require.NoError(b, d.Pool.QueryRow(ctx, `SELECT
				(SELECT count(*) FROM wh_perspective_events WHERE stream_id = $1 AND perspective_name = $2)::int,
				(SELECT count(*) FROM wh_skipped_events WHERE stream_id = $1 AND perspective_name = $2)::int`,
				p.stream, opsName).Scan(&queued, &skippedEvents))
			require.Equal(b, p.behind+1, queued, "the pair's events behind its failing one are queued")
			require.Equal(b, opsSamples, skippedEvents, "every skipped event is recorded")
			_, ok, err := worker.LoadModel(ctx, d.Pool, opsName, p.stream)
			require.NoError(b, err)
			require.False(b, ok, "nothing was applied to the parked pair")
		}
		counts := make([]int32, opsOthers)
		for i, n := range appended {
			counts[i] = int32(n)
		}
		benchWait(b, time.Minute, 5*time.Millisecond, "the Appends to be applied", func() bool {
			var done int
			require.NoError(b, d.Pool.QueryRow(ctx, `SELECT count(*)::int FROM unnest($2::uuid[], $3::int[]) AS a (stream_id, n)
				JOIN wh_perspective_models m ON m.stream_id = a.stream_id AND m.perspective_name = $1
				WHERE (m.model->>'c')::int = a.n`, opsName, others, counts).Scan(&done))
			return done == opsOthers
		})
		benchStop(b, w)
	}
	for _, name := range []string{"retry", "skip", "park", "repark"} {
		for _, suffix := range []string{"", "-1"} {
			b.ReportMetric(medianOf(fig[name+suffix]), name+suffix+"-ms")
		}
	}
	b.ReportMetric(medianOf(fig["append-max"]), "append-max-ms")
	b.ReportMetric(medianOf(fig["append-max-1"]), "append-max-1-ms")
	b.ReportMetric(medianOf(fig["append-p50"]), "append-p50-ms")
}
