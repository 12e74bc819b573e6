package ui_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/ui"
)

// chromium is the path of a headless Chromium, from scripts/chromium.sh (which installs
// Debian's when it is missing). Without one the test fails, saying why: it is not skipped.
func chromium(t *testing.T) string {
	t.Helper()
	_, file, _, _ := runtime.Caller(0)
	script := filepath.Join(filepath.Dir(file), "..", "scripts", "chromium.sh")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", script)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("the browser test needs Chromium and scripts/chromium.sh could not provide it: %v\n%s", err, stderr.String())
	}
	return strings.TrimSpace(string(out))
}

// screenshotDir is $PERSPECTIVES_UI_SCREENSHOTS, else a temporary directory of the test.
func screenshotDir(t *testing.T) string {
	if d := os.Getenv("PERSPECTIVES_UI_SCREENSHOTS"); d != "" {
		require.NoError(t, os.MkdirAll(d, 0o755))
		return d
	}
	return t.TempDir()
}

// The dashboard in headless Chromium: the token visit sets the cookie, every page renders
// (hostile text shown as text, no script on the page), and clicking Retry on a parked pair
// makes the worker retry it (its attempts go up in the database).
func TestBrowserRetryParkedPair(t *testing.T) {
	start := time.Now()
	bin := chromium(t)
	dir := screenshotDir(t)
	ctx := context.Background()

	p := newParked(t, true)
	other := newParked(t, false) // its poison event skipped by an operator, listed as skipped
	_, err := other.admin.Skip(ctx, other.stream, other.name, other.poison(), "ops-alice")
	require.NoError(t, err)
	lk, err := locker.NewPostgres(testDB.Pool, locker.Options{})
	require.NoError(t, err)
	// A lock on another stream: a locked pair is not applied, and p must be retried.
	ok, err := lk.TryAcquire(ctx, uuid.New(), p.name, uuid.New(), locker.Reason("rewind "+hostile))
	require.NoError(t, err)
	require.True(t, ok)
	before := p.failed(t).Attempts
	t.Logf("%s: set up", time.Since(start))

	const token = "browser-test-token"
	s := newServer(t, ui.Options{Token: token, Prefix: "/dash"})
	base := s.URL + "/dash"

	actx, cancelAlloc := chromedp.NewExecAllocator(ctx, append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(bin), chromedp.NoSandbox, chromedp.DisableGPU, chromedp.WindowSize(1440, 900))...)
	defer cancelAlloc()
	bctx, cancelBrowser := chromedp.NewContext(actx)
	defer cancelBrowser()
	bctx, cancelTimeout := context.WithTimeout(bctx, 60*time.Second)
	defer cancelTimeout()

	shot := func(name string) {
		t.Helper()
		png, err := chromedp.Run(bctx, chromedp.FullScreenshot(100))
		require.NoError(t, err, "screenshot %s", name)
		require.NoError(t, os.WriteFile(filepath.Join(dir, name+".png"), png, 0o644))
		t.Logf("%s: screenshot %s", time.Since(start), name)
	}
	text := func(sel string) string {
		t.Helper()
		s, err := chromedp.Run(bctx, chromedp.Text(chromedp.CSS(sel)))
		require.NoError(t, err, "text of %s", sel)
		return s
	}
	location := func() string {
		t.Helper()
		u, err := chromedp.Run(bctx, chromedp.Location())
		require.NoError(t, err)
		return u
	}

	require.NoError(t, chromedp.Do(bctx,
		chromedp.Navigate(base+"/?token="+token),
		chromedp.WaitVisible(chromedp.CSS("main h1")),
	), "open the dashboard with its token")
	require.Equal(t, base+"/", location(), "the token leaves the address")
	require.Equal(t, "Perspectives", text("main h1"))

	for _, page := range []struct{ path, name, want string }{
		{"/", "overview", p.name},
		{"/instances", "instances", "alive"},
		{"/locks", "locks", "rewind " + hostile},
		{"/failed", "failed", "poison refused: " + hostile},
	} {
		require.NoError(t, chromedp.Do(bctx,
			chromedp.Navigate(base+page.path),
			chromedp.WaitVisible(chromedp.CSS("main h1")),
		), page.path)
		require.Contains(t, text("main"), page.want, "%s shows its data, hostile text as text", page.path)
		scripts, err := chromedp.Run(bctx, chromedp.Evaluate[int](`document.querySelectorAll("script").length`))
		require.NoError(t, err)
		require.Zero(t, scripts, "%s: no script element", page.path)
		shot(page.name)
	}
	require.Contains(t, text("main"), "ops-alice", "the skipped event is listed")

	require.NoError(t, chromedp.Do(bctx,
		chromedp.Click(chromedp.CSS(`button[data-action="retry"][data-stream="`+p.stream.String()+`"]`)),
		chromedp.WaitVisible(chromedp.CSS(".flash.ok")),
	), "click Retry")
	require.Equal(t, base+"/failed", location())
	require.Contains(t, text(".flash.ok"), "Retrying stream "+p.stream.String())
	shot("failed-after-retry")
	eventually(t, 20*time.Second, "the worker retried the pair", func() bool {
		fp := p.failed(t)
		return fp != nil && fp.Attempts > before
	})

	// The skip confirmation page, as an operator reaches it.
	require.NoError(t, chromedp.Do(bctx,
		chromedp.Click(chromedp.CSS(`a[data-action="skip"][data-stream="`+p.stream.String()+`"]`)),
		chromedp.WaitVisible(chromedp.CSS(`button[data-action="confirm-skip"]`)),
	), "open the skip confirmation")
	shot("skip-confirm")
	require.NoError(t, chromedp.Cancel(bctx))
	t.Logf("%s: browser closed", time.Since(start))
	t.Logf("screenshots in %s", dir)
}
