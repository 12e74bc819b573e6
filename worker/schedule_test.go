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

// Follow-ups keep their pairs in flight until they run and end.
func TestScheduleFollowUpsKeepTheirPairsInFlight(t *testing.T) {
	s, _ := newTestSchedule(30 * time.Second)
	a, b, c := Pair{Stream: uuid.New(), Perspective: "p"}, Pair{Stream: uuid.New(), Perspective: "p"}, Pair{Stream: uuid.New(), Perspective: "p"}
	group := job{kind: jobApply, pairs: []Pair{a, b, c}}
	s.started(&group)
	s.finish(jobResult{job: group, next: []job{rewindOf(a)}, busy: []Pair{c}}, time.Now())
	require.Equal(t, map[Pair]int{a: 1}, s.inflight, "a waits for its rewind; b and c are done")
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
	require.Equal(t, 3*time.Second, s.followUpWait(now))
	j, ok = s.popPending(now.Add(3 * time.Second))
	require.True(t, ok)
	require.Equal(t, "b@v2.1", j.key)
	require.Zero(t, s.followUpWait(now))
}
