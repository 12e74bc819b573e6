-- Back to 000008.
ALTER TABLE wh_perspectives DROP COLUMN sink;
