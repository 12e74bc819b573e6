package worker_test

// Plans that hold without statistics. The per-pair reads (QueueEventsForPairs,
// QueueIDsForPair), the DELETE of applied rows (wh_delete_applied, which PairsApplyCommit
// calls) and promotion's catch-up check (BuildQueueAge) must read the queue,
// wh_perspective_events, through index probes only, whatever its statistics say; the claim
// (PairsClaim) must read the due rows through their due index, and wh_append's lock of the
// due rows must probe their key. The bounded reads (a pair's first events) must be ordered
// Index (Only) Scans under their Limit, with no Sort: a Sort there reads all of a hot pair's
// rows for a few. QueueIDsForPair, which returns all of
// a pair's rows, may also find them with a bitmap scan of the primary key and sort them, but
// never scan the table. The pair lookups of the group path (PairsLockForApply's functions
// wh_lock_cursors and wh_snapshot_ids, ModelsGet, PairsApplyCommit's wh_apply_commit,
// CursorsEnsure's wh_ensure_cursors) must go through the cursors', snapshots' and models'
// keys.
//
// The test loads a database of its own in one go (a hot stream of 20,000 queued events per
// build beside thousands of ordinary pairs), with autovacuum off for the loaded tables so that
// only the test changes their statistics, and reads each statement's generic plan (what a
// prepared statement settles on) and custom plan (what its first executions get, and every
// execution through a transaction pooler: planned for the given values) with EXPLAIN (FORMAT
// JSON) EXECUTE, in four states: never analyzed, analyzed, stale after most rows were
// deleted, and stale after a second bulk load.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/db"
	"github.com/perspectives-go/perspectives/internal/pgq"
	"github.com/perspectives-go/perspectives/internal/pgtest"
)

// The queue and its indexes.
const (
	planQueue     = "wh_perspective_events"
	planQueuePKey = "wh_perspective_events_pkey"
	// the due rows (PairsClaim, wh_append)
	planPairs    = "wh_perspective_pairs"
	planPairsDue = "wh_perspective_pairs_due_idx"
	planPairsKey = "wh_perspective_pairs_pkey"
	// promotion's catch-up check (BuildQueueAge)
	planQueueBuildAge = "wh_perspective_events_build_age_idx"
)

// The builds of the test's database (the build keys of version 1's first builds).
const (
	planBuildA = "plans_a"
	planBuildB = "plans_b"
)

// planPairIndexes are the indexes whose key is a pair (stream, perspective) of the cursors.
var planPairIndexes = []string{"wh_perspective_cursors_pkey", "wh_perspective_cursors_build_idx"}

// The tables the loads write: autovacuum is off for them, so their statistics are the test's.
var planTables = []string{planQueue, planPairs, "wh_event_store", "wh_perspective_cursors", "wh_perspective_models", "wh_perspective_snapshots"}

// planCall is a statement with its arguments, as the generated code sends them, and the
// settings it is planned under (a function's SET clauses: "name=value").
type planCall struct {
	sql      string
	args     []any
	settings []string
}

var errPlanRecorded = errors.New("recorded, not run")

// planRecorder is a db.DBTX that runs nothing: it records the statement and the arguments of
// the call made through it.
type planRecorder struct{ call *planCall }

func (r planRecorder) Exec(_ context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	*r.call = planCall{sql: sql, args: args}
	return pgconn.CommandTag{}, errPlanRecorded
}

func (r planRecorder) Query(_ context.Context, sql string, args ...any) (pgx.Rows, error) {
	*r.call = planCall{sql: sql, args: args}
	return nil, errPlanRecorded
}

func (r planRecorder) QueryRow(_ context.Context, sql string, args ...any) pgx.Row {
	*r.call = planCall{sql: sql, args: args}
	return planErrRow{}
}

type planErrRow struct{}

func (planErrRow) Scan(...any) error { return errPlanRecorded }

// planRecord is the statement and arguments run sends through the generated code, with the
// arguments as pgq.New passes them (encodable in every query exec mode).
func planRecord(t *testing.T, run func(q *db.Queries) error) planCall {
	t.Helper()
	var c planCall
	require.ErrorIs(t, run(pgq.New(planRecorder{call: &c})), errPlanRecorded)
	require.NotEmpty(t, c.sql)
	return c
}

// planStatement is a statement to check and how it must read.
type planStatement struct {
	name  string
	call  planCall
	queue string   // the one index it reads the queue through; "": it does not read the queue
	cond  []string // what the Index Cond of every read of the queue contains: a lookup, not a walk of the index
	limit bool     // every read of the queue is an ordered probe, the input of a Limit
	// whole: it returns every queued row of a pair, so a bitmap scan of the index followed by
	// a sort of those rows is allowed too (it costs about what reading them in order does).
	whole bool
	// probe: what the Index Cond of a key probe of the queue contains (equality on the
	// index's leading columns: one group's rows, however many the statistics expect), which
	// needs no Limit and may feed a Sort. Its other reads are held to cond and limit.
	probe []string
	// The other tables it must read through an index only (an Index, Index Only or Bitmap
	// Index Scan): table → the indexes it may use.
	other map[string][]string
	// probed: the other tables it must read through key probes only (an Index Cond), never
	// a walk of a whole index (which a merge join does).
	probed []string
}

// planExplain is the plan of c under plan_cache_mode mode (force_generic_plan or
// force_custom_plan): c is prepared as it is and explained with EXPLAIN (FORMAT JSON) EXECUTE.
func planExplain(ctx context.Context, conn *pgx.Conn, mode string, c planCall) (map[string]any, error) {
	out, err := planExplainAs(ctx, conn, "JSON", mode, c)
	if err != nil {
		return nil, err
	}
	var doc []struct{ Plan map[string]any }
	if err := json.Unmarshal([]byte(out), &doc); err != nil || len(doc) != 1 {
		return nil, fmt.Errorf("explain: read %s: %v", out, err)
	}
	return doc[0].Plan, nil
}

// planExplainAs is EXPLAIN (FORMAT format) EXECUTE of c prepared under plan_cache_mode mode.
func planExplainAs(ctx context.Context, conn *pgx.Conn, format, mode string, c planCall) (string, error) {
	if _, err := conn.Exec(ctx, "SET plan_cache_mode = "+mode); err != nil {
		return "", fmt.Errorf("set plan_cache_mode: %w", err)
	}
	for _, kv := range c.settings {
		name, value, _ := strings.Cut(kv, "=")
		if _, err := conn.Exec(ctx, "SELECT set_config($1, $2, false)", name, value); err != nil {
			return "", fmt.Errorf("set %s: %w", kv, err)
		}
		defer func() { _, _ = conn.Exec(context.WithoutCancel(ctx), "RESET "+pgx.Identifier{name}.Sanitize()) }()
	}
	if _, err := conn.Exec(ctx, "PREPARE plan_check AS "+c.sql); err != nil {
		return "", fmt.Errorf("prepare: %w", err)
	}
	params := make([]string, len(c.args))
	for i := range params {
		params[i] = fmt.Sprintf("$%d", i+1)
	}
	// The connection's simple protocol puts the arguments into the statement as literals,
	// which EXECUTE coerces to the prepared statement's parameter types.
	rows, err := conn.Query(ctx, "EXPLAIN (FORMAT "+format+") EXECUTE plan_check("+strings.Join(params, ", ")+")", c.args...)
	var lines []string
	if err == nil {
		lines, err = pgx.CollectRows(rows, pgx.RowTo[string])
	}
	if _, derr := conn.Exec(ctx, "DEALLOCATE plan_check"); err == nil && derr != nil {
		err = derr
	}
	if err != nil {
		return "", fmt.Errorf("explain: %w", err)
	}
	return strings.Join(lines, "\n"), nil
}

// planNodes calls visit for every node of plan, with the node types of its ancestors
// (nearest last).
func planNodes(plan map[string]any, visit func(n map[string]any, above []string)) {
	var walk func(n map[string]any, above []string)
	walk = func(n map[string]any, above []string) {
		visit(n, above)
		typ, _ := n["Node Type"].(string)
		children, _ := n["Plans"].([]any)
		for _, c := range children {
			if child, ok := c.(map[string]any); ok {
				walk(child, append(slices.Clip(above), typ))
			}
		}
	}
	walk(plan, nil)
}

// planScan describes a node that reads a table: "Index Only Scan on t using i".
func planScan(n map[string]any) string {
	typ, _ := n["Node Type"].(string)
	rel, _ := n["Relation Name"].(string)
	s := typ + " on " + rel
	if idx, ok := n["Index Name"].(string); ok {
		s += " using " + idx
	}
	return s
}

// planIsRead reports whether n reads a table's rows (a scan, not the INSERT, UPDATE or DELETE
// that writes them).
func planIsRead(n map[string]any) (table string, ok bool) {
	rel, hasRel := n["Relation Name"].(string)
	typ, _ := n["Node Type"].(string)
	return rel, hasRel && typ != "ModifyTable"
}

// planIndexOf is the index a read goes through and its Index Cond: its own for an Index
// (Only) Scan, its Bitmap Index Scan's for a Bitmap Heap Scan over one; ok is false for any
// other read (a Seq Scan, a bitmap scan that combines several).
func planIndexOf(n map[string]any) (index, cond string, bitmap, ok bool) {
	switch n["Node Type"] {
	case "Index Scan", "Index Only Scan":
	case "Bitmap Heap Scan":
		children, _ := n["Plans"].([]any)
		if len(children) != 1 {
			return "", "", true, false
		}
		child, _ := children[0].(map[string]any)
		if child["Node Type"] != "Bitmap Index Scan" {
			return "", "", true, false
		}
		n, bitmap = child, true
	default:
		return "", "", false, false
	}
	index, _ = n["Index Name"].(string)
	cond, _ = n["Index Cond"].(string)
	return index, cond, bitmap, true
}

// planProblems is what is wrong with how plan reads the queue and s.other's tables, one line
// each: nothing when every such read goes through an index as s expects.
func planProblems(plan map[string]any, s planStatement) []string {
	var problems []string
	reads := 0
	planNodes(plan, func(n map[string]any, above []string) {
		table, ok := planIsRead(n)
		if !ok {
			return
		}
		scan := planScan(n)
		index, cond, bitmap, ok := planIndexOf(n)
		parent := ""
		if len(above) > 0 {
			parent = above[len(above)-1]
		}
		switch {
		case table == planQueue:
			reads++
			if s.queue == "" || !ok || index != s.queue || (bitmap && !s.whole) {
				problems = append(problems, fmt.Sprintf("%s (index %q): want only Index (Only) Scans using %q", scan, index, s.queue))
				return
			}
			if len(s.probe) > 0 && !bitmap && !slices.ContainsFunc(s.probe, func(c string) bool { return !strings.Contains(cond, c) }) {
				return // a key probe
			}
			for _, want := range s.cond {
				if !strings.Contains(cond, want) {
					problems = append(problems, fmt.Sprintf("%s: Index Cond %s lacks %s", scan, cond, want))
				}
			}
			if s.limit && parent != "Limit" {
				problems = append(problems, fmt.Sprintf("%s: under %q, not a Limit", scan, parent))
			}
			if !s.whole && (slices.Contains(above, "Sort") || slices.Contains(above, "Incremental Sort")) {
				problems = append(problems, scan+" feeds a Sort")
			}
		case s.other[table] != nil:
			if !ok || !slices.Contains(s.other[table], index) {
				problems = append(problems, fmt.Sprintf("%s (index %q): want an index scan using one of %v", scan, index, s.other[table]))
			} else if slices.Contains(s.probed, table) && cond == "" {
				problems = append(problems, fmt.Sprintf("%s (index %q): want key probes, not a walk of the index", scan, index))
			}
		}
	})
	if s.queue != "" && reads == 0 {
		problems = append(problems, "the queue is not read")
	}
	return problems
}

// planSummary lists the reads and sorts of plan, for the log.
func planSummary(plan map[string]any) string {
	var parts []string
	planNodes(plan, func(n map[string]any, above []string) {
		typ, _ := n["Node Type"].(string)
		if _, ok := planIsRead(n); ok {
			parts = append(parts, planScan(n))
		} else if strings.HasSuffix(typ, "Sort") {
			parts = append(parts, typ)
		}
	})
	return strings.Join(parts, "; ")
}

// planCheck explains s in both plan cache modes and reports every problem with its plans.
func planCheck(t *testing.T, ctx context.Context, conn *pgx.Conn, s planStatement) {
	t.Helper()
	for _, mode := range []string{"force_generic_plan", "force_custom_plan"} {
		plan, err := planExplain(ctx, conn, mode, s.call)
		require.NoError(t, err, "%s (%s)", s.name, mode)
		t.Logf("%s (%s): %s", s.name, mode, planSummary(plan))
		if p := planProblems(plan, s); len(p) > 0 {
			text, err := planExplainAs(ctx, conn, "TEXT", mode, s.call)
			require.NoError(t, err)
			t.Errorf("%s (%s) does not keep its index plan:\n  %s\n%s", s.name, mode, strings.Join(p, "\n  "), text)
		}
	}
}

// planActiveBuild registers the perspective key with its first build, key, active and
// caught up.
func planActiveBuild(t *testing.T, ctx context.Context, conn *pgx.Conn, key string) {
	t.Helper()
	planExec(t, ctx, conn, `INSERT INTO wh_perspectives (perspective_name) VALUES ($1)`, key)
	planExec(t, ctx, conn, `INSERT INTO wh_perspective_builds (build_key, perspective_name, version, build, state, catchup_done)
		VALUES ($1, $1, 1, 1, 'active', true)`, key)
}

// planExec runs sql on conn, failing the test on an error.
func planExec(t *testing.T, ctx context.Context, conn *pgx.Conn, sql string, args ...any) {
	t.Helper()
	_, err := conn.Exec(ctx, sql, pgq.Args(args)...)
	require.NoError(t, err, sql)
}

// planLoad bulk-loads, in a handful of INSERT ... SELECT statements, the stored and queued
// events tagged tag (their event type): hot, a stream with 20,000 events queued for both builds,
// and 3,000 other streams with 3 each, with a cursor, a model and two snapshots for each pair;
// and idle pairs, with a cursor and a model but nothing queued (applied long ago), as most
// pairs are: against tables no bigger than a group, reading them whole is as cheap as the
// group's 50 lookups.
func planLoad(t *testing.T, ctx context.Context, conn *pgx.Conn, tag string, hot uuid.UUID, idle int) {
	t.Helper()
	planExec(t, ctx, conn, `INSERT INTO wh_event_store (event_id, stream_id, event_type, data)
		SELECT gen_random_uuid(), $1::uuid, $2::text, '{}'::jsonb FROM generate_series(1, 20000)
		UNION ALL
		SELECT gen_random_uuid(), md5($2::text || s)::uuid, $2::text, '{}'
		FROM generate_series(1, 3000) s, generate_series(1, 3)`, hot, tag)
	planExec(t, ctx, conn, `INSERT INTO wh_perspective_events (stream_id, perspective_name, event_id, enqueued_at)
		SELECT e.stream_id, b.build_key, e.event_id,
		       CASE WHEN e.stream_id <> $1::uuid
		                THEN now() - interval '1 hour' + (abs(hashtext(e.stream_id::text)) % 3600000) * interval '1 ms'
		            ELSE now() - interval '2 hours' + random() * interval '1 hour' END
		FROM wh_event_store e CROSS JOIN (VALUES ($3::text), ($4::text)) b (build_key)
		WHERE e.event_type = $2::text`, hot, tag, planBuildA, planBuildB)
	planExec(t, ctx, conn, `INSERT INTO wh_perspective_pairs (stream_id, perspective_name, due_at)
		SELECT q.stream_id, q.perspective_name, min(q.enqueued_at)
		FROM wh_perspective_events q JOIN wh_event_store e ON e.event_id = q.event_id
		WHERE e.event_type = $1::text
		GROUP BY 1, 2`, tag)
	planExec(t, ctx, conn, `WITH queued AS (
		    SELECT DISTINCT e.stream_id, b.build_key AS perspective_name
		    FROM wh_event_store e CROSS JOIN (VALUES ($2::text), ($3::text)) b (build_key)
		    WHERE e.event_type = $1::text
		), pairs AS (
		    SELECT stream_id, perspective_name FROM queued
		    UNION ALL
		    SELECT md5($1::text || 'idle' || s)::uuid, $2::text FROM generate_series(1, $4::int) s
		), cursors AS (
		    INSERT INTO wh_perspective_cursors (stream_id, perspective_name, last_event_id)
		    SELECT stream_id, perspective_name, gen_random_uuid() FROM pairs
		), models AS (
		    INSERT INTO wh_perspective_models (stream_id, perspective_name, model, last_event_id)
		    SELECT stream_id, perspective_name, '{}', gen_random_uuid() FROM pairs
		)
		INSERT INTO wh_perspective_snapshots (stream_id, perspective_name, snapshot_event_id, model)
		SELECT stream_id, perspective_name, gen_random_uuid(), '{}' FROM queued CROSS JOIN generate_series(1, 2)`,
		tag, planBuildA, planBuildB, idle)
}

// planQueueStats is the queue's row count, the planner's idea of it (reltuples: -1 when never
// analyzed) and how many of its columns have statistics.
func planQueueStats(t *testing.T, ctx context.Context, conn *pgx.Conn) (rows int64, reltuples float64, columns int64) {
	t.Helper()
	require.NoError(t, conn.QueryRow(ctx, `SELECT (SELECT count(*) FROM wh_perspective_events), c.reltuples::float8,
		(SELECT count(*) FROM pg_stats s WHERE s.schemaname = 'public' AND s.tablename = c.relname)
		FROM pg_class c WHERE c.oid = 'wh_perspective_events'::regclass`).Scan(&rows, &reltuples, &columns))
	return rows, reltuples, columns
}

// planStatements are the statements to check, with the arguments the worker would pass in
// the database's present state: the claim; the pairs of the hot stream and 48 others as one
// group (the default GroupSize is 50) for the group path's statements, which apply the
// first 100 queued events of each (the default BatchSize); and an Append of 10 events to the
// hot stream.
func planStatements(t *testing.T, ctx context.Context, conn *pgx.Conn, hot uuid.UUID) []planStatement {
	t.Helper()
	streams := []uuid.UUID{hot, hot}
	names := []string{planBuildA, planBuildB}
	rows, err := conn.Query(ctx, `SELECT stream_id, perspective_name FROM wh_perspective_cursors c
		WHERE stream_id <> $1 AND EXISTS (SELECT 1 FROM wh_perspective_events q
		                                  WHERE q.stream_id = c.stream_id AND q.perspective_name = c.perspective_name)
		ORDER BY stream_id, perspective_name LIMIT 48`, hot)
	require.NoError(t, err)
	for rows.Next() {
		var s uuid.UUID
		var n string
		require.NoError(t, rows.Scan(&s, &n))
		streams, names = append(streams, s), append(names, n)
	}
	require.NoError(t, rows.Err())
	require.Len(t, streams, 50)

	var applied []uuid.UUID
	require.NoError(t, conn.QueryRow(ctx, `SELECT array_agg(event_id) FROM (
		SELECT event_id FROM wh_perspective_events WHERE stream_id = $1 AND perspective_name = $2
		ORDER BY event_id LIMIT 100) q`, hot, planBuildA).Scan(&applied))
	require.Len(t, applied, 100)
	appliedStreams, appliedNames := make([]uuid.UUID, len(applied)), make([]string, len(applied))
	for i := range applied {
		appliedStreams[i], appliedNames[i] = hot, planBuildA
	}
	models, since := make([]string, len(streams)), make([]int32, len(streams))
	lastIDs := make([]uuid.UUID, len(streams))
	for i := range streams {
		models[i], since[i], lastIDs[i] = "{}", 1, applied[len(applied)-1]
	}

	// wh_delete_applied deleting 2,000 queued rows of many pairs: as a join of their keys with
	// the queue, hashing the whole queue is then cheaper than 2,000 probes by the planner's
	// estimates.
	var delStreams, delIDs []uuid.UUID
	var delNames []string
	rows, err = conn.Query(ctx, `SELECT stream_id, perspective_name, event_id FROM wh_perspective_events
		ORDER BY stream_id, perspective_name, event_id LIMIT 2000`)
	require.NoError(t, err)
	for rows.Next() {
		var s, e uuid.UUID
		var n string
		require.NoError(t, rows.Scan(&s, &n, &e))
		delStreams, delNames, delIDs = append(delStreams, s), append(delNames, n), append(delIDs, e)
	}
	require.NoError(t, rows.Err())
	require.Len(t, delIDs, 2000)

	pairCond := []string{"(stream_id = ", "(perspective_name = "}
	statements := []planStatement{{
		name:  "PairsClaim",
		call:  planFunctionCall(t, ctx, conn, "wh_claim_pairs", "", "", uuid.New(), []string{planBuildA, planBuildB}, 100, 30.0),
		other: map[string][]string{planPairs: {planPairsDue, planPairsKey}, "wh_perspective_cursors": planPairIndexes},
	}, {
		// After an outage: the rows due between now and 'infinity' (leased, backing off) are few.
		name: "PairsLeasedBy",
		call: planRecord(t, func(q *db.Queries) error {
			_, err := q.PairsLeasedBy(ctx, uuid.New())
			return err
		}),
		other: map[string][]string{planPairs: {planPairsDue}},
	}, {
		name: "QueueEventsForPairs",
		call: planRecord(t, func(q *db.Queries) error {
			_, err := q.QueueEventsForPairs(ctx, db.QueueEventsForPairsParams{StreamIds: streams, PerspectiveNames: names, PerPairLimit: 100})
			return err
		}),
		queue: planQueuePKey, cond: pairCond, limit: true,
		other:  map[string][]string{"wh_event_store": {"wh_event_store_pkey"}},
		probed: []string{"wh_event_store"},
	}, {
		// The hot pair in a group of its own: with the statistics of a hot stream, the
		// planner expects thousands of its rows, and a join with the store planned for that
		// many read the store's whole key for every batch of 100.
		name: "QueueEventsForPairs (the hot pair alone)",
		call: planRecord(t, func(q *db.Queries) error {
			_, err := q.QueueEventsForPairs(ctx, db.QueueEventsForPairsParams{StreamIds: streams[:1], PerspectiveNames: names[:1], PerPairLimit: 100})
			return err
		}),
		queue: planQueuePKey, cond: pairCond, limit: true,
		other:  map[string][]string{"wh_event_store": {"wh_event_store_pkey"}},
		probed: []string{"wh_event_store"},
	}, {
		name: "QueueIDsForPair",
		call: planRecord(t, func(q *db.Queries) error {
			_, err := q.QueueIDsForPair(ctx, db.QueueIDsForPairParams{StreamID: hot, PerspectiveName: planBuildA})
			return err
		}),
		queue: planQueuePKey, cond: pairCond, whole: true,
	}, planApplyCommit(t, ctx, conn, streams, names, models, lastIDs, since, appliedStreams, appliedNames, applied),
		planEnsureCursors(t, ctx, conn, streams, names), {
			name:  "wh_delete_applied",
			call:  planFunctionCall(t, ctx, conn, "wh_delete_applied", "", "", delStreams, delNames, delIDs),
			queue: planQueuePKey, cond: append(slices.Clip(pairCond), "(event_id = "),
		}, {
			name:  "wh_append",
			call:  planAppendLock(t, ctx, conn, streams, names),
			other: map[string][]string{planPairs: {planPairsKey}},
		}, {
			// A job's release deletes the due rows of its pairs whose queue is empty (each found
			// by the first entry of the pair's range, or none) ...
			name:  "wh_pairs_release (empty queues)",
			call:  planReleaseDelete(t, ctx, conn, streams, names),
			queue: planQueuePKey, cond: pairCond,
			other: map[string][]string{planPairs: {planPairsKey}},
		}, {
			// ... and makes the others due at their oldest queued event (the same entry).
			name:  "wh_pairs_release (due times)",
			call:  planFunctionCall(t, ctx, conn, "wh_pairs_release", "UPDATE wh_perspective_pairs d", "", uuid.New(), streams, names, make([]float64, len(streams))),
			queue: planQueuePKey, cond: pairCond, limit: true,
			other: map[string][]string{planPairs: {planPairsKey}},
		}}
	// Promotion's catch-up check, the oldest queued event of a build: the first entry of the
	// build's range of its index, not a scan of the queue.
	statements = append(statements, planStatement{
		name:  "BuildQueueAge",
		call:  planRecord(t, func(q *db.Queries) error { _, err := q.BuildQueueAge(ctx, planBuildA); return err }),
		queue: planQueueBuildAge, cond: []string{"(perspective_name = "}, limit: true,
	})
	// ... and, when that event is older than the catch-up's end, whether a pair waits with
	// such an event: each of the build's due rows a probe of its queue's key (and of its
	// stream's cursor in the active build).
	statements = append(statements, planStatement{
		name: "BuildCatchUpLeftWaiting",
		call: planRecord(t, func(q *db.Queries) error {
			_, err := q.BuildCatchUpLeftWaiting(ctx, db.BuildCatchUpLeftWaitingParams{BuildKey: planBuildA, ActiveKey: planBuildB})
			return err
		}),
		queue: planQueuePKey, cond: pairCond, probe: pairCond, whole: true, // see the query's comment
		probed: []string{"wh_perspective_cursors"},
	})
	statements = append(statements, planGroupLookups(t, ctx, conn, streams, names)...)
	// The apply commit deletes its rows through the function whose plan is checked here.
	commit := slices.IndexFunc(statements, func(s planStatement) bool { return s.name == "wh_apply_commit" })
	require.GreaterOrEqual(t, commit, 0)
	require.Contains(t, statements[commit].call.sql, "wh_delete_applied(")
	return statements
}

func TestPlansSQLHoldWithoutStatistics(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	d, err := pgtest.Create(ctx, "plans")
	require.NoError(t, err)
	defer d.Close()
	conn := planConnect(t, ctx, d)

	for _, table := range planTables {
		planExec(t, ctx, conn, "ALTER TABLE "+table+" SET (autovacuum_enabled = false)")
	}
	for _, b := range []string{planBuildA, planBuildB} {
		planExec(t, ctx, conn, `INSERT INTO wh_perspectives (perspective_name) VALUES ($1)`, b)
		planExec(t, ctx, conn, `INSERT INTO wh_perspective_builds (build_key, perspective_name, version, build, state, catchup_done)
			VALUES ($1, $1, 1, 1, 'active', true)`, b)
	}
	hot := uuid.New()
	planLoad(t, ctx, conn, "load1", hot, 30000)

	check := func(state string, hot uuid.UUID) {
		t.Run(state, func(t *testing.T) {
			for _, s := range planStatements(t, ctx, conn, hot) {
				planCheck(t, ctx, conn, s)
			}
		})
	}

	rows, reltuples, columns := planQueueStats(t, ctx, conn)
	require.Equal(t, -1.0, reltuples, "the queue is never analyzed")
	require.Zero(t, columns, "the queue has no column statistics")
	require.EqualValues(t, 2*(20000+3*3000), rows)
	check("never analyzed", hot)

	planExec(t, ctx, conn, "ANALYZE")
	rows, reltuples, columns = planQueueStats(t, ctx, conn)
	require.InEpsilon(t, float64(rows), reltuples, 0.01, "the queue is analyzed")
	require.NotZero(t, columns)
	check("analyzed", hot)

	// About one row in 16 is left; the statistics still count every row and the hot pair as
	// most of the queue.
	planExec(t, ctx, conn, `DELETE FROM wh_perspective_events WHERE left(event_id::text, 1) <> '0'`)
	rows, reltuples, _ = planQueueStats(t, ctx, conn)
	require.Greater(t, reltuples, 10*float64(rows), "the statistics are stale")
	check("stale after a delete", hot)

	// Analyzed small, then bulk-loaded again: the statistics know nothing of the new hot
	// stream and count a tenth of the rows.
	planExec(t, ctx, conn, "ANALYZE")
	hot2 := uuid.New()
	planLoad(t, ctx, conn, "load2", hot2, 0)
	rows, reltuples, _ = planQueueStats(t, ctx, conn)
	require.Less(t, 10*reltuples, float64(rows), "the statistics are stale")
	check("stale after a second bulk load", hot2)

	var autoAnalyzed, autoVacuumed bool
	require.NoError(t, conn.QueryRow(ctx, `SELECT last_autoanalyze IS NOT NULL, last_autovacuum IS NOT NULL
		FROM pg_stat_user_tables WHERE relid = 'wh_perspective_events'::regclass`).Scan(&autoAnalyzed, &autoVacuumed))
	require.False(t, autoAnalyzed || autoVacuumed, "autovacuum left the queue alone")

	// The checks can fail: without the index a statement must probe, they report its plans.
	// Each index is dropped in a transaction that is rolled back.
	for _, c := range []struct{ statement, drop string }{
		{"PairsClaim", "DROP INDEX " + planPairsDue},
		{"QueueEventsForPairs", "ALTER TABLE wh_perspective_events DROP CONSTRAINT " + planQueuePKey},
	} {
		statements := planStatements(t, ctx, conn, hot2)
		i := slices.IndexFunc(statements, func(s planStatement) bool { return s.name == c.statement })
		require.GreaterOrEqual(t, i, 0)
		tx, err := conn.Begin(ctx)
		require.NoError(t, err)
		_, err = tx.Exec(ctx, c.drop)
		require.NoError(t, err)
		for _, mode := range []string{"force_generic_plan", "force_custom_plan"} {
			plan, err := planExplain(ctx, conn, mode, statements[i].call)
			require.NoError(t, err)
			require.NotEmpty(t, planProblems(plan, statements[i]), "%s (%s) after %s: %s", c.statement, mode, c.drop, planSummary(plan))
		}
		require.NoError(t, tx.Rollback(ctx))
	}
}

// An Append, a claim and a release on a small database, analyzed with 100 cursor and due
// rows and one parked pair's 20,000 queued events: wh_append's statement that writes the
// events, their queue rows and the missing cursor rows probes the cursors' key for each pair,
// its lock of the due rows probes their key, the claim probes the cursors' key for each due
// row it considers, and the release probes the due rows' key and reads the first entry of
// each pair's range of the queue. Without the functions' settings, the planner hashes every
// cursor row for the first, scans the due rows for each pair in the second, scans the
// cursors for each due row in the third and the due rows for the release's due times; the
// plans kept for the session do so at every call until the tables are analyzed
// again, however large they grow meanwhile.
func TestPlansSQLAppendClaimAndReleaseProbeTheKeysOfASmallDatabase(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	d, err := pgtest.Create(ctx, "plans_append")
	require.NoError(t, err)
	defer d.Close()
	conn := planConnect(t, ctx, d)

	const build = "small"
	planActiveBuild(t, ctx, conn, build)
	planExec(t, ctx, conn, `WITH c AS (
		    INSERT INTO wh_perspective_cursors (stream_id, perspective_name)
		    SELECT gen_random_uuid(), $1 FROM generate_series(1, 100)
		    RETURNING stream_id, perspective_name)
		INSERT INTO wh_perspective_pairs (stream_id, perspective_name, due_at)
		SELECT stream_id, perspective_name, now() FROM c`, build)
	planExec(t, ctx, conn, `INSERT INTO wh_perspective_snapshots (stream_id, perspective_name, snapshot_event_id, model)
		SELECT stream_id, perspective_name, gen_random_uuid(), '{}' FROM wh_perspective_cursors`)
	// and one pair parked with 20,000 events queued: the queue's statistics know one stream.
	parked := uuid.New()
	planExec(t, ctx, conn, `WITH e AS (
		    INSERT INTO wh_event_store (event_id, stream_id, event_type, data)
		    SELECT gen_random_uuid(), $1, 't', '{}' FROM generate_series(1, 20000)
		    RETURNING event_id, stream_id
		), c AS (
		    INSERT INTO wh_perspective_cursors (stream_id, perspective_name) VALUES ($1, $2)
		), d AS (
		    INSERT INTO wh_perspective_pairs (stream_id, perspective_name, due_at) VALUES ($1, $2, 'infinity')
		)
		INSERT INTO wh_perspective_events (stream_id, perspective_name, event_id)
		SELECT stream_id, $2, event_id FROM e`, parked, build)
	planExec(t, ctx, conn, "ANALYZE wh_perspective_cursors, wh_perspective_pairs, wh_perspective_events, wh_perspective_snapshots")
	var stream uuid.UUID
	require.NoError(t, conn.QueryRow(ctx, `SELECT stream_id FROM wh_perspective_cursors WHERE stream_id <> $1 LIMIT 1`, parked).Scan(&stream))
	released, releasedNames := []uuid.UUID{stream, parked}, []string{build, build}
	pairCond := []string{"(stream_id = ", "(perspective_name = "}

	releaseDelete := planStatement{
		name:  "wh_pairs_release's delete",
		call:  planReleaseDelete(t, ctx, conn, released, releasedNames),
		queue: planQueuePKey, cond: pairCond,
		other:  map[string][]string{planPairs: {planPairsKey}},
		probed: []string{planPairs},
	}
	for _, s := range []planStatement{{
		name: "wh_append's writes",
		call: planFunctionCall(t, ctx, conn, "wh_append", "WITH builds AS", " INTO queued, pair_streams, pair_keys",
			[]uuid.UUID{uuid.Must(uuid.NewV7())}, []uuid.UUID{stream}, []string{"t"}, []string{"{}"}, []time.Time{{}}),
		other:  map[string][]string{"wh_perspective_cursors": planPairIndexes},
		probed: []string{"wh_perspective_cursors"},
	}, {
		name:   "wh_append's lock",
		call:   planAppendLock(t, ctx, conn, []uuid.UUID{stream}, []string{build}),
		other:  map[string][]string{planPairs: {planPairsKey}},
		probed: []string{planPairs},
	}, {
		name:   "PairsClaim",
		call:   planFunctionCall(t, ctx, conn, "wh_claim_pairs", "", "", uuid.New(), []string{build}, 100, 30.0),
		other:  map[string][]string{planPairs: {planPairsDue, planPairsKey}, "wh_perspective_cursors": planPairIndexes},
		probed: []string{"wh_perspective_cursors"},
	}, planLockCursors(t, ctx, conn, released, releasedNames), planSnapshotIDs(t, ctx, conn, stream, build),
		planApplyCommit(t, ctx, conn, released, releasedNames, []string{"{}", "{}"}, []uuid.UUID{uuid.New(), uuid.New()}, []int32{1, 1},
			released, releasedNames, []uuid.UUID{uuid.New(), uuid.New()}),
		planEnsureCursors(t, ctx, conn, released, releasedNames), releaseDelete, {
			name: "wh_pairs_release's due times",
			call: planFunctionCall(t, ctx, conn, "wh_pairs_release", "UPDATE wh_perspective_pairs d", "",
				uuid.New(), released, releasedNames, []float64{-1, -1}),
			queue: planQueuePKey, cond: pairCond, limit: true,
			other:  map[string][]string{planPairs: {planPairsKey}},
			probed: []string{planPairs},
		}} {
		require.Contains(t, s.call.settings, "enable_seqscan=off", s.name)
		planCheck(t, ctx, conn, s)
		if s.name == releaseDelete.name {
			continue // written to hold without the settings too: checked below
		}

		// The check can fail: planned without the function's settings, the plan is reported.
		s.call.settings = nil
		plan, err := planExplain(ctx, conn, "force_generic_plan", s.call)
		require.NoError(t, err)
		require.NotEmpty(t, planProblems(plan, s), "%s without its settings: %s", s.name, planSummary(plan))
	}

	// The group path's other lookups of the same pairs (its functions are checked above).
	for _, s := range planGroupLookups(t, ctx, conn, released, releasedNames) {
		if len(s.call.settings) == 0 {
			planCheck(t, ctx, conn, s)
		}
	}

	// The release's check that a pair's queue is empty, written as NOT EXISTS, is an anti-join
	// free to read the queue through any index: without the settings it scanned the whole queue
	// for every due row, and with them it walks the build's range of the queue's other index
	// for every pair. It must read the first entry of the pair's range of the primary key.
	const first = `(SELECT q.event_id FROM wh_perspective_events q
               WHERE q.stream_id = d.stream_id AND q.perspective_name = d.perspective_name
               ORDER BY q.event_id
               LIMIT 1) IS NULL`
	require.Equal(t, 1, strings.Count(releaseDelete.call.sql, first), "wh_pairs_release: its delete's check")
	for _, settings := range [][]string{releaseDelete.call.settings, nil} {
		c := releaseDelete.call
		c.settings = settings
		c.sql = strings.Replace(c.sql, first, `NOT EXISTS (SELECT 1 FROM wh_perspective_events q
		    WHERE q.stream_id = d.stream_id AND q.perspective_name = d.perspective_name)`, 1)
		plan, err := planExplain(ctx, conn, "force_generic_plan", c)
		require.NoError(t, err)
		require.NotEmpty(t, planProblems(plan, releaseDelete), "NOT EXISTS, settings %v: %s", settings, planSummary(plan))
	}
}

// The group path's pair lookups with one build, its cursors analyzed: every cursor then
// matches the build's key, and PairsLockForApply, planned as a join of the pairs with the
// cursors, was estimated at one row after its retired-build check and scanned every cursor
// for each pair (31 ms for 50 pairs of 2,000 cursors, the worker's largest cost in
// BenchmarkInstances). Each pair must be a probe of the cursors' key.
func TestPlansSQLGroupLookupsWithOneBuild(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	d, err := pgtest.Create(ctx, "plans_one")
	require.NoError(t, err)
	defer d.Close()
	conn := planConnect(t, ctx, d)

	const build = "one"
	planActiveBuild(t, ctx, conn, build)
	planExec(t, ctx, conn, `INSERT INTO wh_perspective_cursors (stream_id, perspective_name, last_event_id)
		SELECT gen_random_uuid(), $1, gen_random_uuid() FROM generate_series(1, 2000)`, build)
	planExec(t, ctx, conn, `INSERT INTO wh_perspective_models (stream_id, perspective_name, model, last_event_id)
		SELECT stream_id, perspective_name, '{}', last_event_id FROM wh_perspective_cursors`)
	planExec(t, ctx, conn, `INSERT INTO wh_perspective_snapshots (stream_id, perspective_name, snapshot_event_id, model)
		SELECT stream_id, perspective_name, last_event_id, '{}' FROM wh_perspective_cursors`)
	planExec(t, ctx, conn, "ANALYZE")
	rows, err := conn.Query(ctx, `SELECT stream_id FROM wh_perspective_cursors LIMIT 50`)
	require.NoError(t, err)
	streams, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
	require.NoError(t, err)
	names := slices.Repeat([]string{build}, len(streams))

	for _, s := range planGroupLookups(t, ctx, conn, streams, names) {
		planCheck(t, ctx, conn, s)
	}
}

// planAppendLock is the statement of wh_append that locks the pairs' due rows, with the pairs
// (streams, names) as the parameters $1 and $2, planned under the function's settings.
func planAppendLock(t *testing.T, ctx context.Context, conn *pgx.Conn, streams []uuid.UUID, names []string) planCall {
	t.Helper()
	return planPairsStatement(t, ctx, conn, "wh_append", "SELECT count(*), count(*) FILTER", " INTO held, parked",
		"unnest(pair_streams, pair_keys)", streams, names)
}

// planReleaseDelete is the statement of wh_pairs_release that deletes the due rows of the
// pairs it locked whose queue is empty, with the pairs (streams, names) as the locked ones.
func planReleaseDelete(t *testing.T, ctx context.Context, conn *pgx.Conn, streams []uuid.UUID, names []string) planCall {
	t.Helper()
	return planPairsStatement(t, ctx, conn, "wh_pairs_release", "DELETE FROM wh_perspective_pairs d", "",
		"unnest(locked_streams, locked_names)", streams, names)
}

// planPairsStatement is a statement of the PL/pgSQL function name (as planFunctionStatement
// finds it) whose pairs are the unnest of two of its variables, pairs, with those pairs
// (streams, names) as the parameters $1 and $2, planned under the function's settings.
func planPairsStatement(t *testing.T, ctx context.Context, conn *pgx.Conn, name, from, into, pairs string, streams []uuid.UUID, names []string) planCall {
	t.Helper()
	sql, _, settings := planFunctionStatement(t, ctx, conn, name, from, into)
	require.Equal(t, 1, strings.Count(sql, pairs), "%s: the pairs of its statement %q", name, from)
	sql = strings.Replace(sql, pairs, "unnest($1::uuid[], $2::text[])", 1)
	return planCall{sql: sql, args: pgq.Args([]any{streams, names}), settings: settings}
}

// planFunctionCall is a statement of the PL/pgSQL function name (as planFunctionStatement
// finds it), with the function's arguments as $1, $2, … (args, in order) and planned under
// the function's settings.
func planFunctionCall(t *testing.T, ctx context.Context, conn *pgx.Conn, name, from, into string, args ...any) planCall {
	t.Helper()
	sql, params, settings := planFunctionStatement(t, ctx, conn, name, from, into)
	require.Len(t, params, len(args), "%s: its parameters", name)
	for i, p := range params {
		re := regexp.MustCompile(`([^\w.])(?:` + name + `\.)?` + p.name + `\b`) // also as name.param
		require.True(t, re.MatchString(sql), "%s: %s in its source", name, p.name)
		sql = re.ReplaceAllString(sql, fmt.Sprintf("${1}$$%d::%s", i+1, p.typ))
	}
	return planCall{sql: sql, args: pgq.Args(args), settings: settings}
}

// planParam is a function's parameter: its name and its type.
type planParam struct{ name, typ string }

// planFunctionStatement is a statement of the PL/pgSQL function name as its source has it
// (the first of its body, without RETURN QUERY; or, when from is not "", the one that begins
// with from), without its PL/pgSQL clause into (when not ""), with the function's parameters
// and settings ("name=value").
func planFunctionStatement(t *testing.T, ctx context.Context, conn *pgx.Conn, name, from, into string) (string, []planParam, []string) {
	t.Helper()
	var src string
	var names, settings, types []string
	require.NoError(t, conn.QueryRow(ctx, `SELECT p.prosrc, p.proargnames[1:p.pronargs], COALESCE(p.proconfig, '{}'),
		(SELECT array_agg(format_type(a.t, NULL) ORDER BY a.n) FROM unnest(p.proargtypes::oid[]) WITH ORDINALITY AS a (t, n))
		FROM pg_proc p WHERE p.proname = $1 AND p.prolang = (SELECT oid FROM pg_language WHERE lanname = 'plpgsql')`,
		name).Scan(&src, &names, &settings, &types))
	_, body, ok := strings.Cut(src, "BEGIN")
	require.True(t, ok, "%s: its body", name)
	body = strings.TrimPrefix(strings.TrimSpace(body), "RETURN QUERY")
	if from != "" {
		require.Equal(t, 1, strings.Count(body, from), "%s: its statement %q", name, from)
		body = body[strings.Index(body, from):]
	}
	sql, _, ok := strings.Cut(body, ";")
	require.True(t, ok, "%s: the end of its statement", name)
	if into != "" { // PL/pgSQL's, not SQL
		require.Equal(t, 1, strings.Count(sql, into), "%s: its statement's %q", name, into)
		sql = strings.Replace(sql, into, "", 1)
	}
	params := make([]planParam, len(names))
	for i := range names {
		params[i] = planParam{names[i], types[i]}
	}
	return sql, params, settings
}

// planConnect opens one direct connection to d, closed when the test ends (session settings
// and prepared statements must stay on it), in the simple protocol: nothing of pgx's own is
// prepared on it.
func planConnect(t *testing.T, ctx context.Context, d *pgtest.DB) *pgx.Conn {
	t.Helper()
	cfg, err := pgx.ParseConfig(d.DirectURL)
	require.NoError(t, err)
	cfg.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	conn, err := pgx.ConnectConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

// planGroupLookups is the group path's pair lookups of the given pairs, each of which must
// probe its table's key.
func planGroupLookups(t *testing.T, ctx context.Context, conn *pgx.Conn, streams []uuid.UUID, names []string) []planStatement {
	t.Helper()
	// PairsLockForApply reads no table itself: its two functions do, each pair a probe.
	planCalls(t, func(q *db.Queries) error {
		_, err := q.PairsLockForApply(ctx, db.PairsLockForApplyParams{StreamIds: streams, PerspectiveNames: names})
		return err
	}, "wh_lock_cursors", "wh_snapshot_ids")
	return []planStatement{planLockCursors(t, ctx, conn, streams, names), planSnapshotIDs(t, ctx, conn, streams[0], names[0]), {
		name: "ModelsGet",
		call: planRecord(t, func(q *db.Queries) error {
			_, err := q.ModelsGet(ctx, db.ModelsGetParams{StreamIds: streams, PerspectiveNames: names})
			return err
		}),
		other: map[string][]string{"wh_perspective_models": {"wh_perspective_models_pkey"}},
	}}
}

// planCalls requires that the statement run sends through the generated code calls each of
// the functions fns, whose statements are checked in its place.
func planCalls(t *testing.T, run func(q *db.Queries) error, fns ...string) {
	t.Helper()
	c := planRecord(t, run)
	for _, fn := range fns {
		require.Contains(t, c.sql, fn+"(")
	}
}

// planApplyCommit is the statement of wh_apply_commit (PairsApplyCommit's) for the given
// pairs and applied rows: a probe of the cursors' key for each pair.
func planApplyCommit(t *testing.T, ctx context.Context, conn *pgx.Conn, streams []uuid.UUID, names, models []string,
	lastIDs []uuid.UUID, since []int32, appliedStreams []uuid.UUID, appliedNames []string, applied []uuid.UUID) planStatement {
	t.Helper()
	planCalls(t, func(q *db.Queries) error {
		_, err := q.PairsApplyCommit(ctx, db.PairsApplyCommitParams{StreamIds: streams, PerspectiveNames: names})
		return err
	}, "wh_apply_commit")
	return planStatement{
		name: "wh_apply_commit",
		call: planFunctionCall(t, ctx, conn, "wh_apply_commit", "", " INTO deleted",
			streams, names, models, lastIDs, since, appliedStreams, appliedNames, applied),
		other:  map[string][]string{"wh_perspective_cursors": planPairIndexes},
		probed: []string{"wh_perspective_cursors"},
	}
}

// planEnsureCursors is the statement of wh_ensure_cursors (CursorsEnsure's) for the given
// pairs: a probe of the cursors' key for each.
func planEnsureCursors(t *testing.T, ctx context.Context, conn *pgx.Conn, streams []uuid.UUID, names []string) planStatement {
	t.Helper()
	planCalls(t, func(q *db.Queries) error {
		_, err := q.CursorsEnsure(ctx, db.CursorsEnsureParams{StreamIds: streams, PerspectiveNames: names})
		return err
	}, "wh_ensure_cursors")
	return planStatement{
		name:   "wh_ensure_cursors",
		call:   planFunctionCall(t, ctx, conn, "wh_ensure_cursors", "", "", streams, names),
		other:  map[string][]string{"wh_perspective_cursors": planPairIndexes},
		probed: []string{"wh_perspective_cursors"},
	}
}

// planSnapshotIDs is the statement of wh_snapshot_ids (PairsLockForApply's read of a pair's
// snapshots) for the pair (stream, name): a probe of the snapshots' key.
func planSnapshotIDs(t *testing.T, ctx context.Context, conn *pgx.Conn, stream uuid.UUID, name string) planStatement {
	t.Helper()
	return planStatement{
		name:   "wh_snapshot_ids",
		call:   planFunctionCall(t, ctx, conn, "wh_snapshot_ids", "", " INTO ids", stream, name),
		other:  map[string][]string{"wh_perspective_snapshots": {"wh_perspective_snapshots_pkey"}},
		probed: []string{"wh_perspective_snapshots"},
	}
}

// planLockCursors is the statement of wh_lock_cursors (PairsLockForApply's lock of the cursor
// rows) for the given pairs: a probe of the cursors' key for each.
func planLockCursors(t *testing.T, ctx context.Context, conn *pgx.Conn, streams []uuid.UUID, names []string) planStatement {
	t.Helper()
	return planStatement{
		name:   "wh_lock_cursors",
		call:   planFunctionCall(t, ctx, conn, "wh_lock_cursors", "", "", streams, names),
		other:  map[string][]string{"wh_perspective_cursors": planPairIndexes},
		probed: []string{"wh_perspective_cursors"},
	}
}

// A hot pair alone in its group, with statistics that know it (200,000 queued events, a
// tenth of which the planner expects a batch to read): the batch's read of the store must
// stay key probes, and cheap enough in the planner's eyes that PostgreSQL does not
// JIT-compile it (jit is on by default; compiling costs more than the batch). Joined with
// the queue's probe, the store was read whole by a hash join for every batch of 100.
func TestPlansSQLAHotPairReadsTheStoreByKey(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	d, err := pgtest.Create(ctx, "plans_hot")
	require.NoError(t, err)
	defer d.Close()
	conn := planConnect(t, ctx, d)
	hot := uuid.New()
	planActiveBuild(t, ctx, conn, planBuildA)
	planExec(t, ctx, conn, `INSERT INTO wh_event_store (event_id, stream_id, event_type, data)
		SELECT gen_random_uuid(), $1::uuid, 'hot', '{}'::jsonb FROM generate_series(1, 200000)`, hot)
	planExec(t, ctx, conn, `INSERT INTO wh_perspective_events (stream_id, perspective_name, event_id)
		SELECT stream_id, $1, event_id FROM wh_event_store`, planBuildA)
	planExec(t, ctx, conn, "ANALYZE")
	planExec(t, ctx, conn, "SET jit = on")
	var mid uuid.UUID
	require.NoError(t, conn.QueryRow(ctx, `SELECT event_id FROM wh_perspective_events ORDER BY event_id OFFSET 100000 LIMIT 1`).Scan(&mid))
	read := func(after []uuid.UUID) planCall {
		return planRecord(t, func(q *db.Queries) error {
			_, err := q.QueueEventsForPairs(ctx, db.QueueEventsForPairsParams{
				StreamIds: []uuid.UUID{hot}, PerspectiveNames: []string{planBuildA}, AfterEventIds: after, PerPairLimit: 100,
			})
			return err
		})
	}
	for _, s := range []planStatement{{
		name: "QueueEventsForPairs (a hot pair alone, analyzed)", call: read([]uuid.UUID{uuid.Nil}),
		queue: planQueuePKey, cond: []string{"(stream_id = ", "(perspective_name = "}, limit: true,
		other:  map[string][]string{"wh_event_store": {"wh_event_store_pkey"}},
		probed: []string{"wh_event_store"},
	}, {
		// A job that follows its pair's full batch: the probe starts at its bound.
		name: "QueueEventsForPairs (a hot pair alone, analyzed, above a bound)", call: read([]uuid.UUID{mid}),
		queue: planQueuePKey, cond: []string{"(stream_id = ", "(perspective_name = ", "(event_id > "}, limit: true,
		other:  map[string][]string{"wh_event_store": {"wh_event_store_pkey"}},
		probed: []string{"wh_event_store"},
	}} {
		planCheck(t, ctx, conn, s)
		for _, mode := range []string{"force_generic_plan", "force_custom_plan"} {
			text, err := planExplainAs(ctx, conn, "TEXT", mode, s.call)
			require.NoError(t, err)
			require.NotContains(t, text, "JIT:", "%s (%s) is JIT-compiled at every batch:\n%s", s.name, mode, text)
		}
	}
}

// A lone pair's batch (a hot stream) runs the group's reads with one-element arrays, once
// for every 100 events. Planned for the arrays' lengths, a call of PairsLockForApply,
// QueueEventsForPairs or ModelsGet could be planned again every time (a custom plan looks
// cheaper than the generic one for one element; in BenchmarkHotStream all three were, about
// 0.5 ms of the batch); each must settle on its generic plan after PostgreSQL's first five
// custom plans, as prepared through the generated code.
func TestPlansSQLALonePairsReadsKeepOneGenericPlan(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	d, err := pgtest.Create(ctx, "plans_generic")
	require.NoError(t, err)
	defer d.Close()
	conn, err := pgx.Connect(ctx, d.DirectURL) // pgx's default mode: each statement prepared once
	require.NoError(t, err)
	defer conn.Close(context.Background())

	const build = "generic"
	stream := uuid.New()
	planActiveBuild(t, ctx, conn, build)
	planExec(t, ctx, conn, `INSERT INTO wh_event_store (event_id, stream_id, event_type, data)
		SELECT gen_random_uuid(), $1::uuid, 'hot', '{}'::jsonb FROM generate_series(1, 1000)`, stream)
	planExec(t, ctx, conn, `INSERT INTO wh_perspective_events (stream_id, perspective_name, event_id)
		SELECT stream_id, $1, event_id FROM wh_event_store`, build)
	planExec(t, ctx, conn, `INSERT INTO wh_perspective_cursors (stream_id, perspective_name, last_event_id)
		VALUES ($1, $2, '00000000-0000-0000-0000-000000000001')`, stream, build)
	planExec(t, ctx, conn, `INSERT INTO wh_perspective_models (stream_id, perspective_name, model, last_event_id)
		VALUES ($1, $2, '{}', '00000000-0000-0000-0000-000000000001')`, stream, build)
	planExec(t, ctx, conn, "ANALYZE")

	streams, names := []uuid.UUID{stream}, []string{build}
	for range 12 {
		tx, err := conn.Begin(ctx)
		require.NoError(t, err)
		q := db.New(tx)
		locked, err := q.PairsLockForApply(ctx, db.PairsLockForApplyParams{StreamIds: streams, PerspectiveNames: names})
		require.NoError(t, err)
		require.Len(t, locked, 1)
		events, err := q.QueueEventsForPairs(ctx, db.QueueEventsForPairsParams{
			StreamIds: streams, PerspectiveNames: names, AfterEventIds: []uuid.UUID{uuid.Nil}, PerPairLimit: 100,
		})
		require.NoError(t, err)
		require.Len(t, events, 100)
		models, err := q.ModelsGet(ctx, db.ModelsGetParams{StreamIds: streams, PerspectiveNames: names})
		require.NoError(t, err)
		require.Len(t, models, 1)
		require.NoError(t, tx.Rollback(ctx))
	}

	plans := map[string][2]int64{}
	rows, err := conn.Query(ctx, `SELECT substring(statement FROM '^-- name: (\w+)'), generic_plans, custom_plans
		FROM pg_prepared_statements WHERE statement LIKE '-- name: %'`)
	require.NoError(t, err)
	for rows.Next() {
		var name string
		var generic, custom int64
		require.NoError(t, rows.Scan(&name, &generic, &custom))
		plans[name] = [2]int64{generic, custom}
	}
	require.NoError(t, rows.Err())
	for _, name := range []string{"PairsLockForApply", "QueueEventsForPairs", "ModelsGet"} {
		p, ok := plans[name]
		require.True(t, ok, "%s prepared on the connection: %v", name, plans)
		require.LessOrEqual(t, p[1], int64(5), "%s planned for its arguments at every call (generic %d, custom %d)", name, p[0], p[1])
		require.GreaterOrEqual(t, p[0], int64(7), "%s ran its generic plan (generic %d, custom %d)", name, p[0], p[1])
	}
}
