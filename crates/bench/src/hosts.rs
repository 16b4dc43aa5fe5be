//! `rallypoint-bench collectives-hosts`: all_reduce across two test hosts
//! (network namespaces on one bridge, see `rallypoint-testhosts`; needs
//! root), each host's link capped with `tbf` on both ends, two ranks per
//! host. In one run, for each repetition:
//!
//! - **rally**: our group as it runs by default: shared memory within a
//!   host, and the two-level all_reduce (reduce within each host, exchange
//!   between hosts, broadcast within each host);
//! - **rally-flat**: our group with shared memory off: one flat ring of four
//!   over TCP (the two hops within a host go over the host's loopback and
//!   are not capped);
//! - **gloo**: torch's gloo on the same hosts, the same store, the same loop
//!   (`py/coll_bench.py`);
//! - **raw**: one TCP stream each way between the hosts at once, the
//!   bytes/s a link carries per direction under the cap.
//!
//! The floor is what any all_reduce of `S` bytes over two hosts must send
//! across the link, per direction: `S` (each host's half of the sum goes one
//! way, the other half comes back), so `S / cap` seconds. A flat ring of
//! four on two hosts sends `2(n−1)/n · S = 1.5 S` over each of its two
//! crossing hops, so it (and gloo, whose all_reduce is a ring) can at best
//! take 1.5 times the floor.

use std::io::Read;
use std::process::{Child, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use rallypoint_testhosts::{Cluster, Host};

#[derive(clap::Args, Clone)]
pub struct HostsArgs {
    /// The cap on each host's link, each direction, in Mbit/s.
    #[arg(long, default_value_t = 1000)]
    mbit: u32,
    /// Bytes of each all_reduce.
    #[arg(long, default_value_t = 64 << 20)]
    bytes: usize,
    /// Sides: any of rally, rally-flat, gloo, raw.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "raw,rally,rally-flat,gloo"
    )]
    sides: Vec<String>,
    /// Repetitions (the sides alternate within each).
    #[arg(long, default_value_t = 3)]
    repeat: usize,
}

const STORE_PORT: u16 = 29700;
const RAW_PORT: u16 = 29701;

pub fn run(args: HostsArgs) -> Result<()> {
    let c = rallypoint_testhosts::Cluster::new(2)
        .map_err(anyhow::Error::msg)
        .context("test hosts are needed")?;
    for h in c.hosts() {
        h.cap(args.mbit);
    }
    let store = store_on(c.host(0))?;
    let floor = args.bytes as f64 * 8.0 / (args.mbit as f64 * 1e6);
    println!(
        "# 2 hosts x 2 ranks, each link capped at {} Mbit/s each way (tbf on both ends); all_reduce of {} MiB (f32)",
        args.mbit,
        args.bytes >> 20
    );
    println!(
        "# floor: {} MiB across the link per direction at the cap = {:.3} s; a flat ring of 4 sends 1.5x that: {:.3} s",
        args.bytes >> 20,
        floor,
        floor * 1.5
    );
    println!("| rep | side | s per all_reduce (slowest rank) | / floor | busbw GB/s |");
    println!("|---:|---|---:|---:|---:|");
    let mut all: Vec<(String, f64)> = Vec::new();
    for rep in 0..args.repeat {
        for side in &args.sides {
            let secs = if side == "raw" {
                // Seconds the floor's bytes take at the measured rate.
                args.bytes as f64 / raw_duplex(&c, args.bytes as u64 * 4)?
            } else {
                side_once(&c, side, rep, args.bytes)?
            };
            let bus = args.bytes as f64 / secs * 1.5 / 1e9;
            println!(
                "| {} | {side} | {secs:.3} | {:.2} | {bus:.3} |",
                rep + 1,
                secs / floor
            );
            all.push((side.clone(), secs));
        }
    }
    let best = |side: &str| {
        all.iter()
            .filter(|(s, _)| s == side)
            .map(|(_, t)| *t)
            .reduce(f64::min)
    };
    if let (Some(a), Some(g)) = (best("rally"), best("gloo")) {
        println!(
            "# best of each: rally {a:.3} s, gloo {g:.3} s, gloo / rally {:.2}",
            g / a
        );
    }
    if let (Some(a), Some(f)) = (best("rally"), best("rally-flat")) {
        println!(
            "# best of each: rally {a:.3} s, rally-flat {f:.3} s, flat / two-level {:.2}",
            f / a
        );
    }
    drop(store);
    Ok(())
}

/// `rally store serve` on `host`, killed when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn store_on(host: &Host) -> Result<Killed> {
    let rally = std::env::current_exe()?.with_file_name("rally");
    let child = host
        .command(rally)
        .args(["store", "serve", "--port", &STORE_PORT.to_string()])
        .env("RALLY_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .context("starting rally store serve (build rally with --release first)")?;
    Ok(Killed(child))
}

/// Four ranks of `side`, two per host, one all_reduce size: the slowest
/// rank's seconds per op.
fn side_once(c: &Cluster, side: &str, rep: usize, bytes: usize) -> Result<f64> {
    let mut children = Vec::new();
    for r in 0..4 {
        let h = c.host(r / 2);
        let mut cmd = match side {
            "rally" | "rally-flat" => {
                let mut cmd = h.command(std::env::current_exe()?);
                cmd.arg("coll-rank")
                    .env("RALLY_BENCH_SHM", if side == "rally" { "1" } else { "0" })
                    .env("RALLY_BENCH_ADVERTISE", "auto");
                cmd
            }
            "gloo" => {
                let mut cmd = h.command(crate::fixtures::python());
                cmd.arg(crate::fixtures::repo_root().join("crates/bench/py/coll_bench.py"));
                cmd
            }
            other => bail!("unknown side {other}"),
        };
        cmd.args([
            STORE_PORT.to_string(),
            format!("hosts/{side}/{rep}"),
            "4".into(),
            r.to_string(),
            "all_reduce".into(),
            bytes.to_string(),
        ])
        .env("RALLY_BENCH_STORE_HOST", &c.host(0).name)
        .env("RALLY_BENCH_DTYPE", "f32")
        .env("OMP_NUM_THREADS", "1")
        .env_remove("HOSTNAME")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
        children.push(
            cmd.spawn()
                .with_context(|| format!("starting {side} rank {r}"))?,
        );
    }
    let mut slowest: Option<f64> = None;
    for (r, mut ch) in children.into_iter().enumerate() {
        let mut out = String::new();
        ch.stdout
            .take()
            .context("stdout")?
            .read_to_string(&mut out)?;
        let status = ch.wait()?;
        if !status.success() {
            bail!("{side} rank {r} exited with {status}");
        }
        for l in out.lines().filter_map(|l| l.strip_prefix("RESULT ")) {
            let secs: f64 = l
                .split_whitespace()
                .nth(2)
                .context("RESULT line")?
                .parse()?;
            slowest = Some(slowest.map_or(secs, |s: f64| s.max(secs)));
        }
    }
    slowest.context("no result reported")
}

/// One TCP stream each way between the hosts at once, `bytes` each: the
/// slower direction's bytes/s.
fn raw_duplex(c: &Cluster, bytes: u64) -> Result<f64> {
    let spawn = |h: &Host, role: &str| -> Result<Child> {
        h.command(std::env::current_exe()?)
            .args([
                "coll-raw",
                role,
                &RAW_PORT.to_string(),
                &bytes.to_string(),
                "duplex",
            ])
            .env("RALLY_BENCH_RAW_HOST", &c.host(0).name)
            .stdout(Stdio::piped())
            .spawn()
            .context("starting a raw TCP process")
    };
    let a = spawn(c.host(0), "listen")?;
    // The listener is up once it has bound; connecting early is refused.
    let mut b;
    let mut tries = 0;
    loop {
        std::thread::sleep(Duration::from_millis(100));
        b = spawn(c.host(1), "connect")?;
        std::thread::sleep(Duration::from_millis(100));
        match b.try_wait()? {
            Some(s) if !s.success() && tries < 50 => tries += 1,
            _ => break,
        }
    }
    crate::fixtures::slowest_rate([a, b])
}
