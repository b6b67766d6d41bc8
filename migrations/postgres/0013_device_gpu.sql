-- The GPU adapter a device reported at enrollment beside its `gpu`
-- backend (JSON: name, api, device_type, driver); NULL when it reported
-- none.
ALTER TABLE devices ADD COLUMN gpu TEXT;
