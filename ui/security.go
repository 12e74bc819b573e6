package ui

import (
	"crypto/hmac"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"
)

const (
	sessionCookie = "perspectives_ui_session"
	flashCookie   = "perspectives_ui_flash"
	csrfField     = "csrf"
	// csrfLifetime is how long a page's CSRF token stays good (a page left open overnight
	// must be reloaded before its buttons work).
	csrfLifetime = 12 * time.Hour
	maxFormBytes = 64 << 10
)

// authorized reports whether the request may proceed; when not, it has answered it. With a
// token configured, a request needs it as a bearer header or the session cookie; a GET with
// a good ?token= sets the cookie and redirects to the same URL without the token (so it does
// not stay in the address bar or the history).
func (h *handler) authorized(w http.ResponseWriter, r *http.Request) bool {
	if h.opts.Token == "" {
		return true
	}
	if auth := r.Header.Get("Authorization"); auth != "" {
		scheme, tok, _ := strings.Cut(auth, " ")
		if strings.EqualFold(scheme, "Bearer") && h.tokenMatches(strings.TrimSpace(tok)) {
			return true
		}
		h.refuseToken(w, r, "the Authorization header does not carry the dashboard's token")
		return false
	}
	if q := r.URL.Query(); q.Has("token") {
		if !h.tokenMatches(q.Get("token")) {
			h.refuseToken(w, r, "the token in the address is not the dashboard's token")
			return false
		}
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			return true
		}
		http.SetCookie(w, &http.Cookie{
			Name: sessionCookie, Value: h.sessionValue(), Path: h.cookiePath(),
			HttpOnly: true, Secure: r.TLS != nil, SameSite: http.SameSiteLaxMode,
		})
		q.Del("token")
		u := *r.URL
		u.RawQuery = q.Encode()
		http.Redirect(w, r, u.RequestURI(), http.StatusSeeOther)
		return false
	}
	if c, err := r.Cookie(sessionCookie); err == nil {
		if subtle.ConstantTimeCompare([]byte(c.Value), []byte(h.sessionValue())) == 1 {
			return true
		}
	}
	h.refuseToken(w, r, "")
	return false
}

// tokenMatches compares in constant time (of the token's length too: both sides hashed).
func (h *handler) tokenMatches(tok string) bool {
	a, b := sha256.Sum256([]byte(tok)), sha256.Sum256([]byte(h.opts.Token))
	return tok != "" && subtle.ConstantTimeCompare(a[:], b[:]) == 1
}

// sessionValue is the session cookie's value: derived from the token (so it stays good
// across restarts of the dashboard), not the token itself.
func (h *handler) sessionValue() string {
	m := hmac.New(sha256.New, []byte(h.opts.Token))
	m.Write([]byte("perspectives-ui session"))
	return base64.RawURLEncoding.EncodeToString(m.Sum(nil))
}

func (h *handler) refuseToken(w http.ResponseWriter, r *http.Request, why string) {
	msg := "This dashboard needs its token: open it once as " + h.opts.Prefix + "/?token=… (a cookie keeps it), or send the header Authorization: Bearer …."
	if why != "" {
		msg = "Refused: " + why + ". " + msg
	}
	w.Header().Set("WWW-Authenticate", `Bearer realm="perspectives"`)
	h.render(w, r, http.StatusUnauthorized, "error", "Token required", errorPage{Message: msg, NoNav: true})
}

// csrfToken is a token for the forms of a page rendered at now: the time and an HMAC of it
// under the process's secret.
func (h *handler) csrfToken(now time.Time) string {
	ts := strconv.FormatInt(now.Unix(), 10)
	return ts + "." + h.sign("csrf|"+ts)
}

func (h *handler) sign(s string) string {
	m := hmac.New(sha256.New, h.secret)
	m.Write([]byte(s))
	return base64.RawURLEncoding.EncodeToString(m.Sum(nil))
}

// checkCSRF refuses a POST from another origin (Sec-Fetch-Site, Origin, else Referer) or
// without a good CSRF token of this process.
func (h *handler) checkCSRF(r *http.Request) error {
	if err := h.origin.Check(r); err != nil {
		return errors.New("cross-origin request refused")
	}
	if r.Header.Get("Origin") == "" && r.Header.Get("Sec-Fetch-Site") == "" {
		if ref := r.Header.Get("Referer"); ref != "" {
			u, err := url.Parse(ref)
			if err != nil || u.Host != r.Host {
				return errors.New("cross-origin request refused (Referer)")
			}
		}
	}
	r.Body = http.MaxBytesReader(nil, r.Body, maxFormBytes)
	if err := r.ParseForm(); err != nil {
		return fmt.Errorf("bad form: %v", err)
	}
	tok := r.PostForm.Get(csrfField)
	ts, mac, ok := strings.Cut(tok, ".")
	if tok == "" || !ok {
		return errors.New("the form has no CSRF token: reload the page and try again")
	}
	sec, err := strconv.ParseInt(ts, 10, 64)
	if err != nil || !hmac.Equal([]byte(mac), []byte(h.sign("csrf|"+ts))) {
		return errors.New("the form's CSRF token is not valid (the dashboard may have restarted): reload the page and try again")
	}
	if age := time.Since(time.Unix(sec, 0)); age > csrfLifetime || age < -time.Minute {
		return errors.New("the form's CSRF token has expired: reload the page and try again")
	}
	return nil
}

// flash is the outcome of an action, shown once on the page it redirects to.
type flash struct {
	Kind    string `json:"k"` // "ok" or "error"
	Message string `json:"m"`
}

func (h *handler) setFlash(w http.ResponseWriter, f flash) {
	b, _ := json.Marshal(f) // two strings: it cannot fail
	payload := base64.RawURLEncoding.EncodeToString(b)
	http.SetCookie(w, &http.Cookie{
		Name: flashCookie, Value: payload + "." + h.sign("flash|"+payload), Path: h.cookiePath(),
		MaxAge: 120, HttpOnly: true, SameSite: http.SameSiteLaxMode,
	})
}

// takeFlash returns the flash message the request carries (signed by this process) and
// clears it.
func (h *handler) takeFlash(w http.ResponseWriter, r *http.Request) *flash {
	c, err := r.Cookie(flashCookie)
	if err != nil {
		return nil
	}
	http.SetCookie(w, &http.Cookie{Name: flashCookie, Value: "", Path: h.cookiePath(), MaxAge: -1, HttpOnly: true, SameSite: http.SameSiteLaxMode})
	payload, mac, ok := strings.Cut(c.Value, ".")
	if !ok || !hmac.Equal([]byte(mac), []byte(h.sign("flash|"+payload))) {
		return nil
	}
	b, err := base64.RawURLEncoding.DecodeString(payload)
	if err != nil {
		return nil
	}
	var f flash
	if json.Unmarshal(b, &f) != nil || f.Message == "" {
		return nil
	}
	return &f
}

// cookiePath is the path of the dashboard's cookies: its prefix, which covers the prefix
// itself and every path below it ("/" at the root).
func (h *handler) cookiePath() string {
	if h.opts.Prefix == "" {
		return "/"
	}
	return h.opts.Prefix
}
