package worker

import (
	"context"
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

// maxClaimBackoff caps the wait after claims that fail (below MaxRetryBackoff, meant for
// one pair): the whole instance waits, and it resumes within that long of the database
// accepting the claim again.
const maxClaimBackoff = 30 * time.Second

// claimBackoff is the backoff of claims that fail with an error other than a lost connection
// (the database refuses the statement): RetryBackoff, doubling up to maxClaimBackoff
// (MaxRetryBackoff when that is less).
func (w *Worker) claimBackoff() backoff {
	return backoff{first: w.cfg.RetryBackoff, max: min(w.cfg.MaxRetryBackoff, maxClaimBackoff)}
}

// noteClaimFailure takes a claim's outcome for its backoff b: a failure other than a lost
// connection (which claims every reconnectInterval: noteReachable) or a shutdown makes the
// next claim wait, and is logged once until a claim succeeds.
func (w *Worker) noteClaimFailure(ctx context.Context, b *backoff, err error) {
	switch {
	case err == nil:
		if n := b.reset(); n > 0 {
			w.log.Info("claims succeed again", slog.Int("failed_claims", n))
		}
	case ctx.Err() != nil || isConnectionError(err):
	default:
		d := b.fail(time.Now())
		level := slog.LevelError
		if b.failures > 1 {
			level = slog.LevelDebug // said once for the spell
		}
		w.log.Log(ctx, level, "poll queue failed; claiming again with backoff",
			slog.Any("error", err), slog.Int("failed_claims", b.failures), slog.Duration("retry_in", d))
	}
}

// The pairs whose failure could not be recorded (Store.MarkFailed failed) back off here:
// their rows stay due in the database, so without it they would be claimed again at once, and
// fail again, at every wake-up. Such a pair is not claimed until its backoff (RetryBackoff,
// doubling up to MaxRetryBackoff, as a recorded failure's) ends; a job of it that ends with
// nothing left unrecorded resets it.

// unrecorded takes the pairs of a job that ended at now whose failure could not be
// recorded, and resets the backoff of the others that left the flight and ran to the end
// (not busy, contended or cut off).
func (s *schedule) unrecorded(r jobResult, now time.Time) {
	failed := make(map[Pair]bool, len(r.unrecorded))
	for _, p := range r.unrecorded {
		failed[p] = true
		b, ok := s.held[p]
		if !ok {
			b = &backoff{first: s.retry.first, max: s.retry.max}
			s.held[p] = b
		}
		b.fail(now)
	}
	if len(s.held) == 0 {
		return
	}
	unfinished := make(map[Pair]bool, len(r.busy)+len(r.contended)+len(r.cutOff))
	for _, l := range [][]Pair{r.busy, r.contended, r.cutOff} {
		for _, p := range l {
			unfinished[p] = true
		}
	}
	for _, p := range r.job.pairs {
		b, ok := s.held[p]
		if !ok || failed[p] || unfinished[p] || s.inflight[p] {
			continue
		}
		delete(s.held, p)
		s.log.Info("pair processed again after failures that could not be recorded",
			s.logPair(p, slog.Int("unrecorded_failures", b.failures))...)
	}
}

// backingOff returns the pairs whose backoff has not ended at now: the claims skip them. It
// forgets a pair not claimed again for MaxRetryBackoff after its backoff ended: its rows are
// gone (applied by another instance, skipped, a retired build's), and so is the spell.
func (s *schedule) backingOff(now time.Time) []Pair {
	var out []Pair
	for p, b := range s.held {
		switch {
		case b.waiting(now) > 0:
			out = append(out, p)
		case !s.inflight[p] && now.Sub(b.until) > s.retry.max:
			delete(s.held, p)
		}
	}
	return out
}

// nextRetry is how long after now the first backoff that has not ended ends (0: none).
func (s *schedule) nextRetry(now time.Time) time.Duration {
	var d time.Duration
	for _, b := range s.held {
		if w := b.waiting(now); w > 0 && (d == 0 || w < d) {
			d = w
		}
	}
	return d
}
