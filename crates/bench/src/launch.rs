//! `rallypoint-bench launch`: our launcher against PyTorch's `start_processes` for
//! the same work, in the same run (PyTorch's side is `crates/bench/py/launch_bench.py`):
//!
//! - start and reap N workers of `true` (median of R rounds);
//! - stream B bytes of 100-byte lines through tee (file + console; the console is
//!   `/dev/null`), as MB/s; the run fails if our console dropped any line;
//! - stream the same bytes to an inherited stdout (torchrun's default), as MB/s;
//! - stop a group of workers that obey SIGTERM: time from `close` to all reaped.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rallypoint_elastic::multiprocessing::{
    start_processes, Entrypoint, LogsSpec, PerRank, RunLogs, StartSpec, Std,
};

#[derive(clap::Args, Clone)]
pub struct LaunchArgs {
    /// Workers of `true` to start and reap.
    #[arg(long, default_value_t = 64)]
    workers: usize,
    /// Rounds of the start and stop measurements (the median is reported).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Bytes streamed through tee.
    #[arg(long, default_value_t = 1_000_000_000)]
    tee_bytes: u64,
    /// Workers in the stop measurement.
    #[arg(long, default_value_t = 8)]
    stop_workers: usize,
}

fn spec(program: &str, args: &[&str], n: usize) -> StartSpec {
    StartSpec {
        name: "bench".into(),
        entrypoint: Entrypoint::Program(program.into()),
        args: (0..n)
            .map(|i| (i, args.iter().map(OsString::from).collect()))
            .collect(),
        envs: (0..n).map(|i| (i, BTreeMap::new())).collect(),
        global_ranks: BTreeMap::new(),
        bindings: Default::default(),
    }
}

/// The tee worker: `bytes` of 100-byte lines in 1 MiB writes.
pub fn produce(bytes: u64) -> Result<()> {
    let mut line = vec![b'x'; 99];
    line.push(b'\n');
    let block: Vec<u8> = line.iter().copied().cycle().take(1 << 20).collect();
    let mut out = std::io::stdout().lock();
    let mut left = bytes;
    while left > 0 {
        let n = left.min(block.len() as u64) as usize;
        out.write_all(&block[..n])?;
        left -= n as u64;
    }
    out.flush()?;
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs PyTorch's side; returns the seconds of each `RESULT` line.
fn torch(mode: &[&str], quiet_stdout: bool) -> Result<Vec<f64>> {
    let out = Command::new(crate::fixtures::python())
        .arg(crate::fixtures::repo_root().join("crates/bench/py/launch_bench.py"))
        .args(mode)
        .stdout(if quiet_stdout {
            Stdio::null()
        } else {
            Stdio::inherit()
        })
        .stderr(Stdio::piped())
        .output()
        .context("running PyTorch's side")?;
    let err = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        bail!("PyTorch's side failed: {err}");
    }
    Ok(err
        .lines()
        .filter_map(|l| l.strip_prefix("RESULT "))
        .filter_map(|l| l.split_whitespace().nth(1)?.parse().ok())
        .collect())
}

/// Points fd 1 at /dev/null while `f` runs (our pumps write the console there).
fn with_quiet_stdout<T>(f: impl FnOnce() -> T) -> Result<T> {
    std::io::stdout().flush()?;
    let null = std::fs::OpenOptions::new().write(true).open("/dev/null")?;
    // SAFETY: dup/dup2 on valid descriptors; fd 1 is restored before returning.
    unsafe {
        let saved = libc::dup(1);
        libc::dup2(std::os::fd::AsRawFd::as_raw_fd(&null), 1);
        let r = f();
        std::io::stdout().flush()?;
        libc::dup2(saved, 1);
        libc::close(saved);
        Ok(r)
    }
}

pub fn run(args: LaunchArgs) -> Result<()> {
    let dir = tempfile::tempdir()?;
    let quiet = LogsSpec {
        log_dir: Some(dir.path().to_owned()),
        ..LogsSpec::default()
    };
    println!("# launch benchmark: rally vs torch start_processes, same run");

    // Start and reap N workers of `true`.
    let mut ours = Vec::new();
    for round in 0..args.rounds {
        let t = Instant::now();
        let run = RunLogs::create(&quiet, &format!("start{round}"))?;
        let mut ctx = start_processes(
            &spec("true", &[], args.workers),
            &quiet,
            &run.attempt(0, args.workers)?,
        )?;
        let r = ctx
            .wait(Some(Duration::from_secs(120)), Duration::from_millis(1))
            .context("workers did not finish")?;
        anyhow::ensure!(!r.is_failed(), "a worker failed: {:?}", r.failures);
        ours.push(t.elapsed().as_secs_f64());
    }
    let o = median(ours);
    let (workers, rounds) = (args.workers.to_string(), args.rounds.to_string());
    for (label, period) in [("default wait()", "default"), ("wait(period=1ms)", "0.001")] {
        let t = median(torch(&["start", &workers, &rounds, period], false)?);
        println!(
            "start+reap {} x true (ms)        rally {:>9.1}   torch {:>9.1}   rally {:.1}x faster  (torch {label})",
            args.workers,
            o * 1e3,
            t * 1e3,
            t / o
        );
    }

    // Bytes through tee.
    let tee = LogsSpec {
        log_dir: Some(dir.path().to_owned()),
        tee: PerRank::All(Std::Out),
        ..LogsSpec::default()
    };
    let exe = std::env::current_exe()?;
    let exe = exe.to_str().context("executable path is not UTF-8")?;
    let bytes = args.tee_bytes.to_string();
    // One producer worker under `logs`, stdout at /dev/null: seconds to its
    // exit, and its run's log directory.
    let stream = |logs: &LogsSpec, name: &str| -> Result<(f64, RunLogs)> {
        with_quiet_stdout(|| -> Result<(f64, RunLogs)> {
            let t = Instant::now();
            let run = RunLogs::create(logs, name)?;
            let mut ctx = start_processes(
                &spec(exe, &["produce", &bytes], 1),
                logs,
                &run.attempt(0, 1)?,
            )?;
            let r = ctx
                .wait(Some(Duration::from_secs(600)), Duration::from_millis(1))
                .with_context(|| format!("{name} worker did not finish"))?;
            anyhow::ensure!(!r.is_failed(), "{name} worker failed");
            Ok((t.elapsed().as_secs_f64(), run))
        })?
    };
    let (o, run) = stream(&tee, "tee")?;
    let len = std::fs::metadata(run.dir.join("attempt_0/0/stdout.log"))?.len();
    anyhow::ensure!(
        len == args.tee_bytes,
        "lost output: {len} of {} bytes",
        args.tee_bytes
    );
    // A console that fell behind drops lines (they stay in the file): then the
    // console did less work than torch's, and the figure is not comparable.
    let dropped = rallypoint_elastic::multiprocessing::logs::console_lines_dropped();
    anyhow::ensure!(
        dropped == 0,
        "the console dropped {dropped} lines: the tee figure would not be like for like"
    );
    let t = median(torch(&["tee", &args.tee_bytes.to_string(), exe], true)?);
    let mb = args.tee_bytes as f64 / 1e6;
    println!(
        "tee {:.0} MB to file+console (MB/s)  rally {:>9.0}   torch {:>9.0}   rally {:.1}x faster  (0 console lines dropped)",
        mb,
        mb / o,
        mb / t,
        t / o
    );

    // The same bytes with nothing asking for capture: the worker inherits the
    // launcher's stdout (here /dev/null) under both launchers.
    let (o, _) = stream(&quiet, "inherit")?;
    let t = median(torch(&["inherit", &args.tee_bytes.to_string(), exe], true)?);
    println!(
        "{:.0} MB inherited stdout (MB/s)     rally {:>9.0}   torch {:>9.0}   rally {:.1}x faster",
        mb,
        mb / o,
        mb / t,
        t / o
    );

    // Stop a group that obeys SIGTERM.
    let mut ours = Vec::new();
    for round in 0..args.rounds {
        let run = RunLogs::create(&quiet, &format!("stop{round}"))?;
        let mut ctx = start_processes(
            &spec("sleep", &["30"], args.stop_workers),
            &quiet,
            &run.attempt(0, args.stop_workers)?,
        )?;
        std::thread::sleep(Duration::from_millis(300));
        let t = Instant::now();
        ctx.close(libc::SIGTERM, Duration::from_secs(30));
        ours.push(t.elapsed().as_secs_f64());
    }
    let theirs = torch(
        &[
            "stop",
            &args.stop_workers.to_string(),
            &args.rounds.to_string(),
        ],
        false,
    )?;
    let (o, t) = (median(ours), median(theirs));
    println!(
        "stop {} workers on SIGTERM (ms)     rally {:>9.2}   torch {:>9.2}   rally {:.1}x faster",
        args.stop_workers,
        o * 1e3,
        t * 1e3,
        t / o
    );
    Ok(())
}
