//! `rallypoint-bench rendezvous`: N nodes through one round of the dynamic
//! rendezvous (min = max = N); wall time and store operations per node. Both
//! sides run the same way: one process per node (ours: `rallypoint-bench
//! rdzv-node`; PyTorch's c10d `DynamicRendezvousHandler`:
//! `crates/bench/py/rdzv_bench.py`), each with its own connection to the same
//! store server (`rally store serve`, a fresh one per round), operations counted
//! at the same API level. Every process sets up first, then all start on one
//! `go` key; the time runs from `go` to the last node's end.

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
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,128,512")]
    nodes: Vec<usize>,
    /// Largest node count to run PyTorch's handler at (a process per node, each
    /// importing torch: about 300 MB apiece).
    #[arg(long, default_value_t = 32)]
    torch_max: usize,
    /// How long set-up or a round may take before it is reported as not finished.
    #[arg(long, default_value_t = 240)]
    torch_limit_secs: u64,
    /// Ours only, every node a task of this one process with its own
    /// connection to the store server (the 16,384-node figure: that
    /// many processes do not fit on one machine).
    #[arg(long)]
    in_process: bool,
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

/// The protocol every node process follows, ours and PyTorch's alike: connect,
/// build the handler, count itself in at `bench/ready`, wait for `bench/go`, run
/// one round, print `RESULT <unix time at the end> <store ops>` on stderr.
const READY: &str = "bench/ready";
const GO: &str = "bench/go";

/// Node `index` of a round of `n` over `inner`, its store operations counted
/// in `ops`. The keep-alive is slow, so the round is all that is counted.
fn bench_node(
    inner: TcpStore,
    ops: &Arc<AtomicU64>,
    run: &str,
    index: usize,
    n: usize,
    port: u16,
) -> DynamicRendezvous {
    DynamicRendezvous::new(
        Arc::new(Counting {
            inner,
            ops: ops.clone(),
        }),
        run,
        format!("node{index}"),
        Bounds { min: n, max: n },
        Timing {
            join: Duration::from_secs(900),
            keep_alive: Duration::from_secs(600),
            ..Timing::default()
        },
        BootstrapStoreInfo {
            master_addr: "127.0.0.1".into(),
            master_port: port,
        },
    )
}

/// One of our nodes, in its own process (`rallypoint-bench rdzv-node`).
pub fn node(port: u16, run: &str, n: usize, index: usize) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let control = TcpStore::builder("127.0.0.1", port)
            .timeout(Duration::from_secs(900))
            .connect()
            .await?;
        let ops = Arc::new(AtomicU64::new(0));
        let inner = TcpStore::builder("127.0.0.1", port)
            .timeout(Duration::from_secs(900))
            .connect()
            .await?;
        let handler = bench_node(inner, &ops, run, index, n, port);
        control.add(READY, 1).await?;
        control.wait(&[GO]).await?;
        let rank = handler.next_rendezvous().await?.rank;
        let end = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_secs_f64();
        // Heartbeats begin as the round completes; count only the round itself.
        let ops = ops.load(Ordering::Relaxed);
        eprintln!("RESULT {end:.6} {ops} {rank}");
        anyhow::Ok(())
    })
}

/// One round of `n` node processes (ours or PyTorch's) against the store server
/// at `port`: seconds from `go` to the last node done, store ops per node.
fn round(
    side: &str,
    port: u16,
    n: usize,
    run: &str,
    limit: Duration,
) -> Result<Option<(f64, f64)>> {
    let mut children = Vec::with_capacity(n);
    for i in 0..n {
        let mut c = match side {
            "rally" => {
                let mut c = Command::new(std::env::current_exe()?);
                c.arg("rdzv-node");
                c
            }
            _ => {
                let mut c = Command::new(crate::fixtures::python());
                c.arg(crate::fixtures::repo_root().join("crates/bench/py/rdzv_bench.py"));
                c
            }
        };
        c.args([
            port.to_string(),
            run.to_owned(),
            n.to_string(),
            i.to_string(),
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
        children.push(
            c.spawn()
                .with_context(|| format!("starting {side} node {i}"))?,
        );
    }
    // Drain every stderr on its own thread so no child blocks on a full pipe.
    let readers: Vec<_> = children
        .iter_mut()
        .map(|c| {
            let mut err = c.stderr.take().expect("piped");
            std::thread::spawn(move || {
                let mut s = String::new();
                let _ = std::io::Read::read_to_string(&mut err, &mut s);
                s
            })
        })
        .collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let control = rt.block_on(
        TcpStore::builder("127.0.0.1", port)
            .timeout(Duration::from_secs(900))
            .connect(),
    )?;
    let t0 = Instant::now();
    let kill_all = |children: &mut Vec<std::process::Child>| {
        for c in children.iter_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    };
    // Every process set up (PyTorch's import torch takes seconds): then go.
    loop {
        if rt.block_on(control.add(READY, 0))? as usize >= n {
            break;
        }
        if let Some(i) = children
            .iter_mut()
            .position(|c| matches!(c.try_wait(), Ok(Some(_))))
        {
            kill_all(&mut children);
            bail!("{side} node {i} exited before the round");
        }
        if t0.elapsed() > limit {
            kill_all(&mut children);
            bail!("{side} nodes not ready after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let go = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs_f64();
    rt.block_on(control.set(GO, b"1"))?;
    let t1 = Instant::now();
    for c in &mut children {
        loop {
            if c.try_wait()?.is_some() {
                break;
            }
            if t1.elapsed() > limit {
                kill_all(&mut children);
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    let (mut last, mut ops, mut ranks) = (go, 0.0, Vec::with_capacity(n));
    for (i, r) in readers.into_iter().enumerate() {
        let err = r.join().unwrap_or_default();
        let line = err
            .lines()
            .find_map(|l| l.strip_prefix("RESULT "))
            .with_context(|| format!("{side} node {i} reported nothing: {err}"))?;
        let f: Vec<f64> = line
            .split_whitespace()
            .map(|x| x.parse())
            .collect::<Result<_, _>>()?;
        anyhow::ensure!(f.len() == 3, "{side} node {i}: {line}");
        last = last.max(f[0]);
        ops += f[1];
        ranks.push(f[2] as usize);
    }
    ranks.sort_unstable();
    anyhow::ensure!(
        ranks == (0..n).collect::<Vec<_>>(),
        "{side}: ranks are not a permutation"
    );
    Ok(Some((last - go, ops / n as f64)))
}

/// When each step's key appeared: (key, seconds from `go`).
type Marks = Vec<(&'static str, f64)>;

/// One round of `n` nodes, each a task of this process with its own
/// connection to the store server at `port`: seconds from `go` to the last
/// node done, store ops per node, and when the round reached each step
/// (`min`, `complete`, `assigned`: seconds from `go`).
fn in_process(port: u16, n: usize, run: &str) -> Result<(f64, f64, Marks)> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let ops = Arc::new(AtomicU64::new(0));
        // Connected in batches: the listen backlog (somaxconn) is finite.
        let mut stores = Vec::with_capacity(n);
        while stores.len() < n {
            let mut batch = tokio::task::JoinSet::new();
            for _ in 0..(n - stores.len()).min(256) {
                batch.spawn(
                    TcpStore::builder("127.0.0.1", port)
                        .timeout(Duration::from_secs(900))
                        .connect(),
                );
            }
            while let Some(c) = batch.join_next().await {
                stores.push(c??);
            }
        }
        let handlers: Vec<Arc<DynamicRendezvous>> = stores
            .into_iter()
            .enumerate()
            .map(|(i, inner)| Arc::new(bench_node(inner, &ops, run, i, n, port)))
            .collect();
        let (go, _) = tokio::sync::watch::channel(false);
        let tasks: Vec<_> = handlers
            .iter()
            .map(|h| {
                let h = h.clone();
                let mut go = go.subscribe();
                let ops = ops.clone();
                tokio::spawn(async move {
                    go.wait_for(|g| *g).await?;
                    let info = h.next_rendezvous().await?;
                    // Heartbeats begin as the round completes: count only the
                    // round itself.
                    let counted = ops.load(Ordering::Relaxed);
                    anyhow::Ok((Instant::now(), info.rank, counted))
                })
            })
            .collect();
        let t0 = Instant::now();
        // An observer on its own connection (not counted): when each step's
        // key appears.
        let probe = TcpStore::builder("127.0.0.1", port)
            .timeout(Duration::from_secs(900))
            .connect()
            .await?;
        let run_id = run.to_owned();
        let marks = tokio::spawn(async move {
            let mut seen = Vec::new();
            for k in ["min", "complete", "assigned"] {
                let key = format!("rally.rendezvous.{run_id}/r0/{k}");
                if probe.wait(&[&key]).await.is_ok() {
                    seen.push((k, t0.elapsed().as_secs_f64()));
                }
            }
            seen
        });
        go.send_replace(true);
        let mut ranks = Vec::with_capacity(n);
        let mut last = t0;
        for t in tasks {
            let (end, rank, _) = t.await??;
            last = last.max(end);
            ranks.push(rank);
        }
        let took = (last - t0).as_secs_f64();
        let marks = marks.await?;
        let per_node = ops.load(Ordering::Relaxed) as f64 / n as f64;
        ranks.sort_unstable();
        anyhow::ensure!(
            ranks == (0..n).collect::<Vec<_>>(),
            "ranks are not a permutation"
        );
        drop(handlers);
        Ok((took, per_node, marks))
    })
}

pub fn run(args: RendezvousArgs) -> Result<()> {
    if args.in_process {
        println!("# dynamic rendezvous: one round, min = max = N, every node a task of one");
        println!("# process with its own connection to `rally store serve` (fresh per round)");
        println!("{:>6}  {:>12} {:>10}", "nodes", "rally (ms)", "ops/node");
        for &n in &args.nodes {
            let server = crate::targets::start("rally", Some(1))?;
            let (took, ops, marks) = in_process(server.addr.port(), n, "bench-scale")?;
            drop(server);
            let marks: Vec<String> = marks
                .iter()
                .map(|(k, t)| format!("{k} {:.0}", t * 1e3))
                .collect();
            println!(
                "{n:>6}  {:>12.1} {ops:>10.1}   (ms from go: {})",
                took * 1e3,
                marks.join(", ")
            );
        }
        return Ok(());
    }
    println!("# dynamic rendezvous: one round, min = max = N, one process and one store");
    println!("# connection per node, ours and PyTorch's c10d handler against the same");
    println!("# `rally store serve` (a fresh one per round); time from go to the last node");
    println!(
        "{:>6}  {:>12} {:>10}  {:>12} {:>10}  {:>8}",
        "nodes", "rally (ms)", "ops/node", "torch (ms)", "ops/node", "speedup"
    );
    let limit = Duration::from_secs(args.torch_limit_secs);
    for &n in &args.nodes {
        let server = crate::targets::start("rally", Some(1))?;
        let port = server.addr.port();
        let (took, ops) = round("rally", port, n, "bench-rally", limit)?
            .with_context(|| format!("our round of {n} did not finish in {limit:?}"))?;
        drop(server);
        let theirs = if n <= args.torch_max {
            let server = crate::targets::start("rally", Some(1))?;
            let r = round("torch", server.addr.port(), n, "bench-torch", limit)?;
            drop(server);
            Some(r)
        } else {
            None
        };
        // Only measured ratios: a round that did not finish has no ratio.
        let (t_ms, t_ops, speed) = match theirs {
            Some(Some((t, o))) => (
                format!("{:.1}", t * 1e3),
                format!("{o:.1}"),
                format!("{:.1}x", t / took),
            ),
            Some(None) => (
                format!("unfinished in {}s", limit.as_secs()),
                "-".into(),
                "-".into(),
            ),
            None => ("-".into(), "-".into(), "-".into()),
        };
        println!(
            "{n:>6}  {:>12.1} {ops:>10.1}  {t_ms:>12} {t_ops:>10}  {speed:>8}",
            took * 1e3
        );
    }
    Ok(())
}
