-- Asynchronous jobs (FedBuff): each round is a buffer of updates. A
-- buffer round keeps its job's maximum staleness (NULL in a synchronous
-- round); its participants keep training after it closes, and each
-- update folds into the buffer open when it arrives, recorded on the
-- participant with its staleness (buffers between the two).
ALTER TABLE rounds ADD COLUMN max_staleness BIGINT;
ALTER TABLE participants ADD COLUMN folded_round_id BIGINT;
ALTER TABLE participants ADD COLUMN staleness BIGINT;
-- A buffer's metrics are those of the updates folded into it.
CREATE INDEX participants_folded ON participants (folded_round_id) WHERE folded_round_id IS NOT NULL;
