package ui_test

import (
	"context"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/ui"
	"github.com/perspectives-go/perspectives/worker"
)

func TestNewHandlerRefusesBadOptions(t *testing.T) {
	t.Parallel()
	_, err := ui.NewHandler(nil, ui.Options{})
	require.ErrorIs(t, err, ui.ErrInvalidOptions)
	for _, prefix := range []string{"admin", "/a b", "/{x}", "/a?b"} {
		_, err := ui.NewHandler(testDB.Pool, ui.Options{Prefix: prefix})
		require.ErrorIs(t, err, ui.ErrInvalidOptions, prefix)
		require.ErrorContains(t, err, "Prefix")
	}
	_, err = ui.NewHandler(testDB.Pool, ui.Options{Token: " t "})
	require.ErrorIs(t, err, ui.ErrInvalidOptions)
}

// Every page renders, under a prefix, and what the database holds (an error message, a lock
// reason) comes out escaped.
func TestPagesRenderEscaped(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	p := newParked(t, true)
	lk, err := locker.NewPostgres(testDB.Pool, locker.Options{})
	require.NoError(t, err)
	lockStream := uuid.New()
	ok, err := lk.TryAcquire(ctx, lockStream, p.name, uuid.New(), locker.Reason(hostile))
	require.NoError(t, err)
	require.True(t, ok)

	s := newServer(t, ui.Options{Prefix: "/ops/perspectives/"})
	pages := map[string][]string{
		"/":          {p.name, "Versions", "Parked pairs", "active"},
		"/instances": {"Worker instances", "alive"},
		"/locks":     {lockStream.String(), p.name, "Force release", "&lt;script&gt;"},
		"/failed":    {p.stream.String(), p.name, "parked", "Retry", "Skip", "poison refused: &lt;script&gt;"},
		"/failed/skip?" + url.Values{"stream": {p.stream.String()}, "perspective": {p.name}, "event": {p.poison().String()}}.Encode(): {
			p.poison().String(), "poison refused: &lt;script&gt;", `name="by" value="dashboard"`},
	}
	for path, want := range pages {
		r := s.get(t, path)
		require.Equal(t, http.StatusOK, r.status, "%s: %s", path, r.body)
		for _, w := range want {
			require.Contains(t, r.body, w, path)
		}
		require.NotContains(t, r.body, "<script", path)
		require.Contains(t, r.body, `href="/ops/perspectives/failed"`, "links carry the prefix")
	}
	require.Contains(t, s.get(t, "/failed?refresh=30").body, `<meta http-equiv="refresh" content="30">`, "auto-refresh")
	require.NotContains(t, s.get(t, "/failed?refresh=1").body, `http-equiv="refresh"`, "only the periods offered")
	r := s.get(t, "")
	require.Equal(t, http.StatusMovedPermanently, r.status)
	require.Equal(t, "/ops/perspectives/", r.location)
	r = s.get(t, "/nowhere")
	require.Equal(t, http.StatusNotFound, r.status)
	require.Contains(t, r.body, "There is no page at /ops/perspectives/nowhere")
}

// A POST without a CSRF token, with a wrong or forged one, or from another origin is refused
// with 403, and the pair stays parked.
func TestActionsNeedCSRFAndSameOrigin(t *testing.T) {
	t.Parallel()
	p := newParked(t, false)
	s := newServer(t, ui.Options{})
	good := s.csrf(t, "/failed")
	other := newServer(t, ui.Options{}).csrf(t, "/failed") // another process's secret
	form := func(tok string) url.Values {
		v := url.Values{"stream": {p.stream.String()}, "perspective": {p.name}}
		if tok != "" {
			v.Set("csrf", tok)
		}
		return v
	}
	cases := []struct {
		name   string
		form   url.Values
		header []string
		says   string
	}{
		{"no token", form(""), nil, "no CSRF token"},
		{"wrong token", form("1700000000.AAAA"), nil, "not valid"},
		{"another process's token", form(other), nil, "not valid"},
		{"cross-site", form(good), []string{"Sec-Fetch-Site", "cross-site", "Origin", "https://evil.example"}, "cross-origin"},
		{"other origin", form(good), []string{"Sec-Fetch-Site", "", "Origin", "https://evil.example"}, "cross-origin"},
		{"other referer", form(good), []string{"Sec-Fetch-Site", "", "Origin", "", "Referer", "https://evil.example/page"}, "cross-origin"},
	}
	for _, c := range cases {
		r := s.post(t, "/failed/retry", c.form, c.header...)
		require.Equal(t, http.StatusForbidden, r.status, c.name)
		require.Contains(t, r.body, c.says, c.name)
		fp := p.failed(t)
		require.NotNil(t, fp, c.name)
		require.True(t, fp.Parked, "%s: the pair was retried", c.name)
	}
	// The same form with the page's token is accepted: the pair is made due (no worker runs).
	r := s.post(t, "/failed/retry", form(good))
	require.Equal(t, http.StatusSeeOther, r.status, r.body)
	require.Equal(t, "/failed", r.location)
	fp := p.failed(t)
	require.NotNil(t, fp)
	require.False(t, fp.Parked, "retried: failing, due now")
	r = s.get(t, "/failed")
	require.Contains(t, r.body, "Retrying stream "+p.stream.String()+" of "+p.name+" now (1 pair made due)", "the flash message")
	require.NotContains(t, s.get(t, "/failed").body, "Retrying stream", "a flash message is shown once")
}

// With a token, every request needs it: a bearer header, or the cookie a ?token= visit sets.
func TestTokenIsRequired(t *testing.T) {
	t.Parallel()
	const token = "s3cret-token"
	s := newServer(t, ui.Options{Token: token})
	for _, path := range []string{"/", "/instances", "/locks", "/failed", "/nowhere"} {
		r := s.get(t, path)
		require.Equal(t, http.StatusUnauthorized, r.status, path)
		require.Contains(t, r.body, "needs its token", path)
		require.NotContains(t, r.body, `href="/locks"`, "no navigation before the token")
	}
	r := s.post(t, "/failed/retry", url.Values{"perspective": {"x"}})
	require.Equal(t, http.StatusUnauthorized, r.status)
	require.Equal(t, http.StatusUnauthorized, s.get(t, "/", "Authorization", "Bearer wrong").status)
	require.Equal(t, http.StatusUnauthorized, s.get(t, "/?token=wrong").status)
	require.Equal(t, http.StatusOK, s.get(t, "/locks", "Authorization", "Bearer "+token).status)

	r = s.get(t, "/locks?token="+token+"&x=1")
	require.Equal(t, http.StatusSeeOther, r.status)
	require.Equal(t, "/locks?x=1", r.location, "the token leaves the address")
	for _, path := range []string{"/", "/instances", "/locks", "/failed"} {
		require.Equal(t, http.StatusOK, s.get(t, path).status, path)
	}
	// An action with the cookie and the page's CSRF token is accepted (the page has a form
	// when a pair is parked).
	newParked(t, false)
	tok := s.csrf(t, "/failed")
	r = s.post(t, "/failed/retry", url.Values{"csrf": {tok}, "perspective": {"not_registered_" + uuid.NewString()[:8]}})
	require.Equal(t, http.StatusSeeOther, r.status)

	// A forged cookie is not the session.
	s2 := newServer(t, ui.Options{Token: token})
	u, _ := url.Parse(s2.URL)
	s2.client.Jar.SetCookies(u, []*http.Cookie{{Name: "perspectives_ui_session", Value: token}})
	require.Equal(t, http.StatusUnauthorized, s2.get(t, "/").status)
}

// Read-only: no action buttons, and every POST is refused.
func TestReadOnlyRefusesActions(t *testing.T) {
	t.Parallel()
	p := newParked(t, false)
	s := newServer(t, ui.Options{ReadOnly: true})
	for _, path := range []string{"/", "/locks", "/failed"} {
		r := s.get(t, path)
		require.Equal(t, http.StatusOK, r.status)
		require.NotContains(t, r.body, "<form", path)
		require.NotContains(t, r.body, "<button", path)
		require.Contains(t, r.body, "read-only", path)
	}
	require.Contains(t, s.get(t, "/failed").body, p.stream.String())
	rw := newServer(t, ui.Options{})
	tok := rw.csrf(t, "/failed")
	for _, path := range []string{"/failed/retry", "/failed/skip", "/locks/release"} {
		r := s.post(t, path, url.Values{"csrf": {tok}, "stream": {p.stream.String()}, "perspective": {p.name}, "event": {p.poison().String()}})
		require.Equal(t, http.StatusForbidden, r.status, path)
		require.Contains(t, r.body, "read-only", path)
	}
	fp := p.failed(t)
	require.NotNil(t, fp)
	require.True(t, fp.Parked)
}

// Retry on a parked pair with a running worker: it is tried again at once (and parks again:
// the event is still poison), its attempts go up.
func TestRetryRetriesThePair(t *testing.T) {
	t.Parallel()
	p := newParked(t, true)
	before := p.failed(t).Attempts
	s := newServer(t, ui.Options{})
	r := s.post(t, "/failed/retry", url.Values{"csrf": {s.csrf(t, "/failed")}, "stream": {p.stream.String()}, "perspective": {p.name}})
	require.Equal(t, http.StatusSeeOther, r.status)
	eventually(t, 20*time.Second, "the pair retried and parked again", func() bool {
		fp := p.failed(t)
		return fp != nil && fp.Parked && fp.Attempts > before
	})
	// Retry all of the perspective, from the overview.
	r = s.post(t, "/failed/retry", url.Values{"csrf": {s.csrf(t, "/")}, "perspective": {p.name}, "back": {"/"}})
	require.Equal(t, http.StatusSeeOther, r.status)
	require.Equal(t, "/", r.location)
	require.Contains(t, s.get(t, "/").body, "Retrying the failing pairs of "+p.name)
}

// Skip records the operator's name and lets the events after the poison one through.
func TestSkipSkipsTheEvent(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	p := newParked(t, true)
	s := newServer(t, ui.Options{})
	form := url.Values{"csrf": {s.csrf(t, "/failed")}, "stream": {p.stream.String()}, "perspective": {p.name},
		"event": {p.poison().String()}, "by": {"  ada  <b>lovelace</b> "}}
	r := s.post(t, "/failed/skip", form)
	require.Equal(t, http.StatusSeeOther, r.status)
	require.Equal(t, "/failed", r.location)
	page := s.get(t, "/failed").body
	require.Contains(t, page, "Skipped event "+p.poison().String())
	require.Contains(t, page, "ada &lt;b&gt;lovelace&lt;/b&gt;", "the operator, escaped")

	skipped, err := p.admin.Skipped(ctx, p.name, worker.MaxListed)
	require.NoError(t, err)
	require.Len(t, skipped, 1)
	require.Equal(t, p.poison(), skipped[0].Event)
	require.Equal(t, "ada <b>lovelace</b>", skipped[0].By)
	require.False(t, skipped[0].ByPolicy)
	eventually(t, 20*time.Second, "the events after the skipped one applied", func() bool {
		raw, ok, err := worker.LoadModel(ctx, testDB.Pool, p.name, p.stream)
		return err == nil && ok && strings.Contains(string(raw), `"ok": 2`)
	})
	require.Nil(t, p.failed(t), "no longer failing")

	// With no name given, the skip is the dashboard's; an event that is not queued is the
	// Admin's error, shown on the page (not a 500).
	r = s.post(t, "/failed/skip", url.Values{"csrf": {form.Get("csrf")}, "stream": {p.stream.String()}, "perspective": {p.name}, "event": {uuid.NewString()}})
	require.Equal(t, http.StatusSeeOther, r.status)
	page = s.get(t, "/failed").body
	require.Contains(t, page, `class="flash error"`)
	require.Contains(t, page, "is neither queued for stream")
	r = s.post(t, "/failed/skip", url.Values{"csrf": {form.Get("csrf")}, "stream": {"not-a-uuid"}, "perspective": {p.name}, "event": {uuid.NewString()}})
	require.Equal(t, http.StatusSeeOther, r.status)
	require.Contains(t, s.get(t, "/failed").body, "stream &#34;not-a-uuid&#34; is not a UUID")
}

// The operator's name defaults to "dashboard".
func TestSkipByDefaultsToDashboard(t *testing.T) {
	t.Parallel()
	p := newParked(t, false)
	s := newServer(t, ui.Options{})
	r := s.post(t, "/failed/skip", url.Values{"csrf": {s.csrf(t, "/failed")}, "stream": {p.stream.String()}, "perspective": {p.name}, "event": {p.poison().String()}, "by": {"   "}})
	require.Equal(t, http.StatusSeeOther, r.status)
	skipped, err := p.admin.Skipped(context.Background(), p.name, worker.MaxListed)
	require.NoError(t, err)
	require.Len(t, skipped, 1)
	require.Equal(t, ui.DefaultOperator, skipped[0].By)
}

// Force release clears the lock the page shows, which another instance holds; not one that
// another instance has taken since, and nothing on bad input.
func TestForceReleaseClearsTheLock(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	lk, err := locker.NewPostgres(testDB.Pool, locker.Options{})
	require.NoError(t, err)
	stream, name := uuid.New(), uniqueName("lock")
	holder := uuid.New()
	ok, err := lk.TryAcquire(ctx, stream, name, holder, locker.ReasonRewind)
	require.NoError(t, err)
	require.True(t, ok)

	s := newServer(t, ui.Options{Locker: lk})
	tok := s.csrf(t, "/locks")
	require.Contains(t, s.get(t, "/locks").body, `name="instance" value="`+holder.String()+`"`, "the form names the holder shown")
	release := func(instance string) response {
		t.Helper()
		return s.post(t, "/locks/release", url.Values{"csrf": {tok}, "stream": {stream.String()}, "perspective": {name}, "instance": {instance}})
	}
	for _, bad := range []string{"", "nope", uuid.Nil.String()} {
		r := release(bad)
		require.Equal(t, http.StatusSeeOther, r.status, bad)
		_, held, err := lk.Get(ctx, stream, name)
		require.NoError(t, err)
		require.True(t, held, "bad input %q releases nothing", bad)
	}
	require.Contains(t, s.get(t, "/locks").body, "is not an instance ID")

	// Shown as held by holder; taken over by another instance before the click.
	other := uuid.New()
	r := release(other.String())
	require.Equal(t, http.StatusSeeOther, r.status)
	l, held, err := lk.Get(ctx, stream, name)
	require.NoError(t, err)
	require.True(t, held && l.InstanceID == holder, "another instance's lock is left alone")
	require.Contains(t, s.get(t, "/locks").body, "Nothing released")

	r = release(holder.String())
	require.Equal(t, http.StatusSeeOther, r.status)
	require.Equal(t, "/locks", r.location)
	_, held, err = lk.Get(ctx, stream, name)
	require.NoError(t, err)
	require.False(t, held, "the lock is released")
	page := s.get(t, "/locks").body
	require.Contains(t, page, "Released the stream lock of instance "+holder.String()+" on "+name)
	require.NotContains(t, page, stream.String()+"</span>", "no longer listed")

	r = release(holder.String())
	require.Equal(t, http.StatusSeeOther, r.status)
	require.Contains(t, s.get(t, "/locks").body, "holds no lock on "+name)
}

// The overview shows each version's throughput: the rates its live instances reported with
// their last heartbeat.
func TestOverviewShowsThroughput(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	p := newParked(t, false)
	_, err := testDB.Pool.Exec(ctx, `
		INSERT INTO wh_instances (instance_id, host, pid, heartbeat_interval, perspectives, versions, rates, sink_ms)
		VALUES ($1, 'rate-host', 1, interval '1 hour', ARRAY[$2::text], ARRAY[1], ARRAY[1234.4::float8], ARRAY[2.46::float8])`, uuid.New(), p.name)
	require.NoError(t, err)
	s := newServer(t, ui.Options{})
	body := s.get(t, "/").body
	require.Contains(t, body, ">Throughput<")
	require.Contains(t, body, "1\u202f234/s")
	require.Contains(t, body, ">Sink<")
	require.Contains(t, body, "2.5 ms", "the sink's time per commit")
}

// Mounted under a prefix with a token, the dashboard opened at the prefix itself (no
// trailing slash) with ?token= sets a cookie that the page it redirects to sends back.
func TestTokenAtThePrefixWithoutASlash(t *testing.T) {
	t.Parallel()
	s := newServer(t, ui.Options{Token: "prefix-token", Prefix: "/ops"})
	r := s.get(t, "?token=prefix-token")
	require.Equal(t, http.StatusSeeOther, r.status)
	require.Equal(t, "/ops", r.location)
	require.Equal(t, http.StatusMovedPermanently, s.get(t, "").status, "the cookie is sent at the prefix: on to its page")
	require.Equal(t, http.StatusOK, s.get(t, "/").status)
}
