package main

import (
	"bytes"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/worker"
)

func TestProgressIsPlainLinesOffATerminal(t *testing.T) {
	var buf bytes.Buffer
	p := newProgress(&buf, "catch-up", "events", 1000)
	_, plain := p.(*plainProgress)
	require.True(t, plain, "a buffer is not a terminal")

	r, w, err := os.Pipe()
	require.NoError(t, err)
	defer r.Close()
	defer w.Close()
	require.False(t, isTerminal(w), "a pipe is not a terminal")
	_, plain = newProgress(w, "x", "events", 1).(*plainProgress)
	require.True(t, plain)

	// The first set prints at once; the next ones only every interval; done prints the last.
	pp := &plainProgress{w: &buf, label: "catch-up", unit: "events", total: 1000, every: time.Hour, start: time.Now()}
	pp.set(100, 1000)
	pp.set(200, 1000)
	pp.say("a line of its own")
	time.Sleep(20 * time.Millisecond)
	pp.set(600, 1000)
	pp.done()
	pp.set(700, 1000) // after done: nothing
	out := buf.String()
	require.NotContains(t, out, "\r")
	lines := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
	require.Equal(t, []string{"catch-up: 100/1000 events (10%), rate -, ETA -", "a line of its own"}, lines[:2])
	require.Len(t, lines, 3, "%q", out)
	require.Regexp(t, `^catch-up: 600/1000 events \(60%\) in [0-9.]+m?s, \d+ events/s$`, lines[2])

	// Every interval: with rate and ETA.
	buf.Reset()
	pp = &plainProgress{w: &buf, label: "applying", unit: "events", total: 100, every: 0, start: time.Now()}
	pp.set(0, 100)
	time.Sleep(20 * time.Millisecond)
	pp.set(50, 100)
	lines = strings.Split(strings.TrimSuffix(buf.String(), "\n"), "\n")
	require.Len(t, lines, 2)
	require.Regexp(t, `^applying: 50/100 events \(50%\), \d+ events/s, ETA \d+(\.\d+)?m?s$`, lines[1])
}

func TestProgressBarOnATerminalShowsRateAndETA(t *testing.T) {
	var buf bytes.Buffer
	p := newBarProgress(&buf, "catch-up", "events", 100)
	time.Sleep(600 * time.Millisecond) // the bar's rate is measured over half-second windows
	p.set(40, 100)
	p.say("no running worker applies x version 1")
	p.set(100, 120) // the store grew
	p.done()
	out := buf.String()
	require.Contains(t, out, "\r", "frames redrawn in place")
	require.Regexp(t, `catch-up\s+33%.*\(40/120, \d+ events/s\) \[\d+s:\d+s\]|catch-up\s+40%.*\(40/100, \d+ events/s\) \[\d+s:\d+s\]`, out, "count, rate, elapsed:ETA")
	require.Contains(t, out, "no running worker applies x version 1\n")
	require.True(t, strings.HasSuffix(out, "\n"), "ends its line: %q", out)
	require.Regexp(t, regexp.MustCompile(`\(100/120, \d+ events/s\)`), out)
}

func TestMissingWorkerNamesTheLastInstanceSeen(t *testing.T) {
	old, older, other := uuid.New(), uuid.New(), uuid.New()
	instances := []worker.Instance{
		{ID: older, Host: "h1", SinceSeen: 3 * time.Hour, Perspectives: []worker.PerspectiveVersion{{Name: "orders", Version: 2}}},
		{ID: old, Host: "h2", SinceSeen: 12*time.Minute + 300*time.Millisecond, Perspectives: []worker.PerspectiveVersion{{Name: "orders", Version: 2}}},
		{ID: other, Host: "h3", Alive: true, Perspectives: []worker.PerspectiveVersion{{Name: "orders", Version: 1}}},
	}
	require.Equal(t, "no running worker applies orders version 2: start one (last seen: instance "+old.String()+" on host h2, 12m0s ago)",
		missingWorker(instances, "orders", 2))
	require.Empty(t, missingWorker(instances, "orders", 1), "a live instance runs version 1")
	require.Equal(t, "no running worker applies visits version 1: start one (no instance running it has recorded a heartbeat)",
		missingWorker(instances, "visits", 1))
}
