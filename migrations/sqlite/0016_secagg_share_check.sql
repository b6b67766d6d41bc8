-- Secure aggregation's ShareCheck: between ShareKeys and
-- MaskedInputCollection (`secagg_stage` = 'check') each device reports the
-- neighbours whose shares it could not open (8-byte little-endian ids); the
-- server excludes every device reported before anyone masks. Kept until the
-- round ends.
ALTER TABLE participants ADD COLUMN secagg_receipt BLOB;
