-- Central differential privacy (DP-FedAvg). A private job keeps the
-- secret its rounds' noise is drawn from (never sent anywhere), its
-- accountant's state (RDP per order, JSON) and the epsilon spent so far.
-- A private round keeps its clip norm (its fold clips each update to it
-- and weighs each the same; NULL in any other round), the sampling rate
-- it had, and the job's epsilon once it succeeded.
ALTER TABLE jobs ADD COLUMN dp_noise_seed TEXT;
ALTER TABLE jobs ADD COLUMN dp_accountant TEXT;
ALTER TABLE jobs ADD COLUMN dp_epsilon DOUBLE PRECISION;
ALTER TABLE rounds ADD COLUMN clip_norm DOUBLE PRECISION;
ALTER TABLE rounds ADD COLUMN dp_sampling_rate DOUBLE PRECISION;
ALTER TABLE rounds ADD COLUMN dp_epsilon DOUBLE PRECISION;
