-- Promotion of a caught-up build (worker/promotion.go).

-- name: BuildQueueAge :one
-- The age of the oldest event queued for a build, in microseconds (-1: none queued), and
-- whether that event was queued by the time the build's catch-up ended (from_catchup): one
-- the catch-up handed to the queue (the rest of a long stream, a failing or locked stream)
-- or an Append queued while it ran (see BuildCatchUpLeftWaiting).
SELECT COALESCE((extract(epoch FROM clock_timestamp() - o.oldest) * 1000000)::bigint, -1)::bigint AS oldest_micros,
       COALESCE(o.oldest <= (SELECT b.catchup_done_at FROM wh_perspective_builds b WHERE b.build_key = @build_key),
                false)::bool AS from_catchup
FROM (SELECT min(q.enqueued_at) AS oldest FROM wh_perspective_events q WHERE q.perspective_name = @build_key) o;

-- name: BuildCatchUpLeftWaiting :one
-- Whether a pair of the build has an event queued by the time the build's catch-up ended,
-- unless it is parked and its stream is parked in the active build (active_key) too: such an
-- event is part of the build's history however recently it was queued, so the build is not
-- caught up while it waits. A stream parked in both builds waits for an operator in the
-- build readers get as well: it does not hold the promotion off (the queues' ages still
-- compare it). Run when BuildQueueAge says from_catchup: the build's due rows (a pair with
-- nothing queued has none), each with probes of its queue's and its active cursor's keys.
-- Each probe is a LATERAL subquery with a LIMIT, which the planner cannot turn into a join
-- walking the queue's whole range of the build (it did, with stale statistics). With stale
-- statistics it may still read a pair's rows through a bitmap of its key, all of them, where
-- an index scan stops at the first that matches: a check of one build every PollInterval,
-- outside any lock, while its hand-offs are drained.
SELECT EXISTS (
    SELECT 1 FROM wh_perspective_pairs d
    CROSS JOIN LATERAL (
        SELECT 1 FROM wh_perspective_events q
        WHERE q.stream_id = d.stream_id AND q.perspective_name = d.perspective_name
          AND q.enqueued_at <= (SELECT b.catchup_done_at FROM wh_perspective_builds b WHERE b.build_key = @build_key)
        LIMIT 1
    ) waiting
    WHERE d.perspective_name = @build_key
      AND (d.due_at < 'infinity'
           OR NOT EXISTS (SELECT 1 FROM wh_perspective_cursors a
                          WHERE a.stream_id = d.stream_id AND a.perspective_name = @active_key::text
                            AND a.status = 'parked'))
)::bool;

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

-- name: BuildRequestPromotion :execrows
-- Asks the workers to promote a caught-up building build (an operator's promotion of a
-- sink's perspective): the holder of its version's promotion lease promotes it, forced.
UPDATE wh_perspective_builds SET promotion_requested = true
WHERE build_key = @build_key AND state = 'building' AND catchup_done;
