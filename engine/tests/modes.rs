//! Eager and graph mode run the same model code to the same results.

use anyhow::Result;
use canopy_engine::nn::{
    Conv2d, Dropout, Embedding, Flatten, ForwardCtx, GELU, Layer, LayerNorm, Linear, MaxPool2d,
    Params, ReLU, Sequential, Sigmoid, Tanh, init_params, softmax_cross_entropy,
};
use canopy_engine::{Function, Mode, Tensor, Value, set_mode};
use rand::{Rng, SeedableRng, rngs::StdRng};

fn random(shape: &[usize], seed: u64) -> Tensor {
    let mut rng = StdRng::seed_from_u64(seed);
    let n = shape.iter().product();
    Tensor::from_f32(shape, (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()).unwrap()
}

/// Runs `f` in both modes and checks the outputs agree.
fn assert_modes_agree(mut f: Function, args: &[Tensor]) -> Result<()> {
    set_mode(Mode::Eager);
    let eager = f.call(args)?;
    set_mode(Mode::Graph);
    let graph = f.call(args)?;
    let again = f.call(args)?;
    set_mode(Mode::Eager);
    assert_eq!(
        f.compiled_signatures(),
        1,
        "a second call reuses the compiled graph"
    );
    assert_eq!(eager.len(), graph.len());
    for ((e, g), a) in eager.iter().zip(&graph).zip(&again) {
        let (e, g, a) = (e.value()?, g.value()?, a.value()?);
        assert_eq!(e.shape(), g.shape());
        assert_eq!(g, a, "graph mode is deterministic");
        match (e, g) {
            (Value::F32(e), Value::F32(g)) => {
                for (x, y) in e.iter().zip(g.iter()) {
                    assert!(
                        (x - y).abs() <= 1e-5 * (1.0 + x.abs()),
                        "eager {x} vs graph {y}"
                    );
                }
            }
            (e, g) => assert_eq!(e, g),
        }
    }
    Ok(())
}

fn params_for(net: &dyn Layer, seed: u64) -> Params {
    Params(
        init_params(&net.params(), seed)
            .into_iter()
            .map(|(name, data)| (name, Tensor::from_value(Value::from_data(&data))))
            .collect(),
    )
}

#[test]
fn elementwise_and_reductions_agree() -> Result<()> {
    let f = Function::new(|a: &[Tensor]| {
        let h = a[0].mul(&a[1])?.add(&a[1].exp()?)?.tanh()?;
        let m = h.max(&[1], true)?;
        Ok(vec![
            h.sub(&m)?.softmax(1)?,
            h.sum(&[0], false)?,
            h.mean_all()?,
        ])
    });
    assert_modes_agree(f, &[random(&[4, 5], 1), random(&[1, 5], 2)])
}

#[test]
fn a_convolutional_network_with_loss_agrees() -> Result<()> {
    let net = Sequential::new()
        .push(Conv2d::new("c1", 1, 4, 3).padding(1))
        .push(ReLU)
        .push(MaxPool2d::new(2, 2))
        .push(Flatten)
        .push(Linear::new("fc", 4 * 4 * 4, 16))
        .push(GELU)
        .push(LayerNorm::new("ln", 16))
        .push(Tanh)
        .push(Linear::new("out", 16, 3))
        .push(Sigmoid);
    let params = params_for(&net, 5);
    let f = Function::new(move |a: &[Tensor]| {
        let logits = net.forward(&params, &a[0], &ForwardCtx::inference())?;
        let labels = Tensor::from_value(Value::i64(&[2], vec![2, 0])?);
        Ok(vec![
            logits.clone(),
            softmax_cross_entropy(&logits, &labels)?,
        ])
    });
    assert_modes_agree(f, &[random(&[2, 1, 8, 8], 3)])
}

#[test]
fn dropout_and_embedding_agree() -> Result<()> {
    let emb = Embedding {
        name: "emb".into(),
        count: 10,
        dim: 4,
    };
    let params = params_for(&emb, 9);
    let f = Function::new(move |a: &[Tensor]| {
        let seed = Tensor::from_value(Value::scalar_i64(42));
        let ctx = ForwardCtx::training(Some(seed));
        let e = emb.forward(&params, &a[0], &ctx)?;
        Ok(vec![Dropout { p: 0.5 }.forward(&params, &e, &ctx)?])
    });
    let indices = Tensor::from_value(Value::i64(&[2, 3], vec![0, 3, 9, 1, 1, 7])?);
    assert_modes_agree(f, &[indices])
}

#[test]
fn dropout_drops_about_p_and_rescales_the_rest() -> Result<()> {
    set_mode(Mode::Eager);
    let ones = Tensor::from_f32(&[100, 100], vec![1.0; 10_000])?;
    let ctx = ForwardCtx::training(Some(Tensor::from_value(Value::scalar_i64(1))));
    let out = Dropout { p: 0.3 }
        .forward(&Params::default(), &ones, &ctx)?
        .to_vec_f32()?;
    let zeros = out.iter().filter(|&&v| v == 0.0).count() as f64 / out.len() as f64;
    assert!((zeros - 0.3).abs() < 0.02, "dropped fraction {zeros}");
    assert!(
        out.iter()
            .all(|&v| v == 0.0 || (v - 1.0 / 0.7).abs() < 1e-6)
    );
    let inference =
        Dropout { p: 0.3 }.forward(&Params::default(), &ones, &ForwardCtx::inference())?;
    assert_eq!(inference.to_vec_f32()?, vec![1.0; 10_000]);
    Ok(())
}

#[test]
fn shape_errors_are_errors_in_both_modes() {
    for mode in [Mode::Eager, Mode::Graph] {
        set_mode(mode);
        let mut f = Function::new(|a: &[Tensor]| Ok(vec![a[0].matmul(&a[1])?]));
        let err = f
            .call(&[random(&[2, 3], 1), random(&[4, 5], 2)])
            .unwrap_err();
        assert!(
            err.to_string().contains("inner dimensions differ"),
            "{mode:?}: {err}"
        );
    }
    set_mode(Mode::Eager);
}

#[test]
fn a_new_input_shape_compiles_a_new_graph() -> Result<()> {
    set_mode(Mode::Graph);
    let mut f = Function::new(|a: &[Tensor]| Ok(vec![a[0].relu()?.sum_all()?]));
    f.call(&[random(&[2, 3], 1)])?;
    f.call(&[random(&[4, 3], 1)])?;
    f.call(&[random(&[2, 3], 7)])?;
    set_mode(Mode::Eager);
    assert_eq!(f.compiled_signatures(), 2);
    Ok(())
}

/// The README's "Eager and graph mode" block is `examples/modes.rs`, which
/// prints the same sum from both modes.
#[test]
fn the_readme_example_runs_in_both_modes() -> Result<()> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let example = std::fs::read_to_string(root.join("examples/modes.rs"))?;
    let readme = std::fs::read_to_string(root.join("../README.md"))?;
    let shown = readme
        .split_once("## Eager and graph mode")
        .and_then(|(_, rest)| rest.split_once("```rust\n"))
        .and_then(|(_, rest)| rest.split_once("```\n"))
        .map(|(block, _)| block);
    let program = example.find("\nuse ").map(|at| &example[at + 1..]);
    assert!(
        shown.is_some() && shown == program,
        "README.md's eager/graph block is not engine/examples/modes.rs from its `use` line down"
    );
    // `cargo test` builds the package's examples beside its test binaries.
    let exe = std::env::current_exe()?;
    let binary = exe
        .parent()
        .and_then(|deps| deps.parent())
        .map(|dir| dir.join("examples/modes"))
        .filter(|path| path.exists())
        .ok_or_else(|| anyhow::anyhow!("examples/modes is not built; run `cargo test`"))?;
    let output = std::process::Command::new(binary).output()?;
    assert!(output.status.success(), "{output:?}");
    let printed = String::from_utf8(output.stdout)?;
    // relu([[-3, 1], [6, 0.5]]) sums to 7.5 in both modes.
    assert_eq!(printed.trim(), "eager [7.5], graph [7.5]", "{printed}");
    Ok(())
}
