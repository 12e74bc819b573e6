package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/google/uuid"

	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/schema"
)

func runMigrate(ctx context.Context, dbURL string, stdout, _ io.Writer) error {
	pool, err := connect(ctx, dbURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := schema.Migrate(ctx, pool); err != nil {
		return err
	}
	fmt.Fprintln(stdout, "schema is current")
	return nil
}

func runLocks(ctx context.Context, dbURL string, stdout, _ io.Writer) error {
	pool, err := connect(ctx, dbURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	lk, err := locker.NewPostgres(pool, locker.Options{})
	if err != nil {
		return err
	}
	locks, err := lk.ListStatus(ctx)
	if err != nil {
		return err
	}
	if len(locks) == 0 {
		fmt.Fprintln(stdout, "no stream locks held")
		return nil
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "STREAM\tPERSPECTIVE\tHOLDER\tREASON\tEXPIRES IN")
	for _, l := range locks {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", l.StreamID, l.PerspectiveName, l.InstanceID, l.Reason, l.ExpiresIn.Round(100*time.Millisecond))
	}
	return tw.Flush()
}

func definePurge(fs *flag.FlagSet) runFunc {
	stream := fs.String("stream", "", "stream ID (required)")
	name := fs.String("perspective", "", "perspective name (required)")
	return func(ctx context.Context, dbURL string, stdout, _ io.Writer) error {
		sid, err := requiredStream(*stream)
		if err != nil {
			return err
		}
		pool, admin, err := openAdmin(ctx, dbURL, *name)
		if err != nil {
			return err
		}
		defer pool.Close()
		if err := admin.Purge(ctx, sid, *name); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "purged %s of stream %s\n", *name, sid)
		return nil
	}
}

func requiredStream(s string) (uuid.UUID, error) {
	if s == "" {
		return uuid.Nil, fmt.Errorf("--stream is required")
	}
	id, err := uuid.Parse(s)
	if err != nil {
		return uuid.Nil, fmt.Errorf("--stream %q is not a UUID", s)
	}
	if id == uuid.Nil {
		return uuid.Nil, fmt.Errorf("--stream is the nil UUID, which names no stream")
	}
	return id, nil
}
