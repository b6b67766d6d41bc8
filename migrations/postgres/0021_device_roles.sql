-- Roles (ARCHITECTURE.md, "The edge tier"): an enrollment token enrolls
-- devices of one role, and a device keeps its token's. Everything enrolled
-- before this migration is a `device`.
ALTER TABLE enrollment_tokens ADD COLUMN device_role TEXT NOT NULL DEFAULT 'device';
ALTER TABLE devices ADD COLUMN role TEXT NOT NULL DEFAULT 'device';
