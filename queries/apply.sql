-- The normal path's statements, fused so that applying a pair's queued events costs few
-- round trips: lock the cursor (with the snapshot check), then write model, cursor and
-- queue together.

-- name: PairLockForApply :one
-- Locks the pair's cursor row for a short write, skipping it when another transaction
-- holds it (no row). Returns the cursor and whether any snapshot exists.
-- The model is NOT read here but by a later statement of the transaction: under READ
-- COMMITTED a row locked after a concurrent commit is returned in its newest version, while
-- rows joined from other tables stay as of the statement's snapshot, so a model read here
-- could predate the cursor it came with (a rewind that committed meanwhile keeps the cursor
-- position but changes the model).
SELECT c.last_event_id,
       c.version,
       c.events_since_snapshot,
       c.attempts,
       c.stream_lock_instance_id,
       COALESCE(c.stream_lock_expiry > clock_timestamp(), false)::bool AS lock_live,
       EXISTS (
           SELECT 1 FROM wh_perspective_snapshots s
           WHERE s.stream_id = c.stream_id AND s.perspective_name = c.perspective_name
       )::bool AS has_snapshot
FROM wh_perspective_cursors c
WHERE c.stream_id = @stream_id AND c.perspective_name = @perspective_name
FOR UPDATE OF c SKIP LOCKED;

-- name: PairApplyCommit :one
-- Stores the model at last_event_id, advances the cursor (bumping its version) and deletes
-- the applied queue rows, in one statement. Returns how many queue rows were deleted.
WITH model AS (
    INSERT INTO wh_perspective_models (stream_id, perspective_name, model, last_event_id)
    VALUES (@stream_id, @perspective_name, @model, @last_event_id)
    ON CONFLICT (stream_id, perspective_name) DO UPDATE
    SET model = EXCLUDED.model,
        last_event_id = EXCLUDED.last_event_id,
        updated_at = now()
), cursor_row AS (
    UPDATE wh_perspective_cursors
    SET last_event_id = @last_event_id,
        version = version + 1,
        events_since_snapshot = @events_since_snapshot,
        status = 'ok',
        last_error = NULL,
        attempts = 0,
        next_attempt_at = NULL,
        updated_at = now()
    WHERE stream_id = @stream_id AND perspective_name = @perspective_name
), applied AS (
    DELETE FROM wh_perspective_events
    WHERE stream_id = @stream_id
      AND perspective_name = @perspective_name
      AND event_id = ANY(@event_ids::uuid[])
    RETURNING 1
)
SELECT count(*)::bigint AS deleted FROM applied;

-- The group path: the same statements for many pairs at once, so that one transaction of a
-- handful of round trips applies a whole group (Config.GroupSize pairs). The pairs are
-- passed as two parallel arrays, stream_ids[i] with perspective_names[i].

-- name: PairsLockForApply :many
-- Locks the cursor rows of the given pairs, skipping those another transaction holds (and
-- those without a cursor row: see CursorsEnsure). Returns each locked cursor and whether
-- the pair has any snapshot. As with PairLockForApply, models are read by a later
-- statement.
SELECT c.stream_id,
       c.perspective_name,
       c.last_event_id,
       c.events_since_snapshot,
       c.stream_lock_instance_id,
       COALESCE(c.stream_lock_expiry > clock_timestamp(), false)::bool AS lock_live,
       EXISTS (
           SELECT 1 FROM wh_perspective_snapshots s
           WHERE s.stream_id = c.stream_id AND s.perspective_name = c.perspective_name
       )::bool AS has_snapshot
FROM (SELECT unnest(@stream_ids::uuid[]) AS stream_id, unnest(@perspective_names::text[]) AS perspective_name) p
JOIN wh_perspective_cursors c
  ON c.stream_id = p.stream_id AND c.perspective_name = p.perspective_name
FOR UPDATE OF c SKIP LOCKED;

-- name: CursorsMissing :many
-- Which of the given pairs have no cursor row. A plain read: it never waits for a row that
-- another transaction holds (CursorsEnsure's ON CONFLICT would, for a row that transaction
-- updated).
SELECT p.stream_id::uuid AS stream_id, p.perspective_name::text AS perspective_name
FROM (SELECT unnest(@stream_ids::uuid[]) AS stream_id, unnest(@perspective_names::text[]) AS perspective_name) p
WHERE NOT EXISTS (
    SELECT 1 FROM wh_perspective_cursors c
    WHERE c.stream_id = p.stream_id AND c.perspective_name = p.perspective_name
);

-- name: CursorsEnsure :many
-- Creates the missing cursor rows of the given pairs and returns the pairs it created.
-- An existing row is left alone; but when another transaction has updated it and is still
-- open, this waits for that transaction (pass only pairs CursorsMissing reported).
INSERT INTO wh_perspective_cursors (stream_id, perspective_name)
SELECT unnest(@stream_ids::uuid[]), unnest(@perspective_names::text[])
ON CONFLICT (stream_id, perspective_name) DO NOTHING
RETURNING stream_id, perspective_name;

-- name: QueueEventsForPairs :many
-- The queued events of the given pairs with their data: at most per_pair_limit per pair,
-- the lowest event IDs of each.
SELECT q.stream_id, q.perspective_name, q.event_id, e.event_type, e.data, e.created_at
FROM (SELECT unnest(@stream_ids::uuid[]) AS stream_id, unnest(@perspective_names::text[]) AS perspective_name) p
CROSS JOIN LATERAL (
    SELECT qe.stream_id, qe.perspective_name, qe.event_id
    FROM wh_perspective_events qe
    WHERE qe.stream_id = p.stream_id AND qe.perspective_name = p.perspective_name
    ORDER BY qe.event_id
    LIMIT @per_pair_limit
) q
JOIN wh_event_store e ON e.event_id = q.event_id;

-- name: ModelsGet :many
-- The models of the given pairs (pairs without a model have no row).
SELECT m.stream_id, m.perspective_name, m.model, m.last_event_id
FROM (SELECT unnest(@stream_ids::uuid[]) AS stream_id, unnest(@perspective_names::text[]) AS perspective_name) p
JOIN wh_perspective_models m
  ON m.stream_id = p.stream_id AND m.perspective_name = p.perspective_name;

-- name: PairsApplyCommit :one
-- PairApplyCommit for many pairs: pair i's model is models[i] at last_event_ids[i] with
-- events_since_snapshot[i]; the applied queue rows are given as three parallel arrays
-- (applied_stream_ids, applied_perspective_names, applied_event_ids). Returns how many queue
-- rows were deleted.
WITH input AS (
    SELECT unnest(@stream_ids::uuid[]) AS stream_id,
           unnest(@perspective_names::text[]) AS perspective_name,
           unnest(@models::jsonb[]) AS model,
           unnest(@last_event_ids::uuid[]) AS last_event_id,
           unnest(@events_since_snapshot::int[]) AS since_snapshot
), model AS (
    INSERT INTO wh_perspective_models (stream_id, perspective_name, model, last_event_id)
    SELECT i.stream_id, i.perspective_name, i.model, i.last_event_id FROM input i
    ON CONFLICT (stream_id, perspective_name) DO UPDATE
    SET model = EXCLUDED.model,
        last_event_id = EXCLUDED.last_event_id,
        updated_at = now()
), cursor_rows AS (
    UPDATE wh_perspective_cursors c
    SET last_event_id = i.last_event_id,
        version = c.version + 1,
        events_since_snapshot = i.since_snapshot,
        status = 'ok',
        last_error = NULL,
        attempts = 0,
        next_attempt_at = NULL,
        updated_at = now()
    FROM input i
    WHERE c.stream_id = i.stream_id AND c.perspective_name = i.perspective_name
), applied AS (
    DELETE FROM wh_perspective_events q
    USING (
        SELECT unnest(@applied_stream_ids::uuid[]) AS stream_id,
               unnest(@applied_perspective_names::text[]) AS perspective_name,
               unnest(@applied_event_ids::uuid[]) AS event_id
    ) d
    WHERE q.stream_id = d.stream_id
      AND q.perspective_name = d.perspective_name
      AND q.event_id = d.event_id
    RETURNING 1
)
SELECT count(*)::bigint AS deleted FROM applied;
