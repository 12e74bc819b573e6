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

-- name: CursorsLockOfStream :exec
-- Locks the cursor rows of a stream's pairs in the given builds, in key order: the first
-- statement of an operator's skip (EventSkip runs next, in the same transaction).
SELECT 1
FROM wh_perspective_cursors c
WHERE c.stream_id = @stream_id AND c.perspective_name = ANY(@build_keys::text[])
ORDER BY c.perspective_name
FOR UPDATE OF c;

-- name: EventSkip :many
-- An operator skips an event of a stream in the given builds: for each build where the event
-- is queued for the stream's pair or is its failing event, the skip is recorded (who, and the
-- pair's failures so far), the event unqueued, and the cursor version bumped (a rewind in
-- flight, which replayed it, is refused and retried). When it was the failing event, the
-- failure state clears and the pair's other rows are due now. Wakes the workers and the
-- waiters (WaitFor). Returns the builds it skipped the event in.
-- It runs after CursorsLockOfStream, in the same transaction, so that what it reads of the
-- queue is as of after those locks: in one statement, a lock that waited for an apply
-- transaction committing the event would be followed by a read of the queue as of before
-- that commit, and the skip of an event just applied would be recorded.
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

-- name: PairsMarkFailed :many
-- Records a failure of each given pair on its cursor and its due row: errors[i] caused by
-- event_ids[i] (the nil UUID: not one event's), and does what actions[i] says (the worker's
-- failure policy decided it from the pair's failures of that event so far; a failure of
-- another event than the recorded one starts a new count):
--   'retry': status 'failed', due after the backoff (base_seconds doubled per earlier
--            failure, capped at max_seconds, from now);
--   'park':  status 'parked', due never ('infinity') until an operator retries or skips;
--   'skip':  the event is recorded in wh_skipped_events (skipped_by, reason 'policy') and
--            unqueued; the pair's failure state clears and it is due now. Its version is
--            bumped: a rewind in flight, which replayed the event, is refused;
--   'lost':  the operation's stream lock was lost (no failure of the pair's): the error is
--            recorded and the pair is due after the backoff of its failures so far, but its
--            count, its failing event and its status (but 'ok', which becomes 'failed') stay.
-- One row per pair is written whatever its backlog: the cursor and the due row (created if
-- the pair has none, its lease ended). Parking and skipping notify wh_applied (WaitFor
-- wakes), skipping also wh_perspective_events (the pair is due now). Returns each pair's
-- action.
WITH input AS (
    SELECT unnest(@stream_ids::uuid[]) AS stream_id,
           unnest(@perspective_names::text[]) AS perspective_name,
           unnest(@errors::text[]) AS error,
           unnest(@event_ids::uuid[]) AS event_id,
           unnest(@actions::text[]) AS action,
           @base_seconds::float8 AS base_seconds,
           @max_seconds::float8 AS max_seconds
), same AS (
    -- before: the pair's failures in a row of the same event (of no event: the same too)
    SELECT i.*, c.failed_since,
           NULLIF(i.event_id, '00000000-0000-0000-0000-000000000000') AS failing,
           CASE WHEN i.action = 'lost' OR c.failed_event_id IS NOT DISTINCT FROM NULLIF(i.event_id, '00000000-0000-0000-0000-000000000000')
                THEN c.attempts ELSE 0 END AS before
    FROM input i
    JOIN wh_perspective_cursors c
      ON c.stream_id = i.stream_id AND c.perspective_name = i.perspective_name
), old AS (
    -- The backoff runs from this statement's time, not its transaction's start: recorded in
    -- an apply transaction, a failure comes after its Apply ran, maybe for long.
    SELECT s.stream_id, s.perspective_name, s.before AS attempts, s.error, s.action, s.failing AS event_id,
           CASE WHEN s.before > 0 THEN s.failed_since END AS failed_since,
           CASE WHEN s.action IN ('retry', 'lost') THEN clock_timestamp() + interval '1 second' * LEAST(
                   s.max_seconds, s.base_seconds * power(2, LEAST(s.before, 40)))
               WHEN s.action = 'park' THEN 'infinity'::timestamptz
               ELSE clock_timestamp()
           END AS due
    FROM same s
), cur AS (
    UPDATE wh_perspective_cursors c
    SET status = CASE o.action WHEN 'retry' THEN 'failed' WHEN 'park' THEN 'parked'
                     WHEN 'lost' THEN CASE WHEN c.status = 'ok' THEN 'failed' ELSE c.status END ELSE 'ok' END,
        last_error = CASE WHEN o.action = 'skip' THEN NULL ELSE o.error END,
        failed_event_id = CASE o.action WHEN 'skip' THEN NULL WHEN 'lost' THEN c.failed_event_id ELSE o.event_id END,
        failed_since = CASE o.action WHEN 'skip' THEN NULL WHEN 'lost' THEN COALESCE(c.failed_since, now())
                           ELSE COALESCE(o.failed_since, now()) END,
        attempts = CASE o.action WHEN 'skip' THEN 0 WHEN 'lost' THEN c.attempts ELSE o.attempts + 1 END,
        version = CASE WHEN o.action = 'skip' THEN c.version + 1 ELSE c.version END,
        updated_at = now()
    FROM old o
    WHERE c.stream_id = o.stream_id AND c.perspective_name = o.perspective_name
    RETURNING c.stream_id, c.perspective_name
), skipped AS (
    INSERT INTO wh_skipped_events (stream_id, perspective_name, event_id, skipped_by, reason, attempts, last_error)
    SELECT o.stream_id, o.perspective_name, o.event_id, @skipped_by::text, 'policy', o.attempts + 1, o.error
    FROM old o
    WHERE o.action = 'skip' AND o.event_id IS NOT NULL
    ON CONFLICT DO NOTHING
), unqueued AS (
    DELETE FROM wh_perspective_events q
    USING old o
    WHERE o.action = 'skip'
      AND q.stream_id = o.stream_id AND q.perspective_name = o.perspective_name AND q.event_id = o.event_id
), due AS (
    INSERT INTO wh_perspective_pairs (stream_id, perspective_name, due_at)
    SELECT o.stream_id, o.perspective_name, o.due FROM old o
    ON CONFLICT (stream_id, perspective_name) DO UPDATE
    SET due_at = EXCLUDED.due_at, leased_by = NULL
)
SELECT o.stream_id, o.perspective_name, o.action::text AS action
FROM old o
WHERE (SELECT count(*) FROM (
          SELECT pg_notify('wh_applied', '') FROM old WHERE action IN ('park', 'skip')
          UNION ALL
          SELECT pg_notify('wh_perspective_events', '') FROM old WHERE action = 'skip') n) >= 0;

-- name: CursorFailuresLock :one
-- Locks the cursor row (waiting for other writers) and returns its failures in a row, and
-- the event they are of (NULL: none, or not one event's).
SELECT attempts, failed_event_id FROM wh_perspective_cursors
WHERE stream_id = @stream_id AND perspective_name = @perspective_name
FOR UPDATE;
