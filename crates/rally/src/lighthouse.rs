//! `rally lighthouse`: the quorum service of per-step fault tolerance, a
//! drop-in for torchft's `torchft_lighthouse` (its flags as it spells them,
//! kebab-case aliases too), serving until Ctrl-C or SIGTERM. Once bound it
//! prints `rally lighthouse: listening on ADDR` on stderr, where scripts and
//! tests read the port. With `--state etcd://HOST:PORT[/prefix]` its state
//! lives in etcd and one lighthouse per prefix leads while the others stand
//! by (`rallypoint_lighthouse::service::etcd`); it exits non-zero if it
//! loses its lease.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use rallypoint_lighthouse::quorum::Knobs;
use rallypoint_lighthouse::service::etcd::{Etcd, StateUrl};
use rallypoint_lighthouse::service::{Config, Server};

/// How long `--state`'s etcd has to answer at start (and each call after).
const STATE_TIMEOUT: Duration = Duration::from_secs(5);

/// torchft's knobs, with our defaults tuned for fast detection: torchft's
/// managers heartbeat every 100 ms, so a replica silent for 1 s (torchft:
/// 5 s) is gone, and a killed one is dropped the moment its connection
/// resets, whatever the timeout.
#[derive(clap::Args)]
#[command(
    after_help = "Defaults are tuned for fast detection: a killed replica is dropped the \
    moment its connection resets, a silent one after --heartbeat_timeout_ms (1 s here, 5 s in \
    torchft; its managers heartbeat every 100 ms). \
    Point torchft at it with TORCHFT_LIGHTHOUSE=http://HOST:PORT. \
    Survivors of a dropped member learn it from GET /v1/watch on the same port; \
    /status (JSON) and /metrics (Prometheus) are there too. \
    Quorum ids start above the wall clock's Unix milliseconds, so a restarted lighthouse \
    never reuses one provided the clock did not step back across the restart by more than \
    the old one's uptime less the ids it issued (nor a new host's clock lag that much). \
    Heartbeats from replica ids not seen yet are accepted, as torchft's lighthouse does \
    (its managers beat before their first quorum call). \
    With --state etcd://HOST:PORT[/prefix], the last quorum id and members live in etcd: one \
    lighthouse per prefix leads, others stand by (refusing calls with UNAVAILABLE) and take over \
    within --state_lease_s of the leader's death; point managers at a name that follows the \
    leader (a DNS name or VIP, or restart on the same host)."
)]
pub struct LighthouseArgs {
    /// Address to serve gRPC and HTTP on (`[::]` also accepts IPv4).
    #[arg(long, default_value = "[::]:29510")]
    bind: SocketAddr,
    /// The fewest replicas a new (not fast) quorum may have.
    #[arg(long = "min_replicas", alias = "min-replicas")]
    min_replicas: u64,
    /// How long a quorum waits for healthy replicas that have not joined yet,
    /// from the first join, in ms (torchft's default too).
    #[arg(
        long = "join_timeout_ms",
        alias = "join-timeout-ms",
        default_value_t = 60_000
    )]
    join_timeout_ms: u64,
    /// How often the quorum is looked at again while members wait, in ms
    /// (torchft's default too).
    #[arg(
        long = "quorum_tick_ms",
        alias = "quorum-tick-ms",
        default_value_t = 100
    )]
    quorum_tick_ms: u64,
    /// A replica silent this long is dropped, in ms (torchft: 5000; its
    /// managers heartbeat every 100 ms, so 1000 is ten missed beats).
    #[arg(
        long = "heartbeat_timeout_ms",
        alias = "heartbeat-timeout-ms",
        default_value_t = 1_000
    )]
    heartbeat_timeout_ms: u64,
    /// Keep the state in etcd, `etcd://HOST:PORT[/prefix]` (prefix
    /// default `/rally/lighthouse/`), so that a second lighthouse on the
    /// same prefix can take over; an etcd that does not answer within 5 s
    /// at start is an error.
    #[arg(long = "state", value_name = "etcd://HOST:PORT[/prefix]")]
    state: Option<StateUrl>,
    /// The TTL of the leader's etcd lease, in seconds (at least 2): a
    /// standby takes over this long after the leader dies.
    #[arg(long = "state_lease_s", alias = "state-lease-s", default_value_t = 2)]
    state_lease_s: u64,
    #[command(flatten)]
    secret: crate::secret::SecretArgs,
}

/// Serves until Ctrl-C or SIGTERM.
pub fn run(args: LighthouseArgs) -> anyhow::Result<()> {
    args.secret.apply("rally lighthouse")?;
    if args.quorum_tick_ms == 0 || args.heartbeat_timeout_ms == 0 {
        anyhow::bail!("--quorum_tick_ms and --heartbeat_timeout_ms must be above 0");
    }
    let knobs = Knobs {
        min_replicas: args.min_replicas,
        join_timeout: Duration::from_millis(args.join_timeout_ms),
        quorum_tick: Duration::from_millis(args.quorum_tick_ms),
        heartbeat_timeout: Duration::from_millis(args.heartbeat_timeout_ms),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("failed to start the runtime")?;
    rt.block_on(async move {
        // Signal handlers before the line that tells the world we are up, so
        // that a SIGTERM right after it stops us cleanly.
        let stop = shutdown_signal()?;
        let mut config = Config::new(knobs.clone());
        if let Some(url) = args.state {
            let ttl = Duration::from_secs(args.state_lease_s);
            let etcd = Etcd::connect(url.clone(), ttl, STATE_TIMEOUT)
                .await
                .map_err(|e| anyhow::anyhow!("--state {url}: {e}"))?;
            config.state = Some(etcd);
        }
        let server = Server::bind(args.bind, config)
            .await
            .with_context(|| format!("failed to listen on {}", args.bind))?;
        let addr = server
            .local_addr()
            .context("failed to read the bound address")?;
        say!("rally lighthouse: listening on {addr}");
        tracing::info!(?knobs, "serving");
        server
            .run(stop)
            .await
            .context("rally lighthouse stopped serving")?;
        tracing::info!("lighthouse stopped");
        anyhow::Ok(())
    })
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM; the handlers are in place when
/// this returns.
fn shutdown_signal() -> anyhow::Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut int = signal(SignalKind::interrupt()).context("failed to handle SIGINT")?;
    let mut term = signal(SignalKind::terminate()).context("failed to handle SIGTERM")?;
    Ok(async move {
        tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
        }
    })
}
