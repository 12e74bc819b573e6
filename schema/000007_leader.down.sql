DROP INDEX IF EXISTS wh_perspective_events_build_age_idx;
DROP TABLE IF EXISTS wh_leader;
