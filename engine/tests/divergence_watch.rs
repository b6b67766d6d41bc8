//! LeNet-5's default initialisation and the divergence watch, on real
//! training (mnist-10k, the CPU backend).

use std::ops::ControlFlow;
use std::path::PathBuf;

use anyhow::Result;
use canopy_engine::CpuBackend;
use canopy_engine::data::load_dir;
use canopy_engine::optim::Optimizer;
use canopy_engine::train::{Divergence, DivergenceWatch, FitConfig, FitProgress, Trainer, fit};
use canopy_engine::zoo::{Architecture, ModelConfig, build_model, fit_input_stats};

fn datasets() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../datasets")
}

/// What one epoch of a default LeNet-5 (`frozen` prefixes frozen) at
/// `lr` showed: the running means of its losses, and the watch's verdict.
fn one_epoch(
    frozen: &[&str],
    optimizer: Optimizer,
    lr: f32,
) -> Result<(Vec<f64>, Option<Divergence>)> {
    let (train, _) = load_dir(datasets().join("mnist-10k"))?;
    let mut model = build_model(&ModelConfig {
        architecture: Architecture::LeNet5 { classes: 10 },
        seed: 0,
        optimizer,
        frozen_prefixes: frozen.iter().map(|s| s.to_string()).collect(),
        producer: "test".into(),
    })?;
    fit_input_stats(&mut model, &train)?;
    let mut trainer = Trainer::new(&model, &CpuBackend, 0)?;
    let mut watch = DivergenceWatch::new(10);
    let (mut means, mut verdict) = (Vec::new(), None);
    fit(
        &mut trainer,
        &train,
        &FitConfig::new(1, 64, lr, 0),
        &mut |p| {
            if let FitProgress::Batch {
                done, mean_loss, ..
            } = p
                && done > 0
            {
                means.push(mean_loss);
            }
            verdict = verdict.or(watch.observe(&p));
            ControlFlow::Continue(())
        },
    )?;
    Ok((means, verdict))
}

/// With He's gain on its pooled convolutions LeNet-5 started at a loss of
/// 4.48 and its running mean shot to 43.95 with the convolutions frozen
/// (every ReLU died); with LeCun's there, it starts near ln 10 and learns.
#[test]
fn the_default_lenet5_starts_near_ln_10_and_its_frozen_head_learns_at_lr_0_1() -> Result<()> {
    let (means, verdict) = one_epoch(&["conv"], Optimizer::sgd(), 0.1)?;
    let first = means[0];
    assert!(
        first < 3.0,
        "first loss {first}: the logits start at a sane scale"
    );
    // He's gain there made the running mean ten times the first loss
    // (43.95 after 4.48); what is left is a bump the head recovers from.
    let peak = means.iter().cloned().fold(0.0, f64::max);
    assert!(peak < 2.0 * first, "first {first}, peak {peak}");
    assert_eq!(verdict, None);
    let last = *means.last().unwrap();
    assert!(last < 1.5, "the head learned: running mean {last}");
    Ok(())
}

/// Adam at SGD's old default rate: the watch says so.
#[test]
fn adam_at_lr_0_1_diverges_and_the_watch_says_so() -> Result<()> {
    let (means, verdict) = one_epoch(&["conv"], Optimizer::adam(), 0.1)?;
    let verdict = verdict.unwrap_or_else(|| panic!("not flagged; running means {means:?}"));
    assert!(
        verdict.to_string().starts_with("training diverged"),
        "{verdict}"
    );
    Ok(())
}
