-- Read-your-writes (worker.WaitFor): whether an event is in the model LoadModel serves.

-- name: WaitCheck :one
-- Where an event of a stream stands in a perspective's active build (a name without builds:
-- its own rows), in one statement, so that a promotion is seen whole or not at all:
--   registered: the perspective is registered; stored: the event is stored in that stream;
--   applied:    the pair's cursor is at or after the event and the event has no queue row
--               for the pair (a late event that sorts before the cursor stays queued until a
--               rewind applies it), so the model includes it, unless it was skipped;
--   skipped_*:  the event's row in wh_skipped_events for the pair (NULL: not skipped);
--   the pair's failure state, with status 'parked' when it waits for an operator.
-- Every table is read by one probe of its primary key (the active build by its partial
-- unique index): the cost does not grow with the data.
SELECT
    EXISTS (SELECT 1 FROM wh_perspectives p WHERE p.perspective_name = @perspective_name::text)::bool AS registered,
    EXISTS (SELECT 1 FROM wh_event_store e
            WHERE e.event_id = @event_id::uuid AND e.stream_id = @stream_id::uuid)::bool AS stored,
    k.version::int AS version,
    COALESCE(c.last_event_id >= @event_id::uuid
             AND NOT EXISTS (SELECT 1 FROM wh_perspective_events q
                             WHERE q.stream_id = @stream_id::uuid
                               AND q.perspective_name = k.build_key
                               AND q.event_id = @event_id::uuid), false)::bool AS applied,
    COALESCE(c.status, 'ok')::text AS status,
    c.failed_event_id,
    COALESCE(c.attempts, 0)::int AS attempts,
    COALESCE(c.last_error, '')::text AS last_error,
    c.failed_since,
    s.skipped_at,
    COALESCE(s.skipped_by, '')::text AS skipped_by,
    COALESCE(s.reason, '')::text AS skipped_reason
FROM (
    SELECT COALESCE(b.build_key, @perspective_name::text)::text AS build_key,
           COALESCE(b.version, 1)::int AS version
    FROM (SELECT 1) one
    LEFT JOIN wh_perspective_builds b
      ON b.perspective_name = @perspective_name::text AND b.state = 'active'
) k
LEFT JOIN wh_perspective_cursors c
  ON c.stream_id = @stream_id::uuid AND c.perspective_name = k.build_key
LEFT JOIN wh_skipped_events s
  ON s.stream_id = @stream_id::uuid AND s.perspective_name = k.build_key AND s.event_id = @event_id::uuid;
