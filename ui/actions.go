package ui

import (
	"context"
	"fmt"
	"net/http"
	"strings"

	"github.com/google/uuid"

	"github.com/perspectives-go/perspectives/locker"
)

// DefaultOperator is who a skip is recorded as when the form names no one.
const DefaultOperator = "dashboard"

// maxOperatorLength bounds the operator's name a skip records.
const maxOperatorLength = 100

// backTo is the page an action returns to: the form's "back" when it is one of the
// dashboard's pages, else def.
func backTo(r *http.Request, def string) string {
	switch b := r.PostForm.Get("back"); b {
	case "/", "/failed", "/locks":
		return b
	}
	return def
}

// forceRelease clears the stream lock the page showed: the one the form's instance holds.
// A lock that another instance has taken since (the shown one lapsed, say) is left alone.
func (h *handler) forceRelease(ctx context.Context, r *http.Request) (string, string, error) {
	stream, key, _, err := pairArgs(r.PostForm.Get("stream"), r.PostForm.Get("perspective"), "", false)
	if err != nil {
		return "/locks", "", err
	}
	holder, err := uuid.Parse(r.PostForm.Get("instance"))
	if err != nil || holder == uuid.Nil {
		return "/locks", "", fmt.Errorf("%w: instance %q is not an instance ID", locker.ErrInvalidArgument, r.PostForm.Get("instance"))
	}
	before, held, err := h.locks.Get(ctx, stream, key)
	if err != nil {
		return "/locks", "", err
	}
	if !held || before.InstanceID != holder {
		return "/locks", fmt.Sprintf("Instance %s holds no lock on %s of stream %s any more: it was released or expired meanwhile, or another instance holds it now. Nothing released.", holder, key, stream), nil
	}
	// Release is the holder's: it clears the lock only while that instance holds it.
	if err := h.locks.Release(ctx, stream, key, holder); err != nil {
		return "/locks", "", err
	}
	return "/locks", fmt.Sprintf("Released the stream lock of instance %s on %s of stream %s.", holder, key, stream), nil
}

// retry makes a failing or parked pair due now, or every one of a perspective when the
// form names no stream.
func (h *handler) retry(ctx context.Context, r *http.Request) (string, string, error) {
	back := backTo(r, "/failed")
	name := r.PostForm.Get("perspective")
	stream := uuid.Nil
	if s := r.PostForm.Get("stream"); s != "" {
		var err error
		if stream, name, _, err = pairArgs(s, name, "", false); err != nil {
			return back, "", err
		}
	}
	n, err := h.admin.Retry(ctx, stream, name)
	if err != nil {
		return back, "", err
	}
	what := fmt.Sprintf("the failing pairs of %s", name)
	if stream != uuid.Nil {
		what = fmt.Sprintf("stream %s of %s", stream, name)
	}
	if n == 0 {
		return back, fmt.Sprintf("Nothing to retry: %s are not failing (any more).", what), nil
	}
	return back, fmt.Sprintf("Retrying %s now (%d %s made due); running workers pick it up at once.", what, n, plural(int64(n), "pair", "pairs")), nil
}

// skip skips an event of a pair, recorded as skipped by the form's operator.
func (h *handler) skip(ctx context.Context, r *http.Request) (string, string, error) {
	f := r.PostForm
	stream, name, event, err := pairArgs(f.Get("stream"), f.Get("perspective"), f.Get("event"), true)
	if err != nil {
		return "/failed", "", err
	}
	by := strings.Join(strings.Fields(f.Get("by")), " ")
	if by == "" {
		by = DefaultOperator
	}
	if n := len([]rune(by)); n > maxOperatorLength {
		return "/failed", "", fmt.Errorf("%w: the operator's name is %d characters, more than %d", locker.ErrInvalidArgument, n, maxOperatorLength)
	}
	versions, err := h.admin.Skip(ctx, stream, name, event, by)
	if err != nil {
		return "/failed", "", err
	}
	vs := make([]string, len(versions))
	for i, v := range versions {
		vs[i] = fmt.Sprint(v)
	}
	return "/failed", fmt.Sprintf("Skipped event %s of stream %s for %s (%s %s), recorded as skipped by %s; the events after it are applied now.",
		event, stream, name, plural(int64(len(vs)), "version", "versions"), strings.Join(vs, ", "), by), nil
}
