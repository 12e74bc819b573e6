-- name: CursorEnsure :exec
INSERT INTO wh_perspective_cursors (stream_id, perspective_name)
VALUES (@stream_id, @perspective_name)
ON CONFLICT (stream_id, perspective_name) DO NOTHING;

-- name: CursorGet :one
SELECT stream_id, perspective_name, last_event_id, version, status, last_error, attempts,
       events_since_snapshot,
       stream_lock_instance_id,
       COALESCE(stream_lock_expiry > clock_timestamp(), false)::bool AS lock_live
FROM wh_perspective_cursors
WHERE stream_id = @stream_id AND perspective_name = @perspective_name;

-- name: CursorLock :one
-- Locks the cursor row, waiting for other writers (final writes of long operations).
-- lock_live uses clock_timestamp(): the fencing check must see the time after the wait.
SELECT last_event_id, version, events_since_snapshot, attempts, stream_lock_instance_id,
       COALESCE(stream_lock_expiry > clock_timestamp(), false)::bool AS lock_live
FROM wh_perspective_cursors
WHERE stream_id = @stream_id AND perspective_name = @perspective_name
FOR UPDATE;

-- name: CursorMarkFailed :one
-- Records a failure and schedules the retry with exponential backoff; returns the retry time.
UPDATE wh_perspective_cursors
SET status = 'failed',
    last_error = @last_error,
    attempts = attempts + 1,
    next_attempt_at = now() + make_interval(secs => @backoff_seconds::float8),
    updated_at = now()
WHERE stream_id = @stream_id AND perspective_name = @perspective_name
RETURNING attempts, next_attempt_at::timestamptz AS next_attempt_at;

-- name: CursorReset :exec
UPDATE wh_perspective_cursors
SET last_event_id = NULL,
    version = version + 1,
    events_since_snapshot = 0,
    status = 'ok',
    last_error = NULL,
    attempts = 0,
    next_attempt_at = NULL,
    updated_at = now()
WHERE stream_id = @stream_id AND perspective_name = @perspective_name;

-- name: CursorsFailed :many
SELECT stream_id, perspective_name, attempts, last_error, next_attempt_at, updated_at
FROM wh_perspective_cursors
WHERE status = 'failed'
ORDER BY perspective_name, updated_at;
