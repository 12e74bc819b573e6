-- Registration of builds (schema/000002_builds.up.sql) and the append lock. Append takes the
-- shared side of a transaction-level advisory lock and registration the exclusive one, so
-- every Append either commits before a new build is registered (its events are then in the
-- store when the build's catch-up reads it) or queues its events for the new build.

-- name: BuildsOf :many
-- Every build of the given perspectives, oldest first.
SELECT build_key, perspective_name, version, build, state, catchup_done, promotion_requested
FROM wh_perspective_builds
WHERE perspective_name = ANY(@perspective_names::text[])
ORDER BY perspective_name, version, build;

-- name: BuildCreate :exec
-- Adds a build. An active one (the perspective's first) is promoted at once.
INSERT INTO wh_perspective_builds (build_key, perspective_name, version, build, state, promoted_at)
VALUES (@build_key, @perspective_name, @version, @build, @state::text,
        CASE WHEN @state::text = 'active' THEN now() END);

-- name: RegistrationBump :exec
-- In the transaction that adds a build or promotes one: see wh_registration.
UPDATE wh_registration SET epoch = epoch + 1 WHERE id = 1;

-- name: BuildKeyTaken :one
-- Whether a build key is used, by any perspective's build (a perspective's name is its
-- first build's key, so a new name must not be another's key either).
SELECT EXISTS (SELECT 1 FROM wh_perspective_builds WHERE build_key = @build_key)::bool;

-- name: BuildsStatus :many
-- Every build with its catch-up progress and queue (the versions command, the metrics),
-- its failing and parked pairs (through the partial index of the cursors whose status is
-- not ok: a few index entries, whatever the size of the cursor table) and the live
-- instances that run its version (heartbeats younger than three intervals, database clock).
SELECT b.build_key, b.perspective_name, b.version, b.build, b.state,
       b.created_at, b.promoted_at, b.retired_at, b.cleaned_at,
       b.catchup_done, b.catchup_events, b.catchup_streams,
       b.catchup_started_at, b.catchup_done_at, b.catchup_holder,
       COALESCE(q.depth, 0)::bigint AS queued,
       COALESCE((extract(epoch FROM clock_timestamp() - q.oldest) * 1000000)::bigint, 0)::bigint AS oldest_queued_micros,
       COALESCE(f.failing, 0)::bigint AS failing,
       COALESCE(f.parked, 0)::bigint AS parked,
       COALESCE(l.live, 0)::bigint AS live_instances,
       COALESCE(l.rate, 0)::float8 AS events_per_second,
       COALESCE(l.sink_ms, 0)::float8 AS sink_ms
FROM wh_perspective_builds b
LEFT JOIN (
    SELECT perspective_name, count(*) AS depth, min(enqueued_at) AS oldest
    FROM wh_perspective_events
    GROUP BY perspective_name
) q ON q.perspective_name = b.build_key
LEFT JOIN (
    -- The cursors that are not ok, once for all builds, through their partial index probed
    -- with the builds' keys: an index plan whether or not the cursors were analyzed. (Counted
    -- per build instead, in a subquery, the estimate of a never-analyzed builds table makes
    -- the statement cost enough for PostgreSQL to JIT-compile it: half a second each time.)
    SELECT c.perspective_name,
           count(*) FILTER (WHERE c.status = 'failed') AS failing,
           count(*) FILTER (WHERE c.status = 'parked') AS parked
    FROM wh_perspective_cursors c
    WHERE c.perspective_name = ANY (ARRAY(SELECT bk.build_key FROM wh_perspective_builds bk))
      AND c.status <> 'ok'
    GROUP BY c.perspective_name
) f ON f.perspective_name = b.build_key
LEFT JOIN (
    -- Counted once for all builds, for the same reason.
    -- (rate: the events they applied per second over their last heartbeat interval; sink_ms:
    -- the mean of their sinks' time per commit over it, among those that committed)
    SELECT i.perspectives[k] AS perspective_name, i.versions[k] AS version, count(*) AS live,
           sum(COALESCE(i.rates[k], 0)) AS rate,
           avg(NULLIF(i.sink_ms[k], 0)) AS sink_ms
    FROM wh_instances i, generate_subscripts(i.perspectives, 1) AS k
    WHERE i.last_seen_at >= now() - 3 * i.heartbeat_interval
    GROUP BY 1, 2
) l ON l.perspective_name = b.perspective_name AND l.version = b.version
ORDER BY b.perspective_name, b.version, b.build;

-- name: ModelActiveGet :one
-- The model of a stream in a perspective's active build (a name without builds: its own
-- rows). One statement, so a promotion is seen whole or not at all.
SELECT m.model
FROM wh_perspective_models m
WHERE m.stream_id = @stream_id
  AND m.perspective_name = COALESCE(
      (SELECT b.build_key FROM wh_perspective_builds b
       WHERE b.perspective_name = @perspective_name AND b.state = 'active'),
      @perspective_name);

-- name: EventStoreEstimate :one
-- The planner's estimate of the stored events (-1 before the first ANALYZE).
SELECT c.reltuples::bigint AS estimate FROM pg_catalog.pg_class c WHERE c.oid = 'wh_event_store'::regclass;

-- name: RegisterLock :exec
-- The exclusive side of the append lock, held by the (short) transaction that adds or
-- promotes a build, waited for wait_ms at most (the transaction's lock_timeout, set back to
-- what it was once the lock is granted): a lock not granted by then fails with SQLSTATE
-- 55P03, and the caller tries again in a new transaction (worker/builds.go,
-- underAppendLock). A request that waits makes every later Append wait behind it, since
-- PostgreSQL queues a shared request behind a waiting exclusive one: unbounded, a
-- transaction that appended and stays open would hold up every Append until it ends. The
-- order is the data's: the innermost subquery (OFFSET 0: not pulled up) reads the value
-- before, the one around it sets the bound (a volatile output, kept and evaluated as its row
-- is made), and the lock is an argument of the call that sets the value back. (As a WHERE
-- clause the lock would be pushed down below the bound.)
SELECT set_config('lock_timeout', s.before || left(pg_advisory_xact_lock(7214082031553392641)::text, 0), true)
FROM (SELECT b.before, set_config('lock_timeout', (@wait_ms::int)::text, true) AS bound
      FROM (SELECT current_setting('lock_timeout') AS before OFFSET 0) b) s;

-- name: RegisterLockTry :one
-- The exclusive side of the append lock if no transaction holds it now (false otherwise): a
-- try never queues, so no Append waits behind it (see RegisterLock).
SELECT pg_try_advisory_xact_lock(7214082031553392641)::bool AS locked;

-- name: AppendLockHolders :many
-- The transactions holding the shared side of the append lock (they appended events and have
-- not ended): each one's virtual transaction ID (which names it alone, while it runs), its
-- server process (0: a prepared transaction) and how long it has been open (-1: not visible
-- to this role), longest first. An advisory lock on one bigint key is classid (its high 32
-- bits), objid (its low 32 bits) and objsubid 1 in pg_locks.
SELECT l.virtualtransaction::text AS transaction,
       COALESCE(l.pid, 0)::int4 AS pid,
       COALESCE((extract(epoch FROM clock_timestamp() - a.xact_start) * 1000000)::bigint, -1)::bigint AS xact_age_micros
FROM pg_catalog.pg_locks l
LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.mode = 'ShareLock'
  AND l.database = (SELECT d.oid FROM pg_catalog.pg_database d WHERE d.datname = current_database())
  AND l.classid = (7214082031553392641::bigint >> 32)::oid
  AND l.objid = (7214082031553392641::bigint & 4294967295)::oid
  AND l.objsubid = 1
ORDER BY a.xact_start NULLS LAST, l.virtualtransaction;

-- name: PerspectiveRegister :execrows
INSERT INTO wh_perspectives (perspective_name) VALUES (@perspective_name)
ON CONFLICT (perspective_name) DO NOTHING;

-- name: PerspectiveList :many
SELECT perspective_name, registered_at FROM wh_perspectives ORDER BY perspective_name;

-- name: PerspectiveExists :one
SELECT EXISTS (SELECT 1 FROM wh_perspectives WHERE perspective_name = @perspective_name)::bool;

-- name: PerspectiveSinkSet :exec
-- Records whether the perspective writes to a sink, when its registration says otherwise
-- than the last one (one key lookup, no write otherwise).
UPDATE wh_perspectives SET sink = @sink::bool
WHERE perspective_name = @perspective_name AND sink <> @sink::bool;

-- name: PerspectiveSink :one
-- Whether the perspective writes to a sink (false: not registered).
SELECT COALESCE((SELECT sink FROM wh_perspectives WHERE perspective_name = @perspective_name), false)::bool;
