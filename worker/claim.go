package worker

// The claim: the loop leases due pairs in one statement (queries/claim.sql, wh_claim_pairs)
// and starts them in groups; after each job its pairs' leases end (wh_pairs_release).

import (
	"context"
	"log/slog"
	"slices"
	"time"

	"github.com/google/uuid"

	"github.com/perspectives-go/perspectives/db"
)

// reconnectInterval is how often the loop claims while the database does not answer (a
// restart, a failover), so that it resumes within that long of the server answering.
const reconnectInterval = 100 * time.Millisecond

// noteReachable takes a claim's outcome: it logs a lost connection, once for a spell of the
// database not answering and again when it answers, and says whether it is unreachable.
func (w *Worker) noteReachable(ctx context.Context, unreachable bool, err error) bool {
	switch {
	case err == nil:
		if unreachable {
			w.log.Info("database answers again; claiming")
		}
		return false
	case ctx.Err() != nil:
		return unreachable
	case isConnectionError(err):
		if !unreachable {
			w.log.Warn("database unavailable; claiming again every 100ms until it answers", slog.Any("error", err))
		}
		return true
	default: // logged by noteClaimFailure
		return false
	}
}

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
		if isConnectionError(err) && !neverSent(err) && s.unknownSince.IsZero() {
			s.unknownSince = sent // the claim may have committed (see owedUnknown)
		}
		return false, err
	}
	s.nextDue = claimed.NextDue
	// A pair may still be in a job here whose report the loop has not taken yet (the job
	// released it first), or whose lease lapsed (a slow Apply): its new job finds it held
	// by the apply coordinator and releases it due again after busyWait, so it is never left
	// leased by a job that does not run it.
	for _, group := range splitGroups(claimed.Pairs, free) {
		j := job{kind: jobApply, pairs: group, claimed: sent}
		s.started(&j)
		start(j)
	}
	if !s.unknownSince.IsZero() {
		w.owedUnknown(ctx, s)
	}
	return len(claimed.Pairs) >= limit, nil
}

// owedUnknown makes owed the leases that claims which failed with a lost connection since
// s.unknownSince may yet have made: the pairs this instance leases that no job here holds
// (every pair a job here runs or waits for is in s.inflight) and that do not back off after a
// failure that could not be recorded (s.held: their lease keeps them waiting). Releasing them
// is safe because wh_pairs_release is fenced by leased_by and no job here holds them; it is
// sent until half the lease from the first such claim's sending, when those claims' leases
// still last. Past that, nothing is read: the leases lapse. When the read fails it is tried
// after the next claim.
func (w *Worker) owedUnknown(ctx context.Context, s *schedule) {
	by := s.unknownSince.Add(w.cfg.LockOptions.LockTimeout / 2)
	if !time.Now().Before(by) {
		s.unknownSince = time.Time{}
		return
	}
	leased, err := w.store.Leased(ctx, w.cfg.InstanceID)
	if err != nil {
		w.log.Warn("reading the pairs this instance leases failed; read again after the next claim", slog.Any("error", err))
		return
	}
	s.unknownSince = time.Time{}
	unknown := slices.DeleteFunc(leased, func(p Pair) bool {
		_, held := s.held[p]
		return s.inflight[p] > 0 || held
	})
	if len(unknown) > 0 {
		w.log.Info("this instance leases pairs no job here holds (a claim or a release cut off by a lost connection); releasing them",
			slog.Int("pairs", len(unknown)))
		s.owed = append(s.owed, owedRelease{req: ReleaseRequest{Instance: w.cfg.InstanceID, Pairs: unknown}, by: by})
	}
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
// When a lost connection fails it (a restart, a failover) it returns the release as owed: the
// loop sends it again (retryReleases) until half the lease has passed, else the leases lapse
// and the pairs are due again after LockTimeout.
func (w *Worker) release(ctx context.Context, r jobResult) *owedRelease {
	req := ReleaseRequest{Instance: w.cfg.InstanceID, Pairs: r.released(), Later: map[Pair]time.Duration{}}
	if len(req.Pairs) == 0 {
		return nil
	}
	for _, p := range r.busy {
		req.Later[p] = busyWait
	}
	for _, p := range r.unrecorded {
		req.Later[p] = w.unrecordedWait(r.job.unrecorded[p] + 1)
	}
	err := w.sendRelease(ctx, req)
	if err == nil {
		return nil
	}
	owed := &owedRelease{req: req, by: r.job.claimed.Add(w.cfg.LockOptions.LockTimeout / 2)}
	msg := "releasing the pairs' leases failed; sent again after the next claim while half the lease is left, else the pairs are due again when the leases lapse"
	if !isConnectionError(err) || r.job.claimed.IsZero() || !time.Now().Before(owed.by) {
		owed, msg = nil, "releasing the pairs' leases failed; they are due again when the leases lapse"
	}
	w.log.Warn(msg, slog.Int("pairs", len(req.Pairs)), slog.Duration("lease", w.cfg.LockOptions.LockTimeout), slog.Any("error", err))
	return owed
}

// sendRelease runs req under a fresh context bounded by releaseTimeout.
func (w *Worker) sendRelease(ctx context.Context, req ReleaseRequest) error {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), releaseTimeout)
	defer cancel()
	return w.store.Release(rctx, req)
}

// owedRelease is a release that a lost connection failed, and until when it is sent again:
// half the lease after the claim was sent (a lease runs LockTimeout from the claim's
// statement); after that the leases are left to lapse. Sent again, it ends only this
// instance's leases (wh_pairs_release is fenced by leased_by), and the pairs in flight here
// are left out (dropInflight), so it ends no lease of a job that runs.
type owedRelease struct {
	req ReleaseRequest
	by  time.Time
}

// dropInflight drops from the owed releases the pairs in flight here (s.inflight): the
// failed release may have committed and the pair been claimed here again (before or after
// the report of the job that owed it); sent again, it would end the new lease, which that
// job releases. It runs when a job's owed release arrives (finish) and before owed releases
// are sent.
func (s *schedule) dropInflight() {
	for i := range s.owed {
		s.owed[i].req.Pairs = slices.DeleteFunc(slices.Clone(s.owed[i].req.Pairs), func(p Pair) bool { return s.inflight[p] > 0 })
	}
	s.owed = slices.DeleteFunc(s.owed, func(o owedRelease) bool { return len(o.req.Pairs) == 0 })
}

// retryReleases sends again, in one statement, the owed releases whose leases still last
// at now (the others lapse) with the leases of more (released at once), and reports whether
// it released pairs, and its error. When it fails the owed releases stay owed.
func (w *Worker) retryReleases(ctx context.Context, s *schedule, now time.Time, more ...Pair) (bool, error) {
	s.dropInflight()
	s.owed = slices.DeleteFunc(s.owed, func(o owedRelease) bool { return !now.Before(o.by) })
	req := ReleaseRequest{Instance: w.cfg.InstanceID, Pairs: slices.Clone(more), Later: map[Pair]time.Duration{}}
	for _, o := range s.owed {
		req.Pairs = append(req.Pairs, o.req.Pairs...)
		for _, p := range o.req.Pairs { // not the waits of pairs left out since
			if d, ok := o.req.Later[p]; ok {
				req.Later[p] = d
			}
		}
	}
	if len(req.Pairs) == 0 {
		return false, nil
	}
	slices.SortFunc(req.Pairs, comparePairs)
	req.Pairs = slices.Compact(req.Pairs)
	if err := w.sendRelease(ctx, req); err != nil {
		return false, err
	}
	if len(s.owed) > 0 {
		w.log.Info("released the leases whose release had failed", slog.Int("pairs", len(req.Pairs)-len(more)))
	}
	s.owed = nil
	return true, nil
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
