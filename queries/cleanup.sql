-- The cleanup of retired builds' rows, in bounded batches (worker/cleanup.go).

-- name: BuildsToClean :many
-- Retired builds of the given perspectives whose rows are not all deleted, retired at least
-- grace_seconds ago (a transaction an instance began before it saw the retirement has ended),
-- oldest first.
SELECT build_key, perspective_name, version, build, state, catchup_done
FROM wh_perspective_builds
WHERE perspective_name = ANY(@perspective_names::text[])
  AND state = 'retired'
  AND cleaned_at IS NULL
  AND retired_at <= now() - make_interval(secs => @grace_seconds::float8)
ORDER BY retired_at, build_key;

-- name: BuildCleanupBatch :one
-- Deletes the rows of up to batch_size pairs of a retired build: queue rows, due rows,
-- snapshots, model and cursor. Returns the number of pairs deleted (0: none left).
WITH win AS (
    SELECT c.stream_id
    FROM wh_perspective_cursors c
    WHERE c.perspective_name = @build_key
    ORDER BY c.stream_id
    LIMIT @batch_size
    -- Another instance cleaning the same build at once takes other pairs: 0 pairs deleted
    -- means none is left but those another transaction holds (see BuildMarkCleaned).
    FOR UPDATE OF c SKIP LOCKED
), q AS (
    DELETE FROM wh_perspective_events e USING win
    WHERE e.stream_id = win.stream_id AND e.perspective_name = @build_key
), d AS (
    DELETE FROM wh_perspective_pairs p USING win
    WHERE p.stream_id = win.stream_id AND p.perspective_name = @build_key
), s AS (
    DELETE FROM wh_perspective_snapshots sn USING win
    WHERE sn.stream_id = win.stream_id AND sn.perspective_name = @build_key
), m AS (
    DELETE FROM wh_perspective_models mo USING win
    WHERE mo.stream_id = win.stream_id AND mo.perspective_name = @build_key
), c AS (
    DELETE FROM wh_perspective_cursors cu USING win
    WHERE cu.stream_id = win.stream_id AND cu.perspective_name = @build_key
    RETURNING 1
)
SELECT count(*)::bigint AS deleted FROM c;

-- name: BuildCursorsLeft :one
-- Whether a build has cursor rows left (after BuildCleanupBatch deleted none: some are held
-- by another transaction, a rewind committing say).
SELECT EXISTS (SELECT 1 FROM wh_perspective_cursors c WHERE c.perspective_name = @build_key)::bool;

-- name: BuildMarkCleaned :exec
-- Marks a retired build cleaned once none of its cursor rows is left (BuildCleanupBatch found
-- none it could lock): not while another transaction holds some, which may be a cleanup that
-- fails or a lock that deletes nothing; the next cleanup deletes them.
UPDATE wh_perspective_builds b SET cleaned_at = now()
WHERE b.build_key = @build_key AND b.state = 'retired'
  AND NOT EXISTS (SELECT 1 FROM wh_perspective_cursors c WHERE c.perspective_name = @build_key);
