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
//! Each figure is printed as it is measured ([`figures`]), then the ratios of
//! ours to the others. The servers are [`crate::targets`]; the load generator
//! speaks the protocol itself ([`conn`]).

mod args;
mod conn;
mod figures;
mod latency;
mod load;

use anyhow::Result;

pub use args::StoreArgs;
use figures::Figures;

/// Runs the measurements `args.tests` names against `args.servers`.
pub fn run(args: StoreArgs) -> Result<()> {
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
    let mut figures = Figures::default();
    if want("latency") {
        latency::measure(&args, &mut figures)?;
    }
    if want("throughput") {
        load::measure_throughput(&args, &rt, &mut figures)?;
    }
    if want("storm") {
        load::measure_storm(&args, &rt, &mut figures)?;
    }
    if want("memory") {
        load::measure_memory(&args, &rt, &mut figures)?;
    }
    figures.print_ratios();
    Ok(())
}
