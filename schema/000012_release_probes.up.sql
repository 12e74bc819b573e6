-- A job's release (wh_pairs_release) looks up the due rows and the queue by key whatever the
-- statistics say, as wh_append and the claim do (000011). Its plans are kept for the session:
-- planned while the due rows were few and the queue held little but one parked pair's long
-- backlog, its deletion of the rows of pairs whose queue is empty scanned the whole queue for
-- every due row (half a second a release, with those due rows locked and the Appends to
-- their pairs waiting meanwhile); with only sequential scans off, it walked the build's whole
-- range of the queue's other index instead. The emptiness check reads the first entry of the
-- pair's range of the primary key, as the due time's look-up beside it does.

-- After a job: releases the caller's leases on the given pairs. A pair with nothing queued
-- loses its row; the others are due at their oldest queued event, or, when delays[i] is not
-- negative, that many seconds from now (a pair found held by another transaction). Rows whose lease another
-- instance holds now (this one's lapsed), and rows a failure record gave their due time
-- (PairsMarkFailed clears the lease), are left alone.
--
-- The row of a pair whose queue looks empty is deleted only after it is locked FOR UPDATE
-- SKIP LOCKED, and in a statement after that lock, with its own snapshot: an Append still
-- queueing for the pair holds the row FOR KEY SHARE, so it is skipped; any Append that held it
-- before has committed, and its rows are seen. (In one statement, the queue would be read as
-- of the statement's start, before a lock that waited.)
CREATE OR REPLACE FUNCTION wh_pairs_release(
    instance_id       uuid,
    stream_ids        uuid[],
    perspective_names text[],
    delays            float8[]
) RETURNS void
LANGUAGE plpgsql
-- Each pair a probe of the due rows' key and of the first entry of its queue's range,
-- whatever the statistics say, planned once per session.
SET plan_cache_mode = force_generic_plan
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_seqscan = off
SET jit = off
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
          AND (SELECT q.event_id FROM wh_perspective_events q
               WHERE q.stream_id = d.stream_id AND q.perspective_name = d.perspective_name
               ORDER BY q.event_id
               LIMIT 1) IS NULL;
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
