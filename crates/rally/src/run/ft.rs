//! `rally run --ft`: this run is one replica group of a job that never
//! restarts (docs/ft.md).
//!
//! The group's **manager** ([`rallypoint_ft::Manager`]) lives here, in the
//! agent, not in a worker: it speaks for the group to the lighthouse (one
//! connection, heartbeats, one `Quorum` call per step for all the group's
//! ranks), and it serves the workers' quorum and commit calls and the store
//! of the cross-replica process groups. A killed worker, rank 0 included,
//! takes neither the manager nor the job's store (the agent's) away.
//!
//! A worker failure is handled by the agent as any failure: it stops this
//! group's workers and starts them again (within `--max-restarts`, a budget
//! of this group alone), and they rejoin through the quorum and heal from a
//! live group. No process of another group restarts: each group is its own
//! `rally run` with its own rendezvous. The manager tells the lighthouse
//! the moment this group's workers stop (a worker's connection to it ends,
//! or the agent reports a failure: [`AgentHook`]), so the other groups'
//! quorum goes on without this one at once, their step in flight aborted by
//! the lighthouse's push rather than by a timeout.
//!
//! What the workers see: `RALLY_FT_MANAGER`, `RALLY_FT_REPLICA_GROUP` (and
//! `REPLICA_GROUP_ID`, torchft's examples' name), `RALLY_FT_LIGHTHOUSE`
//! (and `TORCHFT_LIGHTHOUSE`), so `rallypoint.ft.Manager(...)` needs none of
//! them as arguments.
//!
//! The manager's status is a section of `--status-port`'s `/status` and
//! `/metrics` ([`FtSection`]); its events (quorum, joins, drops, heals,
//! steps not committed, the lighthouse lost) go to the console and to
//! `--events` as `ft.*` events ([`forward_events`]).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use rallypoint_elastic::agent::events::{AgentEvent, EventSink};
use rallypoint_elastic::agent::status::Section;
use rallypoint_elastic::agent::Stopper;
use rallypoint_ft::{Config, FtEvent, Manager};
use serde_json::{json, Value};
use tokio::runtime::Runtime;

use super::args::RunArgs;

/// Where the group's lighthouse is.
enum Lighthouse {
    /// `--ft-lighthouse HOST:PORT`.
    At(String),
    /// `--ft-serve-lighthouse BIND`: served by this process.
    Serve(SocketAddr),
}

/// `--ft`'s flags, checked.
pub(super) struct FtPlan {
    replica_group: String,
    /// Where the lighthouse is: at `host:port`, or served here first.
    lighthouse: Lighthouse,
    min_replicas: u64,
    connect_timeout: Duration,
    /// The group may span several nodes: the manager of the node that
    /// forms each round as group rank 0 (it hosts the round's job store)
    /// serves the whole group.
    multi_node: bool,
}

/// The `--ft` plan of `a` (`None` without `--ft`), or the flag that is wrong.
pub(super) fn plan(a: &RunArgs, max_nodes: usize) -> anyhow::Result<Option<FtPlan>> {
    if !a.ft {
        if a.ft_serve_lighthouse.is_some() {
            bail!("--ft-serve-lighthouse needs --ft");
        }
        return Ok(None);
    }
    let Some(group) = a.ft_replica_group.clone() else {
        bail!("--ft needs --ft-replica-group ID (this replica group's id, unique among the job's live groups)");
    };
    check_group_id(&group)?;
    let lighthouse = match (&a.ft_lighthouse, a.ft_serve_lighthouse) {
        (Some(l), None) => Lighthouse::At(parse_lighthouse(l)?),
        (None, Some(bind)) => Lighthouse::Serve(bind),
        (Some(_), Some(_)) => bail!(
            "--ft-lighthouse and --ft-serve-lighthouse: give one (with --ft-serve-lighthouse this group uses the one it serves)"
        ),
        (None, None) => bail!(
            "--ft needs --ft-lighthouse HOST:PORT (the quorum service), or --ft-serve-lighthouse to run one here"
        ),
    };
    if !(a.ft_connect_timeout.is_finite() && a.ft_connect_timeout > 0.0) {
        bail!(
            "--ft-connect-timeout {}: expected seconds above 0",
            a.ft_connect_timeout
        );
    }
    let min_replicas = match (a.ft_min_replicas, &lighthouse) {
        (None, _) => 1,
        (Some(0), _) => bail!("--ft-min-replicas 0: a quorum needs at least one replica group"),
        (Some(n), Lighthouse::Serve(_)) => n,
        (Some(_), Lighthouse::At(_)) => bail!(
            "--ft-min-replicas is the served lighthouse's (--ft-serve-lighthouse); with --ft-lighthouse set it where that lighthouse runs (rally lighthouse --min_replicas)"
        ),
    };
    Ok(Some(FtPlan {
        replica_group: group,
        lighthouse,
        min_replicas,
        connect_timeout: Duration::from_secs_f64(a.ft_connect_timeout),
        multi_node: max_nodes > 1,
    }))
}

/// A replica group id is a name in logs, metrics labels and store keys:
/// printable, no spaces, not too long.
fn check_group_id(id: &str) -> anyhow::Result<()> {
    if id.is_empty() || id.len() > 128 || id.chars().any(|c| c.is_whitespace() || c.is_control()) {
        bail!("--ft-replica-group {id:?}: expected 1 to 128 printable characters without spaces");
    }
    Ok(())
}

/// `HOST:PORT` from `HOST:PORT` or `http://HOST:PORT[/]` (torchft's form).
fn parse_lighthouse(s: &str) -> anyhow::Result<String> {
    let bare = s.strip_prefix("http://").unwrap_or(s).trim_end_matches('/');
    let ok = match bare.rsplit_once(':') {
        Some((host, port)) => !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0),
        None => false,
    };
    if !ok || bare.contains('/') {
        bail!("--ft-lighthouse {s:?}: expected HOST:PORT (or http://HOST:PORT)");
    }
    Ok(bare.to_owned())
}

/// Where this host reaches a lighthouse bound at `bind`: loopback for a
/// wildcard bind.
fn local_address(bind: SocketAddr) -> String {
    match bind {
        SocketAddr::V4(v4) if v4.ip().is_unspecified() => format!("127.0.0.1:{}", v4.port()),
        SocketAddr::V6(v6) if v6.ip().is_unspecified() => format!("127.0.0.1:{}", v6.port()),
        other => other.to_string(),
    }
}

/// The running parts of `--ft`: the manager and, with
/// `--ft-serve-lighthouse`, the lighthouse.
pub(super) struct Ft {
    manager: Arc<Manager>,
    lighthouse: String,
    replica_group: String,
    multi_node: bool,
}

/// `RALLY_FT_MANAGER`'s value that sends workers to the job store's
/// [`MANAGER_KEY`].
const STORE: &str = "store";

/// The job store's key holding the group's manager `host:port` (the
/// workers' `rallypoint.ft._locate.KEY`).
const MANAGER_KEY: &str = "rally/ft/manager";

impl Ft {
    /// Serves the lighthouse if asked, starts the manager (trying the
    /// lighthouse up to the connect timeout), and puts the workers'
    /// variables in the environment they inherit.
    pub(super) fn start(rt: &Runtime, plan: FtPlan, world_size: usize) -> anyhow::Result<Ft> {
        let lighthouse = match plan.lighthouse {
            Lighthouse::Serve(bind) => {
                let bound = rt.block_on(serve_lighthouse(bind, plan.min_replicas))?;
                say!(
                    "rally run: serving the lighthouse on {bound} (min replicas {})",
                    plan.min_replicas
                );
                local_address(bound)
            }
            Lighthouse::At(at) => at,
        };
        rt.block_on(reach(&lighthouse, plan.connect_timeout))?;
        // A later node of a group of several would find its own group live.
        let grace = if plan.multi_node {
            rallypoint_ft::status::ID_HELD_GRACE
        } else {
            rt.block_on(not_live_elsewhere(&lighthouse, &plan.replica_group))?
        };
        // Every interface, port 0, heartbeats every 100 ms, a worker silent
        // for 1 s after beating taken for stopped.
        let mut config = Config::new(&plan.replica_group, &lighthouse, world_size);
        config.connect_timeout = plan.connect_timeout;
        config.id_held_grace = grace;
        let manager = rt
            .block_on(Manager::start(config))
            .with_context(|| format!("--ft: replica group {:?}", plan.replica_group))?;
        let manager = Arc::new(manager);
        say!(
            "rally run: replica group {:?}, lighthouse {lighthouse}, manager at {}",
            plan.replica_group,
            manager.address()
        );
        // With several nodes the workers read the manager's address from
        // the round's job store, where group rank 0's agent puts it
        // ([`AgentHook`]).
        let where_ = if plan.multi_node {
            STORE
        } else {
            manager.address()
        };
        std::env::set_var("RALLY_FT_MANAGER", where_);
        std::env::set_var("RALLY_FT_REPLICA_GROUP", &plan.replica_group);
        std::env::set_var("REPLICA_GROUP_ID", &plan.replica_group);
        let url = format!("http://{lighthouse}");
        std::env::set_var("RALLY_FT_LIGHTHOUSE", &url);
        std::env::set_var("TORCHFT_LIGHTHOUSE", &url);
        Ok(Ft {
            manager,
            lighthouse,
            replica_group: plan.replica_group,
            multi_node: plan.multi_node,
        })
    }

    /// The sink that tells the manager what the agent does: a round's
    /// workers started (its world size; with several nodes, group rank 0
    /// publishes the manager's address in the round's job store), or
    /// stopped (a failure, a restart, a signal).
    pub(super) fn agent_hook(&self, rt: &Runtime) -> Arc<dyn EventSink> {
        Arc::new(AgentHook {
            manager: self.manager.clone(),
            multi_node: self.multi_node,
            rt: rt.handle().clone(),
        })
    }

    /// Stops the run (as SIGTERM would) once the lighthouse has refused
    /// this group's id for good: two groups with one id started at the
    /// same moment both passed the check at start, and this one lost.
    /// [`Ft::refused`] then says why. Not for a group of several nodes:
    /// its manager moves to the node that forms a round as group rank 0,
    /// and the old node's session may hold the id a while (it is not
    /// checked at start either).
    pub(super) fn stop_when_refused(&self, rt: &Runtime, stopper: Stopper) {
        if self.multi_node {
            return;
        }
        let mut status = self.manager.status();
        rt.spawn(async move {
            if status.wait_for(|s| s.id_refused.is_some()).await.is_ok() {
                stopper.stop(libc::SIGTERM);
            }
        });
    }

    /// Why the lighthouse refused this group's id for good, if it did.
    pub(super) fn refused(&self) -> Option<String> {
        self.manager.status().borrow().id_refused.clone()
    }

    /// The manager's `/status` and `/metrics` section.
    pub(super) fn section(&self) -> Arc<dyn Section> {
        Arc::new(FtSection(self.manager.clone()))
    }

    /// Renders the manager's events to `sink` (console and `--events`)
    /// until the runtime ends.
    pub(super) fn forward_events(&self, rt: &Runtime, sink: Arc<dyn EventSink>) {
        let mut events = self.manager.events();
        let group = self.replica_group.clone();
        rt.spawn(async move {
            use tokio::sync::broadcast::error::RecvError;
            loop {
                let e = match events.recv().await {
                    Ok(e) => e,
                    Err(RecvError::Lagged(n)) => {
                        say!("rally run: replica group {group:?}: {n} ft event(s) not shown (too many at once)");
                        continue;
                    }
                    Err(RecvError::Closed) => break,
                };
                say_event(&group, &e);
                let (name, fields) = event_json(&e);
                sink.emit(&AgentEvent::Embedder { name, fields });
            }
        });
    }

    /// The closing lines of the run's report: how the group fared.
    pub(super) fn summary(&self) -> String {
        let s = self.manager.status().borrow().clone();
        format!(
            "rally run: replica group {:?} (lighthouse {}): {} step(s) committed, {} not committed{}; last quorum {} with {} group(s); {} heal(s), {} bytes in {:.3} s; {} join(s), {} drop(s) seen",
            self.replica_group,
            self.lighthouse,
            s.commits,
            s.not_committed,
            s.last_not_committed_reason
                .as_deref()
                .map(|r| format!(" (last: {r})"))
                .unwrap_or_default(),
            s.quorum_id.map(|q| q.to_string()).unwrap_or_else(|| "none".into()),
            s.members.len(),
            s.heals,
            s.heal_bytes,
            s.heal_seconds,
            s.joins,
            s.drops,
        )
    }

    /// Tells the lighthouse this group is gone and stops serving.
    pub(super) fn shutdown(self, rt: &Runtime) {
        // At once, whoever else still holds the manager (the status server).
        self.manager.workers_stopped("rally run ended");
        if let Ok(m) = Arc::try_unwrap(self.manager) {
            rt.block_on(async {
                let _ = tokio::time::timeout(Duration::from_secs(2), m.shutdown()).await;
            });
        }
    }
}

/// Tries to open a TCP connection to the lighthouse until one opens or
/// `timeout` passes (a lighthouse that is itself restarting is ridden out),
/// so a wrong address fails the run before any worker starts.
async fn reach(lighthouse: &str, timeout: Duration) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut pause = Duration::from_millis(50);
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let error =
            match tokio::time::timeout(left, tokio::net::TcpStream::connect(lighthouse)).await {
                Ok(Ok(_)) => return Ok(()),
                Ok(Err(e)) => e.to_string(),
                Err(_) => "no answer".to_owned(),
            };
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            bail!(
                "cannot reach the lighthouse at {lighthouse} within {:.1} s (--ft-connect-timeout): {error}",
                timeout.as_secs_f64()
            );
        }
        tokio::time::sleep(pause.min(left)).await;
        pause = (pause * 2).min(Duration::from_secs(1));
    }
}

/// How long a replica id seen live at the lighthouse may take to go before
/// this group takes it for another live group's: the lighthouse's heartbeat
/// timeout (a host that died and came back at once finds its old holder
/// live that long) plus this margin, and at least
/// [`rallypoint_ft::status::ID_HELD_GRACE`].
const LIVE_MARGIN: Duration = Duration::from_millis(1500);

/// Fails when the lighthouse (`rally lighthouse`'s `/status`) counts this
/// replica group's id as a live replica for longer than its grace (see
/// [`LIVE_MARGIN`]): another `rally run --ft` with the same
/// `--ft-replica-group` is running. Returns that grace, which also bounds
/// how long the manager lets the lighthouse refuse the id later (two groups
/// started at the same moment both pass here). torchft's lighthouse has no
/// JSON status (and takes a second join of an id as the first's): nothing
/// is checked there.
async fn not_live_elsewhere(lighthouse: &str, group: &str) -> anyhow::Result<Duration> {
    let default = rallypoint_ft::status::ID_HELD_GRACE;
    let mut grace = None;
    let start = tokio::time::Instant::now();
    loop {
        let status = match lighthouse_status(lighthouse).await {
            Ok(v) => v,
            Err(e) => {
                tracing::debug!(%lighthouse, error = %e, "no JSON status at the lighthouse: the group id is not checked");
                return Ok(default);
            }
        };
        let grace = *grace.get_or_insert_with(|| {
            let hb = status["heartbeat_timeout_ms"]
                .as_u64()
                .map(Duration::from_millis);
            hb.map_or(default, |hb| (hb + LIVE_MARGIN).max(default))
        });
        let healthy = status["healthy"].as_array().cloned().unwrap_or_default();
        if !healthy.iter().any(|h| h == group) {
            return Ok(grace);
        }
        let deadline = start + grace;
        if tokio::time::Instant::now() >= deadline {
            bail!(
                "replica group {group:?} is live at the lighthouse {lighthouse} already (for {:.1} s): another \
                 `rally run --ft` has --ft-replica-group {group}; each live group needs its own id",
                grace.as_secs_f64()
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// `GET /status` of the lighthouse at `host:port`, as JSON (within 2 s).
async fn lighthouse_status(lighthouse: &str) -> anyhow::Result<Value> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let get = async {
        let mut c = tokio::net::TcpStream::connect(lighthouse).await?;
        if let Some(secret) = rallypoint_auth::process_secret() {
            let server = c.peer_addr()?;
            let deadline = std::time::Instant::now() + Duration::from_secs(2);
            let service = rallypoint_auth::Service::LIGHTHOUSE;
            rallypoint_auth::io::tokio::client_handshake(
                &mut c, server, &secret, service, deadline,
            )
            .await?;
        }
        c.write_all(
            format!("GET /status HTTP/1.1\r\nHost: {lighthouse}\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await?;
        let mut body = Vec::new();
        c.take(4 << 20).read_to_end(&mut body).await?;
        anyhow::Ok(body)
    };
    let raw = tokio::time::timeout(Duration::from_secs(2), get)
        .await
        .context("no answer within 2 s")??;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").context("no HTTP head")?;
    if !head.starts_with("HTTP/1.1 200") {
        bail!("{}", head.lines().next().unwrap_or_default());
    }
    Ok(serde_json::from_str(body)?)
}

/// `rally lighthouse` inside this process, with its defaults but
/// `min_replicas`; serves until the runtime ends.
async fn serve_lighthouse(bind: SocketAddr, min_replicas: u64) -> anyhow::Result<SocketAddr> {
    use rallypoint_lighthouse::quorum::Knobs;
    use rallypoint_lighthouse::service::{Config as LhConfig, Server};
    let server = Server::bind(bind, LhConfig::new(Knobs::ours(min_replicas)))
        .await
        .with_context(|| format!("--ft-serve-lighthouse: cannot listen on {bind}"))?;
    let bound = server.local_addr().context("--ft-serve-lighthouse")?;
    tokio::spawn(async move {
        if let Err(e) = server.run(std::future::pending()).await {
            say!("rally run: the lighthouse stopped serving: {e:#}");
        }
    });
    Ok(bound)
}

/// Tells the manager what the agent does with this group's workers.
struct AgentHook {
    manager: Arc<Manager>,
    multi_node: bool,
    rt: tokio::runtime::Handle,
}

impl EventSink for AgentHook {
    fn emit(&self, event: &AgentEvent) {
        let reason = match event {
            AgentEvent::WorkersStarted {
                group_rank,
                world_size,
                master_addr,
                master_port,
                ..
            } => {
                self.manager.set_world_size(*world_size);
                if self.multi_node && *group_rank == 0 {
                    let store = format!("{master_addr}:{master_port}");
                    let address = self.manager.address().to_owned();
                    self.rt.spawn(async move {
                        if let Err(e) = publish(&store, &address).await {
                            say!("rally run: cannot publish the ft manager's address in the job store at {store}: {e:#}");
                        }
                    });
                }
                return;
            }
            AgentEvent::WorkerFailed(r) => {
                format!("worker rank {} (pid {}) failed: {}", r.rank, r.pid, r.exit)
            }
            AgentEvent::GroupRestarting { cause, .. } => format!(
                "the group is restarting ({})",
                cause.as_deref().unwrap_or("unknown cause")
            ),
            AgentEvent::SignalReceived { signal, .. } => format!(
                "rally run received {}",
                rallypoint_elastic::multiprocessing::signal_name(*signal)
            ),
            _ => return,
        };
        self.manager.workers_stopped(&reason);
    }
}

/// Puts the manager's address under [`MANAGER_KEY`] of the round's job
/// store at `store` (this node hosts it; one round trip, within 10 s).
async fn publish(store: &str, address: &str) -> anyhow::Result<()> {
    use rallypoint_store::Store as _;
    let (host, port) = store.rsplit_once(':').context("job store address")?;
    let put = async {
        let s = rallypoint_store::TcpStore::builder(host, port.parse()?)
            .connect()
            .await?;
        s.set(MANAGER_KEY, address.as_bytes()).await?;
        anyhow::Ok(())
    };
    tokio::time::timeout(Duration::from_secs(10), put)
        .await
        .context("no answer within 10 s")?
}

/// The manager's status in `/status` (`"ft"`) and `/metrics` (`rally_ft_*`).
struct FtSection(Arc<Manager>);

impl Section for FtSection {
    fn name(&self) -> &str {
        "ft"
    }

    fn to_json(&self) -> Value {
        let s = self.0.status().borrow().clone();
        json!({
            "replica_group": s.replica_id, "lighthouse": s.lighthouse,
            "connected": s.connected, "quorum_id": s.quorum_id, "members": s.members,
            "max_step": s.max_step, "commits": s.commits,
            "not_committed": s.not_committed,
            "last_not_committed_reason": s.last_not_committed_reason,
            "joins": s.joins, "drops": s.drops, "heals": s.heals,
            "heal_bytes": s.heal_bytes, "heal_seconds": s.heal_seconds,
            "last_error": s.last_error,
        })
    }

    fn to_prometheus(&self) -> String {
        let s = self.0.status().borrow().clone();
        let labels = format!(
            "replica_group=\"{}\"",
            rallypoint_elastic::agent::status::esc(&s.replica_id)
        );
        let mut out = String::new();
        for (name, kind, help, value) in [
            (
                "rally_ft_connected",
                "gauge",
                "1 while the manager holds a lighthouse connection.",
                f64::from(u8::from(s.connected)),
            ),
            (
                "rally_ft_quorum_id",
                "gauge",
                "The id of the last quorum this group took part in (-1: none).",
                s.quorum_id.map_or(-1.0, |q| q as f64),
            ),
            (
                "rally_ft_quorum_members",
                "gauge",
                "Replica groups in the last quorum.",
                s.members.len() as f64,
            ),
            (
                "rally_ft_step",
                "gauge",
                "The highest step among the last quorum's members.",
                s.max_step as f64,
            ),
            (
                "rally_ft_commits_total",
                "counter",
                "Steps this group committed.",
                s.commits as f64,
            ),
            (
                "rally_ft_not_committed_total",
                "counter",
                "Steps this group did not commit.",
                s.not_committed as f64,
            ),
            (
                "rally_ft_joins_total",
                "counter",
                "Replica groups that joined a quorum of this group.",
                s.joins as f64,
            ),
            (
                "rally_ft_drops_total",
                "counter",
                "Replica groups that left a quorum of this group.",
                s.drops as f64,
            ),
            (
                "rally_ft_heals_total",
                "counter",
                "Heals of this group's workers.",
                s.heals as f64,
            ),
            (
                "rally_ft_heal_bytes_total",
                "counter",
                "Bytes received by heals.",
                s.heal_bytes as f64,
            ),
            (
                "rally_ft_heal_seconds_total",
                "counter",
                "Seconds spent receiving heals.",
                s.heal_seconds,
            ),
        ] {
            out.push_str(&format!(
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{{labels}}} {value}\n"
            ));
        }
        out
    }
}

/// One console line per event.
fn say_event(group: &str, e: &FtEvent) {
    match e {
        FtEvent::Quorum { id, members } => {
            say!("rally run: replica group {group:?}: quorum {id} with {members:?}")
        }
        FtEvent::Joined { replica } => say!("rally run: replica group {group:?}: {replica:?} joined"),
        FtEvent::Dropped { replica } => say!("rally run: replica group {group:?}: {replica:?} dropped"),
        FtEvent::Heal { step, bytes, seconds } => say!(
            "rally run: replica group {group:?}: healed to step {step} ({bytes} bytes in {seconds:.3} s)"
        ),
        FtEvent::NotCommitted { rank, step, reason } => {
            say!("rally run: replica group {group:?}: step {step} not committed (group rank {rank}): {reason}")
        }
        FtEvent::LighthouseLost { error } => {
            say!("rally run: replica group {group:?}: lost the lighthouse: {error}")
        }
        FtEvent::IdRefused { reason } => {
            say!("rally run: replica group {group:?}: stopping: {reason}")
        }
    }
}

/// The `ft.*` event's name and fields.
fn event_json(e: &FtEvent) -> (&'static str, Value) {
    match e {
        FtEvent::Quorum { id, members } => {
            ("ft.quorum", json!({"quorum_id": id, "members": members}))
        }
        FtEvent::Joined { replica } => ("ft.joined", json!({"replica_group": replica})),
        FtEvent::Dropped { replica } => ("ft.dropped", json!({"replica_group": replica})),
        FtEvent::Heal {
            step,
            bytes,
            seconds,
        } => (
            "ft.heal",
            json!({"step": step, "bytes": bytes, "seconds": seconds}),
        ),
        FtEvent::NotCommitted { rank, step, reason } => (
            "ft.not_committed",
            json!({"group_rank": rank, "step": step, "reason": reason}),
        ),
        FtEvent::LighthouseLost { error } => ("ft.lighthouse_lost", json!({"error": error})),
        FtEvent::IdRefused { reason } => ("ft.id_refused", json!({"reason": reason})),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lighthouse_addresses_are_host_port_with_or_without_http() {
        assert_eq!(parse_lighthouse("h:29510").unwrap(), "h:29510");
        assert_eq!(
            parse_lighthouse("http://10.0.0.1:7/").unwrap(),
            "10.0.0.1:7"
        );
        for bad in ["h", "h:", ":80", "h:0", "h:99999", "http://h:1/x", ""] {
            assert!(parse_lighthouse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn group_ids_are_printable_names() {
        check_group_id("0").unwrap();
        check_group_id("rack-3.a").unwrap();
        for bad in ["", "a b", "a\nb", &"x".repeat(129)] {
            assert!(check_group_id(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_wildcard_bind_is_reached_on_loopback() {
        assert_eq!(
            local_address("[::]:29510".parse().unwrap()),
            "127.0.0.1:29510"
        );
        assert_eq!(local_address("0.0.0.0:5".parse().unwrap()), "127.0.0.1:5");
        assert_eq!(local_address("10.1.1.1:5".parse().unwrap()), "10.1.1.1:5");
    }
}
