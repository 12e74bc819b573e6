package worker

// Internal tests of the loop's state (schedule): one owner, nothing kept after it is over.

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
)

const contendedMsg = "stream lock contended for longer than LockTimeout"

func newTestSchedule(window time.Duration) (*schedule, *bytes.Buffer) {
	var logs bytes.Buffer
	return newSchedule(window, slog.New(slog.NewTextHandler(&logs, nil)), func(p Pair, more ...any) []any {
		return append([]any{slog.String("stream", p.Stream.String())}, more...)
	}), &logs
}

func rewindOf(p Pair) job { return job{kind: jobRewind, pairs: []Pair{p}} }

// A contended pair is forgotten once its lock is taken, and a contention seen again much
// later is a new one: it is not reported as lasting since the first.
func TestScheduleContentionEndsWhenTheLockIsTakenOrGoesQuiet(t *testing.T) {
	s, logs := newTestSchedule(30 * time.Second)
	a, b := Pair{Stream: uuid.New(), Perspective: "p"}, Pair{Stream: uuid.New(), Perspective: "p"}
	t0 := time.Now()

	ra := rewindOf(a)
	s.started(&ra)
	s.finish(jobResult{job: rewindOf(a), contended: []Pair{a}}, t0)
	require.Len(t, s.contended, 1)
	s.started(&ra)
	s.finish(jobResult{job: rewindOf(a)}, t0.Add(time.Second)) // acquired
	require.Empty(t, s.contended, "a taken lock ends the contention")

	// b: refused, then nothing for longer than a lease, then refused again.
	s.finish(jobResult{job: rewindOf(b), contended: []Pair{b}}, t0)
	s.finish(jobResult{job: job{kind: jobApply, pairs: []Pair{a}}}, t0.Add(31*time.Second))
	require.Empty(t, s.contended, "a contention not seen for a whole LockTimeout is dropped (no entry per pair forever)")
	s.finish(jobResult{job: rewindOf(b), contended: []Pair{b}}, t0.Add(10*time.Minute))
	require.NotContains(t, logs.String(), contendedMsg, "a contention seen again much later is new, not 10 minutes long")
	require.Equal(t, t0.Add(10*time.Minute), s.contended[b].first)
	require.Empty(t, s.inflight, "finished pairs leave the flight")
}

// A pair refused again and again for longer than LockTimeout is warned of, once.
func TestScheduleWarnsOnceOfLongContention(t *testing.T) {
	s, logs := newTestSchedule(30 * time.Second)
	a := Pair{Stream: uuid.New(), Perspective: "p"}
	t0 := time.Now()
	for i := range 8 { // every 10 s for 70 s
		s.finish(jobResult{job: rewindOf(a), contended: []Pair{a}}, t0.Add(time.Duration(i)*10*time.Second))
	}
	require.Equal(t, 1, strings.Count(logs.String(), contendedMsg), logs.String())
	require.Contains(t, logs.String(), "duration=40s", "warned when it first exceeded LockTimeout")
}

// Follow-ups keep their pairs in flight until they run and end; busy pairs are skipped by
// the next claim only.
func TestScheduleFollowUpsAndOneClaimSkips(t *testing.T) {
	s, _ := newTestSchedule(30 * time.Second)
	a, b, c := Pair{Stream: uuid.New(), Perspective: "p"}, Pair{Stream: uuid.New(), Perspective: "p"}, Pair{Stream: uuid.New(), Perspective: "p"}
	group := job{kind: jobApply, pairs: []Pair{a, b, c}}
	s.started(&group)
	s.finish(jobResult{job: group, next: []job{rewindOf(a)}, busy: []Pair{c}}, time.Now())
	require.Equal(t, map[Pair]bool{a: true}, s.inflight, "a waits for its rewind; b and c are done")
	inflight, skip := s.claimSkips()
	require.Equal(t, map[Pair]time.Time{a: {}}, inflight, "in flight (claimed at no known position)")
	require.Equal(t, []Pair{c}, skip, "busy, for one claim")
	inflight, skip = s.claimSkips()
	require.Equal(t, map[Pair]time.Time{a: {}}, inflight)
	require.Empty(t, skip, "the busy skip lasts one claim")
	j, ok := s.popPending(time.Now())
	require.True(t, ok)
	require.Equal(t, rewindOf(a), j)
	_, ok = s.popPending(time.Now())
	require.False(t, ok)
	s.finish(jobResult{job: j}, time.Now())
	require.Empty(t, s.inflight)
}

func TestSplitGroups(t *testing.T) {
	pairs := make([]Pair, 7)
	for i := range pairs {
		pairs[i] = Pair{Stream: uuid.New(), Perspective: "p"}
	}
	require.Nil(t, splitGroups(nil, 3))
	got := splitGroups(pairs, 3)
	require.Len(t, got, 3)
	require.Equal(t, [][]Pair{pairs[0:3], pairs[3:6], pairs[6:7]}, got)
	require.Len(t, splitGroups(pairs[:2], 4), 2, "never more groups than pairs")
}

// A pair whose work is cut off by a lost connection cutOffLimit times in a row (while the
// database answers claims) is strict in its next job: the next cut-off counts as its failure.
// Any job of the pair that is not cut off starts the count again.
func TestScheduleStrictAfterRepeatedCutOffs(t *testing.T) {
	s, _ := newTestSchedule(30 * time.Second)
	a, b := Pair{Stream: uuid.New(), Perspective: "p"}, Pair{Stream: uuid.New(), Perspective: "p"}
	run := func(cut ...Pair) job {
		j := job{kind: jobApply, pairs: []Pair{a, b}}
		s.started(&j)
		s.finish(jobResult{job: j, cutOff: cut}, time.Now())
		return j
	}
	for range cutOffLimit {
		j := run(a, b)
		require.Empty(t, j.cutOffFails, "not yet")
	}
	run(a) // b's job went through: b starts again; a is cut off once more
	j := job{kind: jobApply, pairs: []Pair{a, b}}
	s.started(&j)
	require.Equal(t, map[Pair]bool{a: true}, j.cutOffFails)
	s.finish(jobResult{job: j}, time.Now()) // a went through
	require.Empty(t, s.cutOff, "the counts end with a job that was not cut off")
}

// A follow-up with a later notBefore (a paced catch-up page) waits without a slot: jobs due
// now are served before it, and the loop learns when it becomes due.
func TestSchedulePendingWaitsUntilDue(t *testing.T) {
	s, _ := newTestSchedule(30 * time.Second)
	now := time.Now()
	s.queueBuildJob(job{kind: jobCatchUp, key: "b@v2.1", notBefore: now.Add(3 * time.Second)})
	s.queueBuildJob(job{kind: jobCleanup})
	j, ok := s.popPending(now)
	require.True(t, ok)
	require.Equal(t, jobCleanup, j.kind, "the job due now first")
	_, ok = s.popPending(now)
	require.False(t, ok, "the paced page is not due yet")
	require.Equal(t, 3*time.Second, s.nextDue(now))
	j, ok = s.popPending(now.Add(3 * time.Second))
	require.True(t, ok)
	require.Equal(t, "b@v2.1", j.key)
	require.Zero(t, s.nextDue(now))
}

// A claim starts at the last one's Next, and at the oldest row once every interval; a full
// claim that passed nothing leaves no start.
func TestScheduleClaimStartsWhereTheLastClaimBegan(t *testing.T) {
	s, _ := newTestSchedule(time.Second)
	t0 := time.Now()
	const every = time.Second
	pos := func(sec int) QueuePosition {
		return QueuePosition{At: t0.Add(time.Duration(sec) * time.Second), Stream: uuid.New()}
	}

	from, full := s.claimFrom(t0, every)
	require.True(t, full, "the first claim starts at the oldest row")
	require.Equal(t, QueuePosition{}, from)
	first := pos(1)
	s.claimed(Claimed{Next: first}, full, t0)

	from, full = s.claimFrom(t0.Add(100*time.Millisecond), every)
	require.False(t, full)
	require.Equal(t, first, from, "the next claim starts at the last one's Next")
	s.claimed(Claimed{}, full, t0) // passed nothing from there
	from, _ = s.claimFrom(t0.Add(200*time.Millisecond), every)
	require.Equal(t, first, from, "kept: nothing from there on yet")
	later := pos(2)
	s.claimed(Claimed{Next: later}, false, t0)

	from, full = s.claimFrom(t0.Add(every), every)
	require.True(t, full, "once every interval, from the oldest row again")
	require.Equal(t, QueuePosition{}, from)
	// That claim fails (claimed is not called): the next one is full again.
	from, full = s.claimFrom(t0.Add(every+time.Millisecond), every)
	require.True(t, full, "a full claim that failed is tried again at once, not an interval later")
	require.Equal(t, QueuePosition{}, from)
	s.claimed(Claimed{}, full, t0.Add(every+time.Millisecond))
	from, full = s.claimFrom(t0.Add(every+2*time.Millisecond), every)
	require.False(t, full)
	require.Equal(t, QueuePosition{}, from, "a full claim that passed nothing leaves no start")
}

// A queue notification moves the next claim's start back to the due time it names, before
// every group due then, never forward; one that names none moves it to the oldest row.
func TestScheduleNotificationMovesTheNextClaimsStartBack(t *testing.T) {
	s, _ := newTestSchedule(time.Second)
	t0 := time.Now()
	const every = time.Minute
	next := QueuePosition{At: t0, Stream: uuid.New(), Perspective: "p"}
	s.claimed(Claimed{Next: next}, true, t0)
	start := func() QueuePosition {
		from, full := s.claimFrom(t0.Add(time.Millisecond), every)
		require.False(t, full)
		return from
	}

	s.notified(t0.Add(time.Millisecond))
	require.Equal(t, next, start(), "rows due after the start: found from there")
	s.notified(t0)
	require.Equal(t, QueuePosition{At: t0}, start(), "rows due at the start's time: before every group then")
	s.notified(t0.Add(-time.Second))
	require.Equal(t, QueuePosition{At: t0.Add(-time.Second)}, start())
	s.notified(t0)
	require.Equal(t, QueuePosition{At: t0.Add(-time.Second)}, start(), "never forward")
	s.notified(time.Time{})
	require.Equal(t, QueuePosition{}, start(), "a notification naming no due time: from the oldest row")
}

// The pairs of a job that ended are looked up again, at the group each was claimed at, by the
// next claim (only: the rows that join the group later are announced by their notification):
// the group may hold rows the job did not apply, which the claims since passed as held. A pair
// in a follow-up stays in flight; a pair of unknown position starts the next claim at the
// oldest row.
func TestScheduleLooksUpTheEndedPairsAgain(t *testing.T) {
	s, _ := newTestSchedule(time.Second)
	t0 := time.Now()
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	a, b, c := Pair{uuid.New(), "p"}, Pair{uuid.New(), "p"}, Pair{uuid.New(), "p"}
	g := func(p Pair, ms int) QueuedGroup { return QueuedGroup{Pair: p, At: at(ms)} }
	next := QueuePosition{At: at(50), Stream: uuid.New(), Perspective: "p"}
	s.claimed(Claimed{Pairs: []Pair{a, b, c}, Next: next, At: map[Pair]time.Time{a: at(10), b: at(20), c: at(30)}}, true, t0)
	group := job{kind: jobApply, pairs: []Pair{a, b, c}}
	s.started(&group)
	inflight, _ := s.claimSkips()
	require.Equal(t, map[Pair]time.Time{a: at(10), b: at(20), c: at(30)}, inflight, "in flight, at the groups claimed")
	require.Empty(t, s.claimRechecks(), "nothing ended yet")

	s.finish(jobResult{job: group, next: []job{rewindOf(b)}}, t0)
	require.ElementsMatch(t, []QueuedGroup{g(a, 10), g(c, 30)}, s.claimRechecks(), "b goes on in its rewind")
	require.Equal(t, map[Pair]time.Time{b: at(20)}, s.inflightDue)
	require.ElementsMatch(t, []QueuedGroup{g(a, 10), g(c, 30)}, s.claimRechecks(), "until a claim succeeds")
	s.claimed(Claimed{Next: next}, false, t0)
	require.Empty(t, s.claimRechecks(), "looked up once")
	require.Equal(t, next, s.from, "the start is the last claim's Next")

	rewind, ok := s.popPending(t0)
	require.True(t, ok)
	s.finish(jobResult{job: rewind}, t0)
	require.ElementsMatch(t, []QueuedGroup{g(b, 20)}, s.claimRechecks(), "b, once its rewind ended")
	s.claimed(Claimed{Next: next}, false, t0)
	require.Empty(t, s.claimRechecks())

	later := t0.Add(time.Second)
	unknown := job{kind: jobApply, pairs: []Pair{c}}
	s.started(&unknown)
	s.finish(jobResult{job: unknown}, later)
	require.Empty(t, s.recheck, "a pair not claimed here: no group to look up")
	s.claimed(Claimed{}, false, later)
	require.Equal(t, QueuePosition{}, s.from, "a pair not claimed here: from the oldest row")
}
