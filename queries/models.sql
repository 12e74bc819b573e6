-- Snapshots written by the normal path, a rewind and a bootstrap.

-- name: SnapshotsInsert :exec
-- Stores snapshots, given as parallel arrays (a snapshot already at that position is
-- replaced).
INSERT INTO wh_perspective_snapshots (stream_id, perspective_name, snapshot_event_id, model)
SELECT unnest(@stream_ids::uuid[]), unnest(@perspective_names::text[]),
       unnest(@snapshot_event_ids::uuid[]), unnest(@models::text[])::jsonb
ON CONFLICT (stream_id, perspective_name, snapshot_event_id) DO UPDATE
SET model = EXCLUDED.model;

-- name: SnapshotsDelete :execrows
-- Deletes the given snapshots, as three parallel arrays (the retention's victims).
DELETE FROM wh_perspective_snapshots s
USING (
    SELECT unnest(@stream_ids::uuid[]) AS stream_id,
           unnest(@perspective_names::text[]) AS perspective_name,
           unnest(@snapshot_event_ids::uuid[]) AS snapshot_event_id
) d
WHERE s.stream_id = d.stream_id
  AND s.perspective_name = d.perspective_name
  AND s.snapshot_event_id = d.snapshot_event_id;

-- name: SnapshotsDeleteFrom :execrows
-- Drops the pair's snapshots at or after an event (a late event invalidated them; the nil
-- UUID drops them all).
DELETE FROM wh_perspective_snapshots
WHERE stream_id = @stream_id
  AND perspective_name = @perspective_name
  AND snapshot_event_id >= @from_event_id;
