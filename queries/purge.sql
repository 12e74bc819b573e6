-- A purge (worker/purge.go): the model deleted and the cursor reset.

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

-- name: ModelDelete :execrows
DELETE FROM wh_perspective_models
WHERE stream_id = @stream_id AND perspective_name = @perspective_name;

-- name: PairNotifyIfDue :exec
-- Tells the listening workers that the pair is due, when it is (its due row due now): after
-- its stream lock is released, whose holder made it due meanwhile (a purge resetting a
-- failing pair's cursor, a rebuild queueing the stream again) while the claims skipped it.
SELECT pg_notify('wh_perspective_events', '')
FROM wh_perspective_pairs d
WHERE d.stream_id = @stream_id AND d.perspective_name = @perspective_name AND d.due_at <= now();
