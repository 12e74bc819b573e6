-- Forgetting gone instances (worker/forget.go).

-- name: InstancesForget :execrows
-- Deletes the rows of instances gone (not seen) for longer than forget_seconds: what an
-- instance killed without a clean stop leaves behind.
DELETE FROM wh_instances
WHERE last_seen_at < now() - make_interval(secs => @forget_seconds::float8);
