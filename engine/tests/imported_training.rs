//! Training entry points for a classifier whose `infer` came from
//! elsewhere (`zoo::add_classifier_training`, which `canopy model import`
//! uses): the zoo MLP's `infer` is rewritten the way an ONNX export shapes
//! it (its own input name, a label output first, softmax probabilities),
//! and the derived `train_step` and `eval` must match the zoo's own,
//! step for step, since both minimise the cross-entropy of the same logits.

use anyhow::Result;
use canopy_engine::data::{CsvOptions, Dataset, load_csv_with};
use canopy_engine::optim::Optimizer;
use canopy_engine::tensor::call;
use canopy_engine::train::{EVAL_BATCH, Trainer, evaluate};
use canopy_engine::zoo::{
    Architecture, ENTRY_TRAIN_LOSS, ModelConfig, add_classifier_training, build_model, class_count,
    fit_input_stats, sample_shape,
};
use canopy_engine::{CpuBackend, EngineError, trace};
use canopy_ir::model::{ENTRY_EVAL, ENTRY_INFER, ENTRY_TRAIN_STEP};
use canopy_ir::{DType, Dim, Graph, Model, Shape, TensorType};

fn digits() -> Result<Dataset> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../datasets/digits/digits.csv.gz"
    );
    Ok(load_csv_with(path, &CsvOptions::default())?)
}

fn zoo_mlp(train: &Dataset) -> Result<Model> {
    let mut model = build_model(&ModelConfig {
        architecture: Architecture::Mlp {
            inputs: 64,
            hidden: 32,
            classes: 10,
        },
        seed: 5,
        optimizer: Optimizer::sgd(),
        frozen_prefixes: Vec::new(),
        producer: "test".into(),
    })?;
    fit_input_stats(&mut model, train)?;
    Ok(model)
}

/// `infer` as an exporter writes it: data input `pixels` with a symbolic
/// batch, outputs `label` (i64) then `probabilities` (softmax of the logits).
fn exported_infer(zoo_infer: &Graph, batch: Dim) -> Result<Graph> {
    let mut inputs: Vec<(&str, TensorType)> = zoo_infer
        .inputs()
        .iter()
        .filter(|&&id| zoo_infer.input_name(id) != "x")
        .map(|&id| (zoo_infer.input_name(id), zoo_infer.ty(id).clone()))
        .collect();
    let pixels = TensorType::new(DType::F32, Shape(vec![batch, Dim::Fixed(64)]));
    inputs.push(("pixels", pixels));
    Ok(trace(&inputs, |args| {
        let refs: Vec<_> = args.iter().collect();
        let logits = call(zoo_infer, &refs)?.remove(0);
        Ok(vec![
            ("label".to_string(), logits.argmax(1, false)?),
            ("probabilities".to_string(), logits.softmax(1)?),
        ])
    })?)
}

/// The zoo model's parameters with only the exported `infer`: what an
/// import produces before its training entry points.
fn as_imported(zoo: &Model, batch: Dim) -> Result<Model> {
    let mut model = zoo.clone();
    let infer = exported_infer(zoo.entry(ENTRY_INFER)?, batch)?;
    model.entry_points.clear();
    model.entry_points.insert(ENTRY_INFER.to_string(), infer);
    Ok(model)
}

fn trained_parameters(model: &Model, train: &Dataset, steps: usize) -> Result<Vec<Vec<f32>>> {
    let mut trainer = Trainer::new(model, &CpuBackend, 3)?;
    for batch in train.batches(32, Some(0), true)?.take(steps) {
        trainer.step(batch.x, batch.y, 0.05)?;
    }
    let mut trained = model.clone();
    trainer.write_back(&mut trained)?;
    Ok(trained
        .parameters
        .iter()
        .map(|p| p.data.as_f32().expect("f32 parameter").to_vec())
        .collect())
}

#[test]
fn an_exported_classifier_trains_exactly_like_the_zoo_model() -> Result<()> {
    let (train, test) = digits()?.split(0.2, 1)?;
    let zoo = zoo_mlp(&train)?;
    let mut imported = as_imported(&zoo, Dim::Batch)?;
    assert_eq!(class_count(&imported)?, 10, "classes from `probabilities`");
    assert_eq!(sample_shape(&imported)?, vec![64], "shape from `pixels`");
    add_classifier_training(&mut imported, &Optimizer::sgd())?;
    for entry in [ENTRY_EVAL, ENTRY_TRAIN_LOSS, ENTRY_TRAIN_STEP] {
        assert!(imported.entry_points.contains_key(entry), "{entry}");
    }
    let infer = imported.entry(ENTRY_INFER)?;
    assert_eq!(infer.outputs()[0].0, "label", "infer is kept as exported");

    let before = evaluate(&imported, &test, EVAL_BATCH, &CpuBackend)?;
    let zoo_before = evaluate(&zoo, &test, EVAL_BATCH, &CpuBackend)?;
    assert!((before.loss - zoo_before.loss).abs() < 1e-5);
    assert_eq!(before.accuracy, zoo_before.accuracy);

    let ours = trained_parameters(&imported, &train, 30)?;
    let theirs = trained_parameters(&zoo, &train, 30)?;
    for (index, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        let worst = a
            .iter()
            .zip(b)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(worst <= 1e-5, "parameter {index} differs by {worst}");
    }
    assert_ne!(
        ours,
        zoo.parameters
            .iter()
            .map(|p| p.data.as_f32().unwrap().to_vec())
            .collect::<Vec<_>>(),
        "training changed the parameters"
    );
    Ok(())
}

#[test]
fn frozen_parameters_stay_put_and_the_rest_learn() -> Result<()> {
    let (train, test) = digits()?.split(0.2, 1)?;
    let mut imported = as_imported(&zoo_mlp(&train)?, Dim::Batch)?;
    canopy_engine::zoo::set_frozen(&mut imported, &["fc1".to_string()])?;
    add_classifier_training(&mut imported, &Optimizer::parse("adam")?)?;
    let before = evaluate(&imported, &test, EVAL_BATCH, &CpuBackend)?;
    let mut trainer = Trainer::new(&imported, &CpuBackend, 3)?;
    for epoch in 0..3 {
        for batch in train.batches(32, Some(epoch), true)? {
            trainer.step(batch.x, batch.y, 0.01)?;
        }
    }
    let mut trained = imported.clone();
    trainer.write_back(&mut trained)?;
    let after = evaluate(&trained, &test, EVAL_BATCH, &CpuBackend)?;
    assert!(
        after.accuracy > before.accuracy + 0.3 && after.loss < before.loss,
        "accuracy {:.3} -> {:.3}, loss {:.3} -> {:.3}",
        before.accuracy,
        after.accuracy,
        before.loss,
        after.loss
    );
    for name in ["fc1.weight", "fc1.bias"] {
        assert_eq!(
            trained.parameter(name).unwrap().data,
            imported.parameter(name).unwrap().data,
            "{name} is frozen"
        );
    }
    assert_ne!(
        trained.parameter("fc2.weight").unwrap().data,
        imported.parameter("fc2.weight").unwrap().data
    );
    Ok(())
}

#[test]
fn graphs_that_cannot_train_are_refused_with_the_reason() -> Result<()> {
    let train = digits()?;
    let zoo = zoo_mlp(&train)?;

    let mut fixed_batch = as_imported(&zoo, Dim::Fixed(1))?;
    let error = add_classifier_training(&mut fixed_batch, &Optimizer::sgd()).unwrap_err();
    let message = error.to_string();
    assert!(
        message.contains("`pixels`") && message.contains("fixed first dimension"),
        "{message}"
    );

    let mut labels_only = as_imported(&zoo, Dim::Batch)?;
    let infer = labels_only.entry_points.get_mut(ENTRY_INFER).unwrap();
    let label = infer.find_output("label").unwrap();
    infer.set_outputs(vec![("label".to_string(), label)])?;
    let error = add_classifier_training(&mut labels_only, &Optimizer::sgd()).unwrap_err();
    assert!(matches!(error, EngineError::Shape(_)), "{error:?}");
    assert!(
        error
            .to_string()
            .contains("no f32 output shaped [batch, classes]")
            && error.to_string().contains("label: i64[N]"),
        "{error}"
    );
    Ok(())
}
