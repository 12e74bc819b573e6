DROP FUNCTION IF EXISTS wh_append(uuid[], uuid[], text[], text[], timestamptz[]);
-- The down migration of 000006 keeps wh_notify_queued for the wh_append that calls it: it
-- goes with wh_append.
DROP FUNCTION IF EXISTS wh_notify_queued(timestamptz);
