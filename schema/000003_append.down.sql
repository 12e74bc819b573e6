DROP FUNCTION IF EXISTS wh_append(uuid[], uuid[], text[], text[], timestamptz[]);
