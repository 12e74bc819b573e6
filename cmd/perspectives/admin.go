package main

import (
	"context"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/google/uuid"

	"github.com/perspectives-go/perspectives/internal/pgq"
	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/schema"
	"github.com/perspectives-go/perspectives/worker"
)

func runMigrate(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	pool, err := parseAndConnect(ctx, "migrate", args, stderr)
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

func runLocks(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	pool, err := parseAndConnect(ctx, "locks", args, stderr)
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

func runStatus(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	pool, v, err := connectVersions(ctx, "status", args, stderr)
	if err != nil {
		return err
	}
	defer pool.Close()
	byKey := map[string]worker.BuildStatus{}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "PERSPECTIVE\tVERSION\tSTATE\tQUEUED\tOLDEST QUEUED")
	for _, b := range v.Builds {
		byKey[b.Key] = b
		if b.State == worker.BuildRetired {
			continue
		}
		oldest := "-"
		if b.Queued > 0 {
			oldest = b.OldestQueued.Round(time.Millisecond).String() + " ago"
		}
		fmt.Fprintf(tw, "%s\t%d\t%s\t%d\t%s\n", b.Perspective, b.Version, b.State, b.Queued, oldest)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	failed, err := pgq.New(pool).CursorsFailed(ctx)
	if err != nil {
		return err
	}
	if len(failed) == 0 {
		fmt.Fprintln(stdout, "\nno failed pairs")
		return nil
	}
	fmt.Fprintf(stdout, "\n%d failed pairs:\n", len(failed))
	tw = tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "STREAM\tPERSPECTIVE\tVERSION\tATTEMPTS\tLAST ERROR")
	for _, f := range failed {
		msg := ""
		if f.LastError != nil {
			msg = strings.Join(strings.Fields(*f.LastError), " ")
			if len(msg) > 120 {
				msg = msg[:117] + "..."
			}
		}
		name, version := f.PerspectiveName, "-"
		if b, ok := byKey[f.PerspectiveName]; ok {
			name, version = b.Perspective, fmt.Sprint(b.Version)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\n", f.StreamID, name, version, f.Attempts, msg)
	}
	return tw.Flush()
}

func runPurge(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs, dbURL := flags("purge", "purge --stream UUID --perspective NAME [--database-url URL]", stderr)
	stream := fs.String("stream", "", "stream ID (required)")
	name := fs.String("perspective", "", "perspective name (required)")
	if err := parse(fs, args); err != nil {
		return err
	}
	sid, err := requiredStream(*stream)
	if err != nil {
		return err
	}
	pool, admin, err := openAdmin(ctx, *dbURL, *name)
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

func requiredStream(s string) (uuid.UUID, error) {
	if s == "" {
		return uuid.Nil, fmt.Errorf("--stream is required")
	}
	id, err := uuid.Parse(s)
	if err != nil {
		return uuid.Nil, fmt.Errorf("--stream %q is not a UUID", s)
	}
	return id, nil
}
