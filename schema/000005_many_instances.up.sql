-- What many instances need of the schema: applied queue rows deleted by primary-key probes
-- whatever the statistics say (wh_delete_applied), and when each instance last claimed, so
-- that the claim shares the streams out among the instances claiming (claimed_at).
--
-- The deletion of applied queue rows, by their exact keys (PairsApplyCommit), in a function
-- of its own so that its plan can be pinned to probes of the queue's primary key.
--
-- Planned as a join of the keys (up to GroupSize × BatchSize of them) with the queue, the
-- DELETE was a hash join over a sequential scan of the whole queue whenever the planner
-- priced the index probes above hashing the table: with the default random_page_cost and a
-- queue of 50,000 rows, 1,250 applied rows took 15 ms instead of 5 ms, most of each apply
-- commit's time, and more as the queue grows. With hash and merge joins
-- off for its own statement, the only join left is a nested loop of primary-key probes, one
-- per applied row, whatever the statistics say.
CREATE FUNCTION wh_delete_applied(
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

-- When an instance last claimed work, on the database clock (NULL: it has stopped claiming).
-- The claim shares the streams out among the instances that run the same builds and are
-- claiming (QueueDuePairs): one whose slots are all taken for three heartbeat intervals (a
-- perspective's Apply that hangs, long operations), or that is stopping, drops out and its
-- streams are shared among the others.
ALTER TABLE wh_instances ADD COLUMN claimed_at timestamptz;
