//! FedProx in the model file: the proximal `train_loss` is the loss plus
//! `μ/2 · ‖w − anchor‖²`, the trainer feeds the anchors from the model it
//! starts from, and the term keeps training nearer its start.

use anyhow::{Context, Result};
use canopy_engine::data::{Batch, load_dir};
use canopy_engine::optim::Optimizer;
use canopy_engine::proximal::{
    ANCHOR_PREFIX, check_mu, make_proximal, proximal_mu, proximal_train_loss,
};
use canopy_engine::train::Trainer;
use canopy_engine::zoo::{
    Architecture, ENTRY_TRAIN_LOSS, ModelConfig, build_model, rebuild_train_step,
};
use canopy_engine::{Backend, CpuBackend, Value};
use canopy_ir::Model;
use canopy_ir::model::ENTRY_TRAIN_STEP;

fn mlp() -> Result<Model> {
    Ok(build_model(&ModelConfig {
        architecture: Architecture::Mlp {
            inputs: 784,
            hidden: 32,
            classes: 10,
        },
        seed: 5,
        optimizer: Optimizer::sgd(),
        frozen_prefixes: vec![],
        producer: "test".into(),
    })?)
}

fn batches(count: usize) -> Result<Vec<Batch>> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../datasets/mnist-10k");
    let (train, _) = load_dir(dir)?;
    let train = train.with_feature_shape(&[784])?;
    Ok(train.batches(32, None, true)?.take(count).collect())
}

/// Parameters as the model holds them, anchors shifted by a fixed pattern.
fn feed(model: &Model, graph: &canopy_ir::Graph, batch: &Batch, shift: f32) -> Vec<Value> {
    graph
        .inputs()
        .iter()
        .map(|&i| match graph.input_name(i) {
            "x" => batch.x.clone(),
            "y" => batch.y.clone(),
            "seed" => Value::scalar_i64(7),
            name => {
                let (param, anchored) = match name.strip_prefix(ANCHOR_PREFIX) {
                    Some(param) => (param, true),
                    None => (name.strip_prefix("params/").unwrap_or(name), false),
                };
                let mut data = model.parameter(param).expect("parameter").data.clone();
                if anchored {
                    let values: Vec<f32> = data
                        .as_f32()
                        .expect("f32")
                        .iter()
                        .enumerate()
                        .map(|(k, v)| v + shift * ((k % 7) as f32 - 3.0))
                        .collect();
                    data = canopy_ir::TensorData::f32(data.shape.clone(), values).expect("shape");
                }
                Value::from_data(&data)
            }
        })
        .collect()
}

fn expected_term(model: &Model, trainable: &[String], shift: f32, mu: f64) -> f64 {
    let mut sum = 0.0f64;
    for name in trainable {
        let len = model
            .parameter(name)
            .expect("parameter")
            .data
            .shape
            .iter()
            .product::<usize>();
        sum += (0..len)
            .map(|k| f64::from(shift * ((k % 7) as f32 - 3.0)).powi(2))
            .sum::<f64>();
    }
    mu / 2.0 * sum
}

#[test]
fn proximal_loss_is_the_loss_plus_the_term() -> Result<()> {
    let model = mlp()?;
    let batch = &batches(1)?[0];
    let plain = model.entry(ENTRY_TRAIN_LOSS)?.clone();
    let trainable = model.trainable_names();
    let mu = 0.5;
    let shift = 0.01;
    let proximal = proximal_train_loss(&plain, &trainable, mu)?;
    let loss = |graph: &canopy_ir::Graph| -> Result<f64> {
        let outputs = CpuBackend
            .compile(graph)?
            .run(feed(&model, graph, batch, shift))?;
        let at = graph
            .outputs()
            .iter()
            .position(|(n, _)| n == "loss")
            .expect("loss output");
        Ok(f64::from(outputs[at].to_scalar_f32()?))
    };
    let term = loss(&proximal)? - loss(&plain)?;
    let expected = expected_term(&model, &trainable, shift, mu);
    assert!(
        (term - expected).abs() <= 1e-3 * expected,
        "the proximal term is {term}, expected {expected}"
    );
    Ok(())
}

fn distance_from_start(model: &Model, batches: &[Batch]) -> Result<(f32, f64)> {
    let mut trainer = Trainer::new(model, &CpuBackend, 1)?;
    let mut first_loss = None;
    for batch in batches {
        let stats = trainer.step(batch.x.clone(), batch.y.clone(), 0.1)?;
        first_loss.get_or_insert(stats.loss);
    }
    let mut trained = model.clone();
    trainer.write_back(&mut trained)?;
    let mut distance = 0.0f64;
    for (before, after) in model.parameters.iter().zip(&trained.parameters) {
        let a = before.data.as_f32().context("f32 parameter")?;
        let b = after.data.as_f32().context("f32 parameter")?;
        distance += a
            .iter()
            .zip(b)
            .map(|(x, y)| f64::from(x - y).powi(2))
            .sum::<f64>();
    }
    Ok((first_loss.unwrap_or(f32::NAN), distance.sqrt()))
}

#[test]
fn the_term_keeps_training_nearer_its_start() -> Result<()> {
    let plain = mlp()?;
    let mut proximal = plain.clone();
    make_proximal(&mut proximal, 1.0)?;
    assert_eq!(proximal_mu(&proximal)?, Some(1.0));
    let batches = batches(40)?;
    let (plain_first, plain_distance) = distance_from_start(&plain, &batches)?;
    let (proximal_first, proximal_distance) = distance_from_start(&proximal, &batches)?;
    // At the anchor the term and its gradient are zero.
    assert!(
        (plain_first - proximal_first).abs() <= 1e-6,
        "first losses {plain_first} vs {proximal_first}"
    );
    assert!(
        proximal_distance < 0.9 * plain_distance,
        "FedProx moved {proximal_distance}, plain SGD {plain_distance}"
    );
    Ok(())
}

#[test]
fn rebuilding_the_step_keeps_the_term_and_a_written_file_keeps_mu() -> Result<()> {
    let mut model = mlp()?;
    make_proximal(&mut model, 0.01)?;
    rebuild_train_step(&mut model, &Optimizer::adam())?;
    let bytes = canopy_ir::format::write_model(&model)?;
    let read = canopy_ir::format::read_model(&bytes)?;
    assert_eq!(proximal_mu(&read)?, Some(0.01));
    let step = read.entry(ENTRY_TRAIN_STEP)?;
    let anchors = step
        .input_names()
        .into_iter()
        .filter(|n| n.starts_with(ANCHOR_PREFIX))
        .count();
    assert_eq!(anchors, read.trainable_names().len());
    Trainer::new(&read, &CpuBackend, 1)?;
    Ok(())
}

#[test]
fn mu_out_of_range_is_refused() -> Result<()> {
    for mu in [0.0, -1.0, f64::NAN, f64::INFINITY, 1_000.5] {
        let error = check_mu(mu).expect_err("refused");
        assert!(error.to_string().contains("FedProx mu"), "{error}");
        assert!(make_proximal(&mut mlp()?, mu).is_err());
    }
    let mut model = mlp()?;
    model
        .metadata
        .properties
        .insert("proximal_mu".into(), "lots".into());
    let error = proximal_mu(&model).expect_err("not a number");
    assert!(error.to_string().contains("`lots`"), "{error}");
    Ok(())
}
