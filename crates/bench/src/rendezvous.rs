//! `rallypoint-bench rendezvous`: N nodes through one round of the dynamic
//! rendezvous (min = max = N), each node with its own TCP connection to one store
//! server process; wall time and store operations per node. PyTorch's c10d
//! `DynamicRendezvousHandler` runs the same round in the same run
//! (`crates/bench/py/rdzv_bench.py`: one thread and one TCPStore client per node,
//! operations counted at the same API level).

use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rallypoint_rendezvous::api::{BootstrapStoreInfo, RendezvousHandler};
use rallypoint_rendezvous::dynamic::state::Bounds;
use rallypoint_rendezvous::dynamic::{DynamicRendezvous, Timing};
use rallypoint_store::{Result as StoreResult, Store, TcpStore};

#[derive(clap::Args, Clone)]
pub struct RendezvousArgs {
    /// Node counts to run.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,128,1024,4096")]
    nodes: Vec<usize>,
    /// Largest node count to run PyTorch's handler at (threads in one process,
    /// about a second of polling per round).
    #[arg(long, default_value_t = 128)]
    torch_max: usize,
    /// How long PyTorch's round may take before it is reported as not finished.
    #[arg(long, default_value_t = 240)]
    torch_limit_secs: u64,
}

/// Counts a node's store operations.
struct Counting {
    inner: TcpStore,
    ops: Arc<AtomicU64>,
}

impl Counting {
    fn tick(&self) {
        self.ops.fetch_add(1, Ordering::Relaxed);
    }
}

#[async_trait::async_trait]
impl Store for Counting {
    async fn set(&self, k: &str, v: &[u8]) -> StoreResult<()> {
        self.tick();
        self.inner.set(k, v).await
    }
    async fn get_now(&self, k: &str) -> StoreResult<Vec<u8>> {
        self.tick();
        self.inner.get_now(k).await
    }
    async fn add(&self, k: &str, d: i64) -> StoreResult<i64> {
        self.tick();
        self.inner.add(k, d).await
    }
    async fn compare_set(&self, k: &str, e: &[u8], d: &[u8]) -> StoreResult<Vec<u8>> {
        self.tick();
        self.inner.compare_set(k, e, d).await
    }
    async fn wait_timeout(&self, k: &[&str], t: Duration) -> StoreResult<()> {
        self.tick();
        self.inner.wait_timeout(k, t).await
    }
    async fn check(&self, k: &[&str]) -> StoreResult<bool> {
        self.tick();
        self.inner.check(k).await
    }
    async fn delete_key(&self, k: &str) -> StoreResult<bool> {
        self.tick();
        self.inner.delete_key(k).await
    }
    async fn num_keys(&self) -> StoreResult<i64> {
        self.tick();
        self.inner.num_keys().await
    }
    async fn multi_get(&self, k: &[&str]) -> StoreResult<Vec<Vec<u8>>> {
        self.tick();
        self.inner.multi_get(k).await
    }
    async fn multi_set(&self, p: &[(&str, &[u8])]) -> StoreResult<()> {
        self.tick();
        self.inner.multi_set(p).await
    }
    async fn append(&self, k: &str, v: &[u8]) -> StoreResult<()> {
        self.tick();
        self.inner.append(k, v).await
    }
    async fn list_keys(&self) -> StoreResult<Vec<String>> {
        self.tick();
        self.inner.list_keys().await
    }
    async fn queue_push(&self, k: &str, v: &[u8]) -> StoreResult<()> {
        self.tick();
        self.inner.queue_push(k, v).await
    }
    async fn queue_pop(&self, k: &str, b: bool) -> StoreResult<Vec<u8>> {
        self.tick();
        self.inner.queue_pop(k, b).await
    }
    async fn queue_len(&self, k: &str) -> StoreResult<i64> {
        self.tick();
        self.inner.queue_len(k).await
    }
    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }
    fn set_timeout(&self, t: Duration) {
        self.inner.set_timeout(t)
    }
}

/// One round of `n` of our nodes against the server at `port`.
async fn ours(port: u16, n: usize, run: &str) -> Result<(Duration, f64)> {
    let ops = Arc::new(AtomicU64::new(0));
    let mut nodes = Vec::with_capacity(n);
    for i in 0..n {
        let inner = TcpStore::builder("127.0.0.1", port)
            .timeout(Duration::from_secs(600))
            .connect()
            .await?;
        let store = Counting {
            inner,
            ops: ops.clone(),
        };
        nodes.push(Arc::new(DynamicRendezvous::new(
            Arc::new(store),
            run,
            format!("node{i}"),
            Bounds { min: n, max: n },
            Timing {
                join: Duration::from_secs(600),
                keep_alive: Duration::from_secs(60),
                ..Timing::default()
            },
            BootstrapStoreInfo {
                master_addr: "127.0.0.1".into(),
                master_port: port,
            },
        )));
    }
    ops.store(0, Ordering::Relaxed);
    let t0 = Instant::now();
    let tasks: Vec<_> = nodes
        .iter()
        .map(|h| {
            let h = h.clone();
            tokio::spawn(async move { h.next_rendezvous().await })
        })
        .collect();
    let mut ranks = Vec::with_capacity(n);
    for t in tasks {
        ranks.push(t.await??.rank);
    }
    let took = t0.elapsed();
    // Heartbeats began as each node finished; count only the round itself.
    let per_node = ops.load(Ordering::Relaxed) as f64 / n as f64;
    ranks.sort_unstable();
    anyhow::ensure!(
        ranks == (0..n).collect::<Vec<_>>(),
        "ranks are not a permutation"
    );
    Ok((took, per_node))
}

/// Runs PyTorch's side, for at most `limit`. `Ok(None)` if it did not finish.
fn torch(n: usize, limit: Duration) -> Result<Option<(f64, f64)>> {
    let mut child = Command::new(crate::python())
        .arg(crate::repo_root().join("crates/bench/py/rdzv_bench.py"))
        .arg(n.to_string())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("running PyTorch's side")?;
    // Drain stderr on a thread so a chatty child never blocks on a full pipe.
    let mut stderr = child.stderr.take().context("stderr")?;
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut s);
        s
    });
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait()? {
            break Some(st);
        }
        if t0.elapsed() > limit {
            child.kill()?;
            child.wait()?;
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let err = reader.join().unwrap_or_default();
    let Some(status) = status else {
        return Ok(None);
    };
    if !status.success() {
        bail!(
            "PyTorch's rendezvous failed: {}",
            err.lines()
                .filter(|l| !l.starts_with("[W"))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
    let line = err
        .lines()
        .find_map(|l| l.strip_prefix("RESULT "))
        .context("no RESULT line")?;
    let mut it = line.split_whitespace();
    Ok(Some((
        it.next().context("time")?.parse()?,
        it.next().context("ops")?.parse()?,
    )))
}

pub fn run(args: RendezvousArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    println!("# dynamic rendezvous: one round, min = max = N, one store connection per node");
    println!(
        "{:>6}  {:>12} {:>10}  {:>12} {:>10}  {:>8}",
        "nodes", "rally (ms)", "ops/node", "torch (ms)", "ops/node", "speedup"
    );
    for &n in &args.nodes {
        // A fresh server per size, so each round starts from an empty store.
        let server = crate::start("rally", Some(1))?;
        let (took, ops) = rt.block_on(ours(server.addr.port(), n, "bench"))?;
        drop(server);
        let (t_ms, t_ops, speed) = if n <= args.torch_max {
            let limit = Duration::from_secs(args.torch_limit_secs);
            match torch(n, limit)? {
                Some((t, o)) => (
                    format!("{:.1}", t * 1e3),
                    format!("{o:.1}"),
                    format!("{:.1}x", t / took.as_secs_f64()),
                ),
                None => (
                    format!(">{}", limit.as_millis()),
                    "-".into(),
                    format!(">{:.0}x", limit.as_secs_f64() / took.as_secs_f64()),
                ),
            }
        } else {
            ("-".into(), "-".into(), "-".into())
        };
        println!(
            "{n:>6}  {:>12.1} {ops:>10.1}  {t_ms:>12} {t_ops:>10}  {speed:>8}",
            took.as_secs_f64() * 1e3
        );
    }
    Ok(())
}
