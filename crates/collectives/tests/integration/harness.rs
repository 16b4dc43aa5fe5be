//! Forms in-process groups and runs one task per rank.

use std::future::Future;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

use rallypoint_collectives::{Element, Options, ProcessGroup};
use rallypoint_store::{MemoryStore, Store};

pub fn opts() -> Options {
    Options {
        advertise: Some(IpAddr::V4(Ipv4Addr::LOCALHOST)),
        ..Options::default()
    }
}

/// `n` ranks of one group on a fresh memory store.
pub async fn group(n: usize, opts: Options) -> Vec<ProcessGroup> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    group_on(store, n, opts).await
}

pub async fn group_on(store: Arc<dyn Store>, n: usize, opts: Options) -> Vec<ProcessGroup> {
    let tasks: Vec<_> = (0..n)
        .map(|r| tokio::spawn(ProcessGroup::new(store.clone(), r, n, opts.clone())))
        .collect();
    let mut out = Vec::with_capacity(n);
    for t in tasks {
        out.push(t.await.expect("task").expect("group set-up"));
    }
    out
}

/// `n` ranks of one group on a fresh memory store, rank `r` with `opts(r)`
/// (the seeded simulator's, which needs feature `faults`).
#[cfg(feature = "faults")]
pub async fn group_each(n: usize, opts: impl Fn(usize) -> Options) -> Vec<ProcessGroup> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let tasks: Vec<_> = (0..n)
        .map(|r| tokio::spawn(ProcessGroup::new(store.clone(), r, n, opts(r))))
        .collect();
    let mut out = Vec::with_capacity(n);
    for t in tasks {
        out.push(t.await.expect("task").expect("group set-up"));
    }
    out
}

/// Runs `f` on every rank concurrently; results in rank order.
pub async fn each<F, Fut, R>(groups: &[ProcessGroup], f: F) -> Vec<R>
where
    F: Fn(ProcessGroup) -> Fut,
    Fut: Future<Output = R> + Send + 'static,
    R: Send + 'static,
{
    let tasks: Vec<_> = groups.iter().map(|g| tokio::spawn(f(g.clone()))).collect();
    let mut out = Vec::with_capacity(tasks.len());
    for t in tasks {
        out.push(t.await.expect("rank task panicked"));
    }
    out
}

/// Deterministic small values in -2..=2 (exact in every float type, so the
/// order of reduction cannot change a result).
pub fn data<T: Element>(seed: u64, rank: usize, len: usize) -> Vec<T> {
    let mut rng =
        fastrand::Rng::with_seed(seed ^ (rank as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    (0..len).map(|_| T::from_i8(rng.i8(-2..=2))).collect()
}
