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
use rallypoint_elastic::agent::{status, Agent, AgentSpec, Outcome};
use rallypoint_elastic::multiprocessing::signals::{parse_signals, DEFAULT_SIGNALS};
use rallypoint_elastic::multiprocessing::watchdog;
use rallypoint_elastic::multiprocessing::{Entrypoint, LogsSpec, PerRank, DEFAULT_PREFIX_TEMPLATE};
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
        alias = "nproc_per_node",
        env = "PET_NPROC_PER_NODE",
        default_value = "1"
    )]
    nproc_per_node: String,
    /// Rendezvous backend: `static`, `c10d`, `etcd` (if built in), or registered.
    #[arg(
        long = "rdzv-backend",
        alias = "rdzv_backend",
        env = "PET_RDZV_BACKEND",
        default_value = "static"
    )]
    rdzv_backend: String,
    /// Rendezvous endpoint, `host[:port]`.
    #[arg(
        long = "rdzv-endpoint",
        alias = "rdzv_endpoint",
        env = "PET_RDZV_ENDPOINT",
        default_value = ""
    )]
    rdzv_endpoint: String,
    /// Run id shared by every node of the job.
    #[arg(
        long = "rdzv-id",
        alias = "rdzv_id",
        env = "PET_RDZV_ID",
        default_value = "none"
    )]
    rdzv_id: String,
    /// Backend options, `k1=v1,k2=v2`.
    #[arg(
        long = "rdzv-conf",
        alias = "rdzv_conf",
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
        alias = "max_restarts",
        env = "PET_MAX_RESTARTS",
        default_value_t = 0
    )]
    max_restarts: u32,
    /// Seconds between health checks (a worker's exit is seen at once regardless).
    #[arg(
        long = "monitor-interval",
        alias = "monitor_interval",
        env = "PET_MONITOR_INTERVAL",
        default_value_t = 0.1
    )]
    monitor_interval: f64,
    /// Accepted for compatibility; programs are always started with fork+exec.
    #[arg(long = "start-method", alias = "start_method", env = "PET_START_METHOD", default_value = "spawn",
          value_parser = ["spawn", "fork", "forkserver"])]
    start_method: String,
    /// `null` (default) or `console` (events as JSON lines on stderr).
    #[arg(
        long = "event-log-handler",
        alias = "event_log_handler",
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
    #[arg(long = "no-python", alias = "no_python", env = "PET_NO_PYTHON")]
    no_python: bool,
    /// torchrun runs the script in-process with runpy; here it runs under Python.
    #[arg(long = "run-path", alias = "run_path", env = "PET_RUN_PATH")]
    run_path: bool,
    /// Base directory of per-run logs.
    #[arg(long = "log-dir", alias = "log_dir", env = "PET_LOG_DIR")]
    log_dir: Option<PathBuf>,
    /// Streams to files only: 0-3 or per local rank (`0:1,1:2`).
    #[arg(short = 'r', long, env = "PET_REDIRECTS", default_value = "0")]
    redirects: String,
    /// Streams to files and the console: 0-3 or per local rank.
    #[arg(short = 't', long, env = "PET_TEE", default_value = "0")]
    tee: String,
    /// Local ranks whose output reaches the console, `0,1`.
    #[arg(
        long = "local-ranks-filter",
        alias = "local_ranks_filter",
        env = "PET_LOCAL_RANKS_FILTER",
        default_value = ""
    )]
    local_ranks_filter: String,
    /// Not supported yet (an error if given).
    #[arg(
        long = "duplicate-stdout-filters",
        alias = "duplicate_stdout_filters",
        env = "PET_DUPLICATE_STDOUT_FILTERS",
        default_value = ""
    )]
    duplicate_stdout_filters: String,
    /// Not supported yet (an error if given).
    #[arg(
        long = "duplicate-stderr-filters",
        alias = "duplicate_stderr_filters",
        env = "PET_DUPLICATE_STDERR_FILTERS",
        default_value = ""
    )]
    duplicate_stderr_filters: String,
    /// This node's rank (static backend only).
    #[arg(
        long = "node-rank",
        alias = "node_rank",
        env = "PET_NODE_RANK",
        default_value_t = 0
    )]
    node_rank: usize,
    /// Address of the static backend's store (rank 0's node).
    #[arg(
        long = "master-addr",
        alias = "master_addr",
        env = "PET_MASTER_ADDR",
        default_value = "127.0.0.1"
    )]
    master_addr: String,
    /// Port of the static backend's store.
    #[arg(long = "master-port", alias = "master_port", env = "PET_MASTER_PORT")]
    master_port: Option<u16>,
    /// Address this node advertises.
    #[arg(long = "local-addr", alias = "local_addr", env = "PET_LOCAL_ADDR")]
    local_addr: Option<String>,
    /// Python entry points; not available here (an error if given).
    #[arg(long = "logs-specs", alias = "logs_specs")]
    logs_specs: Option<String>,
    /// GPU NUMA binding; accepted, no effect without GPUs.
    #[arg(long = "numa-binding", alias = "numa_binding")]
    numa_binding: Option<String>,
    /// Signals trapped and forwarded to the workers.
    #[arg(long = "signals-to-handle", alias = "signals_to_handle", env = "PET_SIGNALS_TO_HANDLE", default_value = DEFAULT_SIGNALS)]
    signals_to_handle: String,
    /// Seconds between the stop signal and SIGKILL (else
    /// `TORCH_ELASTIC_SHUTDOWN_TIMEOUT`, else 30).
    #[arg(
        long = "shutdown-timeout",
        alias = "shutdown_timeout",
        env = "PET_SHUTDOWN_TIMEOUT"
    )]
    shutdown_timeout: Option<u64>,
    /// Every worker gets `LOCAL_RANK=0` and one device.
    #[arg(
        long = "virtual-local-rank",
        alias = "virtual_local_rank",
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
    /// (rallypoint) Seconds the rendezvous store may stay unreachable while
    /// workers run before this node gives the job up as failed ("lost the
    /// rendezvous host").
    #[arg(
        long = "rdzv-lost-timeout",
        env = "RALLY_RDZV_LOST_TIMEOUT",
        default_value_t = 5.0
    )]
    rdzv_lost_timeout: f64,
    /// (rallypoint) Write events as JSON lines to this file (`-`: stderr).
    #[arg(long, env = "RALLY_EVENTS")]
    events: Option<PathBuf>,
    /// (rallypoint) Serve /status (JSON) and /metrics (Prometheus) on this port.
    #[arg(long = "status-port", env = "RALLY_STATUS_PORT")]
    status_port: Option<u16>,
    /// The training script (or module, or program) and its arguments.
    #[arg(required = true, trailing_var_arg = true, num_args = 1..)]
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
    std::fs::read_dir("/proc/driver/nvidia/gpus").map_or(0, |d| d.count())
}

fn cpu_count() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn parse_nproc(s: &str) -> anyhow::Result<usize> {
    let n = match s {
        "cpu" => cpu_count(),
        "gpu" => match gpu_count() {
            0 => bail!("--nproc-per-node gpu: no GPUs found"),
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

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length.
    let r = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if r != 0 {
        return "localhost".into();
    }
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
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
    let is_py = Path::new(script).extension().is_some_and(|e| e == "py");
    // A file that is neither .py nor executable is a Python script too.
    let not_executable = || {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(script).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 == 0)
    };
    let python = a.module || a.run_path || (!a.no_python && (is_py || not_executable()));
    if !python {
        return Ok((Entrypoint::Program(script.clone()), rest.to_vec()));
    }
    let exe = std::env::var_os("PYTHON_EXEC").unwrap_or_else(|| "python3".into());
    let mut args: Vec<OsString> = vec!["-u".into()];
    if a.module {
        args.push("-m".into());
    }
    args.push(script.clone());
    args.extend(rest.iter().cloned());
    Ok((Entrypoint::Program(exe), args))
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
    if a.numa_binding.is_some() && gpu_count() > 0 {
        eprintln!("rally run: --numa-binding is not applied (no NUMA support yet)");
    }
    for (flag, v) in [
        ("--monitor-interval", a.monitor_interval),
        ("--exit-barrier-timeout", a.exit_barrier_timeout),
        ("--rdzv-lost-timeout", a.rdzv_lost_timeout),
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
            (None, _) => {
                eprintln!("rally run: warning: no --rdzv-id; jobs sharing this rendezvous endpoint will collide (run id \"none\")");
                "none".into()
            }
        };
    }
    let mut config = RendezvousParameters::parse_conf(&a.rdzv_conf)?;
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
        prefix_template: std::env::var("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")
            .unwrap_or_else(|_| DEFAULT_PREFIX_TEMPLATE.into()),
    };
    let (entrypoint, args) = entrypoint(a)?;
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
        lost_grace: Duration::from_secs_f64(a.rdzv_lost_timeout),
        virtual_local_rank: a.virtual_local_rank,
        hostname: hostname(),
        local_addr: a.local_addr.clone(),
        mark: Some(watchdog::new_mark()),
    };
    Ok(Plan {
        spec,
        params,
        min_nodes,
        max_nodes,
    })
}

/// Runs the job; returns the process exit code.
pub fn run(a: RunArgs) -> anyhow::Result<i32> {
    let plan = plan(&a)?;
    // Workers inherit these, as under torchrun.
    if plan.spec.local_world_size > 1 && std::env::var_os("OMP_NUM_THREADS").is_none() {
        eprintln!("rally run: setting OMP_NUM_THREADS=1 for each worker (set it yourself to tune)");
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
            eprintln!(
                "rally run: cannot set up the {:?} rendezvous: {e}",
                plan.params.backend
            );
            return Ok(Outcome::Rendezvous(e).exit_code());
        }
    };
    eprintln!(
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
        eprintln!("rally run: status at http://{bound}/status, metrics at /metrics");
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
    report(&outcome);
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
            AgentEvent::RendezvousWaiting { run_id, waited } => eprintln!(
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
            } => eprintln!(
                "rally run: round {round} formed: node {group_rank} of {group_world_size}, ranks {}..{} of {world_size}, job store {master_addr}:{master_port}",
                ranks.start, ranks.end
            ),
            AgentEvent::MembershipChanged { nodes_waiting, .. } => eprintln!(
                "rally run: membership changed ({nodes_waiting} node(s) waiting or lost); re-forming the group"
            ),
            AgentEvent::GroupRestarting {
                failed_rounds,
                max_restarts,
                cause,
            } => eprintln!(
                "rally run: worker failed ({}); restarting the group (restart {failed_rounds} of {max_restarts})",
                cause.as_deref().unwrap_or("unknown")
            ),
            AgentEvent::RunClosedAfterSuccess { .. } => eprintln!(
                "rally run: another node finished and closed the run; this node's workers keep running (no more restarts)"
            ),
            AgentEvent::RendezvousUnreachable { error } => eprintln!(
                "rally run: cannot reach the rendezvous ({error}); the workers keep running for now"
            ),
            AgentEvent::SignalReceived { signal, phase } => eprintln!(
                "rally run: {} received during {phase}; stopping",
                rallypoint_elastic::multiprocessing::signal_name(*signal)
            ),
            AgentEvent::StopIncomplete { pids } => eprintln!(
                "rally run: processes {pids:?} did not die after SIGKILL (stuck in the kernel?)"
            ),
            AgentEvent::ExitBarrierTimedOut { error } => {
                eprintln!("rally run: exit barrier did not complete: {error}")
            }
            AgentEvent::HostLingering { nodes_left } => eprintln!(
                "rally run: keeping the rendezvous store up until {nodes_left} other node(s) have seen the outcome"
            ),
            AgentEvent::CleanupFailed { what, error } => {
                tracing::warn!(%error, "{what} failed")
            }
            _ => {}
        }
    }
}

fn report(outcome: &Outcome) {
    match outcome {
        Outcome::Succeeded { attempts, barrier } => {
            let restarts = attempts.saturating_sub(1);
            match barrier {
                None => eprintln!("rally run: job succeeded ({restarts} restart(s))"),
                Some(why) => eprintln!(
                    "rally run: this node's workers succeeded ({restarts} restart(s)); the exit barrier did not complete: {why}"
                ),
            }
        }
        Outcome::NotNeeded => {
            eprintln!("rally run: the job ended without this node (it was a spare)")
        }
        Outcome::Failed {
            reason,
            root_cause,
            failures,
        } => {
            eprintln!("rally run: job FAILED: {reason} (failed rounds: {failures})");
            match root_cause {
                Some(r) => eprintln!("Root cause (first failure across all nodes):\n{r}"),
                None => eprintln!("Root cause: unknown (no worker failure was recorded)"),
            }
        }
        Outcome::Signaled { signal } => eprintln!(
            "rally run: stopped by {}; workers were sent the signal",
            rallypoint_elastic::multiprocessing::signal_name(*signal)
        ),
        Outcome::Rendezvous(e) => eprintln!("rally run: rendezvous failed: {e}"),
        Outcome::Error(e) => eprintln!("rally run: {e}"),
    }
}
