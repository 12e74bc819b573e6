DROP TABLE order_notifications;
DROP FUNCTION orders_view_point(text);
DROP VIEW orders;
DROP TABLE order_rows;
