-- A round trains (`train`), or, before a job trains a model whose input
-- statistics are unfitted, adds up the devices' input moments
-- (`statistics`, round number 0).
ALTER TABLE rounds ADD COLUMN kind TEXT NOT NULL DEFAULT 'train';
