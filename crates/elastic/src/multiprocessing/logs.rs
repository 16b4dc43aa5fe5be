//! Log directories and the pumps that carry worker output to files and the console.
//!
//! Layout, as torchrun's: `<log_dir>/<run_id>_<suffix>/attempt_<n>/<local_rank>/`
//! holding `stdout.log`, `stderr.log` and `error.json`. The attempt directory is
//! wiped and recreated for each attempt.
//!
//! Every worker stream is a pipe read by its own pump thread. The pump appends raw
//! bytes to the stream's file (when redirected or teed) and writes whole, prefixed
//! lines to the console (when teed, or not redirected at all) under the console's
//! lock, so lines of different workers never interleave mid-line. A pump stops at
//! end of file, or — when the worker has exited but a grandchild still holds the
//! pipe open — once the pipe has been quiet for [`DRAIN_AFTER_EXIT`], so such a
//! grandchild never hangs the launcher. Pumps never block a worker: they read as
//! fast as the file and console accept, and a console write error drops console
//! output rather than stalling the file.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::spec::{LogsSpec, Std};

/// How long a pump keeps reading after its worker exited, once the pipe is quiet.
pub const DRAIN_AFTER_EXIT: Duration = Duration::from_millis(100);
const CHUNK: usize = 256 * 1024;

/// The per-run log directory (`<log_dir>/<run_id>_<suffix>`).
#[derive(Debug, Clone)]
pub struct RunLogs {
    pub dir: PathBuf,
}

/// Paths of one worker's files in one attempt.
#[derive(Debug, Clone)]
pub struct WorkerLogs {
    pub dir: PathBuf,
    pub stdout: PathBuf,
    pub stderr: PathBuf,
    pub error_file: PathBuf,
    /// Where a function worker writes its return value.
    pub return_value: PathBuf,
}

/// Why a log directory could not be prepared.
#[derive(Debug, thiserror::Error)]
#[error("cannot prepare log directory {path}")]
pub struct LogDirError {
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

fn suffix() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    format!("{:08x}", h.finish() as u32)
}

impl RunLogs {
    /// Creates `<log_dir>/<run_id>_<suffix>` (a fresh temporary base when the spec
    /// has no `log_dir`).
    pub fn create(spec: &LogsSpec, run_id: &str) -> Result<RunLogs, LogDirError> {
        let base = match &spec.log_dir {
            Some(d) => d.clone(),
            None => std::env::temp_dir().join(format!("torchelastic_{}", suffix())),
        };
        let dir = base.join(format!("{run_id}_{}", suffix()));
        std::fs::create_dir_all(&dir).map_err(|source| LogDirError {
            path: dir.clone(),
            source,
        })?;
        Ok(RunLogs { dir })
    }

    /// Wipes and recreates `attempt_<n>/<rank>/` for every local rank.
    pub fn attempt(&self, attempt: u32, nprocs: usize) -> Result<Vec<WorkerLogs>, LogDirError> {
        let dir = self.dir.join(format!("attempt_{attempt}"));
        let err = |path: &Path| {
            let path = path.to_owned();
            move |source| LogDirError { path, source }
        };
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(err(&dir)(e)),
        }
        (0..nprocs)
            .map(|rank| {
                let d = dir.join(rank.to_string());
                std::fs::create_dir_all(&d).map_err(err(&d))?;
                Ok(WorkerLogs {
                    stdout: d.join("stdout.log"),
                    stderr: d.join("stderr.log"),
                    error_file: d.join("error.json"),
                    return_value: d.join("return_value"),
                    dir: d,
                })
            })
            .collect()
    }
}

/// Which console stream a pump writes to.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Console {
    Stdout,
    Stderr,
}

/// Where one worker stream goes.
pub(crate) struct Route {
    pub file: Option<PathBuf>,
    pub console: Option<(Console, String)>,
}

/// Decides the route of one stream from the spec.
pub(crate) fn route(
    spec: &LogsSpec,
    local_rank: usize,
    stream: Std,
    file: &Path,
    prefix: &str,
) -> Route {
    let pick = |s: Std| {
        if stream == Std::Out {
            s.stdout()
        } else {
            s.stderr()
        }
    };
    let tee = pick(spec.tee.get(local_rank));
    let redirect = tee || pick(spec.redirects.get(local_rank));
    let shown = spec
        .local_ranks_filter
        .as_ref()
        .is_none_or(|f| f.contains(&local_rank));
    let console = if stream == Std::Out {
        Console::Stdout
    } else {
        Console::Stderr
    };
    Route {
        file: redirect.then(|| file.to_owned()),
        console: ((tee || !redirect) && shown).then(|| (console, prefix.to_owned())),
    }
}

/// A running pump.
pub(crate) struct Pump {
    thread: Option<JoinHandle<()>>,
}

impl Pump {
    /// Starts pumping `pipe`. `exited` is set by the owner when the worker exits.
    pub(crate) fn start(
        pipe: OwnedFd,
        route: Route,
        exited: Arc<AtomicBool>,
    ) -> std::io::Result<Pump> {
        let file = match &route.file {
            Some(p) => Some(File::create(p)?),
            None => None,
        };
        let thread = std::thread::Builder::new()
            .name("rally-log-pump".into())
            .spawn(move || pump(pipe, file, route.console, &exited))?;
        Ok(Pump {
            thread: Some(thread),
        })
    }

    /// Waits for the pump to finish.
    pub(crate) fn join(&mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Waits up to `ms` for `fd` to be readable (or hung up). True if it is.
fn readable(fd: RawFd, ms: i32) -> bool {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let n = unsafe { libc::poll(&mut pfd, 1, ms) };
    n > 0
}

fn pump(
    pipe: OwnedFd,
    mut file: Option<File>,
    console: Option<(Console, String)>,
    exited: &AtomicBool,
) {
    let mut src = File::from(pipe);
    let mut buf = vec![0u8; CHUNK];
    let mut partial: Vec<u8> = Vec::new();
    let mut console = console;
    let mut quiet_since: Option<Instant> = None;
    loop {
        if !readable(src.as_raw_fd(), 20) {
            if exited.load(Ordering::Acquire) {
                let since = *quiet_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= DRAIN_AFTER_EXIT {
                    break; // a grandchild holds the pipe; stop anyway
                }
            }
            continue;
        }
        quiet_since = None;
        let n = match src.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        let chunk = &buf[..n];
        if let Some(f) = &mut file {
            if f.write_all(chunk).is_err() {
                file = None;
            }
        }
        if let Some((which, prefix)) = &console {
            if write_lines(*which, prefix, &mut partial, chunk).is_err() {
                console = None;
            }
        }
    }
    if let Some((which, prefix)) = &console {
        if !partial.is_empty() {
            partial.push(b'\n');
            let _ = write_lines(
                *which,
                prefix,
                &mut Vec::new(),
                &std::mem::take(&mut partial),
            );
        }
    }
}

/// Writes the complete lines of `partial + chunk`, each prefixed, in one locked
/// write; keeps the unfinished tail in `partial`.
fn write_lines(
    which: Console,
    prefix: &str,
    partial: &mut Vec<u8>,
    chunk: &[u8],
) -> std::io::Result<()> {
    let Some(last_nl) = chunk.iter().rposition(|&b| b == b'\n') else {
        partial.extend_from_slice(chunk);
        return Ok(());
    };
    let (complete, tail) = chunk.split_at(last_nl + 1);
    let mut out = Vec::with_capacity(complete.len() + partial.len() + 64);
    let mut line_start = true;
    for part in [partial.as_slice(), complete] {
        for piece in part.split_inclusive(|&b| b == b'\n') {
            if line_start {
                out.extend_from_slice(prefix.as_bytes());
                out.push(b' ');
            }
            out.extend_from_slice(piece);
            line_start = piece.ends_with(b"\n");
        }
    }
    partial.clear();
    partial.extend_from_slice(tail);
    match which {
        Console::Stdout => std::io::stdout().lock().write_all(&out),
        Console::Stderr => std::io::stderr().lock().write_all(&out),
    }
}
