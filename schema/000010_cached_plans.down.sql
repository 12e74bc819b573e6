-- Back to 000009: the claim and the deletion of applied rows as SQL functions (000008, 000005),
-- the release planned as PL/pgSQL chooses.
ALTER FUNCTION wh_pairs_release(uuid, uuid[], text[], float8[]) RESET plan_cache_mode;
CREATE OR REPLACE FUNCTION wh_claim_pairs(
    instance_id   uuid,
    build_keys    text[],
    max_pairs     int,
    lease_seconds float8
) RETURNS SETOF wh_perspective_pairs
LANGUAGE sql
SET enable_sort = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
WITH due AS (
    SELECT d.stream_id, d.perspective_name
    FROM wh_perspective_pairs d
    WHERE d.due_at <= now()
      AND (d.perspective_name = ANY(build_keys)) IS TRUE
      AND NOT EXISTS (
          SELECT 1 FROM wh_perspective_cursors c
          WHERE c.stream_id = d.stream_id AND c.perspective_name = d.perspective_name
            AND c.stream_lock_expiry > clock_timestamp())
      AND NOT EXISTS (
          SELECT 1 FROM wh_perspective_builds b
          WHERE b.build_key = d.perspective_name
            AND NOT b.catchup_done
            AND (b.catchup_stream_id IS NULL OR d.stream_id >= b.catchup_stream_id))
    ORDER BY d.due_at
    LIMIT max_pairs
    FOR UPDATE OF d SKIP LOCKED
), leased AS (
    UPDATE wh_perspective_pairs d
    SET due_at = clock_timestamp() + make_interval(secs => lease_seconds),
        leased_by = instance_id
    FROM due
    WHERE d.stream_id = due.stream_id AND d.perspective_name = due.perspective_name
    RETURNING d.*
)
SELECT l.* FROM leased l
UNION ALL
SELECT '00000000-0000-0000-0000-000000000000'::uuid, '', n.due_at, NULL
FROM (SELECT w.due_at FROM wh_perspective_pairs w
      WHERE w.due_at > now() AND w.due_at < 'infinity'
        AND (w.perspective_name = ANY(build_keys)) IS TRUE
      ORDER BY w.due_at
      LIMIT 1) n
$$;

CREATE OR REPLACE FUNCTION wh_delete_applied(
    stream_ids        uuid[],
    perspective_names text[],
    event_ids         uuid[]
) RETURNS bigint
LANGUAGE sql
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
    WITH deleted AS (
        DELETE FROM wh_perspective_events q
        USING (SELECT unnest(stream_ids) AS stream_id,
                      unnest(perspective_names) AS perspective_name,
                      unnest(event_ids) AS event_id) d
        WHERE q.stream_id = d.stream_id
          AND q.perspective_name = d.perspective_name
          AND q.event_id = d.event_id
        RETURNING 1
    )
    SELECT count(*) FROM deleted
$$;
