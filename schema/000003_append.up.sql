-- Append in one statement, so that it costs one round trip: wh_append takes the
-- shared append lock, queues the wake-up notification, and stores and enqueues the events.
--
-- It is a PL/pgSQL function because its statements must see different snapshots: under READ
-- COMMITTED each statement of a (volatile) function takes a new one, so the INSERT sees every
-- build registered before the advisory lock was granted (registration holds that lock
-- exclusively until it commits). A single SQL statement could not: its snapshot is taken
-- before it waits for the lock. At REPEATABLE READ and above the transaction's snapshot may
-- predate a build registered since; then the append fails with a serialization error
-- (SQLSTATE 40001) instead of not queueing its events for that build: see wh_registration.
--
-- Queue rows are stamped with their pair's due time: the next_attempt_at of the rows the
-- pair already has queued, else now(). So every queued row of a pair has the same due time,
-- however many separate Appends queued them, and the claim (QueueDuePairs), which passes one
-- (due time, pair) group per step, serves pairs in the order of their oldest queued event: a
-- stream that has queued many Appends is one pair among the others, not a wall in front of
-- them. A pair backing off after a failure keeps its retry time for the rows it gains.
CREATE FUNCTION wh_append(
    event_ids   uuid[],
    stream_ids  uuid[],
    event_types text[],
    datas       text[],
    created_ats timestamptz[]
) RETURNS bigint
LANGUAGE plpgsql
-- The statements' plans do not depend on the arguments (arrays whose contents the planner
-- cannot see anyway): plan them once per session, not at every call (a custom plan of the
-- INSERT costs more than the rest of a one-event append).
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    queued bigint;
BEGIN
    -- The lock orders this append against the registration of builds (see RegisterLock);
    -- the notification reaches listening workers if the transaction commits, once per
    -- transaction.
    PERFORM pg_advisory_xact_lock_shared(7214082031553392641), pg_notify('wh_perspective_events', '');
    IF current_setting('transaction_isolation') NOT IN ('read committed', 'read uncommitted') THEN
        BEGIN
            PERFORM 1 FROM wh_registration WHERE id = 1 FOR SHARE;
        EXCEPTION WHEN serialization_failure THEN
            RAISE EXCEPTION USING
                ERRCODE = 'serialization_failure',
                MESSAGE = 'a perspective build was registered after this transaction''s snapshot was taken; retry the transaction';
        END;
    END IF;

    WITH ev AS (
        INSERT INTO wh_event_store (event_id, stream_id, event_type, data, created_at)
        SELECT i.event_id, i.stream_id, i.event_type, i.data::jsonb,
               COALESCE(NULLIF(i.created_at, '0001-01-01 00:00:00+00'::timestamptz), now())
        FROM unnest(event_ids, stream_ids, event_types, datas, created_ats)
             AS i (event_id, stream_id, event_type, data, created_at)
        RETURNING event_id, stream_id
    ), pairs AS (
        -- Each (stream, build being built or active) the events are queued for, with the due
        -- time of the rows it has queued already (read as of this statement's snapshot).
        SELECT p.stream_id, p.build_key,
               COALESCE((SELECT q.next_attempt_at FROM wh_perspective_events q
                         WHERE q.stream_id = p.stream_id AND q.perspective_name = p.build_key
                         ORDER BY q.event_id
                         LIMIT 1), now()) AS due
        FROM (SELECT DISTINCT ev.stream_id, b.build_key
              FROM ev CROSS JOIN wh_perspective_builds b
              WHERE b.state IN ('building', 'active')) p
    ), cursors AS (
        -- Each pair's cursor row exists from its first event on, so the worker can lock it at
        -- once. Only missing rows are inserted: ON CONFLICT on an existing row that a worker's
        -- open transaction has updated would wait for that transaction, while the plain read
        -- of NOT EXISTS never waits. Ordered, so that concurrent appends to several new
        -- streams never deadlock.
        INSERT INTO wh_perspective_cursors (stream_id, perspective_name)
        SELECT p.stream_id, p.build_key FROM pairs p
        WHERE NOT EXISTS (SELECT 1 FROM wh_perspective_cursors c
                          WHERE c.stream_id = p.stream_id AND c.perspective_name = p.build_key)
        ORDER BY 1, 2
        ON CONFLICT (stream_id, perspective_name) DO NOTHING
    )
    INSERT INTO wh_perspective_events (stream_id, perspective_name, event_id, next_attempt_at)
    SELECT ev.stream_id, p.build_key, ev.event_id, p.due
    FROM ev JOIN pairs p ON p.stream_id = ev.stream_id;
    GET DIAGNOSTICS queued = ROW_COUNT;
    RETURN queued;
END
$$;
