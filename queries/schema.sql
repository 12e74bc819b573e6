-- The schema package's own statements (schema/schema.go).

-- name: MigrationTurnTry :one
-- Tries, without waiting, the session-level advisory lock that the callers of
-- schema.MigrateFS migrating the history table migrations_table take turns on; held until the
-- session ends.
SELECT pg_try_advisory_lock(hashtext('perspectives schema.Migrate ' || @migrations_table::text))::bool AS mine;
