//! `rally run`: torchrun's command line on the rallypoint agent.
//!
//! Every torchrun flag is accepted in both spellings (`--nproc-per-node`,
//! `--nproc_per_node`) with its `PET_*` environment default, and means what it
//! means to torchrun. The flags become an [`AgentSpec`] and rendezvous
//! parameters; the agent does the rest. Exit codes: 0 success, 1 the job failed,
//! 2 bad command line, 3 the rendezvous failed, 4 the agent could not run the
//! workers, 128 + N stopped by signal N.

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use rallypoint_elastic::agent::events::{AgentEvent, EventSink, Fanout, JsonLines};
use rallypoint_elastic::agent::{status, Agent, AgentSpec, FailureRecord, Outcome};
use rallypoint_elastic::multiprocessing::signals::{parse_signals, DEFAULT_SIGNALS};
use rallypoint_elastic::multiprocessing::stacks::WorkerStacks;
use rallypoint_elastic::multiprocessing::watchdog;
use rallypoint_elastic::multiprocessing::{Entrypoint, LogsSpec, PerRank, DEFAULT_PREFIX_TEMPLATE};
use rallypoint_elastic::numa;
use rallypoint_rendezvous::registry::Registry;
use rallypoint_rendezvous::RendezvousParameters;

/// torchrun's flags (and a few of rallypoint's own, marked so).
#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// Number of nodes, `N` or `MIN:MAX`.
    #[arg(long, env = "PET_NNODES", default_value = "1:1")]
    nnodes: String,
    /// Workers per node: a number, `cpu`, `gpu` or `auto`.
    #[arg(
        long = "nproc-per-node",
        visible_alias = "nproc_per_node",
        env = "PET_NPROC_PER_NODE",
        default_value = "1"
    )]
    nproc_per_node: String,
    /// Rendezvous backend: `static`, `c10d`, `etcd` (if built in), or registered.
    #[arg(
        long = "rdzv-backend",
        visible_alias = "rdzv_backend",
        env = "PET_RDZV_BACKEND",
        default_value = "static"
    )]
    rdzv_backend: String,
    /// Rendezvous endpoint, `host[:port]`.
    #[arg(
        long = "rdzv-endpoint",
        visible_alias = "rdzv_endpoint",
        env = "PET_RDZV_ENDPOINT",
        default_value = ""
    )]
    rdzv_endpoint: String,
    /// Run id shared by every node of the job.
    #[arg(
        long = "rdzv-id",
        visible_alias = "rdzv_id",
        env = "PET_RDZV_ID",
        default_value = "none"
    )]
    rdzv_id: String,
    /// Backend options, `k1=v1,k2=v2`.
    #[arg(
        long = "rdzv-conf",
        visible_alias = "rdzv_conf",
        env = "PET_RDZV_CONF",
        default_value = ""
    )]
    rdzv_conf: String,
    /// One node, with its own rendezvous store on a free port and a random run id.
    #[arg(long, env = "PET_STANDALONE")]
    standalone: bool,
    /// Failed rounds tolerated before the job fails (job-wide).
    #[arg(
        long = "max-restarts",
        visible_alias = "max_restarts",
        env = "PET_MAX_RESTARTS",
        default_value_t = 0
    )]
    max_restarts: u32,
    /// Seconds between health checks (a worker's exit is seen at once regardless).
    #[arg(
        long = "monitor-interval",
        visible_alias = "monitor_interval",
        env = "PET_MONITOR_INTERVAL",
        default_value_t = 0.1
    )]
    monitor_interval: f64,
    /// Accepted for compatibility; programs are always started with fork+exec.
    #[arg(long = "start-method", visible_alias = "start_method", env = "PET_START_METHOD", default_value = "spawn",
          value_parser = ["spawn", "fork", "forkserver"])]
    start_method: String,
    /// `null` (default) or `console` (events as JSON lines on stderr).
    #[arg(
        long = "event-log-handler",
        visible_alias = "event_log_handler",
        env = "PET_EVENT_LOG_HANDLER",
        default_value = "null"
    )]
    event_log_handler: String,
    /// Role of the workers.
    #[arg(long, env = "PET_ROLE", default_value = "default")]
    role: String,
    /// Run the script as a Python module (`python -m`).
    #[arg(short = 'm', long, env = "PET_MODULE")]
    module: bool,
    /// Run the script directly, not under Python.
    #[arg(long = "no-python", visible_alias = "no_python", env = "PET_NO_PYTHON")]
    no_python: bool,
    /// torchrun runs the script in-process with runpy; here it runs under Python.
    #[arg(long = "run-path", visible_alias = "run_path", env = "PET_RUN_PATH")]
    run_path: bool,
    /// Base directory of per-run logs.
    #[arg(long = "log-dir", visible_alias = "log_dir", env = "PET_LOG_DIR")]
    log_dir: Option<PathBuf>,
    /// Streams to files only: 0-3 or per local rank (`0:1,1:2`).
    #[arg(short = 'r', long, env = "PET_REDIRECTS", default_value = "0")]
    redirects: String,
    /// Streams to files and the console: 0-3 or per local rank.
    #[arg(short = 't', long, env = "PET_TEE", default_value = "0")]
    tee: String,
    /// Prefix of teed console lines; `${role_name}`, `${local_rank}`, `${rank}`
    /// and `${hostname}` expand (default `[${role_name}${local_rank}]:`; also
    /// `TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`). Only teed output (`-t`) is
    /// prefixed, as under torchrun.
    #[arg(
        long = "log-line-prefix-template",
        visible_alias = "log_line_prefix_template",
        env = "PET_LOG_LINE_PREFIX_TEMPLATE"
    )]
    log_line_prefix_template: Option<String>,
    /// Local ranks whose output reaches the console, `0,1`.
    #[arg(
        long = "local-ranks-filter",
        visible_alias = "local_ranks_filter",
        env = "PET_LOCAL_RANKS_FILTER",
        default_value = ""
    )]
    local_ranks_filter: String,
    /// Not supported yet (an error if given).
    #[arg(
        long = "duplicate-stdout-filters",
        visible_alias = "duplicate_stdout_filters",
        env = "PET_DUPLICATE_STDOUT_FILTERS",
        default_value = ""
    )]
    duplicate_stdout_filters: String,
    /// Not supported yet (an error if given).
    #[arg(
        long = "duplicate-stderr-filters",
        visible_alias = "duplicate_stderr_filters",
        env = "PET_DUPLICATE_STDERR_FILTERS",
        default_value = ""
    )]
    duplicate_stderr_filters: String,
    /// This node's rank (static backend only).
    #[arg(
        long = "node-rank",
        visible_alias = "node_rank",
        env = "PET_NODE_RANK",
        default_value_t = 0
    )]
    node_rank: usize,
    /// Address of the static backend's store (rank 0's node).
    #[arg(
        long = "master-addr",
        visible_alias = "master_addr",
        env = "PET_MASTER_ADDR",
        default_value = "127.0.0.1"
    )]
    master_addr: String,
    /// Port of the static backend's store.
    #[arg(
        long = "master-port",
        visible_alias = "master_port",
        env = "PET_MASTER_PORT"
    )]
    master_port: Option<u16>,
    /// Address this node advertises.
    #[arg(
        long = "local-addr",
        visible_alias = "local_addr",
        env = "PET_LOCAL_ADDR"
    )]
    local_addr: Option<String>,
    /// Python entry points; not available here (an error if given).
    #[arg(long = "logs-specs", visible_alias = "logs_specs")]
    logs_specs: Option<String>,
    /// Bind each local rank to the CPUs nearest its GPU (GPU i serves local
    /// rank i), memory preferred on the same nodes: node (the GPU's NUMA
    /// node), socket (every node of its socket), exclusive (the node's cores
    /// split among its GPUs), core-complex (one L3 complex per GPU). Without a
    /// GPU, workers run unbound (said on the console).
    #[arg(long = "numa-binding", visible_alias = "numa_binding",
          value_parser = ["node", "socket", "exclusive", "core-complex"])]
    numa_binding: Option<String>,
    /// (rallypoint) Do not read the Python stacks of workers before stopping
    /// them (by default each is written to `stacks.txt` in its log directory
    /// and summarised in the failure report).
    #[arg(long = "no-stack-dump")]
    no_stack_dump: bool,
    /// (rallypoint) Seconds the stack dump may take, for all workers together.
    #[arg(long = "stack-dump-timeout", default_value_t = 5.0)]
    stack_dump_timeout: f64,
    /// Signals trapped and forwarded to the workers.
    #[arg(long = "signals-to-handle", visible_alias = "signals_to_handle", env = "PET_SIGNALS_TO_HANDLE", default_value = DEFAULT_SIGNALS)]
    signals_to_handle: String,
    /// Seconds between the stop signal and SIGKILL (else
    /// `TORCH_ELASTIC_SHUTDOWN_TIMEOUT`, else 30).
    #[arg(
        long = "shutdown-timeout",
        visible_alias = "shutdown_timeout",
        env = "PET_SHUTDOWN_TIMEOUT"
    )]
    shutdown_timeout: Option<u64>,
    /// Every worker gets `LOCAL_RANK=0` and one device.
    #[arg(
        long = "virtual-local-rank",
        visible_alias = "virtual_local_rank",
        env = "PET_VIRTUAL_LOCAL_RANK"
    )]
    virtual_local_rank: bool,
    /// (rallypoint) Seconds every node waits for the others once its workers
    /// succeeded (torchrun: 300, fixed).
    #[arg(
        long = "exit-barrier-timeout",
        env = "RALLY_EXIT_BARRIER_TIMEOUT",
        default_value_t = 300.0
    )]
    exit_barrier_timeout: f64,
    /// (rallypoint) Seconds the rendezvous store may stay unreachable (in a
    /// join, a start, while workers run, at the exit barrier) before this node
    /// gives up on it ("lost the rendezvous host"). Default: the store's read
    /// timeout (`--rdzv-conf read_timeout`, 60 s), so a busy store is never
    /// taken for a lost one.
    #[arg(long = "rdzv-lost-timeout", env = "RALLY_RDZV_LOST_TIMEOUT")]
    rdzv_lost_timeout: Option<f64>,
    /// (rallypoint) Write events as JSON lines to this file (`-`: stderr).
    #[arg(long, env = "RALLY_EVENTS")]
    events: Option<PathBuf>,
    /// (rallypoint) Serve /status (JSON) and /metrics (Prometheus) on this port.
    #[arg(long = "status-port", env = "RALLY_STATUS_PORT")]
    status_port: Option<u16>,
    /// Print a completion script for `rally` to stdout and exit: bash, zsh,
    /// tcsh (as torchrun), fish, elvish or powershell.
    #[arg(long = "print-completion", visible_alias = "print_completion",
          value_parser = ["bash", "zsh", "tcsh", "fish", "elvish", "powershell"])]
    pub print_completion: Option<String>,
    /// The training script (or module, or program) and its arguments.
    #[arg(required_unless_present = "print_completion", trailing_var_arg = true, num_args = 1..)]
    command: Vec<OsString>,
}

/// `N` or `MIN:MAX`.
fn parse_nnodes(s: &str) -> anyhow::Result<(usize, usize)> {
    let parse = |v: &str| {
        v.trim()
            .parse::<usize>()
            .with_context(|| format!("--nnodes {s:?}: {v:?} is not a number of nodes"))
    };
    let (min, max) = match s.split_once(':') {
        Some((a, b)) => (parse(a)?, parse(b)?),
        None => {
            let n = parse(s)?;
            (n, n)
        }
    };
    if min == 0 || min > max {
        bail!("--nnodes {s:?}: need 0 < MIN <= MAX");
    }
    Ok((min, max))
}

fn gpu_count() -> usize {
    rallypoint_elastic::devices::visible_gpus()
}

fn cpu_count() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn parse_nproc(s: &str) -> anyhow::Result<usize> {
    let n = match s {
        "cpu" => cpu_count(),
        "gpu" => match gpu_count() {
            0 => bail!("--nproc-per-node gpu: no GPUs visible (driver listing /proc/driver/nvidia/gpus, CUDA_VISIBLE_DEVICES={:?})", std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "<unset>".into())),
            n => n,
        },
        "auto" => match gpu_count() {
            0 => cpu_count(),
            n => n,
        },
        "xpu" => bail!("--nproc-per-node xpu: XPU devices are not supported"),
        n => n.parse().ok().filter(|n| *n > 0).with_context(|| {
            format!("--nproc-per-node {n:?}: expected a positive number, cpu, gpu or auto")
        })?,
    };
    Ok(n)
}

/// A run id no other job will have: 128 random bits, uuid-shaped.
fn random_run_id() -> String {
    let mut b = [0u8; 16];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
        .is_err()
    {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        b = (t ^ (u128::from(std::process::id()) << 64)).to_le_bytes();
    }
    // Version 4, variant 1, like Python's uuid4().
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

/// Whether the workers run under a Python interpreter rally chose.
fn runs_python(a: &RunArgs) -> bool {
    let Some(script) = a.command.first() else {
        return false;
    };
    let is_py = Path::new(script).extension().is_some_and(|e| e == "py");
    // A file that is neither .py nor executable is a Python script too.
    let not_executable = || {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(script).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 == 0)
    };
    a.module || a.run_path || (!a.no_python && (is_py || not_executable()))
}

/// The worker entrypoint and its arguments.
fn entrypoint(a: &RunArgs) -> anyhow::Result<(Entrypoint, Vec<OsString>)> {
    let (script, rest) = a
        .command
        .split_first()
        .context("no training script given")?;
    if a.module && a.no_python {
        bail!("--module and --no-python cannot be used together");
    }
    if !runs_python(a) {
        return Ok((Entrypoint::Program(script.clone()), rest.to_vec()));
    }
    let exe = python();
    let mut args: Vec<OsString> = vec!["-u".into()];
    if a.module {
        args.push("-m".into());
    }
    args.push(script.clone());
    args.extend(rest.iter().cloned());
    Ok((Entrypoint::Program(exe), args))
}

/// The interpreter for Python workers: `PYTHON_EXEC`; else a `python` beside
/// this executable (a virtual environment's `bin`, where pip puts `rally`), so
/// a venv's `rally` works without activating the venv, as its `torchrun` does;
/// else `python3` from `PATH`.
fn python() -> OsString {
    python_choice().0
}

/// [`python`] and why it was chosen (for the failure summary).
fn python_choice() -> (OsString, String) {
    if let Some(p) = std::env::var_os("PYTHON_EXEC").filter(|p| !p.is_empty()) {
        let why = "PYTHON_EXEC is set".to_owned();
        return (p, why);
    }
    let exe = std::env::current_exe().ok();
    let beside = exe
        .as_ref()
        .and_then(|exe| Some(exe.parent()?.join("python")));
    match beside {
        Some(p) if is_executable(&p) => {
            let why = format!(
                "PYTHON_EXEC is not set, and it is the python beside this rally ({})",
                exe.as_deref().unwrap_or(Path::new("?")).display()
            );
            (p.into_os_string(), why)
        }
        _ => {
            let why = format!(
                "PYTHON_EXEC is not set, and there is no python beside this rally ({}), so python3 was taken from PATH",
                exe.as_deref().unwrap_or(Path::new("?")).display()
            );
            ("python3".into(), why)
        }
    }
}

/// `name` as `PATH` resolves it, for messages.
fn on_path(name: &OsString) -> PathBuf {
    let p = Path::new(name);
    if p.components().count() > 1 {
        return p.to_owned();
    }
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|d| d.join(p))
        .find(|c| is_executable(c))
        .unwrap_or_else(|| p.to_owned())
}

/// What to tell a user whose Python worker failed (`root`, on this host) in
/// a way a wrong interpreter explains: a `ModuleNotFoundError` seen in its
/// error file or stderr names the interpreter, why it was chosen and how to
/// choose another; a failure whose traceback rally could not see (stderr on
/// the terminal) names the interpreter in one line. Nothing when
/// `PYTHON_EXEC` chose it: the user did.
fn interpreter_hint(root: &FailureRecord) -> Option<String> {
    let (exe, why) = python_choice();
    if std::env::var_os("PYTHON_EXEC").is_some_and(|p| !p.is_empty()) {
        return None;
    }
    let exe = on_path(&exe);
    let text = format!("{}\n{}", root.message, root.traceback);
    let missing = text.lines().rev().find_map(|l| {
        l.trim()
            .strip_prefix("ModuleNotFoundError: No module named ")
    });
    if let Some(module) = missing {
        return Some(format!(
            "rally run: the workers ran {} ({why}), and it has no module {module}. \
             Choose the interpreter with PYTHON_EXEC (e.g. PYTHON_EXEC=/path/to/venv/bin/python rally run ...), \
             or run the rally installed in the environment that has the module (/path/to/venv/bin/rally).",
            exe.display()
        ));
    }
    let unseen = root.exitcode == 1
        && root.traceback.is_empty()
        && root.error_file == rallypoint_elastic::agent::NOT_AVAILABLE
        && root.host == rallypoint_elastic::multiprocessing::hostname();
    unseen.then(|| {
        format!(
            "rally run: the workers ran {} ({why}); if the traceback above is a ModuleNotFoundError, set PYTHON_EXEC to the interpreter that has the module.",
            exe.display()
        )
    })
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Everything the flags decide, checked.
struct Plan {
    spec: AgentSpec,
    params: RendezvousParameters,
    min_nodes: usize,
    max_nodes: usize,
}

fn plan(a: &RunArgs) -> anyhow::Result<Plan> {
    if !a.duplicate_stdout_filters.is_empty() || !a.duplicate_stderr_filters.is_empty() {
        bail!("--duplicate-stdout-filters/--duplicate-stderr-filters are not supported by rally run yet");
    }
    if let Some(s) = &a.logs_specs {
        bail!("--logs-specs {s:?}: Python entry points cannot be loaded by rally run; use --log-dir, -r and -t");
    }
    for (flag, v) in [
        ("--monitor-interval", a.monitor_interval),
        ("--exit-barrier-timeout", a.exit_barrier_timeout),
        ("--rdzv-lost-timeout", a.rdzv_lost_timeout.unwrap_or(1.0)),
        ("--stack-dump-timeout", a.stack_dump_timeout),
    ] {
        if !(v.is_finite() && v > 0.0) {
            bail!("{flag} {v}: expected a positive number of seconds");
        }
    }
    let (mut min_nodes, mut max_nodes) = parse_nnodes(&a.nnodes)?;
    let nproc = parse_nproc(&a.nproc_per_node)?;
    let (mut backend, mut endpoint, mut run_id) = (
        a.rdzv_backend.clone(),
        a.rdzv_endpoint.clone(),
        a.rdzv_id.clone(),
    );
    if a.standalone {
        backend = "c10d".into();
        endpoint = "localhost:0".into();
        run_id = random_run_id();
        (min_nodes, max_nodes) = (1, 1);
    } else if run_id == "none" {
        // torchrun's default id is the same for every job; make one that is not.
        let scheduler = ["SLURM_JOB_ID", "LSB_JOBID", "PBS_JOBID", "FLUX_JOB_ID"]
            .iter()
            .find_map(|v| {
                std::env::var(v)
                    .ok()
                    .map(|id| format!("{}-{id}", v.to_lowercase()))
            });
        run_id = match (scheduler, max_nodes) {
            (Some(id), _) => id,
            (None, 1) => random_run_id(),
            // The static backend's store is the job's own (its port): no
            // other job shares it, and torchrun does not warn either.
            (None, _) if backend == "static" => "none".into(),
            (None, _) => {
                say!("rally run: warning: no --rdzv-id; jobs sharing this rendezvous endpoint will collide (run id \"none\")");
                "none".into()
            }
        };
    }
    let mut config = RendezvousParameters::parse_conf(&a.rdzv_conf)?;
    let lost_grace = match a.rdzv_lost_timeout {
        Some(s) => Duration::from_secs_f64(s),
        None => match config.get("read_timeout") {
            Some(v) => v
                .parse::<f64>()
                .ok()
                .filter(|s| s.is_finite() && *s > 0.0)
                .map(Duration::from_secs_f64)
                .with_context(|| format!("--rdzv-conf read_timeout={v}: expected seconds"))?,
            None => Duration::from_secs(60),
        },
    };
    if backend == "static" {
        if endpoint.is_empty() {
            endpoint = format!("{}:{}", a.master_addr, a.master_port.unwrap_or(29500));
        }
        config.insert("rank".into(), a.node_rank.to_string());
        config
            .entry("timeout".into())
            .or_insert_with(|| "900".into());
    }
    let mut params = RendezvousParameters::new(&backend, &endpoint, &run_id, min_nodes, max_nodes)?;
    params.local_addr = a.local_addr.clone();
    params.config = config;

    let signals = parse_signals(&a.signals_to_handle)
        .map_err(|e| anyhow::anyhow!("--signals-to-handle {:?}: {e}", a.signals_to_handle))?;
    let shutdown = match a.shutdown_timeout {
        Some(s) => s,
        None => match std::env::var("TORCH_ELASTIC_SHUTDOWN_TIMEOUT") {
            Ok(v) => v.trim().parse().with_context(|| {
                format!("TORCH_ELASTIC_SHUTDOWN_TIMEOUT={v:?} is not a number of seconds")
            })?,
            Err(_) => 30,
        },
    };
    let local_ranks_filter = match a.local_ranks_filter.trim() {
        "" => None,
        s => Some(
            s.split(',')
                .map(|r| {
                    r.trim()
                        .parse::<usize>()
                        .with_context(|| format!("--local-ranks-filter {s:?}: {r:?} is not a rank"))
                })
                .collect::<anyhow::Result<BTreeSet<usize>>>()?,
        ),
    };
    let logs = LogsSpec {
        log_dir: a.log_dir.clone(),
        redirects: PerRank::parse(&a.redirects).map_err(|e| anyhow::anyhow!("--redirects: {e}"))?,
        tee: PerRank::parse(&a.tee).map_err(|e| anyhow::anyhow!("--tee: {e}"))?,
        local_ranks_filter,
        // As torchrun: the flag, else the variable, else the default.
        prefix_template: a
            .log_line_prefix_template
            .clone()
            .filter(|t| !t.is_empty())
            .or_else(|| {
                std::env::var("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")
                    .ok()
                    .filter(|t| !t.is_empty())
            })
            .unwrap_or_else(|| DEFAULT_PREFIX_TEMPLATE.into()),
    };
    let (entrypoint, args) = entrypoint(a)?;
    let numa = match &a.numa_binding {
        Some(mode) => numa_bindings(mode, nproc)?,
        None => Vec::new(),
    };
    let spec = AgentSpec {
        role: a.role.clone(),
        local_world_size: nproc,
        entrypoint,
        args,
        max_restarts: a.max_restarts,
        monitor_interval: Duration::from_secs_f64(a.monitor_interval),
        logs,
        signals,
        shutdown_timeout: Duration::from_secs(shutdown),
        exit_barrier_timeout: Duration::from_secs_f64(a.exit_barrier_timeout),
        lost_grace,
        virtual_local_rank: a.virtual_local_rank,
        hostname: rallypoint_elastic::multiprocessing::hostname(),
        local_addr: a.local_addr.clone(),
        mark: Some(watchdog::new_mark()),
        stack_dump: (!a.no_stack_dump).then(|| Duration::from_secs_f64(a.stack_dump_timeout)),
        numa,
    };
    Ok(Plan {
        spec,
        params,
        min_nodes,
        max_nodes,
    })
}

/// Where each of `nproc` local ranks runs under `--numa-binding mode`, from
/// this machine's sysfs (`RALLY_SYSFS_ROOT`, for tests, holds another
/// machine's); printed on the console. No GPU: said, and unbound.
fn numa_bindings(mode: &str, nproc: usize) -> anyhow::Result<Vec<numa::Binding>> {
    let flag = || format!("--numa-binding {mode}");
    let parsed: numa::Mode = mode
        .parse()
        .map_err(|e: String| anyhow::anyhow!(e))
        .with_context(flag)?;
    let root = std::env::var_os("RALLY_SYSFS_ROOT").unwrap_or_else(|| "/".into());
    let topo = numa::Topology::new(root);
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let allowed = numa::allowed_cpus();
    let Some(mut bindings) =
        numa::plan(&topo, parsed, nproc, &allowed, visible.as_deref()).with_context(flag)?
    else {
        say!(
            "rally run: {}: this machine has no GPU to bind near; the workers run unbound",
            flag()
        );
        return Ok(Vec::new());
    };
    let memory = numa::memory_policy_allowed();
    for (rank, b) in bindings.iter_mut().enumerate() {
        if !memory {
            b.mem_nodes.clear();
        }
        say!(
            "rally run: {}: local rank {rank} (GPU {}, NUMA node {}) on CPUs {}{}",
            flag(),
            b.gpu,
            b.node,
            numa::format_list(&b.cpus),
            match b.mem_nodes.is_empty() {
                true => ", memory unbound (set_mempolicy is not permitted here)".to_owned(),
                false => format!(
                    ", memory preferred on node(s) {}",
                    numa::format_list(&b.mem_nodes)
                ),
            }
        );
    }
    Ok(bindings)
}

/// Runs the job; returns the process exit code.
pub fn run(a: RunArgs) -> anyhow::Result<i32> {
    let plan = plan(&a)?;
    // Workers inherit these, as under torchrun.
    if plan.spec.local_world_size > 1 && std::env::var_os("OMP_NUM_THREADS").is_none() {
        say!("rally run: setting OMP_NUM_THREADS=1 for each worker (set it yourself to tune)");
        std::env::set_var("OMP_NUM_THREADS", "1");
    }
    std::env::set_var("TORCHELASTIC_SIGNALS_TO_HANDLE", &a.signals_to_handle);
    // Kills every descendant of the workers if this process dies, SIGKILL
    // included (see the watchdog module).
    let mark = plan.spec.mark.clone().unwrap_or_default();
    // SAFETY: no thread has been started yet (the runtime comes next).
    let watchdog = unsafe { watchdog::fork(&mark) };

    // One runtime thread keeps the hosted store, heartbeats and the status server
    // going while this thread watches the workers.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .context("cannot start the runtime")?;
    let registry = Registry::with_builtins();
    let nodes = match (plan.min_nodes, plan.max_nodes) {
        (a, b) if a == b => a.to_string(),
        (a, b) => format!("{a}:{b}"),
    };
    let handler = match rt.block_on(registry.create_handler(plan.params.clone())) {
        Ok(h) => Arc::<dyn rallypoint_rendezvous::RendezvousHandler>::from(h),
        Err(e) => {
            say!(
                "rally run: cannot set up the {:?} rendezvous: {}",
                plan.params.backend,
                chain(&e)
            );
            return Ok(Outcome::Rendezvous(e).exit_code());
        }
    };
    say!(
        "rally run: run {} | {} rendezvous at {} | nodes {nodes} | {} worker(s) per node | max restarts {}",
        plan.params.run_id,
        plan.params.backend,
        if plan.params.endpoint.is_empty() { "-" } else { &plan.params.endpoint },
        plan.spec.local_world_size,
        plan.spec.max_restarts
    );
    let json: Option<Arc<dyn EventSink>> = match (a.events.as_deref(), a.event_log_handler.as_str())
    {
        (Some(p), _) if p == Path::new("-") => {
            Some(Arc::new(JsonLines::new(Box::new(std::io::stderr()))))
        }
        (Some(p), _) => Some(Arc::new(JsonLines::new(Box::new(
            std::fs::File::create(p).with_context(|| format!("--events {}", p.display()))?,
        )))),
        (None, "console") => Some(Arc::new(JsonLines::new(Box::new(std::io::stderr())))),
        (None, "null") => None,
        (None, other) => bail!("--event-log-handler {other:?}: expected null or console"),
    };
    let mut sinks: Vec<Arc<dyn EventSink>> = vec![Arc::new(Console)];
    sinks.extend(json);
    // Kills every descendant of the workers if this process dies, SIGKILL
    // included (see the watchdog module); dropped (and so told to sweep) at exit.
    let agent = Agent::new(plan.spec, handler).with_events(Arc::new(Fanout(sinks)));
    if let Some(port) = a.status_port {
        let addr = SocketAddr::from(([0, 0, 0, 0], port));
        let bound = rt
            .block_on(status::serve(addr, agent.status()))
            .with_context(|| format!("--status-port {port}"))?;
        say!("rally run: status at http://{bound}/status, metrics at /metrics");
    }
    // On this thread: the workers' parent-death signal follows it.
    let outcome = rt.block_on(agent.run());
    match watchdog {
        // The agent swept its marked processes at the end of its last round.
        Ok(w) => w.release(),
        Err(e) => {
            tracing::warn!(error = %e, "there was no watchdog: descendants of workers could have outlived a killed agent")
        }
    }
    report(&outcome, &script_name(&a));
    if let (
        Outcome::Failed {
            root_cause: Some(root),
            ..
        },
        true,
    ) = (&outcome, runs_python(&a))
    {
        if let Some(hint) = interpreter_hint(root) {
            say!("{hint}");
        }
    }
    if let Err(e) = write_launcher_error_file(&outcome) {
        say!("rally run: {e:#}");
    }
    let code = outcome.exit_code();
    // Do not wait for background tasks (heartbeats, the hosted store).
    rt.shutdown_timeout(Duration::from_millis(100));
    Ok(code)
}

/// The console lines of `rally run`, rendered from the agent's events.
struct Console;

impl EventSink for Console {
    fn emit(&self, event: &AgentEvent) {
        match event {
            AgentEvent::RendezvousWaiting { run_id, waited } => say!(
                "rally run: still waiting for the rendezvous of run {run_id:?} after {:.0?}",
                waited
            ),
            AgentEvent::WorkersStarted {
                round,
                group_rank,
                group_world_size,
                world_size,
                ranks,
                master_addr,
                master_port,
                ..
            } => say!(
                "rally run: round {round} formed: node {group_rank} of {group_world_size}, ranks {}..{} of {world_size}, job store {master_addr}:{master_port}",
                ranks.start, ranks.end
            ),
            AgentEvent::MembershipChanged {
                nodes_waiting,
                members_dead,
                lost,
                ..
            } => {
                let who = if lost.is_empty() {
                    String::new()
                } else {
                    format!(": {}", lost.join(", "))
                };
                say!(
                    "rally run: membership changed ({nodes_waiting} node(s) waiting, {members_dead} lost{who}); re-forming the group"
                )
            }
            AgentEvent::GroupRestarting {
                failed_rounds,
                max_restarts,
                cause,
            } => say!(
                "rally run: worker failed ({}); restarting the group (restart {failed_rounds} of {max_restarts})",
                cause.as_deref().unwrap_or("unknown")
            ),
            AgentEvent::RunClosedAfterSuccess { .. } => say!(
                "rally run: another node finished and closed the run; this node's workers keep running (no more restarts)"
            ),
            AgentEvent::RendezvousUnreachable { error } => say!(
                "rally run: cannot reach the rendezvous ({error}); the workers keep running for now"
            ),
            AgentEvent::SignalReceived { signal, phase } => say!(
                "rally run: {} received during {phase}; stopping",
                rallypoint_elastic::multiprocessing::signal_name(*signal)
            ),
            AgentEvent::StacksDumped { workers, took, .. } => {
                let read = workers.iter().filter(|(.., error)| error.is_none()).count();
                say!(
                    "rally run: read the stacks of {read} of {} running worker(s) in {took:.0?} before stopping them",
                    workers.len()
                );
            }
            AgentEvent::StopIncomplete { pids } => say!(
                "rally run: processes {pids:?} did not die after SIGKILL (stuck in the kernel?)"
            ),
            AgentEvent::ExitBarrierTimedOut { error } => {
                say!("rally run: exit barrier did not complete: {error}")
            }
            AgentEvent::HostLingering {
                nodes_left,
                rendezvous_store,
                job_store,
            } => {
                let what = match (rendezvous_store, job_store) {
                    (true, true) => "the rendezvous store and the job store",
                    (true, false) => "the rendezvous store",
                    _ => "the job store",
                };
                say!("rally run: keeping {what} up until {nodes_left} other node(s) have seen the outcome")
            }
            AgentEvent::CleanupFailed { what, error } => {
                tracing::warn!(%error, "{what} failed")
            }
            _ => {}
        }
    }
}

fn report(outcome: &Outcome, name: &str) {
    match outcome {
        Outcome::Succeeded { attempts, barrier } => {
            let restarts = attempts.saturating_sub(1);
            match barrier {
                None => say!("rally run: job succeeded ({restarts} restart(s))"),
                Some(why) => say!(
                    "rally run: this node's workers succeeded ({restarts} restart(s)); the exit barrier did not complete: {why}"
                ),
            }
        }
        Outcome::NotNeeded => {
            say!("rally run: the job ended without this node (it was a spare)")
        }
        Outcome::Failed {
            reason,
            root_cause,
            failures,
            stopped,
        } => {
            say!("rally run: job FAILED: {reason} (failed rounds: {failures})");
            // torchrun's ChildFailedError layout; the root cause is job-wide here
            // (torchrun's is per node).
            let border = "=".repeat(60);
            let section = "-".repeat(60);
            let root = match root_cause {
                Some(r) => format!("[0]:\n{r}"),
                None => "  <unknown: no worker failure was recorded>".to_owned(),
            };
            let stopped = match stopped.is_empty() {
                true => String::new(),
                false => format!(
                    "\n{section}\nStopped on this node (where each worker was):\n{}",
                    where_stopped(stopped)
                ),
            };
            say!(
                "{border}\n{name} FAILED\n{section}\nRoot Cause (first observed failure, across all nodes):\n{root}{stopped}\n{border}"
            );
        }
        Outcome::Signaled { signal, stopped } => {
            say!(
                "rally run: stopped by {}; workers were sent the signal",
                rallypoint_elastic::multiprocessing::signal_name(*signal)
            );
            if !stopped.is_empty() {
                say!(
                    "rally run: where each worker was:\n{}",
                    where_stopped(stopped)
                );
            }
        }
        Outcome::Rendezvous(e) => say!("rally run: rendezvous failed: {}", chain(e)),
        Outcome::Error(e) => say!("rally run: {e}"),
    }
}

/// The few frames of each stopped worker, and where its whole dump is.
fn where_stopped(stopped: &[WorkerStacks]) -> String {
    stopped
        .iter()
        .map(|w| {
            let t = &w.target;
            let file = match &w.written {
                Some(f) => format!(", stacks in {}", f.display()),
                None => String::new(),
            };
            let frames: String = w
                .stuck_frames(STUCK_FRAMES)
                .iter()
                .map(|l| format!("\n    {l}"))
                .collect();
            format!(
                "  rank {} (local_rank: {}, pid: {}){file}:{frames}",
                t.rank, t.local_rank, t.pid
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Innermost frames of each stopped worker in the failure summary.
const STUCK_FRAMES: usize = 3;

/// The name torchrun titles its failure summary with: the script, module or
/// program.
fn script_name(a: &RunArgs) -> String {
    a.command.first().map_or_else(String::new, |c| {
        Path::new(c)
            .file_name()
            .unwrap_or(c)
            .to_string_lossy()
            .into_owned()
    })
}

/// When the launcher itself was given `TORCHELASTIC_ERROR_FILE` (by a scheduler
/// or an outer launcher), puts the root cause there as torchrun's `@record`
/// does: a copy of the worker's error file with `errorCode` added, or, when the
/// worker wrote none (or it is on another node), the failure described in the
/// same layout. Stopped by a signal, it writes what torchrun writes then: a
/// `SignalException` (`Process <pid> got signal: <n>`), so a scheduler reads
/// the same thing whichever launcher ran (the exit code stays 128+N).
fn write_launcher_error_file(outcome: &Outcome) -> anyhow::Result<()> {
    use rallypoint_elastic::errors::{
        copy_with_exit_code, error_json, write_error_file, ErrorReport,
    };
    let Some(path) =
        std::env::var_os(rallypoint_elastic::errors::ERROR_FILE_ENV).filter(|p| !p.is_empty())
    else {
        return Ok(());
    };
    let path = PathBuf::from(path);
    let cannot = || {
        format!(
            "cannot write the launcher's error file ({})",
            path.display()
        )
    };
    let root_cause = match outcome {
        Outcome::Failed { root_cause, .. } => root_cause,
        Outcome::Signaled { signal, .. } => {
            let message = format!(
                "SignalException: Process {} got signal: {signal}",
                std::process::id()
            );
            let stack = format!(
                "rally run received {} ({signal}) and sent it to its workers, as torchrun does\n",
                rallypoint_elastic::multiprocessing::signal_name(*signal)
            );
            let value = error_json(&message, &stack, std::time::SystemTime::now());
            return write_error_file(&path, &value).with_context(cannot);
        }
        _ => return Ok(()),
    };
    let Some(root) = root_cause else {
        return Ok(());
    };
    let from_worker = (root.host == rallypoint_elastic::multiprocessing::hostname())
        .then(|| {
            ErrorReport::read(Path::new(&root.error_file))
                .ok()
                .flatten()
        })
        .flatten();
    match from_worker {
        Some(report) => copy_with_exit_code(&report, Some(root.exitcode), &path),
        None => write_error_file(&path, &root.error_json()),
    }
    .with_context(cannot)
}

/// An error and its causes, `: `-separated.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cause = c.source();
    }
    s
}
