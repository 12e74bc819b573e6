-- Whether a perspective writes to a sink (the application's own tables, worker.Sink), as its
-- last registration said. Only the perspective's code can update those tables, so an
-- operator's action without it (worker.Admin: purge, rebuild of a stream) is refused for
-- such a perspective rather than leave them behind its models, and its promotion is
-- requested of the workers.
ALTER TABLE wh_perspectives ADD COLUMN sink boolean NOT NULL DEFAULT false;

-- The mean time of a sink's Write per committing transaction over the instance's last
-- heartbeat interval, per perspective (parallel to perspectives; 0: no sink, or no commit).
ALTER TABLE wh_instances ADD COLUMN sink_ms float8[] NOT NULL DEFAULT '{}';

-- An operator's promotion of a build of a sink's perspective (worker.Admin.Promote), which
-- the holder of the version's promotion lease carries out: only a worker runs the sink's
-- Promoter in the promotion transaction.
ALTER TABLE wh_perspective_builds ADD COLUMN promotion_requested boolean NOT NULL DEFAULT false;
