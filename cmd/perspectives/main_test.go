package main

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	neturl "net/url"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/internal/pgtest"
	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/worker"
)

var testDB *pgtest.DB

func TestMain(m *testing.M) {
	// The demo re-executes its own binary as worker instances: here, the test binary.
	if len(os.Args) > 1 && os.Args[1] == demoWorkerCommand {
		ctx, cancel := signalContext()
		code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
		cancel()
		os.Exit(code)
	}
	pgtest.Exit(m, "cli", &testDB)
}

func cli(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errb bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	code = run(ctx, args, &out, &errb)
	return code, out.String(), errb.String()
}

func TestHelpAndUsage(t *testing.T) {
	code, _, stderr := cli(t, "--help")
	require.Equal(t, 0, code)
	for _, c := range []string{"migrate", "demo", "locks", "status", "purge", "rebuild"} {
		require.Contains(t, stderr, "  "+c+" ")
	}
	require.NotContains(t, stderr, demoWorkerCommand, "internal command stays out of the usage")

	code, _, stderr = cli(t)
	require.Equal(t, 2, code)
	require.Contains(t, stderr, "usage:")

	code, _, stderr = cli(t, "frobnicate")
	require.Equal(t, 2, code)
	require.Contains(t, stderr, `unknown command "frobnicate"`)

	for _, c := range []string{"migrate", "demo", "locks", "status", "purge", "rebuild"} {
		code, _, stderr = cli(t, c, "--help")
		require.Equal(t, 0, code, c)
		require.Contains(t, stderr, "usage: perspectives "+c, c)
		require.Contains(t, stderr, "-database-url", c)
	}
	code, _, stderr = cli(t, "locks", "--nope")
	require.Equal(t, 2, code)
	require.Contains(t, stderr, "flag provided but not defined: -nope")
}

func TestUnreachableDatabaseIsOneClearLine(t *testing.T) {
	for _, url := range []string{
		"postgres://postgres@127.0.0.1:1/postgres?sslmode=disable&connect_timeout=2",
		"not a url at all ::",
	} {
		for _, c := range []string{"migrate", "locks", "status"} {
			code, stdout, stderr := cli(t, c, "--database-url", url)
			require.Equal(t, 1, code, "%s %s", c, url)
			require.Empty(t, stdout)
			lines := strings.Split(strings.TrimSpace(stderr), "\n")
			require.Len(t, lines, 1, "one line, no stack trace: %q", stderr)
			require.Contains(t, lines[0], "perspectives "+c+":")
			require.NotContains(t, lines[0], "goroutine")
		}
	}
	t.Setenv("DATABASE_URL", "postgres://postgres@127.0.0.1:1/postgres?sslmode=disable&connect_timeout=2")
	code, _, stderr := cli(t, "status")
	require.Equal(t, 1, code)
	require.Contains(t, stderr, "127.0.0.1:1", "DATABASE_URL is used when --database-url is absent")
}

func TestUnreachableDatabaseIsSaidOnce(t *testing.T) {
	url := "postgres://postgres@127.0.0.1:1/postgres?sslmode=disable&connect_timeout=2"
	stream := uuid.NewString()
	for _, args := range [][]string{
		{"migrate"}, {"locks"}, {"status"}, {"versions"}, {"demo"},
		{"purge", "--stream", stream, "--perspective", "p"},
		{"rebuild", "--perspective", "p"},
		{"promote", "--perspective", "p", "--version", "2"},
	} {
		code, stdout, stderr := cli(t, append(args, "--database-url", url)...)
		require.Equal(t, 1, code, args[0])
		require.Empty(t, stdout, args[0])
		require.Equal(t, "perspectives "+args[0]+": cannot reach database "+url+": connection refused (is PostgreSQL running there? set --database-url or DATABASE_URL)\n", stderr)
		require.Equal(t, 1, strings.Count(stderr, "127.0.0.1:1"), "the address once, in the URL: %q", stderr)
		require.Equal(t, 1, strings.Count(stderr, "connection refused"), "the dial error once: %q", stderr)
		require.NotContains(t, stderr, "dial", "pgx's dial error, which names the address again")
	}

	// Several addresses tried: each with its own reason.
	code, _, stderr := cli(t, "status", "--database-url", "postgres://postgres@127.0.0.1:1,127.0.0.1:2/postgres?sslmode=disable&connect_timeout=2")
	require.Equal(t, 1, code)
	require.Contains(t, stderr, ": 127.0.0.1:1: connection refused; 127.0.0.1:2: connection refused (is PostgreSQL running there?")
	require.Equal(t, 2, strings.Count(stderr, "127.0.0.1:1"), "in the URL and before its reason: %q", stderr)

	// A server that answers and refuses: its error, not the advice to start PostgreSQL.
	code, _, stderr = cli(t, "status", "--database-url", withDatabase(t, testDB.URL, "pt_no_such_database"))
	require.Equal(t, 1, code)
	// (SQLSTATE 3D000 from PostgreSQL; a pooler such as PgBouncer answers with its own code.)
	require.Contains(t, stderr, `refused the connection: FATAL: database "pt_no_such_database" does not exist (SQLSTATE `)
	require.NotContains(t, stderr, "is PostgreSQL running")
}

// The demo refuses a lock timeout its instances could not run with, before it touches the
// database (here unreachable, and never dialled).
func TestDemoRefusesABadLockTimeoutFirst(t *testing.T) {
	url := "postgres://postgres@127.0.0.1:1/postgres?sslmode=disable&connect_timeout=2"
	for _, tc := range []struct{ value, want string }{
		{"-1s", "--lock-timeout must be positive, got -1s"},
		{"0s", "--lock-timeout must be positive, got 0s"},
		{"1ns", "--lock-timeout: "},
	} {
		code, stdout, stderr := cli(t, "demo", "--database-url", url, "--lock-timeout", tc.value)
		require.Equal(t, 1, code, tc.value)
		require.Empty(t, stdout, tc.value)
		require.Contains(t, stderr, tc.want, tc.value)
		require.NotContains(t, stderr, "cannot reach database", tc.value)
	}
}

func TestMissingSchemaNamesMigrate(t *testing.T) {
	ctx := context.Background()
	empty, err := pgtest.CreateEmpty(ctx, "cli_empty")
	require.NoError(t, err)
	defer empty.Close()
	// A password (trust authentication ignores it) that the message must not show.
	url := withPassword(t, empty.URL, "s3cr3t-pw")
	for _, c := range []string{"status", "locks", "versions"} {
		code, stdout, stderr := cli(t, c, "--database-url", url)
		require.Equal(t, 1, code, c)
		require.Empty(t, stdout, c)
		lines := strings.Split(strings.TrimSpace(stderr), "\n")
		require.Len(t, lines, 1, "one line: %q", stderr)
		require.Contains(t, stderr, "perspectives "+c+": the perspectives schema is missing from the database", c)
		require.Regexp(t, `\(relation "wh_[a-z_]+" does not exist\)`, stderr, c)
		require.Contains(t, stderr, "run: perspectives migrate --database-url '"+withPassword(t, empty.URL, "xxxxx")+"'", c)
		require.Contains(t, stderr, empty.Name, "names the database")
		require.NotContains(t, stderr, "SQLSTATE", c)
		require.NotContains(t, stderr, "s3cr3t-pw", c)
	}
	// The advice works (migrations need a direct connection).
	code, _, stderr := cli(t, "migrate", "--database-url", empty.DirectURL)
	require.Equal(t, 0, code, stderr)
	for _, c := range []string{"status", "locks"} {
		code, _, stderr = cli(t, c, "--database-url", url)
		require.Equal(t, 0, code, "%s: %s", c, stderr)
	}
}

func withPassword(t *testing.T, dbURL, password string) string {
	t.Helper()
	u, err := neturl.Parse(dbURL)
	require.NoError(t, err)
	u.User = neturl.UserPassword(u.User.Username(), password)
	return u.String()
}

func withDatabase(t *testing.T, dbURL, name string) string {
	t.Helper()
	u, err := neturl.Parse(dbURL)
	require.NoError(t, err)
	u.Path = "/" + name
	return u.String()
}

func TestMigrateLocksStatus(t *testing.T) {
	ctx := context.Background()
	url := testDB.URL
	// Migrations need a direct connection (the pooler suite runs the rest through one).
	code, stdout, stderr := cli(t, "migrate", "--database-url", testDB.DirectURL)
	require.Equal(t, 0, code, stderr)
	require.Contains(t, stdout, "schema is current")

	lk, err := locker.NewPostgres(testDB.Pool, locker.Options{})
	require.NoError(t, err)
	stream, holder := uuid.New(), uuid.New()
	ok, err := lk.TryAcquire(ctx, stream, "cli_locks", holder, locker.ReasonRewind)
	require.NoError(t, err)
	require.True(t, ok)
	code, stdout, stderr = cli(t, "locks", "--database-url", url)
	require.Equal(t, 0, code, stderr)
	require.Contains(t, stdout, "STREAM")
	require.Contains(t, stdout, "EXPIRES IN")
	row := lineWith(t, stdout, stream.String())
	require.Contains(t, row, "cli_locks")
	require.Contains(t, row, holder.String())
	require.Contains(t, row, "rewind")
	require.Regexp(t, `\b(29|30)(\.\d)?s\b`, row)
	require.NoError(t, lk.Release(ctx, stream, "cli_locks", holder))
	code, stdout, _ = cli(t, "locks", "--database-url", url)
	require.Equal(t, 0, code)
	require.NotContains(t, stdout, stream.String())

	// A failing pair and a queued backlog show in status.
	name := "cli_status_" + uuid.NewString()[:6]
	failing := worker.JSONPerspective(name, func(m int, ev worker.Event) (int, error) {
		if ev.Type == "bad" {
			return m, errFailing
		}
		return m + 1, nil
	})
	w, err := worker.New(testDB.Pool, worker.Config{Perspectives: []worker.Perspective{failing}, PollInterval: 10 * time.Millisecond,
		Logger: quiet(), RetryBackoff: time.Hour, MaxRetryBackoff: time.Hour})
	require.NoError(t, err)
	require.NoError(t, w.Start(ctx))
	defer func() { require.NoError(t, w.Stop(ctx)) }()
	bad := uuid.New()
	require.NoError(t, worker.Append(ctx, testDB.Pool, worker.Event{StreamID: bad, Type: "bad"}, worker.Event{StreamID: bad, Type: "ok"}))
	require.Eventually(t, func() bool {
		_, out, _ := cli(t, "status", "--database-url", url)
		return strings.Contains(out, bad.String())
	}, 20*time.Second, 20*time.Millisecond)
	_, stdout, _ = cli(t, "status", "--database-url", url)
	require.Contains(t, stdout, "PERSPECTIVE")
	require.Regexp(t, `(?m)^`+name+`\s+1\s+active\s+2\s+\d`, stdout, "version 1, active: two events stay queued, with the age of the oldest")
	failRow := lineWith(t, stdout, bad.String())
	require.Contains(t, failRow, "refusing bad events")
	require.Regexp(t, `\s1\s`, failRow, "attempts")
}

var errFailing = errorString("refusing bad events")

type errorString string

func (e errorString) Error() string { return string(e) }

func lineWith(t *testing.T, out, s string) string {
	t.Helper()
	for _, l := range strings.Split(out, "\n") {
		if strings.Contains(l, s) {
			return l
		}
	}
	t.Fatalf("no line with %q in:\n%s", s, out)
	return ""
}

func TestPurgeAndRebuild(t *testing.T) {
	ctx := context.Background()
	url := testDB.URL
	name := "cli_rebuild_" + uuid.NewString()[:6]
	counter := worker.JSONPerspective(name, func(m int, _ worker.Event) (int, error) { return m + 1, nil })
	w, err := worker.New(testDB.Pool, worker.Config{Perspectives: []worker.Perspective{counter}, PollInterval: 10 * time.Millisecond, Logger: quiet()})
	require.NoError(t, err)
	require.NoError(t, w.Start(ctx))
	defer func() { require.NoError(t, w.Stop(ctx)) }()
	s1, s2 := uuid.New(), uuid.New()
	require.NoError(t, worker.Append(ctx, testDB.Pool,
		worker.Event{StreamID: s1, Type: "t"}, worker.Event{StreamID: s1, Type: "t"}, worker.Event{StreamID: s2, Type: "t"}))
	model := func(s uuid.UUID) string {
		raw, ok, err := worker.LoadModel(ctx, testDB.Pool, name, s)
		require.NoError(t, err)
		if !ok {
			return "none"
		}
		return string(raw)
	}
	require.Eventually(t, func() bool { return model(s1) == "2" && model(s2) == "1" }, 20*time.Second, 10*time.Millisecond)

	code, _, stderr := cli(t, "purge", "--database-url", url, "--perspective", name)
	require.Equal(t, 1, code)
	require.Contains(t, stderr, "--stream is required")
	code, _, stderr = cli(t, "purge", "--database-url", url, "--stream", "nope", "--perspective", name)
	require.Equal(t, 1, code)
	require.Contains(t, stderr, `--stream "nope" is not a UUID`)
	for _, cmd := range []string{"purge", "retry"} { // retry without --stream means every stream: the nil UUID must not
		code, stdout, stderr := cli(t, cmd, "--database-url", url, "--stream", uuid.Nil.String(), "--perspective", name)
		require.Equal(t, 1, code, cmd)
		require.Empty(t, stdout, cmd)
		require.Contains(t, stderr, "--stream is the nil UUID, which names no stream", cmd)
	}
	code, _, stderr = cli(t, "purge", "--database-url", url, "--stream", s1.String(), "--perspective", "never_registered")
	require.Equal(t, 1, code)
	require.Contains(t, stderr, `perspective "never_registered" is not registered`)

	// Purge is refused while another instance holds the lock.
	lk, err := locker.NewPostgres(testDB.Pool, locker.Options{})
	require.NoError(t, err)
	other := uuid.New()
	ok, err := lk.TryAcquire(ctx, s1, name, other, locker.ReasonRewind)
	require.NoError(t, err)
	require.True(t, ok)
	code, _, stderr = cli(t, "purge", "--database-url", url, "--stream", s1.String(), "--perspective", name)
	require.Equal(t, 1, code)
	require.Contains(t, stderr, "stream lock held by another instance")
	require.Equal(t, "2", model(s1))
	require.NoError(t, lk.Release(ctx, s1, name, other))

	code, stdout, stderr := cli(t, "purge", "--database-url", url, "--stream", s1.String(), "--perspective", name)
	require.Equal(t, 0, code, stderr)
	require.Contains(t, stdout, "purged")
	require.Equal(t, "none", model(s1))

	// Rebuild the whole perspective beside the active build, and wait for its promotion.
	code, stdout, stderr = cli(t, "rebuild", "--database-url", url, "--perspective", name, "--timeout", "30s")
	require.Equal(t, 0, code, stderr)
	require.Contains(t, stdout, "started version 1, build 2, beside the active build")
	require.Contains(t, stdout, "rebuild promoted")
	require.Contains(t, stderr, "catch-up")
	require.Contains(t, stderr, "100%")
	require.NotContains(t, stderr, "\r", "not a terminal: plain lines, no frames")
	require.Regexp(t, `(?m)^catch-up: \d+/\d+ events \(100%\) in [0-9.]+m?s`, stderr, "the final line")
	require.Equal(t, "2", model(s1), "the purged stream is whole again in the new build")
	require.Equal(t, "1", model(s2))

	code, stdout, stderr = cli(t, "versions", "--database-url", url)
	require.Equal(t, 0, code, stderr)
	require.Regexp(t, name+`\s+1\s+2\s+active\s+done`, stdout, "the rebuild is the active build")
	require.NotRegexp(t, name+`\s+1\s+1\s`, stdout, "the replaced build is retired, not listed")

	code, stdout, stderr = cli(t, "rebuild", "--database-url", url, "--perspective", name, "--stream", s2.String(), "--wait=false")
	require.Equal(t, 0, code, stderr)
	require.Contains(t, stdout, "stream "+s2.String()+": purged, 1 events queued")

	code, _, stderr = cli(t, "promote", "--database-url", url, "--perspective", name, "--version", "1")
	require.Equal(t, 1, code)
	require.Contains(t, stderr, "version 1 of "+`"`+name+`"`+" is already active")
	code, _, stderr = cli(t, "promote", "--database-url", url, "--perspective", name, "--version", "7")
	require.Equal(t, 1, code)
	require.Contains(t, stderr, "has no build of version 7")
}

func TestDemoSmall(t *testing.T) {
	if testing.Short() {
		t.Skip("the demo starts worker processes")
	}
	name := "pt_demo_" + uuid.NewString()[:8]
	code, stdout, stderr := cli(t, "demo", "--database-url", pgtest.ServerURL(), "--demo-database", name,
		"--streams", "20", "--events", "15", "--round-gap", "40ms", "--lock-timeout", "2s", "--seed", "7")
	require.Equal(t, 0, code, "stdout:\n%s\nstderr:\n%s", stdout, stderr)
	require.Contains(t, stdout, "consistent: 20 of 20 models match")
	require.Contains(t, stdout, "killed instance")
	require.Contains(t, stdout, "takeovers")
	require.Regexp(t, `poison event +stream …[0-9a-f]{12} parked after 3 failures in .*; skipped by the operator`, stdout)
	require.Contains(t, stdout, "(perspectives skip)")
}

func quiet() *slog.Logger { return slog.New(slog.DiscardHandler) }

// A database migrated to an older version lacks a function or a column of ours: said so,
// with the command that migrates it, as for a missing table; other errors of those codes
// are left as they are.
func TestOlderSchemaNamesMigrate(t *testing.T) {
	tg := &target{url: "postgres://u:pw@db.example/app"}
	for _, e := range []*pgconn.PgError{
		{Code: "42883", Message: "function wh_delete_applied(uuid[], text[], uuid[]) does not exist"},
		{Code: "42703", Message: `column "claimed_at" of relation "wh_instances" does not exist`},
		{Code: "42P01", Message: `relation "wh_perspectives" does not exist`},
	} {
		line := errorLine(fmt.Errorf("status: %w", e), tg)
		require.Contains(t, line, "the perspectives schema is missing from the database, or out of date ("+e.Message+")", e.Code)
		require.Contains(t, line, "run: perspectives migrate --database-url 'postgres://u:xxxxx@db.example/app'", e.Code)
	}
	other := &pgconn.PgError{Code: "42883", Message: "function lower(integer) does not exist"}
	require.Equal(t, "status: "+other.Error(), errorLine(fmt.Errorf("status: %w", other), tg))
}

// A rebuild's wait that Ctrl-C ends says it was interrupted, not that --timeout passed.
func TestRebuildInterruptedSaysSo(t *testing.T) {
	ctx := context.Background()
	d := ownDB(t, "cli_rebuild_int")
	name := "ri_" + uuid.NewString()[:6]
	w, err := worker.New(d.Pool, worker.Config{Perspectives: []worker.Perspective{counterPerspective(name)}, Logger: quiet()})
	require.NoError(t, err)
	require.NoError(t, w.Start(ctx))
	require.NoError(t, w.Stop(ctx)) // registered; no worker builds the rebuild
	var out, errb bytes.Buffer
	rctx, cancel := context.WithTimeout(ctx, time.Second) // as Ctrl-C ends the command's context
	defer cancel()
	code := run(rctx, []string{"rebuild", "--perspective", name, "--database-url", d.URL, "--timeout", "1m"}, &out, &errb)
	require.Equal(t, 1, code)
	require.Contains(t, errb.String(), "interrupted; the rebuild goes on in the database")
	require.NotContains(t, errb.String(), "in 1m0s")
}
