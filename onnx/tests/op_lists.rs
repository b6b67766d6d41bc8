//! The lists of supported ops are generated from the dispatch tables; these
//! tests check that they are what import accepts, and that the copies kept
//! outside the crate (ARCHITECTURE.md, the fuzz dictionary) match them.

mod common;

use std::path::PathBuf;

use anyhow::{Context, Result, bail, ensure};
use canopy_onnx::proto::{ModelProto, NodeProto, OperatorSetIdProto, data_type};
use canopy_onnx::{ML_DOMAIN, OnnxError, SUPPORTED_ML_OPS, SUPPORTED_OPS};
use common::*;

/// A model whose one node, `op_type` of `domain`, reads the input x[N, 3]
/// and writes y. Its attributes and arity may be wrong for the op; what
/// matters is whether import dispatches it.
fn one_node_model(op_type: &str, domain: &str) -> ModelProto {
    let node = NodeProto {
        domain: domain.to_string(),
        ..node(op_type, &["x"], &["y"], vec![])
    };
    let mut m = model(
        vec![node],
        vec![value_info("x", data_type::FLOAT, &[None, Some(3)])],
        vec![output("y")],
        vec![],
    );
    m.opset_import.push(OperatorSetIdProto {
        domain: ML_DOMAIN.to_string(),
        version: 1,
    });
    m
}

/// `Ok(true)` when import refused `op_type` as unsupported (naming it),
/// `Ok(false)` when it reached the op's lowering, whatever that decided.
fn refused_as_unsupported(op_type: &str, domain: &str) -> Result<bool> {
    let m = one_node_model(op_type, domain);
    let Ok(error) = refusal(&m) else {
        return Ok(false);
    };
    match &error {
        OnnxError::UnsupportedOp { op_type: named, .. } => {
            ensure!(named == op_type, "{op_type}: the refusal names {named}");
            expect_message(&error, &[op_type])?;
            Ok(true)
        }
        _ => Ok(false),
    }
}

#[test]
fn every_listed_op_reaches_its_lowering() -> Result<()> {
    for (domain, list) in [("", SUPPORTED_OPS), (ML_DOMAIN, SUPPORTED_ML_OPS)] {
        for &op in list {
            ensure!(
                !refused_as_unsupported(op, domain)?,
                "{op} (domain `{domain}`) is listed but import refuses it as unsupported"
            );
        }
    }
    Ok(())
}

#[test]
fn an_unlisted_op_is_refused_by_name_in_each_domain() -> Result<()> {
    let mut unlisted = vec![
        ("Celu", ""),
        ("add", ""),
        ("Relu ", ""),
        ("", ""),
        ("SVMClassifier", ML_DOMAIN),
    ];
    // Each list belongs to its own domain.
    unlisted.extend(SUPPORTED_ML_OPS.iter().map(|&op| (op, "")));
    unlisted.extend(SUPPORTED_OPS.iter().map(|&op| (op, ML_DOMAIN)));
    for (op, domain) in unlisted {
        ensure!(
            refused_as_unsupported(op, domain)?,
            "`{op}` (domain `{domain}`) is not listed, but import did not refuse it as unsupported"
        );
    }
    Ok(())
}

#[test]
fn the_lists_are_sorted_and_distinct() {
    for list in [SUPPORTED_OPS, SUPPORTED_ML_OPS] {
        assert!(
            list.windows(2).all(|pair| pair[0] < pair[1]),
            "{list:?} is not strictly sorted"
        );
    }
}

fn repository_file(path: &str) -> Result<String> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(path);
    std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))
}

/// The markdown list item `- {label}: A, B, C.` as ARCHITECTURE.md should
/// hold it, wrapped at 78 columns.
fn list_item(label: &str, names: &[&str]) -> String {
    let mut lines = vec![format!("- {label}:")];
    for (index, name) in names.iter().enumerate() {
        let word = if index + 1 == names.len() {
            format!("{name}.")
        } else {
            format!("{name},")
        };
        let last = lines.last_mut().expect("one line at least");
        if last.len() + 1 + word.len() <= 78 {
            last.push(' ');
            last.push_str(&word);
        } else {
            lines.push(format!("  {word}"));
        }
    }
    lines.join("\n")
}

/// The names of the list item starting `- {label}:` (with its indented
/// continuation lines) in `text`.
fn listed_names<'t>(text: &'t str, label: &str) -> Result<Vec<&'t str>> {
    let start = format!("- {label}:");
    let mut lines = text.lines().skip_while(|line| !line.starts_with(&start));
    let Some(first) = lines.next() else {
        bail!("no line starts with `{start}`");
    };
    let continued = lines.take_while(|line| line.starts_with("  ") && !line.trim().is_empty());
    Ok(std::iter::once(&first[start.len()..])
        .chain(continued)
        .flat_map(|line| line.split(','))
        .map(|name| name.trim().trim_end_matches('.'))
        .filter(|name| !name.is_empty())
        .collect())
}

#[test]
fn architecture_md_lists_the_supported_ops() -> Result<()> {
    let text = repository_file("ARCHITECTURE.md")?;
    for (label, list) in [
        ("default domain (`SUPPORTED_OPS`)", SUPPORTED_OPS),
        ("`ai.onnx.ml` (`SUPPORTED_ML_OPS`)", SUPPORTED_ML_OPS),
    ] {
        let listed = listed_names(&text, label)?;
        ensure!(
            listed == list,
            "ARCHITECTURE.md's list of {label} differs from import's; replace it with\n{}",
            list_item(label, list)
        );
    }
    Ok(())
}

#[test]
fn the_fuzz_dictionary_holds_every_supported_op() -> Result<()> {
    let dictionary = repository_file("fuzz/import_onnx.dict")?;
    let entries: Vec<&str> = dictionary.lines().map(str::trim).collect();
    let missing: Vec<String> = SUPPORTED_OPS
        .iter()
        .chain(SUPPORTED_ML_OPS)
        .map(|op| format!("\"{op}\""))
        .filter(|entry| !entries.contains(&entry.as_str()))
        .collect();
    ensure!(
        missing.is_empty(),
        "fuzz/import_onnx.dict lacks these supported ops; add the lines\n{}",
        missing.join("\n")
    );
    Ok(())
}
