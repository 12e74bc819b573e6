// Package pgtest gives each test package its own freshly migrated PostgreSQL database.
//
// The server comes from DATABASE_URL (default postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable).
// Main creates a database with a unique name, migrates it, runs the tests, closes the pool,
// drops the database and checks for leaked goroutines.
//
// With PGTEST_POOLER_URL set (a connection pooler in front of that server, e.g.
// postgres://postgres@127.0.0.1:6439/?sslmode=disable&default_query_exec_mode=exec), the
// tests' pool and URL go through the pooler, to the same database name, with the pooler URL's
// query parameters; creating, migrating and dropping the database still use the direct
// connection (migrations need one). DirectURL is the database without the pooler.
package pgtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"

	"github.com/perspectives-go/perspectives/schema"
)

// DefaultURL is the database used when DATABASE_URL is not set.
const DefaultURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

// ServerURL returns DATABASE_URL or DefaultURL.
func ServerURL() string {
	if u := os.Getenv("DATABASE_URL"); u != "" {
		return u
	}
	return DefaultURL
}

// PoolerURL returns PGTEST_POOLER_URL: "" when the tests connect directly.
func PoolerURL() string { return os.Getenv("PGTEST_POOLER_URL") }

// DB is a throw-away database.
type DB struct {
	Name      string
	URL       string // what the tests connect to: through the pooler when there is one
	DirectURL string // the database on the server itself
	Pool      *pgxpool.Pool
}

// Create makes a new database named after prefix, migrates it and opens a pool on it.
func Create(ctx context.Context, prefix string) (*DB, error) {
	d, err := CreateEmpty(ctx, prefix)
	if err != nil {
		return nil, err
	}
	if err := d.migrate(ctx); err != nil {
		d.Close()
		return nil, err
	}
	return d, nil
}

// migrate migrates the database on a direct pool of its own.
func (d *DB) migrate(ctx context.Context) error {
	if d.DirectURL == d.URL {
		return schema.Migrate(ctx, d.Pool)
	}
	direct, err := pgxpool.New(ctx, d.DirectURL)
	if err != nil {
		return fmt.Errorf("pgtest: %w", err)
	}
	defer direct.Close()
	return schema.Migrate(ctx, direct)
}

// CreateEmpty makes a new, unmigrated database named after prefix and opens a pool on it.
func CreateEmpty(ctx context.Context, prefix string) (*DB, error) {
	admin, err := pgx.Connect(ctx, ServerURL())
	if err != nil {
		return nil, fmt.Errorf("pgtest: connect to %s: %w (is PostgreSQL running? try: make db)", ServerURL(), err)
	}
	defer admin.Close(context.Background())

	b := make([]byte, 4)
	_, _ = rand.Read(b)
	name := fmt.Sprintf("pt_%s_%s", sanitize(prefix), hex.EncodeToString(b))
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		return nil, fmt.Errorf("pgtest: create database %s: %w", name, err)
	}
	u, err := url.Parse(ServerURL())
	if err != nil {
		return nil, fmt.Errorf("pgtest: parse DATABASE_URL: %w", err)
	}
	u.Path = "/" + name
	d := &DB{Name: name, URL: u.String(), DirectURL: u.String()}
	if p := PoolerURL(); p != "" {
		pu, err := url.Parse(p)
		if err != nil {
			_ = d.drop()
			return nil, fmt.Errorf("pgtest: parse PGTEST_POOLER_URL: %w", err)
		}
		pu.Path = "/" + name
		d.URL = pu.String()
	}
	cfg, err := pgxpool.ParseConfig(d.URL)
	if err != nil {
		_ = d.drop()
		return nil, fmt.Errorf("pgtest: %w", err)
	}
	cfg.MaxConns = 24
	d.Pool, err = pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		_ = d.drop()
		return nil, fmt.Errorf("pgtest: open pool: %w", err)
	}
	return d, nil
}

// empties are the databases EmptyURL made, dropped by Main after the run.
var (
	emptiesMu sync.Mutex
	empties   []*DB
)

// EmptyURL makes a new, unmigrated database named after prefix and returns its URL on the
// server itself (no pooler): for examples, which have no t.Cleanup. Main drops it after the
// run.
func EmptyURL(prefix string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	d, err := CreateEmpty(ctx, prefix)
	if err != nil {
		return "", err
	}
	d.Pool.Close()
	d.Pool = nil
	emptiesMu.Lock()
	empties = append(empties, d)
	emptiesMu.Unlock()
	return d.DirectURL, nil
}

// Close closes the pool and drops the database.
func (d *DB) Close() {
	if d.Pool != nil {
		d.Pool.Close()
	}
	if err := d.drop(); err != nil {
		fmt.Fprintln(os.Stderr, err)
	}
}

func (d *DB) drop() error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	admin, err := pgx.Connect(ctx, ServerURL())
	if err != nil {
		return fmt.Errorf("pgtest: drop %s: %w", d.Name, err)
	}
	defer admin.Close(context.Background())
	if _, err := admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{d.Name}.Sanitize()+" WITH (FORCE)"); err != nil {
		return fmt.Errorf("pgtest: drop %s: %w", d.Name, err)
	}
	return nil
}

func sanitize(s string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(s) {
		if (r >= 'a' && r <= 'z') || (r >= '0' && r <= '9') {
			b.WriteRune(r)
		} else {
			b.WriteRune('_')
		}
	}
	if b.Len() > 30 {
		return b.String()[:30]
	}
	return b.String()
}

// Exit runs Main and exits with its code.
func Exit(m *testing.M, prefix string, dst **DB) { os.Exit(Main(m, prefix, dst)) }

// Main is a TestMain body: it creates and migrates the package's database, stores it in
// *dst, runs the tests, tears the database down and fails the run on leaked goroutines.
func Main(m *testing.M, prefix string, dst **DB) int {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	d, err := Create(ctx, prefix)
	cancel()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	*dst = d
	code := m.Run()
	d.Close()
	emptiesMu.Lock()
	for _, e := range empties {
		e.Close()
	}
	empties = nil
	emptiesMu.Unlock()
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: %v\n", err)
			return 1
		}
	}
	return code
}

// Truncate empties every perspectives table (between tests that need a clean slate).
func (d *DB) Truncate(ctx context.Context, t testing.TB) {
	t.Helper()
	if _, err := d.Pool.Exec(ctx, "TRUNCATE wh_event_store, wh_perspectives, wh_perspective_builds, wh_perspective_events, wh_perspective_pairs, wh_perspective_cursors, wh_perspective_models, wh_perspective_snapshots"); err != nil {
		t.Fatalf("truncate: %v", err)
	}
}

// StartPooler starts a PgBouncer of its own in transaction mode in front of the server
// (scripts/pgbouncer.sh: installed when missing, a private port and directory) and returns
// the URL of database name through it. The pooler is stopped, by its PID, when the test
// ends.
func StartPooler(t testing.TB, name string) string {
	t.Helper()
	return startPooler(t, name)
}

// StartPreparedPooler is StartPooler with a PgBouncer that keeps prepared statements in
// transaction mode (>= 1.21, max_prepared_statements: see scripts/pgbouncer.sh), which
// pgx's default query exec mode works through.
func StartPreparedPooler(t testing.TB, name string) string {
	t.Helper()
	return startPooler(t, name, "PGBOUNCER_PREPARED=1")
}

var (
	preparedMu      sync.Mutex
	preparedChecked bool
	preparedMissing string
)

// PreparedPoolerMissing is why StartPreparedPooler cannot run here, "" when it can:
// scripts/pgbouncer.sh prepared installs a PgBouncer >= 1.21 when the system's package
// sources offer one, and exits 3 when the installed PgBouncer is older. The answer is kept for
// the test binary (the script may run apt-get to find it).
func PreparedPoolerMissing(t testing.TB) string {
	t.Helper()
	preparedMu.Lock()
	defer preparedMu.Unlock()
	if !preparedChecked {
		cmd := scriptCommand("pgbouncer.sh", nil, "prepared")
		out, err := cmd.Output()
		var exit *exec.ExitError
		switch {
		case errors.As(err, &exit) && exit.ExitCode() == 3:
			preparedMissing = "PgBouncer < 1.21 installed"
			t.Logf("installed PgBouncer: %s; the system's package sources offer no newer one", strings.TrimSpace(string(out)))
		case err != nil:
			var stderr []byte
			if exit != nil {
				stderr = exit.Stderr
			}
			t.Fatalf("pgtest: scripts/pgbouncer.sh prepared: %v\n%s", err, stderr)
		}
		preparedChecked = true
	}
	return preparedMissing
}

// startPooler starts scripts/pgbouncer.sh with env added to its environment.
func startPooler(t testing.TB, name string, env ...string) string {
	t.Helper()
	port := freePort(t)
	dir, err := os.MkdirTemp("", "pgbouncer-")
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	if out, err := runScript("pgbouncer.sh", env, "start", dir, strconv.Itoa(port)); err != nil {
		_ = os.RemoveAll(dir)
		t.Fatalf("pgtest: start PgBouncer: %v\n%s", err, out)
	}
	t.Cleanup(func() {
		if out, err := runScript("pgbouncer.sh", nil, "stop", dir); err != nil {
			t.Errorf("pgtest: stop PgBouncer: %v\n%s", err, out)
		}
	})
	u, err := url.Parse(ServerURL())
	if err != nil {
		t.Fatalf("pgtest: parse DATABASE_URL: %v", err)
	}
	u.Host, u.Path = fmt.Sprintf("127.0.0.1:%d", port), "/"+name
	return u.String()
}

// WithExecMode is dbURL with pgx's query exec mode set to mode ("exec", "simple_protocol";
// "" leaves pgx's default).
func WithExecMode(dbURL, mode string) string {
	u, err := url.Parse(dbURL)
	if err != nil || mode == "" {
		return dbURL
	}
	q := u.Query()
	q.Set("default_query_exec_mode", mode)
	u.RawQuery = q.Encode()
	return u.String()
}

// Cluster is a private PostgreSQL cluster of a test's own (scripts/pgcluster.sh): its own
// data directory and port, trust authentication. It is stopped and removed when the test
// ends.
type Cluster struct {
	Dir  string
	Port int
	URL  string // its postgres database
}

// StartCluster initializes and starts a private cluster.
func StartCluster(t testing.TB) *Cluster {
	t.Helper()
	c := newCluster(t)
	clusterScript(t, "primary", c.Dir, strconv.Itoa(c.Port))
	return c
}

// StartStandby makes and starts a streaming-replication standby of c on a cluster of its
// own; c's commits then wait for it (synchronous replication).
func (c *Cluster) StartStandby(t testing.TB) *Cluster {
	t.Helper()
	s := newCluster(t)
	clusterScript(t, "standby", s.Dir, strconv.Itoa(s.Port), strconv.Itoa(c.Port))
	return s
}

// Restart restarts the cluster in immediate mode: a crash and recovery.
func (c *Cluster) Restart(t testing.TB) { t.Helper(); clusterScript(t, "restart", c.Dir) }

// Crash stops the cluster in immediate mode.
func (c *Cluster) Crash(t testing.TB) { t.Helper(); clusterScript(t, "crash", c.Dir) }

// Promote promotes a standby and waits until it accepts writes.
func (c *Cluster) Promote(t testing.TB) { t.Helper(); clusterScript(t, "promote", c.Dir) }

func newCluster(t testing.TB) *Cluster {
	t.Helper()
	port := freePort(t)
	dir, err := os.MkdirTemp("", "pgcluster-")
	if err == nil {
		err = os.Chmod(dir, 0o755) // the server runs as postgres when the tests run as root
	}
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	c := &Cluster{Dir: filepath.Join(dir, "data"), Port: port,
		URL: fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", port)}
	t.Cleanup(func() {
		clusterScript(t, "stop", c.Dir)
		_ = os.RemoveAll(dir)
	})
	return c
}

func clusterScript(t testing.TB, args ...string) {
	t.Helper()
	if out, err := runScript("pgcluster.sh", nil, args...); err != nil {
		t.Fatalf("pgtest: pgcluster.sh %s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

// freePort is a TCP port on 127.0.0.1 that nothing listens on (as of now).
func freePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("pgtest: find a free port: %v", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// runScript runs the project's scripts/<name> with args, with DATABASE_URL set to the
// server's and env (NAME=value) added to its environment, and returns its combined output.
func runScript(name string, env []string, args ...string) ([]byte, error) {
	return scriptCommand(name, env, args...).CombinedOutput()
}

// scriptCommand is the command that runs the project's scripts/name with args, and env added
// to its environment.
func scriptCommand(name string, env []string, args ...string) *exec.Cmd {
	_, file, _, _ := runtime.Caller(0)
	script := filepath.Join(filepath.Dir(file), "..", "..", "scripts", name)
	cmd := exec.Command("bash", append([]string{script}, args...)...)
	cmd.Env = append(append(os.Environ(), "DATABASE_URL="+ServerURL()), env...)
	return cmd
}
