-- An aggregator's account of its sub-round (protocol `SubRoundReport`, as
-- JSON): the tier below a tiered job's round, for the round's tree.
ALTER TABLE participants ADD COLUMN sub_round TEXT;
