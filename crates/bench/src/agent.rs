//! `rallypoint-bench agent`: `rally run` against `torchrun`, in the same run.
//!
//! - launch-to-exit: `--standalone --nproc-per-node N --no-python true`, wall
//!   time from exec to exit, median of `--reps`, for each N;
//! - agent memory: resident set of the launcher process while 8 workers sleep;
//! - restart: a worker fails (recording the time); the group is stopped and
//!   restarted; the figure is the time until the last restarted worker started
//!   (`sh/restart_worker.sh`).
//!
//! Both launchers get the same arguments; torchrun is PyTorch's
//! `python -m torch.distributed.run` from `--python`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

#[derive(clap::Args)]
pub struct AgentArgs {
    /// The `rally` binary (build it with --release).
    #[arg(long, default_value = "target/release/rally")]
    rally: PathBuf,
    /// Python with PyTorch.
    #[arg(long, default_value = ".venv/bin/python")]
    python: PathBuf,
    /// Workers per node to measure launch-to-exit at.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    nprocs: Vec<usize>,
    /// Repetitions of each measurement (the median is reported).
    #[arg(long, default_value_t = 5)]
    reps: usize,
}

#[derive(Clone, Copy, Debug)]
enum Launcher {
    Rally,
    Torchrun,
}

impl Launcher {
    fn command(self, a: &AgentArgs, args: &[&str]) -> Command {
        let mut c = match self {
            Launcher::Rally => {
                let mut c = Command::new(&a.rally);
                c.arg("run");
                c
            }
            Launcher::Torchrun => {
                let mut c = Command::new(&a.python);
                c.args(["-m", "torch.distributed.run"]);
                c
            }
        };
        c.args(args)
            .env("RALLY_LOG", "error")
            .env("LOGLEVEL", "ERROR")
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        c
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn launch_to_exit(a: &AgentArgs, l: Launcher, n: usize) -> Result<f64> {
    let n = n.to_string();
    let t0 = Instant::now();
    let status = l
        .command(
            a,
            &[
                "--standalone",
                "--nproc-per-node",
                &n,
                "--no-python",
                "true",
            ],
        )
        .status()
        .with_context(|| format!("{l:?}"))?;
    if !status.success() {
        bail!("{l:?} with {n} workers: {status}");
    }
    Ok(t0.elapsed().as_secs_f64())
}

/// VmRSS and VmHWM (KiB) of the launcher while 8 workers sleep.
fn memory(a: &AgentArgs, l: Launcher) -> Result<(u64, u64)> {
    let mut child = l
        .command(
            a,
            &[
                "--standalone",
                "--nproc-per-node",
                "8",
                "--no-python",
                "sleep",
                "3",
            ],
        )
        .spawn()?;
    std::thread::sleep(Duration::from_millis(2000));
    let status = std::fs::read_to_string(format!("/proc/{}/status", child.id()))?;
    let field = |name: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    let r = (field("VmRSS:"), field("VmHWM:"));
    child.wait()?;
    Ok(r)
}

fn read_time(p: &Path) -> Result<f64> {
    let s = std::fs::read_to_string(p).with_context(|| p.display().to_string())?;
    s.trim()
        .parse()
        .with_context(|| format!("{}: {s:?}", p.display()))
}

/// Seconds from the worker failure to the last restarted worker's start.
fn restart(a: &AgentArgs, l: Launcher, worker: &Path) -> Result<f64> {
    let dir = tempfile::tempdir()?;
    let status = l
        .command(
            a,
            &[
                "--standalone",
                "--nproc-per-node",
                "8",
                "--max-restarts",
                "1",
                "--no-python",
            ],
        )
        .arg(worker)
        .env("BENCH_DIR", dir.path())
        .status()?;
    if !status.success() {
        bail!("{l:?} restart run: {status}");
    }
    let failed = read_time(&dir.path().join("fail"))?;
    let mut last: f64 = 0.0;
    for r in 0..8 {
        last = last.max(read_time(&dir.path().join(format!("start.{r}")))?);
    }
    Ok(last - failed)
}

pub fn run(a: AgentArgs) -> Result<()> {
    let worker = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("sh/restart_worker.sh");
    println!(
        "launch-to-exit, --standalone --nproc-per-node N --no-python true (median of {})",
        a.reps
    );
    println!(
        "{:>4} {:>12} {:>12} {:>8}",
        "N", "rally run", "torchrun", "ratio"
    );
    for &n in &a.nprocs {
        let (mut ours, mut theirs) = (Vec::new(), Vec::new());
        for _ in 0..a.reps {
            ours.push(launch_to_exit(&a, Launcher::Rally, n)?);
            theirs.push(launch_to_exit(&a, Launcher::Torchrun, n)?);
        }
        let (o, t) = (median(ours), median(theirs));
        println!(
            "{n:>4} {:>10.1}ms {:>10.1}ms {:>7.1}x",
            o * 1e3,
            t * 1e3,
            t / o
        );
    }
    let (or, oh) = memory(&a, Launcher::Rally)?;
    let (tr, th) = memory(&a, Launcher::Torchrun)?;
    println!("agent memory with 8 workers: rally run {or} KiB RSS ({oh} peak), torchrun {tr} KiB RSS ({th} peak): {:.1}x smaller", tr as f64 / or as f64);
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    for _ in 0..a.reps {
        ours.push(restart(&a, Launcher::Rally, &worker)?);
        theirs.push(restart(&a, Launcher::Torchrun, &worker)?);
    }
    let (o, t) = (median(ours), median(theirs));
    println!(
        "restart (worker failure to 8 restarted workers running, median of {}): rally run {:.1} ms, torchrun {:.1} ms: {:.1}x",
        a.reps,
        o * 1e3,
        t * 1e3,
        t / o
    );
    Ok(())
}
