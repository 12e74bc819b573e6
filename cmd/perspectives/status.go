package main

import (
	"context"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/perspectives-go/perspectives/internal/pgq"
	"github.com/perspectives-go/perspectives/worker"
)

// runStatus shows the worker instances (alive or gone, by their heartbeats) and, per
// perspective and version, the queue, the lag, the failing and parked pairs and the live
// instances running it, with a verdict that tells idle from stuck; then the failing pairs.
// It exits with exitParked when any pair is parked.
func runStatus(ctx context.Context, dbURL string, stdout, _ io.Writer) error {
	pool, err := connect(ctx, dbURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	admin, err := worker.NewAdmin(pool, nil)
	if err != nil {
		return err
	}
	v, err := admin.Versions(ctx)
	if err != nil {
		return err
	}
	instances, err := admin.Instances(ctx)
	if err != nil {
		return err
	}

	if err := printInstances(stdout, instances); err != nil {
		return err
	}
	fmt.Fprintln(stdout)
	byKey := map[string]worker.BuildStatus{}
	var parked []string
	var parkedPairs int64
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	if len(v.Builds) > 0 {
		fmt.Fprintln(tw, "PERSPECTIVE\tVERSION\tSTATE\tQUEUED\tLAG\tFAILING\tPARKED\tINSTANCES\tEVENTS/S\tHEALTH")
	}
	for _, b := range v.Builds {
		byKey[b.Key] = b
		if b.State == worker.BuildRetired {
			continue
		}
		oldest := "-"
		if b.Queued > 0 {
			oldest = b.OldestQueued.Round(time.Millisecond).String() + " ago"
		}
		fmt.Fprintf(tw, "%s\t%d\t%s\t%d\t%s\t%d\t%d\t%d\t%.1f\t%s\n", b.Perspective, b.Version, b.State, b.Queued, oldest,
			b.Failing, b.Parked, b.LiveInstances, b.EventsPerSecond, health(b))
		if b.Parked > 0 {
			parkedPairs += b.Parked
			parked = append(parked, fmt.Sprintf("%s version %d: %d", b.Perspective, b.Version, b.Parked))
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(v.Builds) == 0 {
		fmt.Fprintln(stdout, "no perspective registered")
	}

	failed, err := pgq.New(pool).CursorsFailed(ctx)
	if err != nil {
		return err
	}
	if len(failed) == 0 {
		fmt.Fprintln(stdout, "\nno failed pairs")
	} else {
		fmt.Fprintf(stdout, "\n%d failed pairs:\n", len(failed))
		tw = tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "STREAM\tPERSPECTIVE\tVERSION\tATTEMPTS\tLAST ERROR")
		for _, f := range failed {
			msg := ""
			if f.LastError != nil {
				msg = clip(*f.LastError, 120)
			}
			name, version := f.PerspectiveName, "-"
			if b, ok := byKey[f.PerspectiveName]; ok {
				name, version = b.Perspective, fmt.Sprint(b.Version)
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\n", f.StreamID, name, version, f.Attempts, msg)
		}
		if err := tw.Flush(); err != nil {
			return err
		}
	}
	if parkedPairs > 0 {
		return &exitError{code: exitParked, msg: fmt.Sprintf(
			"%d parked %s (%s) wait for an operator: list them with perspectives failed, then retry or skip",
			parkedPairs, plural(parkedPairs, "pair", "pairs"), strings.Join(parked, ", "))}
	}
	return nil
}

// printInstances prints the worker instances the heartbeats recorded.
func printInstances(w io.Writer, instances []worker.Instance) error {
	if len(instances) == 0 {
		fmt.Fprintln(w, "no worker instance recorded (a running worker records a heartbeat every "+worker.HeartbeatInterval.String()+")")
		return nil
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "INSTANCE\tHOST\tPID\tSTARTED\tLAST SEEN\tPERSPECTIVES\tSTATE")
	for _, in := range instances {
		state := "alive"
		if !in.Alive {
			state = "gone"
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s ago\t%s\t%s\n", in.ID, in.Host, in.PID,
			in.Started.Local().Format("2006-01-02 15:04:05 MST"), ago(in.SinceSeen), runsList(in.Perspectives), state)
	}
	return tw.Flush()
}

// health is the verdict that tells idle from stuck (BuildStatus.Health), in words: a parked
// pair, or work (a queue, a catch-up) with no live instance to do it, is stuck.
func health(b worker.BuildStatus) string {
	switch b.Health() {
	case worker.HealthStuckParked:
		return fmt.Sprintf("stuck: %d parked %s", b.Parked, plural(b.Parked, "pair", "pairs"))
	case worker.HealthStuckNoInstance:
		return "stuck: no live instance runs it"
	case worker.HealthRetrying:
		return fmt.Sprintf("retrying %d failing %s", b.Failing, plural(b.Failing, "pair", "pairs"))
	case worker.HealthCatchingUp:
		return "catching up"
	case worker.HealthApplying:
		return "applying"
	case worker.HealthIdleNoInstance:
		return "idle (no live instance)"
	default:
		return "idle"
	}
}

// runsList is "orders v2, visits v1".
func runsList(ps []worker.PerspectiveVersion) string {
	if len(ps) == 0 {
		return "-"
	}
	s := make([]string, len(ps))
	for i, p := range ps {
		s[i] = fmt.Sprintf("%s v%d", p.Name, p.Version)
	}
	return strings.Join(s, ", ")
}

// ago rounds an age for people: tenths of seconds under a minute, then seconds, then minutes.
func ago(d time.Duration) string {
	switch {
	case d < time.Minute:
		return d.Round(100 * time.Millisecond).String()
	case d < time.Hour:
		return d.Round(time.Second).String()
	default:
		return d.Round(time.Minute).String()
	}
}

func plural(n int64, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}
