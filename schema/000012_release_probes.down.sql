-- wh_pairs_release as 000008 created it, planned as 000010 set.
CREATE OR REPLACE FUNCTION wh_pairs_release(
    instance_id       uuid,
    stream_ids        uuid[],
    perspective_names text[],
    delays            float8[]
) RETURNS void
LANGUAGE plpgsql
-- Each pair a probe of the due rows' key, whatever the statistics say (as wh_delete_applied).
SET enable_hashjoin = off
SET enable_mergejoin = off
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    locked_streams uuid[];
    locked_names   text[];
BEGIN
    SELECT array_agg(l.stream_id), array_agg(l.perspective_name)
    INTO locked_streams, locked_names
    FROM (SELECT * FROM unnest(stream_ids, perspective_names) AS p (stream_id, perspective_name)
          ORDER BY 1, 2) p
    CROSS JOIN LATERAL (
        SELECT d.stream_id, d.perspective_name FROM wh_perspective_pairs d
        WHERE d.stream_id = p.stream_id AND d.perspective_name = p.perspective_name
          AND d.leased_by = wh_pairs_release.instance_id
        FOR UPDATE SKIP LOCKED) l;

    IF locked_streams IS NOT NULL THEN
        DELETE FROM wh_perspective_pairs d
        USING unnest(locked_streams, locked_names) AS l (stream_id, perspective_name)
        WHERE d.stream_id = l.stream_id AND d.perspective_name = l.perspective_name
          AND NOT EXISTS (SELECT 1 FROM wh_perspective_events q
                          WHERE q.stream_id = d.stream_id AND q.perspective_name = d.perspective_name);
    END IF;

    UPDATE wh_perspective_pairs d
    SET leased_by = NULL,
        due_at = CASE
            WHEN p.delay >= 0 THEN clock_timestamp() + make_interval(secs => p.delay)
            ELSE COALESCE((SELECT q.enqueued_at FROM wh_perspective_events q
                           WHERE q.stream_id = d.stream_id AND q.perspective_name = d.perspective_name
                           ORDER BY q.event_id
                           LIMIT 1), now())
        END
    FROM unnest(stream_ids, perspective_names, delays) AS p (stream_id, perspective_name, delay)
    WHERE d.stream_id = p.stream_id AND d.perspective_name = p.perspective_name
      AND d.leased_by = wh_pairs_release.instance_id;
END
$$;
