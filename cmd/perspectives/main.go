// Command perspectives operates a perspectives database: migrate it, inspect locks and the
// queue, purge or rebuild a perspective, and run the demo.
//
//	go run ./cmd/perspectives <command> [flags]
//
// The database comes from --database-url, else DATABASE_URL, else the local default.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/url"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// DefaultDatabaseURL is used when neither --database-url nor DATABASE_URL is set.
const DefaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

type command struct {
	name    string
	summary string
	run     func(ctx context.Context, args []string, stdout, stderr io.Writer) error
}

func commands() []command {
	return []command{
		{"migrate", "apply the schema migrations (no-op when current)", runMigrate},
		{"demo", "run several workers with late events and a killed instance, then check every model", runDemo},
		{"locks", "list held stream locks: stream, perspective, holder, reason, expires in", runLocks},
		{"status", "show worker instances and, per perspective: queue, lag, failing and parked pairs (exit 3 if any is parked)", runStatus},
		{"purge", "delete one pair's model and snapshots under the stream lock", runPurge},
		{"rebuild", "rebuild a perspective beside its active version (or one stream), with a progress bar", runRebuild},
		{"versions", "per perspective: active and building versions, catch-up progress, rate, ETA, lag", runVersions},
		{"promote", "make a caught-up version of a perspective the active one", runPromote},
		{"failed", "list failing and parked pairs (their event, attempts, error), and with --skipped the skipped events", runFailed},
		{"retry", "retry a perspective's failing and parked pairs now (or one stream's)", runRetry},
		{"skip", "skip a pair's failing event (recorded: who, when), then apply the events after it", runSkip},
		{"ui", "serve the operators' web dashboard (default on 127.0.0.1:8080)", runUI},
		{demoWorkerCommand, "(internal) one demo worker instance", runDemoWorker},
	}
}

func main() {
	ctx, stop := signalContext()
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// run executes one command and returns the exit code. Errors are one line on stderr.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		usage(stderr)
		if len(args) == 0 {
			return 2
		}
		return 0
	}
	var exit *exitError
	for _, c := range commands() {
		if c.name == args[0] {
			ctx, tgt := withTarget(ctx)
			err := c.run(ctx, args[1:], stdout, stderr)
			switch {
			case err == nil:
				return 0
			case errors.Is(err, flag.ErrHelp):
				return 0
			case errors.Is(err, errUsage):
				return 2
			case errors.As(err, &exit):
				fmt.Fprintf(stderr, "perspectives %s: %s\n", c.name, exit.msg)
				return exit.code
			default:
				fmt.Fprintf(stderr, "perspectives %s: %s\n", c.name, errorLine(err, tgt))
				return 1
			}
		}
	}
	fmt.Fprintf(stderr, "perspectives: unknown command %q\n", args[0])
	usage(stderr)
	return 2
}

func usage(w io.Writer) {
	fmt.Fprintln(w, "usage: perspectives <command> [flags]   (each command takes --help)")
	fmt.Fprintln(w, "\ncommands:")
	for _, c := range commands() {
		if strings.HasPrefix(c.summary, "(internal)") {
			continue
		}
		fmt.Fprintf(w, "  %-8s %s\n", c.name, c.summary)
	}
	fmt.Fprintln(w, "\nThe database is --database-url, else $DATABASE_URL, else "+DefaultDatabaseURL)
}

// errUsage marks a usage error already reported by the flag set.
var errUsage = errors.New("usage")

// exitError is a command's outcome that is not a failure to run it but must exit with its
// own code (status with parked pairs): msg is printed as the last line, like an error's.
type exitError struct {
	code int
	msg  string
}

func (e *exitError) Error() string { return e.msg }

// flags returns a flag set for a command with the shared --database-url flag.
func flags(name, synopsis string, stderr io.Writer) (*flag.FlagSet, *string) {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	def := os.Getenv("DATABASE_URL")
	if def == "" {
		def = DefaultDatabaseURL
	}
	dbURL := fs.String("database-url", def, "PostgreSQL URL (default from DATABASE_URL)")
	fs.Usage = func() {
		fmt.Fprintf(stderr, "usage: perspectives %s\n\n", synopsis)
		fs.PrintDefaults()
	}
	return fs, dbURL
}

func parse(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return errUsage
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(fs.Output(), "unexpected argument %q\n", fs.Arg(0))
		fs.Usage()
		return errUsage
	}
	return nil
}

// parseAndConnect parses the flags of a command that takes only --database-url and
// connects to its database.
func parseAndConnect(ctx context.Context, name string, args []string, stderr io.Writer) (*pgxpool.Pool, error) {
	fs, dbURL := flags(name, name+" [--database-url URL]", stderr)
	if err := parse(fs, args); err != nil {
		return nil, err
	}
	return connect(ctx, *dbURL)
}

// connect opens a pool and checks that the database answers. It records dbURL as the
// command's database (see withTarget).
func connect(ctx context.Context, dbURL string) (*pgxpool.Pool, error) {
	recordTarget(ctx, dbURL)
	cfg, err := pgxpool.ParseConfig(dbURL)
	if err != nil {
		return nil, fmt.Errorf("invalid database URL %s: %v", redact(dbURL), oneLine(err))
	}
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(pctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("cannot open database %s: %v", redact(dbURL), oneLine(err))
	}
	if err := pool.Ping(pctx); err != nil {
		pool.Close()
		return nil, &connectError{url: redact(dbURL), err: err}
	}
	return pool, nil
}

// redact hides a password in a URL.
func redact(s string) string {
	u, err := url.Parse(s)
	if err != nil || u.User == nil {
		return s
	}
	if _, ok := u.User.Password(); ok {
		u.User = url.UserPassword(u.User.Username(), "xxxxx")
	}
	return u.String()
}

func oneLine(err error) string {
	return strings.Join(strings.Fields(err.Error()), " ")
}

func signalContext() (context.Context, context.CancelFunc) {
	return signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
}
