-- Appending events (wh_append) and reading them: LoadModel's active model, counts.

-- name: EventsAppend :one
-- Stores the events, enqueues one row per (event, build being built or active), makes sure
-- each pair has a cursor row and notifies listening workers, in one statement (see wh_append
-- in schema/000003_append.up.sql). Returns the number of queue rows written.
SELECT wh_append(@event_ids::uuid[], @stream_ids::uuid[], @event_types::text[],
                 @datas::text[], @created_ats::timestamptz[])::bigint AS queued;

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
