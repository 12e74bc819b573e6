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

// A pair whose failure could not be recorded waits RetryBackoff, doubling with each such
// failure in a row up to MaxRetryBackoff, before it is due again; the loop counts the failures
// in a row and forgets them once a job of the pair runs to the end, or when none runs here for
// heldFor after the last one.
func TestUnrecordedFailuresBackOffAndTheCountResets(t *testing.T) {
	t.Parallel()
	w := &Worker{cfg: Config{RetryBackoff: time.Second, MaxRetryBackoff: 4 * time.Second}}
	var waits []time.Duration
	for n := 1; n <= 4; n++ {
		waits = append(waits, w.unrecordedWait(n))
	}
	assert.Equal(t, []time.Duration{time.Second, 2 * time.Second, 4 * time.Second, 4 * time.Second}, waits)

	s, _ := newTestSchedule(30 * time.Second)
	s.heldFor = 8 * time.Second
	p := Pair{Stream: uuid.New(), Perspective: "p"}
	t0 := time.Now()
	for range 2 {
		j := job{kind: jobApply, pairs: []Pair{p}}
		s.started(&j)
		s.finish(jobResult{job: j, unrecorded: []Pair{p}}, t0)
	}
	assert.Equal(t, 2, s.held[p].failures)
	j := job{kind: jobApply, pairs: []Pair{p}}
	s.started(&j)
	assert.Equal(t, 2, j.unrecorded[p], "the next job knows the count, for its release's wait")
	s.finish(jobResult{job: j, busy: []Pair{p}}, t0)
	assert.Equal(t, 2, s.held[p].failures, "a job that did not run to the end keeps the count")
	s.started(&j)
	s.finish(jobResult{job: j}, t0)
	assert.NotContains(t, s.held, p, "a job that ran to the end resets it")

	// A pair no job here runs again (its rows went elsewhere) is forgotten heldFor after its
	// last such failure: the map keeps nothing that is over.
	s.started(&j)
	s.finish(jobResult{job: j, unrecorded: []Pair{p}}, t0)
	other := job{kind: jobApply, pairs: []Pair{{Stream: uuid.New(), Perspective: "p"}}}
	s.started(&other)
	s.finish(jobResult{job: other}, t0.Add(8*time.Second))
	assert.Contains(t, s.held, p, "not before heldFor")
	s.started(&other)
	s.finish(jobResult{job: other}, t0.Add(8*time.Second+time.Nanosecond))
	assert.NotContains(t, s.held, p, "forgotten after heldFor")
}
