DROP FUNCTION wh_ensure_cursors(uuid[], text[]);
DROP FUNCTION wh_apply_commit(uuid[], text[], text[], uuid[], int[], uuid[], text[], uuid[]);
DROP FUNCTION wh_snapshot_ids(uuid, text);
DROP FUNCTION wh_lock_cursors(uuid[], text[]);
