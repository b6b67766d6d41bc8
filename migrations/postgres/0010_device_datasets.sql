-- What a device reports in its heartbeats: the datasets it can train on
-- (JSON: name, samples, sample shape, classes; the data never leaves the
-- device) and its last error, for operators.
ALTER TABLE devices ADD COLUMN datasets TEXT;
ALTER TABLE devices ADD COLUMN last_error TEXT;
