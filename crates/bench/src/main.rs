//! Benchmark programs for rallypoint. Not tests: they print figures, and
//! `docs/benchmarks.md` records the command and the results.
//!
//! `rallypoint-bench store` drives TCPStore-protocol servers — ours (`rally store
//! serve`) and PyTorch's (libuv, started by `crates/store/tests/py/torch_server.py`) —
//! with one load generator, in the same run, each server in its own process:
//!
//! - throughput: K connections each looping SET, GET, ADD, WAIT (on a present key);
//!   ops/s and per-request latency percentiles;
//! - latency: one connection doing PING and GET round trips, beside a raw loopback
//!   TCP ping-pong of the same sizes (a blocking echo thread);
//! - connection storm: N clients connect, VALIDATE, PING, `ADD init/`, then pass a
//!   store barrier (ADD a counter; the last sets a key; all WAIT on it);
//! - memory: server RSS growth per idle connection, over M connections.
//!
//! `rallypoint-bench launch` compares our launcher with PyTorch's `start_processes`
//! (see `launch.rs`); `rallypoint-bench agent` compares `rally run` with torchrun
//! (see `agent.rs`); `rallypoint-bench collectives` compares our process group
//! with torch's gloo (see `collectives.rs`); `rallypoint-bench rpc` compares our
//! RPC with PyTorch's TensorPipe agent (see `rpc.rs`);
//! `rallypoint-bench collectives-hosts` runs all_reduce across two test hosts
//! with capped links (see `hosts.rs`); `rallypoint-bench partitions` runs the
//! partition scenarios under `rally run` and torchrun (see `partitions.rs`).
//!
//! # Layers
//!
//! The first row is the lowest layer. A module imports only from its own row
//! (never in a circle) and the rows above it; `.ci/module-cycles` checks both.
//!
//! | layer | modules |
//! |---|---|
//! | what measurements share | `fixtures`, `ceilings` |
//! | one benchmark each | `agent`, `collectives`, `etcd`, `hosts`, `idle`, `launch`, `partitions`, `reduce`, `rendezvous`, `rpc`, `torch` |

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use rallypoint_store::protocol::{
    decode_reply, Decoded, Reply, ReplyKind, Request, VALIDATE_MAGIC,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

mod agent;
mod ceilings;
mod collectives;
mod etcd;
mod fixtures;
mod hosts;
mod idle;
mod launch;
mod partitions;
mod reduce;
mod rendezvous;
mod rpc;
mod torch;

pub use launch::LaunchArgs;

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Store server benchmarks: ours and PyTorch's in the same run.
    Store(StoreArgs),
    /// Launcher benchmarks: ours and PyTorch's start_processes in the same run.
    Launch(LaunchArgs),
    /// `rally run` against torchrun: launch-to-exit, agent memory, restart time.
    Agent(agent::AgentArgs),
    /// Dynamic rendezvous: N nodes through one round, ours and PyTorch's c10d.
    Rendezvous(rendezvous::RendezvousArgs),
    /// Store requests per node per second of idle agents (running phase).
    Idle(idle::IdleArgs),
    /// N agents' rendezvous through a real etcd (started here).
    Etcd(etcd::EtcdArgs),
    /// Collectives: our process group against torch's gloo, and the raw TCP ceiling.
    Collectives(collectives::CollectivesArgs),
    /// all_reduce across two test hosts with capped links: two-level, flat ring, gloo.
    CollectivesHosts(hosts::HostsArgs),
    /// The partition scenarios across test hosts under rally run and torchrun.
    Partitions(partitions::PartitionsArgs),
    /// DDP step time over the rally backend for torch.distributed and over
    /// gloo, same run (see torch.rs).
    TorchDdp(torch::TorchDdpArgs),
    /// RPC: ours against PyTorch's (TensorPipe), and the raw TCP ceilings.
    Rpc(rpc::RpcArgs),
    /// One rank's reduction of a segment, per element type, beside a copy.
    Reduce(reduce::ReduceArgs),
    /// (internal) One of our RPC workers.
    #[command(hide = true)]
    RpcWorker { mode: String },
    /// (internal) The echoing side of the raw TCP ping-pong.
    #[command(hide = true)]
    RpcPing { port: u16, rounds: usize },
    /// (internal) One of our collectives ranks.
    #[command(hide = true)]
    CollRank {
        port: u16,
        prefix: String,
        n: usize,
        rank: usize,
        ops: String,
        sizes: String,
    },
    /// (internal) One side of the raw TCP measurement.
    #[command(hide = true)]
    CollRaw {
        role: String,
        port: u16,
        bytes: u64,
        mode: String,
    },
    /// (internal) One process of the raw TCP ring measurement.
    #[command(hide = true)]
    CollRing {
        index: usize,
        #[arg(value_delimiter = ',')]
        ports: Vec<u16>,
        bytes: u64,
    },
    /// (internal) Writes N bytes of 100-byte lines to stdout in 1 MiB writes: the
    /// tee benchmark's worker, the same for both launchers.
    #[command(hide = true)]
    Produce { bytes: u64 },
    /// (internal) One of our rendezvous nodes in its own process.
    #[command(hide = true)]
    RdzvNode {
        port: u16,
        run: String,
        nodes: usize,
        index: usize,
    },
    /// (internal) A raw TCP echo server of fixed sizes, the latency baseline.
    #[command(hide = true)]
    Echo { req: usize, reply: usize },
}

#[derive(clap::Args, Clone)]
struct StoreArgs {
    /// Concurrent connections for the throughput test.
    #[arg(long, default_value_t = 64)]
    connections: usize,
    /// Seconds per throughput measurement.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Round trips for the latency test.
    #[arg(long, default_value_t = 20000)]
    round_trips: usize,
    /// Clients in the connection storm.
    #[arg(long, default_value_t = 16384)]
    storm: usize,
    /// Idle connections for the memory measurement.
    #[arg(long, default_value_t = 8000)]
    idle: usize,
    /// Smaller storm and idle counts run against every server, for a like-for-like
    /// ratio with servers too slow to accept the full counts (PyTorch's libuv server
    /// accepts about ten connections a second here).
    #[arg(long, default_value_t = 64)]
    small: usize,
    /// Which servers: any of rally, torch, torch-legacy.
    #[arg(long, value_delimiter = ',', default_value = "rally,torch")]
    servers: Vec<String>,
    /// Which measurements: any of throughput, latency, storm, memory.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "throughput,latency,storm,memory"
    )]
    tests: Vec<String>,
    /// Worker threads for our server (default: one per core).
    #[arg(long)]
    rally_threads: Option<usize>,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    rallypoint_store::server::raise_fd_limit();
    match cli.command {
        Cmd::Store(args) => store(args),
        Cmd::Launch(args) => launch::run(args),
        Cmd::Agent(args) => agent::run(args),
        Cmd::Rendezvous(args) => rendezvous::run(args),
        Cmd::Idle(args) => idle::run(args),
        Cmd::Etcd(args) => etcd::run(args),
        Cmd::Echo { req, reply } => async_echo(req, reply),
        Cmd::Collectives(args) => collectives::run(args),
        Cmd::CollectivesHosts(args) => hosts::run(args),
        Cmd::Partitions(args) => partitions::run(args),
        Cmd::TorchDdp(args) => torch::run(args),
        Cmd::Rpc(args) => rpc::run(args),
        Cmd::Reduce(args) => reduce::run(args),
        Cmd::RpcWorker { mode } => rpc::worker(&mode),
        Cmd::RpcPing { port, rounds } => rpc::ping(port, rounds),
        Cmd::CollRank {
            port,
            prefix,
            n,
            rank,
            ops,
            sizes,
        } => collectives::rank(port, prefix, n, rank, ops, sizes),
        Cmd::CollRaw {
            role,
            port,
            bytes,
            mode,
        } => collectives::raw(&role, port, bytes, &mode),
        Cmd::CollRing {
            index,
            ports,
            bytes,
        } => collectives::ring_member(index, &ports, bytes),
        Cmd::Produce { bytes } => launch::produce(bytes),
        Cmd::RdzvNode {
            port,
            run,
            nodes,
            index,
        } => rendezvous::node(port, &run, nodes, index),
    }
}

/// A server under test, in its own process.
pub(crate) struct Target {
    name: String,
    child: Child,
    pub(crate) addr: SocketAddr,
}

impl Drop for Target {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(crate) fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

pub(crate) fn python() -> PathBuf {
    std::env::var_os("RALLY_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join(".venv/bin/python"))
}

pub(crate) fn start(name: &str, rally_threads: Option<usize>) -> Result<Target> {
    start_pinned(name, rally_threads, None)
}

/// Starts a target, optionally with all its threads pinned to one CPU.
fn start_pinned(name: &str, rally_threads: Option<usize>, cpu: Option<usize>) -> Result<Target> {
    let mut cmd = match name {
        "rally" => {
            let exe = std::env::current_exe()?.with_file_name("rally");
            let mut c = Command::new(&exe);
            c.args(["store", "serve", "--host", "127.0.0.1", "--port", "0"]);
            if let Some(n) = rally_threads {
                c.args(["--threads", &n.to_string()]);
            }
            c.env("RALLY_LOG", "warn");
            c
        }
        "torch" | "torch-legacy" => {
            let mut c = Command::new(python());
            c.arg(repo_root().join("crates/store/tests/py/torch_server.py"));
            c.arg(if name == "torch" { "libuv" } else { "legacy" });
            c
        }
        "raw-ping" | "raw-get" => {
            let mut c = Command::new(std::env::current_exe()?);
            let (req, reply) = if name == "raw-ping" {
                (5, 4)
            } else {
                (GET_REQ_LEN, 40)
            };
            c.args(["echo", &req.to_string(), &reply.to_string()]);
            c
        }
        other => bail!("unknown server {other}"),
    };
    if let Some(cpu) = cpu {
        let program = cmd.get_program().to_owned();
        let rest: Vec<_> = cmd.get_args().map(|a| a.to_owned()).collect();
        let envs: Vec<_> = cmd
            .get_envs()
            .filter_map(|(k, v)| Some((k.to_owned(), v?.to_owned())))
            .collect();
        cmd = Command::new("taskset");
        cmd.args(["-c", &cpu.to_string()])
            .arg(program)
            .args(rest)
            .envs(envs);
    }
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("starting {name} (build rally with --release first)"))?;
    let mut out = child.stdout.take().context("stdout")?;
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while out.read(&mut b)? == 1 && b[0] != b'\n' {
        line.push(b[0]);
    }
    let line = String::from_utf8_lossy(&line).into_owned();
    let port: u16 = if let Some(p) = line.strip_prefix("PORT ") {
        p.trim().parse()?
    } else if let Some(a) = line.strip_prefix("rally store listening on ") {
        a.trim().parse::<SocketAddr>()?.port()
    } else {
        bail!("{name} printed {line:?}");
    };
    Ok(Target {
        name: name.to_owned(),
        child,
        addr: SocketAddr::from(([127, 0, 0, 1], port)),
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

/// CPU time (user + system) the process has used.
fn cpu_time(pid: u32) -> Result<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = &stat[stat.rfind(')').context("stat format")? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f[11].parse::<u64>()? + f[12].parse::<u64>()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
    Ok(Duration::from_micros(ticks * 1_000_000 / hz))
}

fn rss_kib(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let line = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .context("no VmRSS")?;
    Ok(line
        .split_whitespace()
        .nth(1)
        .context("VmRSS value")?
        .parse()?)
}

/// A raw protocol connection for the load generator.
struct Conn {
    stream: TcpStream,
    wbuf: Vec<u8>,
    rbuf: Vec<u8>,
}

impl Conn {
    async fn open(addr: SocketAddr) -> Result<Conn> {
        Self::open_from(addr, None).await
    }

    /// Connects from source address 127.0.0.`source` when given. Thousands of
    /// connections from one address to one server make each `connect()` scan the
    /// ephemeral port range; a real storm comes from many hosts, so the storm spreads
    /// its clients over loopback addresses (for every server alike).
    async fn open_from(addr: SocketAddr, source: Option<u8>) -> Result<Conn> {
        let stream = match source {
            None => TcpStream::connect(addr).await?,
            Some(host) => {
                let socket = tokio::net::TcpSocket::new_v4()?;
                let one: libc::c_int = 1;
                // SAFETY: setsockopt with a valid fd and an int option value.
                unsafe {
                    libc::setsockopt(
                        std::os::fd::AsRawFd::as_raw_fd(&socket),
                        libc::IPPROTO_IP,
                        libc::IP_BIND_ADDRESS_NO_PORT,
                        (&one as *const libc::c_int).cast(),
                        std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                    );
                }
                socket.bind(SocketAddr::from(([127, 0, 0, host], 0)))?;
                socket.connect(addr).await?
            }
        };
        stream.set_nodelay(true)?;
        let mut c = Conn {
            stream,
            wbuf: Vec::new(),
            rbuf: Vec::with_capacity(256),
        };
        c.wbuf.clear();
        Request::Validate {
            magic: VALIDATE_MAGIC,
        }
        .encode(&mut c.wbuf);
        c.stream.write_all(&c.wbuf).await?;
        c.call(&Request::Ping { nonce: 7 }, ReplyKind::Nonce)
            .await?;
        Ok(c)
    }

    async fn send(&mut self, req: &Request<'_>) -> Result<()> {
        self.wbuf.clear();
        req.encode(&mut self.wbuf);
        self.stream.write_all(&self.wbuf).await?;
        Ok(())
    }

    async fn call(&mut self, req: &Request<'_>, kind: ReplyKind) -> Result<Reply> {
        self.send(req).await?;
        self.reply(kind).await
    }

    async fn reply(&mut self, kind: ReplyKind) -> Result<Reply> {
        loop {
            if let Decoded::Complete(r, n) = decode_reply(kind, &self.rbuf, 1 << 30)? {
                self.rbuf.drain(..n);
                return Ok(r);
            }
            if self.stream.read_buf(&mut self.rbuf).await? == 0 {
                bail!("server closed the connection");
            }
        }
    }
}

pub(crate) fn percentile(sorted: &[u32], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    f64::from(sorted[i]) / 1000.0
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

/// Interleaved rounds of the latency test; the median round is reported.
const LATENCY_ROUNDS: usize = 25;

/// Size of the latency test's GET request (`GET "/lat"`).
const GET_REQ_LEN: usize = 1 + 8 + 4;

/// The latency baseline: a raw TCP echo of fixed sizes (read `req_len` bytes, write
/// `reply_len`) on one epoll-driven thread, the way both store servers wait for
/// input, so the comparison isolates protocol handling from how the machine wakes
/// threads (a thread blocked in `read` wakes ten times slower here).
fn async_echo(req_len: usize, reply_len: usize) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        println!("PORT {}", l.local_addr()?.port());
        loop {
            let (mut s, _) = l.accept().await?;
            s.set_nodelay(true)?;
            tokio::spawn(async move {
                let mut req = vec![0u8; req_len];
                let reply = vec![0u8; reply_len];
                while s.read_exact(&mut req).await.is_ok() {
                    if s.write_all(&reply).await.is_err() {
                        return;
                    }
                }
            });
        }
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

fn store(args: StoreArgs) -> Result<()> {
    // The load generator gets one thread, so the server under test has the other core.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let want = |t: &str| args.tests.iter().any(|x| x == t);
    println!(
        "# store benchmark: {} cores, servers {:?}",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        args.servers
    );
    let mut rows: Vec<(String, String, f64, String)> = Vec::new();
    let mut record = |test: &str, server: &str, value: f64, unit: &str| {
        println!("{test:<34} {server:<13} {value:>12.1} {unit}");
        rows.push((test.to_owned(), server.to_owned(), value, unit.to_owned()));
    };

    if want("latency") {
        // PING: 5 bytes out, 4 back. GET of a 32-byte value: 13 out, 40 back. Each
        // server (and the raw echo baseline) runs in its own process; rounds are
        // interleaved and the median round is reported, as the machine is noisy.
        let ping = [0x0d, 1, 2, 3, 4];
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
        // The raw baseline has one echo process per message size.
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
        for server in &args.servers {
            for kind in ["ping", "get"] {
                runs.push(LatencyRun {
                    target: server.clone(),
                    kind,
                    rounds: Vec::new(),
                });
            }
        }
        // Everything on CPU 0: a wake-up across vCPUs costs ~10x a local one on these
        // VMs and which one a run gets is up to the scheduler, so pinning keeps the
        // comparison about the software path.
        pin_current_thread(Some(0));
        let names: std::collections::BTreeSet<&str> =
            runs.iter().map(|r| r.target.as_str()).collect();
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
                let raw = run.target.starts_with("raw");
                let (req, reply, pre): (&[u8], usize, &[u8]) = match (run.kind, raw) {
                    ("ping", true) => (&ping, 4, &[]),
                    ("ping", false) => (&ping, 4, &hello),
                    (_, true) => (&get, 40, &[]),
                    (_, false) => (&get, 40, &setup),
                };
                let n = args.round_trips / LATENCY_ROUNDS;
                run.rounds.push(ping_pong(t.addr, pre, req, reply, n)?);
            }
        }
        for mut run in runs {
            run.rounds.sort_by(|a, b| a.mean.total_cmp(&b.mean));
            let mid = run.rounds[run.rounds.len() / 2];
            let server = if run.target.starts_with("raw") {
                "raw-tcp"
            } else {
                run.target.as_str()
            };
            record(
                &format!("latency {}-size mean (us)", run.kind),
                server,
                mid.mean,
                &format!(
                    "p50 {:.1} p99 {:.1} (median of {LATENCY_ROUNDS} rounds, same CPU)",
                    mid.p50, mid.p99
                ),
            );
        }
        pin_current_thread(None);
    }
    if want("throughput") {
        for name in &args.servers {
            let t = start(name, args.rally_threads)?;
            let cpu0 = cpu_time(t.child.id())?;
            let r = rt.block_on(throughput(t.addr, args.connections, args.seconds))?;
            let cpu = cpu_time(t.child.id())?.saturating_sub(cpu0);
            let cpu_per_op = cpu.as_secs_f64() * 1e9 / (r.ops_per_s * args.seconds);
            record(
                &format!("throughput {} conns (ops/s)", args.connections),
                &t.name,
                r.ops_per_s,
                &format!("p50 {:.1}us p99 {:.1}us", r.p50_us, r.p99_us),
            );
            record(
                "server cpu per op (ns)",
                &t.name,
                cpu_per_op,
                &format!(
                    "server used {:.0}% of one core",
                    cpu.as_secs_f64() * 100.0 / args.seconds
                ),
            );
        }
    }
    if want("storm") {
        for name in &args.servers {
            let sizes = if name == "rally" {
                vec![args.small, args.storm]
            } else {
                vec![args.small]
            };
            for n in sizes {
                let t = start(name, args.rally_threads)?;
                let cpu0 = cpu_time(t.child.id())?;
                let took = rt.block_on(storm(t.addr, n, "storm"))?;
                let cpu = cpu_time(t.child.id())?.saturating_sub(cpu0);
                record(
                    &format!("storm {n} clients (ms)"),
                    &t.name,
                    took.as_secs_f64() * 1000.0,
                    &format!("connect+validate+ping+init+barrier; server cpu {cpu:?}"),
                );
            }
        }
    }
    if want("memory") {
        for name in &args.servers {
            let sizes = if name == "rally" {
                vec![args.small, args.idle]
            } else {
                vec![args.small]
            };
            for m in sizes {
                let t = start(name, args.rally_threads)?;
                let bytes = rt.block_on(memory_per_conn(&t, m))?;
                record(
                    &format!("memory per idle conn (bytes, {m})"),
                    &t.name,
                    bytes,
                    "RSS growth / connections",
                );
            }
        }
    }

    // Ratios, rally against each other server.
    println!("\n# ratios (rally vs other; >1 means rally is better)");
    let find = |test: &str, server: &str| {
        rows.iter()
            .find(|r| r.0 == test && r.1 == server)
            .map(|r| r.2)
    };
    let tests: Vec<String> = rows
        .iter()
        .map(|r| r.0.clone())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    for test in tests {
        let Some(ours) = find(&test, "rally") else {
            continue;
        };
        let higher_is_better = test.starts_with("throughput");
        if test.starts_with("server cpu") {
            // Reported as-is below.
        }
        for other in rows.iter().filter(|r| r.0 == test && r.1 != "rally") {
            let ratio = if higher_is_better {
                ours / other.2
            } else {
                other.2 / ours
            };
            println!("{test:<34} rally vs {:<13} {ratio:>6.2}x", other.1);
        }
    }
    Ok(())
}
