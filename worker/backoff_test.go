package worker

// Internal tests of the backoffs: the delays, and the loop's state about pairs whose failure
// could not be recorded.

import (
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
)

// The delay doubles from first with each failure in a row, up to max; reset starts again.
func TestBackoffDoublesUpToItsCapAndResets(t *testing.T) {
	t.Parallel()
	b := backoff{first: time.Second, max: 5 * time.Second}
	t0 := time.Now()
	var got []time.Duration
	for range 5 {
		got = append(got, b.fail(t0))
	}
	assert.Equal(t, []time.Duration{time.Second, 2 * time.Second, 4 * time.Second, 5 * time.Second, 5 * time.Second}, got)
	assert.Equal(t, 5*time.Second, b.waiting(t0))
	assert.Zero(t, b.waiting(t0.Add(5*time.Second)))
	assert.Equal(t, 5, b.reset())
	assert.Equal(t, time.Second, b.fail(t0))
}

// A pair whose failure could not be recorded is skipped by the claims until its backoff
// ends, and forgotten when it is not claimed again for MaxRetryBackoff after that (its rows
// went elsewhere): the map keeps nothing that is over.
func TestScheduleForgetsAPairBackingOffThatIsNotClaimedAgain(t *testing.T) {
	t.Parallel()
	s, _ := newTestSchedule(30 * time.Second)
	s.retry = backoff{first: time.Second, max: 4 * time.Second}
	p := Pair{Stream: uuid.New(), Perspective: "p"}
	t0 := time.Now()
	s.finish(jobResult{job: job{kind: jobApply, pairs: []Pair{p}}, unrecorded: []Pair{p}}, t0)

	assert.Equal(t, []Pair{p}, s.backingOff(t0.Add(999*time.Millisecond)))
	assert.Equal(t, time.Millisecond, s.nextRetry(t0.Add(999*time.Millisecond)))
	assert.Empty(t, s.backingOff(t0.Add(time.Second)), "claimable once the backoff ends")
	assert.Contains(t, s.held, p, "its spell goes on until it is processed")
	assert.Empty(t, s.backingOff(t0.Add(5*time.Second)))
	assert.Contains(t, s.held, p)
	s.backingOff(t0.Add(5*time.Second + time.Nanosecond))
	assert.Empty(t, s.held, "not claimed for MaxRetryBackoff since: forgotten")
}
