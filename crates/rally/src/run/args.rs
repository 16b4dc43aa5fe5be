//! `rally run`'s command line: every torchrun flag, in both spellings
//! (`--nproc-per-node`, `--nproc_per_node`) with its `PET_*` environment
//! default, and rallypoint's own flags, marked "(rallypoint)". Only clap's
//! declarations live here: what the values mean is decided in
//! [`super::plan`].

use std::ffi::OsString;
use std::path::PathBuf;

use rallypoint_elastic::multiprocessing::signals::DEFAULT_SIGNALS;

/// torchrun's flags (and a few of rallypoint's own, marked so).
#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// Number of nodes, `N` or `MIN:MAX`.
    #[arg(long, env = "PET_NNODES", default_value = "1:1")]
    pub(super) nnodes: String,
    /// Workers per node: a number, `cpu`, `gpu` or `auto`.
    #[arg(
        long = "nproc-per-node",
        visible_alias = "nproc_per_node",
        env = "PET_NPROC_PER_NODE",
        default_value = "1"
    )]
    pub(super) nproc_per_node: String,
    /// Rendezvous backend: `static`, `c10d`, `etcd` (if built in), or registered.
    #[arg(
        long = "rdzv-backend",
        visible_alias = "rdzv_backend",
        env = "PET_RDZV_BACKEND",
        default_value = "static"
    )]
    pub(super) rdzv_backend: String,
    /// Rendezvous endpoint, `host[:port]`.
    #[arg(
        long = "rdzv-endpoint",
        visible_alias = "rdzv_endpoint",
        env = "PET_RDZV_ENDPOINT",
        default_value = ""
    )]
    pub(super) rdzv_endpoint: String,
    /// Run id shared by every node of the job.
    #[arg(
        long = "rdzv-id",
        visible_alias = "rdzv_id",
        env = "PET_RDZV_ID",
        default_value = "none"
    )]
    pub(super) rdzv_id: String,
    /// Backend options, `k1=v1,k2=v2`.
    #[arg(
        long = "rdzv-conf",
        visible_alias = "rdzv_conf",
        env = "PET_RDZV_CONF",
        default_value = ""
    )]
    pub(super) rdzv_conf: String,
    /// One node, with its own rendezvous store on a free port and a random run id.
    #[arg(long, env = "PET_STANDALONE")]
    pub(super) standalone: bool,
    /// Failed rounds tolerated before the job fails (job-wide).
    #[arg(
        long = "max-restarts",
        visible_alias = "max_restarts",
        env = "PET_MAX_RESTARTS",
        default_value_t = 0
    )]
    pub(super) max_restarts: u32,
    /// Seconds between health checks (a worker's exit is seen at once regardless).
    #[arg(
        long = "monitor-interval",
        visible_alias = "monitor_interval",
        env = "PET_MONITOR_INTERVAL",
        default_value_t = 0.1
    )]
    pub(super) monitor_interval: f64,
    /// Accepted for compatibility; programs are always started with fork+exec.
    #[arg(long = "start-method", visible_alias = "start_method", env = "PET_START_METHOD", default_value = "spawn",
          value_parser = ["spawn", "fork", "forkserver"])]
    pub(super) start_method: String,
    /// `null` (default) or `console` (events as JSON lines on stderr).
    #[arg(
        long = "event-log-handler",
        visible_alias = "event_log_handler",
        env = "PET_EVENT_LOG_HANDLER",
        default_value = "null"
    )]
    pub(super) event_log_handler: String,
    /// Role of the workers.
    #[arg(long, env = "PET_ROLE", default_value = "default")]
    pub(super) role: String,
    /// Run the script as a Python module (`python -m`).
    #[arg(short = 'm', long, env = "PET_MODULE")]
    pub(super) module: bool,
    /// Run the script directly, not under Python.
    #[arg(long = "no-python", visible_alias = "no_python", env = "PET_NO_PYTHON")]
    pub(super) no_python: bool,
    /// torchrun runs the script in-process with runpy; here it runs under Python.
    #[arg(long = "run-path", visible_alias = "run_path", env = "PET_RUN_PATH")]
    pub(super) run_path: bool,
    /// Base directory of per-run logs.
    #[arg(long = "log-dir", visible_alias = "log_dir", env = "PET_LOG_DIR")]
    pub(super) log_dir: Option<PathBuf>,
    /// Streams to files only: 0-3 or per local rank (`0:1,1:2`).
    #[arg(short = 'r', long, env = "PET_REDIRECTS", default_value = "0")]
    pub(super) redirects: String,
    /// Streams to files and the console: 0-3 or per local rank.
    #[arg(short = 't', long, env = "PET_TEE", default_value = "0")]
    pub(super) tee: String,
    /// Prefix of teed console lines; `${role_name}`, `${local_rank}`, `${rank}`
    /// and `${hostname}` expand (default `[${role_name}${local_rank}]:`; also
    /// `TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`). Only teed output (`-t`) is
    /// prefixed, as under torchrun.
    #[arg(
        long = "log-line-prefix-template",
        visible_alias = "log_line_prefix_template",
        env = "PET_LOG_LINE_PREFIX_TEMPLATE"
    )]
    pub(super) log_line_prefix_template: Option<String>,
    /// Local ranks whose output reaches the console, `0,1`.
    #[arg(
        long = "local-ranks-filter",
        visible_alias = "local_ranks_filter",
        env = "PET_LOCAL_RANKS_FILTER",
        default_value = ""
    )]
    pub(super) local_ranks_filter: String,
    /// Not supported yet (an error if given).
    #[arg(
        long = "duplicate-stdout-filters",
        visible_alias = "duplicate_stdout_filters",
        env = "PET_DUPLICATE_STDOUT_FILTERS",
        default_value = ""
    )]
    pub(super) duplicate_stdout_filters: String,
    /// Not supported yet (an error if given).
    #[arg(
        long = "duplicate-stderr-filters",
        visible_alias = "duplicate_stderr_filters",
        env = "PET_DUPLICATE_STDERR_FILTERS",
        default_value = ""
    )]
    pub(super) duplicate_stderr_filters: String,
    /// This node's rank (static backend only).
    #[arg(
        long = "node-rank",
        visible_alias = "node_rank",
        env = "PET_NODE_RANK",
        default_value_t = 0
    )]
    pub(super) node_rank: usize,
    /// Address of the static backend's store (rank 0's node).
    #[arg(
        long = "master-addr",
        visible_alias = "master_addr",
        env = "PET_MASTER_ADDR",
        default_value = "127.0.0.1"
    )]
    pub(super) master_addr: String,
    /// Port of the static backend's store.
    #[arg(
        long = "master-port",
        visible_alias = "master_port",
        env = "PET_MASTER_PORT"
    )]
    pub(super) master_port: Option<u16>,
    /// Address this node advertises.
    #[arg(
        long = "local-addr",
        visible_alias = "local_addr",
        env = "PET_LOCAL_ADDR"
    )]
    pub(super) local_addr: Option<String>,
    /// Python entry points; not available here (an error if given).
    #[arg(long = "logs-specs", visible_alias = "logs_specs")]
    pub(super) logs_specs: Option<String>,
    /// Bind each local rank to the CPUs nearest its GPU (GPU i serves local
    /// rank i), memory preferred on the same nodes: node (the GPU's NUMA
    /// node), socket (every node of its socket), exclusive (the node's cores
    /// split among its GPUs), core-complex (one L3 complex per GPU). Without a
    /// GPU, workers run unbound (said on the console).
    #[arg(long = "numa-binding", visible_alias = "numa_binding",
          value_parser = ["node", "socket", "exclusive", "core-complex"])]
    pub(super) numa_binding: Option<String>,
    /// (rallypoint) Do not read the Python stacks of workers before stopping
    /// them (by default each is written to `stacks.txt` in its log directory
    /// and summarised in the failure report).
    #[arg(long = "no-stack-dump")]
    pub(super) no_stack_dump: bool,
    /// (rallypoint) Seconds the stack dump may take, for all workers together.
    #[arg(long = "stack-dump-timeout", default_value_t = 5.0)]
    pub(super) stack_dump_timeout: f64,
    /// Signals trapped and forwarded to the workers.
    #[arg(long = "signals-to-handle", visible_alias = "signals_to_handle", env = "PET_SIGNALS_TO_HANDLE", default_value = DEFAULT_SIGNALS)]
    pub(super) signals_to_handle: String,
    /// Seconds between the stop signal and SIGKILL (else
    /// `TORCH_ELASTIC_SHUTDOWN_TIMEOUT`, else 30).
    #[arg(
        long = "shutdown-timeout",
        visible_alias = "shutdown_timeout",
        env = "PET_SHUTDOWN_TIMEOUT"
    )]
    pub(super) shutdown_timeout: Option<u64>,
    /// Every worker gets `LOCAL_RANK=0` and one device.
    #[arg(
        long = "virtual-local-rank",
        visible_alias = "virtual_local_rank",
        env = "PET_VIRTUAL_LOCAL_RANK"
    )]
    pub(super) virtual_local_rank: bool,
    /// (rallypoint) Seconds every node waits for the others once its workers
    /// succeeded (torchrun: 300, fixed).
    #[arg(
        long = "exit-barrier-timeout",
        env = "RALLY_EXIT_BARRIER_TIMEOUT",
        default_value_t = 300.0
    )]
    pub(super) exit_barrier_timeout: f64,
    /// (rallypoint) Seconds the rendezvous store may stay unreachable (in a
    /// join, a start, while workers run, at the exit barrier) before this node
    /// gives up on it ("lost the rendezvous host"). Default: the store's read
    /// timeout (`--rdzv-conf read_timeout`, 60 s), so a busy store is never
    /// taken for a lost one.
    #[arg(long = "rdzv-lost-timeout", env = "RALLY_RDZV_LOST_TIMEOUT")]
    pub(super) rdzv_lost_timeout: Option<f64>,
    /// (rallypoint) Write events as JSON lines to this file (`-`: stderr).
    #[arg(long, env = "RALLY_EVENTS")]
    pub(super) events: Option<PathBuf>,
    /// (rallypoint) Serve /status (JSON) and /metrics (Prometheus) on this port.
    #[arg(long = "status-port", env = "RALLY_STATUS_PORT")]
    pub(super) status_port: Option<u16>,
    #[command(flatten)]
    pub(super) secret: crate::secret::SecretArgs,
    /// (rallypoint) Per-step fault tolerance: this run is one replica group
    /// of a job that never restarts. A failure restarts only this group's
    /// workers (they rejoin through the quorum and heal); other groups keep
    /// training. Needs --ft-replica-group and --ft-lighthouse (or
    /// --ft-serve-lighthouse). See docs/ft.md.
    #[arg(long = "ft")]
    pub(super) ft: bool,
    /// (rallypoint, --ft) This replica group's id, unique among the job's
    /// live groups.
    #[arg(
        long = "ft-replica-group",
        env = "RALLY_FT_REPLICA_GROUP",
        value_name = "ID"
    )]
    pub(super) ft_replica_group: Option<String>,
    /// (rallypoint, --ft) The quorum service, `HOST:PORT` (`rally
    /// lighthouse`, or torchft's `torchft_lighthouse`).
    #[arg(
        long = "ft-lighthouse",
        env = "RALLY_FT_LIGHTHOUSE",
        value_name = "HOST:PORT"
    )]
    pub(super) ft_lighthouse: Option<String>,
    /// (rallypoint, --ft) Run `rally lighthouse` inside this `rally run`,
    /// on BIND (`--ft-serve-lighthouse=BIND`; default `[::]:29510`): one
    /// command per host. Other groups
    /// point --ft-lighthouse at this host; the lighthouse goes when this
    /// run ends.
    #[arg(
        long = "ft-serve-lighthouse",
        value_name = "BIND",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "[::]:29510"
    )]
    pub(super) ft_serve_lighthouse: Option<std::net::SocketAddr>,
    /// (rallypoint, --ft-serve-lighthouse) The fewest replica groups a new
    /// quorum may have (`rally lighthouse --min_replicas`; default 1).
    #[arg(long = "ft-min-replicas")]
    pub(super) ft_min_replicas: Option<u64>,
    /// (rallypoint, --ft) Seconds to keep trying an unreachable lighthouse,
    /// at start and whenever this group rejoins (a lighthouse that is
    /// itself restarting is ridden out), before failing with its address.
    #[arg(
        long = "ft-connect-timeout",
        env = "RALLY_FT_CONNECT_TIMEOUT",
        default_value_t = 60.0
    )]
    pub(super) ft_connect_timeout: f64,
    /// Print a completion script for `rally` to stdout and exit: bash, zsh,
    /// tcsh (as torchrun), fish, elvish or powershell.
    #[arg(long = "print-completion", visible_alias = "print_completion",
          value_parser = ["bash", "zsh", "tcsh", "fish", "elvish", "powershell"])]
    pub print_completion: Option<String>,
    /// The training script (or module, or program) and its arguments.
    #[arg(required_unless_present = "print_completion", trailing_var_arg = true, num_args = 1..)]
    pub(super) command: Vec<OsString>,
}
