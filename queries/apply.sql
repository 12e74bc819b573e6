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
