//! Exact GELU against JAX's `gelu(approximate=False)`: inside random
//! compositions with matmul, softmax and reductions, the value, the
//! gradient, the JVP and the Hessian-vector product of our float32 graphs
//! match references JAX computes in float64 to 1e-3 relative, on every
//! backend (the graphs run through `common::compile`, which also checks
//! the GPU against the CPU).
//!
//! The references are generated when the test runs, by
//! `tests/reference/gelu_jax.py` with the interpreter `.ci/run` installs
//! `requirements-dev.txt` into; no silent skip when JAX is missing.

mod common;

use std::io::Write;
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};
use canopy_engine::Value;
use canopy_ir::autodiff::{grad, jvp, value_and_grad};
use canopy_ir::{GeluApproximation, Graph, ReduceKind, TensorType, ValueId};
use serde_json::{Value as Json, json};

const KINDS: [&str; 4] = [
    "matmul_gelu_sum",
    "gelu_matmul_softmax",
    "matmul_gelu_max_mean",
    "nested_gelu_log_softmax",
];
const SEEDS_PER_KIND: u64 = 4;
const X_SHAPE: [usize; 2] = [4, 6];
const W_SHAPE: [usize; 2] = [6, 5];
const OUT_SHAPE: [usize; 2] = [4, 5];
const RELATIVE: f64 = 1e-3;
const INSTALL_HINT: &str = "hint: pip install -r requirements-dev.txt";

fn python() -> String {
    std::env::var("CANOPY_PYTHON").unwrap_or_else(|_| "python3".to_string())
}

/// The composition named `kind`, as `f(x, w; c)` with scalar output `y`;
/// the same functions as in `gelu_jax.py`.
fn composition(kind: &str) -> Result<Graph> {
    let mut g = Graph::new();
    let x = g.input("x", TensorType::f32(&X_SHAPE))?;
    let w = g.input("w", TensorType::f32(&W_SHAPE))?;
    let c = g.input("c", TensorType::f32(&OUT_SHAPE))?;
    let exact = GeluApproximation::None;
    let y = match kind {
        "matmul_gelu_sum" => {
            let h = g.matmul(x, w)?;
            let h = g.gelu(h, exact)?;
            weighted_sum(&mut g, h, c)?
        }
        "gelu_matmul_softmax" => {
            let h = g.gelu(x, exact)?;
            let h = g.matmul(h, w)?;
            let p = g.softmax(h, 1)?;
            weighted_sum(&mut g, p, c)?
        }
        "matmul_gelu_max_mean" => {
            let h = g.matmul(x, w)?;
            let h = g.gelu(h, exact)?;
            let rows = g.reduce(ReduceKind::Max, h, &[1], false)?;
            let a = g.reduce(ReduceKind::Mean, rows, &[0], false)?;
            let gw = g.gelu(w, exact)?;
            let b = g.reduce(ReduceKind::Mean, gw, &[0, 1], false)?;
            g.add(a, b)?
        }
        "nested_gelu_log_softmax" => {
            let h = g.gelu(x, exact)?;
            let h = g.matmul(h, w)?;
            let h = g.gelu(h, exact)?;
            let p = g.log_softmax(h, 1)?;
            weighted_sum(&mut g, p, c)?
        }
        _ => bail!("unknown composition {kind}"),
    };
    g.set_output("y", y)?;
    Ok(g)
}

fn weighted_sum(g: &mut Graph, a: ValueId, c: ValueId) -> Result<ValueId> {
    let product = g.mul(a, c)?;
    Ok(g.sum_all(product)?)
}

struct Case {
    kind: &'static str,
    x: Vec<f32>,
    w: Vec<f32>,
    c: Vec<f32>,
    tx: Vec<f32>,
    tw: Vec<f32>,
}

impl Case {
    fn new(kind: &'static str, seed: u64) -> Case {
        let mut rng = common::Rng(seed.wrapping_mul(0x9E37_79B9) ^ kind.len() as u64);
        let mut draw = |n: usize, scale: f32| (0..n).map(|_| scale * rng.uniform()).collect();
        Case {
            kind,
            // Wide enough to reach both tails of GELU and its curved middle.
            x: draw(24, 2.5),
            w: draw(30, 1.0),
            c: draw(20, 1.0),
            tx: draw(24, 1.0),
            tw: draw(30, 1.0),
        }
    }

    fn json(&self) -> Json {
        json!({
            "kind": self.kind,
            "x": self.x, "x_shape": X_SHAPE,
            "w": self.w, "w_shape": W_SHAPE,
            "c": self.c, "c_shape": OUT_SHAPE,
            "tx": self.tx, "tx_shape": X_SHAPE,
            "tw": self.tw, "tw_shape": W_SHAPE,
        })
    }

    fn inputs(&self) -> Vec<Value> {
        let f = |shape: &[usize], data: &[f32]| Value::f32(shape, data.to_vec()).unwrap();
        vec![
            f(&X_SHAPE, &self.x),
            f(&W_SHAPE, &self.w),
            f(&OUT_SHAPE, &self.c),
        ]
    }

    fn tangents(&self) -> Vec<Value> {
        let f = |shape: &[usize], data: &[f32]| Value::f32(shape, data.to_vec()).unwrap();
        vec![f(&X_SHAPE, &self.tx), f(&W_SHAPE, &self.tw)]
    }
}

/// Runs the reference script on every case.
fn references(cases: &[Case]) -> Result<Vec<Json>> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/reference/gelu_jax.py");
    let mut child = Command::new(python())
        .arg(script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot run `{}`; {INSTALL_HINT}", python()))?;
    let input = Json::Array(cases.iter().map(Case::json).collect());
    child
        .stdin
        .take()
        .context("the script's stdin")?
        .write_all(input.to_string().as_bytes())?;
    let output = child.wait_with_output()?;
    if !output.status.success() {
        bail!(
            "the JAX reference script failed: {}\n{INSTALL_HINT}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    let parsed: Json = serde_json::from_slice(&output.stdout)?;
    Ok(parsed.as_array().context("a list of references")?.clone())
}

fn floats(json: &Json, key: &str) -> Vec<f64> {
    match &json[key] {
        Json::Array(items) => items.iter().map(|v| v.as_f64().unwrap()).collect(),
        v => vec![v.as_f64().unwrap_or_else(|| panic!("`{key}` in {json}"))],
    }
}

fn values(v: &Value) -> Vec<f64> {
    v.as_f32().unwrap().iter().map(|&x| f64::from(x)).collect()
}

/// Each element within 1e-3 of the reference, relative to the element or,
/// for elements near zero, to a hundredth of the largest one.
fn assert_matches(what: &str, ours: &[f64], reference: &[f64]) {
    assert_eq!(ours.len(), reference.len(), "{what}: length");
    let largest = reference.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    for (i, (a, b)) in ours.iter().zip(reference).enumerate() {
        let bound = RELATIVE * b.abs().max(0.01 * largest);
        assert!(
            (a - b).abs() <= bound,
            "{what}[{i}]: ours {a}, JAX {b} (bound {bound})\n ours: {ours:?}\n  JAX: {reference:?}"
        );
    }
}

#[test]
fn exact_gelu_matches_jax_in_value_gradient_jvp_and_hvp() -> Result<()> {
    let cases: Vec<Case> = KINDS
        .iter()
        .flat_map(|&kind| (0..SEEDS_PER_KIND).map(move |seed| Case::new(kind, seed)))
        .collect();
    let references = references(&cases)?;
    assert_eq!(references.len(), cases.len());
    for (case, reference) in cases.iter().zip(&references) {
        let f = composition(case.kind)?;
        let what = |part: &str| format!("{} {part}", case.kind);

        let value_and_gradient = value_and_grad(&f, "y", &["x", "w"])?;
        let out = common::run(&value_and_gradient, case.inputs());
        assert_matches(
            &what("value"),
            &values(&out[0]),
            &floats(reference, "value"),
        );
        assert_matches(
            &what("grad x"),
            &values(&out[1]),
            &floats(reference, "grad_x"),
        );
        assert_matches(
            &what("grad w"),
            &values(&out[2]),
            &floats(reference, "grad_w"),
        );

        let forward = jvp(&f, &["x", "w"])?;
        let out = common::run(&forward, [case.inputs(), case.tangents()].concat());
        assert_matches(&what("jvp"), &values(&out[1]), &floats(reference, "jvp"));

        // H·v, forward over reverse, as the script computes it.
        let hvp = jvp(&grad(&f, "y", &["x", "w"])?, &["x", "w"])?;
        let out = common::run(&hvp, [case.inputs(), case.tangents()].concat());
        assert_matches(
            &what("hvp x"),
            &values(&out[2]),
            &floats(reference, "hvp_x"),
        );
        assert_matches(
            &what("hvp w"),
            &values(&out[3]),
            &floats(reference, "hvp_w"),
        );
    }
    Ok(())
}
