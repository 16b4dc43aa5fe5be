//! The elastic agent: what `rally run` does on each node.
//!
//! # The loop
//!
//! 1. **Rendezvous.** [`RendezvousHandler::next_rendezvous`] gives the round's
//!    store, this node's group rank, the number of nodes and where workers reach the
//!    job's store. The round number is agreed by every node, and becomes the
//!    workers' `TORCHELASTIC_RESTART_COUNT` (see below).
//! 2. **Ranks.** [`ranks::assign`]: one key per node, agent 0 computes prefix sums.
//! 3. **Start** the local workers with torchrun's environment
//!    ([`ranks::worker_env`]), logs under `attempt_<round>`.
//! 4. **Monitor** every `monitor_interval`, woken at once by a worker's exit:
//!    - all succeeded: the exit barrier (every node reaches it, so early finishers
//!      are not mistaken for lost nodes), then the rendezvous is closed: done;
//!    - a worker failed: the whole local group is stopped, the failure is appended
//!      to the run's failure log, and the round's failure is counted once,
//!      job-wide. While the count is within `--max-restarts` the node re-joins and
//!      the group restarts; beyond it the rendezvous is closed and the job fails
//!      with the root cause (the earliest failure on any node);
//!    - nodes waiting to join, or a member found dead by the rendezvous: the group
//!      re-forms without spending the restart budget;
//!    - the rendezvous closed by another node (which gave up): the group stops;
//!    - a trapped signal: forwarded to the workers, SIGKILL after the shutdown
//!      timeout; the rendezvous is left open so the node can come back.
//!
//! # Where torchrun differs
//!
//! torchrun counts restarts per agent, so nodes disagree on
//! `TORCHELASTIC_RESTART_COUNT` and on how much budget is left; here both are
//! job-wide: the count is the round number (every (re)start of the group, the same
//! on every node, so each attempt's worker store prefix `/worker/attempt_<n>` and
//! log directory are fresh) and the budget counts each failed round once. A dead
//! node is noticed by the rendezvous, not only when a collective times out. The
//! failure report names the first failure across all nodes.

pub mod ranks;
pub mod status;

use std::ffi::OsString;
use std::io::Write;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rallypoint_rendezvous::{RendezvousError, RendezvousHandler, RendezvousInfo};
use rallypoint_store::server::{Server, ServerConfig, ServerHandle};
use rallypoint_store::{Store, StoreError};
use serde_json::{json, Value};
use tokio::runtime::Handle;

use crate::multiprocessing::signals::Signals;
use crate::multiprocessing::{
    signal_name, start_processes, Entrypoint, Exit, LogsSpec, ProcessContext, RunLogs, RunResult,
    StartSpec, Waited,
};
use status::{Status, WorkerStatus};

/// What the agent runs, and how.
#[derive(Debug, Clone)]
pub struct AgentSpec {
    pub role: String,
    /// Workers on this node.
    pub local_world_size: usize,
    pub entrypoint: Entrypoint,
    /// Arguments of every worker; `${local_rank}` is replaced per worker.
    pub args: Vec<OsString>,
    pub max_restarts: u32,
    pub monitor_interval: Duration,
    pub logs: LogsSpec,
    /// Signals trapped and forwarded to the workers.
    pub signals: Vec<i32>,
    /// Grace between the stop signal and SIGKILL.
    pub shutdown_timeout: Duration,
    pub exit_barrier_timeout: Duration,
    pub virtual_local_rank: bool,
    /// This node's name in failure reports.
    pub hostname: String,
    /// The address this node advertises (`--local-addr`); else the rendezvous
    /// host when it is this machine's loopback, else `hostname`.
    pub local_addr: Option<String>,
}

/// A worker failure, as recorded in the run's failure log (one JSON line each).
#[derive(Debug, Clone, PartialEq)]
pub struct FailureRecord {
    /// Seconds since the epoch.
    pub time: f64,
    pub host: String,
    pub group_rank: usize,
    pub rank: usize,
    pub local_rank: usize,
    pub round: u64,
    /// Exit code, or 128 + signal number when signalled.
    pub exitcode: i32,
    /// "exit code 3" or "signal SIGKILL".
    pub exit: String,
    /// The error file's message, if the worker wrote one.
    pub message: String,
    pub error_file: String,
}

impl FailureRecord {
    pub fn to_json(&self) -> Value {
        json!({
            "time": self.time, "host": self.host, "group_rank": self.group_rank,
            "rank": self.rank, "local_rank": self.local_rank, "round": self.round,
            "exitcode": self.exitcode, "exit": self.exit, "message": self.message,
            "error_file": self.error_file,
        })
    }

    pub fn from_json(v: &Value) -> Option<FailureRecord> {
        let s = |k: &str| v.get(k).and_then(Value::as_str).unwrap_or("").to_owned();
        let n = |k: &str| v.get(k).and_then(Value::as_u64).unwrap_or(0);
        Some(FailureRecord {
            time: v.get("time")?.as_f64()?,
            host: s("host"),
            group_rank: n("group_rank") as usize,
            rank: n("rank") as usize,
            local_rank: n("local_rank") as usize,
            round: n("round"),
            exitcode: v.get("exitcode").and_then(Value::as_i64).unwrap_or(1) as i32,
            exit: s("exit"),
            message: s("message"),
            error_file: s("error_file"),
        })
    }

    /// The earliest failure in a failure log.
    pub fn first_in(log: &[u8]) -> Option<FailureRecord> {
        String::from_utf8_lossy(log)
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter_map(|v| FailureRecord::from_json(&v))
            .min_by(|a, b| a.time.total_cmp(&b.time))
    }
}

impl std::fmt::Display for FailureRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "  time       : {}", format_time(self.time))?;
        writeln!(f, "  host       : {}", self.host)?;
        writeln!(
            f,
            "  rank       : {} (local_rank {}, node {})",
            self.rank, self.local_rank, self.group_rank
        )?;
        writeln!(
            f,
            "  exit       : {} (exitcode {})",
            self.exit, self.exitcode
        )?;
        writeln!(f, "  attempt    : {}", self.round)?;
        if !self.error_file.is_empty() {
            writeln!(f, "  error_file : {}", self.error_file)?;
        }
        if self.message.is_empty() {
            write!(f, "  message    : (none: the worker wrote no error file)")
        } else {
            write!(f, "  message    : {}", self.message)
        }
    }
}

fn now_secs() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// UTC `YYYY-MM-DD HH:MM:SS.mmm`.
pub fn format_time(secs: f64) -> String {
    let total = secs.max(0.0);
    let days = (total / 86400.0).floor() as i64;
    let rem = total - days as f64 * 86400.0;
    let (h, m, s) = (
        (rem / 3600.0) as u32,
        ((rem % 3600.0) / 60.0) as u32,
        rem % 60.0,
    );
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let mo = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(mo <= 2);
    format!("{y:04}-{mo:02}-{d:02} {h:02}:{m:02}:{s:06.3} UTC")
}

/// How a run ended.
#[derive(Debug)]
pub enum Outcome {
    /// Every worker on every node succeeded.
    Succeeded { attempts: u64 },
    /// The job failed: workers failed beyond the restart budget, or another node
    /// gave up and closed the run.
    Failed {
        reason: String,
        root_cause: Option<Box<FailureRecord>>,
        failures: u64,
    },
    /// A trapped signal stopped this node.
    Signaled { signal: i32 },
    /// This node was a spare and the job ended without it.
    NotNeeded,
    /// The rendezvous failed (timeout, unreachable store, ...).
    Rendezvous(RendezvousError),
    /// Workers could not be started, or the agent's own store traffic failed.
    Error(String),
}

impl Outcome {
    /// The process exit code for `rally run`: 0 success (or not needed), 1 job
    /// failed, 3 rendezvous failed, 4 agent error, 128 + signal when signalled.
    pub fn exit_code(&self) -> i32 {
        match self {
            Outcome::Succeeded { .. } | Outcome::NotNeeded => 0,
            Outcome::Failed { .. } => 1,
            Outcome::Rendezvous(_) => 3,
            Outcome::Error(_) => 4,
            Outcome::Signaled { signal } => 128 + signal,
        }
    }
}

/// JSON-lines events, when asked for.
#[derive(Clone, Default)]
pub struct Events {
    out: Option<Arc<Mutex<Box<dyn Write + Send>>>>,
}

impl Events {
    pub fn to(out: Box<dyn Write + Send>) -> Events {
        Events {
            out: Some(Arc::new(Mutex::new(out))),
        }
    }

    /// Writes `{"event": name, "time": ..., ...fields}` as one line.
    pub fn emit(&self, name: &str, fields: Value) {
        let Some(out) = &self.out else { return };
        let mut v = json!({ "event": name, "time": now_secs() });
        if let (Some(obj), Value::Object(extra)) = (v.as_object_mut(), fields) {
            obj.extend(extra);
        }
        let mut out = out.lock().unwrap_or_else(|e| e.into_inner());
        let _ = writeln!(out, "{v}");
        let _ = out.flush();
    }
}

/// How often the agent says it is still waiting for the rendezvous.
const PROGRESS_EVERY: Duration = Duration::from_secs(10);

/// The agent of one node.
pub struct Agent {
    spec: AgentSpec,
    handler: Arc<dyn RendezvousHandler>,
    rt: Handle,
    events: Events,
    status: Arc<Mutex<Status>>,
    /// The run store of the latest round, for reports after the run closed.
    last_run_store: Mutex<Option<Arc<dyn Store>>>,
}

/// Keys of the run store.
const FAILURE_LOG: &str = "agent/failures";
const FAILURE_COUNT: &str = "agent/failed_rounds";

enum Monitored {
    Done(Outcome),
    /// Re-join: after a failure within budget, or for a membership change.
    Restart,
}

impl Agent {
    pub fn new(spec: AgentSpec, handler: Arc<dyn RendezvousHandler>, rt: Handle) -> Agent {
        Agent {
            status: Arc::new(Mutex::new(Status::new(
                handler.run_id(),
                &spec.role,
                spec.max_restarts,
            ))),
            spec,
            handler,
            rt,
            events: Events::default(),
            last_run_store: Mutex::new(None),
        }
    }

    pub fn with_events(mut self, events: Events) -> Agent {
        self.events = events;
        self
    }

    /// The live status (what the status endpoint serves).
    pub fn status(&self) -> Arc<Mutex<Status>> {
        self.status.clone()
    }

    fn set_status(&self, f: impl FnOnce(&mut Status)) {
        f(&mut self.status.lock().unwrap_or_else(|e| e.into_inner()));
    }

    /// Runs the job on this node until it ends. Call from the thread that lives
    /// as long as the workers (their parent-death signal follows it).
    pub fn run(&self) -> Outcome {
        let signals = match Signals::install(&self.spec.signals) {
            Ok(s) => s,
            Err(e) => return Outcome::Error(format!("cannot trap signals: {e}")),
        };
        let run_logs = match RunLogs::create(&self.spec.logs, self.handler.run_id()) {
            Ok(l) => l,
            Err(e) => return Outcome::Error(e.to_string()),
        };
        loop {
            self.set_status(|s| s.state = "rendezvous".into());
            let info = match self.rendezvous(&signals) {
                Ok(info) => info,
                Err(done) => return done,
            };
            match self.run_round(&info, &run_logs, &signals) {
                Monitored::Done(outcome) => {
                    self.set_status(|s| s.state = state_name(&outcome).into());
                    return outcome;
                }
                Monitored::Restart => continue,
            }
        }
    }

    /// Joins the next round; reports progress while waiting; a trapped signal
    /// ends the wait.
    fn rendezvous(&self, signals: &Signals) -> Result<RendezvousInfo, Outcome> {
        let started = Instant::now();
        self.events.emit(
            "rendezvous.started",
            json!({ "run_id": self.handler.run_id() }),
        );
        let handler = self.handler.clone();
        let mut join = self
            .rt
            .spawn(async move { handler.next_rendezvous().await });
        let result = self.rt.block_on(async {
            let mut next_note = started + PROGRESS_EVERY;
            loop {
                tokio::select! {
                    r = &mut join => return Some(r),
                    _ = tokio::time::sleep(Duration::from_millis(50)) => {
                        if signals.peek().is_some() {
                            join.abort();
                            return None;
                        }
                        if Instant::now() >= next_note {
                            next_note += PROGRESS_EVERY;
                            eprintln!(
                                "rally run: still waiting for the rendezvous of run {:?} after {:.0?}",
                                self.handler.run_id(),
                                started.elapsed()
                            );
                        }
                    }
                }
            }
        });
        let result = match result {
            None => {
                let signal = signals.take().unwrap_or(libc::SIGTERM);
                return Err(Outcome::Signaled { signal });
            }
            Some(Ok(r)) => r,
            Some(Err(e)) => return Err(Outcome::Error(format!("rendezvous task failed: {e}"))),
        };
        match result {
            Ok(info) => {
                self.events.emit(
                    "rendezvous.completed",
                    json!({
                        "run_id": self.handler.run_id(), "round": info.round,
                        "group_rank": info.rank, "group_world_size": info.world_size,
                        "master_addr": info.bootstrap.master_addr,
                        "master_port": info.bootstrap.master_port,
                        "duration_ms": started.elapsed().as_millis() as u64,
                    }),
                );
                Ok(info)
            }
            Err(RendezvousError::GracefulExit { .. }) => Err(Outcome::NotNeeded),
            Err(RendezvousError::Closed { .. }) => Err(self.closed_by_others()),
            Err(e) => {
                self.events
                    .emit("rendezvous.failed", json!({ "error": e.to_string() }));
                Err(Outcome::Rendezvous(e))
            }
        }
    }

    /// The run was closed by another node: failed if anyone recorded a failure.
    fn closed_by_others(&self) -> Outcome {
        let store = self
            .last_run_store
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let (root_cause, failures) = match store {
            Some(s) => self.rt.block_on(async {
                let log = s.get_now(FAILURE_LOG).await.unwrap_or_default();
                let n = s.add(FAILURE_COUNT, 0).await.unwrap_or(0).max(0) as u64;
                (FailureRecord::first_in(&log).map(Box::new), n)
            }),
            None => (None, 0),
        };
        if root_cause.is_none() && failures == 0 {
            // Closed after a success elsewhere, with nothing for us to do.
            return Outcome::NotNeeded;
        }
        Outcome::Failed {
            reason: "another node ended the run".into(),
            root_cause,
            failures,
        }
    }
}

impl Agent {
    /// One round: ranks, start, monitor.
    fn run_round(&self, info: &RendezvousInfo, run_logs: &RunLogs, signals: &Signals) -> Monitored {
        let spec = &self.spec;
        *self
            .last_run_store
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(info.run_store.clone());
        let prefix = format!("rally.agent/r{}", info.round);
        let ranks = match self.rt.block_on(ranks::assign(
            &*info.store,
            &prefix,
            info.rank,
            info.world_size,
            &spec.role,
            spec.local_world_size,
        )) {
            Ok(r) => r,
            Err(e) => {
                return Monitored::Done(Outcome::Error(format!("rank assignment failed: {e}")))
            }
        };
        let (master_addr, master_port, server) = match self.job_store(info, &prefix) {
            Ok(j) => j,
            Err(e) => return Monitored::Done(Outcome::Error(format!("job store: {e}"))),
        };
        let outcome = self.run_workers(info, run_logs, signals, ranks, &master_addr, master_port);
        if let Some(server) = server {
            self.rt.block_on(server.shutdown());
        }
        outcome
    }

    /// Where this round's workers find their store. With an agent store, the node
    /// with rank 0 hosts a fresh server for every round, so no attempt ever reads
    /// keys an earlier one left (PyTorch reuses one server across attempts, and a
    /// restarted gloo group can read its peers' stale addresses); the others learn
    /// its address from the round's store.
    fn job_store(
        &self,
        info: &RendezvousInfo,
        prefix: &str,
    ) -> Result<(String, u16, Option<ServerHandle>), StoreError> {
        if !self.handler.use_agent_store() {
            return Ok((
                info.bootstrap.master_addr.clone(),
                info.bootstrap.master_port,
                None,
            ));
        }
        let key = format!("{prefix}/job_store");
        if info.rank == 0 {
            let host = &info.bootstrap.master_addr;
            let loopback = matches!(host.as_str(), "localhost" | "::1") || host.starts_with("127.");
            let addr = match &self.spec.local_addr {
                Some(a) => a.clone(),
                None if loopback => host.clone(),
                None => self.spec.hostname.clone(),
            };
            let server = self.rt.block_on(Server::bind(
                SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, 0)),
                ServerConfig::default(),
            ))?;
            let port = server.local_addr().port();
            let handle = {
                let _enter = self.rt.enter();
                server.spawn()
            };
            self.rt
                .block_on(info.store.set(&key, format!("{addr}\n{port}").as_bytes()))?;
            return Ok((addr, port, Some(handle)));
        }
        let v = self.rt.block_on(info.store.get(&key))?;
        let s = String::from_utf8_lossy(&v);
        let (addr, port) = s
            .split_once('\n')
            .and_then(|(a, p)| Some((a.to_owned(), p.parse().ok()?)))
            .ok_or_else(|| StoreError::UnexpectedReply {
                op: "job store address",
                addr: key.clone(),
                reply: format!("{s:?}"),
            })?;
        Ok((addr, port, None))
    }

    fn run_workers(
        &self,
        info: &RendezvousInfo,
        run_logs: &RunLogs,
        signals: &Signals,
        ranks: ranks::NodeRanks,
        master_addr: &str,
        master_port: u16,
    ) -> Monitored {
        let spec = &self.spec;
        let failures = self
            .rt
            .block_on(info.run_store.add(FAILURE_COUNT, 0))
            .unwrap_or(0)
            .max(0) as u64;
        let ctx = ranks::WorkerContext {
            role: &spec.role,
            local_world_size: spec.local_world_size,
            group_rank: info.rank,
            group_world_size: info.world_size,
            ranks,
            master_addr,
            master_port,
            restart_count: info.round,
            max_restarts: spec.max_restarts,
            run_id: self.handler.run_id(),
            use_agent_store: self.handler.use_agent_store(),
            virtual_local_rank: spec.virtual_local_rank,
        };
        let n = spec.local_world_size;
        let start = StartSpec {
            name: spec.role.clone(),
            entrypoint: spec.entrypoint.clone(),
            args: (0..n)
                .map(|lr| {
                    let args = spec
                        .args
                        .iter()
                        .map(|a| match a.to_str() {
                            Some(s) if s.contains("${local_rank}") => {
                                OsString::from(s.replace("${local_rank}", &lr.to_string()))
                            }
                            _ => a.clone(),
                        })
                        .collect();
                    (lr, args)
                })
                .collect(),
            envs: (0..n).map(|lr| (lr, ranks::worker_env(&ctx, lr))).collect(),
            global_ranks: (0..n).map(|lr| (lr, ranks.base_rank + lr)).collect(),
        };
        let logs = match run_logs.attempt(info.round.min(u32::MAX as u64) as u32, n) {
            Ok(l) => l,
            Err(e) => return Monitored::Done(Outcome::Error(e.to_string())),
        };
        eprintln!(
            "rally run: round {} formed: node {} of {}, ranks {}..{} of {}, job store {}:{}",
            info.round,
            info.rank,
            info.world_size,
            ranks.base_rank,
            ranks.base_rank + n,
            ranks.world_size,
            master_addr,
            master_port
        );
        let started = Instant::now();
        let mut pctx = match start_processes(&start, &spec.logs, &logs) {
            Ok(p) => p,
            Err(e) => return Monitored::Done(Outcome::Error(format!("cannot start workers: {e}"))),
        };
        pctx.set_failure_grace(spec.shutdown_timeout);
        let pids = pctx.pids();
        self.events.emit(
            "workers.started",
            json!({
                "round": info.round, "group_rank": info.rank,
                "group_world_size": info.world_size, "world_size": ranks.world_size,
                "ranks": (0..n).map(|lr| ranks.base_rank + lr).collect::<Vec<_>>(),
                "pids": pids.values().collect::<Vec<_>>(),
                "restarts_used": failures,
            }),
        );
        self.set_status(|s| {
            s.state = "running".into();
            s.round = info.round;
            s.group_rank = info.rank;
            s.nodes = info.world_size;
            s.world_size = ranks.world_size;
            s.failed_rounds = failures;
            s.workers = (0..n)
                .map(|lr| WorkerStatus {
                    local_rank: lr,
                    rank: ranks.base_rank + lr,
                    pid: pids.get(&lr).copied().unwrap_or(0),
                    state: "running".into(),
                })
                .collect();
        });
        self.monitor(info, &mut pctx, &ctx, signals, started)
    }

    fn monitor(
        &self,
        info: &RendezvousInfo,
        pctx: &mut ProcessContext,
        ctx: &ranks::WorkerContext<'_>,
        signals: &Signals,
        started: Instant,
    ) -> Monitored {
        let spec = &self.spec;
        loop {
            match pctx.wait_forwarding(
                signals,
                Some(spec.monitor_interval),
                spec.monitor_interval,
                spec.shutdown_timeout,
            ) {
                Waited::Signaled { signal, result } => {
                    self.finish_workers(&result);
                    self.events.emit(
                        "agent.signaled",
                        json!({ "signal": signal_name(signal), "round": info.round }),
                    );
                    return Monitored::Done(Outcome::Signaled { signal });
                }
                Waited::Finished(result) if !result.is_failed() => {
                    self.finish_workers(&result);
                    self.events.emit(
                        "workers.succeeded",
                        json!({ "round": info.round, "duration_ms": started.elapsed().as_millis() as u64 }),
                    );
                    return Monitored::Done(self.exit_barrier(info));
                }
                Waited::Finished(result) => {
                    self.finish_workers(&result);
                    return self.on_failure(info, ctx, &result);
                }
                Waited::TimedOut => {}
            }
            // Healthy: has the membership changed, or did the run end elsewhere?
            let checks = self.rt.block_on(async {
                let waiting = self.handler.num_nodes_waiting().await?;
                let closed = self.handler.is_closed().await?;
                Ok::<_, RendezvousError>((waiting, closed))
            });
            match checks {
                Ok((_, true)) => {
                    pctx.close(libc::SIGTERM, spec.shutdown_timeout);
                    self.events
                        .emit("run.closed_elsewhere", json!({ "round": info.round }));
                    return Monitored::Done(self.closed_by_others());
                }
                Ok((waiting, false)) if waiting > 0 => {
                    eprintln!(
                        "rally run: membership changed ({waiting} node(s) waiting or lost); re-forming the group"
                    );
                    self.events.emit(
                        "membership.changed",
                        json!({ "round": info.round, "nodes_waiting": waiting }),
                    );
                    pctx.close(libc::SIGTERM, spec.shutdown_timeout);
                    return Monitored::Restart;
                }
                Ok(_) => {}
                Err(e) => {
                    // The rendezvous store is unreachable: keep the workers running
                    // (they may not need it) but say so.
                    tracing::warn!(error = %e, "cannot check the rendezvous");
                }
            }
        }
    }

    fn finish_workers(&self, result: &RunResult) {
        self.set_status(|s| {
            for w in &mut s.workers {
                w.state = match result.exits.get(&w.local_rank) {
                    Some(Exit::Code(0)) => "succeeded".into(),
                    Some(e) => format!("{e}"),
                    None => "unknown".into(),
                };
            }
        });
    }

    /// After local success: wait for every node, then close the run.
    fn exit_barrier(&self, info: &RendezvousInfo) -> Outcome {
        let prefix = format!("rally.agent/r{}/terminal_state", info.round);
        let barrier = self.rt.block_on(rallypoint_store::util::barrier(
            &*info.store,
            info.world_size,
            &prefix,
            self.spec.exit_barrier_timeout,
            None,
        ));
        if let Err(e) = barrier {
            // Our workers succeeded; a node that never arrives is its own failure.
            tracing::warn!(error = %e, "exit barrier failed");
            eprintln!("rally run: exit barrier: {e}");
        }
        if let Err(e) = self.rt.block_on(self.handler.shutdown()) {
            tracing::warn!(error = %e, "could not close the rendezvous");
        }
        self.events
            .emit("run.succeeded", json!({ "round": info.round }));
        Outcome::Succeeded {
            attempts: info.round + 1,
        }
    }

    /// A local worker failed: log it for the whole run, count the round once, and
    /// restart or give up.
    fn on_failure(
        &self,
        info: &RendezvousInfo,
        ctx: &ranks::WorkerContext<'_>,
        result: &RunResult,
    ) -> Monitored {
        let records: Vec<FailureRecord> = result
            .failures
            .values()
            .map(|f| {
                let (exitcode, exit) = match f.exit {
                    Exit::Code(c) => (c, format!("exit code {c}")),
                    Exit::Signal(s) => (128 + s, format!("signal {}", signal_name(s))),
                };
                FailureRecord {
                    time: f
                        .timestamp
                        .duration_since(UNIX_EPOCH)
                        .map_or(0.0, |d| d.as_secs_f64()),
                    host: self.spec.hostname.clone(),
                    group_rank: ctx.group_rank,
                    rank: ctx.ranks.base_rank + f.local_rank,
                    local_rank: f.local_rank,
                    round: info.round,
                    exitcode,
                    exit,
                    message: f
                        .error
                        .as_ref()
                        .map(|e| e.message.clone())
                        .unwrap_or_default(),
                    error_file: f.error_file.display().to_string(),
                }
            })
            .collect();
        for r in &records {
            self.events.emit("worker.failed", r.to_json());
        }
        let counted: Result<u64, StoreError> = self.rt.block_on(async {
            let mut lines = String::new();
            for r in &records {
                lines.push_str(&r.to_json().to_string());
                lines.push('\n');
            }
            info.run_store.append(FAILURE_LOG, lines.as_bytes()).await?;
            // The first node to report a failure in this round counts it.
            let round_key = format!("agent/failed/{}", info.round);
            let n = if info.run_store.add(&round_key, 1).await? == 1 {
                info.run_store.add(FAILURE_COUNT, 1).await?
            } else {
                info.run_store.add(FAILURE_COUNT, 0).await?
            };
            Ok(n.max(0) as u64)
        });
        let failures = match counted {
            Ok(n) => n,
            Err(e) => {
                return Monitored::Done(Outcome::Failed {
                    reason: format!("workers failed and the run store is unreachable: {e}"),
                    root_cause: records.into_iter().next().map(Box::new),
                    failures: 0,
                })
            }
        };
        self.set_status(|s| s.failed_rounds = failures);
        if failures <= u64::from(self.spec.max_restarts) {
            eprintln!(
                "rally run: worker failed ({}); restarting the group (restart {failures} of {})",
                records
                    .first()
                    .map_or(String::new(), |r| format!("rank {} {}", r.rank, r.exit)),
                self.spec.max_restarts
            );
            self.events.emit(
                "group.restarting",
                json!({ "round": info.round, "failures": failures, "max_restarts": self.spec.max_restarts }),
            );
            return Monitored::Restart;
        }
        // Out of restarts: end the run for everyone, with the job-wide root cause.
        let log = self
            .rt
            .block_on(info.run_store.get_now(FAILURE_LOG))
            .unwrap_or_default();
        let root_cause = FailureRecord::first_in(&log)
            .or_else(|| records.into_iter().next())
            .map(Box::new);
        if let Err(e) = self.rt.block_on(self.handler.set_closed()) {
            tracing::warn!(error = %e, "could not close the rendezvous");
        }
        self.events.emit(
            "run.failed",
            json!({ "failures": failures, "root_cause": root_cause.as_ref().map(|r| r.to_json()) }),
        );
        Monitored::Done(Outcome::Failed {
            reason: format!(
                "workers failed {failures} time(s); --max-restarts is {}",
                self.spec.max_restarts
            ),
            root_cause,
            failures,
        })
    }
}

fn state_name(o: &Outcome) -> &'static str {
    match o {
        Outcome::Succeeded { .. } => "succeeded",
        Outcome::NotNeeded => "not needed",
        Outcome::Signaled { .. } => "signaled",
        _ => "failed",
    }
}
