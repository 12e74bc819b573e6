package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/schollz/progressbar/v3"
	"golang.org/x/term"

	"github.com/perspectives-go/perspectives/worker"
)

// plainEvery is how often a progress that is not on a terminal prints a line.
var plainEvery = 5 * time.Second

// missingEvery is how often the missing-worker message is repeated while no worker runs
// what a command waits for.
var missingEvery = 30 * time.Second

// progress shows how many of total units are done: a progress bar on a terminal, plain
// lines every plainEvery elsewhere (a CI log, a pipe, a file).
type progress interface {
	// set records that n units are done, of total (which may grow).
	set(n, total int64)
	// say prints a line of its own, above the bar on a terminal.
	say(line string)
	// done ends the progress: the bar's last frame, or a final plain line.
	done()
}

// newProgress returns a progress bar when w is a terminal, plain lines otherwise.
func newProgress(w io.Writer, label, unit string, total int64) progress {
	if isTerminal(w) {
		return newBarProgress(w, label, unit, total)
	}
	return &plainProgress{w: w, label: label, unit: unit, total: total, every: plainEvery, start: time.Now()}
}

// isTerminal reports whether w is a terminal.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	return ok && term.IsTerminal(int(f.Fd()))
}

// barProgress is a progress bar (github.com/schollz/progressbar) with count, rate and ETA.
// It draws a frame on every set, unthrottled: the callers set it every 200 ms. Its errors are
// those of writing to the terminal, where they would be reported: they are dropped, as the
// command's own lines' are.
type barProgress struct {
	bar   *progressbar.ProgressBar
	w     io.Writer
	total int64
	ended bool
}

func newBarProgress(w io.Writer, label, unit string, total int64) *barProgress {
	bar := progressbar.NewOptions64(max(total, 1),
		progressbar.OptionSetWriter(w),
		progressbar.OptionSetDescription(label),
		progressbar.OptionSetWidth(30),
		progressbar.OptionShowCount(),
		progressbar.OptionShowIts(),
		progressbar.OptionSetItsString(unit),
		progressbar.OptionSetPredictTime(true),
		progressbar.OptionSetElapsedTime(true),
		progressbar.OptionShowElapsedTimeOnFinish(),
		progressbar.OptionSetRenderBlankState(true),
		progressbar.OptionOnCompletion(func() { fmt.Fprintln(w) }),
	)
	return &barProgress{bar: bar, w: w, total: max(total, 1)}
}

func (p *barProgress) set(n, total int64) {
	if p.ended {
		return
	}
	if total = max(total, 1); total != p.total {
		p.total = total
		p.bar.ChangeMax64(total)
	}
	_ = p.bar.Set64(min(n, p.total))
}

func (p *barProgress) say(line string) {
	if p.ended {
		fmt.Fprintln(p.w, line)
		return
	}
	// Cleared, printed above the bar, and the bar drawn again below it.
	_, _ = progressbar.Bprintln(p.bar, line)
	_ = p.bar.RenderBlank()
}

func (p *barProgress) done() {
	if p.ended {
		return
	}
	p.ended = true
	if p.bar.IsFinished() {
		return
	}
	if p.bar.State().CurrentNum >= p.total {
		_ = p.bar.Finish()
		return
	}
	_ = p.bar.Exit() // keeps the last frame; the completion prints the newline
}

// plainProgress prints "label: n/total unit (p%), rate, ETA" lines: the first at once, then
// one every plainEvery while it changes, and a final one.
type plainProgress struct {
	w       io.Writer
	label   string
	unit    string
	total   int64
	every   time.Duration // plainEvery
	start   time.Time
	n       int64
	first   int64 // n when first set: the rate counts from it
	started bool
	printed time.Time
	ended   bool
}

func (p *plainProgress) set(n, total int64) {
	if p.ended {
		return
	}
	p.n, p.total = n, total
	if !p.started {
		p.started, p.first = true, n
		p.start = time.Now()
	}
	if p.printed.IsZero() || time.Since(p.printed) >= p.every {
		p.line(false)
	}
}

func (p *plainProgress) say(line string) { fmt.Fprintln(p.w, line) }

func (p *plainProgress) done() {
	if p.ended {
		return
	}
	p.ended = true
	p.line(true)
}

// line prints the progress; final adds the elapsed time.
func (p *plainProgress) line(final bool) {
	p.printed = time.Now()
	elapsed := time.Since(p.start)
	var b strings.Builder
	fmt.Fprintf(&b, "%s: %d/%d %s", p.label, p.n, p.total, p.unit)
	if p.total > 0 {
		fmt.Fprintf(&b, " (%.0f%%)", min(100, 100*float64(p.n)/float64(p.total)))
	}
	rate := 0.0
	if s := elapsed.Seconds(); s > 0 {
		rate = float64(p.n-p.first) / s
	}
	switch {
	case final:
		fmt.Fprintf(&b, " in %s", elapsed.Round(100*time.Millisecond))
		if rate > 0 {
			fmt.Fprintf(&b, ", %.0f %s/s", rate, p.unit)
		}
	case rate > 0:
		eta := time.Duration(float64(max(p.total-p.n, 0)) / rate * float64(time.Second))
		fmt.Fprintf(&b, ", %.0f %s/s, ETA %s", rate, p.unit, eta.Round(time.Second))
	default:
		b.WriteString(", rate -, ETA -")
	}
	fmt.Fprintln(p.w, b.String())
}

// workerWatch says when no live worker instance runs a version of a perspective that a
// command waits for: at once, then every missingEvery while none does, and once when one
// does again.
type workerWatch struct {
	admin    *worker.Admin
	name     string
	versions []int
	say      func(string)

	checked time.Time // last look at the instances
	said    time.Time // last time the missing workers were named
	missing string    // what is missing ("": nothing)
	which   []int     // the versions missing
}

// workerCheckEvery is how often the watch reads the instances.
const workerCheckEvery = 2 * time.Second

// check reads the instances (at most every workerCheckEvery) and says what is missing. It
// returns what is missing now ("": every version has a live instance).
func (ww *workerWatch) check(ctx context.Context) string {
	if !ww.checked.IsZero() && time.Since(ww.checked) < workerCheckEvery {
		return ww.missing
	}
	ww.checked = time.Now()
	instances, err := ww.admin.Instances(ctx)
	if err != nil {
		return ww.missing // the wait itself reports database errors
	}
	var missing []string
	var which []int
	for _, v := range ww.versions {
		if m := missingWorker(instances, ww.name, v); m != "" {
			missing = append(missing, m)
			which = append(which, v)
		}
	}
	now := strings.Join(missing, "; ")
	switch {
	case now != "" && (!slices.Equal(which, ww.which) || time.Since(ww.said) >= missingEvery):
		ww.said = time.Now()
		ww.say(now)
	case now == "" && ww.missing != "":
		ww.say(fmt.Sprintf("a worker running %s is alive now", ww.name))
	}
	ww.missing, ww.which = now, which
	return now
}

// missingWorker names what is missing when no live instance runs version of the
// perspective name, with the instance last seen running it if any ("": one is alive).
func missingWorker(instances []worker.Instance, name string, version int) string {
	var last *worker.Instance
	for i, in := range instances {
		if !in.Runs(name, version) {
			continue
		}
		if in.Alive {
			return ""
		}
		if last == nil || in.SinceSeen < last.SinceSeen {
			last = &instances[i]
		}
	}
	seen := "no instance running it has recorded a heartbeat"
	if last != nil {
		seen = fmt.Sprintf("last seen: instance %s on host %s, %s ago", last.ID, last.Host, ago(last.SinceSeen))
	}
	return fmt.Sprintf("no running worker applies %s version %d: start one (%s)", name, version, seen)
}
