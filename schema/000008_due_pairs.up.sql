-- The claim is a write on one due row per pair (docs/internals.md, "The claim").
--
-- wh_perspective_pairs: one row per (stream, build) pair that has work queued, or had until
-- its last job. due_at is when the pair may be claimed next: the enqueue time of its oldest
-- queued event, a backoff after a failure, 'infinity' while it is parked, or the end of the
-- lease of the instance applying it (leased_by). It is the only place the due state lives:
-- the queue rows carry only what an event needs, and a retry, park, skip or purge writes one
-- row here whatever the pair's backlog.
CREATE TABLE wh_perspective_pairs (
    stream_id        uuid        NOT NULL,
    perspective_name text        NOT NULL,
    due_at           timestamptz NOT NULL,
    leased_by        uuid,
    PRIMARY KEY (stream_id, perspective_name)
) WITH (
    -- Written at every claim and release: vacuum it often, as the queue.
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_analyze_scale_factor = 0.01
);

-- The claim's order: oldest due first.
CREATE INDEX wh_perspective_pairs_due_idx ON wh_perspective_pairs (due_at);

-- Every pair with queued rows gets its row: due at its oldest queued event, or as its
-- cursor said (a backoff), or never while parked.
INSERT INTO wh_perspective_pairs (stream_id, perspective_name, due_at)
SELECT q.stream_id, q.perspective_name,
       CASE WHEN c.status = 'parked' THEN 'infinity'::timestamptz
            ELSE GREATEST(min(q.enqueued_at), COALESCE(c.next_attempt_at, '-infinity'::timestamptz)) END
FROM wh_perspective_events q
LEFT JOIN wh_perspective_cursors c
  ON c.stream_id = q.stream_id AND c.perspective_name = q.perspective_name
GROUP BY q.stream_id, q.perspective_name, c.status, c.next_attempt_at;

-- The due state no longer lives on the queue rows nor on the cursor.
DROP INDEX wh_perspective_events_due_idx;
ALTER TABLE wh_perspective_events
    DROP COLUMN attempts,
    DROP COLUMN last_error,
    DROP COLUMN next_attempt_at;
ALTER TABLE wh_perspective_cursors DROP COLUMN next_attempt_at;
-- The claim no longer shares the streams out among the instances claiming.
ALTER TABLE wh_instances DROP COLUMN claimed_at;

-- Append: the events, each pair's cursor row, its due row and its queue rows, in the
-- caller's transaction.
--
-- The due row is inserted if missing (keeping the due time of an existing one), and an
-- existing one is locked FOR KEY SHARE until the transaction ends. That lock is what keeps a
-- pair from being left without a due row: a job that finds a pair's queue empty deletes the
-- row only after locking it FOR UPDATE SKIP LOCKED and then looking at the queue in a new
-- snapshot (wh_pairs_release), so it skips a row an Append is queueing into and sees the
-- rows of every Append that committed before its lock. A claim or a release updating the row
-- takes FOR NO KEY UPDATE, which KEY SHARE does not block. When the lock finds the row gone
-- (deleted by a release that locked it first), the row is inserted again.
DROP FUNCTION wh_append(uuid[], uuid[], text[], text[], timestamptz[]);
DROP FUNCTION wh_notify_queued(timestamptz);
CREATE FUNCTION wh_append(
    event_ids   uuid[],
    stream_ids  uuid[],
    event_types text[],
    datas       text[],
    created_ats timestamptz[]
) RETURNS bigint
LANGUAGE plpgsql
-- The plans do not depend on the arguments (arrays whose contents the planner cannot see
-- anyway): planned once per session, not at every call.
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    queued       bigint;
    pair_streams uuid[];
    pair_keys    text[];
    want         int;
    held         int;
    parked       int;
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

    -- The (stream, build) pairs the events are queued for: every build being built or active.
    -- Ordered, so that concurrent appends to the same new streams never deadlock.
    SELECT array_agg(p.stream_id ORDER BY p.stream_id, p.build_key),
           array_agg(p.build_key ORDER BY p.stream_id, p.build_key)
    INTO pair_streams, pair_keys
    FROM (SELECT DISTINCT s.stream_id, b.build_key
          FROM unnest(stream_ids) AS s (stream_id)
          CROSS JOIN wh_perspective_builds b
          WHERE b.state IN ('building', 'active')) p;
    want := COALESCE(cardinality(pair_streams), 0);

    WITH ev AS (
        INSERT INTO wh_event_store (event_id, stream_id, event_type, data, created_at)
        SELECT i.event_id, i.stream_id, i.event_type, i.data::jsonb,
               COALESCE(NULLIF(i.created_at, '0001-01-01 00:00:00+00'::timestamptz), now())
        FROM unnest(event_ids, stream_ids, event_types, datas, created_ats)
             AS i (event_id, stream_id, event_type, data, created_at)
        RETURNING event_id, stream_id
    ), pairs AS (
        SELECT * FROM unnest(pair_streams, pair_keys) AS p (stream_id, build_key)
    ), cursors AS (
        -- Each pair's cursor row exists from its first event on, so the worker can lock it at
        -- once. Only missing rows are inserted: ON CONFLICT on an existing row that a worker's
        -- open transaction has updated would wait for that transaction, while the plain read
        -- of NOT EXISTS never waits.
        INSERT INTO wh_perspective_cursors (stream_id, perspective_name)
        SELECT p.stream_id, p.build_key FROM pairs p
        WHERE NOT EXISTS (SELECT 1 FROM wh_perspective_cursors c
                          WHERE c.stream_id = p.stream_id AND c.perspective_name = p.build_key)
        ON CONFLICT (stream_id, perspective_name) DO NOTHING
    ), queue AS (
        INSERT INTO wh_perspective_events (stream_id, perspective_name, event_id)
        SELECT ev.stream_id, p.build_key, ev.event_id
        FROM ev JOIN pairs p ON p.stream_id = ev.stream_id
        RETURNING 1
    )
    SELECT count(*) INTO queued FROM queue;

    -- Hold every pair's due row until commit (see above), inserting the missing ones (a new
    -- pair, or one whose row a release deleted meanwhile). Statements of their own, after the
    -- cursor rows: a catch-up page inserts a stream's cursor rows before its due rows too, so
    -- the two never wait for each other in opposite orders (in one statement with the cursors,
    -- an Append and a catch-up page deadlocked). Each sees the rows other transactions
    -- committed since the one before.
    LOOP
        -- (each pair a probe of the key, whatever the statistics say)
        SELECT count(*), count(*) FILTER (WHERE l.due_at = 'infinity') INTO held, parked
        FROM unnest(pair_streams, pair_keys) AS p (stream_id, build_key)
        CROSS JOIN LATERAL (
            SELECT d.due_at FROM wh_perspective_pairs d
            WHERE d.stream_id = p.stream_id AND d.perspective_name = p.build_key
            FOR KEY SHARE) l;
        EXIT WHEN held >= want;
        INSERT INTO wh_perspective_pairs (stream_id, perspective_name, due_at)
        SELECT p.stream_id, p.build_key, now()
        FROM unnest(pair_streams, pair_keys) AS p (stream_id, build_key)
        ON CONFLICT (stream_id, perspective_name) DO NOTHING;
    END LOOP;

    -- A parked pair waits for an operator, but an event that sorts before its failing one
    -- (a late event) is applied now: the pair is due, its rewind commits the late event, and
    -- it parks again at its failing event.
    IF parked > 0 THEN
        UPDATE wh_perspective_pairs d
        SET due_at = now()
        FROM wh_perspective_cursors c
        WHERE d.due_at = 'infinity'
          AND c.stream_id = d.stream_id AND c.perspective_name = d.perspective_name
          AND (d.stream_id, d.perspective_name) IN (SELECT * FROM unnest(pair_streams, pair_keys))
          AND EXISTS (SELECT 1 FROM unnest(event_ids, stream_ids) AS e (event_id, stream_id)
                      WHERE e.stream_id = d.stream_id AND e.event_id < c.failed_event_id);
    END IF;

    IF queued > 0 THEN
        -- Wakes the listening workers if the transaction commits (once per transaction).
        PERFORM pg_notify('wh_perspective_events', '');
    END IF;
    RETURN queued;
END
$$;

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
CREATE FUNCTION wh_pairs_release(
    instance_id       uuid,
    stream_ids        uuid[],
    perspective_names text[],
    delays            float8[]
) RETURNS void
LANGUAGE plpgsql
-- Each pair a probe of the due rows' key, whatever the statistics say (as wh_delete_applied).
SET enable_hashjoin = off
SET enable_mergejoin = off
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

-- The claim (PairsClaim, queries/claim.sql): leases up to max_pairs due pairs of the builds
-- build_keys, oldest due first, for lease_seconds, in one statement. Returns the leased rows,
-- then, when a pair of those builds is waiting (not due yet, not parked), a row with the nil
-- stream whose due_at is when the first of them becomes due. A function so that its plan is
-- pinned whatever the statistics say: the due rows are read in the due index's order, as far
-- as the limit needs (no sort of every due row), and each leased row is updated through a
-- probe of the key (never a hash of the whole table).
CREATE FUNCTION wh_claim_pairs(
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
