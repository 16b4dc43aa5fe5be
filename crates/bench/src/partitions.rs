//! `rallypoint-bench partitions`: the partition scenarios of the tests across
//! hosts (`crates/rally/tests/run/hosts.rs`), under `rally run` and under
//! torchrun, on the same test hosts with the same DDP job (one gloo worker
//! per node, `crates/rally/tests/py/ddp_train.py`, 60 steps of 0.1 s), and
//! the same rendezvous settings (c10d at node1, keep-alive every 1 s, 3
//! misses, `join_timeout` 20 s, `last_call_timeout` 1 s, 3 restarts). rally
//! alone has `--rdzv-lost-timeout` (5 s here). Not a test: it prints, per
//! scenario and launcher, how each node ended and when, counted from the
//! fault. A node still running 200 s after the fault is killed and shown so.
//! Needs root (network namespaces).

use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use rallypoint_testhosts::Host;

#[derive(clap::Args, Clone)]
pub struct PartitionsArgs {
    /// Scenarios: any of brief-cut, member-cut, member-cut-min-max,
    /// host-cut, power-off, agent-kill.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "brief-cut,member-cut,member-cut-min-max,host-cut,power-off,agent-kill"
    )]
    scenarios: Vec<String>,
    /// Launchers: any of rally, torchrun.
    #[arg(long, value_delimiter = ',', default_value = "rally,torchrun")]
    launchers: Vec<String>,
    /// Seconds after the fault before a node still running is killed.
    #[arg(long, default_value_t = 200)]
    cap: u64,
}

const CONF: &str =
    "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=1,join_timeout=20";

pub fn run(args: PartitionsArgs) -> Result<()> {
    println!(
        "| scenario | launcher | node | ended | after the fault | workers finished | last line |"
    );
    println!("|---|---|---|---|---:|---|---|");
    for scenario in &args.scenarios {
        for launcher in &args.launchers {
            one(scenario, launcher, Duration::from_secs(args.cap))
                .with_context(|| format!("{scenario} under {launcher}"))?;
        }
    }
    Ok(())
}

/// (hosts, --nnodes) of a scenario.
fn shape(scenario: &str) -> (usize, &'static str) {
    match scenario {
        "member-cut" => (2, "1:2"),
        "power-off" | "agent-kill" => (3, "2:3"),
        _ => (2, "2"),
    }
}

fn one(scenario: &str, launcher: &str, cap: Duration) -> Result<()> {
    let (n, nnodes) = shape(scenario);
    let mut c = rallypoint_testhosts::Cluster::new(n)
        .map_err(anyhow::Error::msg)
        .context("test hosts are needed")?;
    let dir = tempfile::tempdir()?;
    let (results, progress) = (dir.path().join("results"), dir.path().join("progress"));
    std::fs::create_dir_all(&results)?;
    std::fs::create_dir_all(&progress)?;
    let mut nodes: Vec<Node> = c
        .hosts()
        .iter()
        .map(|h| Node::start(h, launcher, nnodes, dir.path(), &results, &progress))
        .collect::<Result<_>>()?;
    // Every worker training.
    let t0 = Instant::now();
    while (0..n).any(|r| step(&progress, r) < 2) {
        if t0.elapsed() > Duration::from_secs(120) {
            anyhow::bail!("the job never got going");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let fault = Instant::now();
    match scenario {
        "brief-cut" => {
            c.host(1).cut();
            std::thread::sleep(Duration::from_secs(2));
            c.host(1).heal();
        }
        "member-cut" | "member-cut-min-max" => c.host(1).cut(),
        "host-cut" => c.host(0).cut(),
        "power-off" => c.hosts_mut()[2].power_off(),
        "agent-kill" => {
            // SAFETY: signalling our own child, the node's agent.
            unsafe { libc::kill(nodes[2].child.id() as i32, libc::SIGKILL) };
        }
        other => anyhow::bail!("unknown scenario {other}"),
    }
    for (i, node) in nodes.iter_mut().enumerate() {
        let left = cap.saturating_sub(fault.elapsed());
        let ended = node.wait(left)?;
        let took = fault.elapsed();
        let finished: Vec<String> = (0..n)
            .filter_map(|r| {
                let j = std::fs::read_to_string(results.join(format!("{r}.json"))).ok()?;
                let v: serde_json::Value = serde_json::from_str(&j).ok()?;
                (v["host"] == c.host(i).name.as_str())
                    .then(|| format!("rank {r} attempt {}", v["attempt"]))
            })
            .collect();
        println!(
            "| {scenario} | {launcher} | node{} | {ended} | {} | {} | {} |",
            i + 1,
            if ended.starts_with("still") {
                format!("> {:.0} s", took.as_secs_f64())
            } else {
                format!("{:.1} s", took.as_secs_f64())
            },
            if finished.is_empty() {
                "none".into()
            } else {
                finished.join(", ")
            },
            node.last_line().replace('|', "/"),
        );
    }
    Ok(())
}

fn step(progress: &Path, rank: usize) -> u64 {
    std::fs::read_to_string(progress.join(format!("{rank}.step")))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

struct Node {
    child: Child,
    log: PathBuf,
}

impl Node {
    fn start(
        h: &Host,
        launcher: &str,
        nnodes: &str,
        dir: &Path,
        results: &Path,
        progress: &Path,
    ) -> Result<Node> {
        let mut cmd = match launcher {
            "rally" => {
                let mut c = h.command(std::env::current_exe()?.with_file_name("rally"));
                c.args(["run", "--rdzv-lost-timeout", "5"])
                    .env("PYTHON_EXEC", crate::fixtures::python());
                c
            }
            "torchrun" => {
                let mut c = h.command(crate::fixtures::python());
                c.args(["-m", "torch.distributed.run"]);
                c
            }
            other => anyhow::bail!("unknown launcher {other}"),
        };
        let log = dir.join(format!("{}.log", h.name));
        let out = std::fs::File::create(&log)?;
        cmd.args(["--nnodes", nnodes, "--nproc-per-node", "1"])
            .args(["--rdzv-backend", "c10d", "--rdzv-endpoint", "node1:29400"])
            .args([
                "--rdzv-id",
                "partitions",
                "--rdzv-conf",
                CONF,
                "--max-restarts",
                "3",
            ])
            .arg(crate::fixtures::repo_root().join("crates/rally/tests/py/ddp_train.py"))
            .env("RESULT_DIR", results)
            .env("PROGRESS_DIR", progress)
            .env("STEPS", "60")
            .env("STEP_SLEEP", "0.1")
            .env("RALLY_LOG", "warn")
            .env_remove("HOSTNAME")
            .stdout(out.try_clone()?)
            .stderr(out);
        Ok(Node {
            child: cmd.spawn()?,
            log,
        })
    }

    /// How the node ended: its exit, or that it was still running at the
    /// cap (then killed).
    fn wait(&mut self, left: Duration) -> Result<String> {
        let t0 = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait()? {
                return Ok(match s.code() {
                    Some(c) => format!("exit {c}"),
                    None => format!("{s}"),
                });
            }
            if t0.elapsed() >= left {
                let _ = self.child.kill();
                let _ = self.child.wait();
                return Ok("still running: killed".into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The last line of its output worth showing (no torch warnings).
    fn last_line(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let line = text
            .lines()
            .rev()
            .map(str::trim)
            .find(|l| !l.is_empty() && !l.contains("socket.cpp") && !l.starts_with("warnings.warn"))
            .unwrap_or("")
            .to_owned();
        line.chars().take(160).collect()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
