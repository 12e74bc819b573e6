package main

import (
	"context"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/perspectives-go/perspectives/db"
	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/worker"
)

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

func runRebuild(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs, dbURL := flags("rebuild", "rebuild --perspective NAME [--stream UUID] [--wait] [--timeout 10m] [--database-url URL]", stderr)
	name := fs.String("perspective", "", "perspective name (required)")
	stream := fs.String("stream", "", "one stream ID (default: every stream)")
	wait := fs.Bool("wait", true, "wait for running workers to apply the queued events, showing progress")
	timeout := fs.Duration("timeout", 10*time.Minute, "how long --wait waits")
	if err := parse(fs, args); err != nil {
		return err
	}
	pool, admin, err := openAdmin(ctx, *dbURL, *name)
	if err != nil {
		return err
	}
	defer pool.Close()
	q := db.New(pool)
	var streams []uuid.UUID
	if *stream != "" {
		id, err := requiredStream(*stream)
		if err != nil {
			return err
		}
		streams = []uuid.UUID{id}
	} else if streams, err = q.StreamIDs(ctx); err != nil {
		return err
	}

	bar := newProgress(stderr, "queueing", int64(len(streams)))
	var queued int64
	for i, s := range streams {
		n, err := admin.Rebuild(ctx, s, *name)
		if err != nil {
			bar.done()
			return fmt.Errorf("stream %s: %w", s, err)
		}
		queued += n
		bar.set(int64(i + 1))
	}
	bar.done()
	fmt.Fprintf(stdout, "rebuild of %s: %d streams purged, %d events queued\n", *name, len(streams), queued)
	if !*wait || queued == 0 {
		return nil
	}

	var filter uuid.NullUUID
	if len(streams) == 1 {
		filter = uuid.NullUUID{UUID: streams[0], Valid: true}
	}
	wctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	bar = newProgress(stderr, "applying", queued)
	tick := time.NewTicker(200 * time.Millisecond)
	defer tick.Stop()
	for {
		left, err := q.QueueCountFor(wctx, db.QueueCountForParams{PerspectiveName: *name, StreamID: filter})
		if err != nil {
			bar.done()
			return fmt.Errorf("waiting for workers: %w", err)
		}
		bar.set(max(queued-left, 0))
		if left == 0 {
			bar.done()
			fmt.Fprintln(stdout, "rebuild applied")
			return nil
		}
		select {
		case <-wctx.Done():
			bar.done()
			return fmt.Errorf("%d events still queued after %s: are workers running %s? (they keep applying; see: perspectives status)", left, *timeout, *name)
		case <-tick.C:
		}
	}
}

// progress draws a one-line progress bar.
type progress struct {
	w     io.Writer
	label string
	total int64
	start time.Time
}

func newProgress(w io.Writer, label string, total int64) *progress {
	p := &progress{w: w, label: label, total: total, start: time.Now()}
	p.set(0)
	return p
}

func (p *progress) set(n int64) {
	const width = 30
	frac := 1.0
	if p.total > 0 {
		frac = float64(n) / float64(p.total)
	}
	fill := int(frac * width)
	fmt.Fprintf(p.w, "\r%-9s [%s%s] %3.0f%% %d/%d %s", p.label, strings.Repeat("#", fill), strings.Repeat(".", width-fill),
		frac*100, n, p.total, time.Since(p.start).Round(100*time.Millisecond))
}

func (p *progress) done() { fmt.Fprintln(p.w) }
