//! `rallypoint-bench rpc`: our RPC against PyTorch's (TensorPipe), in the same
//! run, each worker in its own process, both sides on one of our store servers
//! (env:// with `TORCHELASTIC_USE_AGENT_STORE=True`: every worker a client).
//!
//! Figures, per side: the round trip of an empty call (worker 0 to worker 1,
//! one at a time), calls per second with 64 in flight (in batches of 64, as
//! `torch.futures.wait_all` does them), a 256 MiB payload sent as an argument
//! (bytes per second; the answer is its length), and `init_rpc` plus graceful
//! shutdown for 2, 8 and 32 workers (from the moment the last worker starts
//! `init_rpc` to the moment the last one returns from shutdown), and how long
//! a call to a stopped worker (SIGSTOP) takes to name it dead under a given
//! heartbeat deadline. The ceilings
//! come from the same run: a raw TCP ping-pong of 64-byte messages between two
//! processes (blocking sockets), and raw one-way TCP bandwidth.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rallypoint_rpc::{init_rpc, Payload, Rpc, RpcBackendOptions};

#[derive(clap::Args, Clone)]
pub struct RpcArgs {
    /// World sizes for the init + shutdown measurement.
    #[arg(long, value_delimiter = ',', default_value = "2,8,32")]
    workers: Vec<usize>,
    /// Sides: rally, torch.
    #[arg(long, value_delimiter = ',', default_value = "rally,torch")]
    sides: Vec<String>,
    /// Sequential round trips timed (calls per second uses 5x as many calls).
    #[arg(long, default_value_t = 2000)]
    rounds: usize,
    /// Payload size in bytes.
    #[arg(long, default_value_t = 256 << 20)]
    payload_bytes: usize,
    /// Repetitions of the whole comparison.
    #[arg(long, default_value_t = 1)]
    repeat: usize,
    /// Heartbeat deadlines (ms) for the partition measurement: worker 1 is
    /// stopped (SIGSTOP) and worker 0 times how long a call with no timeout
    /// takes to name it dead. `--heartbeats none`: skipped.
    #[arg(long, value_delimiter = ',', default_value = "1000,10000")]
    heartbeats: Vec<String>,
}

const WINDOW: usize = 64;

/// Runs `n` workers of `side` in `mode`; returns every worker's RESULT pairs.
fn workers(side: &str, mode: &str, n: usize, args: &RpcArgs) -> Result<Vec<Vec<(String, f64)>>> {
    let server = crate::fixtures::store_server()?;
    let mut children = Vec::new();
    for r in 0..n {
        let mut c = match side {
            "rally" => {
                let mut c = Command::new(std::env::current_exe()?);
                c.args(["rpc-worker", mode]);
                c
            }
            "torch" => {
                let mut c = Command::new(crate::fixtures::python());
                c.arg(crate::fixtures::repo_root().join("crates/bench/py/rpc_bench.py"))
                    .arg(mode);
                c
            }
            other => bail!("unknown side {other}"),
        };
        c.env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", server.port.to_string())
            .env("TORCHELASTIC_USE_AGENT_STORE", "True")
            .env("RANK", r.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("RALLY_BENCH_ROUNDS", args.rounds.to_string())
            .env("RALLY_BENCH_PAYLOAD", args.payload_bytes.to_string())
            .env("OMP_NUM_THREADS", "1")
            .env("PYTHONWARNINGS", "ignore")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        children.push(
            c.spawn()
                .with_context(|| format!("starting {side} worker {r}"))?,
        );
    }
    let mut out = Vec::new();
    for (r, c) in children.into_iter().enumerate() {
        let o = c.wait_with_output()?;
        if !o.status.success() {
            bail!("{side} worker {r} ({mode}) exited with {}", o.status);
        }
        out.push(
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter_map(|l| l.strip_prefix("RESULT "))
                .filter_map(|l| {
                    let (k, v) = l.split_once(' ')?;
                    Some((k.to_owned(), v.trim().parse().ok()?))
                })
                .collect(),
        );
    }
    drop(server.rt);
    Ok(out)
}

fn get(r: &[(String, f64)], k: &str) -> Option<f64> {
    r.iter().find(|(x, _)| x == k).map(|(_, v)| *v)
}

pub fn run(args: RpcArgs) -> Result<()> {
    for rep in 0..args.repeat {
        let rtt = raw_rtt(20_000)?;
        let bw = crate::fixtures::raw_pair(1 << 30, false)?;
        // The ceiling for a round trip beside a transfer on this machine:
        // the raw ping-pong while a raw bulk stream runs between two other
        // processes (they share the same cores).
        let bulk = std::thread::spawn(|| crate::fixtures::raw_pair(8 << 30, false));
        std::thread::sleep(Duration::from_millis(300));
        let rtt_beside_bulk = raw_rtt(2_000)?;
        bulk.join().expect("raw bulk thread")?;
        println!(
            "\n# repetition {}: raw TCP, same run: 64-byte ping-pong round trip {:.1} us; one-way bandwidth {:.2} GB/s",
            rep + 1,
            rtt * 1e6,
            bw / 1e9
        );
        let mut calls = std::collections::BTreeMap::new();
        for side in &args.sides {
            let r = workers(side, "calls", 2, &args)?;
            calls.insert(side.clone(), r[0].clone());
        }
        let (ours, torch) = (calls.get("rally"), calls.get("torch"));
        let f = |s: Option<&Vec<(String, f64)>>, k: &str| s.and_then(|s| get(s, k));
        println!("\n| figure | ours | PyTorch (TensorPipe) | ours vs PyTorch | ours vs raw TCP |");
        println!("|---|---:|---:|---:|---:|");
        let (a, b) = (f(ours, "rtt"), f(torch, "rtt"));
        println!(
            "| empty call round trip | {} | {} | {} faster | {} of raw |",
            a.map_or("-".into(), |v| format!("{:.1} us", v * 1e6)),
            b.map_or("-".into(), |v| format!("{:.1} us", v * 1e6)),
            ratio(b, a),
            a.map_or("-".into(), |v| format!("{:.2}x", v / rtt)),
        );
        if let (Some(l), Some(i)) = (f(ours, "rtt_loaded"), f(ours, "rtt")) {
            let p = |k: &str| f(ours, k).map_or("-".into(), |v| format!("{:.1}", v * 1e6));
            println!(
                "| empty call round trip while {} MiB payloads go to the same worker | {:.1} us ({:.1}x idle; median {} us, p99 {} us, longest {} us) | - | - | raw ping-pong beside a raw bulk stream: {:.1} us ({:.1}x raw idle) |",
                args.payload_bytes >> 20,
                l * 1e6,
                l / i,
                p("rtt_loaded_p50"),
                p("rtt_loaded_p99"),
                p("rtt_loaded_max"),
                rtt_beside_bulk * 1e6,
                rtt_beside_bulk / rtt,
            );
        }
        let (a, b) = (f(ours, "calls_per_s"), f(torch, "calls_per_s"));
        println!(
            "| small calls per second, {WINDOW} in flight | {} | {} | {} | - |",
            a.map_or("-".into(), |v| format!("{v:.0}")),
            b.map_or("-".into(), |v| format!("{v:.0}")),
            ratio(a, b),
        );
        let (a, b) = (
            f(ours, "payload_bytes_per_s"),
            f(torch, "payload_bytes_per_s"),
        );
        println!(
            "| {} MiB payload | {} | {} | {} | {} of raw |",
            args.payload_bytes >> 20,
            a.map_or("-".into(), |v| format!("{:.2} GB/s", v / 1e9)),
            b.map_or("-".into(), |v| format!("{:.2} GB/s", v / 1e9)),
            ratio(a, b),
            a.map_or("-".into(), |v| format!("{:.0}%", v / bw * 100.0)),
        );
        for &n in &args.workers {
            let mut t = std::collections::BTreeMap::new();
            for side in &args.sides {
                let r = workers(side, "init", n, &args)?;
                let start = r.iter().filter_map(|w| get(w, "start")).fold(0.0, f64::max);
                let end = r.iter().filter_map(|w| get(w, "end")).fold(0.0, f64::max);
                t.insert(side.clone(), end - start);
            }
            let (a, b) = (t.get("rally").copied(), t.get("torch").copied());
            println!(
                "| init_rpc + graceful shutdown, {n} workers | {} | {} | {} faster | - |",
                a.map_or("-".into(), |v| format!("{:.3} s", v)),
                b.map_or("-".into(), |v| format!("{:.3} s", v)),
                ratio(b, a),
            );
        }
        for hb in args.heartbeats.iter().filter(|h| *h != "none") {
            let hb: u64 = hb.parse().context("--heartbeats takes milliseconds")?;
            let t = partition(hb)?;
            println!(
                "| a stopped peer (SIGSTOP) named dead, heartbeat {:.0} s | {t:.2} s (deadline + {:.2} s) | not measured (TensorPipe has no heartbeat: the call ends at its timeout) | - | - |",
                hb as f64 / 1e3,
                t - hb as f64 / 1e3,
            );
        }
    }
    Ok(())
}

/// Worker 1 stops itself (SIGSTOP: its sockets stay open, nothing answers);
/// returns how long worker 0's call with no timeout took to fail, naming it
/// dead, under heartbeat deadline `hb_ms`.
fn partition(hb_ms: u64) -> Result<f64> {
    let server = crate::fixtures::store_server()?;
    let mut children = Vec::new();
    for r in 0..2 {
        let mut c = Command::new(std::env::current_exe()?);
        c.args(["rpc-worker", "partition"])
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", server.port.to_string())
            .env("TORCHELASTIC_USE_AGENT_STORE", "True")
            .env("RANK", r.to_string())
            .env("WORLD_SIZE", "2")
            .env("RALLY_BENCH_HEARTBEAT_MS", hb_ms.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        children.push(c.spawn().context("starting a partition worker")?);
    }
    let mut stopped = children.pop().expect("two");
    let o = children.pop().expect("two").wait_with_output();
    // Worker 0 kills worker 1 when done; make sure of it either way.
    let _ = stopped.kill();
    let _ = stopped.wait();
    let o = o?;
    drop(server.rt);
    if !o.status.success() {
        bail!("partition worker 0 exited with {}", o.status);
    }
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("RESULT detect_s ")?.trim().parse().ok())
        .context("worker 0 printed no detection time")
}

fn ratio(num: Option<f64>, den: Option<f64>) -> String {
    match (num, den) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.1}x", a / b),
        _ => "-".into(),
    }
}

/// A raw TCP ping-pong between this process and a child: seconds per round trip.
fn raw_rtt(rounds: usize) -> Result<f64> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let port = l.local_addr()?.port();
    let child = Command::new(std::env::current_exe()?)
        .args(["rpc-ping", &port.to_string(), &rounds.to_string()])
        .spawn()?;
    let (mut s, _) = l.accept()?;
    s.set_nodelay(true)?;
    let mut b = [0u8; 64];
    let mut t0 = Instant::now();
    for i in 0..rounds + 1000 {
        if i == 1000 {
            t0 = Instant::now();
        }
        s.write_all(&b)?;
        s.read_exact(&mut b)?;
    }
    let dt = t0.elapsed().as_secs_f64() / rounds as f64;
    drop(s);
    child.wait_with_output()?;
    Ok(dt)
}

/// The echoing side of [`raw_rtt`].
pub fn ping(port: u16, rounds: usize) -> Result<()> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_nodelay(true)?;
    let mut b = [0u8; 64];
    for _ in 0..rounds + 1000 {
        s.read_exact(&mut b)?;
        s.write_all(&b)?;
    }
    Ok(())
}

/// One of our workers: the same loop as `py/rpc_bench.py`.
/// `RALLY_BENCH_RT=0` runs it on a current-thread runtime.
pub fn worker(mode: &str) -> Result<()> {
    let rt = match std::env::var("RALLY_BENCH_RT").as_deref() {
        Ok("0") => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?,
        _ => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?,
    };
    rt.block_on(worker_main(mode))
}

async fn worker_main(mode: &str) -> Result<()> {
    let rank: u32 = std::env::var("RANK")?.parse()?;
    let opts = worker_options()?;
    let name = format!("w{rank}");
    if mode == "init" {
        let t0 = now();
        let rpc = init_rpc(&name, None, None, Some(env_n()?), Some(opts)).await?;
        rpc.shutdown(true, None).await?;
        println!("RESULT start {t0:.6}\nRESULT end {:.6}", now());
        return Ok(());
    }
    let rpc = init_rpc(&name, None, None, Some(env_n()?), Some(opts)).await?;
    if mode == "partition" {
        if rank == 0 {
            return time_partition(&rpc).await;
        }
        // Worker 1 is stopped, then killed.
        std::future::pending::<()>().await;
    }
    if rank == 0 {
        let rounds: usize = std::env::var("RALLY_BENCH_ROUNDS")?.parse()?;
        time_calls(&rpc, rounds).await?;
        let size: usize = std::env::var("RALLY_BENCH_PAYLOAD")?.parse()?;
        let p = Payload::cpu(vec![1u8; size]);
        time_payload(&rpc, &p, size).await?;
        time_calls_beside_payloads(&rpc, &p).await?;
    }
    rpc.shutdown(true, None).await?;
    Ok(())
}

/// Our workers' options (`RALLY_BENCH_STREAMS` bulk streams and a
/// `RALLY_BENCH_HEARTBEAT_MS` heartbeat when set) and the functions worker 0
/// calls.
fn worker_options() -> Result<RpcBackendOptions> {
    let mut opts = RpcBackendOptions {
        rpc_timeout: Duration::from_secs(600),
        ..Default::default()
    };
    if let Some(n) = std::env::var("RALLY_BENCH_STREAMS")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        opts.tcp.streams = n;
    }
    if let Some(ms) = std::env::var("RALLY_BENCH_HEARTBEAT_MS")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        opts.heartbeat = Duration::from_millis(ms);
    }
    opts.functions.register("nothing", |(): ()| ())?;
    opts.functions.register("stop_me", |(): ()| {
        // Answer first, then stop: the answer must leave before the stop.
        std::thread::spawn(|| {
            std::thread::sleep(Duration::from_millis(50));
            // SAFETY: signals this very process.
            unsafe { libc::kill(libc::getpid(), libc::SIGSTOP) };
        });
        std::process::id()
    })?;
    opts.functions
        .register("size_of", |p: Payload| p.data.len() as u64)?;
    Ok(opts)
}

/// Worker 0 of the partition measurement: stops worker 1 (SIGSTOP), then
/// times how long a call with no timeout takes to name it dead.
async fn time_partition(rpc: &Rpc) -> Result<()> {
    for _ in 0..100 {
        rpc.rpc_sync::<_, ()>("w1", "nothing", &()).await?;
    }
    let pid: u32 = rpc.rpc_sync("w1", "stop_me", &()).await?;
    // Wait until it is stopped (state T in /proc/<pid>/stat).
    let stat = format!("/proc/{pid}/stat");
    let t = Instant::now();
    loop {
        let s = std::fs::read_to_string(&stat)?;
        if s.rsplit(')')
            .next()
            .is_some_and(|r| r.trim_start().starts_with('T'))
        {
            break;
        }
        anyhow::ensure!(t.elapsed() < Duration::from_secs(10), "w1 did not stop");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let t0 = Instant::now();
    let r = rpc
        .rpc_sync_timeout::<_, ()>("w1", "nothing", &(), Some(Duration::ZERO))
        .await;
    let dt = t0.elapsed().as_secs_f64();
    // SAFETY: kills the stopped worker, a child of our parent.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    match r {
        Err(e @ rallypoint_rpc::Error::WorkerGone { .. }) => {
            eprintln!("worker 0: {e}");
            println!("RESULT detect_s {dt:.6}");
        }
        other => bail!("the call to the stopped worker returned {other:?}"),
    }
    rpc.shutdown(false, None).await?;
    Ok(())
}

/// The round trip of an empty call, one at a time, and calls per second
/// with [`WINDOW`] in flight.
async fn time_calls(rpc: &Rpc, rounds: usize) -> Result<()> {
    for _ in 0..200 {
        rpc.rpc_sync::<_, ()>("w1", "nothing", &()).await?;
    }
    let t0 = Instant::now();
    for _ in 0..rounds {
        rpc.rpc_sync::<_, ()>("w1", "nothing", &()).await?;
    }
    println!(
        "RESULT rtt {:.9}",
        t0.elapsed().as_secs_f64() / rounds as f64
    );

    let batches = (rounds * 5 / WINDOW).max(1);
    let t0 = Instant::now();
    for _ in 0..batches {
        let fs: Vec<_> = (0..WINDOW)
            .map(|_| rpc.rpc_async::<_, ()>("w1", "nothing", &()))
            .collect();
        for f in fs {
            f.await?;
        }
    }
    println!(
        "RESULT calls_per_s {:.3}",
        (batches * WINDOW) as f64 / t0.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Bytes per second of a payload of `size` bytes sent as an argument.
async fn time_payload(rpc: &Rpc, p: &Payload, size: usize) -> Result<()> {
    let got: u64 = rpc.rpc_sync("w1", "size_of", p).await?;
    anyhow::ensure!(got as usize == size, "payload size {got}");
    let reps = 3;
    let t0 = Instant::now();
    for _ in 0..reps {
        rpc.rpc_sync::<_, u64>("w1", "size_of", p).await?;
    }
    println!(
        "RESULT payload_bytes_per_s {:.3}",
        (size * reps) as f64 / t0.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Empty calls while payloads to the same worker are in flight: a small
/// call must not queue behind a bulk transfer.
async fn time_calls_beside_payloads(rpc: &Rpc, p: &Payload) -> Result<()> {
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let bulk = {
        let (rpc, p, stop) = (rpc.clone(), p.clone(), stop.clone());
        tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                rpc.rpc_sync::<_, u64>("w1", "size_of", &p).await?;
                n += 1;
            }
            Ok::<u64, rallypoint_rpc::Error>(n)
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    // For 2 s: several whole transfers, not a phase of one.
    let mut each = Vec::new();
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(2) {
        let t = Instant::now();
        rpc.rpc_sync::<_, ()>("w1", "nothing", &()).await?;
        each.push(t.elapsed().as_secs_f64());
    }
    let rtt_loaded = t0.elapsed().as_secs_f64() / each.len() as f64;
    each.sort_by(f64::total_cmp);
    println!(
        "RESULT rtt_loaded_p50 {:.9}\nRESULT rtt_loaded_p99 {:.9}\nRESULT rtt_loaded_max {:.9}",
        each[each.len() / 2],
        each[each.len() * 99 / 100],
        each[each.len() - 1]
    );
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let transfers = bulk.await??;
    anyhow::ensure!(
        transfers > 0,
        "no payload went during the loaded round trips"
    );
    println!("RESULT rtt_loaded {rtt_loaded:.9}");
    Ok(())
}

fn env_n() -> Result<u32> {
    Ok(std::env::var("WORLD_SIZE")?.parse()?)
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs_f64()
}
