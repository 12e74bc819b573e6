-- The claim, the release of leases and the deletion of applied queue rows run one cached
-- generic plan each, as wh_append does. A SQL function with SET clauses is never inlined,
-- and its statement is planned again at every call; a PL/pgSQL function keeps its
-- statements' plans for the server session (also through a transaction pooler, whose
-- server sessions outlive their clients' transactions), but left to choose it plans a call
-- for its arguments whenever such a plan looks cheaper (a claim's LIMIT over many due rows,
-- a one-pair release, a one-row deletion). Planning took about 0.5 ms of each claim and of
-- each release and 0.3 ms of each apply commit on the test machine. A kept plan is made
-- again when a table it reads is analyzed (docs/postgresql.md, "Vacuum"). The statements
-- and their other settings are those of 000005 and 000008.

CREATE OR REPLACE FUNCTION wh_claim_pairs(
    instance_id   uuid,
    build_keys    text[],
    max_pairs     int,
    lease_seconds float8
) RETURNS SETOF wh_perspective_pairs
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_sort = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
BEGIN
    RETURN QUERY
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
          LIMIT 1) n;
END
$$;

-- The deletion of applied queue rows by their exact keys (PairsApplyCommit): a nested loop
-- of primary-key probes, one per row, whatever the statistics say (see 000005).
CREATE OR REPLACE FUNCTION wh_delete_applied(
    stream_ids        uuid[],
    perspective_names text[],
    event_ids         uuid[]
) RETURNS bigint
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
DECLARE
    deleted bigint;
BEGIN
    DELETE FROM wh_perspective_events q
    USING (SELECT unnest(stream_ids) AS stream_id,
                  unnest(perspective_names) AS perspective_name,
                  unnest(event_ids) AS event_id) d
    WHERE q.stream_id = d.stream_id
      AND q.perspective_name = d.perspective_name
      AND q.event_id = d.event_id;
    GET DIAGNOSTICS deleted = ROW_COUNT;
    RETURN deleted;
END
$$;

ALTER FUNCTION wh_pairs_release(uuid, uuid[], text[], float8[]) SET plan_cache_mode = force_generic_plan;
