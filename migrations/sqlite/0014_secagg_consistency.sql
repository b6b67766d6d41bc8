-- Secure aggregation's ConsistencyCheck: between MaskedInputCollection and
-- Unmasking (`secagg_stage` = 'consistency') each survivor signs the survivor
-- set with its enrolled key; the signature is kept here until the round ends
-- and is forwarded to the device's neighbours in their unmask requests.
ALTER TABLE participants ADD COLUMN secagg_signature BLOB;
