package main

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/worker"
)

// An operator's day with a poison event: failed lists the parked pair with its event, status
// exits 3, retry tries it again, a mistyped skip is refused and writes nothing, skip records
// who skipped it and the rest is applied, failed --skipped shows the record.
func TestFailedRetrySkip(t *testing.T) {
	ctx := context.Background()
	d := ownDB(t, "cli_failed")
	name := "fl_" + uuid.NewString()[:6]
	persp := worker.JSONPerspective(name, func(n int, ev worker.Event) (int, error) {
		if ev.Type == "poison" {
			return n, errors.New("cannot apply <poison>")
		}
		return n + 1, nil
	})
	w, err := worker.New(d.Pool, worker.Config{
		Perspectives: []worker.Perspective{persp}, Logger: quiet(),
		RetryBackoff: 5 * time.Millisecond, FailurePolicy: worker.FailurePolicy{Attempts: 2},
	})
	require.NoError(t, err)
	require.NoError(t, w.Start(ctx))
	defer func() { require.NoError(t, w.Stop(ctx)) }()

	stream := uuid.New()
	evs := []worker.Event{{StreamID: stream, Type: "ok"}, {StreamID: stream, Type: "poison"}, {StreamID: stream, Type: "ok"}}
	for i := range evs {
		evs[i].ID = uuid.Must(uuid.NewV7())
		evs[i].Data = json.RawMessage(`{}`)
	}
	require.NoError(t, worker.Append(ctx, d.Pool, evs...))
	admin, err := worker.NewAdmin(d.Pool, nil)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		f, err := admin.Failed(ctx, name, 10)
		return err == nil && len(f) == 1 && f[0].Parked
	}, 20*time.Second, 10*time.Millisecond)

	code, stdout, stderr := cli(t, "failed", "--database-url", d.URL)
	require.Equal(t, 0, code, stderr)
	for _, want := range []string{"PARKED", stream.String(), name, evs[1].ID.String(), "poison", "cannot apply <poison>", "retry or skip"} {
		require.Contains(t, stdout, want)
	}
	code, _, _ = cli(t, "status", "--database-url", d.URL)
	require.Equal(t, 3, code, "status exits non-zero with a parked pair")

	code, stdout, stderr = cli(t, "retry", "--database-url", d.URL, "--perspective", name, "--stream", stream.String())
	require.Equal(t, 0, code, stderr)
	require.Contains(t, stdout, "retrying 1 pair(s) of "+name)
	require.Eventually(t, func() bool {
		f, err := admin.Failed(ctx, name, 10)
		return err == nil && len(f) == 1 && f[0].Parked && f[0].Attempts == 3
	}, 20*time.Second, 10*time.Millisecond, "retried once, parked again")

	other := uuid.Must(uuid.NewV7())
	code, _, stderr = cli(t, "skip", "--database-url", d.URL, "--perspective", name, "--stream", stream.String(), "--event", other.String())
	require.Equal(t, 1, code)
	require.Contains(t, stderr, "is neither queued for stream")
	code, _, stderr = cli(t, "skip", "--database-url", d.URL, "--perspective", name, "--stream", stream.String(), "--event", "nope")
	require.Equal(t, 1, code)
	require.Contains(t, stderr, `--event "nope" is not a UUID`)
	skipped, err := admin.Skipped(ctx, name, 10)
	require.NoError(t, err)
	require.Empty(t, skipped, "a refused skip writes nothing")

	code, stdout, stderr = cli(t, "skip", "--database-url", d.URL, "--perspective", name, "--stream", stream.String(),
		"--event", evs[1].ID.String(), "--by", "alice")
	require.Equal(t, 0, code, stderr)
	require.Contains(t, stdout, "skipped event "+evs[1].ID.String())
	require.Eventually(t, func() bool {
		raw, ok, err := worker.LoadModel(ctx, d.Pool, name, stream)
		return err == nil && ok && string(raw) == "2"
	}, 20*time.Second, 10*time.Millisecond, "the event after the skipped one is applied")

	code, stdout, stderr = cli(t, "failed", "--database-url", d.URL, "--skipped")
	require.Equal(t, 0, code, stderr)
	require.Contains(t, stdout, "no failing or parked pairs")
	for _, want := range []string{"alice", "operator", evs[1].ID.String(), "poison"} {
		require.Contains(t, stdout, want)
	}
	code, _, _ = cli(t, "status", "--database-url", d.URL)
	require.Equal(t, 0, code, "nothing parked any more")
}
