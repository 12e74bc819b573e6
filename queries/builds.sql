-- Builds of perspectives (schema/000002_builds.up.sql): registration, catch-up from the
-- event store, promotion and the cleanup of retired builds.

-- name: BuildsOf :many
-- Every build of the given perspectives, oldest first.
SELECT build_key, perspective_name, version, build, state, catchup_done
FROM wh_perspective_builds
WHERE perspective_name = ANY(@perspective_names::text[])
ORDER BY perspective_name, version, build;

-- name: BuildCreate :exec
-- Adds a build. An active one (the perspective's first) is promoted at once.
INSERT INTO wh_perspective_builds (build_key, perspective_name, version, build, state, promoted_at)
VALUES (@build_key, @perspective_name, @version, @build, @state::text,
        CASE WHEN @state::text = 'active' THEN now() END);

-- name: RegistrationBump :exec
-- In the transaction that adds a build: see wh_registration.
UPDATE wh_registration SET epoch = epoch + 1 WHERE id = 1;

-- name: BuildKeyTaken :one
-- Whether a build key is used, by any perspective's build (a perspective's name is its
-- first build's key, so a new name must not be another's key either).
SELECT EXISTS (SELECT 1 FROM wh_perspective_builds WHERE build_key = @build_key)::bool;

-- name: BuildCatchUpAcquire :one
-- Takes (or renews) the lease on a build's catch-up: free, expired, or already the
-- caller's. Returns the position to continue from; no row when another instance holds it or
-- the catch-up is done.
UPDATE wh_perspective_builds
SET catchup_holder = @instance_id::uuid,
    catchup_expiry = clock_timestamp() + make_interval(secs => @lease_seconds::float8),
    catchup_started_at = COALESCE(catchup_started_at, now())
WHERE build_key = @build_key
  AND state <> 'retired'
  AND NOT catchup_done
  AND (catchup_holder IS NULL OR catchup_expiry <= clock_timestamp() OR catchup_holder = @instance_id::uuid)
RETURNING catchup_stream_id, catchup_event_id;

-- name: CatchUpPage :many
-- The next page of stored events after a position, in (stream_id, event_id) order.
SELECT event_id, stream_id, event_type, data, created_at
FROM wh_event_store
WHERE (stream_id, event_id) > (@after_stream_id::uuid, @after_event_id::uuid)
ORDER BY stream_id, event_id
LIMIT @page_size;

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
-- workers are told. Returns the rows queued.
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

-- name: BuildQueueAge :one
-- The age of the oldest event queued for a build, in microseconds (-1: none queued).
SELECT COALESCE((extract(epoch FROM clock_timestamp() - min(enqueued_at)) * 1000000)::bigint, -1)::bigint AS oldest_micros
FROM wh_perspective_events
WHERE perspective_name = @build_key;

-- name: BuildSetState :exec
-- The times are the statement's, not the transaction's start: a promotion sets them under the
-- append lock, so every Append that still queued for the old state started before them.
-- Making a build active (a promotion) notifies wh_applied: WaitFor judges the new active build.
UPDATE wh_perspective_builds
SET state = @state::text,
    promoted_at = CASE WHEN @state::text = 'active' THEN clock_timestamp() ELSE promoted_at END,
    retired_at  = CASE WHEN @state::text = 'retired' THEN clock_timestamp() ELSE retired_at END,
    catchup_holder = CASE WHEN @state::text = 'retired' THEN NULL ELSE catchup_holder END,
    catchup_expiry = CASE WHEN @state::text = 'retired' THEN NULL ELSE catchup_expiry END
FROM (SELECT CASE WHEN @state::text = 'active' THEN pg_notify('wh_applied', '') END) notified
WHERE build_key = @build_key;

-- name: BuildsToClean :many
-- Retired builds of the given perspectives whose rows are not all deleted, retired at least
-- grace_seconds ago (a transaction an instance began before it saw the retirement has ended).
SELECT build_key
FROM wh_perspective_builds
WHERE perspective_name = ANY(@perspective_names::text[])
  AND state = 'retired'
  AND cleaned_at IS NULL
  AND retired_at <= now() - make_interval(secs => @grace_seconds::float8);

-- name: BuildCleanupBatch :one
-- Deletes the rows of up to batch_size pairs of a retired build: queue rows, due rows,
-- snapshots, model and cursor. Returns the number of pairs deleted (0: none left).
WITH win AS (
    SELECT c.stream_id
    FROM wh_perspective_cursors c
    WHERE c.perspective_name = @build_key
    ORDER BY c.stream_id
    LIMIT @batch_size
    -- Another instance cleaning the same build at once takes other pairs: 0 pairs deleted
    -- means none is left but those another transaction holds (see BuildMarkCleaned).
    FOR UPDATE OF c SKIP LOCKED
), q AS (
    DELETE FROM wh_perspective_events e USING win
    WHERE e.stream_id = win.stream_id AND e.perspective_name = @build_key
), d AS (
    DELETE FROM wh_perspective_pairs p USING win
    WHERE p.stream_id = win.stream_id AND p.perspective_name = @build_key
), s AS (
    DELETE FROM wh_perspective_snapshots sn USING win
    WHERE sn.stream_id = win.stream_id AND sn.perspective_name = @build_key
), m AS (
    DELETE FROM wh_perspective_models mo USING win
    WHERE mo.stream_id = win.stream_id AND mo.perspective_name = @build_key
), c AS (
    DELETE FROM wh_perspective_cursors cu USING win
    WHERE cu.stream_id = win.stream_id AND cu.perspective_name = @build_key
    RETURNING 1
)
SELECT count(*)::bigint AS deleted FROM c;

-- name: BuildMarkCleaned :exec
-- Marks a retired build cleaned once none of its cursor rows is left (BuildCleanupBatch found
-- none it could lock): not while another transaction holds some, which may be a cleanup that
-- fails or a lock that deletes nothing; the next cleanup deletes them.
UPDATE wh_perspective_builds b SET cleaned_at = now()
WHERE b.build_key = @build_key AND b.state = 'retired'
  AND NOT EXISTS (SELECT 1 FROM wh_perspective_cursors c WHERE c.perspective_name = @build_key);

-- name: BuildsStatus :many
-- Every build with its catch-up progress and queue (the versions command, the metrics),
-- its failing and parked pairs (through the partial index of the cursors whose status is
-- not ok: a few index entries, whatever the size of the cursor table) and the live
-- instances that run its version (heartbeats younger than three intervals, database clock).
SELECT b.build_key, b.perspective_name, b.version, b.build, b.state,
       b.created_at, b.promoted_at, b.retired_at, b.cleaned_at,
       b.catchup_done, b.catchup_events, b.catchup_streams,
       b.catchup_started_at, b.catchup_done_at, b.catchup_holder,
       COALESCE(q.depth, 0)::bigint AS queued,
       COALESCE((extract(epoch FROM clock_timestamp() - q.oldest) * 1000000)::bigint, 0)::bigint AS oldest_queued_micros,
       COALESCE(f.failing, 0)::bigint AS failing,
       COALESCE(f.parked, 0)::bigint AS parked,
       COALESCE(l.live, 0)::bigint AS live_instances,
       COALESCE(l.rate, 0)::float8 AS events_per_second
FROM wh_perspective_builds b
LEFT JOIN (
    SELECT perspective_name, count(*) AS depth, min(enqueued_at) AS oldest
    FROM wh_perspective_events
    GROUP BY perspective_name
) q ON q.perspective_name = b.build_key
LEFT JOIN (
    -- The cursors that are not ok, once for all builds, through their partial index probed
    -- with the builds' keys: an index plan whether or not the cursors were analyzed. (Counted
    -- per build instead, in a subquery, the estimate of a never-analyzed builds table makes
    -- the statement cost enough for PostgreSQL to JIT-compile it: half a second each time.)
    SELECT c.perspective_name,
           count(*) FILTER (WHERE c.status = 'failed') AS failing,
           count(*) FILTER (WHERE c.status = 'parked') AS parked
    FROM wh_perspective_cursors c
    WHERE c.perspective_name = ANY (ARRAY(SELECT bk.build_key FROM wh_perspective_builds bk))
      AND c.status <> 'ok'
    GROUP BY c.perspective_name
) f ON f.perspective_name = b.build_key
LEFT JOIN (
    -- Counted once for all builds, for the same reason.
    -- (rate: the events they applied per second over their last heartbeat interval)
    SELECT i.perspectives[k] AS perspective_name, i.versions[k] AS version, count(*) AS live,
           sum(COALESCE(i.rates[k], 0)) AS rate
    FROM wh_instances i, generate_subscripts(i.perspectives, 1) AS k
    WHERE i.last_seen_at >= now() - 3 * i.heartbeat_interval
    GROUP BY 1, 2
) l ON l.perspective_name = b.perspective_name AND l.version = b.version
ORDER BY b.perspective_name, b.version, b.build;

-- name: ModelActiveGet :one
-- The model of a stream in a perspective's active build (a name without builds: its own
-- rows). One statement, so a promotion is seen whole or not at all.
SELECT m.model
FROM wh_perspective_models m
WHERE m.stream_id = @stream_id
  AND m.perspective_name = COALESCE(
      (SELECT b.build_key FROM wh_perspective_builds b
       WHERE b.perspective_name = @perspective_name AND b.state = 'active'),
      @perspective_name);

-- name: EventStoreEstimate :one
-- The planner's estimate of the stored events (-1 before the first ANALYZE).
SELECT c.reltuples::bigint AS estimate FROM pg_catalog.pg_class c WHERE c.oid = 'wh_event_store'::regclass;
