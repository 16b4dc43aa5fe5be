//! The elastic agent: what `rally run` does on each node.
//!
//! # Shape
//!
//! The agent is one async task ([`Agent::run`]) that owns everything: the
//! rendezvous handler, the running worker group, the round's job store, the
//! trapped signals and the policy. In each phase it waits on exactly what can
//! happen there, always together with the signals:
//!
//! | phase | waits on |
//! |---|---|
//! | `rendezvous` | the join, signals, a note every 10 s |
//! | `starting` | rank assignment and the job store's address, signals |
//! | `running` | worker exits (pidfds), rendezvous checks every `monitor_interval`, signals |
//! | `stopping` | the stop (signal, grace, SIGKILL, orphans), signals (a second one kills at once) |
//! | `recording_failure` | the run store, signals |
//! | `exit_barrier` | the barrier, rendezvous checks, signals |
//!
//! What it waited on becomes a [`policy::Event`]; [`policy::Policy`] — pure, with
//! its table of every transition and tests in simulated time — answers with
//! [`policy::Action`]s, which this driver performs. Nothing else shares mutable
//! state: the status endpoint reads snapshots from a `watch` channel
//! ([`Agent::status`]), and everything worth telling goes out as typed
//! [`events::AgentEvent`]s to the caller's [`events::EventSink`] (the library
//! never prints).
//!
//! # The run store
//!
//! Every node of the run shares a run store (from the rendezvous) with:
//!
//! | key | meaning |
//! |---|---|
//! | `agent/failures` | one JSON [`FailureRecord`] per line, appended by the failing node |
//! | `agent/failed/<round>`, `agent/failed_rounds` | each failed round counted once, job-wide |
//! | `agent/outcome` | `failed` or `succeeded`, written by the node that closes the run |
//! | `agent/r<round>/finished` | nodes that have seen how the run ended |
//!
//! A run closed with `agent/outcome = failed` stops every node's workers; a run
//! closed after success only means "no more rounds": healthy workers elsewhere
//! run to the end.
//!
//! # Outcomes survive the rendezvous host
//!
//! With the `c10d` backend one agent hosts the rendezvous store. When the run
//! ends, that node keeps the store up until every other node has counted itself
//! in `agent/r<round>/finished` (after reading the outcome and the failure log),
//! bounded by the shutdown timeout when the run failed, and for as long as the
//! others are alive and running when it succeeded. A node whose rendezvous checks
//! fail for `lost_grace` while its workers run stops them and fails with "lost
//! the rendezvous host": never "succeeded". A failed exit barrier is reported as
//! such.
//!
//! # Where torchrun differs
//!
//! torchrun counts restarts per agent, so nodes disagree on
//! `TORCHELASTIC_RESTART_COUNT` and on how much budget is left; here both are
//! job-wide: the count is the round number (every (re)start of the group, the same
//! on every node, so each attempt's worker store prefix `/worker/attempt_<n>` and
//! log directory are fresh) and the budget counts each failed round once. A dead
//! node is noticed by the rendezvous, not only when a collective times out. The
//! failure report names the first failure across all nodes. Signals are honoured
//! in every phase (torchrun ignores them while blocked in a store call).

pub mod events;
pub mod policy;
pub mod ranks;
pub mod status;

use std::ffi::OsString;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rallypoint_rendezvous::{RendezvousError, RendezvousHandler, RendezvousInfo};
use rallypoint_store::server::{Server, ServerConfig, ServerHandle};
use rallypoint_store::{Store, StoreError};
use serde_json::{json, Value};
use tokio::sync::{watch, Notify};

use crate::multiprocessing::{
    signal_name, start_processes, Entrypoint, Exit, LogsSpec, ProcessContext, RunLogs, RunResult,
    StartSpec,
};
use events::{AgentEvent, Discard, EventSink};
use policy::{Action, Barrier, Event, Limits, Observation, Phase, Policy, Verdict};
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
    /// How long the rendezvous may be unreachable while workers run before the
    /// node gives up on it ("lost the rendezvous host").
    pub lost_grace: Duration,
    pub virtual_local_rank: bool,
    /// This node's name in failure reports.
    pub hostname: String,
    /// The address this node advertises (`--local-addr`); else the rendezvous
    /// host when it is this machine's loopback, else `hostname`.
    pub local_addr: Option<String>,
    /// Put this mark in every worker's environment (`RALLY_AGENT_MARK`) and kill
    /// whatever carries it when a group stops, so no descendant of a worker
    /// outlives its round, even one that called `setsid`; see
    /// [`crate::multiprocessing::watchdog`].
    pub mark: Option<String>,
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
    pub pid: u32,
    /// torchrun's convention: the exit code, or minus the signal number.
    pub exitcode: i32,
    /// "exit code 3" or "signal SIGKILL".
    pub exit: String,
    /// The error file's message, or a description of the exit.
    pub message: String,
    /// The error file's traceback (at most [`TRACEBACK_MAX`] bytes), if it had one.
    pub traceback: String,
    /// The worker's error file, or `<N/A>` if it wrote none (as torchrun).
    pub error_file: String,
}

/// Longest traceback kept in the failure log (its tail: the raise is at the end).
pub const TRACEBACK_MAX: usize = 16 * 1024;

/// What torchrun shows for a missing error file.
pub const NOT_AVAILABLE: &str = "<N/A>";

impl FailureRecord {
    pub fn to_json(&self) -> Value {
        json!({
            "time": self.time, "host": self.host, "group_rank": self.group_rank,
            "rank": self.rank, "local_rank": self.local_rank, "round": self.round,
            "pid": self.pid, "exitcode": self.exitcode, "exit": self.exit,
            "message": self.message, "traceback": self.traceback,
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
            pid: n("pid") as u32,
            exitcode: v.get("exitcode").and_then(Value::as_i64).unwrap_or(1) as i32,
            exit: s("exit"),
            message: s("message"),
            traceback: s("traceback"),
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

    /// The error-file JSON a launcher writes for this failure (torchrun's
    /// `dump_error_file` layout, with `errorCode`), so a scheduler reading the
    /// launcher's `TORCHELASTIC_ERROR_FILE` sees the root cause.
    pub fn error_json(&self) -> Value {
        let callstack = if self.traceback.is_empty() {
            &self.message
        } else {
            &self.traceback
        };
        let when = UNIX_EPOCH + Duration::from_secs_f64(self.time.max(0.0));
        let mut v = crate::errors::error_json(&self.message, callstack, when);
        v["message"]["errorCode"] = json!(self.exitcode);
        v
    }
}

/// torchrun's layout of one failure (`_FAILURE_FORMAT_TEMPLATE`), with the node
/// and attempt added; the traceback indented under `traceback :`.
impl std::fmt::Display for FailureRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "  time      : {}",
            format_time(self.time).replace(' ', "_")
        )?;
        writeln!(f, "  host      : {}", self.host)?;
        writeln!(
            f,
            "  rank      : {} (local_rank: {}, node: {})",
            self.rank, self.local_rank, self.group_rank
        )?;
        let signal = self
            .exit
            .strip_prefix("signal ")
            .map(|s| format!(" ({s})"))
            .unwrap_or_default();
        writeln!(
            f,
            "  exitcode  : {} (pid: {}){signal}",
            self.exitcode, self.pid
        )?;
        writeln!(f, "  attempt   : {}", self.round)?;
        writeln!(f, "  error_file: {}", self.error_file)?;
        let tb = if self.traceback.is_empty() {
            &self.message
        } else {
            &self.traceback
        };
        write!(f, "  traceback : {}", tb.trim_end().replace('\n', "\n  "))
    }
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
    /// Every worker on this node succeeded, and the job did not fail elsewhere.
    /// `barrier` says why the exit barrier did not complete, if it did not.
    Succeeded {
        attempts: u64,
        barrier: Option<String>,
    },
    /// The job failed: workers failed beyond the restart budget, another node
    /// closed the run after a failure, or the rendezvous host was lost.
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
    /// Workers could not be started, or ranks not assigned.
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

    fn state(&self) -> &'static str {
        match self {
            Outcome::Succeeded { .. } => "succeeded",
            Outcome::NotNeeded => "not_needed",
            Outcome::Signaled { .. } => "signaled",
            _ => "failed",
        }
    }
}

/// How often the agent says it is still waiting for the rendezvous.
const PROGRESS_EVERY: Duration = Duration::from_secs(10);
/// Bounds one rendezvous check (closed? nodes waiting?) and each store call at
/// the end of a run: a store that does not answer in this time counts as
/// unreachable.
const CHECK_TIMEOUT: Duration = Duration::from_secs(2);

/// Keys of the run store (see the module doc).
const FAILURE_LOG: &str = "agent/failures";
const FAILURE_COUNT: &str = "agent/failed_rounds";
const OUTCOME: &str = "agent/outcome";

fn finished_key(round: u64) -> String {
    format!("agent/r{round}/finished")
}

/// The agent of one node.
pub struct Agent {
    spec: AgentSpec,
    handler: Arc<dyn RendezvousHandler>,
    events: Arc<dyn EventSink>,
    status: watch::Sender<Status>,
}

/// The round in progress.
struct Round {
    info: RendezvousInfo,
    ranks: ranks::NodeRanks,
    /// The job store this node hosts for the round (rank 0 with an agent store).
    server: Option<ServerHandle>,
    workers: Option<ProcessContext>,
    started: Instant,
    /// Failures of the last stopped group, to record and report.
    failures: Vec<FailureRecord>,
}

impl Agent {
    pub fn new(spec: AgentSpec, handler: Arc<dyn RendezvousHandler>) -> Agent {
        let status = Status::new(handler.run_id(), &spec.role, spec.max_restarts);
        Agent {
            spec,
            handler,
            events: Arc::new(Discard),
            status: watch::channel(status).0,
        }
    }

    /// Sends every [`AgentEvent`] to `sink` (default: dropped).
    pub fn with_events(mut self, sink: Arc<dyn EventSink>) -> Agent {
        self.events = sink;
        self
    }

    /// Snapshots of the live status (what the status endpoint serves).
    pub fn status(&self) -> watch::Receiver<Status> {
        self.status.subscribe()
    }

    fn emit(&self, e: AgentEvent) {
        self.events.emit(&e);
    }

    /// Runs the job on this node until it ends.
    ///
    /// Poll this future from the thread that lives as long as the workers (e.g.
    /// `Runtime::block_on` on the main thread, not `tokio::spawn`): workers are
    /// started from it, and their parent-death signal follows that thread.
    pub async fn run(self) -> Outcome {
        let mut signals = match Signals::trap(&self.spec.signals) {
            Ok(s) => s,
            Err(e) => return Outcome::Error(format!("cannot trap signals: {e}")),
        };
        let run_logs = match RunLogs::create(&self.spec.logs, self.handler.run_id()) {
            Ok(l) => l,
            Err(e) => return Outcome::Error(e.to_string()),
        };
        let (policy, first) = Policy::start(Limits {
            max_restarts: self.spec.max_restarts,
            lost_grace: self.spec.lost_grace,
        });
        let mut run = Run {
            policy,
            signals: &mut signals,
            round: None,
            join_error: None,
            failed_rounds: 0,
            last_run_store: None,
        };
        let mut queue = std::collections::VecDeque::from([first]);
        loop {
            let action = match queue.pop_front() {
                Some(a) => a,
                // Nothing asked for: keep waiting where we are.
                None => {
                    queue.extend(self.resume(&mut run).await);
                    continue;
                }
            };
            self.status
                .send_modify(|s| s.state = run.policy.phase().name().into());
            let more = match action {
                Action::Join => self.join(&mut run).await,
                Action::Start { .. } => self.start(&mut run, &run_logs).await,
                Action::Stop { signal } => self.stop(&mut run, signal).await,
                // Only meaningful while a stop is under way (handled there).
                Action::Kill => Vec::new(),
                Action::RecordFailure { .. } => self.record_failure(&mut run).await,
                Action::EnterBarrier { .. } => self.barrier(&mut run).await,
                Action::NoteClosedAfterSuccess { round } => {
                    self.emit(AgentEvent::RunClosedAfterSuccess { round });
                    Vec::new()
                }
                Action::NoteUnreachable { error } => {
                    self.emit(AgentEvent::RendezvousUnreachable { error });
                    Vec::new()
                }
                Action::NoteReform { round, waiting } => {
                    self.emit(AgentEvent::MembershipChanged {
                        round,
                        nodes_waiting: waiting,
                    });
                    Vec::new()
                }
                Action::NoteRestart { failed_rounds } => {
                    let cause = run
                        .round
                        .as_ref()
                        .and_then(|r| r.failures.first())
                        .map(|f| format!("rank {} {}", f.rank, f.exit));
                    self.emit(AgentEvent::GroupRestarting {
                        failed_rounds,
                        max_restarts: self.spec.max_restarts,
                        cause,
                    });
                    Vec::new()
                }
                Action::Finish(verdict) => {
                    let outcome = self.finish(verdict, &mut run).await;
                    let code = outcome.exit_code();
                    self.status
                        .send_modify(|s| s.state = outcome.state().into());
                    self.emit(AgentEvent::Finished {
                        state: outcome.state(),
                        exit_code: code,
                    });
                    return outcome;
                }
            };
            queue.extend(more);
        }
    }

    /// Feeds `event` to the policy; a signal is also told to the sink.
    fn decide(&self, policy: &mut Policy, event: Event) -> Vec<Action> {
        if let Event::Signal(signal) = event {
            self.emit(AgentEvent::SignalReceived {
                signal,
                phase: policy.phase().name(),
            });
        }
        policy.on(event, Instant::now())
    }

    /// Ticks every `monitor_interval`, the first one interval from now.
    fn monitor_tick(&self) -> tokio::time::Interval {
        let every = self.spec.monitor_interval;
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick
    }

    /// Waits in the current phase when the policy had nothing to do.
    async fn resume(&self, run: &mut Run<'_>) -> Vec<Action> {
        match run.policy.phase() {
            Phase::Running { .. } => self.running(run).await,
            other => unreachable!("the policy never idles in {other:?}"),
        }
    }

    /// Joins the next round (ending the previous one), noting progress every
    /// 10 s; a signal aborts the join.
    async fn join(&self, run: &mut Run<'_>) -> Vec<Action> {
        if let Some(r) = run.round.take() {
            self.end_round(r).await;
        }
        let started = Instant::now();
        let run_id = self.handler.run_id().to_owned();
        self.emit(AgentEvent::RendezvousStarted {
            run_id: run_id.clone(),
        });
        let handler = self.handler.clone();
        let mut join = tokio::spawn(async move { handler.next_rendezvous().await });
        let mut note =
            tokio::time::interval_at(tokio::time::Instant::now() + PROGRESS_EVERY, PROGRESS_EVERY);
        let joined = loop {
            tokio::select! {
                r = &mut join => break r,
                s = run.signals.recv() => {
                    // Dropping the join mid-way is safe: the rendezvous never
                    // waits for a node that stopped between its steps.
                    join.abort();
                    return self.decide(&mut run.policy, Event::Signal(s));
                }
                _ = note.tick() => self.emit(AgentEvent::RendezvousWaiting {
                    run_id: run_id.clone(),
                    waited: started.elapsed(),
                }),
            }
        };
        let event = match joined {
            Ok(Ok(info)) => {
                self.emit(AgentEvent::RendezvousCompleted {
                    run_id,
                    round: info.round,
                    group_rank: info.rank,
                    group_world_size: info.world_size,
                    duration: started.elapsed(),
                });
                let e = Event::Joined { round: info.round };
                run.last_run_store = Some(info.run_store.clone());
                run.round = Some(Round {
                    info,
                    ranks: ranks::NodeRanks::default(),
                    server: None,
                    workers: None,
                    started: Instant::now(),
                    failures: Vec::new(),
                });
                e
            }
            Ok(Err(e)) => {
                let event = match &e {
                    RendezvousError::GracefulExit { .. } => Event::JoinNotNeeded,
                    RendezvousError::Closed { .. } => Event::JoinClosed,
                    other => {
                        self.emit(AgentEvent::RendezvousFailed {
                            error: other.to_string(),
                        });
                        Event::JoinFailed(other.to_string())
                    }
                };
                run.join_error = Some(e);
                event
            }
            Err(e) => Event::JoinFailed(format!("the rendezvous task failed: {e}")),
        };
        self.decide(&mut run.policy, event)
    }

    /// Ranks, the job store, then the workers.
    async fn start(&self, run: &mut Run<'_>, run_logs: &RunLogs) -> Vec<Action> {
        let r = run.round.as_mut().expect("started after a join");
        let prefix = format!("rally.agent/r{}", r.info.round);
        let setup = async {
            let ranks = ranks::assign(
                &*r.info.store,
                &prefix,
                r.info.rank,
                r.info.world_size,
                &self.spec.role,
                self.spec.local_world_size,
            )
            .await
            .map_err(|e| format!("rank assignment failed: {e}"))?;
            let job = self
                .job_store(&r.info, &prefix)
                .await
                .map_err(|e| format!("job store: {e}"))?;
            Ok::<_, String>((ranks, job))
        };
        let setup = tokio::select! {
            s = setup => s,
            s = run.signals.recv() => return self.decide(&mut run.policy, Event::Signal(s)),
        };
        let (ranks, (master_addr, master_port, server)) = match setup {
            Ok(s) => s,
            Err(e) => return self.decide(&mut run.policy, Event::StartFailed(e)),
        };
        r.ranks = ranks;
        r.server = server;
        let event =
            match self.spawn_workers(r, run_logs, &master_addr, master_port, run.failed_rounds) {
                Ok(()) => Event::Started,
                Err(e) => Event::StartFailed(e),
            };
        self.decide(&mut run.policy, event)
    }

    /// Workers run: wait for their exits, check the rendezvous every
    /// `monitor_interval`, and take signals, until the policy acts.
    async fn running(&self, run: &mut Run<'_>) -> Vec<Action> {
        let r = run.round.as_mut().expect("running in a round");
        let workers = r.workers.as_mut().expect("workers started");
        let mut tick = self.monitor_tick();
        loop {
            let event = tokio::select! {
                ok = workers.watch() => match ok {
                    true => Event::WorkersSucceeded,
                    false => Event::WorkerFailed,
                },
                s = run.signals.recv() => Event::Signal(s),
                _ = tick.tick() => {
                    // Signals still interrupt a slow check.
                    tokio::select! {
                        o = observe(&*self.handler, &*r.info.run_store) => Event::Checked(o),
                        s = run.signals.recv() => Event::Signal(s),
                    }
                }
            };
            if event == Event::WorkersSucceeded {
                self.emit(AgentEvent::WorkersSucceeded {
                    round: r.info.round,
                    duration: r.started.elapsed(),
                });
            }
            let actions = self.decide(&mut run.policy, event);
            if !actions.is_empty() {
                return actions;
            }
        }
    }

    /// Stops the group: `signal`, the grace, SIGKILL, orphans. A second signal
    /// cuts the grace short. Then collects how the workers ended.
    async fn stop(&self, run: &mut Run<'_>, signal: i32) -> Vec<Action> {
        let r = run.round.as_mut().expect("stopping a round");
        let Some(workers) = r.workers.as_mut() else {
            return self.decide(&mut run.policy, Event::Stopped);
        };
        let hurry = Notify::new();
        let stuck = {
            let stopping = workers.stop(signal, self.spec.shutdown_timeout, &hurry);
            tokio::pin!(stopping);
            loop {
                tokio::select! {
                    stuck = &mut stopping => break stuck,
                    s = run.signals.recv() => {
                        if self.decide(&mut run.policy, Event::Signal(s)).contains(&Action::Kill) {
                            hurry.notify_one();
                        }
                    }
                }
            }
        };
        if !stuck.is_empty() {
            self.emit(AgentEvent::StopIncomplete { pids: stuck });
        }
        let result = workers.outcome();
        self.finish_workers(&result);
        let failures = self.failure_records(r, &result);
        for f in &failures {
            self.emit(AgentEvent::WorkerFailed(Box::new(f.clone())));
        }
        r.failures = failures;
        self.decide(&mut run.policy, Event::Stopped)
    }

    /// Kills whatever carries this agent's mark: descendants of workers that
    /// left their process group (`setsid`, double forks).
    fn kill_marked(&self) {
        if let Some(mark) = &self.spec.mark {
            let left = crate::multiprocessing::watchdog::kill_marked(
                mark,
                crate::multiprocessing::KILL_WAIT,
            );
            if !left.is_empty() {
                self.emit(AgentEvent::StopIncomplete { pids: left });
            }
        }
    }

    /// Appends the round's failures to the run's log and counts the round once,
    /// job-wide.
    async fn record_failure(&self, run: &mut Run<'_>) -> Vec<Action> {
        let r = run.round.as_ref().expect("a failed round");
        let store = &r.info.run_store;
        let round = r.info.round;
        let mut lines = String::new();
        for f in &r.failures {
            lines.push_str(&f.to_json().to_string());
            lines.push('\n');
        }
        let record = async {
            store.append(FAILURE_LOG, lines.as_bytes()).await?;
            // The first node to report a failure in this round counts it.
            let n = if store.add(&format!("agent/failed/{round}"), 1).await? == 1 {
                store.add(FAILURE_COUNT, 1).await?
            } else {
                store.add(FAILURE_COUNT, 0).await?
            };
            Ok::<u64, StoreError>(n.max(0) as u64)
        };
        let event = tokio::select! {
            n = tokio::time::timeout(CHECK_TIMEOUT, record) => match n {
                Ok(Ok(n)) => Event::FailureRecorded { failed_rounds: n },
                _ => Event::FailureNotRecorded,
            },
            s = run.signals.recv() => Event::Signal(s),
        };
        if let Event::FailureRecorded { failed_rounds } = event {
            run.failed_rounds = failed_rounds;
            self.status.send_modify(|s| s.failed_rounds = failed_rounds);
        }
        self.decide(&mut run.policy, event)
    }

    /// Local workers succeeded: wait for every node, while still watching for a
    /// failure elsewhere or a lost store, and for signals.
    async fn barrier(&self, run: &mut Run<'_>) -> Vec<Action> {
        let r = run.round.as_mut().expect("a round");
        if let Some(server) = r.server.take() {
            // The workers are gone: their job store is no longer needed.
            server.shutdown().await;
        }
        let prefix = format!("rally.agent/r{}/terminal_state", r.info.round);
        let wait = rallypoint_store::util::barrier(
            &*r.info.store,
            r.info.world_size,
            &prefix,
            self.spec.exit_barrier_timeout,
            None,
        );
        tokio::pin!(wait);
        let mut tick = self.monitor_tick();
        loop {
            let event = tokio::select! {
                done = &mut wait => Event::Barrier(match done {
                    Ok(()) => Barrier::Passed,
                    Err(e) => match observe(&*self.handler, &*r.info.run_store).await {
                        Observation::Unreachable(why) => Barrier::Lost(format!("{e}; {why}")),
                        _ if e.is_timeout() => Barrier::TimedOut(e.to_string()),
                        _ => Barrier::Lost(e.to_string()),
                    },
                }),
                s = run.signals.recv() => Event::Signal(s),
                _ = tick.tick() => tokio::select! {
                    o = observe(&*self.handler, &*r.info.run_store) => Event::Checked(o),
                    s = run.signals.recv() => Event::Signal(s),
                },
            };
            if let Event::Barrier(Barrier::TimedOut(error)) = &event {
                self.emit(AgentEvent::ExitBarrierTimedOut {
                    error: error.clone(),
                });
            }
            let actions = self.decide(&mut run.policy, event);
            if !actions.is_empty() {
                return actions;
            }
        }
    }

    /// The end: publish the outcome if this node decides it, read the root
    /// cause, count this node as finished, keep a hosted rendezvous store up
    /// until the others have seen the outcome, and let the rendezvous go.
    async fn finish(&self, verdict: Verdict, run: &mut Run<'_>) -> Outcome {
        let round = run.round.take();
        let attempts = round.as_ref().map_or(0, |r| r.info.round + 1);
        let local = round
            .as_ref()
            .and_then(|r| r.failures.first().cloned())
            .map(Box::new);
        let run_store = round.as_ref().map(|r| r.info.run_store.clone());
        let outcome = match verdict {
            Verdict::Succeeded { barrier, .. } => {
                if let Some(s) = &run_store {
                    // Do not overwrite a failure another node published.
                    let _ = bounded(s.compare_set(OUTCOME, b"", b"succeeded")).await;
                }
                // Closed before lingering, so the others see the outcome; the
                // rendezvous's shutdown below closes it otherwise.
                if self.lingers(round.as_ref()) {
                    self.close_run().await;
                }
                Outcome::Succeeded { attempts, barrier }
            }
            Verdict::OutOfRestarts { failed_rounds } => {
                if let Some(s) = &run_store {
                    let error = match bounded(s.set(OUTCOME, b"failed")).await {
                        Some(Ok(())) => None,
                        Some(Err(e)) => Some(e.to_string()),
                        None => Some(format!("no answer within {CHECK_TIMEOUT:?}")),
                    };
                    if let Some(error) = error {
                        self.emit(AgentEvent::CleanupFailed {
                            what: "publishing the failure",
                            error,
                        });
                    }
                }
                self.close_run().await;
                Outcome::Failed {
                    reason: format!(
                        "workers failed {failed_rounds} time(s); --max-restarts is {}",
                        self.spec.max_restarts
                    ),
                    root_cause: self.root_cause(run_store.as_deref()).await.or(local),
                    failures: failed_rounds,
                }
            }
            Verdict::Unrecorded => Outcome::Failed {
                reason: "workers failed and the run store is unreachable".into(),
                root_cause: local,
                failures: run.failed_rounds,
            },
            Verdict::FailedElsewhere(root) => Outcome::Failed {
                reason: "another node ended the run after a failure".into(),
                root_cause: match root {
                    Some(r) => Some(r),
                    None => self.root_cause(run_store.as_deref()).await,
                },
                failures: self.failed_rounds(run_store.as_deref(), run.failed_rounds).await,
            },
            Verdict::LostRendezvous { during } => Outcome::Failed {
                reason: format!(
                    "lost the rendezvous host during {during}: its store stopped answering for {:?}",
                    self.spec.lost_grace
                ),
                root_cause: local,
                failures: run.failed_rounds,
            },
            Verdict::Signaled(signal) => Outcome::Signaled { signal },
            Verdict::NotNeeded => Outcome::NotNeeded,
            Verdict::ClosedWhileJoining => {
                // The run ended while we joined: failed if anyone recorded a failure.
                let store = run.last_run_store.clone();
                match (
                    self.root_cause(store.as_deref()).await,
                    self.failed_rounds(store.as_deref(), 0).await,
                ) {
                    (None, 0) => Outcome::NotNeeded,
                    (root_cause, failures) => Outcome::Failed {
                        reason: "another node ended the run".into(),
                        root_cause,
                        failures,
                    },
                }
            }
            Verdict::JoinFailed(e) => match run.join_error.take() {
                Some(e) => Outcome::Rendezvous(e),
                None => Outcome::Error(e),
            },
            Verdict::StartFailed(e) => Outcome::Error(e),
        };
        if let Some(r) = round {
            // Left open after a signal, as torchrun, so the node can come back.
            let close = !matches!(outcome, Outcome::Signaled { .. });
            let hosting = self.lingers(Some(&r));
            // A node that does not host the store closes the rendezvous before
            // it counts itself finished: once every node has counted, the host
            // may take the store down, and a close after that would fail.
            if close && !hosting {
                self.shutdown_rendezvous().await;
            }
            if close {
                self.linger(&r, &outcome, run.signals).await;
            }
            self.end_round(r).await;
            if close && hosting {
                self.shutdown_rendezvous().await;
            }
        }
        outcome
    }

    /// Closes the rendezvous for every node and stops this node's part in it.
    async fn shutdown_rendezvous(&self) {
        if let Some(Err(e)) = bounded(self.handler.shutdown()).await {
            self.emit(AgentEvent::CleanupFailed {
                what: "closing the rendezvous",
                error: e.to_string(),
            });
        }
    }

    /// Closes the run so no node starts another round.
    async fn close_run(&self) {
        match tokio::time::timeout(CHECK_TIMEOUT, self.handler.set_closed()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => self.emit(AgentEvent::CleanupFailed {
                what: "closing the rendezvous",
                error: e.to_string(),
            }),
            Err(_) => self.emit(AgentEvent::CleanupFailed {
                what: "closing the rendezvous",
                error: format!("no answer within {CHECK_TIMEOUT:?}"),
            }),
        }
    }

    /// The earliest failure in the run's log.
    async fn root_cause(&self, store: Option<&dyn Store>) -> Option<Box<FailureRecord>> {
        let log = tokio::time::timeout(CHECK_TIMEOUT, store?.get_now(FAILURE_LOG))
            .await
            .ok()?
            .ok()?;
        FailureRecord::first_in(&log).map(Box::new)
    }

    async fn failed_rounds(&self, store: Option<&dyn Store>, known: u64) -> u64 {
        let Some(store) = store else { return known };
        match tokio::time::timeout(CHECK_TIMEOUT, store.add(FAILURE_COUNT, 0)).await {
            Ok(Ok(n)) => (n.max(0) as u64).max(known),
            _ => known,
        }
    }

    /// Whether this node keeps the rendezvous store up at the end of `round`.
    fn lingers(&self, round: Option<&Round>) -> bool {
        self.handler.hosts_store() && round.is_some_and(|r| r.info.world_size > 1)
    }

    /// Counts this node as finished; the node hosting the rendezvous store then
    /// keeps it up until every node of the round has (bounded when the run
    /// failed; while the others run, when it succeeded), so they can read the
    /// outcome and the failure log.
    async fn linger(&self, r: &Round, outcome: &Outcome, signals: &mut Signals) {
        let key = finished_key(r.info.round);
        let store = &r.info.run_store;
        if tokio::time::timeout(CHECK_TIMEOUT, store.add(&key, 1))
            .await
            .is_err()
        {
            return;
        }
        if !self.lingers(Some(r)) {
            return;
        }
        let failed = !matches!(outcome, Outcome::Succeeded { .. });
        let bound = failed.then(|| {
            tokio::time::Instant::now()
                + self.spec.shutdown_timeout
                + self.spec.monitor_interval
                + CHECK_TIMEOUT * 2
        });
        let mut said = false;
        loop {
            let finished = match tokio::time::timeout(CHECK_TIMEOUT, store.add(&key, 0)).await {
                Ok(Ok(n)) => n.max(0) as usize,
                _ => return,
            };
            if finished >= r.info.world_size {
                return;
            }
            // A node that died will never count itself.
            if !failed
                && matches!(
                    tokio::time::timeout(CHECK_TIMEOUT, self.handler.num_nodes_waiting()).await,
                    Ok(Ok(n)) if n > 0
                )
            {
                return;
            }
            if !said {
                said = true;
                self.emit(AgentEvent::HostLingering {
                    nodes_left: r.info.world_size - finished,
                });
            }
            let nap = tokio::time::sleep(Duration::from_millis(50));
            tokio::select! {
                _ = nap => {}
                _ = signals.recv() => return,
                _ = async {
                    match bound {
                        Some(b) => tokio::time::sleep_until(b).await,
                        None => std::future::pending().await,
                    }
                } => return,
            }
        }
    }

    /// Releases what a round holds: its job store, and any workers left (none,
    /// normally: every path stops them first).
    async fn end_round(&self, mut r: Round) {
        if let Some(mut w) = r.workers.take() {
            let stuck = w.stop(libc::SIGKILL, Duration::ZERO, &Notify::new()).await;
            if !stuck.is_empty() {
                self.emit(AgentEvent::StopIncomplete { pids: stuck });
            }
        }
        // Daemons a successful worker left behind end with its round.
        self.kill_marked();
        if let Some(server) = r.server.take() {
            server.shutdown().await;
        }
    }

    /// Where this round's workers find their store. With an agent store, the node
    /// with rank 0 hosts a fresh server for every round, so no attempt ever reads
    /// keys an earlier one left (PyTorch reuses one server across attempts, and a
    /// restarted gloo group can read its peers' stale addresses); the others learn
    /// its address from the round's store.
    async fn job_store(
        &self,
        info: &RendezvousInfo,
        prefix: &str,
    ) -> Result<(String, u16, Option<ServerHandle>), StoreError> {
        if !self.handler.use_agent_store() || self.handler.job_store_at_bootstrap() {
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
            let server = Server::bind_any(0, ServerConfig::default()).await?;
            let port = server.local_addr().port();
            let handle = server.spawn();
            info.store
                .set(&key, format!("{addr}\n{port}").as_bytes())
                .await?;
            return Ok((addr, port, Some(handle)));
        }
        let v = info.store.get(&key).await?;
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

    /// Starts the local workers with torchrun's environment.
    fn spawn_workers(
        &self,
        r: &mut Round,
        run_logs: &RunLogs,
        master_addr: &str,
        master_port: u16,
        failed_rounds: u64,
    ) -> Result<(), String> {
        let spec = &self.spec;
        let info = &r.info;
        let ctx = ranks::WorkerContext {
            role: &spec.role,
            local_world_size: spec.local_world_size,
            group_rank: info.rank,
            group_world_size: info.world_size,
            ranks: r.ranks,
            master_addr,
            master_port,
            restart_count: info.round,
            max_restarts: spec.max_restarts,
            run_id: self.handler.run_id(),
            use_agent_store: self.handler.use_agent_store(),
            virtual_local_rank: spec.virtual_local_rank,
        };
        let n = spec.local_world_size;
        let base = r.ranks.base_rank;
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
            envs: (0..n)
                .map(|lr| {
                    let mut env = ranks::worker_env(&ctx, lr);
                    if let Some(mark) = &spec.mark {
                        env.insert(
                            crate::multiprocessing::watchdog::MARK_ENV.into(),
                            mark.clone(),
                        );
                    }
                    (lr, env)
                })
                .collect(),
            global_ranks: (0..n).map(|lr| (lr, base + lr)).collect(),
        };
        let logs = run_logs
            .attempt(info.round.min(u32::MAX as u64) as u32, n)
            .map_err(|e| e.to_string())?;
        let mut workers = start_processes(&start, &spec.logs, &logs)
            .map_err(|e| format!("cannot start workers: {e}"))?;
        workers.set_mark(spec.mark.clone());
        let pids = workers.pids();
        r.workers = Some(workers);
        r.started = Instant::now();
        self.emit(AgentEvent::WorkersStarted {
            round: info.round,
            group_rank: info.rank,
            group_world_size: info.world_size,
            world_size: r.ranks.world_size,
            ranks: base..base + n,
            pids: pids.values().copied().collect(),
            master_addr: master_addr.to_owned(),
            master_port,
            restarts_used: failed_rounds,
        });
        self.status.send_modify(|s| {
            s.round = info.round;
            s.group_rank = info.rank;
            s.nodes = info.world_size;
            s.world_size = r.ranks.world_size;
            s.failed_rounds = failed_rounds;
            s.workers = (0..n)
                .map(|lr| WorkerStatus {
                    local_rank: lr,
                    rank: base + lr,
                    pid: pids.get(&lr).copied().unwrap_or(0),
                    state: "running".into(),
                })
                .collect();
        });
        Ok(())
    }

    fn finish_workers(&self, result: &RunResult) {
        self.status.send_modify(|s| {
            for w in &mut s.workers {
                w.state = match result.exits.get(&w.local_rank) {
                    Some(Exit::Code(0)) => "succeeded".into(),
                    Some(e) => format!("{e}"),
                    None => "unknown".into(),
                };
            }
        });
    }

    fn failure_records(&self, r: &Round, result: &RunResult) -> Vec<FailureRecord> {
        result
            .failures
            .values()
            .map(|f| {
                let exit = match f.exit {
                    Exit::Code(c) => format!("exit code {c}"),
                    Exit::Signal(s) => format!("signal {}", signal_name(s)),
                };
                let traceback = f
                    .error
                    .as_ref()
                    .and_then(|e| e.callstack.as_deref())
                    .map(|t| {
                        let mut cut = t.len().saturating_sub(TRACEBACK_MAX);
                        while !t.is_char_boundary(cut) {
                            cut += 1;
                        }
                        t[cut..].to_owned()
                    })
                    .unwrap_or_default();
                FailureRecord {
                    time: f
                        .timestamp
                        .duration_since(UNIX_EPOCH)
                        .map_or(0.0, |d| d.as_secs_f64()),
                    host: self.spec.hostname.clone(),
                    group_rank: r.info.rank,
                    rank: r.ranks.base_rank + f.local_rank,
                    local_rank: f.local_rank,
                    round: r.info.round,
                    pid: f.pid,
                    exitcode: f.exit.code(),
                    exit,
                    message: f.message(),
                    traceback,
                    error_file: match f.error {
                        Some(_) => f.error_file.display().to_string(),
                        None => NOT_AVAILABLE.to_owned(),
                    },
                }
            })
            .collect()
    }
}

/// `f`, or `None` if it does not finish within [`CHECK_TIMEOUT`].
async fn bounded<T>(f: impl std::future::Future<Output = T>) -> Option<T> {
    tokio::time::timeout(CHECK_TIMEOUT, f).await.ok()
}

/// What the agent's task owns besides its immutable setup.
struct Run<'s> {
    policy: Policy,
    signals: &'s mut Signals,
    round: Option<Round>,
    /// Why the last join failed, for the outcome.
    join_error: Option<RendezvousError>,
    failed_rounds: u64,
    /// The run store of the latest round, to read the outcome after the run
    /// closed while joining.
    last_run_store: Option<Arc<dyn Store>>,
}

/// One bounded look at the rendezvous from a node whose workers run: closed
/// (after a failure, or not), nodes waiting or lost, or unreachable.
async fn observe(handler: &dyn RendezvousHandler, run_store: &dyn Store) -> Observation {
    let look = async {
        if handler.is_closed().await.map_err(|e| e.to_string())? {
            let outcome = run_store
                .get_now(OUTCOME)
                .await
                .map_err(|e| e.to_string())?;
            if outcome == b"failed" {
                let log = run_store
                    .get_now(FAILURE_LOG)
                    .await
                    .map_err(|e| e.to_string())?;
                return Ok(Observation::ClosedAfterFailure(
                    FailureRecord::first_in(&log).map(Box::new),
                ));
            }
            return Ok(Observation::ClosedAfterSuccess);
        }
        Ok::<_, String>(match handler.num_nodes_waiting().await {
            Ok(0) => Observation::Healthy,
            Ok(n) => Observation::NodesWaiting(n),
            Err(e) => return Err(e.to_string()),
        })
    };
    match tokio::time::timeout(CHECK_TIMEOUT, look).await {
        Ok(Ok(o)) => o,
        Ok(Err(e)) => Observation::Unreachable(e),
        Err(_) => Observation::Unreachable(format!("no answer within {CHECK_TIMEOUT:?}")),
    }
}

/// The trapped signals, as one stream (armed for the agent's whole life).
pub struct Signals {
    streams: Vec<(i32, tokio::signal::unix::Signal)>,
}

impl Signals {
    /// Traps every signal in `set` (on the current runtime).
    pub fn trap(set: &[i32]) -> std::io::Result<Signals> {
        let streams = set
            .iter()
            .map(|&n| {
                Ok((
                    n,
                    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::from_raw(n))?,
                ))
            })
            .collect::<std::io::Result<_>>()?;
        Ok(Signals { streams })
    }

    /// The next trapped signal. Cancel-safe: a signal is never lost.
    pub async fn recv(&mut self) -> i32 {
        std::future::poll_fn(|cx| {
            for (n, s) in &mut self.streams {
                if s.poll_recv(cx).is_ready() {
                    return std::task::Poll::Ready(*n);
                }
            }
            std::task::Poll::Pending
        })
        .await
    }
}

pub(crate) fn now_secs() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}
