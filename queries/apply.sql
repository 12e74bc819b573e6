-- The normal path: one transaction applies the queued events of a group of (stream,
-- perspective) pairs (Config.GroupSize; a single pair is a group of one) in a handful of
-- statements. The pairs are passed as two parallel arrays, stream_ids[i] with
-- perspective_names[i].
--
-- The statements that read a group (PairsLockForApply, QueueEventsForPairs, ModelsGet) take
-- their arrays through scalar subqueries, unnest((SELECT @a)): the planner then estimates
-- every call alike, whatever the arrays' lengths, and PostgreSQL keeps one generic plan for
-- each prepared statement instead of planning every call (a custom plan is cheaper than the
-- generic one only for the array's known length). Planning them took about 0.5 ms of a
-- lone pair's batch of 100 events (worker/plans_sql_test.go pins that they are not planned
-- again).

-- name: PairsLockForApply :many
-- Locks the cursor rows of the given pairs, skipping those another transaction holds (and
-- those without a cursor row: see CursorsEnsure, and those of a retired build). Returns each locked cursor, the holder of
-- an unexpired stream lock on it (the nil UUID: none), and the pair's snapshot positions, newest first.
-- The model is NOT read here but by a later statement of the transaction (ModelsGet): under
-- READ COMMITTED a row locked after a concurrent commit is returned in its newest version,
-- while rows joined from other tables stay as of the statement's snapshot, so a model read
-- here could predate the cursor it came with (a rewind that committed meanwhile keeps the
-- cursor position but changes the model).
-- The cursor rows are locked by wh_lock_cursors and the snapshots read by wh_snapshot_ids
-- (schema/000013_apply_key_lookups.up.sql), each pair a probe of the tables' keys, with
-- sequential scans (and hash and merge joins) off, whatever the statistics say: planned as a
-- join, a single build's cursors (all of them matching its key) were once estimated at one
-- row after the retired-build check, and the join scanned every cursor for each pair (31 ms
-- for 50 pairs of 2,000 cursors); planned while the cursors were few, the lookup scanned them
-- all for each pair once they were many.
SELECT c.stream_id,
       c.perspective_name,
       c.last_event_id,
       c.events_since_snapshot,
       c.attempts,
       c.failed_event_id,
       COALESCE(CASE WHEN c.stream_lock_expiry > clock_timestamp() THEN c.stream_lock_instance_id END,
                '00000000-0000-0000-0000-000000000000')::uuid AS lock_holder,
       wh_snapshot_ids(c.stream_id, c.perspective_name)::uuid[] AS snapshot_ids
FROM wh_lock_cursors((SELECT @stream_ids::uuid[]), (SELECT @perspective_names::text[])) c;

-- name: CursorsEnsure :many
-- Creates the cursor rows of the given pairs that do not exist, in key order (two
-- transactions never insert the same rows in opposite orders), and returns the pairs it
-- created. It never waits for a row that exists, even one another open transaction updated:
-- only the pairs without a row in the statement's snapshot are inserted (ON CONFLICT alone
-- would wait for that transaction). A row another transaction is inserting at the same time
-- is waited for, then left alone; one another transaction is deleting counts as existing (a
-- lock of it that waits then finds no row).
-- The statement is wh_ensure_cursors (schema/000013_apply_key_lookups.up.sql): each pair a
-- probe of the cursors' key, whatever the statistics say.
SELECT c.stream_id, c.perspective_name
FROM wh_ensure_cursors(@stream_ids::uuid[], @perspective_names::text[]) c;

-- name: QueueEventsForPairs :many
-- The queued events of the given pairs: at most per_pair_limit per pair, the lowest event
-- IDs of each above after_event_ids[i] (the nil UUID, NULL, or past the array's end: from
-- the lowest), in no particular order. A bound starts the probe at it, past the index entries of the
-- rows applied before it (deleted, but left in the index until a vacuum).
-- Each pair is one probe of the queue's primary key, in event_id order, that stops after
-- per_pair_limit rows. The limit is read through a subquery, so the planner does not know it
-- and costs the probe as stopping early (it assumes a tenth of the rows for such a LIMIT):
-- the ordered probe always wins. Knowing the value, the planner compares it with the rows it
-- expects of a pair, the average pair's few whatever the statistics, and when the limit is
-- not below them it reads and sorts all of each pair's rows instead (a bitmap heap scan and
-- a sort): 20,000 of a hot stream for every batch of 100.
-- The events are then read from the store by their keys, as an array the planner counts as
-- a few: joined instead, the tenth of a hot stream it expects made the join a hash or merge
-- join reading the whole store for every batch, and probing by a lateral subquery cost that
-- many probes, enough for PostgreSQL to JIT-compile the statement at every batch. See
-- worker/plans_sql_test.go.
WITH q AS (
    SELECT q.perspective_name, q.event_id
    FROM (SELECT unnest((SELECT @stream_ids::uuid[])) AS stream_id, unnest((SELECT @perspective_names::text[])) AS perspective_name,
                 unnest((SELECT @after_event_ids::uuid[])) AS after_event_id) p
    CROSS JOIN LATERAL (
        SELECT qe.perspective_name, qe.event_id
        FROM wh_perspective_events qe
        WHERE qe.stream_id = p.stream_id AND qe.perspective_name = p.perspective_name
          AND qe.event_id > COALESCE(p.after_event_id, '00000000-0000-0000-0000-000000000000')
        ORDER BY qe.event_id
        LIMIT (SELECT @per_pair_limit::int)
    ) q
)
SELECT q.perspective_name, e.event_id, e.stream_id, e.event_type, e.data, e.created_at
FROM wh_event_store e
JOIN q ON q.event_id = e.event_id
WHERE e.event_id = ANY (ARRAY(SELECT q.event_id FROM q));

-- name: ModelsGet :many
-- The models of the given pairs (pairs without a model have no row). Each pair is a probe
-- of the models' key in a LATERAL subquery, whatever the statistics say (as a join it could
-- be planned as a hash join reading every model).
SELECT m.stream_id, m.perspective_name, m.model, m.last_event_id
FROM (SELECT unnest((SELECT @stream_ids::uuid[])) AS stream_id, unnest((SELECT @perspective_names::text[])) AS perspective_name) p
CROSS JOIN LATERAL (
    SELECT m.stream_id, m.perspective_name, m.model, m.last_event_id
    FROM wh_perspective_models m
    WHERE m.stream_id = p.stream_id AND m.perspective_name = p.perspective_name
    OFFSET 0 -- a subquery of its own, not flattened into a join
) m;

-- name: PairsApplyCommit :one
-- Pair i's model becomes models[i] at last_event_ids[i] with events_since_snapshot[i]; its
-- cursor advances (bumping its version) and its failure state clears; the applied queue rows
-- are deleted, given as three parallel arrays (applied_stream_ids,
-- applied_perspective_names, applied_event_ids). Returns how many queue rows were deleted.
-- It notifies wh_applied (WaitFor wakes; once per transaction, since PostgreSQL folds a
-- transaction's identical notifications): the normal path, a rewind's commit and a
-- catch-up's page all make their events visible through this statement.
-- The statement is wh_apply_commit (schema/000013_apply_key_lookups.up.sql): each pair's
-- cursor row by its key, each applied row by the queue's primary key, whatever the statistics
-- say.
SELECT wh_apply_commit(@stream_ids::uuid[], @perspective_names::text[], @models::text[], @last_event_ids::uuid[],
                       @events_since_snapshot::int[], @applied_stream_ids::uuid[],
                       @applied_perspective_names::text[], @applied_event_ids::uuid[])::bigint AS deleted;
