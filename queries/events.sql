-- Appending events and registering builds. Append takes a shared transaction-level
-- advisory lock and registration the exclusive one, so every Append either commits before a
-- new build is registered (its events are then in the store when the build's catch-up reads
-- it) or queues its events for the new build.

-- name: AppendLockAndNotify :one
-- Takes the shared append lock and queues the wake-up notification for listening workers
-- (PostgreSQL delivers it only if the transaction commits, and once per transaction).
-- Returns the transaction's isolation level: above READ COMMITTED, Append must also check
-- that its snapshot knows every build (RegistrationCheck).
SELECT current_setting('transaction_isolation')::text AS isolation
FROM (SELECT pg_advisory_xact_lock_shared(7214082031553392641), pg_notify('wh_perspective_events', '')) AS taken;

-- name: RegistrationCheck :exec
-- In a REPEATABLE READ or SERIALIZABLE transaction: fails with a serialization error when
-- a build was registered after the transaction's snapshot was taken (the snapshot would not
-- queue the events for it). The caller retries the transaction.
SELECT epoch FROM wh_registration WHERE id = 1 FOR SHARE;

-- name: QueueListen :exec
-- Subscribes the session to the notification AppendLockAndNotify queues.
LISTEN wh_perspective_events;

-- name: RegisterLock :exec
-- The exclusive side of the append lock, held by the (short) transaction that adds a build.
SELECT pg_advisory_xact_lock(7214082031553392641);

-- name: EventsAppend :execrows
-- Stores the events, enqueues one row per (event, build being built or active) and makes
-- sure each pair has a cursor row. Returns the number of queue rows written.
WITH ev AS (
    INSERT INTO wh_event_store (event_id, stream_id, event_type, data, created_at)
    SELECT i.event_id, i.stream_id, i.event_type, i.data::jsonb,
           COALESCE(NULLIF(i.created_at, '0001-01-01 00:00:00+00'::timestamptz), now())
    FROM (
        SELECT unnest(@event_ids::uuid[])          AS event_id,
               unnest(@stream_ids::uuid[])         AS stream_id,
               unnest(@event_types::text[])        AS event_type,
               unnest(@datas::text[])              AS data,
               unnest(@created_ats::timestamptz[]) AS created_at
    ) AS i
    RETURNING event_id, stream_id
), builds AS (
    SELECT b.build_key FROM wh_perspective_builds b WHERE b.state IN ('building', 'active')
), cursors AS (
    -- Each pair's cursor row exists from its first event on, so the worker can lock it at
    -- once. Ordered, so that concurrent appends to several streams never deadlock.
    INSERT INTO wh_perspective_cursors (stream_id, perspective_name)
    SELECT DISTINCT ev.stream_id, b.build_key
    FROM ev CROSS JOIN builds b
    ORDER BY 1, 2
    ON CONFLICT (stream_id, perspective_name) DO NOTHING
)
INSERT INTO wh_perspective_events (stream_id, perspective_name, event_id)
SELECT ev.stream_id, b.build_key, ev.event_id
FROM ev CROSS JOIN builds b;

-- name: PerspectiveRegister :execrows
INSERT INTO wh_perspectives (perspective_name) VALUES (@perspective_name)
ON CONFLICT (perspective_name) DO NOTHING;

-- name: PerspectiveList :many
SELECT perspective_name, registered_at FROM wh_perspectives ORDER BY perspective_name;

-- name: PerspectiveExists :one
SELECT EXISTS (SELECT 1 FROM wh_perspectives WHERE perspective_name = @perspective_name)::bool;

-- name: EventsReplayPage :many
-- One page of a stream's events after a position, up to an inclusive bound, in ID order.
SELECT event_id, stream_id, event_type, data, created_at
FROM wh_event_store
WHERE stream_id = @stream_id
  AND event_id > @after_event_id
  AND event_id <= @upto_event_id
ORDER BY event_id
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

-- name: QueueProbe :exec
-- A notification on the channel of AppendLockAndNotify with a payload (Appends send none):
-- a listener sends it to itself to check that its session receives notifications.
SELECT pg_notify('wh_perspective_events', @payload::text);

-- name: BackendPID :one
-- The process ID of the server backend that runs the statement (see pgq.Pooled).
SELECT pg_backend_pid()::int4 AS pid;
