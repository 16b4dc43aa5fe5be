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
//! Every node of the run shares a run store (from the rendezvous); the keys and
//! the protocol are in [`run_store`]. The run's verdict is one key written by
//! compare-and-set (*succeeded* only over nothing, *failed* over nothing or a
//! success), and the policy closes the rendezvous only after the verdict is
//! there, so no node reads a close as a success that was not one. A published
//! failure stops every node's workers, whatever the backend (`static` too); a
//! run closed after success only means "no more rounds": healthy workers
//! elsewhere run to the end.
//!
//! # Stores outlive the workers that use them
//!
//! A node that serves a store other nodes use (the round's job store, rank 0's
//! with an agent store; the `c10d` rendezvous store; the `static` store on node
//! rank 0) keeps it up at the end until every other node of the run has left
//! the rendezvous or was found dead by the keep-alive (the rendezvous' census:
//! nodes counted in at their first round, out when they leave, on every way
//! out; a node of a later round that re-formed without this one counts too):
//! bounded by the shutdown grace after a failure, for as long as the others
//! live after a success. A node whose
//! rendezvous checks fail for `lost_grace` while its workers run stops them and
//! fails with "lost the rendezvous host": never "succeeded". A failed exit
//! barrier is classified by what the run store says, not by the error alone.
//!
//! The policy's failure orders are tried by the seeded simulator in `sim.rs`
//! (tests only), which checks the run's invariants after every event.
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
pub mod run_store;
#[cfg(test)]
mod sim;
pub mod status;

use std::ffi::OsString;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rallypoint_rendezvous::{RendezvousError, RendezvousHandler, RendezvousInfo};
use rallypoint_store::server::{Server, ServerConfig, ServerHandle};
use rallypoint_store::{Store, StoreError};
use tokio::sync::{watch, Notify};

use crate::multiprocessing::{
    signal_name, start_processes, Entrypoint, Exit, LogsSpec, ProcessContext, RunLogs, RunResult,
    StartSpec,
};
use events::{AgentEvent, Discard, EventSink};
use policy::{Action, Event, Failure, Limits, Observation, Phase, Policy, Verdict};
pub use run_store::{format_time, FailureRecord, NOT_AVAILABLE, TRACEBACK_MAX};
use status::{AgentState, Status, WorkerState, WorkerStatus};

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

    fn state(&self) -> AgentState {
        match self {
            Outcome::Succeeded { .. } => AgentState::Succeeded,
            Outcome::NotNeeded => AgentState::NotNeeded,
            Outcome::Signaled { .. } => AgentState::Signaled,
            _ => AgentState::Failed,
        }
    }
}

/// How often the agent says it is still waiting for the rendezvous.
const PROGRESS_EVERY: Duration = Duration::from_secs(10);
/// Bounds one rendezvous check (verdict? membership changed?) and each store
/// call at the end of a run: a store that does not answer in this time counts as
/// unreachable.
const CHECK_TIMEOUT: Duration = Duration::from_secs(2);
/// How often a lingering host looks whether the others finished.
const LINGER_POLL: Duration = Duration::from_millis(50);
/// How often a join looks at the run store, to notice it gone: a join fails
/// once it has not answered for `lost_grace` (plus at most one probe).
const JOIN_PROBE: Duration = Duration::from_secs(1);

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
    /// Kept until the run ends or the round is left: other nodes' workers may
    /// still use it after this node's workers finished.
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
        let (policy, first) = Policy::start(self.limits());
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
                .send_modify(|s| s.state = run.policy.phase().state());
            let more = match action {
                Action::Join => self.join(&mut run).await,
                Action::Start { .. } => self.start(&mut run, &run_logs).await,
                Action::Stop { signal } => self.stop(&mut run, signal).await,
                // Only meaningful while a stop is under way (handled there).
                Action::Kill => Vec::new(),
                Action::RecordFailure { .. } => self.record_failure(&mut run).await,
                Action::EnterBarrier { .. } => self.barrier(&mut run).await,
                Action::Publish(p) => self.publish(&mut run, &p).await,
                Action::ReadVerdict => self.read_verdict(&mut run).await,
                Action::CloseRendezvous => self.close_rendezvous(&mut run).await,
                Action::MarkFinished { round } => self.mark_finished(&mut run, round).await,
                Action::Linger {
                    round,
                    nodes,
                    bound,
                } => self.linger(&mut run, round, nodes, bound).await,
                Action::NoteClosedAfterSuccess { .. }
                | Action::NoteUnreachable { .. }
                | Action::NoteReform { .. }
                | Action::NoteRestart { .. }
                | Action::NoteRecordRetry { .. } => {
                    self.tell(action, run.round.as_ref());
                    Vec::new()
                }
                Action::Finish(verdict) => {
                    let outcome = self.finish(verdict, &mut run).await;
                    let code = outcome.exit_code();
                    self.status.send_modify(|s| s.state = outcome.state());
                    self.emit(AgentEvent::Finished {
                        state: outcome.state().name(),
                        exit_code: code,
                    });
                    return outcome;
                }
            };
            queue.extend(more);
        }
    }

    /// The policy's knobs, from the spec and the backend.
    /// Emits what a note action tells; hands back any other action.
    fn tell(&self, action: Action, round: Option<&Round>) -> Option<Action> {
        match action {
            Action::NoteClosedAfterSuccess { round } => {
                self.emit(AgentEvent::RunClosedAfterSuccess { round })
            }
            Action::NoteUnreachable { error } => {
                self.emit(AgentEvent::RendezvousUnreachable { error })
            }
            Action::NoteReform {
                round,
                waiting,
                dead,
            } => self.emit(AgentEvent::MembershipChanged {
                round,
                nodes_waiting: waiting,
                members_dead: dead,
            }),
            Action::NoteRestart { failed_rounds } => {
                let cause = round
                    .and_then(|r| r.failures.first())
                    .map(|f| format!("rank {} {}", f.rank, f.exit));
                self.emit(AgentEvent::GroupRestarting {
                    failed_rounds,
                    max_restarts: self.spec.max_restarts,
                    cause,
                });
            }
            Action::NoteRecordRetry { error } => self.emit(AgentEvent::CleanupFailed {
                what: "recording the failure (retrying)",
                error,
            }),
            other => return Some(other),
        }
        None
    }

    /// Tells the notes among `actions` at once and returns the rest: a phase
    /// that waits on something under way (a start, the exit barrier) goes on
    /// waiting after a note instead of abandoning the wait.
    fn tell_notes(&self, actions: Vec<Action>, round: Option<&Round>) -> Vec<Action> {
        actions
            .into_iter()
            .filter_map(|a| self.tell(a, round))
            .collect()
    }

    fn limits(&self) -> Limits {
        Limits {
            max_restarts: self.spec.max_restarts,
            lost_grace: self.spec.lost_grace,
            hosts_rendezvous: self.handler.hosts_store(),
            // The others stop their workers within the shutdown grace once they
            // see the failure (one check away), then count themselves out; one
            // that cannot see it stops them once the store has been gone for
            // `lost_grace`.
            linger_after_failure: self.spec.shutdown_timeout
                + self.spec.monitor_interval
                + CHECK_TIMEOUT * 2
                + self.spec.lost_grace,
            // Without liveness, a node that died silently would be waited for
            // forever: one more exit-barrier timeout, then the host goes.
            linger_after_success: (!self.handler.detects_dead_members())
                .then_some(self.spec.exit_barrier_timeout),
            reforms: self.handler.reforms(),
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

    /// Joins the next round (ending the previous one). The previous round's job
    /// store stays up until the join ends: a member that has not yet noticed the
    /// re-form still runs workers on it, and a store gone under them would read
    /// as their failure.
    async fn join(&self, run: &mut Run<'_>) -> Vec<Action> {
        let previous = match run.round.take() {
            Some(mut r) => {
                let server = r.server.take();
                self.end_round(r).await;
                server
            }
            None => None,
        };
        let actions = self.join_next(run).await;
        if let Some(server) = previous {
            server.shutdown().await;
        }
        actions
    }

    /// Joins the next round, noting progress every 10 s; a signal aborts it.
    async fn join_next(&self, run: &mut Run<'_>) -> Vec<Action> {
        let started = Instant::now();
        let run_id = self.handler.run_id().to_owned();
        self.emit(AgentEvent::RendezvousStarted {
            run_id: run_id.clone(),
        });
        let handler = self.handler.clone();
        let mut join = tokio::spawn(async move { handler.next_rendezvous().await });
        let mut note =
            tokio::time::interval_at(tokio::time::Instant::now() + PROGRESS_EVERY, PROGRESS_EVERY);
        // The run store, probed while the join waits: the join itself would
        // wait out the store client's retries and the join timeout.
        let probed = run
            .last_run_store
            .clone()
            .or_else(|| self.handler.run_store());
        let mut probe =
            tokio::time::interval_at(tokio::time::Instant::now() + JOIN_PROBE, JOIN_PROBE);
        let mut unreachable_since: Option<Instant> = None;
        let joined = loop {
            tokio::select! {
                r = &mut join => break r,
                _ = probe.tick(), if probed.is_some() => {
                    let store = probed.as_ref().expect("probed only with a store");
                    let answer = tokio::time::timeout(
                        JOIN_PROBE,
                        store.check(&[run_store::keys::CLOSED]),
                    )
                    .await;
                    let error = match answer {
                        Ok(Ok(_)) => None,
                        Ok(Err(e)) => Some(e.to_string()),
                        Err(_) => Some(format!("no answer within {JOIN_PROBE:?}")),
                    };
                    match error {
                        None => unreachable_since = None,
                        Some(e) => {
                            let since = *unreachable_since.get_or_insert_with(Instant::now);
                            if since.elapsed() >= self.spec.lost_grace {
                                join.abort();
                                let at = self
                                    .handler
                                    .endpoint()
                                    .map_or(String::new(), |e| format!(" at {e}"));
                                let error = format!(
                                    "the rendezvous store{at} of run {run_id} stopped answering for {:?} while joining (--rdzv-lost-timeout): {e}",
                                    since.elapsed()
                                );
                                self.emit(AgentEvent::RendezvousFailed { error: error.clone() });
                                return self.decide(&mut run.policy, Event::JoinFailed(error));
                            }
                        }
                    }
                }
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
                let e = Event::Joined {
                    round: info.round,
                    nodes: info.world_size,
                };
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
                    RendezvousError::GracefulExit { .. } | RendezvousError::Closed { .. } => {
                        Event::JoinClosed
                    }
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

    /// Ranks, the job store, then the workers; the rendezvous is watched
    /// meanwhile, so a member lost after the round formed re-forms the group at
    /// once instead of costing the store's timeout.
    async fn start(&self, run: &mut Run<'_>, run_logs: &RunLogs) -> Vec<Action> {
        let r = run.round.as_ref().expect("started after a join");
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
        let mut tick = self.monitor_tick();
        let setup = async {
            tokio::pin!(setup);
            loop {
                tokio::select! {
                    s = &mut setup => return Ok(s),
                    s = run.signals.recv() => return Err(self.decide(&mut run.policy, Event::Signal(s))),
                    _ = tick.tick() => {
                        let seen = tokio::select! {
                            o = observe(&*self.handler, &*r.info.run_store, r.info.round) => Event::Checked(o),
                            s = run.signals.recv() => Event::Signal(s),
                        };
                        let actions = self.tell_notes(self.decide(&mut run.policy, seen), None);
                        if !actions.is_empty() {
                            return Err(actions);
                        }
                    }
                }
            }
        };
        let setup = match setup.await {
            Ok(s) => s,
            Err(actions) => return actions,
        };
        let r = run.round.as_mut().expect("started after a join");
        let (ranks, (master_addr, master_port, server)) = match setup {
            Ok(s) => s,
            Err(e) => {
                return self.decide(
                    &mut run.policy,
                    Event::StartFailed(policy::StartError::Store(e)),
                )
            }
        };
        r.ranks = ranks;
        let hosts_job_store = server.is_some();
        r.server = server;
        let event =
            match self.spawn_workers(r, run_logs, &master_addr, master_port, run.failed_rounds) {
                Ok(()) => Event::Started { hosts_job_store },
                Err(e) => Event::StartFailed(policy::StartError::Local(e)),
            };
        if let Event::StartFailed(policy::StartError::Local(e)) = &event {
            // The failure others read as the root cause.
            r.failures = vec![self.start_failure(r, e)];
        }
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
                        o = observe(&*self.handler, &*r.info.run_store, r.info.round) => Event::Checked(o),
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
            return self.decide(&mut run.policy, Event::Stopped { failure: None });
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
        let mut failures = self.failure_records(r, &result);
        failures.sort_by(|a, b| a.time.total_cmp(&b.time));
        for f in &failures {
            self.emit(AgentEvent::WorkerFailed(Box::new(f.clone())));
        }
        let failure = failures.first().cloned().map(Box::new);
        r.failures = failures;
        self.decide(&mut run.policy, Event::Stopped { failure })
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

    /// Records the round's failures in the run store and counts the round once,
    /// job-wide. One bounded attempt; the policy retries within `lost_grace`.
    async fn record_failure(&self, run: &mut Run<'_>) -> Vec<Action> {
        let r = run.round.as_ref().expect("a failed round");
        let store = &*r.info.run_store;
        let record = async {
            let n =
                run_store::record_failure(store, r.info.round, r.info.rank, &r.failures).await?;
            let finishing = run_store::finishing(store, r.info.round).await?;
            Ok::<_, StoreError>((n, finishing))
        };
        let event = tokio::select! {
            n = tokio::time::timeout(CHECK_TIMEOUT, record) => match n {
                Ok(Ok((n, finishing))) => Event::FailureRecorded { failed_rounds: n, finishing },
                Ok(Err(e)) => Event::FailureNotRecorded(e.to_string()),
                Err(_) => Event::FailureNotRecorded(format!("no answer within {CHECK_TIMEOUT:?}")),
            },
            s = run.signals.recv() => Event::Signal(s),
        };
        if let Event::FailureNotRecorded(_) = event {
            // Do not hammer a store that just failed.
            tokio::time::sleep(self.spec.monitor_interval).await;
        }
        if let Event::FailureRecorded { failed_rounds, .. } = event {
            run.failed_rounds = failed_rounds;
            self.status.send_modify(|s| s.failed_rounds = failed_rounds);
        }
        self.decide(&mut run.policy, event)
    }

    /// Local workers succeeded: say that the round is finishing, then wait for
    /// every node, while still watching for a failure elsewhere or a lost store,
    /// and for signals. The round's job store stays up (other nodes' workers may
    /// still use it).
    async fn barrier(&self, run: &mut Run<'_>) -> Vec<Action> {
        let r = run.round.as_mut().expect("a round");
        let _ = bounded(run_store::mark_finishing(&*r.info.run_store, r.info.round)).await;
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
                done = &mut wait => match done {
                    Ok(()) => Event::BarrierPassed,
                    Err(e) => {
                        // What the rendezvous says decides (the policy's table):
                        // a failure published meanwhile is never a timeout.
                        let seen = observe(&*self.handler, &*r.info.run_store, r.info.round).await;
                        if e.is_timeout() {
                            self.emit(AgentEvent::ExitBarrierTimedOut { error: e.to_string() });
                        }
                        Event::BarrierFailed {
                            error: e.to_string(),
                            timed_out: e.is_timeout(),
                            seen,
                        }
                    }
                },
                s = run.signals.recv() => Event::Signal(s),
                _ = tick.tick() => tokio::select! {
                    o = observe(&*self.handler, &*r.info.run_store, r.info.round) => Event::Checked(o),
                    s = run.signals.recv() => Event::Signal(s),
                },
            };
            let actions = self.tell_notes(self.decide(&mut run.policy, event), None);
            if !actions.is_empty() {
                return actions;
            }
        }
    }

    /// The run store of this node's round (or of its last one).
    fn run_store(&self, run: &Run<'_>) -> Option<Arc<dyn Store>> {
        run.round
            .as_ref()
            .map(|r| r.info.run_store.clone())
            .or_else(|| run.last_run_store.clone())
            .or_else(|| self.handler.run_store())
    }

    /// Writes the verdict; answers with what the store holds afterwards.
    async fn publish(&self, run: &mut Run<'_>, p: &policy::Publish) -> Vec<Action> {
        let event = match self.run_store(run) {
            None => Event::NotPublished("no run store".into()),
            Some(store) => match bounded(run_store::publish(&*store, p)).await {
                Some(Ok(closed)) => Event::Published(closed),
                Some(Err(e)) => Event::NotPublished(e.to_string()),
                None => Event::NotPublished(format!("no answer within {CHECK_TIMEOUT:?}")),
            },
        };
        if let Event::NotPublished(error) = &event {
            self.emit(AgentEvent::CleanupFailed {
                what: "publishing the verdict",
                error: error.clone(),
            });
        }
        self.decide(&mut run.policy, event)
    }

    /// Reads the verdict after the run closed while this node joined.
    async fn read_verdict(&self, run: &mut Run<'_>) -> Vec<Action> {
        let event = match self.run_store(run) {
            // No run store to read (a backend without one before a round).
            None => Event::VerdictRead(None),
            Some(store) => match bounded(run_store::read_verdict(&*store)).await {
                Some(Ok(v)) => Event::VerdictRead(v),
                Some(Err(e)) => Event::NotPublished(e.to_string()),
                None => Event::NotPublished(format!("no answer within {CHECK_TIMEOUT:?}")),
            },
        };
        self.decide(&mut run.policy, event)
    }

    /// Closes the rendezvous so no node starts another round.
    async fn close_rendezvous(&self, run: &mut Run<'_>) -> Vec<Action> {
        let error = match bounded(self.handler.set_closed()).await {
            Some(Ok(())) => None,
            Some(Err(e)) => Some(e.to_string()),
            None => Some(format!("no answer within {CHECK_TIMEOUT:?}")),
        };
        if let Some(error) = error {
            self.emit(AgentEvent::CleanupFailed {
                what: "closing the rendezvous",
                error,
            });
        }
        self.decide(&mut run.policy, Event::RendezvousClosed)
    }

    /// Leaves the rendezvous for good (after it read the verdict): stops
    /// keeping alive and counts this node out of the run, so a host lingering
    /// for it stops waiting.
    async fn mark_finished(&self, run: &mut Run<'_>, _round: u64) -> Vec<Action> {
        if let Some(Err(e)) = bounded(self.handler.leave()).await {
            self.emit(AgentEvent::CleanupFailed {
                what: "leaving the rendezvous",
                error: e.to_string(),
            });
        }
        self.decide(&mut run.policy, Event::MarkedFinished)
    }

    /// Keeps this node's stores up until every other node of the run left or
    /// was found dead ([`RendezvousHandler::remaining`] is 0), or `bound`
    /// passed; a signal cuts it short.
    async fn linger(
        &self,
        run: &mut Run<'_>,
        _round: u64,
        _nodes: usize,
        bound: Option<Duration>,
    ) -> Vec<Action> {
        let Some(store) = self.run_store(run) else {
            return self.decide(&mut run.policy, Event::Lingered(None));
        };
        let until = bound.map(|b| tokio::time::Instant::now() + b);
        let mut said = false;
        let mut unreachable_since: Option<Instant> = None;
        // By then every other node has stopped its workers on its own.
        let give_up = if self.handler.hosts_store() {
            self.limits().linger_after_failure
        } else {
            self.spec.lost_grace
        };
        loop {
            // A store that does not answer now may be stalled: keep it up and
            // look again. A node whose rendezvous store is another's gives up
            // after `lost_grace` (nobody can count itself out of a store that
            // is gone); the host of that store waits until the others, who
            // cannot reach it either, have stopped their workers on their own.
            // The bound, if any, still ends the wait.
            let remaining = bounded(self.handler.remaining()).await.and_then(Result::ok);
            if remaining == Some(0) {
                break;
            }
            if remaining.is_some() {
                unreachable_since = None;
            } else if unreachable_since.get_or_insert_with(Instant::now).elapsed() >= give_up {
                break;
            }
            if let (false, Some(n)) = (said, remaining) {
                said = true;
                self.emit(AgentEvent::HostLingering { nodes_left: n });
            }
            let nap = tokio::time::sleep(LINGER_POLL);
            tokio::select! {
                _ = nap => {}
                s = run.signals.recv() => return self.decide(&mut run.policy, Event::Signal(s)),
                _ = async {
                    match until {
                        Some(b) => tokio::time::sleep_until(b).await,
                        None => std::future::pending().await,
                    }
                } => break,
            }
        }
        let seen = bounded(run_store::read_verdict(&*store))
            .await
            .and_then(Result::ok)
            .flatten();
        self.decide(&mut run.policy, Event::Lingered(seen))
    }

    /// The end: turn the verdict into the outcome, leave the rendezvous (never
    /// closing it: the policy closed it if, and only if, a verdict was
    /// published), and release the round.
    async fn finish(&self, verdict: Verdict, run: &mut Run<'_>) -> Outcome {
        let round = run.round.take();
        let attempts = round.as_ref().map_or(0, |r| r.info.round + 1);
        let store = self.run_store(run);
        let outcome = match verdict {
            Verdict::Succeeded { barrier, .. } => Outcome::Succeeded { attempts, barrier },
            Verdict::Failed {
                why: Failure::StartFailed(e),
                ..
            } => Outcome::Error(e),
            Verdict::Failed { why, root } => {
                let failures = match &store {
                    Some(s) => bounded(run_store::failed_rounds(&**s))
                        .await
                        .and_then(Result::ok)
                        .unwrap_or(0)
                        .max(run.failed_rounds),
                    None => run.failed_rounds,
                };
                Outcome::Failed {
                    reason: self.reason(&why),
                    root_cause: root,
                    failures,
                }
            }
            Verdict::Signaled(signal) => Outcome::Signaled { signal },
            Verdict::NotNeeded => Outcome::NotNeeded,
            Verdict::JoinFailed(e) => match run.join_error.take() {
                Some(e) => Outcome::Rendezvous(e),
                None => Outcome::Error(e),
            },
        };
        if let Some(Err(e)) = bounded(self.handler.leave()).await {
            self.emit(AgentEvent::CleanupFailed {
                what: "leaving the rendezvous",
                error: e.to_string(),
            });
        }
        if let Some(r) = round {
            self.end_round(r).await;
        }
        outcome
    }

    fn reason(&self, why: &Failure) -> String {
        match why {
            Failure::OutOfRestarts { failed_rounds } => format!(
                "workers failed {failed_rounds} time(s); --max-restarts is {}",
                self.spec.max_restarts
            ),
            Failure::AfterClose => {
                "workers failed after the run was closed (no more rounds to restart in)".into()
            }
            Failure::MemberLostAfterClose => {
                "a node died after the run was closed (no more rounds to replace it)".into()
            }
            Failure::FixedGroupFinished => format!(
                "workers failed after another node's workers had finished, and the {} rendezvous cannot restart without them",
                self.handler.backend()
            ),
            Failure::FixedGroupStart(e) => format!(
                "the group could not start ({e}), and the {} rendezvous cannot re-form",
                self.handler.backend()
            ),
            Failure::MemberLostFixedGroup => format!(
                "a node stopped keeping alive, and the {} rendezvous cannot re-form without it",
                self.handler.backend()
            ),
            Failure::Unrecorded => format!(
                "workers failed and the run store did not take the failure for {:?}",
                self.spec.lost_grace
            ),
            Failure::Elsewhere => "another node ended the run after a failure".into(),
            Failure::LostRendezvous { during } => format!(
                "lost the rendezvous host during {during}: its store stopped answering for {:?}",
                self.spec.lost_grace
            ),
            Failure::StartFailed(e) => e.clone(),
            Failure::Unpublished(e) => {
                format!("the run's verdict could not be read or written (outcome unknown): {e}")
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

    /// The failure record of a start that failed on this node.
    fn start_failure(&self, r: &Round, error: &str) -> FailureRecord {
        FailureRecord {
            time: now_secs(),
            host: self.spec.hostname.clone(),
            group_rank: r.info.rank,
            rank: r.ranks.base_rank,
            local_rank: 0,
            round: r.info.round,
            pid: 0,
            exitcode: 1,
            exit: "not started".into(),
            message: error.to_owned(),
            traceback: String::new(),
            error_file: NOT_AVAILABLE.to_owned(),
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
                    state: WorkerState::Running,
                })
                .collect();
        });
        Ok(())
    }

    fn finish_workers(&self, result: &RunResult) {
        self.status.send_modify(|s| {
            for w in &mut s.workers {
                w.state = match result.exits.get(&w.local_rank) {
                    Some(&e) => WorkerState::Ended(e),
                    None => WorkerState::Unknown,
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
    /// The run store of the latest round, to read the verdict after the run
    /// closed while joining.
    last_run_store: Option<Arc<dyn Store>>,
}

/// One bounded look at the run from a node whose round is under way: the
/// verdict if one is published (whatever the backend), else how the membership
/// changed, else healthy; unreachable if the look fails.
async fn observe(
    handler: &dyn RendezvousHandler,
    run_store: &dyn Store,
    round: u64,
) -> Observation {
    let look = async {
        if let Some(closed) = run_store::read_verdict(run_store)
            .await
            .map_err(|e| e.to_string())?
        {
            return Ok(Observation::Closed(closed));
        }
        let m = handler.membership().await.map_err(|e| e.to_string())?;
        if m.waiting == 0 && m.dead == 0 {
            return Ok(Observation::Healthy);
        }
        let finishing = m.waiting > 0
            && run_store::finishing(run_store, round)
                .await
                .map_err(|e| e.to_string())?;
        Ok::<_, String>(Observation::Changed {
            waiting: m.waiting,
            dead: m.dead,
            finishing,
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
