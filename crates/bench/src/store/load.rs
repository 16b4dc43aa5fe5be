//! The measurements under load, each against a fresh server process:
//! throughput (K connections each looping SET, GET, ADD, WAIT on a present
//! key; ops/s, per-request latency percentiles and the server's CPU per
//! operation), the connection storm (N clients connect, VALIDATE, PING,
//! `ADD init/`, then pass a store barrier) and memory (the server's RSS
//! growth per idle connection). Storm and memory also run at `--small` for
//! every server, for a like-for-like ratio with servers too slow for the
//! full counts.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use rallypoint_store::protocol::{Reply, ReplyKind, Request};
use tokio::runtime::Runtime;

use super::args::StoreArgs;
use super::conn::Conn;
use super::figures::{percentile, Figures};
use crate::targets::{cpu_time, rss_kib, start, Target};

/// Throughput of every server, and its CPU per operation.
pub(super) fn measure_throughput(
    args: &StoreArgs,
    rt: &Runtime,
    figures: &mut Figures,
) -> Result<()> {
    for name in &args.servers {
        let t = start(name, args.rally_threads)?;
        let cpu0 = cpu_time(t.child.id())?;
        let r = rt.block_on(throughput(t.addr, args.connections, args.seconds))?;
        let cpu = cpu_time(t.child.id())?.saturating_sub(cpu0);
        let cpu_per_op = cpu.as_secs_f64() * 1e9 / (r.ops_per_s * args.seconds);
        figures.record(
            &format!("throughput {} conns (ops/s)", args.connections),
            &t.name,
            r.ops_per_s,
            &format!("p50 {:.1}us p99 {:.1}us", r.p50_us, r.p99_us),
        );
        figures.record(
            "server cpu per op (ns)",
            &t.name,
            cpu_per_op,
            &format!(
                "server used {:.0}% of one core",
                cpu.as_secs_f64() * 100.0 / args.seconds
            ),
        );
    }
    Ok(())
}

/// The connection storm against every server: ours at `--small` and
/// `--storm` clients, the others at `--small`.
pub(super) fn measure_storm(args: &StoreArgs, rt: &Runtime, figures: &mut Figures) -> Result<()> {
    for name in &args.servers {
        for n in sizes(name, args.small, args.storm) {
            let t = start(name, args.rally_threads)?;
            let cpu0 = cpu_time(t.child.id())?;
            let took = rt.block_on(storm(t.addr, n, "storm"))?;
            let cpu = cpu_time(t.child.id())?.saturating_sub(cpu0);
            figures.record(
                &format!("storm {n} clients (ms)"),
                &t.name,
                took.as_secs_f64() * 1000.0,
                &format!("connect+validate+ping+init+barrier; server cpu {cpu:?}"),
            );
        }
    }
    Ok(())
}

/// Memory per idle connection of every server: ours over `--small` and
/// `--idle` connections, the others over `--small`.
pub(super) fn measure_memory(args: &StoreArgs, rt: &Runtime, figures: &mut Figures) -> Result<()> {
    for name in &args.servers {
        for m in sizes(name, args.small, args.idle) {
            let t = start(name, args.rally_threads)?;
            let bytes = rt.block_on(memory_per_conn(&t, m))?;
            figures.record(
                &format!("memory per idle conn (bytes, {m})"),
                &t.name,
                bytes,
                "RSS growth / connections",
            );
        }
    }
    Ok(())
}

/// The counts a server is measured at: ours also at the full count.
fn sizes(name: &str, small: usize, full: usize) -> Vec<usize> {
    if name == "rally" {
        vec![small, full]
    } else {
        vec![small]
    }
}

struct Throughput {
    ops_per_s: f64,
    p50_us: f64,
    p99_us: f64,
}

/// K connections, each looping SET k, GET k, ADD c, WAIT [k] for `seconds`.
async fn throughput(addr: SocketAddr, k: usize, seconds: f64) -> Result<Throughput> {
    let mut conns = Vec::with_capacity(k);
    for _ in 0..k {
        conns.push(Conn::open(addr).await?);
    }
    let start = Arc::new(tokio::sync::Barrier::new(k + 1));
    let deadline = Arc::new(std::sync::OnceLock::<Instant>::new());
    let mut tasks = Vec::new();
    for (i, mut c) in conns.into_iter().enumerate() {
        let (start, deadline) = (start.clone(), deadline.clone());
        tasks.push(tokio::spawn(async move {
            let key = format!("/bench/{i}");
            let value = vec![b'x'; 32];
            let mut lat: Vec<u32> = Vec::with_capacity(1 << 16);
            let mut ops = 0u64;
            start.wait().await;
            let end = *deadline.get().expect("deadline set before release");
            while Instant::now() < end {
                c.send(&Request::Set {
                    key: key.as_bytes(),
                    value: &value,
                })
                .await?;
                let t = Instant::now();
                c.call(
                    &Request::Get {
                        key: key.as_bytes(),
                    },
                    ReplyKind::Str,
                )
                .await?;
                lat.push(t.elapsed().as_nanos() as u32);
                let t = Instant::now();
                c.call(
                    &Request::Add {
                        key: b"/bench/counter",
                        delta: 1,
                    },
                    ReplyKind::Int,
                )
                .await?;
                lat.push(t.elapsed().as_nanos() as u32);
                let t = Instant::now();
                c.call(
                    &Request::Wait {
                        keys: vec![key.as_bytes()],
                    },
                    ReplyKind::Byte,
                )
                .await?;
                lat.push(t.elapsed().as_nanos() as u32);
                ops += 4;
            }
            anyhow::Ok((ops, lat))
        }));
    }
    let t0 = Instant::now();
    deadline
        .set(t0 + Duration::from_secs_f64(seconds))
        .expect("set once");
    start.wait().await;
    let mut ops = 0;
    let mut lat = Vec::new();
    for t in tasks {
        let (o, l) = t.await??;
        ops += o;
        lat.extend(l);
    }
    let elapsed = t0.elapsed().as_secs_f64();
    lat.sort_unstable();
    Ok(Throughput {
        ops_per_s: ops as f64 / elapsed,
        p50_us: percentile(&lat, 0.5),
        p99_us: percentile(&lat, 0.99),
    })
}

/// N clients: connect, VALIDATE, PING, ADD init/, then a store barrier.
async fn storm(addr: SocketAddr, n: usize, prefix: &str) -> Result<Duration> {
    // Bound connects in flight so the listen backlog never overflows into SYN
    // retransmits (which would measure the kernel's 1 s retry timer, not the server).
    let gate = Arc::new(tokio::sync::Semaphore::new(1024));
    let t0 = Instant::now();
    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        let gate = gate.clone();
        let prefix = prefix.to_owned();
        let source = 2 + (i % 250) as u8;
        tasks.push(tokio::spawn(async move {
            let permit = gate.acquire_owned().await?;
            let mut c = Conn::open_from(addr, Some(source)).await?;
            c.call(
                &Request::Add {
                    key: b"init/",
                    delta: 1,
                },
                ReplyKind::Int,
            )
            .await?;
            drop(permit);
            let members = format!("/{prefix}/num_members");
            let last = format!("/{prefix}/last_member");
            let Reply::Int(arrived) = c
                .call(
                    &Request::Add {
                        key: members.as_bytes(),
                        delta: 1,
                    },
                    ReplyKind::Int,
                )
                .await?
            else {
                bail!("bad ADD reply")
            };
            if arrived as usize == n {
                c.send(&Request::Set {
                    key: last.as_bytes(),
                    value: b"1",
                })
                .await?;
            }
            c.call(
                &Request::Wait {
                    keys: vec![last.as_bytes()],
                },
                ReplyKind::Byte,
            )
            .await?;
            anyhow::Ok(c)
        }));
    }
    let mut conns = Vec::with_capacity(n);
    for t in tasks {
        conns.push(t.await??);
    }
    let took = t0.elapsed();
    drop(conns);
    Ok(took)
}

/// Server RSS growth per idle (validated, pinged) connection, in bytes.
async fn memory_per_conn(target: &Target, m: usize) -> Result<f64> {
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = rss_kib(target.child.id())?;
    let mut conns = Vec::with_capacity(m);
    for i in 0..m {
        conns.push(Conn::open_from(target.addr, Some(2 + (i % 250) as u8)).await?);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = rss_kib(target.child.id())?;
    drop(conns);
    Ok((after.saturating_sub(before) * 1024) as f64 / m as f64)
}
