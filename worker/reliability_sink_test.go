package worker_test

// The model check of a sink: the application's table follows the models through a worker
// process SIGKILLed mid catch-up, three instances with concurrent Appends and late events, a
// skipped poison event, a purge, and a rolling change of version promoted through a view
// that readers never see mixed or empty.

import (
	"context"
	"encoding/json"
	"errors"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/internal/pgtest"
	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/worker"
)

const helperRoleSinkCatchUpVictim = "sink-catchup-victim"

// poisoned fails on every event of type "poison".
type poisoned struct{ worker.Perspective }

func (p poisoned) Apply(ctx context.Context, model json.RawMessage, ev worker.Event) (json.RawMessage, error) {
	if ev.Type == "poison" {
		return nil, errors.New("poison event")
	}
	return p.Perspective.Apply(ctx, model, ev)
}

// viewSink is version v of a ledger perspective with a sink (ledgerSink's rows) whose
// Promoted repoints the view sink_view at the promoted build's rows.
type viewSink struct{ *ledgerSink }

func newViewSink(name string, v int, sleep time.Duration) viewSink {
	var p worker.Perspective = poisoned{newVLedger(name, v)}
	if sleep > 0 {
		p = sleepyPerspective{Perspective: p, sleep: sleep}
	}
	return viewSink{&ledgerSink{Perspective: p, version: v}}
}

func (p viewSink) Promoted(ctx context.Context, tx pgx.Tx, from *worker.Build, to worker.Build) error {
	if err := p.ledgerSink.Promoted(ctx, tx, from, to); err != nil {
		return err
	}
	_, err := tx.Exec(ctx, `CREATE OR REPLACE VIEW sink_view AS
		SELECT build_key, stream_id, model FROM sink_rows WHERE build_key = '`+strings.ReplaceAll(to.Key, "'", "''")+`'`)
	return err
}

// runSinkCatchUpVictim runs one worker of version 1 with the view sink whose catch-up is
// slow, until it is killed, its stdin closes or a minute passes.
func runSinkCatchUpVictim() error {
	pageSize, err := strconv.Atoi(os.Getenv(helperEnvPageSize))
	if err != nil {
		return err
	}
	return runVictim(func(pool *pgxpool.Pool) (worker.Config, error) {
		lk, err := locker.NewPostgres(pool, killLockOptions)
		if err != nil {
			return worker.Config{}, err
		}
		return worker.Config{
			Perspectives:    []worker.Perspective{newViewSink(os.Getenv(helperEnvPerspective), 1, 2*time.Millisecond)},
			Locker:          lk,
			LockOptions:     killLockOptions,
			PollInterval:    20 * time.Millisecond,
			CatchUpPageSize: pageSize,
		}, nil
	})
}

// viewRows is the build key's rows of sink_rows, their models as version ledgers.
func viewRows(t *testing.T, d *pgtest.DB, key string) map[uuid.UUID]sinkRow[vledger] {
	t.Helper()
	return sinkRowsOf[vledger](t, d, key)
}

// sinkConverged waits until the rows of the active build are version v folded over each
// stream's stored events in ID order without the skipped ones, except the streams in
// absent, which have no row, and the models are the same.
func sinkConverged(t *testing.T, d *pgtest.DB, name string, v int, skipped map[uuid.UUID]bool, absent map[uuid.UUID]bool) string {
	t.Helper()
	ctx := context.Background()
	var last string
	var key string
	deadline := time.Now().Add(60 * time.Second)
	for {
		key = activeKey(t, d, name)
		want := map[uuid.UUID][]uuid.UUID{}
		for s, ids := range lcStored(t, d) {
			if absent[s] {
				continue
			}
			want[s] = slices.DeleteFunc(ids, func(id uuid.UUID) bool { return skipped[id] })
		}
		rows := viewRows(t, d, key)
		bad := 0
		for s, ids := range want {
			r, ok := rows[s]
			m, mok := loadVLedger(t, ctx, d, name, s)
			if !ok || r.model.V != v || !slices.Equal(r.model.IDs, ids) || !mok || !slices.Equal(m.IDs, ids) {
				bad++
			}
		}
		if bad == 0 && len(rows) == len(want) {
			return key
		}
		last = strconv.Itoa(bad) + " of " + strconv.Itoa(len(want)) + " streams' rows differ; rows " + strconv.Itoa(len(rows))
		if time.Now().After(deadline) {
			t.Fatalf("the sink's rows of %s never matched the fold of version %d: %s", key, v, last)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func TestReliabilitySinkModelCheck(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := sinkDB(t)
	name := uniqueName("reliab_sink")

	// History, stored before any worker runs the perspective.
	const streams, perStream = 30, 30
	var all []uuid.UUID
	for range streams {
		s := uuid.New()
		all = append(all, s)
		require.NoError(t, worker.Append(ctx, d.Pool, events(s, newIDs(t, perStream))...))
	}

	// A worker process catches up slowly, and is SIGKILLed a third of the way.
	cmd := startVictim(t, helperRoleSinkCatchUpVictim,
		helperEnvDBURL+"="+d.URL, helperEnvPerspective+"="+name, helperEnvPageSize+"=25")
	eventually(t, 30*time.Second, "the victim a third into its catch-up", func() bool {
		var n int64
		err := d.Pool.QueryRow(ctx, `SELECT catchup_events FROM wh_perspective_builds WHERE perspective_name = $1`, name).Scan(&n)
		return err == nil && n >= streams*perStream/3
	})
	require.NoError(t, cmd.Process.Signal(syscall.SIGKILL))
	_ = cmd.Wait()
	require.NotEmpty(t, viewRows(t, d, activeKey(t, d, name)), "the victim's committed pages wrote rows")

	// Three instances take over, while Appends (some late) and a poison event arrive.
	policy := worker.FailurePolicy{Attempts: 1, Skip: true}
	start := func(v int) *worker.Worker {
		w, err := worker.New(d.Pool, worker.Config{
			Perspectives: []worker.Perspective{newViewSink(name, v, 0)}, Locker: lockerIn(t, d, killLockOptions),
			LockOptions: killLockOptions, CatchUpPageSize: 25, FailurePolicy: policy,
			PollInterval: 20 * time.Millisecond, Logger: quietLogger(),
		})
		require.NoError(t, err)
		require.NoError(t, w.Start(ctx))
		return w
	}
	stop := func(w *worker.Worker) {
		sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		require.NoError(t, w.Stop(sctx))
	}
	instances := []*worker.Worker{start(1), start(1), start(1)}
	defer func() {
		for _, w := range instances {
			stop(w)
		}
	}()
	poison := worker.Event{ID: uuid.Must(uuid.NewV7()), StreamID: all[3], Type: "poison", Data: json.RawMessage(`{}`)}
	var wg sync.WaitGroup
	for g := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(g), 7))
			var held []worker.Event // appended later than newer events of their stream: late
			for i := range 40 {
				ev := worker.Event{ID: uuid.Must(uuid.NewV7()), StreamID: all[r.IntN(streams)], Type: "amount", Data: json.RawMessage(`{"n":1}`)}
				if i%7 == 0 {
					held = append(held, ev)
					continue
				}
				if err := worker.Append(ctx, d.Pool, ev); err != nil {
					t.Error(err)
					return
				}
			}
			for _, ev := range held {
				if err := worker.Append(ctx, d.Pool, ev); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	require.NoError(t, worker.Append(ctx, d.Pool, poison))
	wg.Wait()
	skipped := map[uuid.UUID]bool{poison.ID: true}
	k1 := sinkConverged(t, d, name, 1, skipped, nil)

	// A purge deletes the row with the model.
	purged := all[5]
	require.NoError(t, instances[0].Purge(ctx, purged, name))
	sinkConverged(t, d, name, 1, skipped, map[uuid.UUID]bool{purged: true})
	v1Rows := len(viewRows(t, d, k1))

	// Readers of the view, sampled until the end: always one build's rows, never fewer than
	// version 1 had.
	var samples, bad atomic.Int64
	var badWhat atomic.Value
	sctx, stopSampling := context.WithCancel(ctx)
	var sampler sync.WaitGroup
	sampler.Add(1)
	go func() {
		defer sampler.Done()
		for sctx.Err() == nil {
			var builds, n int
			err := d.Pool.QueryRow(sctx, `SELECT count(DISTINCT build_key), count(*) FROM sink_view`).Scan(&builds, &n)
			if err != nil {
				if sctx.Err() == nil {
					bad.Add(1)
					badWhat.Store(err.Error())
				}
				return
			}
			samples.Add(1)
			if builds != 1 || n < v1Rows {
				bad.Add(1)
				badWhat.Store("builds " + strconv.Itoa(builds) + ", rows " + strconv.Itoa(n))
			}
		}
	}()

	// A rolling deployment of version 2: one instance at a time.
	for i := range instances {
		stop(instances[i])
		instances[i] = start(2)
	}
	eventually(t, 60*time.Second, "version 2 promoted", func() bool { return activeKey(t, d, name) != k1 })
	k2 := sinkConverged(t, d, name, 2, skipped, nil)
	time.Sleep(100 * time.Millisecond) // readers sample the view after the promotion too
	stopSampling()
	sampler.Wait()
	require.Zero(t, bad.Load(), "a reader of the view saw a mix of builds or missing rows: %v", badWhat.Load())
	require.Positive(t, samples.Load())
	require.Len(t, viewRows(t, d, k2), v1Rows+1, "version 2 has a row for the purged stream, rebuilt from the store")

	// The retired build's rows go with it.
	_, err := d.Pool.Exec(ctx, `UPDATE wh_perspective_builds SET retired_at = now() - interval '1 hour' WHERE build_key = $1`, k1)
	require.NoError(t, err)
	eventually(t, 30*time.Second, "the retired build's rows deleted", func() bool { return len(viewRows(t, d, k1)) == 0 })
	t.Logf("%d samples of the view during the version change", samples.Load())
}
