-- wh_append and wh_notify_queued stay as 000006 made them: the workers of 000005 wake on the
-- notification whatever its payload says.
SELECT 1;
