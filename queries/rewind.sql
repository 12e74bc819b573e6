-- A rewind (worker/rewind.go): what it starts from, the replay, the snapshots it drops.

-- name: QueueIDsForPair :many
-- The queued event IDs of one pair, in order. The pair is compared with a subquery's values,
-- which the planner does not know: it plans for an average pair, a lookup in the primary
-- key, whatever the statistics say of the given one (given a hot stream that they count as a
-- third of the queue, as they still do after most of its rows were applied, it scans the
-- whole table). See worker/plans_sql_test.go.
SELECT q.event_id FROM wh_perspective_events q
WHERE (q.stream_id, q.perspective_name) = (SELECT @stream_id::uuid, @perspective_name::text)
ORDER BY q.event_id;

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

-- name: SnapshotLatestBefore :one
-- The newest snapshot strictly before an event.
SELECT snapshot_event_id, model
FROM wh_perspective_snapshots
WHERE stream_id = @stream_id
  AND perspective_name = @perspective_name
  AND snapshot_event_id < @before_event_id
ORDER BY snapshot_event_id DESC
LIMIT 1;

-- name: SnapshotIDs :many
-- Snapshot positions of one pair, newest first.
SELECT snapshot_event_id
FROM wh_perspective_snapshots
WHERE stream_id = @stream_id AND perspective_name = @perspective_name
ORDER BY snapshot_event_id DESC;

-- name: CursorGet :one
SELECT stream_id, perspective_name, last_event_id, version, status, last_error, attempts,
       events_since_snapshot,
       stream_lock_instance_id,
       COALESCE(stream_lock_expiry > clock_timestamp(), false)::bool AS lock_live
FROM wh_perspective_cursors
WHERE stream_id = @stream_id AND perspective_name = @perspective_name;
