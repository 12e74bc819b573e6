package worker

// The claim: the loop leases due pairs in one statement (queries/claim.sql, wh_claim_pairs)
// and starts them in groups; after each job its pairs' leases end (wh_pairs_release).

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"github.com/google/uuid"

	"github.com/perspectives-go/perspectives/db"
)

// reconnectInterval is how often the loop claims while the database does not answer (a
// restart, a failover), so that it resumes within that long of the server answering.
const reconnectInterval = 100 * time.Millisecond

// claimAndStart leases due pairs for free slots and starts them, in groups. It reports
// whether to claim again at once (the claim returned its limit), and the claim's error.
func (w *Worker) claimAndStart(ctx context.Context, s *schedule, free int, start func(job)) (bool, error) {
	limit := free * w.cfg.GroupSize
	sent := time.Now()
	claimed, err := w.store.Claim(ctx, ClaimRequest{
		Instance:     w.cfg.InstanceID,
		Perspectives: w.builds().keys,
		Limit:        limit,
		Lease:        w.cfg.LockOptions.LockTimeout,
	})
	if err != nil {
		if isConnectionError(err) && !neverSent(err) {
			s.unknown = true // the claim may have committed (see releaseUnknown)
		}
		return false, err
	}
	s.nextDue = claimed.NextDue
	if claimed.NextDue.IsZero() || claimed.NextDue.After(time.Now()) {
		s.nextDueMissed = false
	}
	// A pair may still be in a job here whose report the loop has not taken yet (the job
	// released it first), or whose lease lapsed (a slow Apply): its new job finds it held
	// by the apply coordinator and releases it due again after busyWait, so it is never left
	// leased by a job that does not run it.
	for _, group := range splitGroups(claimed.Pairs, free) {
		j := job{kind: jobApply, pairs: group, claimed: sent}
		s.started(&j)
		start(j)
	}
	return len(claimed.Pairs) >= limit, nil
}

// releaseUnknown ends, in one statement with the leases of more, the leases this instance
// may hold without knowing of them, when s.unknown says that a lost connection cut off a
// claim (it may have committed) or a release (it may not have) since the last look: it reads
// the pairs whose unexpired leases the instance holds (PairsLeasedBy) and releases those no
// job here holds (s.inflight counts every pair a job here runs or waits for). That is safe
// because the release is fenced by leased_by and no job here runs them. A pair backing off
// after a failure that could not be recorded is released due after that backoff. The read
// and the release run under a fresh context bounded by releaseTimeout each (at Stop, the
// loop's may have ended). It reports whether it released pairs, and its error: when the read
// fails, more are released all the same; when the read or the release fails, s.unknown
// stays set, and the loop tries again after its next claim (at Stop, the leases lapse).
func (w *Worker) releaseUnknown(ctx context.Context, s *schedule, more ...Pair) (bool, error) {
	req := ReleaseRequest{Instance: w.cfg.InstanceID, Pairs: slices.Clone(more), Later: map[Pair]time.Duration{}}
	unknown := 0
	var readErr error
	if s.unknown {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), releaseTimeout)
		leased, err := w.store.Leased(rctx, w.cfg.InstanceID)
		cancel()
		if err != nil {
			readErr = fmt.Errorf("read the pairs this instance leases: %w", err)
		}
		for _, p := range leased {
			if s.inflight[p] > 0 {
				continue
			}
			unknown++
			req.Pairs = append(req.Pairs, p)
			if h, ok := s.held[p]; ok {
				req.Later[p] = w.unrecordedWait(h.failures)
			}
		}
	}
	if len(req.Pairs) > 0 {
		slices.SortFunc(req.Pairs, comparePairs)
		req.Pairs = slices.Compact(req.Pairs)
		if err := w.sendRelease(ctx, req); err != nil {
			return false, err
		}
	}
	if unknown > 0 {
		w.log.Info("released the leases of pairs no job here holds (a claim or a release cut off by a lost connection)",
			slog.Int("pairs", unknown))
	}
	s.unknown = readErr != nil
	return len(req.Pairs) > 0, readErr
}

// splitGroups divides pairs into at most n groups of nearly equal size, in order.
func splitGroups(pairs []Pair, n int) [][]Pair {
	if len(pairs) == 0 || n <= 0 {
		return nil
	}
	n = min(n, len(pairs))
	size := (len(pairs) + n - 1) / n
	groups := make([][]Pair, 0, n)
	for len(pairs) > 0 {
		m := min(size, len(pairs))
		groups = append(groups, pairs[:m:m])
		pairs = pairs[m:]
	}
	return groups
}

// busyWait is how long a pair found held by another transaction or goroutine (a purge, a
// failure being recorded, a catch-up page) waits before it is due again.
const busyWait = 100 * time.Millisecond

// release ends the leases of r's pairs that no follow-up keeps: each is due again at its
// oldest queued event (its row goes when nothing is queued), a busy one after busyWait, one
// whose failure could not be recorded after its backoff (unrecordedWait). It runs under a
// fresh context bounded by releaseTimeout, so that a stop does not leave the leases to lapse.
// It reports whether a lost connection (a restart, a failover) or its own timeout failed
// it: the loop then releases the leases after its next claim that succeeds
// (releaseUnknown); after any other error they lapse, and the pairs are due again after
// LockTimeout.
func (w *Worker) release(ctx context.Context, r jobResult) (cut bool) {
	req := ReleaseRequest{Instance: w.cfg.InstanceID, Pairs: r.released(), Later: map[Pair]time.Duration{}}
	if len(req.Pairs) == 0 {
		return false
	}
	for _, p := range r.busy {
		req.Later[p] = busyWait
	}
	for _, p := range r.unrecorded {
		req.Later[p] = w.unrecordedWait(r.job.unrecorded[p] + 1)
	}
	err := w.sendRelease(ctx, req)
	if err == nil {
		return false
	}
	// Its own timeout (a server that stopped answering) leaves it as uncertain as a lost
	// connection does.
	cut = isConnectionError(err) || errors.Is(err, context.DeadlineExceeded)
	msg := "releasing the pairs' leases failed; they are due again when the leases lapse"
	if cut {
		msg = "releasing the pairs' leases failed; released after the next claim that succeeds, while they last"
	}
	w.log.Warn(msg, slog.Int("pairs", len(req.Pairs)), slog.Duration("lease", w.cfg.LockOptions.LockTimeout), slog.Any("error", err))
	return cut
}

// sendRelease runs req under a fresh context bounded by releaseTimeout.
func (w *Worker) sendRelease(ctx context.Context, req ReleaseRequest) error {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), releaseTimeout)
	defer cancel()
	return w.store.Release(rctx, req)
}

// released is the pairs of r's job that no follow-up keeps: the job releases their leases.
func (r jobResult) released() []Pair {
	kept := map[Pair]bool{}
	for _, next := range r.next {
		for _, p := range next.pairs {
			kept[p] = true
		}
	}
	var out []Pair
	for _, p := range r.job.pairs {
		if !kept[p] {
			out = append(out, p)
		}
	}
	return out
}

// maxClaimBackoff caps the wait after claims that fail (below MaxRetryBackoff, meant for
// one pair): the whole instance waits, and it resumes within that long of the database
// accepting the claim again.
const maxClaimBackoff = 30 * time.Second

// claimHealth is what the loop knows of its last claims.
type claimHealth struct {
	// unreachable: the last claim could not reach the database (a lost connection); the
	// loop claims again every reconnectInterval
	unreachable bool
	// refused backs off claims that fail otherwise (the database refuses the statement):
	// RetryBackoff, doubling up to maxClaimBackoff (MaxRetryBackoff when that is less)
	refused backoff
}

// newClaimHealth is the loop's claimHealth before its first claim.
func (w *Worker) newClaimHealth() claimHealth {
	return claimHealth{refused: backoff{first: w.cfg.RetryBackoff, max: min(w.cfg.MaxRetryBackoff, maxClaimBackoff)}}
}

// noteClaim takes a claim's outcome into h. A lost connection is logged once for a spell of
// the database not answering, and again when it answers; any other failure (but a shutdown)
// makes the next claim wait its backoff, and is logged once until a claim succeeds.
func (w *Worker) noteClaim(ctx context.Context, h *claimHealth, err error) {
	switch {
	case err == nil:
		if h.unreachable {
			w.log.Info("database answers again; claiming")
		}
		if n := h.refused.reset(); n > 0 {
			w.log.Info("claims succeed again", slog.Int("failed_claims", n))
		}
		h.unreachable = false
	case ctx.Err() != nil:
	case isConnectionError(err):
		if !h.unreachable {
			w.log.Warn("database unavailable; claiming again every 100ms until it answers", slog.Any("error", err))
		}
		h.unreachable = true
	default:
		h.unreachable = false
		d := h.refused.fail(time.Now())
		level := slog.LevelError
		if h.refused.failures > 1 {
			level = slog.LevelDebug // said once for the spell
		}
		w.log.Log(ctx, level, "poll queue failed; claiming again with backoff",
			slog.Any("error", err), slog.Int("failed_claims", h.refused.failures), slog.Duration("retry_in", d))
	}
}

// ClaimRequest asks Store.Claim for due pairs.
type ClaimRequest struct {
	Instance     uuid.UUID     // the lease holder
	Perspectives []string      // the build keys this instance runs
	Limit        int           // at most this many pairs
	Lease        time.Duration // how long the lease lasts: the pairs are due again then if not released
}

// Claimed is what Store.Claim leased.
type Claimed struct {
	Pairs []Pair
	// NextDue is when the first pair of those builds that is not due yet becomes due (a
	// backoff ending, a lease lapsing); the zero time: none is waiting.
	NextDue time.Time
}

// ReleaseRequest asks Store.Release to end leases.
type ReleaseRequest struct {
	Instance uuid.UUID
	Pairs    []Pair
	// Later holds the pairs due again only after a wait (held by another transaction; a
	// failure that could not be recorded), and that wait.
	Later map[Pair]time.Duration
}

func (s *pgStore) Claim(ctx context.Context, req ClaimRequest) (Claimed, error) {
	rows, err := s.q.PairsClaim(ctx, db.PairsClaimParams{
		InstanceID:   req.Instance,
		BuildKeys:    req.Perspectives,
		MaxPairs:     int32(req.Limit),
		LeaseSeconds: req.Lease.Seconds(),
	})
	if err != nil {
		return Claimed{}, err
	}
	var c Claimed
	for _, r := range rows {
		if r.StreamID == uuid.Nil {
			c.NextDue = r.DueAt // the next waiting pair's due time
			continue
		}
		c.Pairs = append(c.Pairs, Pair{Stream: r.StreamID, Perspective: r.PerspectiveName})
	}
	// The statement returns the pairs in no particular order: oldest stream first keeps
	// groups, and so their row locks, in one order.
	slices.SortFunc(c.Pairs, comparePairs)
	return c, nil
}

func (s *pgStore) Release(ctx context.Context, req ReleaseRequest) error {
	if len(req.Pairs) == 0 {
		return nil
	}
	streams, names := pairArrays(req.Pairs)
	delays := make([]float64, len(req.Pairs))
	for i, p := range req.Pairs {
		delays[i] = -1 // at its oldest queued event
		if d, ok := req.Later[p]; ok {
			delays[i] = d.Seconds()
		}
	}
	return s.q.PairsRelease(ctx, db.PairsReleaseParams{
		InstanceID: req.Instance, StreamIds: streams, PerspectiveNames: names, Delays: delays,
	})
}

func (s *pgStore) Leased(ctx context.Context, instance uuid.UUID) ([]Pair, error) {
	rows, err := s.q.PairsLeasedBy(ctx, instance)
	if err != nil {
		return nil, err
	}
	pairs := make([]Pair, len(rows))
	for i, r := range rows {
		pairs[i] = Pair{Stream: r.StreamID, Perspective: r.PerspectiveName}
	}
	return pairs, nil
}

// ClaimStore is what the claim asks of the database: lease due pairs, and end the leases.
type ClaimStore interface {
	// Claim leases up to req.Limit due pairs, oldest due first (one statement: see
	// PairsClaim), for req.Lease on the database clock. It also says when the next pair of
	// those builds that is not due yet becomes due (the zero time: none is waiting).
	Claim(ctx context.Context, req ClaimRequest) (Claimed, error)
	// Release ends req.Instance's leases on pairs whose job has ended: a pair with nothing
	// queued loses its due row, the others are due at their oldest queued event, or
	// req.Later[p] from now when given. It never leaves a queued event without a due row,
	// even while an Append to the pair is in flight (see wh_pairs_release).
	Release(ctx context.Context, req ReleaseRequest) error
	// Leased returns the pairs whose due rows instance leases (see PairsLeasedBy).
	Leased(ctx context.Context, instance uuid.UUID) ([]Pair, error)
}
