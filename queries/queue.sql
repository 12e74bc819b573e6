-- name: PairsClaim :many
-- The claim: leases up to max_pairs due pairs of the builds this instance runs (build_keys),
-- oldest due first, in one statement. A pair is due when its due row says so (due_at: its
-- oldest queued event, a backoff, 'infinity' while parked, the end of another lease) and
-- nothing else holds it: no unexpired stream lock on it (a rewind, a bootstrap, a purge, an
-- operator's lock) and its build's catch-up has passed its stream. Rows another claim is
-- leasing are skipped (SKIP LOCKED), never waited for. Leasing moves the row's due time to
-- the lease's end (lease_seconds on the database clock): if the instance dies, the pair is
-- due again then; wh_pairs_release ends the lease after the job.
-- The statement is wh_claim_pairs (schema/000008_due_pairs.up.sql): the leased rows, then
-- a row of the nil stream with when the next waiting pair becomes due, if one waits.
SELECT * FROM wh_claim_pairs(@instance_id::uuid, @build_keys::text[], @max_pairs::int, @lease_seconds::float8);

-- name: PairsRelease :exec
-- Ends the caller's leases on the given pairs after their job (see wh_pairs_release):
-- delays[i] negative: due at its oldest queued event; else that many seconds from now.
SELECT wh_pairs_release(@instance_id::uuid, @stream_ids::uuid[], @perspective_names::text[], @delays::float8[]);

-- name: QueueIDsForPair :many
-- The queued event IDs of one pair, in order. The pair is compared with a subquery's values,
-- which the planner does not know: it plans for an average pair, a lookup in the primary
-- key, whatever the statistics say of the given one (given a hot stream that they count as a
-- third of the queue, as they still do after most of its rows were applied, it scans the
-- whole table). See worker/plans_sql_test.go.
SELECT q.event_id FROM wh_perspective_events q
WHERE (q.stream_id, q.perspective_name) = (SELECT @stream_id::uuid, @perspective_name::text)
ORDER BY q.event_id;

-- name: QueueDepth :many
-- Queue depth per perspective, and the age of its oldest row on the database clock.
SELECT perspective_name,
       count(*)::bigint AS depth,
       (extract(epoch FROM clock_timestamp() - min(enqueued_at)) * 1000000)::bigint AS oldest_age_micros
FROM wh_perspective_events
GROUP BY perspective_name
ORDER BY perspective_name;

-- name: QueueCount :one
SELECT count(*)::bigint FROM wh_perspective_events;

-- name: QueueCountFor :one
-- Queued rows of a perspective's builds that are not retired, optionally of one stream.
SELECT count(*)::bigint FROM wh_perspective_events q
WHERE q.perspective_name IN (
        SELECT b.build_key FROM wh_perspective_builds b
        WHERE b.perspective_name = @perspective_name AND b.state <> 'retired')
  AND (sqlc.narg(stream_id)::uuid IS NULL OR q.stream_id = sqlc.narg(stream_id)::uuid);
