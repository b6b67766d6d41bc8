-- Adaptive clipping for central differential privacy. A private round
-- counts the updates whose norm was within its clip as it folds them; a
-- job with adaptive clipping keeps the clip its next round takes (NULL
-- until its first round has adapted it, and in any other job).
ALTER TABLE rounds ADD COLUMN dp_unclipped BIGINT NOT NULL DEFAULT 0;
ALTER TABLE jobs ADD COLUMN dp_clip_norm DOUBLE PRECISION;
