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
