-- An edge owes the cloud, for one cloud round, a training result and,
-- once the round's version exists, its devices' evaluation of it: one
-- uplink of each kind (`result`: a training or statistics sub-round's
-- weighted mean; `evaluation`: the sample-weighted mean of its devices'
-- evaluation reports).
ALTER TABLE uplinks ADD COLUMN task_kind TEXT NOT NULL DEFAULT 'result';
ALTER TABLE uplinks DROP CONSTRAINT uplinks_cloud_round_id_key;
ALTER TABLE uplinks ADD CONSTRAINT uplinks_cloud_round_kind UNIQUE (cloud_round_id, task_kind);
