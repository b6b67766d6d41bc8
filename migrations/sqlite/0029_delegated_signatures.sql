-- An edge's own signature over a version its sub-round made, with the
-- cloud's delegation that lets its key sign (JSON of a ModelDelegation);
-- NULL for the cloud's signatures the edge relays.
ALTER TABLE relayed_signatures ADD COLUMN delegation TEXT;
