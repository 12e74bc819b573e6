package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/perspectives-go/perspectives/worker"
)

func runVersions(ctx context.Context, dbURL string, stdout, _ io.Writer) error {
	pool, v, err := connectVersions(ctx, dbURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	if len(v.Builds) == 0 {
		fmt.Fprintln(stdout, "no perspective registered")
		return nil
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "PERSPECTIVE\tVERSION\tBUILD\tSTATE\tCAUGHT UP\tRATE\tETA\tQUEUED\tLAG")
	now := time.Now()
	for _, b := range v.Builds {
		if b.State == worker.BuildRetired {
			continue
		}
		progress, rate, eta := catchUpFigures(b, v, now)
		lag := "-"
		if b.Queued > 0 {
			lag = b.OldestQueued.Round(time.Millisecond).String()
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%s\t%s\t%s\t%s\t%d\t%s\n",
			b.Perspective, b.Version, b.N, b.State, progress, rate, eta, b.Queued, lag)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	about := "exact"
	if v.Estimated {
		about = "estimated"
	}
	fmt.Fprintf(stdout, "\nstore: %d events (%s); LAG is the age of the oldest queued event\n", v.StoredEvents, about)
	return nil
}

// connectVersions connects and reads every build's status; the caller closes the pool.
func connectVersions(ctx context.Context, dbURL string) (*pgxpool.Pool, worker.Versions, error) {
	pool, err := connect(ctx, dbURL)
	if err != nil {
		return nil, worker.Versions{}, err
	}
	admin, err := worker.NewAdmin(pool, nil)
	if err == nil {
		var v worker.Versions
		if v, err = admin.Versions(ctx); err == nil {
			return pool, v, nil
		}
	}
	pool.Close()
	return nil, worker.Versions{}, err
}

// catchUpFigures gives a build's catch-up progress (events and streams of the store's),
// its rate and the time it still needs, as printed.
func catchUpFigures(b worker.BuildStatus, v worker.Versions, now time.Time) (progress, rate, eta string) {
	if b.CatchUpDone {
		return fmt.Sprintf("done (%d events, %d streams)", b.CatchUpEvents, b.CatchUpStreams), "-", "-"
	}
	pct := 0.0
	if v.StoredEvents > 0 {
		pct = min(100, 100*float64(b.CatchUpEvents)/float64(v.StoredEvents))
	}
	progress = fmt.Sprintf("%.1f%% (%d of %d events, %d streams)", pct, b.CatchUpEvents, v.StoredEvents, b.CatchUpStreams)
	if b.CatchUpStarted == nil || b.CatchUpEvents == 0 {
		return progress, "-", "-"
	}
	elapsed := now.Sub(*b.CatchUpStarted).Seconds()
	if elapsed <= 0 {
		return progress, "-", "-"
	}
	perSec := float64(b.CatchUpEvents) / elapsed
	left := max(v.StoredEvents-b.CatchUpEvents, 0)
	return progress, fmt.Sprintf("%.0f events/s", perSec), (time.Duration(float64(left)/perSec) * time.Second).Round(time.Second).String()
}

func definePromote(fs *flag.FlagSet) runFunc {
	name := fs.String("perspective", "", "perspective name (required)")
	version := fs.Int("version", 0, "the version to make active (required; its catch-up must be done)")
	return func(ctx context.Context, dbURL string, stdout, _ io.Writer) error {
		if *version < 1 {
			return fmt.Errorf("--version is required and must be positive")
		}
		pool, admin, err := openAdmin(ctx, dbURL, *name)
		if err != nil {
			return err
		}
		defer pool.Close()
		b, err := admin.Promote(ctx, *name, *version)
		if err != nil {
			return err
		}
		if b.PromotionRequested {
			fmt.Fprintf(stdout, "%s writes to a sink: its promotion to version %d (build %d) is requested of the workers running that version, which promote it at their next look at the builds\n", *name, b.Version, b.N)
			return nil
		}
		fmt.Fprintf(stdout, "%s version %d (build %d) is active\n", *name, b.Version, b.N)
		return nil
	}
}
