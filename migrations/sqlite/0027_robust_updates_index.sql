-- The orchestrator looks for closed robust rounds whose stored updates
-- are still to delete on every tick; this keeps that a lookup of the few
-- rounds that still keep updates, not a scan of every round.
CREATE INDEX rounds_keeping_updates ON rounds (id)
    WHERE robust_rule IS NOT NULL AND updates_deleted_ms IS NULL;
