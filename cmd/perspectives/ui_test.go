package main

import (
	"bufio"
	"context"
	"io"
	"net/http"
	"regexp"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A non-loopback address needs a token, or --insecure-listen; nothing is served then.
func TestUIRefusesNonLoopbackWithoutToken(t *testing.T) {
	t.Setenv(uiTokenEnv, "")
	for _, addr := range []string{"0.0.0.0:0", ":0", "192.0.2.1:8080"} {
		code, stdout, stderr := cli(t, "ui", "--addr", addr, "--database-url", testDB.URL)
		require.Equal(t, 1, code, addr)
		require.Contains(t, stderr, "not a loopback address, without a token", addr)
		require.Contains(t, stderr, "--insecure-listen", addr)
		require.Empty(t, stdout, addr)
	}
	for _, addr := range []string{"127.0.0.1:0", "[::1]:0", "localhost:0"} {
		ok, err := isLoopback(context.Background(), addr)
		require.NoError(t, err)
		require.True(t, ok, addr)
	}
}

// ui serves the dashboard (with the token from the environment) until its context ends,
// then shuts down and exits 0.
func TestUIServesUntilStopped(t *testing.T) {
	t.Setenv(uiTokenEnv, "cli-token")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	lines, done := serveUI(t, ctx, "--read-only")
	first := lines.Text()
	require.Contains(t, first, "read-only; token required")
	m := regexp.MustCompile(`http://(127\.0\.0\.1:\d+)/`).FindStringSubmatch(first)
	require.NotNil(t, m, first)
	base := "http://" + m[1]

	res, err := http.Get(base + "/")
	require.NoError(t, err)
	_ = res.Body.Close()
	require.Equal(t, http.StatusUnauthorized, res.StatusCode, "the token from the environment is required")
	req, err := http.NewRequest(http.MethodGet, base+"/failed", nil)
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer cli-token")
	res, err = http.DefaultClient.Do(req)
	require.NoError(t, err)
	_ = res.Body.Close()
	require.Equal(t, http.StatusOK, res.StatusCode)

	cancel() // as SIGINT does: main's signal context
	go func() {
		for lines.Scan() {
			if lines.Text() == "dashboard stopped" {
				return
			}
		}
	}()
	select {
	case code := <-done:
		require.Equal(t, 0, code)
	case <-time.After(20 * time.Second):
		t.Fatal("ui did not stop")
	}
	http.DefaultClient.CloseIdleConnections()
}

// Without a token, on a loopback address, the dashboard answers only requests that name a
// loopback host: a page of another site whose name resolves to 127.0.0.1 (DNS rebinding)
// gets 421, and so cannot read its pages or post its actions.
func TestUIWithoutTokenAnswersLoopbackHostsOnly(t *testing.T) {
	t.Setenv(uiTokenEnv, "")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	lines, done := serveUI(t, ctx)
	m := regexp.MustCompile(`http://127\.0\.0\.1:(\d+)/`).FindStringSubmatch(lines.Text())
	require.NotNil(t, m, lines.Text())
	go func() {
		for lines.Scan() {
		}
	}()
	for _, tc := range []struct {
		host string
		want int
	}{
		{"127.0.0.1:" + m[1], http.StatusOK},
		{"localhost:" + m[1], http.StatusOK},
		{"[::1]:" + m[1], http.StatusOK},
		{"rebind.attacker.example:" + m[1], http.StatusMisdirectedRequest},
		{"10.0.0.1:" + m[1], http.StatusMisdirectedRequest},
	} {
		req, err := http.NewRequest(http.MethodGet, "http://127.0.0.1:"+m[1]+"/failed", nil)
		require.NoError(t, err)
		req.Host = tc.host
		res, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		_ = res.Body.Close()
		require.Equal(t, tc.want, res.StatusCode, tc.host)
	}
	cancel()
	select {
	case code := <-done:
		require.Equal(t, 0, code)
	case <-time.After(20 * time.Second):
		t.Fatal("ui did not stop")
	}
	http.DefaultClient.CloseIdleConnections()
}

// serveUI runs perspectives ui on 127.0.0.1, a free port and testDB, with more flags, until
// ctx ends: its stdout's lines, scanned up to the first (where it listens), and its exit
// code once it has returned.
func serveUI(t *testing.T, ctx context.Context, more ...string) (*bufio.Scanner, <-chan int) {
	t.Helper()
	pr, pw := io.Pipe()
	done := make(chan int, 1)
	go func() {
		code := run(ctx, append([]string{"ui", "--addr", "127.0.0.1:0", "--database-url", testDB.URL}, more...), pw, io.Discard)
		_ = pw.Close()
		done <- code
	}()
	lines := bufio.NewScanner(pr)
	require.True(t, lines.Scan(), "the first line says where it listens")
	return lines, done
}
