//! `rallypoint-bench idle`: store requests per node per second of idle
//! `rally run` agents in the running phase (the scale figure in `docs/benchmarks.md`). N agents
//! join one `c10d` round on a standalone store server of ours
//! (`is_host=false`, so the server sees every agent's requests and nothing
//! else), their workers sleep, and the server's request counter is read over
//! a window once every worker runs. The job store is rank 0's own, so worker
//! traffic (none here) would not count.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

#[derive(clap::Args)]
pub struct IdleArgs {
    /// The `rally` binary (build it with --release).
    #[arg(long, default_value = "target/release/rally")]
    rally: PathBuf,
    /// Agents (one worker each).
    #[arg(long, default_value_t = 16)]
    nodes: usize,
    /// Seconds counted, once every worker runs.
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// `--monitor-interval` of the agents (rally's default, as torchrun's).
    #[arg(long, default_value_t = 0.1)]
    monitor_interval: f64,
}

pub fn run(a: IdleArgs) -> Result<()> {
    let server = crate::fixtures::store_server()?;
    let (port, handle) = (server.port, &server.handle);
    let dir = tempfile::tempdir()?;
    let mut agents: Vec<Child> = (0..a.nodes)
        .map(|_| {
            Command::new(&a.rally)
                .args([
                    "run",
                    "--nnodes",
                    &a.nodes.to_string(),
                    "--nproc-per-node",
                    "1",
                ])
                .args(["--rdzv-backend", "c10d", "--rdzv-id", "idle"])
                .args(["--rdzv-endpoint", &format!("127.0.0.1:{port}")])
                .args(["--rdzv-conf", "is_host=false"])
                .args(["--monitor-interval", &a.monitor_interval.to_string()])
                .args(["--no-python", "sh", "-c"])
                .arg(format!(
                    "touch {}/$RANK; exec sleep 600",
                    dir.path().display()
                ))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .with_context(|| format!("starting {}", a.rally.display()))
        })
        .collect::<Result<_>>()?;
    let t0 = Instant::now();
    while std::fs::read_dir(dir.path())?.count() < a.nodes {
        anyhow::ensure!(
            t0.elapsed() < Duration::from_secs(120),
            "the {} workers did not all start",
            a.nodes
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Let the start's own traffic settle.
    std::thread::sleep(Duration::from_secs(2));
    let before = handle.stats().requests;
    let t = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(a.seconds));
    let requests = handle.stats().requests - before;
    let secs = t.elapsed().as_secs_f64();
    for c in &agents {
        // SAFETY: kill(2) on a child we spawned.
        unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
    }
    for c in &mut agents {
        let _ = c.wait();
    }
    println!(
        "idle running phase, {} agents, --monitor-interval {}: {} store requests in {:.1} s = {:.2} per node per second",
        a.nodes,
        a.monitor_interval,
        requests,
        secs,
        requests as f64 / a.nodes as f64 / secs
    );
    Ok(())
}
