package worker_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/worker"
)

func TestLoadDecodesTheActiveModel(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := uniqueName("load")
	startWorker(t, worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(name)}})

	stream := uuid.New()
	all := events(stream, newIDs(t, 5))
	// The second event arrives late: Load must return the rewound model, in ID order.
	require.NoError(t, worker.Append(ctx, testDB.Pool, all[0], all[2], all[3], all[4]))
	wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	require.NoError(t, worker.WaitFor(wctx, testDB.Pool, name, stream, all[4].ID))
	require.NoError(t, worker.Append(ctx, testDB.Pool, all[1]))
	require.NoError(t, worker.WaitFor(wctx, testDB.Pool, name, stream, all[1].ID))

	m, ok, err := worker.Load[ledger](ctx, testDB.Pool, name, stream)
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, expectedLedger(t, all), m)

	// It is LoadModel's JSON, decoded.
	raw, ok, err := worker.LoadModel(ctx, testDB.Pool, name, stream)
	require.NoError(t, err)
	require.True(t, ok)
	var want ledger
	require.NoError(t, json.Unmarshal(raw, &want))
	require.Equal(t, want, m)

	// A pointer type works too.
	p, ok, err := worker.Load[*ledger](ctx, testDB.Pool, name, stream)
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, want, *p)

	// No model: the zero value and false.
	none, ok, err := worker.Load[ledger](ctx, testDB.Pool, name, uuid.New())
	require.NoError(t, err)
	require.False(t, ok)
	require.Zero(t, none)

	// A model that does not decode into M names the perspective, the stream and the type.
	n, ok, err := worker.Load[int](ctx, testDB.Pool, name, stream)
	require.Error(t, err)
	require.False(t, ok)
	require.Zero(t, n)
	require.ErrorContains(t, err, name)
	require.ErrorContains(t, err, stream.String())
	require.ErrorContains(t, err, "int")

	// Bad input is refused before any SQL runs.
	_, _, err = worker.Load[ledger](ctx, testDB.Pool, name, uuid.Nil)
	require.ErrorIs(t, err, locker.ErrInvalidArgument)
	_, _, err = worker.Load[ledger](ctx, testDB.Pool, "", stream)
	require.ErrorIs(t, err, locker.ErrInvalidArgument)
	_, _, err = worker.Load[ledger](ctx, nil, name, stream)
	require.ErrorIs(t, err, locker.ErrInvalidArgument)
}
