-- Mobile eligibility (a job's `device_policy`). `devices.conditions` is the
-- state a device last reported in a heartbeat (JSON: charging,
-- unmetered_network, idle, battery_percent), NULL before its first report;
-- selection passes over devices whose report violates a job's policy.
-- `rounds.ineligible` counts participants that withdrew because they no
-- longer met the policy (participant state `ineligible`), which are not
-- dropouts.
ALTER TABLE devices ADD COLUMN conditions TEXT;
ALTER TABLE rounds ADD COLUMN ineligible INTEGER NOT NULL DEFAULT 0;
