//! What the job secret costs a group, against the same group without it, in
//! the same run: `cargo run --release -p rallypoint-collectives --example
//! secret_cost [ranks] [rounds]`.
//!
//! Every rank is a task of this process over loopback TCP (shared memory
//! off), on a fresh memory store per group. Each round forms a group with
//! and one without the secret, in alternation, so drift of the machine shows
//! in both alike, and measures:
//!
//! - set-up: forming the group and its first barrier, which opens the
//!   connections (each with the job-secret handshake, or not);
//! - steady state: all_reduce of 4 KiB (latency) and of 16 MiB (bandwidth)
//!   on the connections already open.
//!
//! The median of the rounds is printed per figure.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rallypoint_collectives::{JobSecret, Options, ProcessGroup, ReduceOp};
use rallypoint_store::{MemoryStore, Store};

/// One round's figures for one side.
#[derive(Default, Clone, Copy)]
struct Figures {
    setup: Duration,
    connections: u64,
    small: Duration,
    large: Duration,
}

async fn form(n: usize, secret: Option<JobSecret>) -> Vec<ProcessGroup> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let opts = Options {
        advertise: Some(std::net::Ipv4Addr::LOCALHOST.into()),
        shared_memory: false,
        secret: Ok(secret),
        ..Options::default()
    };
    let tasks: Vec<_> = (0..n)
        .map(|r| tokio::spawn(ProcessGroup::new(store.clone(), r, n, opts.clone())))
        .collect();
    let mut pgs = Vec::with_capacity(n);
    for t in tasks {
        pgs.push(t.await.expect("a rank's task").expect("forming the group"));
    }
    pgs
}

/// Runs `iters` all-reduces of `len` floats on every rank; the time per op.
async fn all_reduce(pgs: &[ProcessGroup], len: usize, iters: u32) -> Duration {
    let start = Instant::now();
    let tasks: Vec<_> = pgs
        .iter()
        .cloned()
        .map(|pg| {
            tokio::spawn(async move {
                let mut v = vec![1.0f32; len];
                for _ in 0..iters {
                    pg.all_reduce(&mut v, ReduceOp::Sum)
                        .await
                        .expect("all_reduce");
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("a rank's task");
    }
    start.elapsed() / iters
}

async fn round(n: usize, secret: Option<JobSecret>) -> Figures {
    let start = Instant::now();
    let pgs = form(n, secret).await;
    let tasks: Vec<_> = pgs
        .iter()
        .cloned()
        .map(|pg| tokio::spawn(async move { pg.barrier().await.expect("barrier") }))
        .collect();
    for t in tasks {
        t.await.expect("a rank's task");
    }
    let setup = start.elapsed();
    let small = all_reduce(&pgs, 1024, 500).await;
    let large = all_reduce(&pgs, 4 << 20, 5).await;
    Figures {
        setup,
        connections: pgs.iter().map(ProcessGroup::handshakes).sum(),
        small,
        large,
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let n: usize = args
        .next()
        .map_or(4, |a| a.parse().expect("ranks: a number"));
    let rounds: usize = args
        .next()
        .map_or(7, |a| a.parse().expect("rounds: a number"));
    let secret = JobSecret::from_bytes(b"a job secret for the benchmark, 32 b".to_vec())
        .expect("a valid secret");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let (mut with, mut without) = (Vec::new(), Vec::new());
    rt.block_on(async {
        for _ in 0..rounds {
            with.push(round(n, Some(secret.clone())).await);
            without.push(round(n, None).await);
        }
    });
    println!("{n} ranks over loopback TCP, median of {rounds} rounds (in alternation)");
    println!("{:<34} {:>12} {:>12}", "", "no secret", "job secret");
    let row = |name: &str, f: fn(&Figures) -> Duration| {
        let a = median(without.iter().map(f).collect());
        let b = median(with.iter().map(f).collect());
        println!("{name:<34} {:>9.1} µs {:>9.1} µs", micros(a), micros(b));
    };
    println!(
        "{:<34} {:>12} {:>12}",
        "connection ends (opened + accepted)", without[0].connections, with[0].connections
    );
    row("set-up: form + first barrier", |f| f.setup);
    row("all_reduce 4 KiB, per op", |f| f.small);
    row("all_reduce 16 MiB, per op", |f| f.large);
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}
