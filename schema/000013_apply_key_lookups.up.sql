-- The apply transaction's statements (PairsLockForApply, PairsApplyCommit, CursorsEnsure in
-- queries/apply.sql) run in the functions below, which look up each pair by the tables' keys
-- whatever the statistics say, as the claim, wh_append and the release do (000011, 000012).
-- Planned while the cursors were few (analyzed at 100 rows), the statements kept for the
-- session scanned or hashed every cursor row once the table had grown: 191-197 ms to lock a
-- group of 50 pairs among 100,000 cursors, against 0.7-1.0 ms.
--
-- wh_lock_cursors locks the cursor rows of the given pairs (stream_ids[i] with
-- perspective_names[i]) that exist, belong to a build that is not retired and no other
-- transaction holds (SKIP LOCKED), and returns them: each pair a probe of the cursors' key.
CREATE FUNCTION wh_lock_cursors(
    stream_ids        uuid[],
    perspective_names text[]
) RETURNS SETOF wh_perspective_cursors
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_seqscan = off
SET jit = off
AS $$
BEGIN
    RETURN QUERY
    SELECT l.*
    FROM (SELECT unnest(stream_ids) AS stream_id, unnest(perspective_names) AS perspective_name) p
    CROSS JOIN LATERAL (
        SELECT c.* FROM wh_perspective_cursors c
        WHERE c.stream_id = p.stream_id AND c.perspective_name = p.perspective_name
          -- A retired build is never written again (its rows are being deleted).
          AND NOT EXISTS (SELECT 1 FROM wh_perspective_builds b
                          WHERE b.build_key = c.perspective_name AND b.state = 'retired')
        FOR UPDATE OF c SKIP LOCKED) l;
END
$$;

-- wh_snapshot_ids: the positions of a pair's snapshots, newest first (empty: none), through
-- the snapshots' key whatever the statistics say (planned while the snapshots were few, the
-- lookup beside the lock scanned them all for each pair).
CREATE FUNCTION wh_snapshot_ids(
    pair_stream uuid,
    pair_build  text
) RETURNS uuid[]
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET jit = off
AS $$
DECLARE
    ids uuid[];
BEGIN
    SELECT COALESCE(array_agg(s.snapshot_event_id ORDER BY s.snapshot_event_id DESC), '{}') INTO ids
    FROM wh_perspective_snapshots s
    WHERE s.stream_id = pair_stream AND s.perspective_name = pair_build;
    RETURN ids;
END
$$;

-- wh_apply_commit: PairsApplyCommit's statement (queries/apply.sql says what it writes), with
-- each pair's cursor row found by its key whatever the statistics say: planned while the
-- cursors were few, the statement hashed every cursor row at each commit once they were many.
CREATE FUNCTION wh_apply_commit(
    stream_ids                uuid[],
    perspective_names         text[],
    models                    text[],
    last_event_ids            uuid[],
    since_snapshots           int[],
    applied_stream_ids        uuid[],
    applied_perspective_names text[],
    applied_event_ids         uuid[]
) RETURNS bigint
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_seqscan = off
SET jit = off
AS $$
DECLARE
    deleted bigint;
BEGIN
    WITH input AS (
        SELECT unnest(stream_ids) AS stream_id,
               unnest(perspective_names) AS perspective_name,
               unnest(models)::jsonb AS model,
               unnest(last_event_ids) AS last_event_id,
               unnest(since_snapshots) AS since_snapshot
    ), model AS (
        INSERT INTO wh_perspective_models (stream_id, perspective_name, model, last_event_id)
        SELECT i.stream_id, i.perspective_name, i.model, i.last_event_id FROM input i
        ON CONFLICT (stream_id, perspective_name) DO UPDATE
        SET model = EXCLUDED.model,
            last_event_id = EXCLUDED.last_event_id,
            updated_at = now()
    ), cursor_rows AS (
        UPDATE wh_perspective_cursors c
        SET last_event_id = i.last_event_id,
            version = c.version + 1,
            events_since_snapshot = i.since_snapshot,
            -- A failure clears once its event is applied. Events applied before it (a late
            -- one, or ones queued before it since) leave it as it is, count and all.
            status = CASE WHEN i.last_event_id < c.failed_event_id THEN c.status ELSE 'ok' END,
            last_error = CASE WHEN i.last_event_id < c.failed_event_id THEN c.last_error END,
            failed_event_id = CASE WHEN i.last_event_id < c.failed_event_id THEN c.failed_event_id END,
            failed_since = CASE WHEN i.last_event_id < c.failed_event_id THEN c.failed_since END,
            attempts = CASE WHEN i.last_event_id < c.failed_event_id THEN c.attempts ELSE 0 END,
            updated_at = now()
        FROM input i
        WHERE c.stream_id = i.stream_id AND c.perspective_name = i.perspective_name
    )
    -- by primary-key probes (see wh_delete_applied)
    SELECT wh_delete_applied(applied_stream_ids, applied_perspective_names, applied_event_ids) INTO deleted;
    -- Sent even when no queue row was deleted (a catch-up page applies events never queued).
    PERFORM pg_notify('wh_applied', '');
    RETURN deleted;
END
$$;

-- wh_ensure_cursors: CursorsEnsure's statement (queries/apply.sql says what it does), with
-- each pair's cursor row looked up by its key whatever the statistics say: planned while the
-- cursors were few, it hashed every cursor row at each call once they were many.
CREATE FUNCTION wh_ensure_cursors(
    stream_ids        uuid[],
    perspective_names text[]
) RETURNS SETOF wh_perspective_cursors
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_seqscan = off
SET jit = off
AS $$
BEGIN
    RETURN QUERY
    WITH created AS (
        INSERT INTO wh_perspective_cursors (stream_id, perspective_name)
        SELECT p.stream_id, p.perspective_name
        FROM unnest(stream_ids, perspective_names) AS p (stream_id, perspective_name)
        WHERE NOT EXISTS (SELECT 1 FROM wh_perspective_cursors c
                          WHERE c.stream_id = p.stream_id AND c.perspective_name = p.perspective_name)
        ORDER BY p.stream_id, p.perspective_name
        ON CONFLICT (stream_id, perspective_name) DO NOTHING
        RETURNING *
    )
    SELECT * FROM created;
END
$$;
