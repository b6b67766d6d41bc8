-- Why a participant dropped out: the reason a device gave when it declined
-- its task (a model it refused, data that does not fit the model, ...), a
-- timeout, or the round's failure. NULL for devices that did not drop out,
-- and for dropouts recorded before this column.
ALTER TABLE participants ADD COLUMN drop_reason TEXT;
