package ui_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/internal/pgtest"
	"github.com/perspectives-go/perspectives/ui"
	"github.com/perspectives-go/perspectives/worker"
)

var testDB *pgtest.DB

func TestMain(m *testing.M) { pgtest.Exit(m, "ui", &testDB) }

// hostile is text the tests store in the database to check that the pages escape it.
const hostile = `<script>alert("x")</script>`

var names atomic.Int64

func uniqueName(prefix string) string {
	return fmt.Sprintf("%s_%d_%d", prefix, time.Now().UnixNano()%1e6, names.Add(1))
}

func quietLogger() *slog.Logger { return slog.New(slog.DiscardHandler) }

// parkedPair is a pair parked at its poison event, by a worker that fails events of type
// "poison" of that stream (other tests' streams fold fine) with an error holding hostile.
type parkedPair struct {
	name   string
	stream uuid.UUID
	events []worker.Event // ok, poison, ok
	admin  *worker.Admin
	w      *worker.Worker // nil once stopped
}

// newParked parks a pair; with keepRunning the worker keeps running (it retries what is
// retried), else it is stopped once the pair is parked, so that nothing but the test
// changes the pair.
func newParked(t *testing.T, keepRunning bool) *parkedPair {
	t.Helper()
	ctx := context.Background()
	p := &parkedPair{name: uniqueName("ui"), stream: uuid.New()}
	stream := p.stream
	persp := worker.JSONPerspective(p.name, func(m map[string]int, ev worker.Event) (map[string]int, error) {
		if ev.Type == "poison" && ev.StreamID == stream {
			return m, errors.New("poison refused: " + hostile)
		}
		if m == nil {
			m = map[string]int{}
		}
		m[ev.Type]++
		return m, nil
	})
	w, err := worker.New(testDB.Pool, worker.Config{
		Perspectives:  []worker.Perspective{persp},
		FailurePolicy: worker.FailurePolicy{Attempts: 1},
		RetryBackoff:  5 * time.Millisecond, MaxRetryBackoff: 10 * time.Millisecond,
		PollInterval: 20 * time.Millisecond,
		Logger:       quietLogger(),
	})
	require.NoError(t, err)
	require.NoError(t, w.Start(ctx))
	p.w = w
	t.Cleanup(p.stop)
	for i, typ := range []string{"ok", "poison", "ok"} {
		id, err := uuid.NewV7()
		require.NoError(t, err)
		p.events = append(p.events, worker.Event{ID: id, StreamID: stream, Type: typ, Data: json.RawMessage(fmt.Sprintf(`{"n": %d}`, i))})
	}
	require.NoError(t, worker.Append(ctx, testDB.Pool, p.events...))
	p.admin, err = worker.NewAdmin(testDB.Pool, nil)
	require.NoError(t, err)
	eventually(t, 20*time.Second, "the pair parked", func() bool {
		fp := p.failed(t)
		return fp != nil && fp.Parked
	})
	if !keepRunning {
		p.stop()
	}
	return p
}

func (p *parkedPair) stop() {
	if p.w == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_ = p.w.Stop(ctx)
	p.w = nil
}

func (p *parkedPair) poison() uuid.UUID { return p.events[1].ID }

// failed is the pair's entry in Admin.Failed (nil: it is not failing).
func (p *parkedPair) failed(t testing.TB) *worker.FailedPair {
	t.Helper()
	all, err := p.admin.Failed(context.Background(), p.name, worker.MaxListed)
	require.NoError(t, err)
	for i := range all {
		if all[i].Stream == p.stream {
			return &all[i]
		}
	}
	return nil
}

// eventually waits for cond (see pgtest.Eventually).
var eventually = pgtest.Eventually

// server is the dashboard under test and a browser-like client (cookies, no redirects
// followed).
type server struct {
	*httptest.Server
	client *http.Client
	prefix string
}

func newServer(t *testing.T, opts ui.Options) *server {
	t.Helper()
	if opts.Logger == nil {
		opts.Logger = quietLogger()
	}
	h, err := ui.NewHandler(testDB.Pool, opts)
	require.NoError(t, err)
	prefix := strings.TrimRight(opts.Prefix, "/")
	mux := http.NewServeMux()
	mux.Handle(prefix+"/", h)
	if prefix != "" {
		mux.Handle(prefix, h)
	}
	s := &server{Server: httptest.NewServer(mux), prefix: prefix}
	t.Cleanup(s.Close)
	jar, err := cookiejar.New(nil)
	require.NoError(t, err)
	s.client = &http.Client{Jar: jar, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	return s
}

// response is a finished request.
type response struct {
	status   int
	body     string
	location string
}

func (s *server) do(t testing.TB, req *http.Request) response {
	t.Helper()
	res, err := s.client.Do(req)
	require.NoError(t, err)
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	return response{status: res.StatusCode, body: string(b), location: res.Header.Get("Location")}
}

func (s *server) get(t testing.TB, path string, header ...string) response {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, s.URL+s.prefix+path, nil)
	require.NoError(t, err)
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	return s.do(t, req)
}

// post submits a form as a browser on the dashboard's page does (same origin).
func (s *server) post(t testing.TB, path string, form url.Values, header ...string) response {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, s.URL+s.prefix+path, strings.NewReader(form.Encode()))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Origin", s.URL)
	req.Header.Set("Sec-Fetch-Site", "same-origin")
	for i := 0; i+1 < len(header); i += 2 {
		if header[i+1] == "" {
			req.Header.Del(header[i])
		} else {
			req.Header.Set(header[i], header[i+1])
		}
	}
	return s.do(t, req)
}

var csrfRE = regexp.MustCompile(`name="csrf" value="([^"]+)"`)

// csrf is the CSRF token of the page at path.
func (s *server) csrf(t testing.TB, path string) string {
	t.Helper()
	r := s.get(t, path)
	require.Equal(t, http.StatusOK, r.status, r.body)
	m := csrfRE.FindStringSubmatch(r.body)
	require.NotNil(t, m, "no CSRF field on %s", path)
	return m[1]
}
