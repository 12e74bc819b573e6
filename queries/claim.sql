-- The claim (worker/claim.go): lease the oldest due pairs, and end the leases after the job.

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

-- name: PairsLeasedBy :many
-- The pairs whose due rows the instance leases, and whose leases have not lapsed (a lease
-- moves due_at to its end, never 'infinity'). After a claim or a release that a lost
-- connection cut off: the claim may have committed, or the release not, leaving leases the
-- instance does not know of. The rows due between now and 'infinity' are few (leased,
-- backing off; parked pairs are due at 'infinity'): read through the due index, not a scan
-- (no index leads on leased_by, which every claim and release writes).
SELECT stream_id, perspective_name FROM wh_perspective_pairs
WHERE due_at > now() AND due_at < 'infinity' AND leased_by = @instance_id::uuid
ORDER BY stream_id, perspective_name;
