//! `rally stacks <pid|run-id>`: the Python stacks of a running job's workers,
//! on demand, without stopping anything — the dump `rally run` takes before a
//! stop, taken now.
//!
//! The target is found from `/proc`:
//!
//! - a pid of a `rally run` (or `torchrun`) agent: its workers, the children
//!   that carry `TORCHELASTIC_RUN_ID` in their environment;
//! - any other pid: that process;
//! - anything else is a run id: every worker of that run on this host (each
//!   process whose environment has `TORCHELASTIC_RUN_ID=<run>` and whose
//!   parent's has not, so a worker's own children are left out).
//!
//! Reading another process's memory takes ptrace permission: the same user and
//! `kernel.yama.ptrace_scope` 0, or root (`CAP_SYS_PTRACE`); a worker that
//! cannot be read is named with the reason, and the dump `rally run` takes
//! itself (of its own children) needs neither.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use anyhow::bail;
use rallypoint_elastic::multiprocessing::stacks::{self, Target};

#[derive(clap::Args)]
pub struct StacksArgs {
    /// A worker's pid, an agent's pid (`rally run` or `torchrun`: all its
    /// workers), or a run id (every worker of the run on this host).
    target: String,
    /// Seconds the dump may take, for all workers together.
    #[arg(long, default_value_t = 5.0)]
    timeout: f64,
}

/// A process's environment, from `/proc/<pid>/environ`.
fn environ(pid: u32) -> BTreeMap<String, String> {
    let Ok(bytes) = std::fs::read(format!("/proc/{pid}/environ")) else {
        return BTreeMap::new();
    };
    bytes
        .split(|b| *b == 0)
        .filter_map(|kv| {
            let kv = String::from_utf8_lossy(kv);
            let (k, v) = kv.split_once('=')?;
            Some((k.to_owned(), v.to_owned()))
        })
        .collect()
}

/// The parent of `pid`, from `/proc/<pid>/stat` (the field after the
/// parenthesised command, which may itself hold spaces and parentheses).
fn parent(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &stat[stat.rfind(')')? + 1..];
    after.split_whitespace().nth(1)?.parse().ok()
}

/// Every pid on this host.
fn all_pids() -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut pids: Vec<u32> = dir
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    pids.sort_unstable();
    pids
}

const RUN_ID: &str = "TORCHELASTIC_RUN_ID";

/// A target for `pid`, its rank read from its environment.
fn target(pid: u32, env: &BTreeMap<String, String>) -> Target {
    let num = |k: &str| env.get(k).and_then(|v| v.parse().ok());
    Target {
        local_rank: num("LOCAL_RANK").unwrap_or(0),
        rank: num("RANK").unwrap_or(0),
        pid,
        file: None,
    }
}

/// The workers `what` names (see the module docs).
fn targets(what: &str) -> anyhow::Result<Vec<Target>> {
    let pids = all_pids();
    if let Ok(pid) = what.parse::<u32>() {
        if !Path::new(&format!("/proc/{pid}")).exists() {
            bail!("no process {pid} on this host");
        }
        let workers: Vec<Target> = pids
            .iter()
            .filter(|&&p| parent(p) == Some(pid))
            .filter_map(|&p| {
                let env = environ(p);
                env.contains_key(RUN_ID).then(|| target(p, &env))
            })
            .collect();
        return Ok(match workers.is_empty() {
            true => vec![target(pid, &environ(pid))],
            false => workers,
        });
    }
    let of_run = |p: u32| environ(p).get(RUN_ID).is_some_and(|r| r == what);
    let workers: Vec<Target> = pids
        .iter()
        .filter(|&&p| of_run(p) && !parent(p).is_some_and(of_run))
        .map(|&p| target(p, &environ(p)))
        .collect();
    if workers.is_empty() {
        bail!("no worker of run {what:?} on this host (no process with {RUN_ID}={what} that this user can see), and it is not a pid");
    }
    Ok(workers)
}

/// Prints the stacks; exit code 0 when every worker was read, 1 otherwise.
pub fn run(a: StacksArgs) -> anyhow::Result<i32> {
    if !(a.timeout.is_finite() && a.timeout > 0.0) {
        bail!(
            "--timeout {}: expected a positive number of seconds",
            a.timeout
        );
    }
    let mut targets = targets(&a.target)?;
    targets.sort_by_key(|t| (t.rank, t.pid));
    const WHY: &str = "on demand (rally stacks; the worker keeps running)";
    let dumps = stacks::dump(targets, Duration::from_secs_f64(a.timeout), WHY);
    let mut all_read = true;
    for (i, d) in dumps.iter().enumerate() {
        if i > 0 {
            println!();
        }
        print!("{}", d.render(WHY));
        if let Err(e) = &d.stacks {
            all_read = false;
            if e.contains("ermission") || e.contains("EPERM") {
                say!("rally stacks: pid {}: reading its memory needs ptrace permission (run as root, or set kernel.yama.ptrace_scope=0)", d.target.pid);
            }
        }
    }
    Ok(if all_read { 0 } else { 1 })
}
