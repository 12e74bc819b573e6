-- The notification of an Append names where its rows lie in the claim's order: the earliest
-- due time it stamped on them (microseconds since the epoch, as text), sent only when it
-- queued any. A claim after the first starts where the last one left off (Claimed.Next),
-- past the groups it passed; an Append whose transaction began before that point and
-- committed after the claim (a slow statement, or an Append inside a longer transaction)
-- has its rows before it. The worker receiving the notification starts its next claim at
-- that due time at the latest, so they wait for no claim from the oldest row (worker/schedule.go).
--
-- wh_notify_queued sends that notification for rows due at due or later; the other
-- statements that make queue rows due send it too (queries/: a purge, a rebuild, a catch-up
-- leaving a stream to the normal path, a failure's retry time).
CREATE FUNCTION wh_notify_queued(due timestamptz) RETURNS void
LANGUAGE sql
AS $$
    SELECT pg_notify('wh_perspective_events', (extract(epoch FROM due) * 1000000)::bigint::text)
$$;

-- wh_append otherwise as in 000004_operations.up.sql.
CREATE OR REPLACE FUNCTION wh_append(
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
    first_due timestamptz;
BEGIN
    -- The lock orders this append against the registration of builds (see RegisterLock).
    PERFORM pg_advisory_xact_lock_shared(7214082031553392641);
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
        SELECT p.stream_id, p.build_key, COALESCE(f.next_attempt_at, now()) AS due, f.event_id AS first_id
        FROM (SELECT DISTINCT ev.stream_id, b.build_key
              FROM ev CROSS JOIN wh_perspective_builds b
              WHERE b.state IN ('building', 'active')) p
        LEFT JOIN LATERAL (
            SELECT q.next_attempt_at, q.event_id FROM wh_perspective_events q
            WHERE q.stream_id = p.stream_id AND q.perspective_name = p.build_key
            ORDER BY q.event_id
            LIMIT 1) f ON true
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
    ), queue AS (
        INSERT INTO wh_perspective_events (stream_id, perspective_name, event_id, next_attempt_at)
        SELECT ev.stream_id, p.build_key, ev.event_id,
               -- A parked pair's rows wait for an operator, except an event that sorts before
               -- its first queued one (the failing event): that one is applied now.
               CASE WHEN p.due = '9999-12-31 00:00:00+00'::timestamptz AND ev.event_id < p.first_id
                    THEN now() ELSE p.due END
        FROM ev JOIN pairs p ON p.stream_id = ev.stream_id
        RETURNING next_attempt_at
    )
    SELECT count(*), min(queue.next_attempt_at) INTO queued, first_due FROM queue;
    IF queued > 0 THEN
        -- Reaches the listening workers if the transaction commits (once per transaction
        -- and due time).
        PERFORM wh_notify_queued(first_due);
    END IF;
    RETURN queued;
END
$$;
