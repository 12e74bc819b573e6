-- wh_append keeps the version of 000006: the workers of 000005 wake on its notification
-- whatever its payload says.
SELECT 1;
