//! The NPU backend on ONNX Runtime's CPU execution provider: providers the
//! runtime lacks are reported and skipped, graphs run with a symbolic
//! batch, resident values stay between runs, and what ONNX cannot express
//! or a wrong input is refused with the object named.

mod common;

use anyhow::Result;
use canopy_engine::{Backend, CpuBackend, EngineError, Value};
use canopy_ir::{DType, Dim, Graph, Op, Shape, TensorType};
use canopy_npu::{NpuError, OrtBackend, Provider};

/// A build of ONNX Runtime for Linux desktops, as the wheel is, has none
/// of the NPU providers: they are reported, with ONNX Runtime's name for
/// each, and the CPU is used.
#[test]
fn providers_the_runtime_lacks_are_reported_and_skipped() {
    let backend = OrtBackend::open(&common::config(&[
        Provider::Nnapi,
        Provider::Qnn,
        Provider::Cpu,
    ]))
    .unwrap();
    assert_eq!(backend.providers(), [Provider::Cpu]);
    let missing = backend.missing_providers();
    assert_eq!(
        missing.iter().map(|m| m.provider).collect::<Vec<_>>(),
        [Provider::Nnapi, Provider::Qnn]
    );
    assert!(
        missing[0].reason.contains("NnapiExecutionProvider"),
        "{:?}",
        missing[0]
    );
    assert!(
        missing[1].reason.contains("QNNExecutionProvider"),
        "{:?}",
        missing[1]
    );
    assert!(
        backend.runtime_version().starts_with("1."),
        "{}",
        backend.runtime_version()
    );
}

#[test]
fn no_usable_provider_is_an_error_naming_them_with_a_hint() {
    let error = OrtBackend::open(&common::config(&[Provider::Qnn, Provider::Cann]))
        .err()
        .expect("the wheel has neither QNN nor CANN");
    assert!(
        matches!(error, NpuError::NoUsableProvider { .. }),
        "{error:?}"
    );
    let message = error.to_string();
    for part in [
        "qnn, cann",
        "QNNExecutionProvider",
        "CANNExecutionProvider",
        "hint: add `cpu`",
    ] {
        assert!(message.contains(part), "`{part}` missing from: {message}");
    }
}

/// relu(x·w + b) with a symbolic batch.
fn dense() -> Result<Graph> {
    let mut g = Graph::new();
    let x = g.input(
        "x",
        TensorType::new(DType::F32, Shape(vec![Dim::Batch, Dim::Fixed(3)])),
    )?;
    let w = g.input("w", TensorType::f32(&[3, 2]))?;
    let b = g.input("b", TensorType::f32(&[2]))?;
    let xw = g.matmul(x, w)?;
    let y = g.add(xw, b)?;
    let y = g.relu(y)?;
    g.set_output("y", y)?;
    Ok(g)
}

fn values(shape: &[usize], first: f32) -> Value {
    let n: usize = shape.iter().product();
    Value::f32(shape, (0..n).map(|i| first + 0.5 * i as f32).collect()).unwrap()
}

#[test]
fn one_session_runs_every_batch_size_as_the_cpu_does() -> Result<()> {
    let backend = common::cpu_backend();
    let graph = dense()?;
    let mut ort = backend.compile(&graph)?;
    let mut cpu = CpuBackend.compile(&graph)?;
    for batch in [1, 4, 7] {
        let inputs = vec![
            values(&[batch, 3], -2.0),
            values(&[3, 2], -1.0),
            values(&[2], 0.5),
        ];
        let want = cpu.run(inputs.clone())?;
        let got = ort.run(inputs)?;
        assert_eq!(got[0].shape(), [batch, 2]);
        let (got, want) = (got[0].to_f32_vec()?, want[0].to_f32_vec()?);
        for (g, w) in got.iter().zip(&want) {
            assert!(
                (g - w).abs() <= 1e-5 * w.abs().max(1.0),
                "{got:?} vs {want:?}"
            );
        }
    }
    assert_eq!(backend.sessions_created(), 1);
    assert_eq!(backend.runs(), 3);
    Ok(())
}

/// `w ← w − 0.5·x`, with `w` resident: the update stays in the executable
/// between runs, and a snapshot restores it.
#[test]
fn resident_values_stay_between_runs() -> Result<()> {
    let mut g = Graph::new();
    let w = g.input("w", TensorType::f32(&[2]))?;
    let x = g.input("x", TensorType::f32(&[2]))?;
    let half = g.scalar(0.5)?;
    let step = g.mul(x, half)?;
    let next = g.sub(w, step)?;
    let total = g.sum_all(next)?;
    g.set_output("w", next)?;
    g.set_output("total", total)?;
    let backend = common::cpu_backend();
    let mut exe = backend.compile(&g)?;
    exe.make_resident(vec![(0, Value::f32(&[2], vec![1.0, 2.0])?)])?;
    let x = || Value::f32(&[2], vec![1.0, -1.0]).unwrap();
    let first = exe.run_resident(vec![x()])?;
    assert_eq!(first.outputs.len(), 1, "only `total` comes back");
    assert_eq!(first.outputs[0].to_scalar_f32()?, 3.0);
    exe.snapshot_resident()?;
    exe.run_resident(vec![x()])?;
    assert_eq!(exe.read_resident()?[0].1.to_f32_vec()?, [0.0, 3.0]);
    exe.restore_resident()?;
    assert_eq!(exe.read_resident()?[0].1.to_f32_vec()?, [0.5, 2.5]);
    Ok(())
}

#[test]
fn an_op_onnx_cannot_express_is_unsupported_naming_it() -> Result<()> {
    let mut g = Graph::new();
    let seed = g.input("seed", TensorType::new(DType::I64, Shape::fixed(&[])))?;
    let noise = g.push(
        Op::RandomUniform {
            shape: vec![Dim::Fixed(4)],
        },
        &[seed],
    )?;
    g.set_output("noise", noise)?;
    let backend = common::cpu_backend();
    let error = backend
        .compile(&g)
        .err()
        .expect("random_uniform has no ONNX form");
    let EngineError::Unsupported {
        backend: name,
        what,
    } = &error
    else {
        panic!("expected Unsupported, got {error:?}");
    };
    assert_eq!(name, "npu");
    assert!(what.contains("random_uniform"), "{what}");
    assert_eq!(backend.sessions_created(), 0);
    Ok(())
}

#[test]
fn a_wrong_input_is_refused_naming_it() -> Result<()> {
    let backend = common::cpu_backend();
    let mut exe = backend.compile(&dense()?)?;
    let error = exe
        .run(vec![
            values(&[2, 3], 0.0),
            values(&[3, 3], 0.0),
            values(&[2], 0.0),
        ])
        .expect_err("w has the wrong shape");
    assert!(
        matches!(&error, EngineError::Input { name, .. } if name == "w"),
        "{error:?}"
    );
    let error = exe
        .run(vec![values(&[2, 3], 0.0)])
        .expect_err("too few inputs");
    assert!(
        matches!(error, EngineError::InputCount { got: 1, .. }),
        "{error:?}"
    );
    Ok(())
}
