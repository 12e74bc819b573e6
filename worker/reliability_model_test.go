package worker_test

// Scenario 4: the randomized multi-instance model check.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/internal/pgq"
	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/worker"
)

// jitterPerspective is a ledger whose Apply sleeps up to a millisecond, widening the
// windows in which faults land mid-operation.
func jitterPerspective(name string) worker.Perspective {
	return worker.JSONPerspective(name, func(m ledger, ev worker.Event) (ledger, error) {
		time.Sleep(time.Duration(rand.IntN(1000)) * time.Microsecond)
		return foldLedger(m, ev)
	})
}

// probeInvariants checks, in one REPEATABLE READ snapshot of the database, what must hold
// at every instant (not only at rest) for each stream:
//   - every stored event is one the test appended;
//   - a model exists exactly when the cursor has a position, and both are at the same event;
//   - the model's IDs are strictly increasing (ID order, no duplicates), all stored, and
//     its sum is theirs: the model is the fold of exactly the events it lists;
//   - every stored event at or before the model's position that the model lacks is still
//     queued (arrived late; nothing lost);
//   - no snapshot lies beyond the model's position, and every snapshot before the earliest
//     queued event equals the fold of the stored events up to it.
func probeInvariants(ctx context.Context, pool *pgxpool.Pool, name string, streams []uuid.UUID, amounts map[uuid.UUID]int) ([]string, error) {
	tx, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
	if err != nil {
		return nil, err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	var bad []string
	for _, s := range streams {
		st, err := readPair(ctx, tx, name, s)
		if err != nil {
			return nil, err
		}
		fail := func(format string, args ...any) {
			bad = append(bad, fmt.Sprintf("stream %s: ", s)+fmt.Sprintf(format, args...))
		}
		stored := map[uuid.UUID]bool{}
		for _, id := range st.stored {
			stored[id] = true
			if _, ok := amounts[id]; !ok {
				fail("stored event %s was never appended", id)
			}
		}
		queuedSet := map[uuid.UUID]bool{}
		for _, id := range st.queued {
			queuedSet[id] = true
		}
		cursorAt := uuid.Nil
		if st.cursor != nil && st.cursor.LastEventID.Valid {
			cursorAt = st.cursor.LastEventID.UUID
		}
		if !st.hasModel {
			if cursorAt != uuid.Nil {
				fail("cursor at %s but no model", cursorAt)
			}
			if len(st.snapshots) > 0 {
				fail("%d snapshots but no model", len(st.snapshots))
			}
			continue
		}
		if cursorAt != st.modelLast {
			fail("cursor at %s, model at %s", cursorAt, st.modelLast)
		}
		ids := st.model.IDs
		if len(ids) == 0 || ids[len(ids)-1] != st.modelLast {
			fail("model at %s but its last applied event is not that one (%d events)", st.modelLast, len(ids))
		}
		sum := 0
		inModel := map[uuid.UUID]bool{}
		for i, id := range ids {
			if i > 0 && bytes.Compare(ids[i-1][:], id[:]) >= 0 {
				fail("model applied %s after %s: out of ID order or twice", id, ids[i-1])
			}
			if !stored[id] {
				fail("model applied %s, which is not stored", id)
			}
			inModel[id] = true
			sum += amounts[id]
		}
		if sum != st.model.Sum {
			fail("model sum %d, but its events sum to %d", st.model.Sum, sum)
		}
		for _, id := range st.stored {
			if bytes.Compare(id[:], st.modelLast[:]) <= 0 && !inModel[id] && !queuedSet[id] {
				fail("event %s is before the model's position, not in the model and not queued: lost", id)
			}
		}
		minQueued := uuid.Max
		if len(st.queued) > 0 {
			minQueued = st.queued[0]
		}
		for pos, snap := range st.snapshots {
			if bytes.Compare(pos[:], st.modelLast[:]) > 0 {
				fail("snapshot at %s is beyond the model's position %s", pos, st.modelLast)
			}
			if bytes.Compare(pos[:], minQueued[:]) >= 0 {
				continue // may predate a late event still queued; the rewind drops it
			}
			var want ledger
			for _, id := range st.stored {
				if bytes.Compare(id[:], pos[:]) <= 0 {
					want.IDs = append(want.IDs, id)
					want.Sum += amounts[id]
				}
			}
			if !slices.Equal(want.IDs, snap.IDs) || want.Sum != snap.Sum {
				fail("snapshot at %s has %d events (sum %d); the fold up to it has %d (sum %d)", pos, len(snap.IDs), snap.Sum, len(want.IDs), want.Sum)
			}
		}
	}
	return bad, nil
}

// TestReliabilityRandomizedModelCheck runs three worker instances against a random schedule,
// for RELIABILITY_BUDGET (default 8s; `make reliability` runs 2m):
//   - appends of 1-4 events to ~20 streams, some of them late (an ID generated earlier,
//     held back, appended after newer ones);
//   - a foreign instance acquiring and releasing stream locks on random pairs;
//   - forced expiry (SQL) of a random lock, preferably one a worker holds at that moment
//     (mid-rewind or bootstrap), else the foreign instance's or an admin's;
//   - Stop of a random instance and Start of a new one;
//   - Admin.Rebuild of a random pair (purge and re-queue every event, under the lock);
//   - probes of the instantaneous invariants (probeInvariants) while all this runs.
//
// At the end it appends the held-back events, releases the foreign locks, waits for the
// queue to drain and checks every invariant. The schedule (operation kinds, streams, event
// order, data, pauses, configuration) is a function of the seed: each operation draws the
// same number of random values whatever its outcome. The interleaving with the workers'
// goroutines is not reproducible; a replay repeats the same pressure on the same shapes.
func TestReliabilityRandomizedModelCheck(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	seed := reliabilitySeed(t)
	budget := reliabilityBudget(t, 8*time.Second)
	tag := fmt.Sprintf("seed=%d", seed)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("FAILED with %s; replay: RELIABILITY_SEED=%d RELIABILITY_BUDGET=%s go test -race -count=1 -run 'TestReliabilityRandomizedModelCheck' ./worker/", tag, seed, budget)
		}
	})
	rng := rand.New(rand.NewPCG(seed, 4))
	name := uniqueName("reliab_model")
	logs := newLogCounter()
	lockOpts := locker.Options{LockTimeout: 2 * time.Second, KeepAliveInterval: 500 * time.Millisecond}
	snapOpts := worker.SnapshotOptions{EveryNEvents: 2 + rng.IntN(4), MaxPerStream: 1 + rng.IntN(4)}
	persp := jitterPerspective(name)

	startInstance := func() *worker.Worker {
		w, err := worker.New(testDB.Pool, worker.Config{
			Perspectives: []worker.Perspective{persp},
			Locker:       newLocker(t, lockOpts),
			LockOptions:  lockOpts,
			Snapshots:    snapOpts,
			BatchSize:    1 + rng.IntN(8),
			PollInterval: 10 * time.Millisecond,
			RetryBackoff: 10 * time.Millisecond, MaxRetryBackoff: 100 * time.Millisecond,
			Logger: slog.New(logs),
		})
		require.NoError(t, err)
		require.NoError(t, w.Start(ctx), tag)
		t.Cleanup(func() {
			sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			require.NoError(t, w.Stop(sctx))
		})
		return w
	}
	var instances [3]*worker.Worker
	for i := range instances {
		instances[i] = startInstance()
	}
	t.Logf("%s budget=%s perspective=%s snapshots=%+v", tag, budget, name, snapOpts)

	foreign := newLocker(t, locker.Options{LockTimeout: 3 * time.Second, KeepAliveInterval: time.Second})
	foreignID := uuid.Must(uuid.NewV7())
	inspect := newLocker(t, lockOpts)
	admin, err := worker.NewAdmin(testDB.Pool, newLocker(t, lockOpts))
	require.NoError(t, err)

	const nStreams = 20
	streamIDs := make([]uuid.UUID, nStreams)
	streams := map[uuid.UUID][]worker.Event{}
	for i := range streamIDs {
		streamIDs[i] = uuid.New()
	}
	amounts := map[uuid.UUID]int{}
	heldBack := make([][]worker.Event, nStreams) // generated, not yet appended: late when they are
	maxID := make([]uuid.UUID, nStreams)
	foreignHeld := map[int]bool{}
	newEvent := func(si int) worker.Event {
		n := 1 + rng.IntN(100)
		return worker.Event{ID: uuid.Must(uuid.NewV7()), StreamID: streamIDs[si], Type: "amount", Data: json.RawMessage(fmt.Sprintf(`{"n":%d}`, n))}
	}
	var st struct {
		appends, events, late, foreignOK, foreignRefused, foreignReleases, expiries, expiredLocks,
		restarts, rebuilds, rebuildsRefused, probes int
	}
	appendBatch := func(si int, batch []worker.Event) {
		require.NoError(t, worker.Append(ctx, testDB.Pool, batch...), tag)
		s := streamIDs[si]
		for _, ev := range batch {
			var a amount
			require.NoError(t, json.Unmarshal(ev.Data, &a))
			amounts[ev.ID] = a.N
			streams[s] = append(streams[s], ev)
			if bytes.Compare(ev.ID[:], maxID[si][:]) < 0 {
				st.late++
			} else {
				maxID[si] = ev.ID
			}
		}
		st.appends++
		st.events += len(batch)
	}
	probe := func(when string) {
		bad, err := probeInvariants(ctx, testDB.Pool, name, streamIDs, amounts)
		require.NoError(t, err, tag)
		if len(bad) > 0 {
			t.Fatalf("%s: invariants violated %s:\n  %s\nworker warnings:\n    %s", tag, when, strings.Join(bad, "\n  "), logs.warnings())
		}
		st.probes++
	}
	reasons := []locker.Reason{locker.ReasonRewind, locker.ReasonBootstrap, locker.ReasonPurge}

	start := time.Now()
	for time.Since(start) < budget {
		op, r := rng.IntN(100), rng.Uint64()
		si := int(r % nStreams)
		s := streamIDs[si]
		switch {
		case op < 55: // append 1-4 events, some late
			k := 1 + rng.IntN(4)
			var batch []worker.Event
			for range k {
				if pick, late := rng.Uint64(), rng.IntN(3) == 0; late && len(heldBack[si]) > 0 {
					j := int(pick % uint64(len(heldBack[si])))
					batch = append(batch, heldBack[si][j])
					heldBack[si] = slices.Delete(heldBack[si], j, j+1)
				} else {
					batch = append(batch, newEvent(si))
				}
				if rng.IntN(5) == 0 {
					heldBack[si] = append(heldBack[si], newEvent(si))
				}
			}
			appendBatch(si, batch)
		case op < 63: // foreign acquire
			reason := reasons[rng.IntN(len(reasons))]
			ok, err := foreign.TryAcquire(ctx, s, name, foreignID, reason)
			require.NoError(t, err, tag)
			if ok {
				foreignHeld[si] = true
				st.foreignOK++
			} else {
				st.foreignRefused++
			}
		case op < 71: // foreign release
			held := make([]int, 0, len(foreignHeld))
			for i := range foreignHeld {
				held = append(held, i)
			}
			if len(held) > 0 {
				sort.Ints(held)
				i := held[int(r%uint64(len(held)))]
				require.NoError(t, foreign.Release(ctx, streamIDs[i], name, foreignID), tag)
				delete(foreignHeld, i)
				st.foreignReleases++
			}
		case op < 79: // forced expiry, preferably of a lock a worker holds right now
			target, preferHeld := s, rng.IntN(4) != 0
			if preferHeld {
				locks, err := inspect.List(ctx)
				require.NoError(t, err, tag)
				var ours, workers []uuid.UUID // locks on this perspective; those held by a worker
				for _, l := range locks {
					if l.PerspectiveName == name {
						ours = append(ours, l.StreamID)
						if l.InstanceID != foreignID {
							workers = append(workers, l.StreamID)
						}
					}
				}
				if len(workers) > 0 {
					ours = workers
				}
				if len(ours) > 0 {
					target = ours[int(r%uint64(len(ours)))]
				}
			}
			tag2, err := testDB.Pool.Exec(ctx, `UPDATE wh_perspective_cursors SET stream_lock_expiry = now() - interval '1 millisecond'
				WHERE stream_id = $1 AND perspective_name = $2 AND stream_lock_instance_id IS NOT NULL`, target, name)
			require.NoError(t, err, tag)
			st.expiries++
			st.expiredLocks += int(tag2.RowsAffected())
		case op < 82: // stop an instance, start a new one
			i := int(r % uint64(len(instances)))
			sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			require.NoError(t, instances[i].Stop(sctx), tag)
			cancel()
			instances[i] = startInstance()
			st.restarts++
		case op < 85: // rebuild a pair
			if len(streams[s]) == 0 {
				break
			}
			_, err := admin.Rebuild(ctx, s, name)
			switch {
			case err == nil:
				st.rebuilds++
			case errors.Is(err, worker.ErrLocked):
				st.rebuildsRefused++
			default:
				require.NoError(t, err, tag)
			}
		case op < 89:
			probe("mid-run")
		default: // let the workers catch up
			time.Sleep(time.Duration(10+rng.IntN(40)) * time.Millisecond)
		}
		time.Sleep(time.Duration(rng.IntN(6)) * time.Millisecond)
	}

	// Quiesce: the held-back events arrive (late), the foreign locks go, the queue drains.
	for si := range heldBack {
		if len(heldBack[si]) > 0 {
			appendBatch(si, heldBack[si])
			heldBack[si] = nil
		}
	}
	for si := range foreignHeld {
		require.NoError(t, foreign.Release(ctx, streamIDs[si], name, foreignID), tag)
	}
	for s, evs := range streams {
		if len(evs) == 0 {
			delete(streams, s)
		}
	}
	var backlog int64
	require.NoError(t, testDB.Pool.QueryRow(ctx, `SELECT count(*) FROM wh_perspective_events
		WHERE perspective_name = $1 AND stream_id = ANY($2)`, pgq.Args([]any{name, streamIDs})...).Scan(&backlog))
	drainStart := time.Now()
	waitConverged(t, ctx, testDB.Pool, name, streams, max(60*time.Second, budget/2), tag)
	drained := time.Since(drainStart)
	probe("at rest")
	for _, w := range instances {
		require.NoError(t, w.Stop(ctx), tag)
	}
	for _, s := range streamIDs {
		l, held, err := inspect.Get(ctx, s, name)
		require.NoError(t, err, tag)
		require.False(t, held, "%s: stream %s: lock left after every instance stopped: %+v", tag, s, l)
	}
	checked := requireConverged(t, ctx, testDB.Pool, name, streams, tag)
	require.Zero(t, logs.count(msgPanic), "%s: %s", tag, logs.warnings())
	// No fault injected here makes an operation fail (refusals and shutdowns are not
	// failures): a recorded failure on these streams is a bug, even if it healed.
	require.Zero(t, logs.countOn(msgProcessFailed, streamIDs...)+logs.countOn(msgApplyFailed, streamIDs...),
		"%s: failures recorded:%s", tag, logs.causeSummary())

	t.Logf("%s: %s of faults, then %d queued rows drained in %s; %d events checked on %d streams, 0 lost, 0 applied twice\n"+
		"  appends %d (events %d, late %d); foreign locks %d taken, %d refused, %d released; forced expiries %d (%d held locks expired);\n"+
		"  instance restarts %d; rebuilds %d (+%d refused: locked); invariant probes %d\n"+
		"  worker logs:%s\n  warnings and errors (all streams):%s",
		tag, budget, backlog, drained.Round(time.Millisecond), checked, len(streams),
		st.appends, st.events, st.late, st.foreignOK, st.foreignRefused, st.foreignReleases, st.expiries, st.expiredLocks,
		st.restarts, st.rebuilds, st.rebuildsRefused, st.probes, logs.summary(streamIDs...), logs.causeSummary())
}
