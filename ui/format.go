package ui

import (
	"fmt"
	"html/template"
	"io/fs"
	"net/http"
	"path"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/perspectives-go/perspectives/internal/shortid"
	"github.com/perspectives-go/perspectives/worker"
)

// parsePages parses each page's template with the layout: pages[name] executes "layout".
func parsePages() (map[string]*template.Template, error) {
	base, err := template.New("").Funcs(funcs).ParseFS(templateFS, "templates/layout.html")
	if err != nil {
		return nil, err
	}
	files, err := fs.Glob(templateFS, "templates/*.html")
	if err != nil {
		return nil, err
	}
	pages := make(map[string]*template.Template, len(files))
	for _, f := range files {
		name := strings.TrimSuffix(path.Base(f), ".html")
		if name == "layout" {
			continue
		}
		t, err := template.Must(base.Clone()).ParseFS(templateFS, f)
		if err != nil {
			return nil, err
		}
		pages[name] = t
	}
	return pages, nil
}

var funcs = template.FuncMap{
	"ago":            ago,
	"duration":       duration,
	"count":          count,
	"short":          shortid.String, // the full ID goes in the element's title
	"stamp":          stamp,
	"runs":           runs,
	"pct":            func(f float64) string { return strconv.FormatFloat(f, 'f', 1, 64) },
	"rate":           rate,
	"millis":         millis,
	"plural":         plural,
	"isNil":          func(id uuid.UUID) bool { return id == uuid.Nil },
	"until":          func(now, t time.Time) string { return duration(t.Sub(now)) },
	"int64":          func(n int) int64 { return int64(n) },
	"refreshChoices": func() []int { return refreshChoices },
	"pairsOf":        func(l layout, pairs []worker.FailedPair) pairsTable { return pairsTable{L: l, Pairs: pairs} },
}

// refreshChoices are the auto-refresh periods a page offers, in seconds (0: off).
var refreshChoices = []int{0, 10, 30, 60}

// refreshOf is the request's ?refresh= when it is one of refreshChoices, else 0.
func refreshOf(r *http.Request) int {
	n, err := strconv.Atoi(r.URL.Query().Get("refresh"))
	if err != nil || !slices.Contains(refreshChoices, n) {
		return 0
	}
	return n
}

// pairsTable is what the "pairs" template renders: a table of failing pairs in a page.
type pairsTable struct {
	L     layout
	Pairs []worker.FailedPair
}

// ago is how long before now t was, in words ("3m12s ago").
func ago(now, t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	d := now.Sub(t)
	if d < 0 {
		return "just now"
	}
	return duration(d) + " ago"
}

// duration is d rounded for reading: "850ms", "12.3s", "4m05s", "3h12m", "2d4h".
func duration(d time.Duration) string {
	switch {
	case d < 0:
		return "-" + duration(-d)
	case d < time.Second:
		return d.Round(time.Millisecond).String()
	case d < time.Minute:
		return strconv.FormatFloat(d.Seconds(), 'f', 1, 64) + "s"
	case d < time.Hour:
		d = d.Round(time.Second)
		return fmt.Sprintf("%dm%02ds", int(d.Minutes()), int(d.Seconds())%60)
	case d < 48*time.Hour:
		d = d.Round(time.Minute)
		return fmt.Sprintf("%dh%02dm", int(d.Hours()), int(d.Minutes())%60)
	default:
		d = d.Round(time.Hour)
		return fmt.Sprintf("%dd%dh", int(d.Hours())/24, int(d.Hours())%24)
	}
}

// count is n with thousands separated by a thin space ("1 234 567").
func count(n int64) string {
	s := strconv.FormatInt(n, 10)
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	var b strings.Builder
	for i, r := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteRune('\u202f')
		}
		b.WriteRune(r)
	}
	if neg {
		return "-" + b.String()
	}
	return b.String()
}

// stamp is t in UTC to the second.
func stamp(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format("2006-01-02 15:04:05 UTC")
}

// runs is "orders v2, visits v1".
func runs(ps []worker.PerspectiveVersion) string {
	parts := make([]string, len(ps))
	for i, p := range ps {
		parts[i] = fmt.Sprintf("%s v%d", p.Name, p.Version)
	}
	return strings.Join(parts, ", ")
}

func plural(n int64, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}

// millis is a time in milliseconds, as the overview shows a sink's time per commit ("-":
// none).
func millis(ms float64) string {
	if ms <= 0 {
		return "-"
	}
	return measure(ms, " ms")
}

// rate is a throughput in events per second, as the overview shows it.
func rate(perSecond float64) string {
	if perSecond <= 0 {
		return "0/s"
	}
	return measure(perSecond, "/s")
}

// measure is a positive figure with its unit: one decimal below 10, else rounded to a whole
// number with thousands separators.
func measure(x float64, unit string) string {
	if x < 10 {
		return strconv.FormatFloat(x, 'f', 1, 64) + unit
	}
	return count(int64(x+0.5)) + unit
}
