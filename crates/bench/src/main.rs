//! Benchmark programs for rallypoint. Not tests: they print figures, and
//! `docs/benchmarks.md` records the command and the results.
//!
//! `rallypoint-bench store` compares our store server with PyTorch's (see
//! `store/`); `rallypoint-bench launch` compares our launcher with PyTorch's `start_processes`
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
//! | what measurements share | `fixtures`, `ceilings`, `targets` |
//! | one benchmark each | `agent`, `collectives`, `etcd`, `hosts`, `idle`, `launch`, `partitions`, `reduce`, `rendezvous`, `rpc`, `secret`, `store`, `torch` |

use anyhow::Result;
use clap::{Parser, Subcommand};

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
mod secret;
mod store;
mod targets;
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
    Store(store::StoreArgs),
    /// What the job secret costs the store: with and without, same run.
    Secret(secret::SecretArgs),
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

fn main() -> Result<()> {
    let cli = Cli::parse();
    rallypoint_store::server::raise_fd_limit();
    match cli.command {
        Cmd::Store(args) => store::run(args),
        Cmd::Secret(args) => secret::run(args),
        Cmd::Launch(args) => launch::run(args),
        Cmd::Agent(args) => agent::run(args),
        Cmd::Rendezvous(args) => rendezvous::run(args),
        Cmd::Idle(args) => idle::run(args),
        Cmd::Etcd(args) => etcd::run(args),
        Cmd::Echo { req, reply } => targets::async_echo(req, reply),
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
