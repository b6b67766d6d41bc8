-- The device authority's certificate of a device's id and enrolled key
-- (64 bytes, an Ed25519 signature; see canopy_protocol::device_cert). The
-- server relays it to the device's neighbours in secure rounds, which take
-- a neighbour's key only on the authority's word when they pin it.
ALTER TABLE devices ADD COLUMN certificate BYTEA;
