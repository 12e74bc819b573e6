-- Whether a perspective writes to a sink (the application's own tables, worker.Sink), as its
-- last registration said. Only the perspective's code can update those tables, so an
-- operator's action without it (worker.Admin: purge, rebuild of a stream, a forced
-- promotion) is refused for such a perspective rather than leave them behind its models.
ALTER TABLE wh_perspectives ADD COLUMN sink boolean NOT NULL DEFAULT false;
