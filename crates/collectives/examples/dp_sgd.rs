//! Data-parallel SGD in Rust, launched like a PyTorch job:
//!
//! ```text
//! cargo build --release --example dp_sgd -p rallypoint-collectives
//! rally run --standalone --nproc-per-node 4 --no-python target/release/examples/dp_sgd
//! ```
//!
//! Each worker holds its own shard of a synthetic linear-regression problem
//! (`y = X·w* + noise`). Rank 0 initialises the model and broadcasts it; every
//! step each worker computes the gradient of the mean squared error on its shard,
//! the gradients are averaged with `all_reduce(AVG)`, and every replica applies
//! the same update. At the end the replicas are all-gathered and checked equal,
//! and rank 0 reports how close the model came to `w*`.

use rallypoint_collectives::blocking::BlockingGroup;
use rallypoint_collectives::{Options, ReduceOp};

const DIM: usize = 32;
const ROWS_PER_RANK: usize = 2048;
const STEPS: usize = 300;
const LR: f32 = 0.1;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let g = BlockingGroup::from_env(Options::default())?;
    let (rank, n) = (g.rank(), g.size());

    // The true model is the same everywhere (same seed); the data is per rank.
    let mut rng = fastrand::Rng::with_seed(7);
    let w_true: Vec<f32> = (0..DIM).map(|_| rng.f32() * 2.0 - 1.0).collect();
    let mut rng = fastrand::Rng::with_seed(1000 + rank as u64);
    let x: Vec<f32> = (0..ROWS_PER_RANK * DIM)
        .map(|_| rng.f32() * 2.0 - 1.0)
        .collect();
    let y: Vec<f32> = x
        .chunks(DIM)
        .map(|row| dot(row, &w_true) + (rng.f32() - 0.5) * 0.01)
        .collect();

    let mut w = vec![0.0f32; DIM];
    if rank == 0 {
        let mut init = fastrand::Rng::with_seed(42);
        w.iter_mut().for_each(|v| *v = init.f32() - 0.5);
    }
    g.broadcast(&mut w, 0)?;

    let mut grad = vec![0.0f32; DIM];
    for step in 0..STEPS {
        grad.fill(0.0);
        let mut loss = 0.0f32;
        for (row, &target) in x.chunks(DIM).zip(&y) {
            let err = dot(row, &w) - target;
            loss += err * err;
            for (gi, xi) in grad.iter_mut().zip(row) {
                *gi += 2.0 * err * xi;
            }
        }
        grad.iter_mut().for_each(|v| *v /= ROWS_PER_RANK as f32);
        let mut mean_loss = [loss / ROWS_PER_RANK as f32];
        g.all_reduce(&mut grad, ReduceOp::Avg)?;
        g.all_reduce(&mut mean_loss, ReduceOp::Avg)?;
        for (wi, gi) in w.iter_mut().zip(&grad) {
            *wi -= LR * gi;
        }
        if rank == 0 && (step % 50 == 0 || step + 1 == STEPS) {
            println!("step {step:>3}  loss {:.6}", mean_loss[0]);
        }
    }

    let mut replicas = vec![0.0f32; DIM * n];
    g.all_gather(&w, &mut replicas)?;
    let agree = replicas.chunks(DIM).all(|r| r == w.as_slice());
    if !agree {
        return Err("replicas diverged".into());
    }
    if rank == 0 {
        let dist = w
            .iter()
            .zip(&w_true)
            .map(|(a, b)| (a - b) * (a - b))
            .sum::<f32>()
            .sqrt();
        println!("{n} replicas agree; |w - w*| = {dist:.5}");
    }
    g.barrier()?;
    Ok(())
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}
