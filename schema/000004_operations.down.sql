-- wh_append keeps the version of 000004: without parked rows (their due time is reset
-- below) it does what the version of 000003 does.
UPDATE wh_perspective_events SET next_attempt_at = now() WHERE next_attempt_at = '9999-12-31 00:00:00+00';
DROP TABLE IF EXISTS wh_instances;
DROP TABLE IF EXISTS wh_skipped_events;
DROP INDEX IF EXISTS wh_perspective_cursors_failed_idx;
UPDATE wh_perspective_cursors SET status = 'failed' WHERE status = 'parked';
ALTER TABLE wh_perspective_cursors
    DROP COLUMN IF EXISTS failed_since,
    DROP COLUMN IF EXISTS failed_event_id,
    DROP CONSTRAINT wh_perspective_cursors_status_check,
    ADD CONSTRAINT wh_perspective_cursors_status_check CHECK (status IN ('ok', 'failed'));
CREATE INDEX wh_perspective_cursors_failed_idx
    ON wh_perspective_cursors (perspective_name)
    WHERE status = 'failed';
