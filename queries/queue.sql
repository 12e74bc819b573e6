-- name: QueueDuePairs :many
-- The pairs with due queue rows, oldest row first, of the builds this instance runs
-- (perspective_names holds their build keys), skipping the pairs listed in inflight_pairs and
-- skip_pairs, pairs another instance has locked, pairs backing off after a failure, and
-- pairs whose build's catch-up has not passed their stream yet; each once, each flagged own
-- or not (see the sharing of streams below): up to pair_limit of its own and pair_limit of
-- the others' (the caller takes its own first), and where the next claim may start (see the
-- end).
-- A loose index scan: each step is one probe of the due index for the first row after the
-- previous step's (next_attempt_at, stream, perspective) group, so a step passes a whole
-- group (all the rows one Append queued for a pair) at once, and the cost grows with the
-- groups passed, not with their rows. The pair is then judged once per group. At most
-- max_steps groups are passed, so a claim stays cheap when few pairs are due but one of them
-- has many separately queued groups.
-- The probe's only index condition is the row comparison, which the planner estimates at a
-- third of the table whatever its statistics (none on a new or bulk-loaded queue): an
-- ordered index scan that stops at the first row is then always its cheapest plan. With the
-- due time (next_attempt_at <= now()) and the perspectives (= ANY, which PostgreSQL 15 would
-- make an index condition that gives up the index's order) there too, it may estimate a
-- handful of rows and read and sort all the matching rows instead, at every step: hundreds of
-- milliseconds per claim on a queue of a few thousand rows. So the perspectives are a
-- filter (IS TRUE keeps the comparison out of the index condition) and the due time is
-- judged per group: the first group not due ends the scan.
-- Several instances running the same builds (the same perspectives and versions, alive by
-- their heartbeats in wh_instances, and claiming: claimed_at) would all find the same oldest
-- pairs and collide on their cursor rows. So each prefers the streams its rank among them
-- owns (hashtext of the stream modulo their number): the scan goes on until it has found
-- pair_limit pairs of its own,
-- keeping on the way the first pair_limit claimable pairs of the others' streams (the
-- others' groups after those cost it the index probe only), and the caller takes its own
-- first, then the others in order. So the others' oldest pairs fill every claim that does not
-- find enough of its own: an instance that is busy holds up only the streams it owns, and
-- only while every other instance has its fill of its own; one that is stopping (it says so
-- at once), killed (its heartbeats stop) or has not claimed for three heartbeat intervals
-- (its slots all taken: a perspective's Apply that hangs) drops out, and the streams are
-- shared out among the others.
-- An instance without a row (no heartbeat yet, or a store's tests) owns every stream.
WITH RECURSIVE peers AS (
    SELECT count(*)::int AS n,
           (count(*) FILTER (WHERE i.instance_id < @instance_id::uuid))::int AS rank,
           @pair_limit::int AS pair_limit,
           @max_steps::int AS max_steps
    FROM wh_instances me
    JOIN wh_instances i
      ON i.perspectives = me.perspectives AND i.versions = me.versions
     AND i.last_seen_at >= now() - 3 * i.heartbeat_interval
     AND i.claimed_at >= now() - 3 * i.heartbeat_interval
    WHERE me.instance_id = @instance_id::uuid
), inflight AS (
    -- the caller's pairs in flight (NULL: none), each with the due time of the group it was
    -- claimed at (any time no group has when not known)
    SELECT unnest(COALESCE(@inflight_pairs::text[], '{}')) AS pair,
           unnest(COALESCE(@inflight_at::timestamptz[], '{}')) AS at
), skipped AS (
    -- pairs the caller just found held by another transaction (NULL: none)
    SELECT unnest(COALESCE(@skip_pairs::text[], '{}')) AS pair
), recheck AS (
    -- the groups (pair and due time) at which pairs whose jobs here ended lately were claimed
    -- (NULL: none; a pair may come with several), which the claims since may have passed as
    -- held (below)
    SELECT unnest(COALESCE(@recheck_streams::uuid[], '{}')) AS stream_id,
           unnest(COALESCE(@recheck_perspectives::text[], '{}')) AS perspective_name,
           unnest(COALESCE(@recheck_at::timestamptz[], '{}')) AS at
), found AS (
    -- the first of them with rows still queued there (a probe of the due index each): what
    -- the job left (more than BatchSize rows, a failure not recorded, a lock refused), or
    -- rows an Append stamped with the pair's due time while the job applied the pair (see
    -- wh_append) after it had read its rows. The claim starts there at the latest.
    SELECT r.at, r.stream_id
    FROM recheck r
    WHERE EXISTS (SELECT 1 FROM wh_perspective_events q
                  WHERE q.next_attempt_at = r.at AND q.stream_id = r.stream_id
                    AND q.perspective_name = r.perspective_name)
    ORDER BY r.at, r.stream_id
    LIMIT 1
), start AS (
    -- from_at/from_stream/from_perspective (a position this claim or an earlier one
    -- returned, see the end; from_perspective '' starts at the stream's first group at
    -- from_at, a name after that group), or the group found above when it lies before
    SELECT COALESCE(f.at, sqlc.narg(from_at)::timestamptz) AS at,
           COALESCE(f.stream_id, sqlc.narg(from_stream)::uuid) AS stream_id,
           CASE WHEN f.at IS NULL THEN COALESCE(sqlc.narg(from_perspective)::text, '') ELSE '' END AS perspective_name
    FROM (SELECT 1) one
    LEFT JOIN found f
      ON sqlc.narg(from_at)::timestamptz IS NOT NULL
     AND (f.at, f.stream_id, '') < (sqlc.narg(from_at)::timestamptz, sqlc.narg(from_stream)::uuid,
                                    COALESCE(sqlc.narg(from_perspective)::text, ''))
), due AS (
    -- The start: before every row, or at the start above, so that the claim does not step
    -- through the groups being applied nor the dead index entries of the rows applied since.
    SELECT COALESCE(st.at, '-infinity'::timestamptz) AS next_attempt_at,
           COALESCE(st.stream_id, '00000000-0000-0000-0000-000000000000'::uuid) AS stream_id,
           st.perspective_name,
           -- The pairs returned so far, as 64-bit hashes of 'stream_id/perspective_name': every
           -- step carries (copies) this array, and a claim passing a thousand groups with
           -- hundreds of text entries spent a third of its time on it. Two pairs with one hash
           -- would pass the second over for this claim only; the next one returns it.
           '{}'::bigint[] AS returned,
           false AS ok,
           false AS own,
           0 AS oks,   -- claimable pairs found so far
           0 AS owned, -- of them, of streams this instance owns
           0 AS steps,
           p.n AS peer_count, -- the instances the streams are shared among (0: no row here)
           p.rank AS peer_rank, -- this instance's place among them
           p.pair_limit,
           -- finding pair_limit pairs of its own takes about n times the groups: the bound on
           -- the groups passed grows by pair_limit per other instance
           p.max_steps + greatest(p.n - 1, 0) * p.pair_limit AS max_steps,
           -- the first group passed that the next claim must pass again (open, below), and
           -- the first of those not of another instance's stream (mine)
           NULL::timestamptz AS open_at,
           NULL::uuid AS open_stream,
           NULL::timestamptz AS mine_at,
           NULL::uuid AS mine_stream
    FROM peers p, start st
    UNION ALL
    SELECT n.next_attempt_at, n.stream_id, n.perspective_name,
           CASE WHEN n.ok THEN d.returned || hashtextextended(n.pair, 0) ELSE d.returned END,
           n.ok,
           n.own,
           d.oks + n.ok::int,
           d.owned + (n.ok AND n.own)::int,
           d.steps + 1,
           d.peer_count, d.peer_rank, d.pair_limit, d.max_steps,
           COALESCE(d.open_at, CASE WHEN n.open THEN n.next_attempt_at END),
           CASE WHEN d.open_at IS NULL AND n.open THEN n.stream_id ELSE d.open_stream END,
           COALESCE(d.mine_at, CASE WHEN n.mine THEN n.next_attempt_at END),
           CASE WHEN d.mine_at IS NULL AND n.mine THEN n.stream_id ELSE d.mine_stream END
    FROM due d
    CROSS JOIN LATERAL (
        SELECT c.next_attempt_at, c.stream_id, c.perspective_name, c.pair, c.ok, c.own,
               -- Open: a group the next claim must pass again. Not the group a pair in flight
               -- here was claimed at (held), nor one of this instance's own pairs returned
               -- here (the caller takes them all): what their jobs leave there, the caller
               -- looks up again (recheck). A later group of a pair in flight here, and a pair
               -- another transaction's claim mark holds, are open: the job may have read its
               -- rows before that group was queued, and its instance does not look it up.
               NOT (c.held OR (c.ok AND c.own)) AS open,
               -- An open group of this instance's streams, or not due. When the claim finds
               -- its fill of its own pairs, the next one starts at the first such group, past
               -- the other instances' streams, which they claim themselves (while they run
               -- and claim, as the peers above; each starts before the groups of its streams
               -- that it may need); when it does not, it needs the others' pairs too.
               (NOT c.held AND NOT c.ok AND c.own) OR NOT c.due AS mine
        FROM (
            SELECT g.next_attempt_at, g.stream_id, g.perspective_name, g.pair, g.own, g.due, h.held,
                   (g.due
                    -- in flight here (a hashed subplan: one lookup, however many pairs)
                    AND g.pair NOT IN (SELECT b.pair FROM inflight b)
                    -- another instance's pair, once there are enough of them to fill the
                    -- claim, is passed at the cost of the probe that found it
                    AND (g.own OR d.oks - d.owned < d.pair_limit)
                    -- pairs just found held by another transaction (a hashed subplan)
                    AND g.pair NOT IN (SELECT s.pair FROM skipped s)
                    -- pairs an apply transaction holds (its claim mark, see PairsLockForApply):
                    -- tested by taking and at once releasing the shared side
                    AND CASE WHEN pg_try_advisory_lock_shared(g.stream_hash, hashtext(g.perspective_name))
                             THEN pg_advisory_unlock_shared(g.stream_hash, hashtext(g.perspective_name))
                             ELSE false END
                    AND NOT EXISTS (
                        SELECT 1 FROM wh_perspective_cursors c
                        WHERE c.stream_id = g.stream_id
                          AND c.perspective_name = g.perspective_name
                          AND ((c.stream_lock_instance_id <> @instance_id::uuid AND c.stream_lock_expiry > clock_timestamp())
                               OR c.next_attempt_at > now())
                    )
                    -- a build's pairs wait until its catch-up has passed their stream
                    AND NOT EXISTS (
                        SELECT 1 FROM wh_perspective_builds b
                        WHERE b.build_key = g.perspective_name
                          AND NOT b.catchup_done
                          AND (b.catchup_stream_id IS NULL OR g.stream_id >= b.catchup_stream_id)
                    )
                    -- each pair once (last: only the pairs that pass the rest are looked up)
                    AND hashtextextended(g.pair, 0) <> ALL (d.returned)) AS ok
            FROM (
                SELECT x.next_attempt_at, x.stream_id, x.perspective_name, x.pair, x.stream_hash,
                       x.next_attempt_at <= now() AS due,
                       -- a stream this instance owns (all of them when it shares them with none)
                       (d.peer_count <= 1 OR (x.stream_hash::bigint & 2147483647) % d.peer_count = d.peer_rank) AS own
                FROM (
                    SELECT q.next_attempt_at, q.stream_id, q.perspective_name,
                           q.stream_id::text || '/' || q.perspective_name AS pair,
                           hashtext(q.stream_id::text) AS stream_hash
                    FROM wh_perspective_events q
                    WHERE (q.next_attempt_at, q.stream_id, q.perspective_name) > (d.next_attempt_at, d.stream_id, d.perspective_name)
                      AND (q.perspective_name = ANY(@perspective_names::text[])) IS TRUE
                    ORDER BY q.next_attempt_at, q.stream_id, q.perspective_name, q.event_id
                    LIMIT 1
                ) x
            ) g
            -- Held: the group a pair in flight here was claimed at (a hashed subplan).
            CROSS JOIN LATERAL (
                SELECT COALESCE(g.due AND (g.pair, g.next_attempt_at) IN (SELECT b.pair, b.at FROM inflight b), false) AS held
            ) h
        ) c
    ) n
    -- The first group not yet due ends the scan (the groups after it are not due either).
    WHERE d.steps < d.max_steps AND d.next_attempt_at <= now()
      AND d.owned < d.pair_limit
), last AS (
    SELECT * FROM due WHERE due.steps > 0 ORDER BY due.steps DESC LIMIT 1
)
-- The claimable pairs, in order (start false), then, when the claim passed any group, where
-- the next claim may start (start true): at the first open group passed (perspective ''),
-- else after the last group passed (its perspective). Every row due now that the next claim
-- can return lies at or after it, but for the rows left of the pairs being applied, which
-- their instances look up again, and, when the claim found its fill of its own streams'
-- pairs, the rows of the other instances' streams, which they claim; and so does every row
-- queued by a transaction that begins later (but in those groups): it is never after now(),
-- which a group not yet due (a pair backing off) would be. A row queued by a
-- transaction running meanwhile may lie before it: its Append's notification names its due
-- time, and the worker's next claim starts there (worker/schedule.go, notified).
SELECT due.stream_id::uuid AS stream_id, due.perspective_name::text AS perspective_name,
       due.next_attempt_at::timestamptz AS next_attempt_at, due.ok::bool AS ok, due.own::bool AS own,
       false AS start
FROM due
WHERE due.ok
UNION ALL
SELECT CASE WHEN s.at > now() THEN '00000000-0000-0000-0000-000000000000'::uuid ELSE s.stream END,
       CASE WHEN s.at > now() THEN '' ELSE s.perspective END,
       least(s.at, now()), false, false, true
FROM (
    SELECT COALESCE(o.at, l.next_attempt_at) AS at,
           COALESCE(o.stream, l.stream_id) AS stream,
           CASE WHEN o.at IS NULL THEN l.perspective_name ELSE '' END AS perspective
    FROM last l
    CROSS JOIN LATERAL (
        SELECT CASE WHEN l.owned >= l.pair_limit THEN l.mine_at ELSE l.open_at END AS at,
               CASE WHEN l.owned >= l.pair_limit THEN l.mine_stream ELSE l.open_stream END AS stream
    ) o
) s;

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
