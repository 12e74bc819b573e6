package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"slices"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/perspectives-go/perspectives/db"
	"github.com/perspectives-go/perspectives/internal/pgq"
	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/worker"
)

// connectAdmin connects and returns the pool (which the caller closes) and an Admin that
// takes no stream locks (for commands that only read, retry or skip).
func connectAdmin(ctx context.Context, dbURL string) (*pgxpool.Pool, *worker.Admin, error) {
	pool, err := connect(ctx, dbURL)
	if err != nil {
		return nil, nil, err
	}
	admin, err := worker.NewAdmin(pool, nil)
	if err != nil {
		pool.Close()
		return nil, nil, err
	}
	return pool, admin, nil
}

// openAdmin checks that a perspective was named, connects, and returns the pool (which the
// caller closes) and an Admin with the Postgres locker on it.
func openAdmin(ctx context.Context, dbURL, perspective string) (*pgxpool.Pool, *worker.Admin, error) {
	if perspective == "" {
		return nil, nil, fmt.Errorf("--perspective is required")
	}
	pool, err := connect(ctx, dbURL)
	if err != nil {
		return nil, nil, err
	}
	lk, err := locker.NewPostgres(pool, locker.Options{})
	if err == nil {
		var admin *worker.Admin
		if admin, err = worker.NewAdmin(pool, lk); err == nil {
			return pool, admin, nil
		}
	}
	pool.Close()
	return nil, nil, err
}

func defineRebuild(fs *flag.FlagSet) runFunc {
	name := fs.String("perspective", "", "perspective name (required)")
	stream := fs.String("stream", "", "one stream ID (default: the whole perspective, built beside its active version)")
	wait := fs.Bool("wait", true, "wait for running workers to do the rebuild, showing progress")
	timeout := fs.Duration("timeout", 10*time.Minute, "how long --wait waits")
	return func(ctx context.Context, dbURL string, stdout, stderr io.Writer) error {
		pool, admin, err := openAdmin(ctx, dbURL, *name)
		if err != nil {
			return err
		}
		defer pool.Close()
		wctx, cancel := context.WithTimeout(ctx, *timeout)
		defer cancel()
		if *stream != "" {
			id, err := requiredStream(*stream)
			if err != nil {
				return err
			}
			return rebuildStream(ctx, pool, admin, *name, id, *wait, *timeout, stdout, stderr)
		}

		b, created, err := admin.RebuildPerspective(ctx, *name)
		if err != nil {
			return err
		}
		verb := "started"
		if !created {
			verb = "already under way:"
		}
		fmt.Fprintf(stdout, "rebuild of %s %s version %d, build %d, beside the active build (readers keep it until the rebuild is promoted)\n",
			*name, verb, b.Version, b.N)
		if !*wait {
			return nil
		}
		var bar progress
		watch := &workerWatch{admin: admin, name: *name, versions: []int{b.Version}, say: func(line string) {
			if bar != nil {
				bar.say(line)
				return
			}
			fmt.Fprintln(stderr, line)
		}}
		saidCaughtUp := false
		tick := time.NewTicker(200 * time.Millisecond)
		defer tick.Stop()
		for {
			v, err := admin.Versions(ctx) // not wctx: the timeout ends the wait, not a read
			if err != nil {
				if bar != nil {
					bar.done()
				}
				if ctx.Err() != nil {
					return fmt.Errorf("interrupted; the rebuild goes on in the database (see: perspectives versions): %w", ctx.Err())
				}
				return fmt.Errorf("waiting for workers: %w", err)
			}
			var st *worker.BuildStatus
			for i := range v.Builds {
				if v.Builds[i].Key == b.Key {
					st = &v.Builds[i]
				}
			}
			if st == nil {
				if bar != nil {
					bar.done()
				}
				return fmt.Errorf("build %d of %s version %d is gone", b.N, *name, b.Version)
			}
			total := max(v.StoredEvents, st.CatchUpEvents)
			if bar == nil {
				bar = newProgress(stderr, "catch-up", "events", total)
			}
			if st.CatchUpDone {
				bar.set(total, total) // it has read the whole store
			} else {
				bar.set(st.CatchUpEvents, total)
			}
			switch {
			case st.State == worker.BuildActive:
				bar.done()
				fmt.Fprintln(stdout, "rebuild promoted: readers get it now")
				return nil
			case st.State == worker.BuildRetired:
				bar.done()
				return fmt.Errorf("the rebuild was retired before it was promoted (a newer version was promoted)")
			case st.CatchUpDone && !saidCaughtUp:
				saidCaughtUp = true
				bar.say(fmt.Sprintf("caught up with the store; waiting for its promotion (automatic, unless the workers run with ManualPromotion: then run perspectives promote --perspective %s --version %d)", *name, b.Version))
			}
			missing := watch.check(ctx)
			select {
			case <-wctx.Done():
				bar.done()
				if ctx.Err() != nil {
					return fmt.Errorf("interrupted; the rebuild goes on in the database (see: perspectives versions): %w", ctx.Err())
				}
				why := fmt.Sprintf("are workers running %s version %d?", *name, b.Version)
				if missing != "" {
					why = missing
				}
				return fmt.Errorf("the rebuild read %d of %d events in %s: %s (the rebuild waits in the database; see: perspectives versions)",
					st.CatchUpEvents, v.StoredEvents, *timeout, why)
			case <-tick.C:
			}
		}
	}
}

// rebuildStream rebuilds one stream of the perspective (purge and re-queue under the stream
// lock) and waits for the workers to apply it.
func rebuildStream(ctx context.Context, pool *pgxpool.Pool, admin *worker.Admin, name string, stream uuid.UUID, wait bool, timeout time.Duration, stdout, stderr io.Writer) error {
	queued, err := admin.Rebuild(ctx, stream, name)
	if err != nil {
		return fmt.Errorf("stream %s: %w", stream, err)
	}
	fmt.Fprintf(stdout, "rebuild of %s, stream %s: purged, %d events queued\n", name, stream, queued)
	if !wait || queued == 0 {
		return nil
	}
	wctx, cancel := context.WithTimeout(ctx, timeout) // ends the wait; reads use ctx
	defer cancel()
	q := pgq.New(pool)
	versions, err := runningVersions(ctx, admin, name)
	if err != nil {
		if ctx.Err() != nil {
			return fmt.Errorf("interrupted; the queued events stay queued (see: perspectives status): %w", ctx.Err())
		}
		return fmt.Errorf("waiting for workers: %w", err)
	}
	bar := newProgress(stderr, "applying", "events", queued)
	watch := &workerWatch{admin: admin, name: name, versions: versions, say: bar.say}
	tick := time.NewTicker(200 * time.Millisecond)
	defer tick.Stop()
	for {
		left, err := q.QueueCountFor(ctx, db.QueueCountForParams{PerspectiveName: name, StreamID: uuid.NullUUID{UUID: stream, Valid: true}})
		if err != nil {
			bar.done()
			if ctx.Err() != nil {
				return fmt.Errorf("interrupted; the queued events stay queued (see: perspectives status): %w", ctx.Err())
			}
			return fmt.Errorf("waiting for workers: %w", err)
		}
		bar.set(max(queued-left, 0), queued)
		if left == 0 {
			bar.done()
			fmt.Fprintln(stdout, "rebuild applied")
			return nil
		}
		missing := watch.check(ctx)
		select {
		case <-wctx.Done():
			bar.done()
			if ctx.Err() != nil {
				return fmt.Errorf("interrupted; the queued events stay queued (see: perspectives status): %w", ctx.Err())
			}
			why := fmt.Sprintf("are workers running %s?", name)
			if missing != "" {
				why = missing
			}
			return fmt.Errorf("%d events still queued after %s: %s (they stay queued; see: perspectives status)", left, timeout, why)
		case <-tick.C:
		}
	}
}

// runningVersions is the versions of the perspective whose builds are not retired: the
// versions running workers apply a stream's rebuild in.
func runningVersions(ctx context.Context, admin *worker.Admin, name string) ([]int, error) {
	v, err := admin.Versions(ctx)
	if err != nil {
		return nil, err
	}
	var out []int
	for _, b := range v.Builds {
		if b.Perspective == name && b.State != worker.BuildRetired && !slices.Contains(out, b.Version) {
			out = append(out, b.Version)
		}
	}
	return out, nil
}
