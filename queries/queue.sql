-- Counts of the queue, for the status and the command line.

-- name: QueueDepth :many
-- Queue depth per perspective, and the age of its oldest row on the database clock.
SELECT perspective_name,
       count(*)::bigint AS depth,
       (extract(epoch FROM clock_timestamp() - min(enqueued_at)) * 1000000)::bigint AS oldest_age_micros
FROM wh_perspective_events
GROUP BY perspective_name
ORDER BY perspective_name;

-- name: QueueCount :one
SELECT count(*)::bigint FROM wh_perspective_events;

-- name: QueueCountFor :one
-- Queued rows of a perspective's builds that are not retired, optionally of one stream.
SELECT count(*)::bigint FROM wh_perspective_events q
WHERE q.perspective_name IN (
        SELECT b.build_key FROM wh_perspective_builds b
        WHERE b.perspective_name = @perspective_name AND b.state <> 'retired')
  AND (sqlc.narg(stream_id)::uuid IS NULL OR q.stream_id = sqlc.narg(stream_id)::uuid);
