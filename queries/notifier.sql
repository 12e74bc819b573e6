-- The notifier's session (worker/notifier.go): one per process and pool, subscribed to the
-- channels its subscribers need, and to a channel of its own for the probe that checks it
-- receives what is sent through the pool.

-- name: NotifierListenQueue :exec
-- The notification wh_append sends as its rows are queued (the worker's loop).
LISTEN wh_perspective_events;

-- name: NotifierUnlistenQueue :exec
UNLISTEN wh_perspective_events;

-- name: NotifierListenApplied :exec
-- The notification of the commits that make events visible in models (PairsApplyCommit,
-- BuildSetState's promotion, and parking or skipping a pair): worker.WaitFor.
LISTEN wh_applied;

-- name: NotifierUnlistenApplied :exec
UNLISTEN wh_applied;

-- name: NotifierListenProbe :exec
LISTEN wh_notifier_probe;

-- name: NotifierProbe :exec
-- The probe a notifier sends itself through the pool once subscribed.
SELECT pg_notify('wh_notifier_probe', @payload::text);
