-- The read model of the perspective "orders" in the application's own tables.
--
-- order_rows holds one row per order and build of the perspective (a version, or a rebuild
-- of one): a new version builds its rows beside the active one's, under its own build_key,
-- and the retired build's rows are deleted after its promotion. The application reads the
-- view orders, which shows one build's rows without the build column; the perspective's
-- Promoted repoints it (orders_view_point) in the transaction that promotes a build.
CREATE TABLE order_rows (
    build_key     text   NOT NULL,
    order_id      uuid   NOT NULL,
    customer      text   NOT NULL,
    status        text   NOT NULL,
    total_cents   bigint NOT NULL,
    last_event_id uuid   NOT NULL,
    PRIMARY KEY (build_key, order_id)
);

-- The first build of version 1 has the perspective's name as its build key, and is active
-- from its registration on (no promotion, so no Promoted): the view starts there.
CREATE VIEW orders AS
SELECT order_id, customer, status, total_cents, last_event_id
FROM order_rows
WHERE build_key = 'orders';

-- orders_view_point points the view orders at the rows of build key. It runs in the
-- promotion transaction, which holds the worker's append lock: lock_timeout bounds its
-- wait for the view's lock (behind a long query reading the view, new readers queue
-- too); on timeout the promotion rolls back and is tried again at the worker's next look.
CREATE FUNCTION orders_view_point(key text) RETURNS void
LANGUAGE plpgsql
SET lock_timeout = '1s'
AS $$
BEGIN
    EXECUTE format(
        'CREATE OR REPLACE VIEW orders AS '
        'SELECT order_id, customer, status, total_cents, last_event_id '
        'FROM order_rows WHERE build_key = %L', key);
END
$$;

-- order_notifications is an outbox: one row per order and kind of notification, written
-- by live changes only (a replay rebuilds models, it does not notify again), once
-- whichever build writes it first.
CREATE TABLE order_notifications (
    order_id   uuid        NOT NULL,
    kind       text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (order_id, kind)
);
