-- name: CursorGet :one
SELECT stream_id, perspective_name, last_event_id, version, status, last_error, attempts,
       events_since_snapshot,
       stream_lock_instance_id,
       COALESCE(stream_lock_expiry > clock_timestamp(), false)::bool AS lock_live
FROM wh_perspective_cursors
WHERE stream_id = @stream_id AND perspective_name = @perspective_name;

-- name: CursorFailuresLock :one
-- Locks the cursor row (waiting for other writers) and returns its failures in a row, and
-- the event they are of (NULL: none, or not one event's).
SELECT attempts, failed_event_id FROM wh_perspective_cursors
WHERE stream_id = @stream_id AND perspective_name = @perspective_name
FOR UPDATE;

-- name: CursorLock :one
-- Locks the cursor row, waiting for other writers (final writes of long operations).
-- lock_holder is the holder of an unexpired stream lock (the nil UUID: none), judged with clock_timestamp(): the
-- fencing check must see the time after the wait.
SELECT last_event_id, version,
       COALESCE(CASE WHEN stream_lock_expiry > clock_timestamp() THEN stream_lock_instance_id END,
                '00000000-0000-0000-0000-000000000000')::uuid AS lock_holder
FROM wh_perspective_cursors
WHERE stream_id = @stream_id AND perspective_name = @perspective_name
FOR UPDATE;

-- name: CursorReset :exec
-- Resets the pair's cursor (purge): no position, no failure; its queued rows (of a pair
-- that was failing or parked) are due now (its due row, when it has one; its lease, if any,
-- is kept), which the listening workers are told.
WITH cur AS (
    UPDATE wh_perspective_cursors c
    SET last_event_id = NULL,
        version = c.version + 1,
        events_since_snapshot = 0,
        status = 'ok',
        last_error = NULL,
        failed_event_id = NULL,
        failed_since = NULL,
        attempts = 0,
        updated_at = now()
    WHERE c.stream_id = @stream_id AND c.perspective_name = @perspective_name
    RETURNING c.stream_id, c.perspective_name
), due AS (
    UPDATE wh_perspective_pairs d
    SET due_at = now()
    FROM cur
    WHERE d.stream_id = cur.stream_id AND d.perspective_name = cur.perspective_name
      AND d.due_at > now() AND d.leased_by IS NULL
    RETURNING 1
)
SELECT pg_notify('wh_perspective_events', '') WHERE EXISTS (SELECT 1 FROM due);

-- name: CursorsFailed :many
SELECT c.stream_id, c.perspective_name, c.attempts, c.last_error, d.due_at AS next_attempt_at, c.updated_at
FROM wh_perspective_cursors c
-- when it is retried (none while parked: 'infinity')
LEFT JOIN wh_perspective_pairs d
  ON d.stream_id = c.stream_id AND d.perspective_name = c.perspective_name AND d.due_at < 'infinity'
WHERE c.status <> 'ok'
ORDER BY c.perspective_name, c.updated_at;
