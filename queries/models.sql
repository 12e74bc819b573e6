-- name: ModelGet :one
SELECT model, last_event_id
FROM wh_perspective_models
WHERE stream_id = @stream_id AND perspective_name = @perspective_name;

-- name: ModelDelete :execrows
DELETE FROM wh_perspective_models
WHERE stream_id = @stream_id AND perspective_name = @perspective_name;

-- name: SnapshotLatestBefore :one
-- The newest snapshot strictly before an event.
SELECT snapshot_event_id, model
FROM wh_perspective_snapshots
WHERE stream_id = @stream_id
  AND perspective_name = @perspective_name
  AND snapshot_event_id < @before_event_id
ORDER BY snapshot_event_id DESC
LIMIT 1;

-- name: SnapshotInsert :exec
INSERT INTO wh_perspective_snapshots (stream_id, perspective_name, snapshot_event_id, model)
VALUES (@stream_id, @perspective_name, @snapshot_event_id, @model)
ON CONFLICT (stream_id, perspective_name, snapshot_event_id) DO UPDATE
SET model = EXCLUDED.model;

-- name: SnapshotIDs :many
-- Snapshot positions of one pair, newest first.
SELECT snapshot_event_id
FROM wh_perspective_snapshots
WHERE stream_id = @stream_id AND perspective_name = @perspective_name
ORDER BY snapshot_event_id DESC;

-- name: SnapshotsDelete :execrows
DELETE FROM wh_perspective_snapshots
WHERE stream_id = @stream_id
  AND perspective_name = @perspective_name
  AND snapshot_event_id = ANY(@snapshot_event_ids::uuid[]);

-- name: SnapshotsDeleteFrom :execrows
-- Drops the snapshots at or after an event (a late event invalidated them).
DELETE FROM wh_perspective_snapshots
WHERE stream_id = @stream_id
  AND perspective_name = @perspective_name
  AND snapshot_event_id >= @from_event_id;

-- name: SnapshotsDeleteAll :execrows
DELETE FROM wh_perspective_snapshots
WHERE stream_id = @stream_id AND perspective_name = @perspective_name;
