//! The README's "Eager and graph mode" program: the block there is this
//! file from its `use` line down, and `engine/tests/modes.rs` runs it.

use canopy_engine::{Function, Mode, Tensor, set_mode};

fn main() -> Result<(), canopy_engine::EngineError> {
    let x = Tensor::from_f32(&[2, 3], vec![1.0, -2.0, 3.0, -4.0, 5.0, -6.0])?;
    let w = Tensor::from_f32(&[3, 2], vec![0.5, -1.0, 1.0, 0.5, -0.5, 1.0])?;
    let mut f = Function::new(|args: &[Tensor]| {
        let h = args[0].matmul(&args[1])?.relu()?;
        Ok(vec![h.sum_all()?])
    });
    let eager = f.call(&[x.clone(), w.clone()])?; // op by op, as Rust runs it
    set_mode(Mode::Graph); // the one line: trace, optimise, compile, cache
    let graph = f.call(&[x, w])?; // the second call with these shapes reuses the graph
    println!(
        "eager {:?}, graph {:?}",
        eager[0].to_vec_f32()?,
        graph[0].to_vec_f32()?
    );
    Ok(())
}
