//! Feeds arbitrary bytes through the path `canopy model import` takes:
//! `decode_model` and `import_model_with` (float initializers as
//! parameters) under the default limits. Refusals are fine; a panic is not.
//! Each input goes in twice: as the file's bytes, and read as a recipe for
//! a small model (`onnx_recipe.rs`) that is encoded and goes the same way,
//! since random bytes seldom get past the protobuf decoder to the ops.
//!
//! Whatever import accepts must be a model the rest of Canopy can use, so a
//! lowering that builds an ill-typed graph is a failure even when it does
//! not panic: the graph must pass the IR verifier, and the model file the
//! CLI would write must be writable and read back (the file reader checks
//! every limit and the verifier again) to the same bytes. Import writes a
//! trainable model, so the graph's reverse mode with respect to its
//! parameters, where autodiff accepts it, must verify too.
#![no_main]

use std::collections::BTreeMap;

use canopy_ir::autodiff::vjp;
use canopy_ir::format::{read_model, write_model};
use canopy_ir::model::{ENTRY_INFER, PARAM_PREFIX};
use canopy_ir::verify::verify;
use canopy_ir::{Graph, Metadata, Model, Parameter};
use canopy_onnx::{ImportOptions, ImportedModel, Limits, decode_model, import_model_with};
use libfuzzer_sys::arbitrary::Unstructured;
use libfuzzer_sys::fuzz_target;
use prost::Message;

mod onnx_recipe;

fuzz_target!(|data: &[u8]| {
    import(data);
    if let Ok(model) = onnx_recipe::model(&mut Unstructured::new(data)) {
        import(&model.encode_to_vec());
    }
});

fn import(bytes: &[u8]) {
    let limits = Limits::default();
    let Ok(proto) = decode_model(bytes, &limits) else {
        return;
    };
    let options = ImportOptions { parameters: true };
    if let Ok(imported) = import_model_with(&proto, &limits, options) {
        check_accepted(imported);
    }
}

fn check_accepted(imported: ImportedModel) {
    if let Err(error) = verify(&imported.graph) {
        panic!("import built a graph the verifier refuses: {error}");
    }
    check_reverse_mode(&imported.graph);
    let model = as_model(imported);
    let bytes = match write_model(&model) {
        Ok(bytes) => bytes,
        Err(error) => panic!("an imported model cannot be written: {error}"),
    };
    // Compared as bytes, not as models: NaN weights are not equal to
    // themselves.
    match read_model(&bytes).map(|again| write_model(&again)) {
        Ok(Ok(again)) => assert!(again == bytes, "an imported model reads back changed"),
        Ok(Err(error)) => panic!("an imported model, read back, cannot be written: {error}"),
        Err(error) => panic!("an imported model's file is refused by the reader: {error}"),
    }
}

/// Autodiff may refuse a graph (an op without a gradient); what it builds
/// must be well typed.
fn check_reverse_mode(graph: &Graph) {
    let parameters: Vec<&str> = graph
        .input_names()
        .into_iter()
        .filter(|name| name.starts_with(PARAM_PREFIX))
        .collect();
    if let Ok(backward) = vjp(graph, &parameters)
        && let Err(error) = verify(&backward)
    {
        panic!("the reverse mode of an imported graph does not verify: {error}");
    }
}

/// The model `canopy model import` writes: the graph as `infer`, and each
/// parameter import made from an initializer as a trainable parameter.
fn as_model(imported: ImportedModel) -> Model {
    let parameters = imported
        .parameters
        .iter()
        .map(|name| {
            let (_, data) = imported
                .initializers
                .iter()
                .find(|(initializer, _)| initializer == name)
                .unwrap_or_else(|| panic!("parameter `{name}` has no initializer"));
            Parameter {
                name: name.clone(),
                data: data.clone(),
                trainable: true,
            }
        })
        .collect();
    Model {
        metadata: Metadata {
            model_name: "fuzz".to_string(),
            ..Metadata::default()
        },
        parameters,
        entry_points: BTreeMap::from([(ENTRY_INFER.to_string(), imported.graph)]),
    }
}
