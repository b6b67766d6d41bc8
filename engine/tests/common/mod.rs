//! Shared helpers for gradient tests: running graphs on every backend
//! (the CPU, and the GPU through [`CrossChecked`]) and checking autodiff
//! against central finite differences.
//!
//! The kernels are f32, so differences are taken in f32 and compared in f64
//! with a tolerance that scales with the magnitudes involved.

#![allow(dead_code)]

use canopy_engine::backend::{ResidentRun, TransferCounters};
use canopy_engine::gpu::AdapterPreference;
use canopy_engine::{Backend, CpuBackend, EngineResult, Executable, GpuBackend, Value};
use canopy_ir::autodiff::{jvp, vjp};
use canopy_ir::{DType, Graph, Shape, TensorType, ValueId};

/// A scalar function of a compiled graph's outputs.
type Objective<'a> = dyn Fn(&mut Box<dyn Executable>, Vec<Value>) -> f64 + 'a;

/// Compiles `graph` for every backend under test; the executable runs
/// each and checks that they agree, returning the CPU's outputs.
pub fn compile(graph: &Graph) -> Box<dyn Executable> {
    let cpu = CpuBackend
        .compile(graph)
        .unwrap_or_else(|e| panic!("compile failed: {e:?}\n{graph:#?}"));
    let gpu = gpu_under_test().map(|gpu| {
        gpu.compile(graph)
            .unwrap_or_else(|e| panic!("GPU compile failed: {e}\n{graph:#?}"))
    });
    Box::new(CrossChecked { cpu, gpu })
}

/// The GPU backend, which every suite also runs on. No silent skip: it
/// must open unless `CANOPY_TEST_BACKENDS=cpu` says to test the CPU alone.
///
/// A device of its own for each test thread, not the process's shared
/// one: threads on one wgpu device take turns (a poll holds the device's
/// lock while it waits for its fence, and a buffer's release waits for
/// that lock), so two test threads used one core between them. With a
/// device each, the conformance suite ran in 50 s instead of 63 s on two
/// cores with lavapipe (`PROPTEST_RNG_SEED=42`, 2026-12-01).
pub fn gpu_under_test() -> Option<GpuBackend> {
    if std::env::var("CANOPY_TEST_BACKENDS").as_deref() == Ok("cpu") {
        return None;
    }
    thread_local! {
        static GPU: Result<GpuBackend, String> =
            GpuBackend::new(AdapterPreference::Best).map_err(|e| e.to_string());
    }
    let gpu = GPU.with(Clone::clone).unwrap_or_else(|e| {
        panic!(
            "{e}\nhint: install a Vulkan driver (.ci/run installs mesa-vulkan-drivers), \
             or set CANOPY_TEST_BACKENDS=cpu to test the CPU backend alone"
        )
    });
    Some(gpu)
}

/// Runs a graph on the CPU and on the GPU and asserts that every output
/// agrees to `|gpu - cpu| <= 1e-4·|cpu| + 1e-5·max(1, max|cpu|)`.
pub struct CrossChecked {
    pub cpu: Box<dyn Executable>,
    pub gpu: Option<Box<dyn Executable>>,
}

impl CrossChecked {
    fn check(&self, cpu: &[Value], gpu: &[Value]) {
        assert_eq!(cpu.len(), gpu.len(), "output count");
        for ((c, g), name) in cpu.iter().zip(gpu).zip(self.cpu.output_names()) {
            assert_close_across_backends(name, c, g);
        }
    }
}

pub fn assert_close_across_backends(name: &str, cpu: &Value, gpu: &Value) {
    assert_eq!(cpu.dtype(), gpu.dtype(), "output `{name}`: dtype");
    assert_eq!(cpu.shape(), gpu.shape(), "output `{name}`: shape");
    match (cpu, gpu) {
        (Value::F32(c), Value::F32(g)) => {
            let scale = c.iter().fold(
                1.0f32,
                |m, v| if v.is_finite() { m.max(v.abs()) } else { m },
            );
            for (i, (a, b)) in c.iter().zip(g.iter()).enumerate() {
                let same = (a.is_nan() && b.is_nan()) || a == b;
                let close = (a - b).abs() <= 1e-4 * a.abs() + 1e-5 * scale;
                assert!(
                    same || close,
                    "output `{name}` element {i}: CPU {a}, GPU {b}"
                );
            }
        }
        _ => assert_eq!(cpu, gpu, "output `{name}`"),
    }
}

impl Executable for CrossChecked {
    fn run(&mut self, inputs: Vec<Value>) -> EngineResult<Vec<Value>> {
        let gpu = self.gpu.as_mut().map(|gpu| gpu.run(inputs.clone()));
        let cpu = self.cpu.run(inputs)?;
        if let Some(gpu) = gpu {
            let gpu = gpu.unwrap_or_else(|e| panic!("the CPU ran it, the GPU failed: {e}"));
            self.check(&cpu, &gpu);
        }
        Ok(cpu)
    }

    fn input_names(&self) -> &[String] {
        self.cpu.input_names()
    }

    fn output_names(&self) -> &[String] {
        self.cpu.output_names()
    }

    fn make_resident(&mut self, values: Vec<(usize, Value)>) -> EngineResult<()> {
        if let Some(gpu) = &mut self.gpu {
            gpu.make_resident(values.clone())?;
        }
        self.cpu.make_resident(values)
    }

    fn run_resident(&mut self, inputs: Vec<Value>) -> EngineResult<ResidentRun> {
        let gpu = self
            .gpu
            .as_mut()
            .map(|gpu| gpu.run_resident(inputs.clone()));
        let cpu = self.cpu.run_resident(inputs)?;
        if let Some(gpu) = gpu {
            let gpu = gpu.unwrap_or_else(|e| panic!("the CPU ran it, the GPU failed: {e}"));
            assert_eq!(
                cpu.non_finite, gpu.non_finite,
                "non-finite resident outputs"
            );
            assert_eq!(cpu.outputs.len(), gpu.outputs.len());
            for (k, (c, g)) in cpu.outputs.iter().zip(&gpu.outputs).enumerate() {
                assert_close_across_backends(&format!("returned #{k}"), c, g);
            }
        }
        Ok(cpu)
    }

    fn read_resident(&mut self) -> EngineResult<Vec<(usize, Value)>> {
        let cpu = self.cpu.read_resident()?;
        if let Some(gpu) = &mut self.gpu {
            let gpu = gpu.read_resident()?;
            for ((p, c), (q, g)) in cpu.iter().zip(&gpu) {
                assert_eq!(p, q);
                assert_close_across_backends(&self.cpu.input_names()[*p], c, g);
            }
        }
        Ok(cpu)
    }

    fn snapshot_resident(&mut self) -> EngineResult<()> {
        if let Some(gpu) = &mut self.gpu {
            gpu.snapshot_resident()?;
        }
        self.cpu.snapshot_resident()
    }

    fn restore_resident(&mut self) -> EngineResult<()> {
        if let Some(gpu) = &mut self.gpu {
            gpu.restore_resident()?;
        }
        self.cpu.restore_resident()
    }

    fn transfers(&self) -> TransferCounters {
        self.gpu.as_ref().map(|g| g.transfers()).unwrap_or_default()
    }
}

pub fn run(graph: &Graph, inputs: Vec<Value>) -> Vec<Value> {
    compile(graph)
        .run(inputs)
        .unwrap_or_else(|e| panic!("run failed: {e:?}"))
}

/// Cases per property test: 32, or `PROPTEST_CASES` for a soak run (the
/// suites set their own config, which would otherwise ignore it).
pub fn proptest_cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(32)
}

/// Finite-difference step and tolerances.
#[derive(Clone, Copy, Debug)]
pub struct Tolerance {
    pub eps: f32,
    /// Relative tolerance against the magnitudes of the compared numbers.
    pub rtol: f64,
    /// Absolute tolerance, scaled by the largest derivative seen.
    pub atol: f64,
}

impl Default for Tolerance {
    fn default() -> Self {
        Tolerance {
            eps: 1e-2,
            rtol: 1e-2,
            atol: 2e-3,
        }
    }
}

/// A tiny deterministic generator for cotangents and directions, seeded
/// from the inputs so every proptest case uses fresh ones.
pub struct Rng(pub u64);

impl Rng {
    pub fn from_values(values: &[Value]) -> Rng {
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        for v in values {
            if let Ok(a) = v.as_f32() {
                for x in a.iter() {
                    seed = (seed ^ u64::from(x.to_bits())).wrapping_mul(0x100_0000_01B3);
                }
            }
        }
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    pub fn tensor_like(&mut self, v: &Value) -> Value {
        let data = (0..v.len()).map(|_| self.uniform()).collect();
        Value::f32(v.shape(), data).expect("shape of an existing value")
    }
}

/// Checks first-order derivatives of every f32 output with respect to every
/// f32 input of `graph` (VJP and JVP against finite differences, and
/// against each other), then does the same for the VJP graph itself, so
/// every rule is also checked to be correctly differentiable.
pub fn check_vjp_jvp(graph: &Graph, inputs: &[Value]) {
    check_vjp_jvp_with(graph, inputs, Tolerance::default());
}

/// Where a crate includes these suites to test its own backend
/// (npu/tests/conformance.rs sets `cfg(canopy_forward_backend)` from its
/// build script), every case checks that backend's forward results against
/// the CPU's instead, with that crate's `check_forward`; derivatives are
/// the engine's own run's to check.
#[cfg(canopy_forward_backend)]
pub fn check_vjp_jvp_with(graph: &Graph, inputs: &[Value], _tol: Tolerance) {
    crate::check_forward(graph, inputs);
}

#[cfg(not(canopy_forward_backend))]
pub fn check_vjp_jvp_with(graph: &Graph, inputs: &[Value], tol: Tolerance) {
    let backward = check_first_order(graph, inputs, tol);
    let Some((mut vjp_graph, vjp_inputs)) = backward else {
        return;
    };
    // The VJP graph's own VJP would add `cotangent/y` again for its output
    // `y`; rename its outputs so the names stay distinct.
    let renamed = vjp_graph
        .outputs()
        .iter()
        .map(|(name, v)| (format!("first/{name}"), *v))
        .collect();
    vjp_graph.set_outputs(renamed).expect("distinct names");
    check_first_order(&vjp_graph, &vjp_inputs, tol);
}

/// Names of the f32 inputs, the ones derivatives are taken for.
fn f32_inputs(graph: &Graph) -> Vec<(usize, String)> {
    graph
        .inputs()
        .iter()
        .enumerate()
        .filter(|(_, id)| graph.ty(**id).dtype == DType::F32)
        .map(|(k, id)| (k, graph.input_name(*id).to_string()))
        .collect()
}

fn f32_output_positions(graph: &Graph) -> Vec<usize> {
    (0..graph.outputs().len())
        .filter(|&k| graph.ty(graph.outputs()[k].1).dtype == DType::F32)
        .collect()
}

/// One first-order check; returns the VJP graph and its inputs for a
/// second-order check, or `None` when there is nothing to differentiate.
fn check_first_order(
    graph: &Graph,
    inputs: &[Value],
    tol: Tolerance,
) -> Option<(Graph, Vec<Value>)> {
    let wrt = f32_inputs(graph);
    let outs = f32_output_positions(graph);
    if wrt.is_empty() || outs.is_empty() {
        return None;
    }
    let names: Vec<&str> = wrt.iter().map(|(_, n)| n.as_str()).collect();
    let mut rng = Rng::from_values(inputs);
    let mut primal = compile(graph);
    let base = primal.run(inputs.to_vec()).expect("primal run");
    let cotangents: Vec<Value> = outs.iter().map(|&o| rng.tensor_like(&base[o])).collect();
    let directions: Vec<Value> = wrt
        .iter()
        .map(|&(k, _)| rng.tensor_like(&inputs[k]))
        .collect();

    // Reverse mode.
    let vjp_graph = vjp(graph, &names).expect("vjp transform");
    let mut vjp_inputs = inputs.to_vec();
    vjp_inputs.extend(cotangents.iter().cloned());
    let vjp_out = run(&vjp_graph, vjp_inputs.clone());
    assert_close_values("vjp primal outputs", &vjp_out[..base.len()], &base, tol);
    let grads = &vjp_out[base.len()..];

    // φ(x) = Σ ⟨u_o, f_o(x)⟩; its gradient is the VJP with cotangents u.
    let phi = |exe: &mut Box<dyn Executable>, xs: Vec<Value>| -> f64 {
        let ys = exe.run(xs).expect("perturbed run");
        outs.iter()
            .zip(&cotangents)
            .map(|(&o, u)| dot(&ys[o], u))
            .sum()
    };
    for (j, &(k, ref name)) in wrt.iter().enumerate() {
        let numeric = fd_gradient(&mut primal, inputs, k, tol.eps, &phi);
        let analytic = to_f64(&grads[j]);
        assert_close(&format!("vjp grad/{name}"), &analytic, &numeric, tol);
    }

    // Forward mode along a random direction, elementwise per output.
    let jvp_graph = jvp(graph, &names).expect("jvp transform");
    let mut jvp_inputs = inputs.to_vec();
    jvp_inputs.extend(directions.iter().cloned());
    let jvp_out = run(&jvp_graph, jvp_inputs);
    let tangents = &jvp_out[base.len()..];
    let plus = run(graph, perturb(inputs, &wrt, &directions, tol.eps));
    let minus = run(graph, perturb(inputs, &wrt, &directions, -tol.eps));
    for (t, &o) in tangents.iter().zip(&outs) {
        let numeric: Vec<f64> = to_f64(&plus[o])
            .iter()
            .zip(to_f64(&minus[o]))
            .map(|(p, m)| (p - m) / (2.0 * f64::from(tol.eps)))
            .collect();
        let name = &graph.outputs()[o].0;
        assert_close(&format!("jvp tangent/{name}"), &to_f64(t), &numeric, tol);
    }

    // ⟨u, J·d⟩ = ⟨Jᵀ·u, d⟩ holds exactly, up to rounding.
    let forward: f64 = tangents
        .iter()
        .zip(&cotangents)
        .map(|(t, u)| dot(t, u))
        .sum();
    let reverse: f64 = grads.iter().zip(&directions).map(|(g, d)| dot(g, d)).sum();
    let scale = 1.0 + forward.abs().max(reverse.abs());
    assert!(
        (forward - reverse).abs() <= 1e-3 * scale,
        "⟨u, J·d⟩ = {forward} but ⟨Jᵀ·u, d⟩ = {reverse}"
    );
    Some((vjp_graph, vjp_inputs))
}

/// ∂φ/∂x_i for every element of input `k`, by central differences.
fn fd_gradient(
    exe: &mut Box<dyn Executable>,
    inputs: &[Value],
    k: usize,
    eps: f32,
    phi: &Objective<'_>,
) -> Vec<f64> {
    let n = inputs[k].len();
    (0..n)
        .map(|i| {
            let mut plus = inputs.to_vec();
            let mut minus = inputs.to_vec();
            nudge(&mut plus[k], i, eps);
            nudge(&mut minus[k], i, -eps);
            (phi(exe, plus) - phi(exe, minus)) / (2.0 * f64::from(eps))
        })
        .collect()
}

fn nudge(v: &mut Value, i: usize, by: f32) {
    let Value::F32(a) = v else {
        panic!("only f32 inputs are nudged")
    };
    let x = a.iter_mut().nth(i).expect("index within the tensor");
    *x += by;
}

fn perturb(inputs: &[Value], wrt: &[(usize, String)], dirs: &[Value], eps: f32) -> Vec<Value> {
    let mut out = inputs.to_vec();
    for (&(k, _), d) in wrt.iter().zip(dirs) {
        let Value::F32(a) = &mut out[k] else {
            unreachable!("wrt inputs are f32")
        };
        let d = d.as_f32().expect("directions are f32");
        a.zip_mut_with(d, |x, &dx| *x += eps * dx);
    }
    out
}

pub fn to_f64(v: &Value) -> Vec<f64> {
    v.as_f32()
        .expect("an f32 value")
        .iter()
        .map(|&x| f64::from(x))
        .collect()
}

pub fn dot(a: &Value, b: &Value) -> f64 {
    to_f64(a).iter().zip(to_f64(b)).map(|(x, y)| x * y).sum()
}

fn assert_close_values(what: &str, got: &[Value], want: &[Value], tol: Tolerance) {
    for (k, (g, w)) in got.iter().zip(want).enumerate() {
        match (g.as_f32(), w.as_f32()) {
            (Ok(_), Ok(_)) => assert_close(&format!("{what} #{k}"), &to_f64(g), &to_f64(w), tol),
            _ => assert_eq!(g, w, "{what} #{k}"),
        }
    }
}

/// Elementwise |a − b| ≤ atol·(1 + max|b|) + rtol·max(|a|, |b|).
pub fn assert_close(what: &str, got: &[f64], want: &[f64], tol: Tolerance) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    let scale = 1.0 + want.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
        let bound = tol.atol * scale + tol.rtol * a.abs().max(b.abs());
        assert!(
            (a - b).abs() <= bound && a.is_finite() == b.is_finite(),
            "{what}[{i}]: autodiff {a} vs finite difference {b} (bound {bound})\n got: {got:?}\nwant: {want:?}"
        );
    }
}

// ---- building test graphs ------------------------------------------------

/// A graph under construction together with the values of its inputs.
pub struct Case {
    pub g: Graph,
    pub inputs: Vec<Value>,
}

impl Default for Case {
    fn default() -> Self {
        Case::new()
    }
}

impl Case {
    pub fn new() -> Case {
        Case {
            g: Graph::new(),
            inputs: Vec::new(),
        }
    }

    pub fn f32(&mut self, name: &str, shape: &[usize], data: Vec<f32>) -> ValueId {
        let id = self
            .g
            .input(name, TensorType::f32(shape))
            .expect("fresh input name");
        self.inputs
            .push(Value::f32(shape, data).expect("data fits shape"));
        id
    }

    pub fn i64(&mut self, name: &str, shape: &[usize], data: Vec<i64>) -> ValueId {
        let ty = TensorType::new(DType::I64, Shape::fixed(shape));
        let id = self.g.input(name, ty).expect("fresh input name");
        self.inputs
            .push(Value::i64(shape, data).expect("data fits shape"));
        id
    }

    pub fn bool(&mut self, name: &str, shape: &[usize], data: Vec<bool>) -> ValueId {
        let ty = TensorType::new(DType::Bool, Shape::fixed(shape));
        let id = self.g.input(name, ty).expect("fresh input name");
        let array =
            ndarray::ArrayD::from_shape_vec(ndarray::IxDyn(shape), data).expect("data fits shape");
        self.inputs.push(Value::Bool(array));
        id
    }

    /// Sets `y` as the only output and runs the full derivative check.
    pub fn check(mut self, y: ValueId) {
        self.g.set_output("y", y).expect("output");
        check_vjp_jvp(&self.g, &self.inputs);
    }

    pub fn check_with(mut self, y: ValueId, tol: Tolerance) {
        self.g.set_output("y", y).expect("output");
        check_vjp_jvp_with(&self.g, &self.inputs, tol);
    }
}
