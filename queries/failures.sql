-- name: PairsFailed :many
-- The failing and parked pairs of the builds that are not retired (of one perspective, or of
-- all when perspective_name is NULL), parked first, then oldest failure first, with the
-- failing event's type (NULL: not one event's failure, or the event is not stored).
SELECT c.stream_id, b.perspective_name, b.version, b.build_key, c.status,
       c.failed_event_id, e.event_type AS failed_event_type,
       c.attempts, COALESCE(c.last_error, '')::text AS last_error,
       COALESCE(c.failed_since, c.updated_at)::timestamptz AS failed_since,
       d.due_at AS next_attempt_at
FROM wh_perspective_builds b
JOIN wh_perspective_cursors c ON c.perspective_name = b.build_key AND c.status <> 'ok'
-- when it is due next (none while parked: 'infinity')
LEFT JOIN wh_perspective_pairs d
  ON d.stream_id = c.stream_id AND d.perspective_name = c.perspective_name AND d.due_at < 'infinity'
LEFT JOIN wh_event_store e ON e.event_id = c.failed_event_id
WHERE b.state <> 'retired'
  AND (sqlc.narg(perspective_name)::text IS NULL OR b.perspective_name = sqlc.narg(perspective_name)::text)
ORDER BY c.status = 'parked' DESC, COALESCE(c.failed_since, c.updated_at), c.stream_id
LIMIT @max_rows;

-- name: PairsRetry :many
-- Makes the failing and parked pairs of a perspective's builds that are not retired (of one
-- stream, or all when stream_id is NULL) due now: status 'failed' until an application
-- succeeds, attempts kept, so a pair that fails again goes straight back to its policy (a
-- parked pair is parked again). One row per pair, whatever its backlog: its cursor's status
-- and its due row. Wakes the workers. Returns the pairs.
WITH cur AS (
    UPDATE wh_perspective_cursors c
    SET status = 'failed', updated_at = now()
    FROM wh_perspective_builds b
    WHERE b.perspective_name = @perspective_name AND b.state <> 'retired'
      AND c.perspective_name = b.build_key
      AND c.status <> 'ok'
      AND (sqlc.narg(stream_id)::uuid IS NULL OR c.stream_id = sqlc.narg(stream_id)::uuid)
    RETURNING c.stream_id, c.perspective_name, b.version
), due AS (
    UPDATE wh_perspective_pairs d
    SET due_at = now(), leased_by = NULL
    FROM cur
    WHERE d.stream_id = cur.stream_id AND d.perspective_name = cur.perspective_name
)
SELECT cur.stream_id, cur.perspective_name AS build_key, cur.version
FROM cur
WHERE (SELECT count(*) FROM (SELECT pg_notify('wh_perspective_events', '') FROM cur LIMIT 1) n) >= 0;

-- name: EventSkip :many
-- An operator skips an event of a stream in the given builds: for each build where the event
-- is queued for the stream's pair or is its failing event, the skip is recorded (who, and the
-- pair's failures so far), the event unqueued, and the cursor version bumped (a rewind in
-- flight, which replayed it, is refused and retried). When it was the failing event, the
-- failure state clears and the pair's other rows are due now. Wakes the workers and the
-- waiters (WaitFor). Returns the builds it skipped the event in.
WITH target AS (
    SELECT c.stream_id, c.perspective_name, c.attempts, c.last_error,
           (c.failed_event_id IS NOT DISTINCT FROM @event_id::uuid OR c.status = 'ok') AS clears
    FROM wh_perspective_cursors c
    WHERE c.stream_id = @stream_id
      AND c.perspective_name = ANY(@build_keys::text[])
      AND (c.failed_event_id = @event_id::uuid
           OR EXISTS (SELECT 1 FROM wh_perspective_events q
                      WHERE q.stream_id = c.stream_id AND q.perspective_name = c.perspective_name
                        AND q.event_id = @event_id::uuid))
    FOR UPDATE OF c
), recorded AS (
    INSERT INTO wh_skipped_events (stream_id, perspective_name, event_id, skipped_by, reason, attempts, last_error)
    SELECT t.stream_id, t.perspective_name, @event_id::uuid, @skipped_by::text, 'operator', t.attempts, t.last_error
    FROM target t
    ON CONFLICT DO NOTHING
), unqueued AS (
    DELETE FROM wh_perspective_events q
    USING target t
    WHERE q.stream_id = t.stream_id AND q.perspective_name = t.perspective_name
      AND q.event_id = @event_id::uuid
), cur AS (
    UPDATE wh_perspective_cursors c
    SET version = c.version + 1,
        status = CASE WHEN t.clears THEN 'ok' ELSE c.status END,
        last_error = CASE WHEN t.clears THEN NULL ELSE c.last_error END,
        failed_event_id = CASE WHEN t.clears THEN NULL ELSE c.failed_event_id END,
        failed_since = CASE WHEN t.clears THEN NULL ELSE c.failed_since END,
        attempts = CASE WHEN t.clears THEN 0 ELSE c.attempts END,
        updated_at = now()
    FROM target t
    WHERE c.stream_id = t.stream_id AND c.perspective_name = t.perspective_name
), due AS (
    UPDATE wh_perspective_pairs d
    SET due_at = now(), leased_by = NULL
    FROM target t
    WHERE t.clears
      AND d.stream_id = t.stream_id AND d.perspective_name = t.perspective_name
)
SELECT t.perspective_name AS build_key
FROM target t
WHERE (SELECT count(*) FROM (
          (SELECT pg_notify('wh_perspective_events', '') FROM target LIMIT 1)
          UNION ALL
          (SELECT pg_notify('wh_applied', '') FROM target LIMIT 1)) n) >= 0;

-- name: SkippedEvents :many
-- The skipped events of a perspective's builds that are not retired (or of all when
-- perspective_name is NULL), newest first.
SELECT s.stream_id, b.perspective_name, b.version, s.event_id, e.event_type,
       s.skipped_at, s.skipped_by, s.reason, s.attempts, COALESCE(s.last_error, '')::text AS last_error
FROM wh_skipped_events s
JOIN wh_perspective_builds b ON b.build_key = s.perspective_name AND b.state <> 'retired'
LEFT JOIN wh_event_store e ON e.event_id = s.event_id
WHERE sqlc.narg(perspective_name)::text IS NULL OR b.perspective_name = sqlc.narg(perspective_name)::text
ORDER BY s.skipped_at DESC, s.stream_id, s.event_id
LIMIT @max_rows;
