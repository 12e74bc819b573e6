package worker

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
)

// fakeInstances records the heartbeats' calls; beats fail while fail is set, and hang until
// their context ends while hang is set.
type fakeInstances struct {
	mu     sync.Mutex
	beats  []time.Time // successful beats
	tried  int
	fail   bool
	hang   bool
	hung   []time.Duration // how long each hanging beat waited
	forgot []uuid.UUID
	// forgetCtx is the error of each forget's context when called
	forgetCtx []error
	row       instanceRecord
}

func (f *fakeInstances) beat(ctx context.Context, r instanceRecord) error {
	f.mu.Lock()
	f.tried++
	f.row = r
	fail, hang := f.fail, f.hang
	f.mu.Unlock()
	if hang {
		start := time.Now()
		<-ctx.Done()
		f.mu.Lock()
		f.hung = append(f.hung, time.Since(start))
		f.mu.Unlock()
		return ctx.Err()
	}
	if fail {
		return context.DeadlineExceeded
	}
	f.mu.Lock()
	f.beats = append(f.beats, time.Now())
	f.mu.Unlock()
	return nil
}

// refresh is beat on a row that is there.
func (f *fakeInstances) refresh(ctx context.Context, r instanceRecord) (bool, error) {
	return true, f.beat(ctx, r)
}

func (f *fakeInstances) forget(ctx context.Context, id uuid.UUID) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.forgetCtx = append(f.forgetCtx, ctx.Err())
	if ctx.Err() != nil {
		return ctx.Err()
	}
	f.forgot = append(f.forgot, id)
	return nil
}

func (f *fakeInstances) forgetGone(context.Context, time.Duration, LeaderLease) (int64, error) {
	return 0, nil
}

func (f *fakeInstances) set(fn func(f *fakeInstances)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	fn(f)
}

func (f *fakeInstances) snapshot() (beats []time.Time, tried int, hung []time.Duration, forgot []uuid.UUID) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]time.Time(nil), f.beats...), f.tried, append([]time.Duration(nil), f.hung...), append([]uuid.UUID(nil), f.forgot...)
}

// syncBuf is a goroutine-safe log sink.
type syncBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuf) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuf) count(msg string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return strings.Count(s.b.String(), msg)
}

func TestHeartbeatBeatsEveryIntervalSurvivesFailuresAndForgetsAtStop(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const every = 5 * time.Second
		rec := &fakeInstances{}
		var logs syncBuf
		log := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
		id := uuid.New()
		row := newInstanceRecord(id, every, []PerspectiveVersion{{Name: "orders", Version: 2}})
		start := time.Now()

		var applied, sinkNanos, sinkWrites atomic.Int64 // events applied to orders, its sink's Writes
		h := startHeartbeat(context.Background(), rec, row, func() []perspectiveCount {
			return []perspectiveCount{{applied: applied.Load(), sinkNanos: sinkNanos.Load(), sinkWrites: sinkWrites.Load()}}
		}, log)
		stopped := false
		defer func() {
			if !stopped {
				h.stop(context.Background())
			}
		}()
		beats, _, _, _ := rec.snapshot()
		require.Len(t, beats, 1, "the first heartbeat is written before startHeartbeat returns")
		require.Equal(t, start, beats[0])
		var written instanceRecord
		rec.set(func(f *fakeInstances) { written = f.row })
		require.Equal(t, []float64{0}, written.Rates, "no rate before a whole interval")
		require.Equal(t, []float64{0}, written.SinkMillis, "no sink time before a whole interval")
		written.Rates, written.SinkMillis = nil, nil
		require.Equal(t, row, written)
		require.NotEmpty(t, written.Host)
		require.Positive(t, written.PID)

		applied.Add(50) // 10 per second over the first interval
		sinkNanos.Add(int64(30 * time.Millisecond))
		sinkWrites.Add(4) // 7.5 ms per Write
		time.Sleep(every)
		synctest.Wait()
		rec.set(func(f *fakeInstances) { written = f.row })
		require.Equal(t, []float64{10}, written.Rates, "the events applied per second over the last interval")
		require.Equal(t, []float64{7.5}, written.SinkMillis, "the sink's mean time per Write over the last interval")
		time.Sleep(every)
		synctest.Wait()
		rec.set(func(f *fakeInstances) { written = f.row })
		require.Equal(t, []float64{0}, written.Rates, "none applied in the second interval")
		require.Equal(t, []float64{0}, written.SinkMillis, "no Write in the second interval")
		beats, _, _, _ = rec.snapshot()
		require.Equal(t, []time.Time{start, start.Add(every), start.Add(2 * every)}, beats, "one heartbeat per interval")

		// Failing writes: a warning once, then debug lines; the heartbeat goes on.
		rec.set(func(f *fakeInstances) { f.fail = true })
		time.Sleep(3 * every)
		synctest.Wait()
		_, tried, _, _ := rec.snapshot()
		require.Equal(t, 6, tried)
		require.Equal(t, 1, logs.count("level=WARN msg=\"heartbeat not recorded; will retry"))
		require.Equal(t, 2, logs.count("level=DEBUG msg=\"heartbeat not recorded\""))

		rec.set(func(f *fakeInstances) { f.fail = false })
		time.Sleep(every)
		synctest.Wait()
		beats, _, _, _ = rec.snapshot()
		require.Len(t, beats, 4)
		require.Equal(t, 1, logs.count("heartbeat recorded again"))

		// A write that hangs is cut off after heartbeatTimeout, and the next one is on time.
		rec.set(func(f *fakeInstances) { f.hang = true })
		time.Sleep(every)
		synctest.Wait()
		time.Sleep(heartbeatTimeout)
		synctest.Wait()
		rec.set(func(f *fakeInstances) { f.hang = false })
		time.Sleep(every - heartbeatTimeout)
		synctest.Wait()
		beats, _, hung, _ := rec.snapshot()
		require.Equal(t, []time.Duration{heartbeatTimeout}, hung)
		require.Len(t, beats, 5)
		require.Equal(t, start.Add(8*every), beats[4], "the beat after the one that hung is on time")

		h.stop(context.Background())
		stopped = true
		_, tried, _, forgot := rec.snapshot()
		require.Equal(t, []uuid.UUID{id}, forgot, "the row is deleted at stop")
		time.Sleep(3 * every)
		synctest.Wait()
		_, after, _, _ := rec.snapshot()
		require.Equal(t, tried, after, "no heartbeat after stop")
	})
}

// stop lets a heartbeat in progress end by itself before it deletes the row: cancelled, its
// statement could still commit on the server after the deletion and bring the row back (seen
// once in TestBuildStatusThroughputFromHeartbeats: a stopped worker's rate still counted).
func TestHeartbeatStopWaitsForTheBeatInProgress(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const every = 5 * time.Second
		rec := &fakeInstances{}
		log := slog.New(slog.NewTextHandler(&syncBuf{}, nil))
		id := uuid.New()
		h := startHeartbeat(context.Background(), rec, newInstanceRecord(id, every, nil), nil, log)
		rec.set(func(f *fakeInstances) { f.hang = true })
		time.Sleep(every) // the second beat begins, and hangs until its timeout
		synctest.Wait()
		_, tried, _, _ := rec.snapshot()
		require.Equal(t, 2, tried)

		began := time.Now()
		h.stop(context.Background())
		_, _, hung, forgot := rec.snapshot()
		require.Equal(t, []time.Duration{heartbeatTimeout}, hung, "the beat in progress was not cut short")
		require.Equal(t, heartbeatTimeout, time.Since(began), "stop waited for it, no longer")
		require.Equal(t, []uuid.UUID{id}, forgot, "then the row is deleted")
	})
}

// stop runs under its context: a beat in progress is cut short when that context ends (not
// at its own timeout), and the row's deletion runs under it too, so stop returns by its
// deadline (here the row is left to lapse, and a warning says so).
func TestHeartbeatStopRunsUnderItsContext(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const every = 5 * time.Second
		rec := &fakeInstances{}
		var logs syncBuf
		h := startHeartbeat(context.Background(), rec, newInstanceRecord(uuid.New(), every, nil), nil, slog.New(slog.NewTextHandler(&logs, nil)))
		rec.set(func(f *fakeInstances) { f.hang = true })
		time.Sleep(every) // the second beat begins, and hangs
		synctest.Wait()

		began := time.Now()
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		h.stop(ctx)
		require.Equal(t, time.Second, time.Since(began), "stop returned at its deadline")
		rec.set(func(f *fakeInstances) {
			require.Equal(t, []time.Duration{time.Second}, f.hung, "the beat in progress was cut short at the deadline")
			require.Equal(t, []error{context.DeadlineExceeded}, f.forgetCtx, "the deletion ran under stop's context")
		})
		require.Equal(t, 1, logs.count("instance row not deleted at stop"))
	})
}
