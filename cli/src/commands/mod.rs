pub mod authority;
pub mod bench;
pub mod compression;
pub mod datasets;
pub mod devices;
pub mod eval;
pub mod export;
pub mod import;
pub mod inspect;
pub mod jobs;
pub mod login;
pub mod models;
pub mod new;
pub mod privacy;
pub mod robust;
pub mod run;
pub mod simulate;
pub mod stats;
pub mod train;
pub mod watch;

use anyhow::{Context, Result, bail};
use canopy_engine::data::{Dataset, load_dir};
use canopy_ir::Model;
use std::path::Path;

use crate::files::Hint;

/// Loads `dir`'s train and test splits shaped for `model`'s `x` input,
/// checking that labels fit its classes.
pub fn load_for_model(dir: &Path, model: &Model) -> Result<(Dataset, Dataset)> {
    let (train, test) =
        load_dir(dir).with_context(|| format!("cannot load dataset `{}`", dir.display()))?;
    let shape = canopy_engine::zoo::sample_shape(model)?;
    let classes = canopy_engine::zoo::class_count(model).map_err(|error| {
        Hint::attach(
            anyhow::Error::new(error),
            "rebuild the model with `canopy model new`, or import a classifier",
        )
    })?;
    let fit = |d: Dataset, split: &str| -> Result<Dataset> {
        let sample: Vec<usize> = d.feature_shape().to_vec();
        let d = d.with_feature_shape(&shape).map_err(|e| {
            anyhow::Error::new(e)
                .context(format!(
                    "the {split} split of `{}` has samples of shape {sample:?}, but the model `{}` expects {shape:?}",
                    dir.display(),
                    model.metadata.model_name
                ))
        })?;
        if let Some(bad) = d.labels().iter().find(|&&l| l < 0 || l as usize >= classes) {
            bail!(
                "the {split} split of `{}` has label {bad}, but the model `{}` has {classes} classes",
                dir.display(),
                model.metadata.model_name
            );
        }
        Ok(d)
    };
    Ok((fit(train, "train")?, fit(test, "test")?))
}

/// A backend's name, with the adapter for a GPU: `gpu (NVIDIA H100, vulkan)`.
pub fn describe_backend(backend: &dyn canopy_engine::Backend) -> String {
    let info = backend.describe();
    match info.adapter {
        Some(adapter) => format!("{} ({}, {})", info.backend, adapter.name, adapter.api),
        None => info.backend,
    }
}
