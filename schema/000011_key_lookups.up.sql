-- Key lookups whatever the statistics say, for an Append and a claim. On a small table a
-- scan looks cheaper than an index, and a plan made then, kept for the server session, scans
-- the whole table at every call until the table is analyzed again, however large it has
-- grown: left to such plans, wh_append hashes every cursor row and scans the due rows for
-- each pair, and wh_claim_pairs scans the cursors for each due row it considers. Both run
-- without sequential scans, and without JIT, whose threshold a statement's cost estimate
-- can reach with scans off.
--
-- wh_append also finds its pairs in the statement that writes the events, the queue rows and
-- the missing cursor rows (one statement fewer), with hash and merge joins off as
-- wh_delete_applied. Its arguments, result and effects are those of 000008; the claim's
-- statement is that of 000010. (BenchmarkAppendCost in BENCHMARKS.md compares an Append of
-- one event with a single INSERT of its event and queue row.)

CREATE OR REPLACE FUNCTION wh_append(
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
-- Each pair a probe of the cursors' and due rows' keys, whatever the statistics say. With
-- scans off, a statement's estimated cost can pass JIT's threshold: no JIT here.
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_seqscan = off
SET jit = off
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

    -- The (stream, build) pairs the events are queued for: every build being built or active,
    -- in key order, so that concurrent appends to the same new streams never deadlock.
    WITH builds AS (
        SELECT b.build_key FROM wh_perspective_builds b WHERE b.state IN ('building', 'active')
    ), pairs AS (
        SELECT DISTINCT s.stream_id, b.build_key
        FROM unnest(stream_ids) AS s (stream_id) CROSS JOIN builds b
        ORDER BY 1, 2
    ), ev AS (
        INSERT INTO wh_event_store (event_id, stream_id, event_type, data, created_at)
        SELECT i.event_id, i.stream_id, i.event_type, i.data::jsonb,
               COALESCE(NULLIF(i.created_at, '0001-01-01 00:00:00+00'::timestamptz), now())
        FROM unnest(event_ids, stream_ids, event_types, datas, created_ats)
             AS i (event_id, stream_id, event_type, data, created_at)
        RETURNING event_id, stream_id
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
        -- every event for every build (each event's stream is in pairs with each build)
        INSERT INTO wh_perspective_events (stream_id, perspective_name, event_id)
        SELECT ev.stream_id, b.build_key, ev.event_id
        FROM ev CROSS JOIN builds b
        RETURNING 1
    )
    SELECT (SELECT count(*) FROM queue),
           array_agg(p.stream_id ORDER BY p.stream_id, p.build_key),
           array_agg(p.build_key ORDER BY p.stream_id, p.build_key)
    INTO queued, pair_streams, pair_keys
    FROM pairs p;
    want := COALESCE(cardinality(pair_streams), 0);

    -- Hold every pair's due row until commit (why: 000008_due_pairs), inserting the missing
    -- ones (a new pair, or one whose row a release deleted meanwhile). Statements of their
    -- own, after the cursor rows: a catch-up page inserts a stream's cursor rows before its due
    -- rows too, so the two never wait for each other in opposite orders (in one statement
    -- with the cursors, an Append and a catch-up page can deadlock). Each sees the rows
    -- other transactions committed since the one before.
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

ALTER FUNCTION wh_claim_pairs(uuid, text[], int, float8) SET enable_seqscan = off;
ALTER FUNCTION wh_claim_pairs(uuid, text[], int, float8) SET jit = off;
