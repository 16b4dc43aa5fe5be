//! `rallypoint-bench etcd`: N agents' rendezvous through a real etcd (issue
//! 18's figure). The benchmark starts etcd (Debian's `etcd-server`, or
//! `RALLY_ETCD`); every node is a task of this process with its own etcd
//! client (its own connection), built as `--rdzv-backend etcd` builds it (the
//! etcd store, lease keep-alive, worker-hosted job store). One round with
//! min = max = N; the time runs from `go` to the last node's end, and the
//! requests each node sent to etcd are counted (retries included).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use rallypoint_rendezvous::api::{RendezvousHandler, RendezvousParameters};
use rallypoint_rendezvous::dynamic::{DynamicRendezvous, Timing};
use rallypoint_rendezvous::etcd::testing::EtcdServer;
use rallypoint_rendezvous::etcd::{EtcdStore, LeaseKeepalive};

#[derive(clap::Args)]
pub struct EtcdArgs {
    /// Node counts to run.
    #[arg(long, value_delimiter = ',', default_value = "64,256,1024")]
    nodes: Vec<usize>,
}

pub fn run(a: EtcdArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    println!("# etcd rendezvous: one round, min = max = N, every node a task of one");
    println!("# process with its own etcd client; a fresh etcd per round");
    println!(
        "{:>6}  {:>10}  {:>14}  {:>14}",
        "nodes", "time (ms)", "requests/node", "max of a node"
    );
    for &n in &a.nodes {
        let (took, mean, max) = rt.block_on(round(n))?;
        println!("{n:>6}  {:>10.1}  {mean:>14.1}  {max:>14}", took * 1e3);
    }
    Ok(())
}

async fn round(n: usize) -> Result<(f64, f64, u64)> {
    let etcd = EtcdServer::start().await?;
    let mut p = RendezvousParameters::new("etcd", &etcd.endpoint, "bench-etcd", n, n)?;
    p.config.insert("join_timeout".into(), "900".into());
    let timing = Timing::from_params(&p)?;
    let mut stores = Vec::with_capacity(n);
    for _ in 0..n {
        stores.push(etcd.store("/rallypoint/").await?);
    }
    let handlers: Vec<(Arc<DynamicRendezvous>, EtcdStore)> = stores
        .into_iter()
        .enumerate()
        .map(|(i, store)| {
            let mut p = p.clone();
            p.local_addr = Some(format!("node{i}"));
            let h = DynamicRendezvous::worker_hosted(Arc::new(store.clone()), &p, timing)
                .with_backend_name("etcd")
                .with_keepalive(Arc::new(LeaseKeepalive::new(store.clone())));
            (Arc::new(h), store)
        })
        .collect();
    let (go, _) = tokio::sync::watch::channel(false);
    let tasks: Vec<_> = handlers
        .iter()
        .map(|(h, store)| {
            let (h, store) = (h.clone(), store.clone());
            let mut go = go.subscribe();
            tokio::spawn(async move {
                go.wait_for(|g| *g).await?;
                let before = store.rpcs();
                let info = h.next_rendezvous().await?;
                anyhow::Ok((Instant::now(), info.rank, store.rpcs() - before))
            })
        })
        .collect();
    // Let every client's connection settle before the clock starts.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let t0 = Instant::now();
    go.send_replace(true);
    let (mut last, mut total, mut max, mut ranks) = (t0, 0, 0, Vec::with_capacity(n));
    for t in tasks {
        let (end, rank, rpcs) = t.await??;
        last = last.max(end);
        total += rpcs;
        max = max.max(rpcs);
        ranks.push(rank);
    }
    ranks.sort_unstable();
    anyhow::ensure!(
        ranks == (0..n).collect::<Vec<_>>(),
        "ranks are not a permutation"
    );
    drop(handlers);
    Ok(((last - t0).as_secs_f64(), total as f64 / n as f64, max))
}
