DROP TABLE IF EXISTS wh_perspective_snapshots;
DROP TABLE IF EXISTS wh_perspective_models;
DROP TABLE IF EXISTS wh_perspective_cursors;
DROP TABLE IF EXISTS wh_perspective_events;
DROP TABLE IF EXISTS wh_perspectives;
DROP TABLE IF EXISTS wh_event_store;
