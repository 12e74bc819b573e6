// Command perspectives operates a perspectives database. Install it with
//
//	go install github.com/perspectives-go/perspectives/cmd/perspectives@latest
//
// and run it as
//
//	perspectives <command> [flags]
//
// Its commands:
//
//	migrate   apply the schema migrations
//	demo      run several worker processes on a demo database, kill one, check every model
//	locks     list the held stream locks
//	status    worker instances, and per perspective the queue, lag, failing and parked pairs
//	purge     delete one pair's model and snapshots under the stream lock
//	rebuild   rebuild a perspective beside its active version, or one stream in place
//	versions  per perspective: active and building versions, catch-up progress, lag
//	promote   make a caught-up version of a perspective the active one
//	failed    list failing and parked pairs, and the skipped events
//	retry     retry a perspective's failing and parked pairs now
//	skip      skip a pair's failing event, then apply the events after it
//	ui        serve the operators' web dashboard
//
// Each takes --help. The database comes from --database-url, else DATABASE_URL, else
// DefaultDatabaseURL. docs/cli.md describes every command, flag, output and exit code.
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

// Exit codes of the command (see docs/cli.md).
const (
	exitOK     = 0 // done; also for --help
	exitFailed = 1 // the command failed: its error is the last line on stderr
	exitUsage  = 2 // no command, an unknown one, or flags that do not parse
	exitParked = 3 // status: some pair is parked, waiting for an operator
)

// runFunc runs a command once its flags are parsed; dbURL is the value of --database-url.
type runFunc func(ctx context.Context, dbURL string, stdout, stderr io.Writer) error

type command struct {
	name     string
	synopsis string // the usage line after "perspectives "
	summary  string
	// define defines the command's own flags on fs, which has --database-url, and returns
	// the function that runs the command with their values once fs has parsed the arguments.
	define func(fs *flag.FlagSet) runFunc
}

func commands() []command {
	return []command{
		{"migrate", "migrate [--database-url URL]",
			"apply the schema migrations (no-op when current)", noFlags(runMigrate)},
		{"demo", "demo [flags]",
			"run several workers with late events and a killed instance, then check every model", defineDemo},
		{"locks", "locks [--database-url URL]",
			"list held stream locks: stream, perspective, holder, reason, expires in", noFlags(runLocks)},
		{"status", "status [--database-url URL]",
			"show worker instances and, per perspective: queue, lag, failing and parked pairs (exit 3 if any is parked)", noFlags(runStatus)},
		{"purge", "purge --stream UUID --perspective NAME [--database-url URL]",
			"delete one pair's model and snapshots under the stream lock", definePurge},
		{"rebuild", "rebuild --perspective NAME [--stream UUID] [--wait=false] [--timeout 10m] [--database-url URL]",
			"rebuild a perspective beside its active version (or one stream), with a progress bar", defineRebuild},
		{"versions", "versions [--database-url URL]",
			"per perspective: active and building versions, catch-up progress, rate, ETA, lag", noFlags(runVersions)},
		{"promote", "promote --perspective NAME --version N [--database-url URL]",
			"make a caught-up version of a perspective the active one", definePromote},
		{"failed", "failed [--perspective NAME] [--skipped] [--limit N] [--database-url URL]",
			"list failing and parked pairs (their event, attempts, error), and with --skipped the skipped events", defineFailed},
		{"retry", "retry --perspective NAME [--stream UUID] [--database-url URL]",
			"retry a perspective's failing and parked pairs now (or one stream's)", defineRetry},
		{"skip", "skip --stream UUID --perspective NAME --event UUID [--by NAME] [--database-url URL]",
			"skip a pair's failing event (recorded: who, when), then apply the events after it", defineSkip},
		{"ui", "ui [--addr 127.0.0.1:8080] [--read-only] [--token T] [--insecure-listen] [--database-url URL]",
			"serve the operators' web dashboard (default on 127.0.0.1:8080)", defineUI},
		{demoWorkerCommand, demoWorkerCommand + " --instance UUID [flags]",
			"(internal) one demo worker instance", defineDemoWorker},
	}
}

// noFlags defines a command that takes only --database-url.
func noFlags(run runFunc) func(*flag.FlagSet) runFunc {
	return func(*flag.FlagSet) runFunc { return run }
}

// internal reports whether c is for the tool's own use (the demo's worker processes): it
// is left out of the usage and the documentation.
func (c command) internal() bool { return strings.HasPrefix(c.summary, "(internal)") }

// flagSet returns c's flag set, with the shared --database-url flag, and the function that
// runs c with the flags' values once the set has parsed the arguments.
func (c command) flagSet(stderr io.Writer) (*flag.FlagSet, *string, runFunc) {
	fs := flag.NewFlagSet(c.name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	def := os.Getenv("DATABASE_URL")
	if def == "" {
		def = DefaultDatabaseURL
	}
	dbURL := fs.String("database-url", def, "PostgreSQL URL (default from DATABASE_URL)")
	fs.Usage = func() {
		fmt.Fprintf(stderr, "usage: perspectives %s\n\n", c.synopsis)
		fs.PrintDefaults()
	}
	return fs, dbURL, c.define(fs)
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
			return exitUsage
		}
		return exitOK
	}
	for _, c := range commands() {
		if c.name == args[0] {
			return runCommand(ctx, c, args[1:], stdout, stderr)
		}
	}
	fmt.Fprintf(stderr, "perspectives: unknown command %q\n", args[0])
	usage(stderr)
	return exitUsage
}

// runCommand parses c's flags from args, runs c and returns its exit code.
func runCommand(ctx context.Context, c command, args []string, stdout, stderr io.Writer) int {
	fs, dbURL, runc := c.flagSet(stderr)
	if err := parse(fs, args); errors.Is(err, flag.ErrHelp) {
		return exitOK
	} else if err != nil {
		return exitUsage
	}
	ctx, tgt := withTarget(ctx)
	err := runc(ctx, *dbURL, stdout, stderr)
	var exit *exitError
	switch {
	case err == nil:
		return exitOK
	case errors.As(err, &exit):
		fmt.Fprintf(stderr, "perspectives %s: %s\n", c.name, exit.msg)
		return exit.code
	default:
		fmt.Fprintf(stderr, "perspectives %s: %s\n", c.name, errorLine(err, tgt))
		return exitFailed
	}
}

func usage(w io.Writer) {
	fmt.Fprintln(w, "usage: perspectives <command> [flags]   (each command takes --help)")
	fmt.Fprintln(w, "\ncommands:")
	for _, c := range commands() {
		if c.internal() {
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
