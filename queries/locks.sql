-- Stream locks live on the cursor row of a (stream, perspective) pair.
-- Every expiry is set and compared with the database clock; no client time is used.
-- clock_timestamp(), not now(): now() is fixed when the transaction starts, so a statement
-- that waited for the row lock would otherwise compare with a stale time (reviving a lock
-- that lapsed during the wait, or granting a lease that already ran out).

-- name: StreamLockAcquireFree :execrows
-- Acquire's common case without the look-up of the previous holder: the pair is unlocked
-- (its cursor row is created when missing) or already held by the caller (reason and
-- expiry are then overwritten); no takeover is possible. When it takes nothing,
-- StreamLockAcquire decides (a lock of another instance, expired or not). An upsert, not a
-- plain UPDATE: ON CONFLICT locks the row before computing the expiry, so a statement that
-- waited for the row still grants a full lease.
INSERT INTO wh_perspective_cursors AS c (
    stream_id, perspective_name, stream_lock_instance_id, stream_lock_expiry, stream_lock_reason
) VALUES (
    @stream_id, @perspective_name, @instance_id::uuid,
    clock_timestamp() + make_interval(secs => @lock_timeout_seconds::float8), @reason::text
)
ON CONFLICT (stream_id, perspective_name) DO UPDATE
SET stream_lock_instance_id = EXCLUDED.stream_lock_instance_id,
    stream_lock_expiry      = clock_timestamp() + make_interval(secs => @lock_timeout_seconds::float8),
    stream_lock_reason      = EXCLUDED.stream_lock_reason
WHERE c.stream_lock_instance_id IS NULL
   OR c.stream_lock_instance_id = EXCLUDED.stream_lock_instance_id;

-- name: StreamLockAcquire :one
-- Takes the lock when the pair is unlocked, its lock has expired, or the caller already
-- holds it (reason and expiry are then overwritten). Creates the cursor row if it is missing.
-- A row is returned only when the caller now holds the lock; took_over says that it
-- replaced another instance's (expired) lock — as seen when the statement began, which is
-- exact unless another writer changed the row meanwhile (it is reported for metrics only).
WITH prev AS (
    SELECT stream_lock_instance_id AS holder
    FROM wh_perspective_cursors
    WHERE stream_id = @stream_id AND perspective_name = @perspective_name
)
INSERT INTO wh_perspective_cursors AS c (
    stream_id, perspective_name, stream_lock_instance_id, stream_lock_expiry, stream_lock_reason
) VALUES (
    @stream_id, @perspective_name, @instance_id::uuid,
    clock_timestamp() + make_interval(secs => @lock_timeout_seconds::float8), @reason::text
)
ON CONFLICT (stream_id, perspective_name) DO UPDATE
SET stream_lock_instance_id = EXCLUDED.stream_lock_instance_id,
    -- Computed here, not taken from EXCLUDED: VALUES is evaluated before any wait for the row.
    stream_lock_expiry      = clock_timestamp() + make_interval(secs => @lock_timeout_seconds::float8),
    stream_lock_reason      = EXCLUDED.stream_lock_reason
WHERE c.stream_lock_instance_id IS NULL
   OR c.stream_lock_expiry <= clock_timestamp()
   OR c.stream_lock_instance_id = EXCLUDED.stream_lock_instance_id
RETURNING COALESCE((SELECT holder <> @instance_id::uuid FROM prev), false)::bool AS took_over;

-- name: StreamLockRenew :execrows
-- Extends the expiry only while the caller holds an unexpired lock; a lapsed lock is not revived.
UPDATE wh_perspective_cursors
SET stream_lock_expiry = clock_timestamp() + make_interval(secs => @lock_timeout_seconds::float8)
WHERE stream_id = @stream_id
  AND perspective_name = @perspective_name
  AND stream_lock_instance_id = @instance_id::uuid
  AND stream_lock_expiry > clock_timestamp();

-- name: StreamLockRelease :execrows
-- Clears the lock only if the caller holds it.
UPDATE wh_perspective_cursors
SET stream_lock_instance_id = NULL,
    stream_lock_expiry      = NULL,
    stream_lock_reason      = NULL
WHERE stream_id = @stream_id
  AND perspective_name = @perspective_name
  AND stream_lock_instance_id = @instance_id::uuid;

-- name: StreamLockForceRelease :execrows
-- Clears the lock whoever holds it (operator action).
UPDATE wh_perspective_cursors
SET stream_lock_instance_id = NULL,
    stream_lock_expiry      = NULL,
    stream_lock_reason      = NULL
WHERE stream_id = @stream_id
  AND perspective_name = @perspective_name
  AND stream_lock_instance_id IS NOT NULL;

-- name: StreamLockGet :one
-- The unexpired lock on one pair, with the time left on the database clock.
SELECT stream_id,
       perspective_name,
       stream_lock_instance_id::uuid          AS instance_id,
       stream_lock_reason::text               AS reason,
       stream_lock_expiry::timestamptz        AS expiry,
       (extract(epoch FROM stream_lock_expiry - clock_timestamp()) * 1000000)::bigint AS expires_in_micros
FROM wh_perspective_cursors
WHERE stream_id = @stream_id
  AND perspective_name = @perspective_name
  AND stream_lock_instance_id IS NOT NULL
  AND stream_lock_expiry > clock_timestamp();

-- name: StreamLockList :many
-- Every unexpired lock, soonest expiry first, with the time left on the database clock.
SELECT stream_id,
       perspective_name,
       stream_lock_instance_id::uuid          AS instance_id,
       stream_lock_reason::text               AS reason,
       stream_lock_expiry::timestamptz        AS expiry,
       (extract(epoch FROM stream_lock_expiry - clock_timestamp()) * 1000000)::bigint AS expires_in_micros
FROM wh_perspective_cursors
WHERE stream_lock_instance_id IS NOT NULL
  AND stream_lock_expiry > clock_timestamp()
ORDER BY stream_lock_expiry, stream_id, perspective_name;
