-- name: OrderRowsUpsert :exec
-- Writes one build's rows, one per order (the arrays are parallel, of one length: set-
-- returning functions in a select list run in step).
INSERT INTO order_rows (build_key, order_id, customer, status, total_cents, last_event_id)
SELECT @build_key::text, unnest(@order_ids::uuid[]), unnest(@customers::text[]),
       unnest(@statuses::text[]), unnest(@totals_cents::bigint[]), unnest(@last_event_ids::uuid[])
ON CONFLICT (build_key, order_id) DO UPDATE
SET customer      = excluded.customer,
    status        = excluded.status,
    total_cents   = excluded.total_cents,
    last_event_id = excluded.last_event_id;

-- name: OrderRowsDelete :exec
-- Deletes one build's rows of the orders.
DELETE FROM order_rows
WHERE build_key = @build_key AND order_id = ANY (@order_ids::uuid[]);

-- name: OrderRowsDeleteBuild :execrows
-- Deletes up to batch_size rows of a build (a retired one): called until it deletes fewer.
DELETE FROM order_rows d
WHERE d.build_key = @build_key::text
  AND d.order_id IN (SELECT r.order_id FROM order_rows r
                     WHERE r.build_key = @build_key::text
                     LIMIT @batch_size);

-- name: OrdersViewPoint :exec
-- Points the view orders at the rows of build_key.
SELECT orders_view_point(@build_key::text);

-- name: OrderNotificationsAdd :exec
-- Queues a notification of kind for each order, unless one is queued already.
INSERT INTO order_notifications (order_id, kind)
SELECT unnest(@order_ids::uuid[]), @kind::text
ON CONFLICT (order_id, kind) DO NOTHING;

-- name: OrderNotificationsList :many
SELECT order_id, kind FROM order_notifications ORDER BY order_id, kind;

-- name: OpenOrdersOver :many
-- The open orders whose total is over min_cents, largest first.
SELECT order_id, customer, total_cents
FROM orders
WHERE status = 'open' AND total_cents > @min_cents
ORDER BY total_cents DESC, order_id;

-- name: OrdersList :many
-- Every order of the view, by ID.
SELECT order_id, customer, status, total_cents, last_event_id
FROM orders
ORDER BY order_id;
