-- Why a failed round failed, as a stable kind beside its text in
-- `status_message` (`server/src/round_failure.rs`): clients branch on the
-- kind, people read the text. Rounds that failed before this migration
-- were recorded with the text alone.
ALTER TABLE rounds ADD COLUMN failure_kind TEXT;
UPDATE rounds SET failure_kind = 'unrecorded' WHERE state = 'failed';
