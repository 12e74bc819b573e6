-- The perspectives schema: the event store, the per-perspective queue, the cursors
-- (which carry the stream locks), the read models and their snapshots.
-- Every table is keyed by stream_id first so it can be partitioned or distributed by stream.

CREATE TABLE wh_event_store (
    event_id   uuid        NOT NULL PRIMARY KEY, -- UUIDv7: time-ordered; order within a stream is event_id order
    stream_id  uuid        NOT NULL,
    event_type text        NOT NULL CHECK (event_type <> ''),
    data       jsonb       NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX wh_event_store_stream_idx ON wh_event_store (stream_id, event_id);

-- Perspectives registered by workers at start. Registration enqueues the backlog.
CREATE TABLE wh_perspectives (
    perspective_name text        NOT NULL PRIMARY KEY CHECK (perspective_name <> ''),
    registered_at    timestamptz NOT NULL DEFAULT now()
);

-- The queue: one row per (stream, perspective, event) not yet applied.
CREATE TABLE wh_perspective_events (
    stream_id        uuid        NOT NULL,
    perspective_name text        NOT NULL,
    event_id         uuid        NOT NULL,
    enqueued_at      timestamptz NOT NULL DEFAULT now(),
    attempts         integer     NOT NULL DEFAULT 0,
    last_error       text,
    next_attempt_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (stream_id, perspective_name, event_id)
) WITH (
    -- A queue: every row is deleted soon after it is written. Vacuum and analyze it far
    -- more often than the defaults (20% / 10% of the table changed), so that dead index
    -- entries and stale statistics do not slow the claim and the per-pair reads.
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_analyze_scale_factor = 0.01
);

-- Due rows, oldest first. The key is unique (it ends with the primary key): a bare
-- next_attempt_at index would deduplicate the many rows one Append stamps with the same time
-- into posting lists, whose dead entries (applied rows) a scan can never skip.
CREATE INDEX wh_perspective_events_due_idx
    ON wh_perspective_events (next_attempt_at, stream_id, perspective_name, event_id);

-- One row per (stream, perspective): the applied position, failure state and the stream lock.
-- version is bumped by every change of position or model (not by lock operations): the
-- fencing check of long operations compares it.
CREATE TABLE wh_perspective_cursors (
    stream_id               uuid        NOT NULL,
    perspective_name        text        NOT NULL CHECK (perspective_name <> ''),
    last_event_id           uuid,
    version                 bigint      NOT NULL DEFAULT 0,
    status                  text        NOT NULL DEFAULT 'ok' CHECK (status IN ('ok', 'failed')),
    last_error              text,
    attempts                integer     NOT NULL DEFAULT 0,
    next_attempt_at         timestamptz,
    events_since_snapshot   integer     NOT NULL DEFAULT 0,
    updated_at              timestamptz NOT NULL DEFAULT now(),
    stream_lock_instance_id uuid,
    stream_lock_expiry      timestamptz,
    stream_lock_reason      varchar(50),
    PRIMARY KEY (stream_id, perspective_name),
    CONSTRAINT wh_perspective_cursors_lock_complete CHECK (
        (stream_lock_instance_id IS NULL) = (stream_lock_expiry IS NULL)
        AND (stream_lock_instance_id IS NULL) = (stream_lock_reason IS NULL)
    )
);

-- Held locks, soonest expiry first (List). Only the expiry is indexed: with the pair's
-- columns in it too, the planner scans this index for Renew and Release instead of
-- probing the primary key.
CREATE INDEX wh_perspective_cursors_lock_idx
    ON wh_perspective_cursors (stream_lock_expiry)
    WHERE stream_lock_instance_id IS NOT NULL;

CREATE INDEX wh_perspective_cursors_failed_idx
    ON wh_perspective_cursors (perspective_name)
    WHERE status = 'failed';

-- The model of each (stream, perspective) with the last event it includes.
CREATE TABLE wh_perspective_models (
    stream_id        uuid        NOT NULL,
    perspective_name text        NOT NULL,
    model            jsonb       NOT NULL,
    last_event_id    uuid        NOT NULL,
    updated_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (stream_id, perspective_name)
);

-- Restore points for rewinds: the model as of snapshot_event_id (inclusive).
CREATE TABLE wh_perspective_snapshots (
    stream_id         uuid        NOT NULL,
    perspective_name  text        NOT NULL,
    snapshot_event_id uuid        NOT NULL,
    model             jsonb       NOT NULL,
    created_at        timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (stream_id, perspective_name, snapshot_event_id)
);
