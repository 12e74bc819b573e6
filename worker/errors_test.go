package worker_test

// Errors of clean-up steps are returned with the main outcome, not dropped.

import (
	"context"
	"errors"
	"testing"
	"testing/synctest"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/metric/embedded"
	"go.opentelemetry.io/otel/metric/noop"

	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/worker"
)

// unregisterFails is a meter provider whose callbacks' registrations fail to unregister.
type unregisterFails struct{ noop.MeterProvider }

func (unregisterFails) Meter(string, ...metric.MeterOption) metric.Meter {
	return unregisterFailsMeter{}
}

type unregisterFailsMeter struct{ noop.Meter }

func (unregisterFailsMeter) RegisterCallback(metric.Callback, ...metric.Observable) (metric.Registration, error) {
	return unregisterFailsRegistration{}, nil
}

type unregisterFailsRegistration struct{ embedded.Registration }

func (unregisterFailsRegistration) Unregister() error {
	return errors.New("callback unknown to the SDK")
}

// Stop returns the error of unregistering the queue gauges (and still stops).
func TestUnitStopReturnsAGaugeUnregisterError(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		store := utLoopStore()
		store.ClaimFunc = func(context.Context, worker.ClaimRequest) (worker.Claimed, error) { return worker.Claimed{}, nil }
		w, err := worker.NewWithStore(store, worker.Config{
			Perspectives:  []worker.Perspective{utPerspective(utName, nil)},
			PollOnly:      true,
			MeterProvider: unregisterFails{},
			Logger:        utLogger(&utLogBuf{}),
		})
		require.NoError(t, err)
		require.NoError(t, w.Start(context.Background()))
		synctest.Wait()
		err = w.Stop(context.Background())
		require.Error(t, err)
		assert.Contains(t, err.Error(), "worker: stop: unregister the queue gauges: callback unknown to the SDK")
		require.NoError(t, w.Stop(context.Background()), "stopped: a second Stop has nothing to do")
	})
}

// releaseFails is locker.Postgres whose Release fails: the lock stays until it lapses.
type releaseFails struct{ *locker.Postgres }

func (releaseFails) Release(context.Context, uuid.UUID, string, uuid.UUID) error {
	return errors.New("release refused")
}

// An Admin operation whose stream lock cannot be released returns that error, although the
// operation itself was done: the lock holds the workers off the pair until it lapses.
func TestAdminReturnsAReleaseThatFails(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := uniqueName("admin_release")
	_, err := psStore(testDB).Register(ctx, name, 1)
	require.NoError(t, err)
	lk := newLocker(t, locker.Options{})
	admin, err := worker.NewAdmin(testDB.Pool, releaseFails{lk})
	require.NoError(t, err)
	stream := uuid.New()

	err = admin.Purge(ctx, stream, name)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "worker: purge: "+name+" version 1: release stream lock: release refused")
	l, held, err := lk.Get(ctx, stream, worker.BuildKey(name, 1, 1))
	require.NoError(t, err)
	require.True(t, held, "the lock the release left")
	assert.Equal(t, locker.ReasonPurge, l.Reason)
}

// An Admin rebuild whose queueing fails leaves the pair as it was: its purge and its
// queueing commit together.
func TestAdminRebuildThatCannotQueueLeavesThePairAsItWas(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := isolatedDB(t)
	name := uniqueName("admin_rebuild")
	_, err := psStore(d).Register(ctx, name, 1)
	require.NoError(t, err)
	key := worker.BuildKey(name, 1, 1)
	stream := uuid.New()
	ids := newIDs(t, 2)
	require.NoError(t, worker.Append(ctx, d.Pool, events(stream, ids)...))
	// As if applied: the model at the last event, nothing queued.
	gsExec(t, ctx, d.Pool, `DELETE FROM wh_perspective_events WHERE stream_id = $1`, stream)
	gsExec(t, ctx, d.Pool, `DELETE FROM wh_perspective_pairs WHERE stream_id = $1`, stream)
	gsExec(t, ctx, d.Pool, `UPDATE wh_perspective_cursors SET last_event_id = $3 WHERE stream_id = $1 AND perspective_name = $2`, stream, key, ids[1])
	gsExec(t, ctx, d.Pool, `INSERT INTO wh_perspective_models (stream_id, perspective_name, model, last_event_id) VALUES ($1, $2, '{"n": 2}', $3)`, stream, key, ids[1])
	gsExec(t, ctx, d.Pool, `CREATE FUNCTION refuse_queue() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'queue refused'; END $$`)
	gsExec(t, ctx, d.Pool, `CREATE TRIGGER refuse_queue BEFORE INSERT ON wh_perspective_events FOR EACH ROW EXECUTE FUNCTION refuse_queue()`)
	admin, err := worker.NewAdmin(d.Pool, nil)
	require.NoError(t, err)

	n, err := admin.Rebuild(ctx, stream, name)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "worker: rebuild: "+name+" version 1: queue the stream: ")
	assert.Contains(t, err.Error(), "queue refused")
	assert.Zero(t, n, "nothing queued")
	model, found, err := worker.LoadModel(ctx, d.Pool, name, stream)
	require.NoError(t, err)
	require.True(t, found, "the model is still there: the purge rolled back with the queueing")
	assert.JSONEq(t, `{"n": 2}`, string(model))
	var last uuid.UUID
	require.NoError(t, d.Pool.QueryRow(ctx, `SELECT last_event_id FROM wh_perspective_cursors WHERE stream_id = $1 AND perspective_name = $2`,
		stream, key).Scan(&last))
	assert.Equal(t, ids[1], last, "the cursor is where it was")

	gsExec(t, ctx, d.Pool, `DROP TRIGGER refuse_queue ON wh_perspective_events`)
	n, err = admin.Rebuild(ctx, stream, name)
	require.NoError(t, err)
	assert.EqualValues(t, 2, n, "once the queue accepts rows, both events are queued")
	_, found, err = worker.LoadModel(ctx, d.Pool, name, stream)
	require.NoError(t, err)
	assert.False(t, found, "and the model purged")
}

// cutOffAcquire is locker.Postgres whose TryAcquire takes the lock, then reports its
// context ended (cancel ends it): as an acquire that committed while its caller's deadline
// passed.
type cutOffAcquire struct {
	*locker.Postgres
	cancel context.CancelFunc
}

func (l cutOffAcquire) TryAcquire(ctx context.Context, stream uuid.UUID, name string, instance uuid.UUID, reason locker.Reason) (bool, error) {
	if _, err := l.Postgres.TryAcquire(context.WithoutCancel(ctx), stream, name, instance, reason); err != nil {
		return false, err
	}
	l.cancel()
	return false, ctx.Err()
}

// An Admin's acquire that its context's end cut off (it may have committed) is released: the
// pair is not paused until the lock lapses.
func TestAdminReleasesAnAcquireItsContextCutOff(t *testing.T) {
	t.Parallel()
	name := uniqueName("admin_cutoff")
	_, err := psStore(testDB).Register(context.Background(), name, 1)
	require.NoError(t, err)
	lk := newLocker(t, locker.Options{})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	admin, err := worker.NewAdmin(testDB.Pool, cutOffAcquire{lk, cancel})
	require.NoError(t, err)
	stream := uuid.New()

	err = admin.Purge(ctx, stream, name)
	require.ErrorIs(t, err, context.Canceled)
	_, held, err := lk.Get(context.Background(), stream, worker.BuildKey(name, 1, 1))
	require.NoError(t, err)
	require.False(t, held, "the lock the cut-off acquire took is released")
}
