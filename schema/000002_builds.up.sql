-- Builds: the versions of each perspective, and their rebuilds. The pairs of a build are
-- keyed, in the perspective_name column of the queue, cursors, models and snapshots, by its
-- build_key: the perspective's own name for the first build of version 1 (so the rows of a
-- database from before builds are that build's), name@v<version>.<build> for the others.
-- At most one build of a perspective is active (LoadModel reads it); others are building
-- beside it (caught up from the event store, then promoted) or retired (their rows are
-- deleted in the background).
CREATE TABLE wh_perspective_builds (
    build_key          text        NOT NULL PRIMARY KEY,
    perspective_name   text        NOT NULL REFERENCES wh_perspectives (perspective_name) ON DELETE CASCADE,
    version            integer     NOT NULL CHECK (version > 0),
    build              integer     NOT NULL CHECK (build > 0),
    state              text        NOT NULL CHECK (state IN ('building', 'active', 'retired')),
    created_at         timestamptz NOT NULL DEFAULT now(),
    promoted_at        timestamptz,
    retired_at         timestamptz,
    cleaned_at         timestamptz, -- a retired build whose rows are all deleted
    -- The catch-up: every stored event up to (catchup_stream_id, catchup_event_id), in
    -- (stream_id, event_id) order, is applied to the build, or queued for it; NULL: not
    -- started. The normal path leaves a pair alone until the catch-up has passed its stream.
    catchup_stream_id  uuid,
    catchup_event_id   uuid,
    catchup_done       boolean     NOT NULL DEFAULT false,
    catchup_events     bigint      NOT NULL DEFAULT 0, -- events read so far
    catchup_streams    bigint      NOT NULL DEFAULT 0, -- streams passed so far
    catchup_started_at timestamptz,
    catchup_done_at    timestamptz,
    -- The lease of the instance doing the catch-up (database clock), renewed by every page.
    catchup_holder     uuid,
    catchup_expiry     timestamptz,
    UNIQUE (perspective_name, version, build)
);

CREATE UNIQUE INDEX wh_perspective_builds_one_active
    ON wh_perspective_builds (perspective_name) WHERE state = 'active';

-- The cursors of one build (catch-up progress, the cleanup of a retired build). Only new
-- pairs pay for it: no update changes these columns.
CREATE INDEX wh_perspective_cursors_build_idx ON wh_perspective_cursors (perspective_name, stream_id);

-- Registration bumps this row in the transaction that adds a build. An Append in a
-- REPEATABLE READ or SERIALIZABLE transaction locks it FOR SHARE: when its snapshot predates
-- a new build (so it would not queue its events for it), that fails with a serialization
-- error instead of losing them.
CREATE TABLE wh_registration (
    id    integer PRIMARY KEY CHECK (id = 1),
    epoch bigint  NOT NULL
);
INSERT INTO wh_registration (id, epoch) VALUES (1, 0);

-- The perspectives registered before builds existed: their rows are version 1's first
-- build, active and caught up (registration queued their backlog).
INSERT INTO wh_perspective_builds (build_key, perspective_name, version, build, state, promoted_at, catchup_done, catchup_done_at)
SELECT perspective_name, perspective_name, 1, 1, 'active', registered_at, true, registered_at
FROM wh_perspectives;
