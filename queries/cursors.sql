-- Cursor rows: the lock a long operation's final write takes, and the failed ones listed.

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

-- name: CursorsFailed :many
SELECT c.stream_id, c.perspective_name, c.attempts, c.last_error, d.due_at AS next_attempt_at, c.updated_at
FROM wh_perspective_cursors c
-- when it is retried (none while parked: 'infinity')
LEFT JOIN wh_perspective_pairs d
  ON d.stream_id = c.stream_id AND d.perspective_name = c.perspective_name AND d.due_at < 'infinity'
WHERE c.status <> 'ok'
ORDER BY c.perspective_name, c.updated_at;
