-- Worker instances' heartbeats (wh_instances, schema/000004_operations.up.sql). Liveness is
-- judged on the database clock: an instance is alive while its row is younger than three
-- of its heartbeat intervals.

-- name: InstanceBeat :exec
-- Records an instance as running now: inserts its row (started now) or refreshes it. Its
-- first heartbeat only, and again when InstanceRefresh found no row (the parameters are
-- InstanceRefresh's, in the same order).
INSERT INTO wh_instances (host, pid, heartbeat_interval, perspectives, versions, rates, sink_ms, instance_id)
VALUES (@host, @pid, make_interval(secs => @heartbeat_seconds::float8),
        @perspectives::text[], @versions::integer[], @rates::float8[], @sink_ms::float8[], @instance_id)
ON CONFLICT (instance_id) DO UPDATE
SET last_seen_at = now(),
    host = EXCLUDED.host,
    pid = EXCLUDED.pid,
    heartbeat_interval = EXCLUDED.heartbeat_interval,
    perspectives = EXCLUDED.perspectives,
    versions = EXCLUDED.versions,
    rates = EXCLUDED.rates,
    sink_ms = EXCLUDED.sink_ms;

-- name: InstanceRefresh :execrows
-- Refreshes an instance's row as InstanceBeat does, and never inserts it: a heartbeat that
-- runs late on the server (its client gave up on it) after Stop deleted the row does not
-- bring the row back. 0 rows: there is no row.
UPDATE wh_instances
SET host = @host,
    pid = @pid,
    heartbeat_interval = make_interval(secs => @heartbeat_seconds::float8),
    perspectives = @perspectives::text[],
    versions = @versions::integer[],
    rates = @rates::float8[],
    sink_ms = @sink_ms::float8[],
    last_seen_at = now()
WHERE instance_id = @instance_id;

-- name: InstanceDelete :exec
-- Removes an instance's row at its clean stop.
DELETE FROM wh_instances WHERE instance_id = @instance_id;

-- name: InstancesList :many
-- Every recorded instance, oldest first, with its liveness and how long ago it was last
-- seen, both on the database clock.
SELECT instance_id, host, pid, started_at, last_seen_at,
       (extract(epoch FROM heartbeat_interval) * 1000000)::bigint AS heartbeat_micros,
       perspectives, versions, rates,
       (last_seen_at >= now() - 3 * heartbeat_interval)::bool AS alive,
       (extract(epoch FROM now() - last_seen_at) * 1000000)::bigint AS seen_ago_micros
FROM wh_instances
ORDER BY started_at, instance_id;
