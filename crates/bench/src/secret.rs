//! `rallypoint-bench secret`: what the job secret (issue 49) costs the store,
//! measured against the same store without it, in the same run.
//!
//! One store server of ours in this process (its own runtime, one thread) and
//! the client on this thread, so each has a core. Each figure is taken with
//! and without the secret in alternation (`--rounds` times, the median of
//! the rounds reported), so drift of the machine shows in both sides alike:
//!
//! - connect: a client's connect to a usable store (TCP, the job-secret
//!   handshake if any, PyTorch's VALIDATE and PING), one after another;
//! - round trip: one connection's GET of a 32-byte value;
//! - throughput: `--connections` connections looping SET and GET;
//! - through the proxy: what an unchanged PyTorch worker pays under `rally
//!   run --job-secret-file`: our client without the secret through the
//!   loopback proxy to a store with it, against the same client directly
//!   to a store without one; and PyTorch's own `TCPStore` client the same
//!   two ways (`--python`, a torch install), timed inside Python.

use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rallypoint_store::proxy::Proxy;
use rallypoint_store::secret::JobSecret;
use rallypoint_store::server::{Server, ServerConfig, ServerHandle};
use rallypoint_store::{Store, TcpStore};

#[derive(clap::Args, Clone)]
pub struct SecretArgs {
    /// Connects per side and round.
    #[arg(long, default_value_t = 1000)]
    connects: usize,
    /// GET round trips per side and round.
    #[arg(long, default_value_t = 20000)]
    round_trips: usize,
    /// Connections of the throughput test.
    #[arg(long, default_value_t = 16)]
    connections: usize,
    /// Seconds of each throughput measurement.
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
    /// Rounds of each figure (with and without, in alternation).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// A Python with torch, for PyTorch's own client (skipped if not given).
    #[arg(long)]
    python: Option<String>,
}

/// The server side: two stores (with and without the secret) and a proxy to
/// the protected one, on a runtime of their own.
struct Servers {
    _rt: tokio::runtime::Runtime,
    plain: ServerHandle,
    guarded: ServerHandle,
    proxy: Proxy,
}

impl Servers {
    fn start(secret: &JobSecret) -> Result<Servers> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()?;
        let (plain, guarded, proxy) = rt.block_on(async {
            let bind = |secret: Option<JobSecret>| async move {
                let config = ServerConfig {
                    secret,
                    ..ServerConfig::default()
                };
                let s = Server::bind("127.0.0.1:0".parse().unwrap(), config).await?;
                anyhow::Ok(s.spawn())
            };
            let plain = bind(None).await?;
            let guarded = bind(Some(secret.clone())).await?;
            let proxy = Proxy::start(&guarded.local_addr().to_string(), secret.clone()).await?;
            anyhow::Ok((plain, guarded, proxy))
        })?;
        Ok(Servers {
            _rt: rt,
            plain,
            guarded,
            proxy,
        })
    }
}

fn builder(port: u16, secret: Option<&JobSecret>) -> rallypoint_store::TcpStoreBuilder {
    TcpStore::builder("127.0.0.1", port)
        .timeout(Duration::from_secs(30))
        .secret(secret.cloned())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Median and p99 of `n` connects, in microseconds.
async fn connects(port: u16, secret: Option<&JobSecret>, n: usize) -> Result<(f64, f64)> {
    let mut t = Vec::with_capacity(n);
    for _ in 0..n {
        let t0 = Instant::now();
        let s = builder(port, secret).connect().await?;
        t.push(t0.elapsed().as_secs_f64() * 1e6);
        drop(s);
    }
    Ok((percentile(&mut t, 0.5), percentile(&mut t, 0.99)))
}

/// Mean GET round trip in microseconds over `n`.
async fn round_trips(port: u16, secret: Option<&JobSecret>, n: usize) -> Result<f64> {
    let s = builder(port, secret).connect().await?;
    s.set("k", &[7u8; 32]).await?;
    let t0 = Instant::now();
    for _ in 0..n {
        s.get("k").await?;
    }
    Ok(t0.elapsed().as_secs_f64() * 1e6 / n as f64)
}

/// SET+GET pairs per second over `c` connections for `secs`.
async fn throughput(port: u16, secret: Option<&JobSecret>, c: usize, secs: f64) -> Result<f64> {
    let mut stores = Vec::new();
    for _ in 0..c {
        stores.push(std::sync::Arc::new(builder(port, secret).connect().await?));
    }
    let until = Instant::now() + Duration::from_secs_f64(secs);
    let t0 = Instant::now();
    let mut loops = tokio::task::JoinSet::new();
    for (i, s) in stores.into_iter().enumerate() {
        loops.spawn(async move {
            let key = format!("k{i}");
            let mut ops = 0u64;
            while Instant::now() < until {
                s.set(&key, b"v").await?;
                s.get(&key).await?;
                ops += 2;
            }
            anyhow::Ok(ops)
        });
    }
    let mut ops = 0;
    while let Some(r) = loops.join_next().await {
        ops += r??;
    }
    Ok(ops as f64 / t0.elapsed().as_secs_f64())
}

/// PyTorch's client: mean GET round trip (µs) over `n`, and the connect time
/// (µs), at 127.0.0.1:`port`.
fn torch_client(python: &str, port: u16, n: usize) -> Result<(f64, f64)> {
    let code = r#"
import sys, time
from datetime import timedelta
import torch.distributed as dist
port, n = int(sys.argv[1]), int(sys.argv[2])
t0 = time.perf_counter()
s = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=30))
connect = time.perf_counter() - t0
s.set("k", b"x" * 32)
t0 = time.perf_counter()
for _ in range(n):
    s.get("k")
print((time.perf_counter() - t0) / n * 1e6, connect * 1e6)
"#;
    let out = Command::new(python)
        .args(["-c", code, &port.to_string(), &n.to_string()])
        .output()
        .context("running the torch client")?;
    if !out.status.success() {
        bail!("torch client: {}", String::from_utf8_lossy(&out.stderr));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut it = text.split_whitespace().map(str::parse::<f64>);
    match (it.next(), it.next()) {
        (Some(Ok(rt)), Some(Ok(c))) => Ok((rt, c)),
        _ => bail!("torch client printed {text:?}"),
    }
}

fn row(what: &str, without: f64, with: f64, unit: &str) {
    println!(
        "| {what} | {without:.1} {unit} | {with:.1} {unit} | {:.3}x |",
        with / without
    );
}

pub fn run(a: SecretArgs) -> Result<()> {
    let secret = JobSecret::from_bytes(vec![0x5a; 32])?;
    let servers = Servers::start(&secret)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (plain, guarded, proxy) = (
        servers.plain.local_addr().port(),
        servers.guarded.local_addr().port(),
        servers.proxy.local_addr().port(),
    );
    let s = Some(&secret);
    let (mut c50, mut c99, mut rt_, mut tp, mut px) = (
        [vec![], vec![]],
        [vec![], vec![]],
        [vec![], vec![]],
        [vec![], vec![]],
        [vec![], vec![]],
    );
    for round in 0..a.rounds {
        // Odd rounds measure the side with the secret first: an effect of
        // the order shows as a difference between rounds, not as a ratio.
        let order: [usize; 2] = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        rt.block_on(async {
            for &i in &order {
                let (port, secret) = if i == 0 { (plain, None) } else { (guarded, s) };
                let (m, p) = connects(port, secret, a.connects).await?;
                c50[i].push(m);
                c99[i].push(p);
            }
            for &i in &order {
                let (port, secret) = if i == 0 { (plain, None) } else { (guarded, s) };
                rt_[i].push(round_trips(port, secret, a.round_trips).await?);
            }
            for &i in &order {
                let (port, secret) = if i == 0 { (plain, None) } else { (guarded, s) };
                tp[i].push(throughput(port, secret, a.connections, a.seconds).await?);
            }
            for &i in &order {
                let port = if i == 0 { plain } else { proxy };
                px[i].push(round_trips(port, None, a.round_trips).await?);
            }
            anyhow::Ok(())
        })?;
    }
    for (name, v) in [("throughput", &tp), ("round trip", &rt_)] {
        eprintln!("# {name} by round, without / with: {:?} / {:?}", v[0], v[1]);
    }
    println!(
        "# job secret: our store without and with it, same run, median of {} rounds",
        a.rounds
    );
    println!("| measurement | without | with | ratio |");
    println!("|---|---:|---:|---:|");
    let m = |v: &[Vec<f64>; 2], i: usize| median(v[i].clone());
    row("connect, median (our client)", m(&c50, 0), m(&c50, 1), "us");
    row("connect, p99 (our client)", m(&c99, 0), m(&c99, 1), "us");
    row("GET 32 B round trip, mean", m(&rt_, 0), m(&rt_, 1), "us");
    row(
        &format!("throughput, {} connections (ops/s)", a.connections),
        m(&tp, 0),
        m(&tp, 1),
        "",
    );
    row(
        "GET round trip, our client without the secret: direct / through the proxy",
        m(&px, 0),
        m(&px, 1),
        "us",
    );
    if let Some(py) = &a.python {
        let n = (a.round_trips / 4).max(1000);
        let (mut direct, mut via, mut cd, mut cv) = (vec![], vec![], vec![], vec![]);
        for _ in 0..a.rounds {
            let (r, c) = torch_client(py, plain, n)?;
            direct.push(r);
            cd.push(c);
            let (r, c) = torch_client(py, proxy, n)?;
            via.push(r);
            cv.push(c);
        }
        row(
            "PyTorch's TCPStore GET round trip: direct (no secret) / through the proxy (secret)",
            median(direct),
            median(via),
            "us",
        );
        row(
            "PyTorch's TCPStore connect: direct / through the proxy",
            median(cd),
            median(cv),
            "us",
        );
    }
    let refused = servers.guarded.stats().refused;
    if refused.total() != 0 {
        bail!("the protected store refused {refused:?}: the figures are not of admitted clients");
    }
    Ok(())
}
