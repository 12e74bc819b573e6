package worker

import (
	"log/slog"
	"time"
)

// backoff is the wait between attempts of something that keeps failing: first after the
// first failure, doubling with each further failure in a row up to max. A success resets
// it (reset).
type backoff struct {
	first, max time.Duration
	failures   int       // in a row
	until      time.Time // the next attempt waits until then
}

// fail records a failure at now and returns how long the next attempt waits.
func (b *backoff) fail(now time.Time) time.Duration {
	d := b.first
	for i := 0; i < b.failures && d < b.max; i++ {
		d *= 2
	}
	d = min(d, b.max)
	b.failures++
	b.until = now.Add(d)
	return d
}

// waiting is how long after now the next attempt may run (0: now).
func (b *backoff) waiting(now time.Time) time.Duration {
	return max(b.until.Sub(now), 0)
}

// reset forgets the failures and returns how many there were in a row.
func (b *backoff) reset() int {
	n := b.failures
	b.failures, b.until = 0, time.Time{}
	return n
}

// The pairs whose failure could not be recorded (Store.MarkFailed failed) back off: their
// job releases them due only after unrecordedWait (RetryBackoff, doubling up to
// MaxRetryBackoff with each such failure in a row, as a recorded failure's), so that they
// are not claimed again, to fail again, at every wake-up. The loop counts them (schedule.held);
// a job of the pair that ends with nothing left unrecorded resets the count.

// unrecordedWait is how long a pair whose failure could not be recorded, for the n-th time
// in a row (from 1), waits before it is due again.
func (w *Worker) unrecordedWait(n int) time.Duration {
	b := backoff{first: w.cfg.RetryBackoff, max: w.cfg.MaxRetryBackoff, failures: n - 1}
	return b.fail(time.Now())
}

// unrecordedSpell is a pair's run of failures that could not be recorded.
type unrecordedSpell struct {
	failures int       // in a row
	last     time.Time // when the last one was reported
}

// unrecorded takes, at now, the pairs of a job that ended whose failure could not be
// recorded, and resets the count of the others that left the flight and ran to the end (not
// busy, contended or cut off). It forgets a pair no job here ran for heldFor after its last
// such failure: its rows went elsewhere (another instance, a skip, a retired build), and so
// did the spell.
func (s *schedule) unrecorded(r jobResult, now time.Time) {
	failed := make(map[Pair]bool, len(r.unrecorded))
	for _, p := range r.unrecorded {
		failed[p] = true
		h := s.held[p]
		s.held[p] = unrecordedSpell{failures: h.failures + 1, last: now}
	}
	if len(s.held) == 0 {
		return
	}
	for p, h := range s.held {
		if s.inflight[p] == 0 && now.Sub(h.last) > s.heldFor {
			delete(s.held, p)
		}
	}
	unfinished := make(map[Pair]bool, len(r.busy)+len(r.contended)+len(r.cutOff))
	for _, l := range [][]Pair{r.busy, r.contended, r.cutOff} {
		for _, p := range l {
			unfinished[p] = true
		}
	}
	for _, p := range r.job.pairs {
		h, ok := s.held[p]
		if !ok || failed[p] || unfinished[p] || s.inflight[p] > 0 {
			continue
		}
		delete(s.held, p)
		s.log.Info("pair processed again after failures that could not be recorded",
			s.logPair(p, slog.Int("unrecorded_failures", h.failures))...)
	}
}
