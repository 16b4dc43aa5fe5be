//! `rallypoint-bench store`'s command line: the sizes of each measurement,
//! and which servers and measurements to run.

#[derive(clap::Args, Clone)]
pub struct StoreArgs {
    /// Concurrent connections for the throughput test.
    #[arg(long, default_value_t = 64)]
    pub(super) connections: usize,
    /// Seconds per throughput measurement.
    #[arg(long, default_value_t = 5.0)]
    pub(super) seconds: f64,
    /// Round trips for the latency test.
    #[arg(long, default_value_t = 20000)]
    pub(super) round_trips: usize,
    /// Clients in the connection storm.
    #[arg(long, default_value_t = 16384)]
    pub(super) storm: usize,
    /// Idle connections for the memory measurement.
    #[arg(long, default_value_t = 8000)]
    pub(super) idle: usize,
    /// Smaller storm and idle counts run against every server, for a like-for-like
    /// ratio with servers too slow to accept the full counts (PyTorch's libuv server
    /// accepts about ten connections a second here).
    #[arg(long, default_value_t = 64)]
    pub(super) small: usize,
    /// Which servers: any of rally, torch, torch-legacy.
    #[arg(long, value_delimiter = ',', default_value = "rally,torch")]
    pub(super) servers: Vec<String>,
    /// Which measurements: any of throughput, latency, storm, memory.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "throughput,latency,storm,memory"
    )]
    pub(super) tests: Vec<String>,
    /// Worker threads for our server (default: one per core).
    #[arg(long)]
    pub(super) rally_threads: Option<usize>,
}
