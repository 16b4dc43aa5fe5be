//! `rallypoint-bench agent`: `rally run` against `torchrun`, in the same run.
//!
//! - launch-to-exit: `--standalone --nproc-per-node N --no-python true`, wall
//!   time from exec to exit, median of `--reps`, for each N;
//! - agent memory: resident set of the launcher process while 8 workers sleep;
//! - restart: a worker fails (recording the time); the group is stopped and
//!   restarted; the figure is the time until the last restarted worker started
//!   (`sh/restart_worker.sh`).
//! - what the stack dump adds to a stop (`--stacks-only`): SIGTERM to exit
//!   with N Python workers waiting in a function, `rally run` with its dump,
//!   `rally run --no-stack-dump` and torchrun, interleaved run by run; the
//!   dump's own time is read from the agent's `workers.stacks_dumped` event.
//! - signal to exit: SIGTERM to the launcher in a phase, until it has exited
//!   (workers obey SIGTERM): waiting for a rendezvous that needs a second node,
//!   running 8 sleeping workers, and at the exit barrier of a two-node job
//!   whose other node still runs. The launcher is given time to reach the phase
//!   (3 s; torchrun's Python start-up takes about 2 s here) before the signal.
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
    /// Measure only signal-to-exit.
    #[arg(long)]
    signals_only: bool,
    /// Measure only what the stack dump adds to signal-to-exit.
    #[arg(long)]
    stacks_only: bool,
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

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// How long a launcher may take to exit after SIGTERM before it is killed and
/// reported as a cut-off (torchrun ignores signals at its exit barrier).
const SIGNAL_CUTOFF: Duration = Duration::from_secs(20);

/// Milliseconds from SIGTERM to `child`'s exit; `None` if it had not exited
/// after [`SIGNAL_CUTOFF`] (then it is SIGKILLed).
fn term_to_exit(child: &mut std::process::Child) -> Result<Option<f64>> {
    let t0 = Instant::now();
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    loop {
        if child.try_wait()?.is_some() {
            return Ok(Some(t0.elapsed().as_secs_f64() * 1e3));
        }
        if t0.elapsed() >= SIGNAL_CUTOFF {
            child.kill()?;
            child.wait()?;
            return Ok(None);
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Milliseconds from SIGTERM to exit, with the launcher in `phase` (`None`: cut
/// off).
fn signal_to_exit(a: &AgentArgs, l: Launcher, phase: &str) -> Result<Option<f64>> {
    let settle = Duration::from_secs(3);
    let port = free_port()?.to_string();
    let endpoint = format!("127.0.0.1:{port}");
    let two = |id: &str, rest: &[&str]| -> Result<std::process::Child> {
        let mut args = vec![
            "--nnodes",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            &endpoint,
            "--rdzv-id",
            id,
            "--nproc-per-node",
            "1",
            "--monitor-interval",
            "0.1",
            "--no-python",
        ];
        args.extend_from_slice(rest);
        Ok(l.command(a, &args).spawn()?)
    };
    match phase {
        "rendezvous" => {
            let mut c = two("sig-rdzv", &["true"])?;
            std::thread::sleep(settle);
            term_to_exit(&mut c)
        }
        "running" => {
            let mut c = l
                .command(
                    a,
                    &[
                        "--standalone",
                        "--nproc-per-node",
                        "8",
                        "--no-python",
                        "sleep",
                        "100",
                    ],
                )
                .spawn()?;
            std::thread::sleep(settle);
            term_to_exit(&mut c)
        }
        "exit barrier" => {
            let mut done = two("sig-barrier", &["true"])?;
            let mut busy = two("sig-barrier", &["sleep", "100"])?;
            std::thread::sleep(settle + settle);
            let ms = term_to_exit(&mut done);
            let _ = busy.kill();
            let _ = busy.wait();
            ms
        }
        other => bail!("no phase {other}"),
    }
}

pub fn run(a: AgentArgs) -> Result<()> {
    if a.signals_only {
        return signals(&a);
    }
    if a.stacks_only {
        return stacks(&a);
    }
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
    signals(&a)?;
    Ok(())
}

fn signals(a: &AgentArgs) -> Result<()> {
    println!(
        "signal to exit (SIGTERM; workers obey it), median of {} (ms; cut off at {:?})",
        a.reps, SIGNAL_CUTOFF
    );
    println!(
        "{:>14} {:>12} {:>12} {:>8}",
        "phase", "rally run", "torchrun", "ratio"
    );
    let show = |v: Option<f64>| {
        v.map_or(format!(">{:.0}", SIGNAL_CUTOFF.as_secs_f64() * 1e3), |v| {
            format!("{v:.1}")
        })
    };
    for phase in ["rendezvous", "running", "exit barrier"] {
        let (mut ours, mut theirs) = (Vec::new(), Vec::new());
        for _ in 0..a.reps {
            ours.push(signal_to_exit(a, Launcher::Rally, phase)?);
            theirs.push(signal_to_exit(a, Launcher::Torchrun, phase)?);
            // A cut-off run says all there is to say about that launcher.
            if theirs.last() == Some(&None) && theirs.len() >= 2 {
                break;
            }
        }
        // A median over runs where any was cut off is no figure: report the cut-off.
        let med = |v: Vec<Option<f64>>| -> Option<f64> {
            v.iter().copied().collect::<Option<Vec<f64>>>().map(median)
        };
        let (o, t) = (med(ours), med(theirs));
        let ratio = match (o, t) {
            (Some(o), Some(t)) => format!("{:.1}x", t / o),
            _ => "-".into(),
        };
        println!("{phase:>14} {:>12} {:>12} {ratio:>8}", show(o), show(t));
    }
    Ok(())
}

/// One stop of N Python workers waiting in a function: milliseconds from
/// SIGTERM to exit, and the dump's own time from the events (rally with the
/// dump only).
fn stop_python_workers(
    a: &AgentArgs,
    l: Launcher,
    n: usize,
    dump: bool,
) -> Result<(Option<f64>, Option<f64>)> {
    let dir = tempfile::tempdir()?;
    let events = dir.path().join("events.jsonl");
    let worker = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("py/stuck_worker.py");
    let n_s = n.to_string();
    let mut args = vec!["--standalone", "--nproc-per-node", &n_s];
    if matches!(l, Launcher::Rally) && !dump {
        args.push("--no-stack-dump");
    }
    let events_s = events.display().to_string();
    if matches!(l, Launcher::Rally) {
        args.extend(["--events", &events_s]);
    }
    let mut c = l.command(a, &args);
    c.arg(&worker)
        .env("BENCH_DIR", dir.path())
        .env("PYTHON_EXEC", &a.python);
    let mut child = c.spawn()?;
    let t0 = Instant::now();
    while (0..n).any(|r| !dir.path().join(format!("ready.{r}")).exists()) {
        if t0.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            bail!("{l:?}: {n} workers not ready after 60 s");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let ms = term_to_exit(&mut child)?;
    let took = std::fs::read_to_string(&events)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["event"] == "workers.stacks_dumped")
        .and_then(|v| v["took_ms"].as_f64());
    Ok((ms, took))
}

fn stacks(a: &AgentArgs) -> Result<()> {
    println!(
        "SIGTERM to exit with N Python workers waiting in a function, median of {} (ms)",
        a.reps
    );
    println!(
        "{:>4} {:>14} {:>12} {:>12} {:>10} {:>10} {:>12}",
        "N", "rally (dump)", "rally (off)", "torchrun", "added", "dump took", "torchrun/ours"
    );
    for &n in &a.nprocs {
        let (mut on, mut off, mut theirs, mut took) = (vec![], vec![], vec![], vec![]);
        for _ in 0..a.reps {
            let (ms, t) = stop_python_workers(a, Launcher::Rally, n, true)?;
            on.push(ms.context("rally with the dump was cut off")?);
            took.push(t.context("no workers.stacks_dumped event")?);
            off.push(
                stop_python_workers(a, Launcher::Rally, n, false)?
                    .0
                    .context("rally without the dump was cut off")?,
            );
            theirs.push(
                stop_python_workers(a, Launcher::Torchrun, n, false)?
                    .0
                    .context("torchrun was cut off")?,
            );
        }
        let (on, off, theirs, took) = (median(on), median(off), median(theirs), median(took));
        println!(
            "{n:>4} {on:>14.1} {off:>12.1} {theirs:>12.1} {:>10.1} {took:>10.1} {:>12.1}x",
            on - off,
            theirs / on
        );
    }
    Ok(())
}
