//! A parameter server over RPC: worker 0 (`ps`) holds a linear model behind an
//! RRef; every other worker (`trainer1`, …) fetches the RRef, then loops:
//! read the weights, compute a gradient on its own synthetic batch, and apply
//! it at the owner with a method call. Launch with:
//!
//! ```text
//! cargo build --release -p rallypoint-rpc --example param_server
//! rally run --standalone --nproc-per-node 3 --no-python target/release/examples/param_server
//! ```
//!
//! Every worker ends with a graceful shutdown; the server prints the final
//! loss on fresh data and exits non-zero if the model did not learn.

use std::sync::OnceLock;
use std::time::Duration;

use rallypoint_rpc::{init_rpc, RRef, RpcBackendOptions};
use serde::{Deserialize, Serialize};

const DIM: usize = 16;
const STEPS: usize = 200;
const BATCH: usize = 32;
const LR: f32 = 0.05;

#[derive(Serialize, Deserialize)]
struct Model {
    w: Vec<f32>,
    updates: u64,
}

static MODEL: OnceLock<RRef<Model>> = OnceLock::new();

fn truth(i: usize) -> f32 {
    (i as f32 * 0.37).sin()
}

/// A batch of `x` with `y = truth · x`, from a small xorshift generator.
fn batch(seed: &mut u64) -> Vec<(Vec<f32>, f32)> {
    (0..BATCH)
        .map(|_| {
            let x: Vec<f32> = (0..DIM)
                .map(|_| {
                    *seed ^= *seed << 13;
                    *seed ^= *seed >> 7;
                    *seed ^= *seed << 17;
                    (*seed % 2000) as f32 / 1000.0 - 1.0
                })
                .collect();
            let y = x.iter().enumerate().map(|(i, v)| v * truth(i)).sum();
            (x, y)
        })
        .collect()
}

fn loss(w: &[f32], data: &[(Vec<f32>, f32)]) -> f32 {
    data.iter()
        .map(|(x, y)| {
            let p: f32 = x.iter().zip(w).map(|(a, b)| a * b).sum();
            (p - y) * (p - y)
        })
        .sum::<f32>()
        / data.len() as f32
}

fn grad(w: &[f32], data: &[(Vec<f32>, f32)]) -> Vec<f32> {
    let mut g = vec![0.0; DIM];
    for (x, y) in data {
        let p: f32 = x.iter().zip(w).map(|(a, b)| a * b).sum();
        for (gi, xi) in g.iter_mut().zip(x) {
            *gi += 2.0 * (p - y) * xi / data.len() as f32;
        }
    }
    g
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let rank: u32 = std::env::var("RANK")?.parse()?;
    let world: u32 = std::env::var("WORLD_SIZE")?.parse()?;
    let opts = RpcBackendOptions::default();
    // The server hands out its model's RRef (a fork from its owner).
    opts.functions
        .register_async("model", |_rpc, (): ()| async {
            loop {
                if let Some(m) = MODEL.get() {
                    return Ok::<RRef<Model>, String>(m.clone());
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })?;
    opts.functions
        .register_method("weights", |m: &mut Model, (): ()| {
            Ok::<Vec<f32>, String>(m.w.clone())
        })?;
    opts.functions
        .register_method("apply", |m: &mut Model, g: Vec<f32>| {
            if g.len() != m.w.len() {
                return Err(format!(
                    "gradient of {} for a model of {}",
                    g.len(),
                    m.w.len()
                ));
            }
            for (w, g) in m.w.iter_mut().zip(&g) {
                *w -= LR * g;
            }
            m.updates += 1;
            Ok(m.updates)
        })?;
    let name = if rank == 0 {
        "ps".to_owned()
    } else {
        format!("trainer{rank}")
    };
    let rpc = init_rpc(&name, None, None, Some(world), Some(opts)).await?;

    if rank == 0 {
        let model = rpc.rref(Model {
            w: vec![0.0; DIM],
            updates: 0,
        });
        let _ = MODEL.set(model.clone());
        // Wait for the trainers (shutdown's barrier), then judge the model.
        rpc.shutdown(true, None).await?;
        let (w, updates) = model.with_local_value(|m| (m.w.clone(), m.updates)).await?;
        let l = loss(&w, &batch(&mut 12345));
        println!(
            "ps: {updates} updates from {} trainers; loss on fresh data {l:.5}",
            world - 1
        );
        if l > 0.05 {
            return Err(format!("the model did not learn (loss {l})").into());
        }
    } else {
        let model: RRef<Model> = rpc.rpc_sync("ps", "model", &()).await?;
        let mut seed = 0x9e3779b97f4a7c15u64 ^ rank as u64;
        for step in 0..STEPS {
            let w: Vec<f32> = model.call("weights", &()).await?;
            let data = batch(&mut seed);
            let _: u64 = model.call("apply", &grad(&w, &data)).await?;
            if step % 50 == 0 {
                println!("{name}: step {step} loss {:.5}", loss(&w, &data));
            }
        }
        drop(model);
        rpc.shutdown(true, None).await?;
    }
    Ok(())
}
