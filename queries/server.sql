-- The server itself, for reports (the benchmark harness, bench/doc.go).

-- name: ServerVersion :one
SELECT version()::text AS version;

-- name: ServerSettings :many
-- The named settings as "name = value", the value as SHOW prints it (with its unit), in the
-- order of names.
SELECT (n.name || ' = ' || current_setting(n.name))::text AS setting
FROM unnest(@names::text[]) WITH ORDINALITY AS n (name, ord)
ORDER BY n.ord;
