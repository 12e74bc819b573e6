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

-- name: SnapshotsInsertMany :exec
-- SnapshotInsert for many snapshots, given as parallel arrays.
INSERT INTO wh_perspective_snapshots (stream_id, perspective_name, snapshot_event_id, model)
SELECT unnest(@stream_ids::uuid[]), unnest(@perspective_names::text[]),
       unnest(@snapshot_event_ids::uuid[]), unnest(@models::jsonb[])
ON CONFLICT (stream_id, perspective_name, snapshot_event_id) DO UPDATE
SET model = EXCLUDED.model;

-- name: SnapshotsPrune :execrows
-- Applies the retention of the given pairs' snapshots (Snapshots.MaxPerStream): of each
-- pair's snapshots, newest first, it keeps the first max_per_stream-1 and the last (the
-- oldest, so that a very late event still finds a restore point), or only the first when
-- max_per_stream is 1.
DELETE FROM wh_perspective_snapshots s
USING (
    SELECT r.stream_id, r.perspective_name, r.snapshot_event_id,
           row_number() OVER w AS pos,
           count(*) OVER (PARTITION BY r.stream_id, r.perspective_name) AS total
    FROM wh_perspective_snapshots r
    JOIN (SELECT unnest(@stream_ids::uuid[]) AS stream_id, unnest(@perspective_names::text[]) AS perspective_name) p
      ON r.stream_id = p.stream_id AND r.perspective_name = p.perspective_name
    WINDOW w AS (PARTITION BY r.stream_id, r.perspective_name ORDER BY r.snapshot_event_id DESC)
) ranked
WHERE s.stream_id = ranked.stream_id
  AND s.perspective_name = ranked.perspective_name
  AND s.snapshot_event_id = ranked.snapshot_event_id
  AND ranked.pos >= GREATEST(@max_per_stream::int, 2)
  AND (@max_per_stream::int = 1 OR ranked.pos < ranked.total);
