//! Start, watch and stop a group of worker processes.
//!
//! [`start_processes`] starts one process per local rank, each in its own session
//! (and so its own process group), with its own arguments and environment (the parent's, plus the rank's
//! map, plus `TORCHELASTIC_ERROR_FILE`). It returns a [`ProcessContext`] that polls
//! or waits for the group, reports each failure (exit code or signal, error-file
//! contents, time), and stops everyone with [`ProcessContext::close`]: the signal to
//! every process group, output still drained during the grace period, then SIGKILL.
//!
//! Process discipline: the launcher becomes a child subreaper, so grandchildren
//! orphaned by a worker are re-parented to it and reaped (`waitpid(-pgid)`); each
//! worker gets `PR_SET_PDEATHSIG = SIGKILL` as a safety net, so no worker outlives
//! a launcher killed with SIGKILL. The parent-death signal fires when the spawning
//! *thread* exits, so start workers from a thread that lives as long as they do.
//!
//! Bad input — ranks missing from, or extra in, the argument and environment maps, a
//! program that does not exist, an unwritable log directory — is an error that
//! names the problem, and leaves nothing running.

mod context;
pub mod functions;
pub mod logs;
pub mod signals;
pub mod spec;
pub mod stacks;
pub mod watchdog;

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::os::fd::OwnedFd;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

pub use context::{
    signal_name, Exit, ProcessContext, ProcessFailure, RunResult, Waited, KILL_WAIT,
};
pub use logs::{RunLogs, WorkerLogs};
pub use spec::{expand_prefix, LogsSpec, PerRank, SpecError, Std, DEFAULT_PREFIX_TEMPLATE};

use crate::errors::ERROR_FILE_ENV;
use context::Worker;
use logs::{route, Pump, Route, Stream};

/// What each worker runs.
#[derive(Debug, Clone)]
pub enum Entrypoint {
    /// A program, found on `PATH` if it has no slash.
    Program(OsString),
    /// A function registered in this binary's [`functions::Registry`]: the worker
    /// re-executes the current binary, which must call [`functions::dispatch`].
    Function(String),
}

/// One start of a worker group.
#[derive(Debug, Clone)]
pub struct StartSpec {
    /// Name for logs and errors (torchrun uses the role).
    pub name: String,
    pub entrypoint: Entrypoint,
    /// Arguments per local rank; must cover exactly 0..n.
    pub args: BTreeMap<usize, Vec<OsString>>,
    /// Extra environment per local rank; must cover exactly 0..n.
    pub envs: BTreeMap<usize, BTreeMap<String, String>>,
    /// Global rank per local rank, for the `${rank}` prefix (defaults to local rank).
    pub global_ranks: BTreeMap<usize, usize>,
    /// CPUs and memory nodes per local rank (see [`crate::numa`]), applied in
    /// the child before exec; a rank not in the map runs unbound.
    pub bindings: BTreeMap<usize, crate::numa::Binding>,
}

/// Why workers could not be started. Nothing is left running after any of these.
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    #[error("{what} must cover local ranks 0..{n}: missing {missing:?}, extra {extra:?}")]
    Ranks {
        what: &'static str,
        n: usize,
        missing: Vec<usize>,
        extra: Vec<usize>,
    },
    #[error("no workers to start")]
    Empty,
    #[error(transparent)]
    LogDir(#[from] logs::LogDirError),
    #[error("cannot start {program:?} for local rank {local_rank}")]
    Program {
        program: OsString,
        local_rank: usize,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot set up output of local rank {local_rank}")]
    Output {
        local_rank: usize,
        #[source]
        source: std::io::Error,
    },
}

fn check_ranks<T>(what: &'static str, n: usize, m: &BTreeMap<usize, T>) -> Result<(), SpawnError> {
    let missing: Vec<usize> = (0..n).filter(|r| !m.contains_key(r)).collect();
    let extra: Vec<usize> = m.keys().copied().filter(|&r| r >= n).collect();
    if missing.is_empty() && extra.is_empty() {
        Ok(())
    } else {
        Err(SpawnError::Ranks {
            what,
            n,
            missing,
            extra,
        })
    }
}

/// Becomes a child subreaper, once per process.
fn become_subreaper() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: prctl with an integer argument.
        let r = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
        if r != 0 {
            tracing::warn!(error = %std::io::Error::last_os_error(), "could not become a child subreaper; orphaned grandchildren will not be reaped here");
        }
    });
}

/// Starts `spec.args.len()` workers with logs under `logs` (one entry per local rank,
/// from [`RunLogs::attempt`]) routed as `logs_spec` says.
pub fn start_processes(
    spec: &StartSpec,
    logs_spec: &LogsSpec,
    logs: &[WorkerLogs],
) -> Result<ProcessContext, SpawnError> {
    let n = spec.args.len();
    if n == 0 {
        return Err(SpawnError::Empty);
    }
    check_ranks("args", n, &spec.args)?;
    check_ranks("envs", n, &spec.envs)?;
    if logs.len() != n {
        return Err(SpawnError::Ranks {
            what: "log directories",
            n,
            missing: (logs.len()..n).collect(),
            extra: (n..logs.len()).collect(),
        });
    }
    become_subreaper();
    let parent = std::process::id() as libc::pid_t;
    // Spawn everyone first, then start one pump for all pipes: forking stays cheap
    // while the launcher has no pump threads yet (pipes buffer output meanwhile).
    let mut workers: Vec<Worker> = Vec::with_capacity(n);
    let mut streams: Vec<Stream> = Vec::with_capacity(2 * n);
    for (local_rank, worker_logs) in logs.iter().enumerate() {
        match spawn_one(spec, logs_spec, worker_logs, local_rank, parent) {
            Ok((w, s)) => {
                workers.push(w);
                streams.extend(s);
            }
            Err(e) => {
                // Leave nothing running.
                ProcessContext::new(spec.name.clone(), workers, None)
                    .close(libc::SIGKILL, std::time::Duration::from_secs(1));
                return Err(e);
            }
        }
    }
    if streams.is_empty() {
        return Ok(ProcessContext::new(spec.name.clone(), workers, None));
    }
    match Pump::start(streams) {
        Ok(pump) => Ok(ProcessContext::new(spec.name.clone(), workers, Some(pump))),
        Err(source) => {
            ProcessContext::new(spec.name.clone(), workers, None)
                .close(libc::SIGKILL, std::time::Duration::from_secs(1));
            Err(SpawnError::Output {
                local_rank: 0,
                source,
            })
        }
    }
}

/// The name of this host (`gethostname`, as Python's `socket.gethostname()`).
pub fn hostname() -> String {
    rallypoint_store::host::hostname()
}

fn spawn_one(
    spec: &StartSpec,
    logs_spec: &LogsSpec,
    logs: &WorkerLogs,
    local_rank: usize,
    parent: libc::pid_t,
) -> Result<(Worker, Vec<Stream>), SpawnError> {
    let (program, mut cmd) = match &spec.entrypoint {
        Entrypoint::Program(p) => (p.clone(), Command::new(p)),
        Entrypoint::Function(name) => {
            let exe = std::env::current_exe().map_err(|source| SpawnError::Program {
                program: "<current executable>".into(),
                local_rank,
                source,
            })?;
            let mut c = Command::new(&exe);
            c.env(functions::FUNCTION_ENV, name)
                .env(functions::RESULT_ENV, &logs.return_value);
            (exe.into_os_string(), c)
        }
    };
    let rank = spec
        .global_ranks
        .get(&local_rank)
        .copied()
        .unwrap_or(local_rank);
    let prefix = expand_prefix(
        &logs_spec.prefix_template,
        &spec.name,
        local_rank,
        rank,
        &hostname(),
    );
    let routes = [
        route(logs_spec, local_rank, Std::Out, &logs.stdout, &prefix),
        route(logs_spec, local_rank, Std::Err, &logs.stderr, &prefix),
    ];
    let mut stdio = Vec::with_capacity(2);
    for r in &routes {
        stdio.push(match r {
            Route::Inherit => Stdio::inherit(),
            Route::Discard => Stdio::null(),
            Route::File(path) => Stdio::from(
                std::fs::File::create(path)
                    .map_err(|source| SpawnError::Output { local_rank, source })?,
            ),
            Route::Tee { .. } => Stdio::piped(),
        });
    }
    let [out, err]: [Stdio; 2] = stdio.try_into().expect("two streams");
    // stdin is inherited, as under torchrun (`breakpoint()` works in a terminal).
    cmd.args(&spec.args[&local_rank])
        .envs(&spec.envs[&local_rank])
        .env(ERROR_FILE_ENV, &logs.error_file)
        .stdout(out)
        .stderr(err);
    let binding = spec
        .bindings
        .get(&local_rank)
        .map(crate::numa::Binding::prepare);
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            if let Some(b) = &binding {
                b.apply()?;
            }
            // A session of its own, as torchrun's `start_new_session=True`: the
            // worker's process group is signalled as one, and the terminal's job
            // control leaves it alone (reading an inherited terminal never stops
            // it with SIGTTIN; Ctrl-C reaches the launcher, which forwards it).
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
            // The launcher may have died between fork and prctl.
            if libc::getppid() != parent {
                libc::_exit(1);
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().map_err(|source| SpawnError::Program {
        program: program.clone(),
        local_rank,
        source,
    })?;
    let pid = child.id();
    let exited = Arc::new(AtomicBool::new(false));
    let pipes: [Option<OwnedFd>; 2] = [
        child.stdout.take().map(Into::into),
        child.stderr.take().map(Into::into),
    ];
    let streams = routes
        .into_iter()
        .zip(pipes)
        .filter_map(|(r, pipe)| match (r, pipe) {
            (
                Route::Tee {
                    file,
                    console,
                    prefix,
                },
                Some(pipe),
            ) => Some(Stream {
                pipe,
                file,
                console,
                prefix,
                exited: exited.clone(),
            }),
            _ => None,
        })
        .collect();
    Ok((Worker::new(local_rank, pid, logs.clone(), exited), streams))
}
