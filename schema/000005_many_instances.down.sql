ALTER TABLE wh_instances DROP COLUMN IF EXISTS claimed_at;
DROP FUNCTION IF EXISTS wh_delete_applied(uuid[], text[], uuid[]);
