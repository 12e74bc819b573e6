package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"time"

	"github.com/google/uuid"

	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/worker"
)

const demoWorkerCommand = "demo-worker"

// demoStats are what one demo instance reports when it stops.
type demoStats struct {
	Instance      string `json:"instance"`
	EventsApplied int64  `json:"events_applied"`
	Rewinds       int64  `json:"rewinds"`
	Contended     int64  `json:"contended"`
	Refused       int64  `json:"refused"`
	Bootstraps    int64  `json:"bootstraps"`
	Failures      int64  `json:"failures"`
	Retired       int64  `json:"retired"` // "perspective version retired" said
}

// statsHandler counts the worker's log records instead of printing them.
type statsHandler struct {
	mu sync.Mutex
	s  demoStats
}

func (h *statsHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h *statsHandler) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h *statsHandler) WithGroup(string) slog.Handler            { return h }
func (h *statsHandler) Handle(_ context.Context, r slog.Record) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	switch r.Message {
	case "events applied":
		r.Attrs(func(a slog.Attr) bool {
			if a.Key == "events" {
				h.s.EventsApplied += a.Value.Int64()
			}
			return true
		})
	case "rewind completed":
		h.s.Rewinds++
	case "rewind skipped: stream lock held by another instance":
		h.s.Contended++
	case "operation refused at commit; will retry",
		"stream lock lost: the operation's work was refused; will retry with backoff":
		h.s.Refused++
	case "snapshot bootstrapped":
		h.s.Bootstraps++
	case "processing failed; will retry with backoff", "event application failed; will retry with backoff":
		h.s.Failures++
	case "perspective version retired: this instance no longer applies it":
		h.s.Retired++
	}
	return nil
}

func (h *statsHandler) snapshot() demoStats {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.s
}

// runDemoWorker runs one worker instance for the demo until it is signalled, then prints
// its stats as one JSON line. It prints "ready" once started.
func defineDemoWorker(fs *flag.FlagSet) runFunc {
	instance := fs.String("instance", "", "instance ID")
	lockTimeout := fs.Duration("lock-timeout", 4*time.Second, "stream lock timeout")
	delay := fs.Duration("apply-delay", time.Millisecond, "time spent per applied event")
	version := fs.Int("version", 1, "the version of the demo perspective this instance runs")
	return func(ctx context.Context, dbURL string, stdout, stderr io.Writer) error {
		id, err := uuid.Parse(*instance)
		if err != nil {
			return fmt.Errorf("--instance: %w", err)
		}
		pool, err := connect(ctx, dbURL)
		if err != nil {
			return err
		}
		defer pool.Close()
		opts := locker.Options{LockTimeout: *lockTimeout, KeepAliveInterval: *lockTimeout / 4}
		lk, err := locker.NewPostgres(pool, opts)
		if err != nil {
			return err
		}
		h := &statsHandler{s: demoStats{Instance: id.String()}}
		w, err := worker.New(pool, worker.Config{
			InstanceID:   id,
			Perspectives: []worker.Perspective{demoPerspective(*version, *delay)},
			Locker:       lk,
			LockOptions:  opts,
			Snapshots:    worker.SnapshotOptions{EveryNEvents: 10, MaxPerStream: 3},
			PollInterval: 50 * time.Millisecond,
			Logger:       slog.New(h),
			RetryBackoff: 100 * time.Millisecond,
			// The demo's poison event parks its pair after three tries (about 0.7 s).
			FailurePolicy: worker.FailurePolicy{Attempts: 3},
		})
		if err != nil {
			return err
		}
		if err := w.Start(ctx); err != nil {
			return err
		}
		fmt.Fprintln(stdout, "ready")
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := w.Stop(sctx); err != nil {
			return err
		}
		return json.NewEncoder(stdout).Encode(h.snapshot())
	}
}
