-- Leader leases (wh_leader, schema/000007_leader.up.sql): one row per election name, held by
-- one instance until its expiry, on the database clock. worker/leader.go attempts, renews and
-- resigns them; every maintenance write is fenced by LeaderHold in its own transaction.

-- name: LeaderAttempt :many
-- Takes each named lease that is free or expired, and renews each one the instance holds
-- already, for ttl_seconds from now; returns the names it holds afterwards. elected_at is
-- when this holder's term began: kept by a renewal, now for a new term. The names come
-- sorted, so that two instances attempting the same names lock their rows in the same order.
INSERT INTO wh_leader AS l (name, leader_id, elected_at, expires_at)
SELECT n.name, @leader_id::uuid, now(), now() + make_interval(secs => @ttl_seconds::float8)
FROM unnest(@names::text[]) AS n (name)
ORDER BY n.name
ON CONFLICT (name) DO UPDATE
SET leader_id = EXCLUDED.leader_id,
    elected_at = CASE WHEN l.leader_id = EXCLUDED.leader_id AND l.expires_at > now() THEN l.elected_at
                      ELSE EXCLUDED.elected_at END,
    expires_at = EXCLUDED.expires_at
WHERE l.leader_id = EXCLUDED.leader_id OR l.expires_at <= now()
RETURNING l.name;

-- name: LeaderResign :execrows
-- Gives up the named leases the instance holds (at its stop): the others take them at their
-- next attempt, without waiting for the expiry.
DELETE FROM wh_leader
WHERE leader_id = @leader_id AND name = ANY(@names::text[]);

-- name: LeaderHold :one
-- The fence of a maintenance write, first in its transaction: the lease's row while the
-- instance holds it unexpired (clock_timestamp: when the check runs, not when the transaction
-- began), locked FOR SHARE so that no other instance takes it over before the write commits.
-- No row: the instance is not the leader, and the write is rolled back.
SELECT name
FROM wh_leader
WHERE name = @name AND leader_id = @leader_id AND expires_at > clock_timestamp()
FOR SHARE;
