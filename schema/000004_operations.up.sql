-- Operating the worker: parked pairs, skipped events, instance heartbeats.

-- A pair whose processing failed as many times as its perspective's failure policy allows
-- is parked: status 'parked', its queue rows (and the rows Appends add to it: they take the
-- pair's due time, see wh_append) due at 9999-12-31, so that no claim takes them, until an
-- operator retries it (perspectives retry) or skips its failing event (perspectives skip).
-- failed_event_id is the event whose Apply failed (NULL: the failure was not one event's);
-- failed_since is when the pair's current run of failures began.
ALTER TABLE wh_perspective_cursors
    DROP CONSTRAINT wh_perspective_cursors_status_check,
    ADD CONSTRAINT wh_perspective_cursors_status_check CHECK (status IN ('ok', 'failed', 'parked')),
    ADD COLUMN failed_event_id uuid,
    ADD COLUMN failed_since timestamptz;

DROP INDEX wh_perspective_cursors_failed_idx;
CREATE INDEX wh_perspective_cursors_failed_idx
    ON wh_perspective_cursors (perspective_name)
    WHERE status <> 'ok';

-- Events a pair will never apply: skipped by the failure policy (reason 'policy') or by an
-- operator (reason 'operator'), with who, when and the error that made them skip it. A
-- rewind's replay and every re-queueing of a stream leave them out. Keyed by the build
-- (perspective_name holds the build key, as in the other tables): a new version or a rebuild
-- meets the event afresh.
CREATE TABLE wh_skipped_events (
    stream_id        uuid        NOT NULL,
    perspective_name text        NOT NULL,
    event_id         uuid        NOT NULL,
    skipped_at       timestamptz NOT NULL DEFAULT now(),
    skipped_by       text        NOT NULL CHECK (skipped_by <> ''),
    reason           text        NOT NULL CHECK (reason IN ('policy', 'operator')),
    attempts         integer     NOT NULL DEFAULT 0,
    last_error       text,
    PRIMARY KEY (stream_id, perspective_name, event_id)
);

-- One row per running worker instance, written at start and every heartbeat_interval, and
-- deleted at a clean stop: an instance whose row is older than a few intervals is gone.
CREATE TABLE wh_instances (
    instance_id        uuid        NOT NULL PRIMARY KEY,
    host               text        NOT NULL,
    pid                integer     NOT NULL,
    started_at         timestamptz NOT NULL DEFAULT now(),
    last_seen_at       timestamptz NOT NULL DEFAULT now(),
    heartbeat_interval interval    NOT NULL,
    perspectives       text[]      NOT NULL, -- the perspectives it runs, name and version, in
    versions           integer[]   NOT NULL, -- two parallel arrays
    -- Events it applied per second over its last heartbeat interval, per perspective
    -- (parallel to perspectives): the throughput the dashboard and status show.
    rates              float8[]    NOT NULL DEFAULT '{}'
);

-- Append (see 000003_append.up.sql) as before, but for a parked pair: its new rows take its
-- due time (9999-12-31, waiting for the operator) unless they sort before its first queued
-- event, the failing one: such a late event is applied at once (the rewind commits it, and
-- the pair parks again at its failing event).
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
    )
    INSERT INTO wh_perspective_events (stream_id, perspective_name, event_id, next_attempt_at)
    SELECT ev.stream_id, p.build_key, ev.event_id,
           -- A parked pair's rows wait for an operator, except an event that sorts before
           -- its first queued one (the failing event): that one is applied now.
           CASE WHEN p.due = '9999-12-31 00:00:00+00'::timestamptz AND ev.event_id < p.first_id
                THEN now() ELSE p.due END
    FROM ev JOIN pairs p ON p.stream_id = ev.stream_id;
    GET DIAGNOSTICS queued = ROW_COUNT;
    RETURN queued;
END
$$;
