// Package ui is the operators' web dashboard: an http.Handler an application mounts in its
// own server (or that `perspectives ui` serves) showing each perspective's versions and lag,
// the worker instances, the held stream locks and the failing, parked and skipped pairs, with
// Retry, Skip and Force-release actions.
//
// Pages are rendered on the server with html/template (everything shown is escaped; no
// script runs: the Content-Security-Policy forbids it). Actions are POSTs that carry a CSRF
// token and are refused from other origins. When Options.Token is set, every request needs
// it; Options.ReadOnly hides the actions and refuses them.
package ui

import (
	"context"
	"crypto/rand"
	"embed"
	"errors"
	"fmt"
	"html/template"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/worker"
)

// ErrInvalidOptions is wrapped by NewHandler's errors about its options.
var ErrInvalidOptions = errors.New("invalid dashboard options")

// Options configures the dashboard. The zero value serves it at the root, read-write,
// without a token (fit for a server that listens on localhost only).
type Options struct {
	// Prefix is the path the handler is mounted at, e.g. "/perspectives" for
	// mux.Handle("/perspectives/", h): the handler serves the paths below it and builds its
	// links with it (it does not need http.StripPrefix). Default "": the root.
	Prefix string
	// ReadOnly hides the action buttons and refuses every POST with 403. Default false.
	ReadOnly bool
	// Token, when set, is required by every request, pages and actions alike: an
	// "Authorization: Bearer <token>" header, or a cookie the dashboard sets when a page is
	// opened once with ?token=<token>. Compared in constant time. Default "": none (then
	// serve it on a loopback address only, or behind your own authentication).
	Token string
	// Locker lists the held stream locks and force-releases them. Default nil: a
	// locker.Postgres on the pool (stream locks live on the cursor rows, so any
	// locker.Postgres on the database sees the workers' locks).
	Locker *locker.Postgres
	// Logger records the actions taken and the errors met. Default nil: slog.Default().
	Logger *slog.Logger
}

// Rows listed at most on the failures page (failing or parked pairs; skipped events).
const (
	maxFailed  = 500
	maxSkipped = 200
)

// queryTimeout bounds the database work of one request.
const queryTimeout = 15 * time.Second

// handler is the dashboard.
type handler struct {
	opts   Options
	admin  *worker.Admin
	locks  *locker.Postgres
	log    *slog.Logger
	mux    *http.ServeMux
	pages  map[string]*template.Template
	secret []byte // per process: signs CSRF tokens and flash messages
	origin *http.CrossOriginProtection
}

//go:embed templates/*.html
var templateFS embed.FS

// NewHandler returns the dashboard on pool. It checks opts and parses its templates; it
// runs no SQL until a page is requested.
func NewHandler(pool *pgxpool.Pool, opts Options) (http.Handler, error) {
	if pool == nil {
		return nil, fmt.Errorf("ui: %w: pool is nil", ErrInvalidOptions)
	}
	prefix, err := cleanPrefix(opts.Prefix)
	if err != nil {
		return nil, err
	}
	opts.Prefix = prefix
	if opts.Token != strings.TrimSpace(opts.Token) {
		return nil, fmt.Errorf("ui: %w: Token has leading or trailing spaces", ErrInvalidOptions)
	}
	h := &handler{opts: opts, log: opts.Logger, locks: opts.Locker, origin: http.NewCrossOriginProtection()}
	if h.log == nil {
		h.log = slog.Default()
	}
	if h.locks == nil {
		if h.locks, err = locker.NewPostgres(pool, locker.Options{}); err != nil {
			return nil, fmt.Errorf("ui: %w", err)
		}
	}
	if h.admin, err = worker.NewAdmin(pool, nil); err != nil {
		return nil, fmt.Errorf("ui: %w", err)
	}
	h.secret = make([]byte, 32)
	if _, err := rand.Read(h.secret); err != nil {
		return nil, fmt.Errorf("ui: %w", err)
	}
	if h.pages, err = parsePages(); err != nil {
		return nil, fmt.Errorf("ui: %w", err)
	}
	h.routes()
	return h, nil
}

// cleanPrefix is "" or "/a/b" (no trailing slash).
func cleanPrefix(p string) (string, error) {
	p = strings.TrimRight(p, "/")
	switch {
	case p == "":
		return "", nil
	case !strings.HasPrefix(p, "/"):
		return "", fmt.Errorf("ui: %w: Prefix %q must begin with a slash", ErrInvalidOptions, p)
	case strings.ContainsAny(p, "{}?#%\" <>\\"):
		return "", fmt.Errorf("ui: %w: Prefix %q may hold only plain path characters", ErrInvalidOptions, p)
	}
	return p, nil
}

func (h *handler) routes() {
	p := h.opts.Prefix
	m := http.NewServeMux()
	m.HandleFunc("GET "+p+"/{$}", h.page(h.overview))
	m.HandleFunc("GET "+p+"/instances", h.page(h.instances))
	m.HandleFunc("GET "+p+"/locks", h.page(h.locksPage))
	m.HandleFunc("GET "+p+"/failed", h.page(h.failed))
	m.HandleFunc("GET "+p+"/failed/skip", h.page(h.skipConfirm))
	m.HandleFunc("POST "+p+"/locks/release", h.action(h.forceRelease))
	m.HandleFunc("POST "+p+"/failed/retry", h.action(h.retry))
	m.HandleFunc("POST "+p+"/failed/skip", h.action(h.skip))
	if p != "" {
		m.Handle("GET "+p, http.RedirectHandler(p+"/", http.StatusMovedPermanently))
	}
	m.HandleFunc("/", h.notFound)
	h.mux = m
}

// ServeHTTP sets the security headers, checks the token and serves the request.
func (h *handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	hd := w.Header()
	// No script at all, styles only from the page itself, forms only to the dashboard.
	hd.Set("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'; img-src 'self' data:; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
	hd.Set("X-Content-Type-Options", "nosniff")
	hd.Set("X-Frame-Options", "DENY")
	hd.Set("Referrer-Policy", "same-origin")
	hd.Set("Cache-Control", "no-store")
	if !h.authorized(w, r) {
		return
	}
	h.mux.ServeHTTP(w, r)
}

func (h *handler) notFound(w http.ResponseWriter, r *http.Request) {
	h.render(w, r, http.StatusNotFound, "error", "Not found", errorPage{Message: "There is no page at " + r.URL.Path + "."})
}

// pageFunc loads a page's data; an error is shown on the page.
type pageFunc func(ctx context.Context, r *http.Request) (tmpl, title string, data any, err error)

func (h *handler) page(f pageFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), queryTimeout)
		defer cancel()
		tmpl, title, data, err := f(ctx, r)
		if err != nil {
			h.log.Error("ui: page", slog.String("path", r.URL.Path), slog.Any("error", err))
			status := http.StatusInternalServerError
			if errors.Is(err, locker.ErrInvalidArgument) {
				status = http.StatusBadRequest
			}
			h.render(w, r, status, "error", title, errorPage{Message: err.Error()})
			return
		}
		h.render(w, r, http.StatusOK, tmpl, title, data)
	}
}

// layout is what every page's frame shows around the page's own data.
type layout struct {
	Title    string
	Prefix   string
	Nav      string // the page's tab
	ReadOnly bool
	CSRF     string
	Flash    *flash
	Refresh  int // seconds between automatic reloads (0: none), from ?refresh=
	Now      time.Time
	Page     any
}

// errorPage is the page of an error; NoNav hides the navigation (before the token is given).
type errorPage struct {
	Message string
	NoNav   bool
}

func (h *handler) render(w http.ResponseWriter, r *http.Request, status int, tmpl, title string, data any) {
	t, ok := h.pages[tmpl]
	if !ok {
		http.Error(w, "ui: no template "+tmpl, http.StatusInternalServerError)
		return
	}
	l := layout{
		Title: title, Prefix: h.opts.Prefix, Nav: tmpl, ReadOnly: h.opts.ReadOnly,
		CSRF: h.csrfToken(time.Now()), Flash: h.takeFlash(w, r), Now: time.Now(), Page: data,
	}
	if status == http.StatusOK && tmpl != "skip" {
		l.Refresh = refreshOf(r)
	}
	var b strings.Builder
	if err := t.ExecuteTemplate(&b, "layout", l); err != nil {
		h.log.Error("ui: render", slog.String("template", tmpl), slog.Any("error", err))
		http.Error(w, "ui: the page could not be rendered; see the log", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(status)
	_, _ = w.Write([]byte(b.String())) // an error is the client's going away: nobody to tell
}

// action wraps a POST: read-only and CSRF checks, then f, whose outcome is a flash message
// on the page it redirects to (303).
func (h *handler) action(f func(ctx context.Context, r *http.Request) (back string, msg string, err error)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if h.opts.ReadOnly {
			h.render(w, r, http.StatusForbidden, "error", "Read-only", errorPage{Message: "This dashboard is read-only: actions are turned off."})
			return
		}
		if err := h.checkCSRF(r); err != nil {
			h.log.Warn("ui: refused action", slog.String("path", r.URL.Path), slog.String("remote", r.RemoteAddr), slog.Any("error", err))
			h.render(w, r, http.StatusForbidden, "error", "Refused", errorPage{Message: err.Error()})
			return
		}
		ctx, cancel := context.WithTimeout(r.Context(), queryTimeout)
		defer cancel()
		back, msg, err := f(ctx, r)
		fl := flash{Kind: "ok", Message: msg}
		if err != nil {
			h.log.Warn("ui: action failed", slog.String("path", r.URL.Path), slog.Any("error", err))
			fl = flash{Kind: "error", Message: err.Error()}
		} else {
			h.log.Info("ui: action", slog.String("path", r.URL.Path), slog.String("remote", r.RemoteAddr), slog.String("outcome", msg))
		}
		h.setFlash(w, fl)
		http.Redirect(w, r, h.opts.Prefix+back, http.StatusSeeOther)
	}
}
