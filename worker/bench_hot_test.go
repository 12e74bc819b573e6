package worker_test

// One hot stream alone: on a database created for the run, 200,000 events of one stream
// queued by Appends of 10 events, drained by one default worker, against the same number of
// events over 4,000 streams (50 each) drained the same way, from backlogs restored before
// every drain, interleaved. The hot stream is one pair, applied a batch (BatchSize) at a time,
// up to ten batches per claim (a full batch keeps the lease for the next): its throughput is
// that of its transactions in a row, and the time of its last tenth against its first tells
// whether a batch costs more with the backlog behind it or the rows applied before it. A
// third variant drains the hot stream with BatchSize 1000: what a larger batch buys a long
// backlog.

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/worker"
)

const (
	hotName       = "bench_hot"
	hotPerAppend  = 10
	hotAppends    = 20000
	hotEvents     = hotAppends * hotPerAppend
	hotAppendsTx  = 200 // Appends per transaction of the setup
	hotStreams    = 4000
	hotPerStream  = hotEvents / hotStreams
	hotRounds     = 1 // rounds of every variant per run (the order rotates from run to run)
	hotTenth      = hotEvents / 10
	hotAppendData = 55 // the sum of one Append's amounts (events: 1..10)
)

var hotRound int

// BenchmarkHotStream reports the events per second of one default worker draining one hot
// stream and draining as many events spread over 4,000 streams, their ratio, the time of
// the hot stream's last tenth over its first, and the hot stream's drain with BatchSize 1000
// against the same spread drain.
//
// PERSPECTIVES_BENCH_VERBOSE=1 logs every drain's statements (count and time by name).
func BenchmarkHotStream(b *testing.B) {
	ctx := context.Background()
	b.StopTimer() // only the drains are timed
	verbose := os.Getenv("PERSPECTIVES_BENCH_VERBOSE") != ""
	tracer := newStmtTracer()
	rates := map[string][]float64{}
	var tenths []float64 // the hot stream's last tenth over its first, per drain
	var firstMs, lastMs []float64
	for range b.N {
		d := freshDB(b, "hot")
		persp := sumPerspective(hotName)
		register(b, d.Pool, worker.Config{Perspectives: []worker.Perspective{persp}})
		hot := uuid.New()
		for range hotAppends / hotAppendsTx {
			require.NoError(b, pgx.BeginFunc(ctx, d.Pool, func(tx pgx.Tx) error {
				for range hotAppendsTx {
					if err := worker.Append(ctx, tx, events(hot, newIDs(b, hotPerAppend))...); err != nil {
						return err
					}
				}
				return nil
			}))
		}
		hotBacklog := drainBacklog{pool: d.Pool, persp: persp, events: hotEvents, saved: "bench_hot"}
		hotBacklog.save(b, ctx)
		appendBacklog(b, ctx, d.Pool, hotStreams, hotPerStream)
		spread := drainBacklog{pool: d.Pool, persp: persp, events: hotEvents, saved: "bench_spread"}
		spread.save(b, ctx)
		pool := benchPool(b, d.URL, tracer)
		cfg := worker.Config{PollInterval: worker.DefaultPollInterval} // the defaults
		variants := []string{"hot", "spread", "hot-b1000"}
		for range hotRounds {
			for j := range variants {
				v := variants[(hotRound+j)%len(variants)]
				tracer.take()
				var el time.Duration
				switch v {
				case "hot", "hot-b1000":
					hotBacklog.reset(b, ctx)
					hcfg := cfg
					if v == "hot-b1000" {
						hcfg.BatchSize = 1000
					}
					var begun, tenth, ninth time.Duration // first applied, a tenth applied, nine tenths
					el = hotBacklog.drainWorker(b, ctx, pool, hcfg, 1, func(applied int64, at time.Duration) {
						if begun == 0 && applied > 0 {
							begun = at
						}
						if tenth == 0 && applied >= hotTenth {
							tenth = at
						}
						if ninth == 0 && applied >= hotEvents-hotTenth {
							ninth = at
						}
					})
					require.Positive(b, ninth, "nine tenths of the hot stream were seen applied before the end")
					if v == "hot" {
						first, last := tenth-begun, el-ninth
						firstMs, lastMs = append(firstMs, ms(first)), append(lastMs, ms(last))
						tenths = append(tenths, last.Seconds()/first.Seconds())
					}
					var c, s int
					require.NoError(b, d.Pool.QueryRow(ctx, `SELECT (model->>'c')::int, (model->>'s')::int FROM wh_perspective_models
						WHERE perspective_name = $1 AND stream_id = $2`, hotName, hot).Scan(&c, &s))
					require.Equal(b, hotEvents, c, "the hot stream's model counts every event")
					require.Equal(b, hotAppends*hotAppendData, s, "the hot stream's model sums every event")
				case "spread":
					spread.reset(b, ctx)
					el = spread.drainWorker(b, ctx, pool, cfg, 1, nil)
					var right int
					require.NoError(b, d.Pool.QueryRow(ctx, `SELECT count(*)::int FROM wh_perspective_models
						WHERE perspective_name = $1 AND (model->>'c')::int = $2 AND (model->>'s')::int = $3`,
						hotName, hotPerStream, hotPerStream*(hotPerStream+1)/2).Scan(&right))
					require.Equal(b, hotStreams, right, "every spread stream's model counts and sums its events")
				}
				var pairs int
				require.NoError(b, d.Pool.QueryRow(ctx, `SELECT count(*)::int FROM wh_perspective_pairs`).Scan(&pairs))
				require.Zero(b, pairs, "%s: due rows left after the drain", v)
				rates[v] = append(rates[v], hotEvents/el.Seconds())
				if verbose {
					fmt.Fprintf(os.Stderr, "%s: %.0f events/s in %s; statements:\n%s", v, hotEvents/el.Seconds(), el, stmtReport(tracer.take()))
				}
			}
			hotRound++
		}
	}
	b.ReportMetric(medianOf(rates["hot"]), "hot-events/s")
	b.ReportMetric(medianOf(rates["spread"]), "spread-events/s")
	b.ReportMetric(medianOf(rates["hot"])/medianOf(rates["spread"]), "hot/spread")
	b.ReportMetric(medianOf(rates["hot-b1000"]), "hot-b1000-events/s")
	b.ReportMetric(medianOf(rates["hot-b1000"])/medianOf(rates["spread"]), "hot-b1000/spread")
	b.ReportMetric(medianOf(firstMs), "hot-first-tenth-ms")
	b.ReportMetric(medianOf(lastMs), "hot-last-tenth-ms")
	b.ReportMetric(medianOf(tenths), "hot-last/first-tenth")
}
