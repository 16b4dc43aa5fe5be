//! The latency measurement: one connection doing PING and GET round trips
//! against each server, beside a raw loopback TCP ping-pong of the same sizes
//! (an echo process per size). Everything runs on CPU 0, rounds are
//! interleaved across servers and the median round is reported, as the
//! machine is noisy.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::time::Instant;

use anyhow::{Context, Result};
use rallypoint_store::protocol::Request;

use super::args::StoreArgs;
use super::figures::{percentile, Figures};
use crate::targets::{start_pinned, Target, GET_REQ_LEN};

/// Interleaved rounds of the latency test; the median round is reported.
const LATENCY_ROUNDS: usize = 25;

/// The latency measurement of every server, with the raw baseline.
pub(super) fn measure(args: &StoreArgs, figures: &mut Figures) -> Result<()> {
    let messages = Messages::new();
    let mut runs = latency_runs(&args.servers);
    // Everything on CPU 0: a wake-up across vCPUs costs ~10x a local one on these
    // VMs and which one a run gets is up to the scheduler, so pinning keeps the
    // comparison about the software path.
    pin_current_thread(Some(0));
    let names: std::collections::BTreeSet<&str> = runs.iter().map(|r| r.target.as_str()).collect();
    let targets: Vec<Target> = names
        .iter()
        .map(|n| start_pinned(n, args.rally_threads, Some(0)))
        .collect::<Result<_>>()?;
    for _round in 0..LATENCY_ROUNDS {
        for run in runs.iter_mut() {
            let t = targets
                .iter()
                .find(|t| t.name == run.target)
                .context("target")?;
            let (req, reply, pre) = messages.of(run);
            let n = args.round_trips / LATENCY_ROUNDS;
            run.rounds.push(ping_pong(t.addr, pre, req, reply, n)?);
        }
    }
    for run in runs {
        record(run, figures);
    }
    pin_current_thread(None);
    Ok(())
}

/// The bytes of the latency test. PING: 5 bytes out, 4 back. GET of a
/// 32-byte value: 13 out, 40 back.
struct Messages {
    ping: [u8; 5],
    get: Vec<u8>,
    /// The store's VALIDATE, before the first PING.
    hello: [u8; 5],
    /// VALIDATE and the SET of the value read, before the first GET.
    setup: Vec<u8>,
}

impl Messages {
    fn new() -> Messages {
        let mut get = Vec::new();
        Request::Get { key: b"/lat" }.encode(&mut get);
        assert_eq!(get.len(), GET_REQ_LEN);
        let hello = [0x00, 0xce, 0xf7, 0x85, 0x3c];
        let mut setup = hello.to_vec();
        Request::Set {
            key: b"/lat",
            value: &[b'v'; 32],
        }
        .encode(&mut setup);
        Messages {
            ping: [0x0d, 1, 2, 3, 4],
            get,
            hello,
            setup,
        }
    }

    /// What `run` sends each round, the length of the reply, and what it
    /// sends first (nothing to the raw echo).
    fn of(&self, run: &LatencyRun) -> (&[u8], usize, &[u8]) {
        let raw = run.target.starts_with("raw");
        match (run.kind, raw) {
            ("ping", true) => (&self.ping, 4, &[]),
            ("ping", false) => (&self.ping, 4, &self.hello),
            (_, true) => (&self.get, 40, &[]),
            (_, false) => (&self.get, 40, &self.setup),
        }
    }
}

/// One run per server and message size; the raw baseline has one echo
/// process per message size.
fn latency_runs(servers: &[String]) -> Vec<LatencyRun> {
    let mut runs = vec![
        LatencyRun {
            target: "raw-ping".into(),
            kind: "ping",
            rounds: Vec::new(),
        },
        LatencyRun {
            target: "raw-get".into(),
            kind: "get",
            rounds: Vec::new(),
        },
    ];
    for server in servers {
        for kind in ["ping", "get"] {
            runs.push(LatencyRun {
                target: server.clone(),
                kind,
                rounds: Vec::new(),
            });
        }
    }
    runs
}

/// The median round of `run`.
fn record(mut run: LatencyRun, figures: &mut Figures) {
    run.rounds.sort_by(|a, b| a.mean.total_cmp(&b.mean));
    let mid = run.rounds[run.rounds.len() / 2];
    let server = if run.target.starts_with("raw") {
        "raw-tcp"
    } else {
        run.target.as_str()
    };
    figures.record(
        &format!("latency {}-size mean (us)", run.kind),
        server,
        mid.mean,
        &format!(
            "p50 {:.1} p99 {:.1} (median of {LATENCY_ROUNDS} rounds, same CPU)",
            mid.p50, mid.p99
        ),
    );
}

/// Round-trip times of one latency run, in microseconds.
#[derive(Clone, Copy)]
struct RoundTrips {
    mean: f64,
    p50: f64,
    p99: f64,
}

/// One target and message size of the latency test, with its rounds.
struct LatencyRun {
    target: String,
    kind: &'static str,
    rounds: Vec<RoundTrips>,
}

/// Blocking round trips on one connection: write `req`, read `reply_len` bytes.
fn ping_pong(
    addr: SocketAddr,
    hello: &[u8],
    req: &[u8],
    reply_len: usize,
    n: usize,
) -> Result<RoundTrips> {
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    s.write_all(hello)?;
    let mut buf = vec![0u8; reply_len];
    let mut lat = Vec::with_capacity(n);
    for i in 0..n + n / 10 {
        let t = Instant::now();
        s.write_all(req)?;
        s.read_exact(&mut buf)?;
        if i >= n / 10 {
            lat.push(t.elapsed().as_nanos() as u32);
        }
    }
    lat.sort_unstable();
    let mean = lat.iter().map(|&l| f64::from(l)).sum::<f64>() / lat.len() as f64 / 1000.0;
    Ok(RoundTrips {
        mean,
        p50: percentile(&lat, 0.5),
        p99: percentile(&lat, 0.99),
    })
}

/// Pins the calling thread to `cpu`, or lets it run anywhere again.
fn pin_current_thread(cpu: Option<usize>) {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; the calls only read it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        for c in 0..n {
            if cpu.is_none_or(|p| p == c) {
                libc::CPU_SET(c, &mut set);
            }
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}
