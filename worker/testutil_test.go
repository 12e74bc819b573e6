package worker_test

// Helpers shared by the unit tests (mocks, no database): a perspective whose model shows
// any gap, duplicate or reordering, a goroutine-safe log sink, IDs.

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/mocks"
	"github.com/perspectives-go/perspectives/worker"
)

const utName = "seq"

// utSeq is the model of utPerspective: the events' "n" values, in application order.
// Events created with n = 1, 2, 3, … in ID order fold to [1 2 3 …].
type utSeq struct {
	Seq []int `json:"seq"`
}

func utPerspective(name string, hook func(n int) error) worker.Perspective {
	if hook == nil {
		return utPerspectiveOf(name, nil)
	}
	return utPerspectiveOf(name, func(_ worker.Event, n int) error { return hook(n) })
}

// utPerspectiveOf is utPerspective whose hook is also given the event.
func utPerspectiveOf(name string, hook func(ev worker.Event, n int) error) worker.Perspective {
	return worker.JSONPerspective(name, func(m utSeq, ev worker.Event) (utSeq, error) {
		var d struct {
			N int `json:"n"`
		}
		if err := json.Unmarshal(ev.Data, &d); err != nil {
			return m, err
		}
		if hook != nil {
			if err := hook(ev, d.N); err != nil {
				return m, err
			}
		}
		m.Seq = append(m.Seq, d.N)
		return m, nil
	})
}

func utDecode(t testing.TB, raw []byte) []int {
	t.Helper()
	var m utSeq
	require.NoError(t, json.Unmarshal(raw, &m), "model %s", raw)
	return m.Seq
}

// utLogBuf is a goroutine-safe log sink (the keepalive logs from its own goroutine).
type utLogBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *utLogBuf) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *utLogBuf) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func utLogger(buf *utLogBuf) *slog.Logger {
	return slog.New(slog.NewTextHandler(buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

func utNewID(t testing.TB) uuid.UUID {
	t.Helper()
	id, err := uuid.NewV7()
	require.NoError(t, err)
	return id
}

func utSorted(ids []uuid.UUID) []uuid.UUID {
	out := slices.Clone(ids)
	slices.SortFunc(out, func(a, b uuid.UUID) int { return bytes.Compare(a[:], b[:]) })
	return out
}

// utBuilds is the one build of the perspective utName: version 1, active, caught up.
func utBuilds() []worker.Build {
	return []worker.Build{{Key: utName, Perspective: utName, Version: 1, N: 1, State: worker.BuildActive, CatchUpDone: true}}
}

// utLoopStore is a Store mock with what a started worker's loop asks besides its claims and
// jobs: utBuilds registered and running, no status, nothing to clean up.
func utLoopStore() *mocks.StoreMock {
	return &mocks.StoreMock{
		RegisterFunc: func(context.Context, string, int) ([]worker.Build, error) { return utBuilds(), nil },
		ReleaseFunc:  func(context.Context, worker.ReleaseRequest) error { return nil },
		LeasedFunc:   func(context.Context, uuid.UUID) ([]worker.Pair, error) { return nil, nil },
		BuildsFunc:   func(context.Context, []string) ([]worker.Build, error) { return utBuilds(), nil },
		StatusFunc:   func(context.Context) ([]worker.BuildStatus, error) { return nil, nil },
		CleanupFunc: func(context.Context, []string, time.Duration, int, worker.LeaderLease) (bool, error) {
			return false, nil
		},
	}
}
