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

-- The view's first definition (the rows of the first build of version 1, whose key is the
-- perspective's name) is what sqlc reads; the registration of the perspective's first
-- build, whichever version it is, repoints it (Promoted from no build).
CREATE VIEW orders AS
SELECT order_id, customer, status, total_cents, last_event_id
FROM order_rows
WHERE build_key = 'orders';

-- orders_view_point points the view orders at the rows of build key. It runs in the
-- transaction that promotes (or registers) a build, which holds the exclusive side of the
-- worker's append lock: Appends wait for it, and it waits for the queries that read the
-- view, as new readers of the view wait behind it. lock_timeout bounds that wait; on a
-- timeout (SQLSTATE 55P03) the worker rolls back and tries again, as for its own locks.
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
-- by live changes only (a replay rebuilds models from events that were live once: it does
-- not notify again). Live changes reach every build (the active one and one building
-- beside it), so the key is the order and the kind, not the build: the first build to
-- write the row wins and the other's insert does nothing. The sender sets sent_at and
-- keeps the row, which is what keeps the later insert a no-op.
CREATE TABLE order_notifications (
    order_id   uuid        NOT NULL,
    kind       text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    sent_at    timestamptz,
    PRIMARY KEY (order_id, kind)
);
