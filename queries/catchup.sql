-- A build's catch-up (worker/catchup.go): its lease, its pages of the event store, the
-- streams it hands to the queue, its position.

-- name: BuildCatchUpPosition :one
-- A build's catch-up position, when the caller may take its lease (BuildCatchUpAcquire):
-- free, expired, or already the caller's. No row when another instance holds it or the
-- catch-up is done. A plain read: it never waits.
SELECT catchup_stream_id, catchup_event_id
FROM wh_perspective_builds
WHERE build_key = @build_key
  AND state <> 'retired'
  AND NOT catchup_done
  AND (catchup_holder IS NULL OR catchup_expiry <= clock_timestamp() OR catchup_holder = @instance_id::uuid);

-- name: BuildCatchUpAcquire :one
-- Takes (or renews) the lease on a build's catch-up: free, expired, or already the
-- caller's. Returns the position to continue from; no row when another instance holds it,
-- the catch-up is done, or another transaction holds the build's row (a page of another
-- instance that outlived its lease: this one does not wait for it).
UPDATE wh_perspective_builds b
SET catchup_holder = @instance_id::uuid,
    catchup_expiry = clock_timestamp() + make_interval(secs => @lease_seconds::float8),
    catchup_started_at = COALESCE(b.catchup_started_at, now())
WHERE b.build_key = (SELECT l.build_key FROM wh_perspective_builds l WHERE l.build_key = @build_key
                     FOR UPDATE SKIP LOCKED)
  AND b.state <> 'retired'
  AND NOT b.catchup_done
  AND (b.catchup_holder IS NULL OR b.catchup_expiry <= clock_timestamp() OR b.catchup_holder = @instance_id::uuid)
RETURNING b.catchup_stream_id, b.catchup_event_id;

-- name: PairDueHold :many
-- Holds the pair's due row FOR KEY SHARE until the transaction ends, as wh_append holds the
-- due rows of the pairs it queues for: a job's release racing the transaction neither
-- deletes the row as empty (its FOR UPDATE SKIP LOCKED skips it) nor waits for it (its
-- update of the lease takes a lock that does not conflict). No row when the pair has none:
-- a release deleted it after the queueing statement ran (PairDueEnsure, then hold again).
SELECT d.stream_id FROM wh_perspective_pairs d
WHERE d.stream_id = @stream_id AND d.perspective_name = @perspective_name
FOR KEY SHARE;

-- name: QueueUnqueueSkipped :execrows
-- Deletes the pair's queued rows of events skipped for it: after QueueEnqueueStreamFrom in
-- the same transaction, a statement of its own, which sees a skip that committed while that
-- statement's insert waited for it (the skip deleting the same queue row): read as of before,
-- the skipped event was queued again.
DELETE FROM wh_perspective_events q
USING wh_skipped_events s
WHERE q.stream_id = @stream_id AND q.perspective_name = @perspective_name
  AND s.stream_id = q.stream_id AND s.perspective_name = q.perspective_name AND s.event_id = q.event_id;

-- name: PairDueEnsure :exec
-- Creates the pair's due row, due now, unless it has one.
INSERT INTO wh_perspective_pairs (stream_id, perspective_name, due_at)
VALUES (@stream_id, @perspective_name, now())
ON CONFLICT (stream_id, perspective_name) DO NOTHING;

-- name: BuildCatchUpLetGo :exec
-- Lets go of the catch-up leases an instance holds, as it stops: another instance continues
-- those catch-ups at its next look at the builds, not when the leases expire. A page of the
-- instance still running holds its build's row: this waits for its commit.
UPDATE wh_perspective_builds
SET catchup_holder = NULL, catchup_expiry = NULL
WHERE catchup_holder = @instance_id::uuid AND NOT catchup_done;

-- name: CatchUpPage :many
-- The next page of stored events after a position, in (stream_id, event_id) order.
SELECT event_id, stream_id, event_type, data, created_at
FROM wh_event_store
WHERE (stream_id, event_id) > (@after_stream_id::uuid, @after_event_id::uuid)
ORDER BY stream_id, event_id
LIMIT @page_size;

-- name: CatchUpSkipped :many
-- The events skipped for a build among the streams from first to last (a page's streams),
-- read under the page's cursor row locks: an operator can skip an event queued for a
-- building build before its catch-up reaches the stream (Admin.Skip locks the cursor rows
-- first, so a skip is seen here, or waits for the page, or holds the row, and the page then
-- hands the stream over to the queue: see QueueUnqueueSkipped).
SELECT stream_id, event_id
FROM wh_skipped_events
WHERE stream_id >= @first_stream_id AND stream_id <= @last_stream_id
  AND perspective_name = @build_key;

-- name: CatchUpQueued :many
-- The events queued for a build among the streams from first to last (a page's streams).
SELECT stream_id, event_id
FROM wh_perspective_events
WHERE stream_id >= @first_stream_id AND stream_id <= @last_stream_id
  AND perspective_name = @build_key;

-- name: BuildCatchUpAdvance :execrows
-- Moves a build's catch-up position, in the transaction that wrote the page's models, and
-- renews the lease; with done (no stored event after the position) ends the catch-up
-- instead: the stream it was at counts as passed (unless it was passed whole already: its
-- position is the highest UUID) and the lease is let go. Fenced: only while the caller
-- holds the lease and the position is still the one it started from (0 rows and the page is
-- rolled back). Not on the lease's expiry: the page's transaction has held the build's row
-- since it took the lease (BuildCatchUpAcquire), so no other instance could take it over
-- meanwhile, however long the fold took; refusing a page that outlived its lease only made
-- every instance fold the same page again, for ever, when a page takes longer than the lease
-- (a slow perspective: TestReliabilityRandomizedModelCheck, LockTimeout 2 s).
UPDATE wh_perspective_builds b
SET catchup_stream_id = CASE WHEN a.done THEN b.catchup_stream_id ELSE a.stream_id END,
    catchup_event_id  = CASE WHEN a.done THEN b.catchup_event_id ELSE a.event_id END,
    catchup_events    = b.catchup_events + a.events,
    catchup_streams   = b.catchup_streams + a.streams + CASE
        WHEN NOT a.done OR b.catchup_stream_id IS NULL
             OR b.catchup_event_id = 'ffffffff-ffff-ffff-ffff-ffffffffffff' THEN 0
        ELSE 1 END,
    catchup_done      = a.done,
    catchup_done_at   = CASE WHEN a.done THEN now() END,
    catchup_holder    = CASE WHEN a.done THEN NULL ELSE b.catchup_holder END,
    catchup_expiry    = CASE WHEN a.done THEN NULL ELSE clock_timestamp() + make_interval(secs => a.lease_seconds) END
FROM (SELECT @done::bool AS done, sqlc.narg(stream_id)::uuid AS stream_id, sqlc.narg(event_id)::uuid AS event_id,
             @events::bigint AS events, @streams::bigint AS streams, @lease_seconds::float8 AS lease_seconds) a
WHERE b.build_key = @build_key
  AND (a.done OR a.stream_id IS NOT NULL) -- a page always moves to a position
  AND b.catchup_holder = @instance_id::uuid
  AND NOT b.catchup_done
  AND b.catchup_stream_id IS NOT DISTINCT FROM sqlc.narg(from_stream_id)::uuid
  AND b.catchup_event_id IS NOT DISTINCT FROM sqlc.narg(from_event_id)::uuid;

-- name: QueueEnqueueStreamFrom :one
-- Queues a stream's stored events from an event on (inclusive; the nil UUID: all of them)
-- for a build: what a catch-up could not apply (a failing event and the ones after it, the
-- rest of a long stream) is left to the normal path; a rebuild queues the whole stream.
-- Events the pair skipped stay skipped. The pair's due row is created, due now, unless it
-- has one (a failure recorded in the same transaction keeps its backoff); the listening
-- workers are told. Returns the rows queued. The transaction then holds the due row
-- (PairDueHold), as an Append does.
WITH queued AS (
    INSERT INTO wh_perspective_events (stream_id, perspective_name, event_id)
    SELECT e.stream_id, @build_key::text, e.event_id
    FROM wh_event_store e
    WHERE e.stream_id = @stream_id AND e.event_id >= @from_event_id
      AND NOT EXISTS (SELECT 1 FROM wh_skipped_events s
                      WHERE s.stream_id = e.stream_id AND s.perspective_name = @build_key::text
                        AND s.event_id = e.event_id)
    ON CONFLICT DO NOTHING
    RETURNING 1
), due AS (
    INSERT INTO wh_perspective_pairs (stream_id, perspective_name, due_at)
    SELECT @stream_id, @build_key::text, now()
    WHERE EXISTS (SELECT 1 FROM queued)
    ON CONFLICT (stream_id, perspective_name) DO NOTHING
)
SELECT count(*)::bigint FROM queued
WHERE (SELECT count(*) FROM (SELECT pg_notify('wh_perspective_events', '') WHERE EXISTS (SELECT 1 FROM queued)) n) >= 0;
