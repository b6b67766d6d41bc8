-- Why devices cannot train a version (no `train_step`, no trainable
-- parameters, a parameter that is not f32, ...), so that a job refused for
-- it can say why. NULL for trainable versions, and for versions stored
-- before this column, whose reason was not kept.
ALTER TABLE model_versions ADD COLUMN untrainable_reason TEXT;
