//! How a simulation deals one dataset out to its devices: `iid`,
//! `dirichlet:ALPHA` (per-class label skew) or `shards:K` (each device
//! holds K classes, the FedAvg paper's pathological split). The engine's
//! partitions do the dealing; this module names the setting, checks that
//! every device can train and evaluate, and says which device could not.

use std::fmt;
use std::str::FromStr;

use canopy_engine::data::{Dataset, partition_by_label, partition_dirichlet_sized, partition_iid};

use crate::SimError;

/// A partition of a dataset over devices, as `--partition` spells it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Partition {
    /// Every device gets a near-equal random share.
    Iid,
    /// Each device's class mix drawn from Dirichlet(alpha), every device
    /// holding a near-equal share (Hsu, Qi and Brown, 2019): small alpha
    /// (0.1) gives each device a few dominant classes, large alpha (100)
    /// is near IID. Equal shares, so that 1,000 devices on 8,000 samples
    /// each hold some (`partition_dirichlet_sized`).
    Dirichlet { alpha: f64 },
    /// Each device holds `classes` classes, each class's samples split
    /// evenly among its holders.
    Shards { classes: usize },
}

impl fmt::Display for Partition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Partition::Iid => write!(f, "iid"),
            Partition::Dirichlet { alpha } => write!(f, "dirichlet:{alpha}"),
            Partition::Shards { classes } => write!(f, "shards:{classes}"),
        }
    }
}

impl FromStr for Partition {
    type Err = String;

    fn from_str(text: &str) -> Result<Partition, String> {
        let usage = "expected `iid`, `dirichlet:ALPHA` (e.g. dirichlet:0.5) or `shards:K` \
                     (e.g. shards:2, each device holding 2 classes)";
        let (kind, value) = match text.split_once(':') {
            Some((kind, value)) => (kind, Some(value)),
            None => (text, None),
        };
        match (kind, value) {
            ("iid", None) => Ok(Partition::Iid),
            ("dirichlet", Some(alpha)) => match alpha.parse::<f64>() {
                Ok(alpha) if alpha.is_finite() && alpha > 0.0 => Ok(Partition::Dirichlet { alpha }),
                _ => Err(format!(
                    "`{alpha}` is not a Dirichlet concentration: it must be a positive number"
                )),
            },
            ("shards", Some(classes)) => match classes.parse::<usize>() {
                Ok(classes) if classes >= 1 => Ok(Partition::Shards { classes }),
                _ => Err(format!(
                    "`{classes}` is not a number of classes per device: it must be 1 or more"
                )),
            },
            _ => Err(format!("`{text}` is not a partition: {usage}")),
        }
    }
}

impl Partition {
    /// `data` dealt to `devices` devices, reproducibly from `seed`. Every
    /// device gets at least one sample to train on, or the error names the
    /// first that would not.
    pub fn deal(self, data: &Dataset, devices: usize, seed: u64) -> Result<Vec<Dataset>, SimError> {
        let refused = |cause: String| SimError::Partition {
            partition: self,
            devices,
            samples: data.len(),
            cause,
        };
        if devices > data.len() {
            return Err(refused(format!(
                "there are more devices than the dataset's {} samples, so some would hold none",
                data.len()
            )));
        }
        let shards = match self {
            Partition::Iid => partition_iid(data, devices, seed),
            Partition::Dirichlet { alpha } => partition_dirichlet_sized(data, devices, alpha, seed),
            Partition::Shards { classes } => partition_by_label(data, devices, classes, seed),
        }
        .map_err(|error| refused(canopy_term::error_chain(&error)))?;
        // The held-out split (`canopy_sdk::local::holdout`) takes a tenth
        // of each class, rounded, so never a class's only sample: a device
        // has something to train on exactly when its shard is not empty.
        if let Some(index) = shards.iter().position(Dataset::is_empty) {
            return Err(refused(format!(
                "device {index} would hold no samples, so nothing to train on"
            )));
        }
        Ok(shards)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labelled(samples: usize, classes: usize) -> Dataset {
        let labels = (0..samples).map(|i| (i % classes) as i64).collect();
        Dataset::new(vec![0.5; samples * 2], vec![2], labels, classes).expect("a dataset")
    }

    #[test]
    fn partitions_parse_and_print_as_spelled() {
        for text in ["iid", "dirichlet:0.5", "shards:2"] {
            assert_eq!(text.parse::<Partition>().unwrap().to_string(), text);
        }
        for bad in [
            "",
            "dirichlet",
            "dirichlet:0",
            "dirichlet:-1",
            "dirichlet:nan",
            "shards:0",
            "iid:3",
            "random",
        ] {
            let error = bad.parse::<Partition>().unwrap_err();
            assert!(error.contains('`'), "{bad}: {error}");
        }
    }

    #[test]
    fn every_sample_goes_to_one_device_and_every_device_trains() {
        let data = labelled(1_000, 10);
        for partition in [
            Partition::Iid,
            Partition::Dirichlet { alpha: 0.5 },
            Partition::Shards { classes: 2 },
        ] {
            let shards = partition.deal(&data, 20, 7).unwrap();
            assert_eq!(shards.len(), 20);
            assert_eq!(
                shards.iter().map(Dataset::len).sum::<usize>(),
                1_000,
                "{partition}"
            );
            assert_eq!(
                shards,
                partition.deal(&data, 20, 7).unwrap(),
                "reproducible"
            );
        }
    }

    #[test]
    fn a_partition_that_leaves_a_device_without_data_is_refused_naming_it() {
        let data = labelled(30, 3);
        let error = Partition::Iid.deal(&data, 31, 1).unwrap_err().to_string();
        assert!(
            error.contains("--partition iid") && error.contains("31 devices"),
            "{error}"
        );
        // One sample each: the held-out split takes none of a single
        // sample, so each device still trains.
        Partition::Iid.deal(&data, 30, 1).unwrap();
        // Classes of 1, 1 and 4 samples, two holders each: a holder of a
        // one-sample class gets nothing.
        let skewed = Dataset::new(vec![0.5; 12], vec![2], vec![0, 1, 2, 2, 2, 2], 3).unwrap();
        let error = Partition::Shards { classes: 1 }
            .deal(&skewed, 6, 1)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("--partition shards:1") && error.contains("got no samples"),
            "{error}"
        );
    }
}
