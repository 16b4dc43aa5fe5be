//! `rallypoint-bench collectives`: our process group against torch's gloo, in
//! the same run, on the same store server, with the same loop.
//!
//! For each world size, `n` processes of each side run every op over sizes
//! from 4 B up: a warm-up, a barrier, then a timed loop. Every rank reports its
//! seconds per op and the slowest rank counts. The table gives bus bandwidth
//! (nccl-tests' convention: `busbw = algbw × 2(n−1)/n` for all_reduce,
//! `(n−1)/n` for all_gather with the size being the gathered output, `1` for
//! broadcast), latency for small sizes and barriers, and ours ÷ gloo.
//!
//! The ceiling is raw TCP between two processes on the same loopback, measured in
//! the same run: one direction (one sender, one receiver), and both directions
//! at once (each process sends and receives, as a two-rank ring does), reported
//! per direction. For every world size `n` it also measures a raw TCP ring:
//! `n` processes, each writing to the next and reading from the previous at
//! once, which is exactly the traffic of a ring all-reduce with no protocol on
//! top. Any all-reduce must send and receive `2(n−1)/n` of the buffer per rank,
//! so its bus bandwidth cannot exceed that per-link rate; on a 2-core machine,
//! where loopback TCP is CPU memcpy shared by every process, the ring rate is
//! the ceiling both we and gloo are measured against.
//!
//! Before and after each side, the bench measures the host's cross-core
//! penalty (`ceilings::cross_core`) and prints it beside the table: on this
//! VM, moving data between cores is 4–9 times slower for seconds at a
//! time, and a ratio is only like with like when both sides ran in the
//! same condition (every probe around them about 1, or every one high).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rallypoint_collectives::{split_round_bytes, Element, Options, ProcessGroup, ReduceOp};
use rallypoint_store::{Store, TcpStore};

use crate::ceilings::{copy_ceiling, cross_core, memcpy_rate, pin_thread, reduce_ceiling};

#[derive(clap::Args, Clone)]
pub struct CollectivesArgs {
    /// World sizes to run.
    #[arg(long, value_delimiter = ',', default_value = "2,4")]
    ranks: Vec<usize>,
    /// Ops: any of all_reduce, broadcast, all_gather, barrier.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "all_reduce,broadcast,all_gather,barrier"
    )]
    ops: Vec<String>,
    /// Largest size in bytes (sizes go up by 4x from 4 B).
    #[arg(long, default_value_t = 256 << 20)]
    max_bytes: usize,
    /// Smallest size in bytes.
    #[arg(long, default_value_t = 4)]
    min_bytes: usize,
    /// Sides: rally (shared memory on one host, the default), rally-tcp
    /// (shared memory off), rally-tcp-owned (the same through the `*_async`
    /// forms, which own their buffers and so receive straight into them),
    /// rally-2host (the ranks told they are on two hosts, half each:
    /// two-level all_reduce, broadcast and barrier, with loopback TCP between
    /// the "hosts"), torch-rally (our torch.distributed backend, through
    /// torch, as gloo is), gloo.
    #[arg(long, value_delimiter = ',', default_value = "rally,rally-tcp,gloo")]
    sides: Vec<String>,
    /// Bytes per raw TCP measurement.
    #[arg(long, default_value_t = 2 << 30)]
    raw_bytes: u64,
    /// Our segment size (default: the library's).
    #[arg(long)]
    segment_bytes: Option<usize>,
    /// Our TCP connections per peer (default: the library's).
    #[arg(long)]
    streams: Option<usize>,
    /// Repetitions of the whole comparison (sides alternate within each).
    #[arg(long, default_value_t = 1)]
    repeat: usize,
    /// Element type of every buffer, both sides: f32, f16 or bf16. Sizes
    /// stay in bytes.
    #[arg(long, default_value = "f32", value_parser = ["f32", "f16", "bf16"])]
    dtype: String,
}

fn sizes(max: usize) -> Vec<usize> {
    let mut v = vec![];
    let mut s = 4;
    while s <= max {
        v.push(s);
        s *= 4;
    }
    v
}

/// Timed ops per size: about 512 MiB moved, 5 to 1,000 ops.
/// `RALLY_BENCH_ITERS`, a positive integer, overrides it (for profiling one
/// size); anything else is ignored, as on the Python side.
fn iters_for(bytes: usize) -> usize {
    if let Some(n) = std::env::var("RALLY_BENCH_ITERS")
        .ok()
        .and_then(|s| s.parse::<usize>().ok())
        .filter(|&n| n > 0)
    {
        return n;
    }
    ((512usize << 20) / bytes.max(1)).clamp(5, 1000)
}

fn bus_factor(op: &str, n: usize) -> f64 {
    let n = n as f64;
    match op {
        "all_reduce" => 2.0 * (n - 1.0) / n,
        "all_gather" => (n - 1.0) / n,
        _ => 1.0,
    }
}

/// (op, bytes) → seconds per op, slowest rank.
type Results = BTreeMap<(String, usize), f64>;

pub fn run(args: CollectivesArgs) -> Result<()> {
    let server = crate::fixtures::store_server()?;
    let port = server.port;
    let sizes: Vec<usize> = sizes(args.max_bytes)
        .into_iter()
        .filter(|&s| s >= args.min_bytes)
        .collect();
    let ops = args.ops.join(",");
    let size_list = sizes
        .iter()
        .map(|s| s.to_string())
        .collect::<Vec<_>>()
        .join(",");

    println!("# elements: {}, both sides", args.dtype);
    // Every repetition's times, by world size and side, for the spread.
    let mut every: BTreeMap<(usize, String), Vec<Results>> = BTreeMap::new();
    for rep in 0..args.repeat {
        let (uni, duplex) = raw_tcp(args.raw_bytes)?;
        let copy = memcpy_rate(64 << 20);
        println!(
            "\n# repetition {}: raw TCP on loopback, same run: one direction {:.2} GB/s; both directions at once {:.2} GB/s each; single-thread memcpy of 64 MiB {:.2} GB/s",
            rep + 1,
            uni / 1e9,
            duplex / 1e9,
            copy / 1e9
        );
        for &n in &args.ranks {
            let ring = raw_ring(n, args.raw_bytes / n as u64)?;
            println!(
                "\n# raw TCP ring of {n} processes, same run: {:.2} GB/s per link (the all_reduce busbw ceiling)",
                ring / 1e9
            );
            println!(
                "# {n} threads each copying 64 MiB in and out through a 1 MiB half (shared memory's two copies, no reduction, no waits), same run: all_reduce busbw ceiling {:.2} GB/s",
                copy_ceiling(n, 64 << 20) * bus_factor("all_reduce", n) / 1e9
            );
            println!(
                "# {n} ranks' split shared-memory all-reduce run by threads with perfect waiting (a thread per CPU, its ranks back to back, spin barriers for stages; rounds of {} KiB, as the library's here), same run: all_reduce busbw ceiling {:.2} GB/s",
                split_round_bytes(n, Options::default().shm_slot_bytes) >> 10,
                reduce_ceiling(n, 64 << 20) * bus_factor("all_reduce", n) / 1e9
            );
            let mut results: BTreeMap<String, Results> = BTreeMap::new();
            let mut penalty: BTreeMap<String, String> = BTreeMap::new();
            for side in &args.sides {
                let prefix = format!("bench/{side}/{n}/{rep}");
                let (before, rate0) = cross_core_penalty();
                let r = ranks(side, port, &prefix, n, &ops, &size_list, &args)
                    .with_context(|| format!("{side} with {n} ranks"))?;
                let (after, rate1) = cross_core_penalty();
                println!(
                    "# {side}: cross-core penalty {before:.2} before, {after:.2} after (two-rank exchange across cores {:.2}, {:.2} GB/s)",
                    rate0 / 1e9,
                    rate1 / 1e9
                );
                penalty.insert(side.clone(), format!("{before:.1}-{after:.1}"));
                every.entry((n, side.clone())).or_default().push(r.clone());
                results.insert(side.clone(), r);
            }
            for ours in [
                "rally",
                "rally-tcp",
                "rally-tcp-owned",
                "rally-2host",
                "torch-rally",
            ] {
                if results.contains_key(ours) {
                    let of = |s: &str| penalty.get(s).map_or("-", |p| p.as_str());
                    println!(
                        "\n# cross-core penalty (before-after each side): ours {}, gloo {}",
                        of(ours),
                        of("gloo")
                    );
                    report(n, ours, &args.ops, &sizes, &results, uni, ring, copy);
                }
            }
        }
    }
    if args.repeat > 1 {
        spread(&every, &args.ops, &sizes);
    }
    Ok(())
}

/// The median of `v` (the mean of the middle two for an even count).
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len().is_multiple_of(2) {
        (v[m - 1] + v[m]) / 2.0
    } else {
        v[m]
    }
}

/// Over every repetition: each side's median time per op and size, its
/// spread (fastest and slowest run), and the ratio of the medians. One run's
/// figure can swing severalfold on this VM (docs/benchmarks.md, "How to read
/// the figures"); the median of several, with its spread beside it, is the
/// figure to quote.
fn spread(every: &BTreeMap<(usize, String), Vec<Results>>, ops: &[String], sizes: &[usize]) {
    let times = |n: usize, side: &str, key: &(String, usize)| -> Vec<f64> {
        every
            .get(&(n, side.to_owned()))
            .map(|runs| runs.iter().filter_map(|r| r.get(key).copied()).collect())
            .unwrap_or_default()
    };
    let sides: std::collections::BTreeSet<&str> = every.keys().map(|(_, s)| s.as_str()).collect();
    let worlds: std::collections::BTreeSet<usize> = every.keys().map(|(n, _)| *n).collect();
    for n in worlds {
        for op in ops {
            println!("\n## spread over every repetition: {op}, {n} ranks (us: median, fastest-slowest run)");
            let others: Vec<&str> = sides.iter().copied().filter(|s| *s != "gloo").collect();
            let head: String = others
                .iter()
                .map(|s| format!(" {s} | {s} time / gloo time |"))
                .collect();
            println!("| bytes | runs | gloo |{head}");
            println!("|---:|---:|---:|{}", "---:|---:|".repeat(others.len()));
            let keys: Vec<usize> = if op == "barrier" {
                vec![4]
            } else {
                sizes.to_vec()
            };
            for s in keys {
                let key = (op.clone(), s);
                let mut g = times(n, "gloo", &key);
                let runs = g.len();
                let fmt = |v: &mut Vec<f64>| -> (String, Option<f64>) {
                    if v.is_empty() {
                        return ("-".into(), None);
                    }
                    let m = median(v);
                    let (lo, hi) = (v[0], v[v.len() - 1]);
                    (
                        format!("{:.1} ({:.1}-{:.1})", m * 1e6, lo * 1e6, hi * 1e6),
                        Some(m),
                    )
                };
                let (gs, gm) = fmt(&mut g);
                let mut row = format!("| {s} | {runs} | {gs} |");
                for side in &others {
                    let (os, om) = fmt(&mut times(n, side, &key));
                    let ratio = match (om, gm) {
                        (Some(o), Some(g)) => format!("{:.2}", o / g),
                        _ => "-".into(),
                    };
                    row.push_str(&format!(" {os} | {ratio} |"));
                }
                println!("{row}");
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn report(
    n: usize,
    side: &str,
    ops: &[String],
    sizes: &[usize],
    results: &BTreeMap<String, Results>,
    uni: f64,
    ring: f64,
    copy: f64,
) {
    let ours = results.get(side);
    let gloo = results.get("gloo");
    for op in ops {
        println!("\n## {op}, {n} ranks, ours = {side}");
        if op == "barrier" {
            let get = |r: Option<&Results>| r.and_then(|r| r.get(&(op.clone(), 4))).copied();
            let (a, b) = (get(ours), get(gloo));
            println!(
                "latency: ours {} us, gloo {} us, ours/gloo {}",
                a.map_or("-".into(), |v| format!("{:.1}", v * 1e6)),
                b.map_or("-".into(), |v| format!("{:.1}", v * 1e6)),
                match (a, b) {
                    (Some(a), Some(b)) => format!("{:.2}", a / b),
                    _ => "-".into(),
                }
            );
            continue;
        }
        println!("| bytes | ours us | gloo us | ours busbw GB/s | gloo busbw GB/s | busbw ours/gloo | ours / raw 1-dir | ours / raw ring | gloo / raw ring | ours / memcpy |");
        println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        for &s in sizes {
            let key = (op.clone(), s);
            let a = ours.and_then(|r| r.get(&key)).copied();
            let b = gloo.and_then(|r| r.get(&key)).copied();
            let bus = |t: f64| {
                let total = if op == "all_gather" { s * n } else { s };
                total as f64 / t * bus_factor(op, n) / 1e9
            };
            let f = |v: Option<f64>, g: &dyn Fn(f64) -> String| v.map_or("-".into(), g);
            // A ceiling not measured (`--raw-bytes 0`) is shown as "-".
            let pct = |base: f64| {
                move |t: f64| {
                    if base > 0.0 {
                        format!("{:.0}%", bus(t) * 1e9 / base * 100.0)
                    } else {
                        "-".into()
                    }
                }
            };
            println!(
                "| {s} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                f(a, &|t| format!("{:.1}", t * 1e6)),
                f(b, &|t| format!("{:.1}", t * 1e6)),
                f(a, &|t| format!("{:.3}", bus(t))),
                f(b, &|t| format!("{:.3}", bus(t))),
                match (a, b) {
                    (Some(a), Some(b)) => format!("{:.2}", b / a),
                    _ => "-".into(),
                },
                f(a, &pct(uni)),
                f(a, &pct(ring)),
                f(b, &pct(ring)),
                f(a, &pct(copy)),
            );
        }
    }
}

/// The host's cross-core penalty now (see `ceilings`): how many times
/// slower the two-rank exchange runs when its data crosses cores than when
/// it does not (about 1 normally), and the crossing rate in bytes/s (a
/// two-rank all-reduce's busbw ceiling at this moment).
fn cross_core_penalty() -> (f64, f64) {
    let (crossing, private) = cross_core(16 << 20);
    (private / crossing, crossing)
}

/// Runs `n` rank processes of `side`; returns the slowest rank's seconds per op.
fn ranks(
    side: &str,
    port: u16,
    prefix: &str,
    n: usize,
    ops: &str,
    sizes: &str,
    args: &CollectivesArgs,
) -> Result<Results> {
    let mut children = Vec::with_capacity(n);
    for r in 0..n {
        let mut c = match side {
            "rally" | "rally-tcp" | "rally-tcp-owned" | "rally-2host" => {
                let mut c = Command::new(std::env::current_exe()?);
                c.arg("coll-rank");
                c.env(
                    "RALLY_BENCH_SHM",
                    if side.starts_with("rally-tcp") {
                        "0"
                    } else {
                        "1"
                    },
                );
                if side == "rally-tcp-owned" {
                    c.env("RALLY_BENCH_OWNED", "1");
                }
                if side == "rally-2host" {
                    c.env("RALLY_BENCH_HOST", format!("h{}", r * 2 / n));
                }
                c
            }
            "gloo" | "torch-rally" => {
                let mut c = Command::new(crate::fixtures::python());
                c.arg(crate::fixtures::repo_root().join("crates/bench/py/coll_bench.py"));
                if side == "torch-rally" {
                    c.env("RALLY_BENCH_BACKEND", "rally")
                        .env("PYTHONPATH", crate::torch::package()?);
                }
                c
            }
            other => bail!("unknown side {other}"),
        };
        c.args([
            port.to_string(),
            prefix.to_owned(),
            n.to_string(),
            r.to_string(),
        ])
        .args([ops, sizes])
        .env("OMP_NUM_THREADS", "1")
        .env("RALLY_BENCH_DTYPE", &args.dtype)
        .env(
            "RALLY_BENCH_SEGMENT",
            args.segment_bytes
                .map(|s| s.to_string())
                .unwrap_or_default(),
        )
        .env(
            "RALLY_BENCH_STREAMS",
            args.streams.map(|s| s.to_string()).unwrap_or_default(),
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
        children.push(
            c.spawn()
                .with_context(|| format!("starting {side} rank {r}"))?,
        );
    }
    let readers: Vec<_> = children
        .iter_mut()
        .map(|c| {
            let mut out = c.stdout.take().expect("piped");
            std::thread::spawn(move || {
                let mut s = String::new();
                let _ = out.read_to_string(&mut s);
                s
            })
        })
        .collect();
    let mut results = Results::new();
    let mut failed = None;
    for (r, (mut c, rd)) in children.into_iter().zip(readers).enumerate() {
        let status = c.wait()?;
        let out = rd.join().expect("reader");
        if !status.success() {
            failed.get_or_insert(format!("{side} rank {r} exited with {status}"));
        }
        for line in out.lines().filter_map(|l| l.strip_prefix("RESULT ")) {
            let f: Vec<&str> = line.split_whitespace().collect();
            let (op, bytes, secs) = (f[0].to_owned(), f[1].parse()?, f[2].parse::<f64>()?);
            let e = results.entry((op, bytes)).or_insert(0.0);
            *e = e.max(secs);
        }
    }
    if let Some(f) = failed {
        bail!(f);
    }
    Ok(results)
}

/// One of our ranks: the same loop as `py/coll_bench.py`.
pub fn rank(
    port: u16,
    prefix: String,
    n: usize,
    rank: usize,
    ops: String,
    sizes: String,
) -> Result<()> {
    // `RALLY_BENCH_PIN=1` (both sides): each rank's process, and every
    // thread it starts, runs on CPU `rank mod CPUs` only, so the scheduler
    // cannot stack a woken rank on its waker's CPU while another idles.
    if std::env::var("RALLY_BENCH_PIN").as_deref() == Ok("1") {
        pin_thread(rank);
    }
    let rt = match std::env::var("RALLY_BENCH_RT")
        .ok()
        .and_then(|s| s.parse::<usize>().ok())
    {
        Some(0) => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?,
        Some(k) => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(k)
            .enable_all()
            .build()?,
        None => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?,
    };
    rt.block_on(async move {
        // Across test hosts (`collectives-hosts`), the store is on another
        // host and each rank advertises its own address.
        let store_host =
            std::env::var("RALLY_BENCH_STORE_HOST").unwrap_or_else(|_| "127.0.0.1".into());
        let advertise = match std::env::var("RALLY_BENCH_ADVERTISE").as_deref() {
            Ok("auto") => None,
            _ => Some("127.0.0.1".parse()?),
        };
        let store: Arc<dyn Store> = Arc::new(
            TcpStore::builder(&store_host, port)
                .timeout(Duration::from_secs(600))
                .connect()
                .await?,
        );
        let pg = ProcessGroup::new(store, rank, n, {
            let mut o = Options {
                prefix,
                advertise,
                ..Options::default()
            };
            if let Some(s) = std::env::var("RALLY_BENCH_SEGMENT")
                .ok()
                .and_then(|s| s.parse().ok())
            {
                o.segment_bytes = s;
            }
            o.shared_memory = std::env::var("RALLY_BENCH_SHM").as_deref() != Ok("0");
            o.host_id = std::env::var("RALLY_BENCH_HOST").ok();
            if let Some(s) = std::env::var("RALLY_BENCH_SLOT")
                .ok()
                .and_then(|s| s.parse().ok())
            {
                o.shm_slot_bytes = s;
            }
            if let Some(w) = std::env::var("RALLY_BENCH_WINDOW")
                .ok()
                .and_then(|s| s.parse().ok())
            {
                o.receive_window = w;
            }
            if let Some(s) = std::env::var("RALLY_BENCH_STREAMS")
                .ok()
                .and_then(|s| s.parse().ok())
            {
                o.streams_per_peer = s;
            }
            o
        })
        .await?;
        let sizes: Vec<usize> = sizes.split(',').map(str::parse).collect::<Result<_, _>>()?;
        let owned = std::env::var("RALLY_BENCH_OWNED").as_deref() == Ok("1");
        match std::env::var("RALLY_BENCH_DTYPE").as_deref() {
            Ok("f16") => each_op::<rallypoint_collectives::f16>(&pg, &ops, &sizes, owned).await?,
            Ok("bf16") => each_op::<rallypoint_collectives::bf16>(&pg, &ops, &sizes, owned).await?,
            Ok("f32") | Err(_) => each_op::<f32>(&pg, &ops, &sizes, owned).await?,
            Ok(other) => bail!("unknown element type {other}"),
        }
        pg.barrier().await?;
        anyhow::Ok(())
    })
}

/// Every op and size of one rank, in elements of `T`.
async fn each_op<T: Element>(
    pg: &ProcessGroup,
    ops: &str,
    sizes: &[usize],
    owned: bool,
) -> Result<()> {
    let n = pg.size();
    let zero = T::from_i8(0);
    for op in ops.split(',') {
        let list = if op == "barrier" {
            vec![4]
        } else {
            sizes.to_vec()
        };
        for bytes in list {
            let count = (bytes / std::mem::size_of::<T>()).max(1);
            check::<T>(pg, op, count, owned).await?;
            // Zeros: repeated sums into one buffer stay exact (ones
            // overflowed to infinity after ~128 all_reduces).
            let mut buf = vec![zero; count];
            let mut out = vec![zero; if op == "all_gather" { count * n } else { 0 }];
            let iters = iters_for(bytes);
            timed(pg, op, &mut buf, &mut out, (iters / 10).max(2), owned).await?;
            pg.barrier().await?;
            let dt = timed(pg, op, &mut buf, &mut out, iters, owned)
                .await?
                .as_secs_f64()
                / iters as f64;
            if buf.iter().chain(&out).any(|&x| x != zero) {
                bail!("{op} of {bytes} bytes: the timed ops corrupted the buffer");
            }
            println!("RESULT {op} {bytes} {dt:.9}");
        }
    }
    Ok(())
}

/// One `op` of `count` elements on inputs that differ by rank, with its
/// result checked, so that a benchmark never times a wrong answer.
async fn check<T: Element>(pg: &ProcessGroup, op: &str, count: usize, owned: bool) -> Result<()> {
    let (n, r) = (pg.size(), pg.rank());
    // Small integers whose sums over every rank fit an i8 and are exact in
    // every type (bf16 holds integers up to 256 exactly).
    if n > 127 {
        bail!("the result check supports up to 127 ranks, not {n}");
    }
    let m = if n <= 18 { 7 } else { 2 };
    let mine = move |r: usize| (0..count).map(move |i| T::from_i8(((i + r) % m) as i8));
    let got: Vec<T>;
    let want: Vec<T>;
    match op {
        "all_reduce" => {
            let mut b: Vec<T> = mine(r).collect();
            if owned {
                b = pg.all_reduce_async(b, ReduceOp::Sum).wait().await?;
            } else {
                pg.all_reduce(&mut b, ReduceOp::Sum).await?;
            }
            want = (0..count)
                .map(|i| T::from_i8((0..n).map(|q| ((i + q) % m) as i8).sum()))
                .collect();
            got = b;
        }
        "broadcast" => {
            let mut b: Vec<T> = mine(r).collect();
            if owned {
                b = pg.broadcast_async(b, 0).wait().await?;
            } else {
                pg.broadcast(&mut b, 0).await?;
            }
            want = mine(0).collect();
            got = b;
        }
        "all_gather" => {
            let mut out = vec![T::from_i8(0); count * n];
            let input: Vec<T> = mine(r).collect();
            if owned {
                out = pg.all_gather_async(input).wait().await?;
            } else {
                pg.all_gather(&input, &mut out).await?;
            }
            want = (0..n).flat_map(mine).collect();
            got = out;
        }
        _ => return Ok(()),
    }
    if got != want {
        bail!(
            "{op} of {count} {} on rank {r} of {n} returned a wrong result",
            T::DTYPE
        );
    }
    Ok(())
}

/// `k` ops; `owned`: all_reduce and broadcast through their `*_async`
/// forms, moving the buffer in and out (no copy).
async fn timed<T: Element>(
    pg: &ProcessGroup,
    op: &str,
    buf: &mut Vec<T>,
    out: &mut [T],
    k: usize,
    owned: bool,
) -> Result<Duration> {
    let t0 = Instant::now();
    for _ in 0..k {
        // all_gather_async consumes its input: the borrowing form is timed
        // for it (its input would need a copy per op).
        if owned && (op == "all_reduce" || op == "broadcast") {
            let b = std::mem::take(buf);
            *buf = match op {
                "all_reduce" => pg.all_reduce_async(b, ReduceOp::Sum).wait().await?,
                _ => pg.broadcast_async(b, 0).wait().await?,
            };
            continue;
        }
        match op {
            "all_reduce" => pg.all_reduce(buf, ReduceOp::Sum).await?,
            "broadcast" => pg.broadcast(buf, 0).await?,
            "all_gather" => pg.all_gather(buf, out).await?,
            "barrier" => pg.barrier().await?,
            other => bail!("unknown op {other}"),
        }
    }
    Ok(t0.elapsed())
}

/// Raw TCP between two processes: (one direction, per direction with both at once), bytes/s.
fn raw_tcp(bytes: u64) -> Result<(f64, f64)> {
    let one = crate::fixtures::raw_pair(bytes, false)?;
    let both = crate::fixtures::raw_pair(bytes, true)?;
    Ok((one, both))
}

/// A raw TCP ring of `n` processes, each sending `bytes` to the next while
/// receiving as much from the previous: the slowest link's bytes/s.
fn raw_ring(n: usize, bytes: u64) -> Result<f64> {
    if n < 2 {
        bail!("a ring needs at least 2 processes");
    }
    let ports = free_ports(n)?;
    let list = ports
        .iter()
        .map(|p| p.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let children = (0..n)
        .map(|i| {
            Command::new(std::env::current_exe()?)
                .args(["coll-ring", &i.to_string(), &list, &bytes.to_string()])
                .stdout(Stdio::piped())
                .spawn()
                .context("starting a raw TCP ring process")
        })
        .collect::<Result<Vec<_>>>()?;
    let mut slowest = f64::INFINITY;
    for c in children {
        let out = c.wait_with_output()?;
        if !out.status.success() {
            bail!("raw TCP ring process failed");
        }
        for l in String::from_utf8_lossy(&out.stdout).lines() {
            if let Some(v) = l.strip_prefix("RATE ") {
                slowest = slowest.min(v.trim().parse::<f64>()?);
            }
        }
    }
    Ok(slowest)
}

fn free_ports(n: usize) -> Result<Vec<u16>> {
    let held = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<std::io::Result<Vec<_>>>()?;
    held.iter().map(|l| Ok(l.local_addr()?.port())).collect()
}

/// One process of the raw ring: listens on its port, connects to the next
/// one's (retrying while it starts), then sends and receives at once; prints
/// `RATE bytes/s` for what it received.
pub fn ring_member(index: usize, ports: &[u16], bytes: u64) -> Result<()> {
    let n = ports.len();
    let listener = TcpListener::bind(("127.0.0.1", ports[index]))?;
    let next = ports[(index + 1) % n];
    let deadline = Instant::now() + Duration::from_secs(10);
    let out = loop {
        match TcpStream::connect(("127.0.0.1", next)) {
            Ok(s) => break s,
            Err(e) if Instant::now() > deadline => return Err(e.into()),
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    };
    let inp = listener.accept()?.0;
    out.set_nodelay(true)?;
    stream(out, Some(inp), bytes, true)
}

/// Sends `bytes` on `w` (if `sends`) while receiving as many on `r`; prints the
/// receive rate.
fn stream(w: TcpStream, r: Option<TcpStream>, bytes: u64, sends: bool) -> Result<()> {
    let mut w = w;
    let sender = std::thread::spawn(move || -> std::io::Result<()> {
        if sends {
            let chunk = vec![7u8; 1 << 20];
            let mut left = bytes;
            while left > 0 {
                let k = left.min(chunk.len() as u64) as usize;
                w.write_all(&chunk[..k])?;
                left -= k as u64;
            }
        }
        Ok(())
    });
    if let Some(mut r) = r {
        let mut buf = vec![0u8; 1 << 20];
        let mut got = 0u64;
        let t0 = Instant::now();
        while got < bytes {
            let k = r.read(&mut buf)?;
            if k == 0 {
                bail!("raw TCP peer closed early");
            }
            got += k as u64;
        }
        println!("RATE {}", got as f64 / t0.elapsed().as_secs_f64());
    }
    sender.join().expect("sender")?;
    Ok(())
}

/// One side of the raw measurement: receivers print `RATE bytes/s`.
pub fn raw(role: &str, port: u16, bytes: u64, mode: &str) -> Result<()> {
    // Across test hosts (`collectives-hosts`): the listener's host.
    let across = std::env::var("RALLY_BENCH_RAW_HOST").ok();
    let s = match (role, across) {
        ("listen", None) => TcpListener::bind(("127.0.0.1", port))?.accept()?.0,
        ("listen", Some(_)) => TcpListener::bind(("0.0.0.0", port))?.accept()?.0,
        (_, None) => TcpStream::connect(("127.0.0.1", port))?,
        (_, Some(h)) => TcpStream::connect((h.as_str(), port))?,
    };
    s.set_nodelay(true)?;
    let sends = mode == "duplex" || role == "connect";
    let receives = mode == "duplex" || role == "listen";
    let w = s.try_clone()?;
    stream(w, receives.then_some(s), bytes, sends)
}
