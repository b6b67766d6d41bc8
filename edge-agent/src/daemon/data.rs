//! The datasets a running agent trains on: every dataset in the registry
//! is offered to the server (by name, size, sample shape and classes, in
//! each heartbeat), and a task that names one gets it, loaded and split on
//! first use. The dataset the agent was started with is loaded at start,
//! so a broken default fails the start rather than the first task.
//!
//! Loaded datasets are kept in memory, at most [`MAX_LOADED_DATASETS`] of
//! them (the default always); a task for another one evicts the least
//! recently used.

use std::sync::{Arc, Mutex};

use anyhow::{Context, Result};
use canopy_protocol::messages::{DatasetInfo, MAX_DATASETS as MAX_REPORTED_DATASETS};
use canopy_sdk::local::LocalData;

use crate::datasets::{DatasetEntry, Registry};
use crate::files::DataDir;

/// Most datasets held in memory at once, the default included.
pub(super) const MAX_LOADED_DATASETS: usize = 2;

/// A registered dataset, loaded and split once (the SDK's rule, which
/// simulated devices share).
fn load(entry: &DatasetEntry) -> Result<LocalData> {
    let local = entry
        .source()
        .load_local(&entry.name)
        .with_context(|| format!("cannot load registered dataset `{}`", entry.name))?;
    tracing::info!(
        dataset = %entry.name,
        train = local.train.len(),
        holdout = local.holdout.len(),
        "dataset loaded"
    );
    Ok(local)
}

pub(super) struct LocalDatasets {
    registry: Registry,
    default: Arc<LocalData>,
    /// Loaded datasets other than the default, most recently used last.
    others: Mutex<Vec<Arc<LocalData>>>,
}

impl LocalDatasets {
    /// Reads the registry and loads the dataset named (or the registry's
    /// default).
    pub fn open(dir: &DataDir, name: Option<&str>) -> Result<LocalDatasets> {
        let registry = Registry::load(dir)?;
        let entry = registry.resolve(dir, name)?;
        let default = Arc::new(load(entry)?);
        Ok(LocalDatasets {
            registry,
            default,
            others: Mutex::new(Vec::new()),
        })
    }

    pub fn default_name(&self) -> &str {
        &self.default.name
    }

    /// What the heartbeat offers: the default first, then the others in
    /// registry order, up to the protocol's limit.
    pub fn offered(&self) -> Vec<DatasetInfo> {
        let default = self.registry.get(self.default_name());
        let others = self
            .registry
            .datasets
            .iter()
            .filter(|d| d.name != self.default.name);
        default
            .into_iter()
            .chain(others)
            .take(MAX_REPORTED_DATASETS)
            .map(|entry| DatasetInfo {
                name: entry.name.clone(),
                samples: entry.samples,
                sample_shape: entry.feature_shape.iter().map(|&d| d as u64).collect(),
                classes: entry.classes,
            })
            .collect()
    }

    /// The registry entry a task names (`None`: the default), or why the
    /// agent cannot work on it.
    pub fn check(&self, name: Option<&str>) -> Result<(), String> {
        match name {
            None => Ok(()),
            Some(name) if name == self.default.name => Ok(()),
            Some(name) if self.registry.get(name).is_some() => Ok(()),
            Some(name) => {
                let known: Vec<&str> = self
                    .registry
                    .datasets
                    .iter()
                    .map(|d| d.name.as_str())
                    .collect();
                Err(format!(
                    "missing dataset: the job trains on dataset `{name}`, which this device has not registered (registered: {known:?})"
                ))
            }
        }
    }

    /// The dataset a task names, loaded. Blocking: call it off the async
    /// runtime.
    pub fn get(&self, name: Option<&str>) -> Result<Arc<LocalData>> {
        let name = match name {
            None => return Ok(self.default.clone()),
            Some(name) if name == self.default.name => return Ok(self.default.clone()),
            Some(name) => name,
        };
        let mut others = self.others.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(at) = others.iter().position(|d| d.name == name) {
            let data = others.remove(at);
            others.push(data.clone());
            return Ok(data);
        }
        self.check(Some(name)).map_err(anyhow::Error::msg)?;
        let entry = self
            .registry
            .get(name)
            .expect("check found the dataset in the registry");
        let data = Arc::new(load(entry)?);
        if others.len() + 1 >= MAX_LOADED_DATASETS {
            others.remove(0);
        }
        others.push(data.clone());
        Ok(data)
    }
}
