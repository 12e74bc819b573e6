DROP FUNCTION IF EXISTS wh_delete_applied(uuid[], text[], uuid[]);
