-- Back to 000007: the due state on the queue rows (and a failing pair's backoff on its
-- cursor), the claim's instance shares, and the notification that names a due time.
ALTER TABLE wh_instances ADD COLUMN claimed_at timestamptz;
ALTER TABLE wh_perspective_cursors ADD COLUMN next_attempt_at timestamptz;
ALTER TABLE wh_perspective_events
    ADD COLUMN attempts integer NOT NULL DEFAULT 0,
    ADD COLUMN last_error text,
    ADD COLUMN next_attempt_at timestamptz NOT NULL DEFAULT now();

UPDATE wh_perspective_events q
SET next_attempt_at = CASE WHEN d.due_at = 'infinity' THEN '9999-12-31 00:00:00+00'::timestamptz ELSE d.due_at END
FROM wh_perspective_pairs d
WHERE d.stream_id = q.stream_id AND d.perspective_name = q.perspective_name;
UPDATE wh_perspective_cursors c
SET next_attempt_at = d.due_at
FROM wh_perspective_pairs d
WHERE d.stream_id = c.stream_id AND d.perspective_name = c.perspective_name AND c.status = 'failed';

CREATE INDEX wh_perspective_events_due_idx
    ON wh_perspective_events (next_attempt_at, stream_id, perspective_name, event_id);

DROP FUNCTION wh_claim_pairs(uuid, text[], int, float8);
DROP FUNCTION wh_pairs_release(uuid, uuid[], text[], float8[]);
DROP FUNCTION wh_append(uuid[], uuid[], text[], text[], timestamptz[]);
DROP TABLE wh_perspective_pairs;

CREATE FUNCTION wh_notify_queued(due timestamptz) RETURNS void
LANGUAGE sql
AS $$
    SELECT pg_notify('wh_perspective_events', (extract(epoch FROM due) * 1000000)::bigint::text)
$$;

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
