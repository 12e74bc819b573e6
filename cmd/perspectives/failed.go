package main

// failed, retry, skip: the operators' commands for pairs whose perspective fails on an event
// (see worker.FailurePolicy).

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/user"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/google/uuid"

	"github.com/perspectives-go/perspectives/worker"
)

func defineFailed(fs *flag.FlagSet) runFunc {
	name := fs.String("perspective", "", "only this perspective (default: all)")
	skipped := fs.Bool("skipped", false, "also list the skipped events: who skipped what, and when")
	limit := fs.Int("limit", 100, fmt.Sprintf("list at most this many (1 to %d)", worker.MaxListed))
	return func(ctx context.Context, dbURL string, stdout, stderr io.Writer) error {
		pool, admin, err := connectAdmin(ctx, dbURL)
		if err != nil {
			return err
		}
		defer pool.Close()
		failed, err := admin.Failed(ctx, *name, *limit)
		if err != nil {
			return err
		}
		now := time.Now()
		if len(failed) == 0 {
			fmt.Fprintln(stdout, "no failing or parked pairs")
		} else {
			tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "STATE\tSTREAM\tPERSPECTIVE\tVERSION\tEVENT\tTYPE\tATTEMPTS\tSINCE\tNEXT TRY\tLAST ERROR")
			for _, f := range failed {
				state, next := "failing", "now"
				if f.Parked {
					state, next = "PARKED", "retry or skip"
				} else if d := f.NextAttempt.Sub(now); !f.NextAttempt.IsZero() && d > 0 {
					next = "in " + d.Round(time.Second).String()
				}
				ev, typ := "-", "-"
				if f.Event != uuid.Nil {
					ev, typ = f.Event.String(), cmpOr(f.EventType, "?")
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\t%d\t%s ago\t%s\t%s\n", state, f.Stream, f.Perspective, f.Version,
					ev, typ, f.Attempts, now.Sub(f.Since).Round(time.Second), next, clip(f.LastError, 120))
			}
			if err := tw.Flush(); err != nil {
				return err
			}
			if len(failed) == *limit {
				fmt.Fprintf(stdout, "(the first %d; --limit shows more)\n", *limit)
			}
			fmt.Fprintln(stdout, "retry now: perspectives retry --perspective NAME [--stream ID]; skip the event: perspectives skip --stream ID --perspective NAME --event ID")
		}
		if !*skipped {
			return nil
		}
		events, err := admin.Skipped(ctx, *name, *limit)
		if err != nil {
			return err
		}
		fmt.Fprintln(stdout)
		if len(events) == 0 {
			fmt.Fprintln(stdout, "no skipped events")
			return nil
		}
		tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "SKIPPED\tBY\tHOW\tSTREAM\tPERSPECTIVE\tVERSION\tEVENT\tTYPE\tATTEMPTS\tLAST ERROR")
		for _, s := range events {
			how := "operator"
			if s.ByPolicy {
				how = "policy"
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%d\t%s\t%s\t%d\t%s\n", s.At.Local().Format(time.DateTime), s.By, how,
				s.Stream, s.Perspective, s.Version, s.Event, cmpOr(s.EventType, "?"), s.Attempts, clip(s.LastError, 120))
		}
		return tw.Flush()
	}
}

func defineRetry(fs *flag.FlagSet) runFunc {
	name := fs.String("perspective", "", "perspective name (required)")
	stream := fs.String("stream", "", "one stream ID (default: every failing and parked pair of the perspective)")
	return func(ctx context.Context, dbURL string, stdout, stderr io.Writer) error {
		sid := uuid.Nil
		if *stream != "" {
			var err error
			if sid, err = requiredStream(*stream); err != nil {
				return err
			}
		}
		pool, admin, err := openAdmin(ctx, dbURL, *name)
		if err != nil {
			return err
		}
		defer pool.Close()
		n, err := admin.Retry(ctx, sid, *name)
		if err != nil {
			return err
		}
		switch {
		case n == 0 && sid != uuid.Nil:
			fmt.Fprintf(stdout, "stream %s of %s is not failing: nothing to retry\n", sid, *name)
		case n == 0:
			fmt.Fprintf(stdout, "no pair of %s is failing: nothing to retry\n", *name)
		default:
			fmt.Fprintf(stdout, "retrying %d pair(s) of %s now (running workers pick them up at once; see perspectives failed)\n", n, *name)
		}
		return nil
	}
}

func defineSkip(fs *flag.FlagSet) runFunc {
	stream := fs.String("stream", "", "stream ID (required)")
	name := fs.String("perspective", "", "perspective name (required)")
	event := fs.String("event", "", "the event to skip (required; perspectives failed shows the failing one)")
	by := fs.String("by", defaultOperator(), "who skips it (recorded with the skip)")
	return func(ctx context.Context, dbURL string, stdout, stderr io.Writer) error {
		sid, err := requiredStream(*stream)
		if err != nil {
			return err
		}
		if *event == "" {
			return fmt.Errorf("--event is required")
		}
		eid, err := uuid.Parse(*event)
		if err != nil {
			return fmt.Errorf("--event %q is not a UUID", *event)
		}
		pool, admin, err := openAdmin(ctx, dbURL, *name)
		if err != nil {
			return err
		}
		defer pool.Close()
		versions, err := admin.Skip(ctx, sid, *name, eid, *by)
		if err != nil {
			return err
		}
		vs := make([]string, len(versions))
		for i, v := range versions {
			vs[i] = fmt.Sprint(v)
		}
		fmt.Fprintf(stdout, "skipped event %s of stream %s for %s (version %s), recorded as skipped by %s; the events after it are applied next\n",
			eid, sid, *name, strings.Join(vs, ", "), *by)
		return nil
	}
}

// defaultOperator names the operator running a command: user@host.
func defaultOperator() string {
	name := os.Getenv("USER")
	if u, err := user.Current(); err == nil && u.Username != "" {
		name = u.Username
	}
	host, _ := os.Hostname()
	switch {
	case name == "" && host == "":
		return "cli"
	case host == "":
		return name
	}
	return cmpOr(name, "cli") + "@" + host
}

func cmpOr(s, def string) string {
	if s == "" {
		return def
	}
	return s
}

// clip shortens s to one line of at most n runes.
func clip(s string, n int) string {
	s = strings.Join(strings.Fields(s), " ")
	if r := []rune(s); len(r) > n {
		return string(r[:n-1]) + "…"
	}
	return s
}
