package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/perspectives-go/perspectives/ui"
)

// uiTokenEnv is the environment variable --token defaults to.
const uiTokenEnv = "PERSPECTIVES_UI_TOKEN"

// uiShutdownTimeout bounds how long the dashboard waits for requests in flight at a signal.
const uiShutdownTimeout = 10 * time.Second

// runUI serves the operators' web dashboard (package ui) until SIGINT or SIGTERM.
func defineUI(fs *flag.FlagSet) runFunc {
	addr := fs.String("addr", "127.0.0.1:8080", "address to listen on (host:port); a loopback address unless a token is set")
	readOnly := fs.Bool("read-only", false, "show no action buttons and refuse every action")
	token := fs.String("token", "", "token every request needs (default: $"+uiTokenEnv+")")
	insecure := fs.Bool("insecure-listen", false, "allow a non-loopback --addr without a token (something else must guard it)")
	return func(ctx context.Context, dbURL string, stdout, stderr io.Writer) error {
		if *token == "" {
			*token = os.Getenv(uiTokenEnv)
		}
		loopback, err := isLoopback(ctx, *addr)
		if err != nil {
			return err
		}
		if !loopback && *token == "" && !*insecure {
			return fmt.Errorf("refusing to serve the dashboard on %s, which is not a loopback address, without a token: anyone who reaches it could retry, skip and force-release. "+
				"Set --token or %s, or pass --insecure-listen when something else (a proxy with authentication, a firewall) guards it", *addr, uiTokenEnv)
		}

		pool, admin, err := connectAdmin(ctx, dbURL)
		if err != nil {
			return err
		}
		defer pool.Close()
		if _, err := admin.Versions(ctx); err != nil { // a database without the schema is said so now, not on every page
			return err
		}
		log := slog.New(slog.NewTextHandler(stderr, nil))
		h, err := ui.NewHandler(pool, ui.Options{ReadOnly: *readOnly, Token: *token, Logger: log})
		if err != nil {
			return err
		}
		ln, err := (&net.ListenConfig{}).Listen(ctx, "tcp", *addr)
		if err != nil {
			return fmt.Errorf("listen: %w", err)
		}
		var handler http.Handler = h
		if *token == "" && loopback {
			handler = loopbackHostOnly(h)
		}
		srv := &http.Server{Handler: handler, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 2 * time.Minute,
			ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn)}

		mode := "read-write"
		if *readOnly {
			mode = "read-only"
		}
		fmt.Fprintf(stdout, "dashboard on http://%s/ (%s", ln.Addr(), mode)
		if *token != "" {
			fmt.Fprint(stdout, "; token required: open it once as /?token=…, or send Authorization: Bearer …")
		} else if !loopback {
			fmt.Fprint(stdout, "; NO token, on a non-loopback address (--insecure-listen)")
		}
		fmt.Fprintln(stdout, "); Ctrl-C stops it")

		served := make(chan error, 1)
		go func() { served <- srv.Serve(ln) }()
		select {
		case err := <-served:
			return fmt.Errorf("serve: %w", err)
		case <-ctx.Done():
		}
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), uiShutdownTimeout)
		defer cancel()
		err = srv.Shutdown(sctx)
		if serr := <-served; serr != nil && !errors.Is(serr, http.ErrServerClosed) {
			err = errors.Join(err, serr)
		}
		if err != nil {
			return fmt.Errorf("shut down: %w", err)
		}
		fmt.Fprintln(stdout, "dashboard stopped")
		return nil
	}
}

// loopbackHostOnly serves h only to requests whose Host names a loopback address (a
// loopback IP, or localhost): without a token, a page on another site whose name an attacker
// points at 127.0.0.1 (DNS rebinding) would otherwise be of the dashboard's origin in the
// operator's browser, read its pages and post its actions. Others get 421.
func loopbackHostOnly(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		host := r.Host
		if hp, _, err := net.SplitHostPort(host); err == nil {
			host = hp
		}
		host = strings.TrimSuffix(strings.TrimPrefix(host, "["), "]")
		ip := net.ParseIP(host)
		if !strings.EqualFold(host, "localhost") && (ip == nil || !ip.IsLoopback()) {
			http.Error(w, "this dashboard answers only at a loopback address (localhost, 127.0.0.1, [::1]); set a token to serve it under another name",
				http.StatusMisdirectedRequest)
			return
		}
		h.ServeHTTP(w, r)
	})
}

// isLoopback reports whether addr (host:port) listens on loopback addresses only: a
// loopback IP, or a name that resolves to loopback addresses only ("localhost"). An empty
// host (every interface) is not.
func isLoopback(ctx context.Context, addr string) (bool, error) {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false, fmt.Errorf("--addr %q: %v", addr, err)
	}
	if host == "" {
		return false, nil
	}
	if ip := net.ParseIP(host); ip != nil {
		return ip.IsLoopback(), nil
	}
	ips, err := net.DefaultResolver.LookupIPAddr(ctx, host)
	if err != nil {
		return false, fmt.Errorf("--addr %q: %v", addr, err)
	}
	for _, ip := range ips {
		if !ip.IP.IsLoopback() {
			return false, nil
		}
	}
	return len(ips) > 0, nil
}
