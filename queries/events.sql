-- Appending events and registering builds. Append takes a shared transaction-level
-- advisory lock and registration the exclusive one, so every Append either commits before a
-- new build is registered (its events are then in the store when the build's catch-up reads
-- it) or queues its events for the new build.

-- name: QueueListen :exec
-- Subscribes the session to the notification wh_append queues.
LISTEN wh_perspective_events;

-- name: RegisterLock :exec
-- The exclusive side of the append lock, held by the (short) transaction that adds a build.
SELECT pg_advisory_xact_lock(7214082031553392641);

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

-- name: QueueProbe :exec
-- A notification on the channel of wh_append with a payload (Appends send none):
-- a listener sends it to itself to check that its session receives notifications.
SELECT pg_notify('wh_perspective_events', @payload::text);

-- name: BackendPID :one
-- The process ID of the server backend that runs the statement (see pgq.Pooled).
SELECT pg_backend_pid()::int4 AS pid;
