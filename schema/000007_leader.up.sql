-- Maintenance once: the leader leases of the periodic maintenance services (promotion
-- checks, the cleanup of retired builds, forgetting gone instances), each run by the one
-- instance holding its lease (worker/leader.go), and the index that keeps promotion's
-- catch-up check a probe rather than a scan of the queue.
--
-- One row per election name: the instance that holds it, since when, and until when, all on
-- the database clock. An instance renews its own row before it expires, deletes it when it
-- stops (the others take over at their next attempt) and, killed, leaves it to expire (the
-- others take over then). A maintenance write checks, in its own transaction, that its
-- instance still holds its unexpired row (queries/leader.sql, LeaderHold).
CREATE TABLE wh_leader (
    name       text        NOT NULL PRIMARY KEY,
    leader_id  uuid        NOT NULL,
    elected_at timestamptz NOT NULL,
    expires_at timestamptz NOT NULL
);

-- The oldest queued event of a build (BuildQueueAge: promotion's catch-up check), read from
-- the first entry of the build's range instead of a scan of the whole queue.
CREATE INDEX wh_perspective_events_build_age_idx ON wh_perspective_events (perspective_name, enqueued_at);
