DROP TABLE IF EXISTS wh_registration;
DROP INDEX IF EXISTS wh_perspective_cursors_build_idx;
DROP TABLE IF EXISTS wh_perspective_builds;
