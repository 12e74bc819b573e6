-- Operating the worker (issue 14): parked pairs, skipped events, instance heartbeats.

-- A pair whose processing failed as many times as its perspective's failure policy allows
-- is parked: status 'parked', its queue rows (and the rows Appends add to it: they take the
-- pair's due time, see wh_append) due at 9999-12-31, so that no claim takes them, until an
-- operator retries it (perspectives retry) or skips its failing event (perspectives skip).
-- failed_event_id is the event whose Apply failed (NULL: the failure was not one event's);
-- failed_since is when the pair's current run of failures began.
ALTER TABLE wh_perspective_cursors
    DROP CONSTRAINT wh_perspective_cursors_status_check,
    ADD CONSTRAINT wh_perspective_cursors_status_check CHECK (status IN ('ok', 'failed', 'parked')),
    ADD COLUMN failed_event_id uuid,
    ADD COLUMN failed_since timestamptz;

DROP INDEX wh_perspective_cursors_failed_idx;
CREATE INDEX wh_perspective_cursors_failed_idx
    ON wh_perspective_cursors (perspective_name)
    WHERE status <> 'ok';

-- Events a pair will never apply: skipped by the failure policy (reason 'policy') or by an
-- operator (reason 'operator'), with who, when and the error that made them skip it. A
-- rewind's replay and every re-queueing of a stream leave them out. Keyed by the build
-- (perspective_name holds the build key, as in the other tables): a new version or a rebuild
-- meets the event afresh.
CREATE TABLE wh_skipped_events (
    stream_id        uuid        NOT NULL,
    perspective_name text        NOT NULL,
    event_id         uuid        NOT NULL,
    skipped_at       timestamptz NOT NULL DEFAULT now(),
    skipped_by       text        NOT NULL CHECK (skipped_by <> ''),
    reason           text        NOT NULL CHECK (reason IN ('policy', 'operator')),
    attempts         integer     NOT NULL DEFAULT 0,
    last_error       text,
    PRIMARY KEY (stream_id, perspective_name, event_id)
);

-- One row per running worker instance, written at start and every heartbeat_interval, and
-- deleted at a clean stop: an instance whose row is older than a few intervals is gone.
CREATE TABLE wh_instances (
    instance_id        uuid        NOT NULL PRIMARY KEY,
    host               text        NOT NULL,
    pid                integer     NOT NULL,
    started_at         timestamptz NOT NULL DEFAULT now(),
    last_seen_at       timestamptz NOT NULL DEFAULT now(),
    heartbeat_interval interval    NOT NULL,
    perspectives       text[]      NOT NULL, -- the perspectives it runs, name and version, in
    versions           integer[]   NOT NULL  -- two parallel arrays
);
