package main

import (
	"context"
	"regexp"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/internal/pgtest"
	"github.com/perspectives-go/perspectives/worker"
)

// ownDB is a migrated database of the test's own: status reports every perspective of its
// database, and other tests park pairs and start workers.
func ownDB(t *testing.T, prefix string) *pgtest.DB {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	d, err := pgtest.Create(ctx, prefix)
	require.NoError(t, err)
	t.Cleanup(d.Close)
	return d
}

func counterPerspective(name string) worker.Perspective {
	return worker.JSONPerspective(name, func(m int, _ worker.Event) (int, error) { return m + 1, nil })
}

// insertGoneInstance writes the row an instance killed seenAgo ago left behind.
func insertGoneInstance(t *testing.T, d *pgtest.DB, id uuid.UUID, host string, seenAgo time.Duration, name string, version int) {
	t.Helper()
	_, err := d.Pool.Exec(context.Background(), `
		INSERT INTO wh_instances (instance_id, host, pid, started_at, last_seen_at, heartbeat_interval, perspectives, versions)
		VALUES ($1, $2, 4242, now() - $3::interval - interval '1 hour', now() - $3::interval, interval '5 seconds', ARRAY[$4::text], ARRAY[$5::int])`,
		id, host, seenAgo.String(), name, version)
	require.NoError(t, err)
}

func TestStatusTellsIdleFromStuckAndExitsNonZeroWhenParked(t *testing.T) {
	ctx := context.Background()
	d := ownDB(t, "cli_status")
	name := "st_" + uuid.NewString()[:6]
	w, err := worker.New(d.Pool, worker.Config{Perspectives: []worker.Perspective{counterPerspective(name)}, PollInterval: 10 * time.Millisecond, Logger: quiet()})
	require.NoError(t, err)
	require.NoError(t, w.Start(ctx))
	stopped := false
	defer func() {
		if !stopped {
			require.NoError(t, w.Stop(ctx))
		}
	}()
	s1, s2 := uuid.New(), uuid.New()
	require.NoError(t, worker.Append(ctx, d.Pool, worker.Event{StreamID: s1, Type: "t"}, worker.Event{StreamID: s2, Type: "t"}))
	require.Eventually(t, func() bool {
		_, ok1, _ := worker.LoadModel(ctx, d.Pool, name, s1)
		_, ok2, _ := worker.LoadModel(ctx, d.Pool, name, s2)
		return ok1 && ok2
	}, 20*time.Second, 10*time.Millisecond)
	admin, err := worker.NewAdmin(d.Pool, nil)
	require.NoError(t, err)
	require.Eventually(t, func() bool { // the models come from the queue; the catch-up ends apart
		v, err := admin.Versions(ctx)
		return err == nil && len(v.Builds) == 1 && v.Builds[0].CatchUpDone
	}, 20*time.Second, 10*time.Millisecond)

	// Idle: nothing queued, a live instance.
	code, stdout, stderr := cli(t, "status", "--database-url", d.URL)
	require.Equal(t, 0, code, stderr)
	require.Empty(t, stderr)
	require.Contains(t, stdout, "INSTANCE")
	inst := lineWith(t, stdout, w.InstanceID().String())
	require.Regexp(t, `\s\d+\s.*\s[0-9.]+m?s ago\s+`+name+` v1\s+alive$`, inst, "pid, started, last seen ago, perspectives, alive")
	require.Regexp(t, `(?m)^`+name+`\s+1\s+active\s+0\s+-\s+0\s+0\s+1\s+[0-9.]+\s+idle$`, stdout)

	// A parked pair: stuck, exit status 3 with a last line that says so.
	_, err = d.Pool.Exec(ctx, `UPDATE wh_perspective_cursors SET status = 'parked', attempts = 8, last_error = 'boom' WHERE perspective_name = $1 AND stream_id = $2`, name, s1)
	require.NoError(t, err)
	code, stdout, stderr = cli(t, "status", "--database-url", d.URL)
	require.Equal(t, exitParked, code, "stdout:\n%s\nstderr:\n%s", stdout, stderr)
	require.Equal(t, 3, code)
	require.Regexp(t, `(?m)^`+name+`\s+1\s+active\s+0\s+-\s+0\s+1\s+1\s+[0-9.]+\s+stuck: 1 parked pair$`, stdout)
	lines := strings.Split(strings.TrimSpace(stderr), "\n")
	require.Equal(t, "perspectives status: 1 parked pair ("+name+" version 1: 1) wait for an operator: list them with perspectives failed, then retry or skip",
		lines[len(lines)-1])

	// Back to ok: exit 0. A failing pair is retried, not stuck.
	_, err = d.Pool.Exec(ctx, `UPDATE wh_perspective_cursors SET status = 'failed' WHERE perspective_name = $1 AND stream_id = $2`, name, s1)
	require.NoError(t, err)
	code, stdout, stderr = cli(t, "status", "--database-url", d.URL)
	require.Equal(t, 0, code, stderr)
	require.Regexp(t, `(?m)^`+name+`\s+1\s+active\s+0\s+-\s+1\s+0\s+1\s+[0-9.]+\s+retrying 1 failing pair$`, stdout)
	require.Contains(t, lineWith(t, stdout, s1.String()), "boom", "the failed pairs' list")
	// A long error of many-byte characters: cut at 120 characters, still UTF-8.
	_, err = d.Pool.Exec(ctx, `UPDATE wh_perspective_cursors SET last_error = repeat('é', 300) WHERE perspective_name = $1 AND stream_id = $2`, name, s1)
	require.NoError(t, err)
	_, stdout, _ = cli(t, "status", "--database-url", d.URL)
	require.True(t, utf8.ValidString(stdout), "status prints UTF-8")
	require.Contains(t, lineWith(t, stdout, s1.String()), strings.Repeat("é", 119)+"…")
	require.NotContains(t, stdout, strings.Repeat("é", 120))
	_, err = d.Pool.Exec(ctx, `UPDATE wh_perspective_cursors SET status = 'ok' WHERE perspective_name = $1 AND stream_id = $2`, name, s1)
	require.NoError(t, err)

	// No live instance, events queued: stuck, told apart from idle. The stopped worker's row
	// is gone; a killed one's stays, shown gone.
	require.NoError(t, w.Stop(ctx))
	stopped = true
	killed := uuid.New()
	insertGoneInstance(t, d, killed, "old-host", 12*time.Minute, name, 1)
	require.NoError(t, worker.Append(ctx, d.Pool, worker.Event{StreamID: s2, Type: "t"}))
	code, stdout, stderr = cli(t, "status", "--database-url", d.URL)
	require.Equal(t, 0, code, stderr)
	require.NotContains(t, stdout, w.InstanceID().String(), "deleted at Stop")
	require.Regexp(t, `old-host\s+4242\s.*\s12m\d+s ago\s+`+name+` v1\s+gone$`, lineWith(t, stdout, killed.String()))
	require.Regexp(t, `(?m)^`+name+`\s+1\s+active\s+1\s+[0-9.]+m?s ago\s+0\s+0\s+0\s+0\.0\s+stuck: no live instance runs it$`, stdout)
}

func TestRebuildWithoutWorkerNamesItInPlainLines(t *testing.T) {
	ctx := context.Background()
	d := ownDB(t, "cli_rebuild_missing")
	name := "rb_" + uuid.NewString()[:6]
	// Registered by a worker that then stopped; a killed instance of it was last seen 12m ago.
	w, err := worker.New(d.Pool, worker.Config{Perspectives: []worker.Perspective{counterPerspective(name)}, PollInterval: 10 * time.Millisecond, Logger: quiet()})
	require.NoError(t, err)
	require.NoError(t, w.Start(ctx))
	s := uuid.New()
	require.NoError(t, worker.Append(ctx, d.Pool, worker.Event{StreamID: s, Type: "t"}, worker.Event{StreamID: s, Type: "t"}))
	require.Eventually(t, func() bool { _, ok, _ := worker.LoadModel(ctx, d.Pool, name, s); return ok }, 20*time.Second, 10*time.Millisecond)
	require.NoError(t, w.Stop(ctx))
	killed := uuid.New()
	insertGoneInstance(t, d, killed, "old-host", 12*time.Minute, name, 1)
	missing := regexp.QuoteMeta("no running worker applies "+name+" version 1: start one (last seen: instance "+killed.String()+" on host old-host, ") +
		`12m\d+s ago\)`

	start := time.Now()
	code, stdout, stderr := cli(t, "rebuild", "--database-url", d.URL, "--perspective", name, "--timeout", "1500ms")
	require.Equal(t, 1, code, "stdout:\n%s\nstderr:\n%s", stdout, stderr)
	require.Less(t, time.Since(start), 30*time.Second)
	require.Contains(t, stdout, "started version 1, build 2")
	require.NotContains(t, stderr, "\r", "not a terminal: plain lines")
	lines := strings.Split(strings.TrimSpace(stderr), "\n")
	require.Equal(t, "catch-up: 0/2 events (0%), rate -, ETA -", lines[0], "the first line at once")
	require.Regexp(t, "^"+missing+"$", lines[1], "said at once")
	require.Regexp(t, `^catch-up: 0/2 events \(0%\) in [0-9.]+m?s$`, lines[2], "a final line")
	require.Regexp(t, "^"+regexp.QuoteMeta("perspectives rebuild: the rebuild read 0 of 2 events in 1.5s: ")+missing+
		regexp.QuoteMeta(" (the rebuild waits in the database; see: perspectives versions)")+"$", lines[len(lines)-1])

	// One stream: the same.
	code, _, stderr = cli(t, "rebuild", "--database-url", d.URL, "--perspective", name, "--stream", s.String(), "--timeout", "1s")
	require.Equal(t, 1, code, stderr)
	require.NotContains(t, stderr, "\r")
	// (Its events are queued for both builds: the active one and the rebuild under way.)
	require.Regexp(t, regexp.QuoteMeta("applying: 0/4 events (0%), rate -, ETA -\n")+missing+"\n", stderr)
	require.Regexp(t, regexp.QuoteMeta("4 events still queued after 1s: ")+missing, stderr)
}

// On a database without perspectives, status says so instead of the builds' table.
func TestStatusOfADatabaseWithoutPerspectives(t *testing.T) {
	d := ownDB(t, "cli_status_empty")
	code, stdout, stderr := cli(t, "status", "--database-url", d.URL)
	require.Equal(t, 0, code, stderr)
	require.Contains(t, stdout, "no perspective registered")
	require.NotContains(t, stdout, "PERSPECTIVE", "no table header without a row")
}
