-- Appending events and registering builds. Append takes a shared transaction-level
-- advisory lock and registration the exclusive one, so every Append either commits before a
-- new build is registered (its events are then in the store when the build's catch-up reads
-- it) or queues its events for the new build.

-- name: RegisterLock :exec
-- The exclusive side of the append lock, held by the (short) transaction that adds or
-- promotes a build, waited for wait_ms at most (the transaction's lock_timeout, set back to
-- what it was once the lock is granted): a lock not granted by then fails with SQLSTATE
-- 55P03, and the caller tries again in a new transaction (worker/pgstore_builds.go,
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

-- name: EventsAppend :one
-- Stores the events, enqueues one row per (event, build being built or active), makes sure
-- each pair has a cursor row and notifies listening workers, in one statement (see wh_append
-- in schema/000003_append.up.sql). Returns the number of queue rows written.
SELECT wh_append(@event_ids::uuid[], @stream_ids::uuid[], @event_types::text[],
                 @datas::text[], @created_ats::timestamptz[])::bigint AS queued;

-- name: PerspectiveRegister :execrows
INSERT INTO wh_perspectives (perspective_name) VALUES (@perspective_name)
ON CONFLICT (perspective_name) DO NOTHING;

-- name: PerspectiveList :many
SELECT perspective_name, registered_at FROM wh_perspectives ORDER BY perspective_name;

-- name: PerspectiveExists :one
SELECT EXISTS (SELECT 1 FROM wh_perspectives WHERE perspective_name = @perspective_name)::bool;

-- name: EventsReplayPage :many
-- One page of a stream's events after a position, up to an inclusive bound, in ID order,
-- without the events the pair (the stream and build_key) skipped.
SELECT e.event_id, e.stream_id, e.event_type, e.data, e.created_at
FROM wh_event_store e
WHERE e.stream_id = @stream_id
  AND e.event_id > @after_event_id
  AND e.event_id <= @upto_event_id
  AND NOT EXISTS (SELECT 1 FROM wh_skipped_events s
                  WHERE s.stream_id = e.stream_id AND s.perspective_name = @build_key::text
                    AND s.event_id = e.event_id)
ORDER BY e.event_id
LIMIT @page_size;

-- name: EventsForStream :many
-- Every event of a stream in ID order (tests, the demo's consistency check).
SELECT event_id, stream_id, event_type, data, created_at
FROM wh_event_store
WHERE stream_id = @stream_id
ORDER BY event_id;

-- name: StreamIDs :many
SELECT DISTINCT stream_id FROM wh_event_store ORDER BY stream_id;

-- name: EventCount :one
SELECT count(*)::bigint FROM wh_event_store;

-- name: BackendPID :one
-- The process ID of the server backend that runs the statement (see pgq.Pooled).
SELECT pg_backend_pid()::int4 AS pid;
