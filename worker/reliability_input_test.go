package worker_test

// Scenario 6: bad input through the worker package's public entry points that
// scenarios_test.go does not already cover (it covers Append's event validation and
// Append(nil db), worker.New's Config validation and nil pool, Worker.Purge's ErrorIs for
// an unknown perspective and a nil stream, Start after Stop).

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/worker"
)

// tableCounts is the row count of every perspectives table.
func tableCounts(t testing.TB, ctx context.Context) map[string]int64 {
	t.Helper()
	counts := map[string]int64{}
	for _, table := range []string{"wh_event_store", "wh_perspectives", "wh_perspective_events",
		"wh_perspective_cursors", "wh_perspective_models", "wh_perspective_snapshots"} {
		var n int64
		require.NoError(t, testDB.Pool.QueryRow(ctx, "SELECT count(*) FROM "+table).Scan(&n))
		counts[table] = n
	}
	return counts
}

// callSafely runs fn and turns a panic into an error, so that one crashing entry point
// fails its own case instead of the whole test binary.
func callSafely(fn func() error) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("PANIC: %v", r)
		}
	}()
	return fn()
}

// TestReliabilityBadInputWritesNothing calls each entry point with one bad argument and
// requires an error that wraps the right sentinel and names the problem, no panic, and
// not one row written to any table.
//
// Not parallel: "nothing written" is checked on whole tables, which the parallel tests
// write to; a serial test never overlaps them.
func TestReliabilityBadInputWritesNothing(t *testing.T) {
	ctx := context.Background()
	name := uniqueName("reliab_input")
	stream := uuid.New()
	var nilPool *pgxpool.Pool // a typed nil: what an unset *pgxpool.Pool variable holds
	var nilConn *pgx.Conn
	lk := newLocker(t, locker.Options{})

	// A worker that runs name but is not started (starting it would write: registration
	// and catching up on every stored event).
	w, err := worker.New(testDB.Pool, worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(name)}, Locker: lk, Logger: quietLogger()})
	require.NoError(t, err)
	admin, err := worker.NewAdmin(testDB.Pool, lk)
	require.NoError(t, err)
	adminNoLocker, err := worker.NewAdmin(testDB.Pool, nil)
	require.NoError(t, err)
	long := strings.Repeat("p", locker.MaxPerspectiveNameLength+1)
	ev := worker.Event{StreamID: stream, Type: "amount"}
	loadModel := func(dbtx worker.DBTX, name string, stream uuid.UUID) func() error {
		return func() error { _, _, err := worker.LoadModel(ctx, dbtx, name, stream); return err }
	}

	cases := []struct {
		name string
		call func() error
		is   error
		want string
	}{
		{"LoadModel nil db", loadModel(nil, name, stream), locker.ErrInvalidArgument, "db is nil"},
		{"LoadModel typed-nil pool", loadModel(nilPool, name, stream), locker.ErrInvalidArgument, "db is nil"},
		{"LoadModel typed-nil conn", loadModel(nilConn, name, stream), locker.ErrInvalidArgument, "db is nil"},
		{"LoadModel nil stream", loadModel(testDB.Pool, name, uuid.Nil), locker.ErrInvalidArgument, "stream ID is the nil UUID"},
		{"LoadModel empty perspective", loadModel(testDB.Pool, "", stream), locker.ErrInvalidArgument, "perspective name is empty"},
		{"LoadModel perspective too long", loadModel(testDB.Pool, long, stream), locker.ErrInvalidArgument, "more than 200"},
		{"LoadModel perspective with NUL", loadModel(testDB.Pool, "a\x00b", stream), locker.ErrInvalidArgument, "NUL byte"},
		{"LoadModel perspective not UTF-8", loadModel(testDB.Pool, "a\xffb", stream), locker.ErrInvalidArgument, "not valid UTF-8"},

		{"Append typed-nil pool", func() error { return worker.Append(ctx, nilPool, ev) }, locker.ErrInvalidArgument, "db is nil"},
		{"Append typed-nil conn", func() error { return worker.Append(ctx, nilConn, ev) }, locker.ErrInvalidArgument, "db is nil"},
		{"Append cancelled context", func() error {
			cctx, cancel := context.WithCancel(ctx)
			cancel()
			return worker.Append(cctx, testDB.Pool, ev)
		}, context.Canceled, "context canceled"},

		{"Worker.Purge unknown perspective", func() error { return w.Purge(ctx, stream, "no_such_perspective") }, locker.ErrInvalidArgument, `unknown perspective "no_such_perspective"`},
		{"Worker.Purge nil stream", func() error { return w.Purge(ctx, uuid.Nil, name) }, locker.ErrInvalidArgument, "stream ID is the nil UUID"},
		{"Worker.Purge empty perspective", func() error { return w.Purge(ctx, stream, "") }, locker.ErrInvalidArgument, "perspective name is empty"},

		{"New typed-nil locker", func() error {
			_, err := worker.New(testDB.Pool, worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(name)}, Locker: (*locker.Postgres)(nil)})
			return err
		}, worker.ErrInvalidConfig, "Locker"},
		{"NewAdmin nil pool", func() error { _, err := worker.NewAdmin(nil, lk); return err }, locker.ErrInvalidArgument, "pool is nil"},
		{"NewAdmin typed-nil locker", func() error { _, err := worker.NewAdmin(testDB.Pool, (*locker.Postgres)(nil)); return err }, locker.ErrInvalidArgument, "locker"},

		{"Admin.Purge unregistered perspective", func() error { return admin.Purge(ctx, stream, name) }, locker.ErrInvalidArgument, fmt.Sprintf("perspective %q is not registered", name)},
		{"Admin.Purge unregistered perspective, no locker", func() error { return adminNoLocker.Purge(ctx, stream, name) }, locker.ErrInvalidArgument, fmt.Sprintf("perspective %q is not registered", name)},
		{"Admin.Purge nil stream", func() error { return admin.Purge(ctx, uuid.Nil, name) }, locker.ErrInvalidArgument, "stream ID is the nil UUID"},
		{"Admin.Purge empty perspective", func() error { return admin.Purge(ctx, stream, "") }, locker.ErrInvalidArgument, "perspective name is empty"},
		{"Admin.Rebuild unregistered perspective", func() error { _, err := admin.Rebuild(ctx, stream, name); return err }, locker.ErrInvalidArgument, fmt.Sprintf("perspective %q is not registered", name)},
		{"Admin.Rebuild unregistered perspective, no locker", func() error { _, err := adminNoLocker.Rebuild(ctx, stream, name); return err }, locker.ErrInvalidArgument, fmt.Sprintf("perspective %q is not registered", name)},
		{"Admin.Rebuild nil stream", func() error { _, err := admin.Rebuild(ctx, uuid.Nil, name); return err }, locker.ErrInvalidArgument, "stream ID is the nil UUID"},
		{"Admin.Rebuild perspective with NUL", func() error { _, err := admin.Rebuild(ctx, stream, "a\x00b"); return err }, locker.ErrInvalidArgument, "NUL byte"},

		{"Start with a cancelled context", func() error {
			w2, err := worker.New(testDB.Pool, worker.Config{Perspectives: []worker.Perspective{ledgerPerspective(uniqueName("reliab_input"))}, Logger: quietLogger()})
			if err != nil {
				return err
			}
			defer func() { _ = w2.Stop(ctx) }()
			cctx, cancel := context.WithCancel(ctx)
			cancel()
			return w2.Start(cctx)
		}, context.Canceled, "register perspective"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			before := tableCounts(t, ctx)
			err := callSafely(tc.call)
			if assert.Error(t, err) {
				assert.NotContains(t, err.Error(), "PANIC", "bad input must be refused with an error, not a panic")
				assert.True(t, errors.Is(err, tc.is), "error %q must wrap %q", err, tc.is)
				assert.Contains(t, strings.ToLower(err.Error()), strings.ToLower(tc.want), "the error names the problem")
			}
			assert.Equal(t, before, tableCounts(t, ctx), "nothing written")
		})
	}
}
