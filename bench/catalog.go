package main

// benchmark is one benchmark function of the repository, as BENCHMARKS.md's index lists it.
type benchmark struct {
	name     string // the function
	file     string // its file, from the repository's root
	what     string // what it measures
	baseline string // what it is compared with, measured in the same run
}

// benchmarks are every benchmark function of the repository's *_test.go files, in the order
// of BENCHMARKS.md. The test of this package fails when a function is missing here, or here
// and not in the repository, or without its section in BENCHMARKS.md.
var benchmarks = []benchmark{
	{"BenchmarkLockCycle", "locker/bench_test.go",
		"one lock cycle of the Postgres locker (TryAcquire + Renew + Release) at concurrency 1 and 8, with durable and with asynchronous commits",
		"the lock-cycle floor (three raw primary-key UPDATEs of the same columns) and session advisory locks, interleaved cycle by cycle"},
	{"BenchmarkLockCyclePooled", "locker/bench_test.go",
		"the same lock cycle through PgBouncer in transaction mode: in pgx's exec mode, and through a PgBouncer >= 1.21 that keeps prepared statements",
		"the same cycle direct (pgx's default mode) and the floor, interleaved cycle by cycle"},
	{"BenchmarkWorkerDrain", "worker/throughput_bench_test.go",
		"events applied per second draining a backlog of 1,000 streams × 50 events, by the default worker and nine other variants",
		"a hand-written drain doing the same reads and writes in as few batched statements as it can; every variant from the same restored backlog, in a rotating order"},
	{"BenchmarkDrainFloor", "worker/bench_floor_test.go",
		"events applied per second by the default worker draining 4,000 streams × 50 events for a perspective whose model lists its event IDs",
		"the one-pass SQL floor (one statement folding every stream's model with jsonb_agg) and the hand-written baseline of BenchmarkWorkerDrain; all from the same restored backlog, in a rotating order"},
	{"BenchmarkWakeupLatency", "worker/bench_wakeup_test.go",
		"Append → model latency with an idle worker at the default PollInterval, for a new event and for a late event (a rewind)",
		"none: bounds in milliseconds"},
	{"BenchmarkRewindCost", "worker/bench_rewind_test.go",
		"the time and Go heap of a rewind for a late event near the end of streams of 1k, 10k and 100k events",
		"the rewind of the 1k-event stream, interleaved"},
	{"BenchmarkIsolation", "worker/bench_isolation_test.go",
		"the throughput of 100 other streams while one stream is under a rewind of 3–4 seconds",
		"the same drain with no rewind, interleaved"},
	{"BenchmarkTakeover", "worker/bench_takeover_test.go",
		"the time until a late event is applied on a pair whose lock another instance took and abandoned, at PollInterval 1 s and 100 ms",
		"the bound LockTimeout + PollInterval + 1 s"},
	{"BenchmarkLifecycle", "worker/bench_lifecycle_test.go",
		"registration, catch-up and a blue/green build of a perspective over a store of 1,000,000 events",
		"a hand-written one-pass fold of the store (catch-up); the same Append → model latency with nothing building (blue/green)"},
	{"BenchmarkStarvation", "worker/bench_skew_test.go",
		"how much of a hot stream is applied by the time 100 cold streams after it are done: a backlog of 2,000 queued Appends (queue), and 200,000 stored events a new perspective's first build catches up with (catchup)",
		"none: a share of the hot stream"},
	{"BenchmarkHotStream", "worker/bench_hot_test.go",
		"events applied per second by the default worker draining one stream's 200,000 queued events, the time of its last tenth against its first, and the same drain with BatchSize 1000",
		"the same number of events over 4,000 streams drained the same way, from restored backlogs, in alternating order"},
	{"BenchmarkLiveTraffic", "worker/bench_skew_test.go",
		"how long after the last of 1,000 Appends to 2,000 streams the queue is empty, on a fresh database, and the snapshot rows written",
		"none: bounds"},
	{"BenchmarkAppendCost", "worker/bench_skew_test.go",
		"the latency of Append of one event, without and with a worker listening",
		"one hand-written statement writing the event row and its queue row, interleaved"},
	{"BenchmarkHotStreamInstances", "worker/bench_skew_test.go",
		"four workers behind one hot stream appended to one event at a time, with 500 cold streams interleaved",
		"none; no target"},
	{"BenchmarkOperatorActions", "worker/bench_ops_test.go",
		"Admin.Retry, the park that follows and Admin.Skip of a parked pair with 200,000 events queued behind its failing event, and the slowest Append of other streams meanwhile",
		"the same actions on a pair with 1 event behind, interleaved; bounds in milliseconds"},
	{"BenchmarkScale", "worker/bench_scale_test.go",
		"the drain's cost per event and the claims' latency on a bulk-loaded queue of 1M events (10M with a knob)",
		"the same drain of 100k events, in the same run"},
	{"BenchmarkSink", "examples/orders/order/bench_test.go",
		"the orders example's sink (sqlc upserts of its table in every commit): a drain of 4,000 orders × 25 events, and the rewind of a late event of an order of 2,000 events",
		"the same perspective without its sink, on a database of its own, in alternating order"},
	{"BenchmarkInstances", "worker/bench_instances_test.go",
		"the same backlog (8,000 streams × 25 events) drained by one worker process and by four",
		"one process with the default configuration, on the same restored backlog"},
}

// target is a figure with its bound.
type target struct {
	bench, metric string
	atMost        bool // the figure must be <= bound (else >= bound)
	bound         float64
	what          string
	// needs names the variant the figure comes from when a run may leave that variant out
	// (the benchmark then logs "not run: <variant>: <reason>"): "prepared", a PgBouncer that
	// keeps prepared statements (>= 1.21), used only when the installed one is.
	needs string
}

// targets are the figures with a bound, in the order of BENCHMARKS.md's results table.
var targets = []target{
	{"BenchmarkLockCycle/conc=1", "lock/floor", true, 1.10, "lock cycle ≤ 1.10× the floor, concurrency 1", ""},
	{"BenchmarkLockCycle/conc=8", "lock/floor", true, 1.10, "lock cycle ≤ 1.10× the floor, concurrency 8", ""},
	{"BenchmarkLockCyclePooled/conc=1", "pooled/lock", true, 1.3, "lock cycle through PgBouncer in pgx's exec mode ≤ 1.3× direct, concurrency 1", ""},
	{"BenchmarkLockCyclePooled/conc=8", "pooled/lock", true, 1.3, "lock cycle through PgBouncer in pgx's exec mode ≤ 1.3× direct, concurrency 8", ""},
	{"BenchmarkLockCyclePooled/conc=1", "prepared/lock", true, 1.3, "lock cycle through PgBouncer >= 1.21 keeping prepared statements ≤ 1.3× direct, concurrency 1", "prepared"},
	{"BenchmarkLockCyclePooled/conc=8", "prepared/lock", true, 1.3, "lock cycle through PgBouncer >= 1.21 keeping prepared statements ≤ 1.3× direct, concurrency 8", "prepared"},
	{"BenchmarkWorkerDrain", "worker-events/s", false, 50000, "drain ≥ 50,000 events/s (default configuration)", ""},
	{"BenchmarkWorkerDrain", "worker/baseline", false, 0.6, "drain ≥ 0.6× the hand-written baseline", ""},
	{"BenchmarkWorkerDrain", "worker/baseline", false, 0.9, "drain ≥ 0.9× the hand-written baseline", ""},
	{"BenchmarkDrainFloor", "worker/floor", false, 0.4, "drain ≥ 0.4× the one-pass SQL floor (4,000 streams × 50 events, a model of event IDs)", ""},
	{"BenchmarkWorkerDrain", "pooled/direct-time", true, 1.3, "drain through PgBouncer in pgx's exec mode ≤ 1.3× the direct drain's time", ""},
	{"BenchmarkWorkerDrain", "prepared/direct-time", true, 1.3, "drain through PgBouncer >= 1.21 keeping prepared statements ≤ 1.3× the direct drain's time", "prepared"},
	{"BenchmarkWakeupLatency", "idle-p50-ms", true, 10, "wake-up at idle, median ≤ 10 ms from Append returning", ""},
	{"BenchmarkWakeupLatency", "late-p50-ms", true, 25, "late event (rewind), median ≤ 25 ms from Append returning", ""},
	{"BenchmarkWakeupLatency", "idle-call-p50-ms", true, 10, "wake-up at idle, median ≤ 10 ms from the Append call", ""},
	{"BenchmarkWakeupLatency", "late-call-p50-ms", true, 25, "late event (rewind), median ≤ 25 ms from the Append call", ""},
	{"BenchmarkRewindCost", "100k/1k-rewind", true, 1.5, "100k-event rewind ≤ 1.5× the 1k rewind (worker time)", ""},
	{"BenchmarkRewindCost", "100k/1k-e2e", true, 1.5, "100k-event rewind ≤ 1.5× the 1k rewind (Append to model)", ""},
	{"BenchmarkRewindCost", "100k/1k-peak-heap", true, 1.25, "peak heap of a rewind flat in stream length (100k/1k ≤ 1.25)", ""},
	{"BenchmarkIsolation", "during/normal", false, 0.9, "other streams during a long rewind ≥ 0.9× normal", ""},
	{"BenchmarkTakeover/poll=1s", "takeover/bound", true, 1, "takeover ≤ LockTimeout + PollInterval + 1 s (poll 1 s)", ""},
	{"BenchmarkTakeover/poll=100ms", "takeover/bound", true, 1, "takeover ≤ LockTimeout + PollInterval + 1 s (poll 100 ms)", ""},
	{"BenchmarkLifecycle", "register-start-ms", true, 1000, "registration: Start of a new perspective ≤ 1 s", ""},
	{"BenchmarkLifecycle", "register-append-max-ms", true, 50, "registration: slowest Append meanwhile ≤ 50 ms", ""},
	{"BenchmarkLifecycle", "register-queue-rows", true, 20000, "registration: queue rows ≤ 1 per stream (20,000)", ""},
	{"BenchmarkLifecycle", "catchup/floor", false, 0.8, "catch-up throughput ≥ 0.8× the hand-written baseline", ""},
	{"BenchmarkLifecycle", "during-build/idle", true, 2, "Append → v1 model while v2 builds ≤ 2× idle", ""},
	{"BenchmarkStarvation/queue", "hot-applied-at-cold-done-%", true, 20, "100 cold streams done before 20% of a hot stream's 2,000 queued Appends are applied", ""},
	{"BenchmarkStarvation/catchup", "hot-applied-at-cold-done-%", true, 20, "catch-up: 100 cold streams done before 20% of a hot stream's 200,000 stored events are applied", ""},
	{"BenchmarkHotStream", "hot/spread", false, 0.5, "one hot stream's drain ≥ 0.5× the same events over 4,000 streams", ""},
	{"BenchmarkHotStream", "hot-last/first-tenth", true, 1.5, "a hot stream's last tenth ≤ 1.5× its first (a batch's cost flat in the backlog)", ""},
	{"BenchmarkLiveTraffic", "live-empty-after-ms", true, 100, "live traffic, fresh database: queue empty ≤ 100 ms after the last Append", ""},
	{"BenchmarkLiveTraffic", "live-snapshot-rows", true, 0, "live traffic: snapshot rows ≤ pairs with ≥ EveryNEvents events (0 here)", ""},
	{"BenchmarkAppendCost", "append/floor", true, 1.5, "Append of 1 event ≤ 1.5× the one-statement baseline", ""},
	{"BenchmarkOperatorActions", "retry-ms", true, 50, "retry of a parked pair with 200,000 events queued ≤ 50 ms", ""},
	{"BenchmarkOperatorActions", "park-ms", true, 50, "parking a pair with 200,000 events queued ≤ 50 ms (the statement)", ""},
	{"BenchmarkOperatorActions", "skip-ms", true, 50, "skip of a parked pair's failing event with 200,000 events queued ≤ 50 ms", ""},
	{"BenchmarkOperatorActions", "append-max-ms", true, 50, "slowest Append of another stream during those actions ≤ 50 ms", ""},
	{"BenchmarkScale", "large/small-per-event", true, 1.5, "drain cost per event, the large queue (1M events) ≤ 1.5× 100k events", ""},
	{"BenchmarkInstances", "x4-throughput/x1", false, 0.9, "4 worker processes: throughput ≥ 0.9× 1 process's", ""},
	{"BenchmarkInstances", "x4-claims/event/x1", true, 1.1, "4 worker processes: claims per applied event ≤ 1.1× 1 process's", ""},
	{"BenchmarkInstances", "x4-min-share-%", false, 15, "4 worker processes: none applies less than 15% of the events", ""},
	{"BenchmarkSink", "sink/plain", false, 0.75, "drain with a sink upserting one row per changed pair through sqlc ≥ 0.75× without it", ""},
	{"BenchmarkSink", "rewind-sink/plain", true, 1.3, "a late event's rewind with a sink ≤ 1.3× without it", ""},
}
