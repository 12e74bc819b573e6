-- Back to 000008.
ALTER TABLE wh_perspectives DROP COLUMN sink;
ALTER TABLE wh_instances DROP COLUMN sink_ms;
ALTER TABLE wh_perspective_builds DROP COLUMN promotion_requested;
