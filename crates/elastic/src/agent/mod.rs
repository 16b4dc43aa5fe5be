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
//! | `starting` | rank assignment and the job store's address, the rendezvous watch, signals |
//! | `running` | worker exits (pidfds), the rendezvous watch ([`watcher`]: woken by the store, no polling), signals |
//! | `stopping` | the stop (signal, grace, SIGKILL, orphans), signals (a second one kills at once) |
//! | `recording_failure` | the run store, signals |
//! | `exit_barrier` | the barrier, the rendezvous watch, signals |
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
//! live after a success. A job store's host also keeps it up while any client
//! is connected to it (other nodes' workers; TCP keep-alive closes those of a
//! host that died or was cut off): it may be out of reach of the rendezvous
//! when the others are not, and run on. A node whose
//! rendezvous checks fail for `lost_grace` while its workers run stops them and
//! fails with "lost the rendezvous host": never "succeeded". A failed exit
//! barrier is classified by what the run store says, not by the error alone.
//!
//! The policy's failure orders are tried by the seeded simulator in `sim.rs`
//! (tests only), which checks the run's invariants after every event.
//!
//! # Layout
//!
//! This file holds the types and the dispatch loop ([`Agent::run`]: take the
//! next action, perform it, feed what happened to the policy). The driver
//! has one file per group of actions it carries out: `joining.rs`,
//! `starting.rs`, `running.rs` (running, stopping, recording a failure),
//! `ending.rs` (the exit barrier, the verdict, the close, the linger, the
//! outcome).
//!
//! The decisions are in [`policy`] (`policy/`), one file per phase
//! (`rendezvous.rs`, `starting.rs`, `running.rs`, `stopping.rs`,
//! `recording.rs`, `exit_barrier.rs`, `ending.rs`), with the table of events
//! that are stale in each phase (`stale.rs`) and the types they share
//! (`phase.rs`, `event.rs`, `action.rs`, `verdict.rs`). So `starting.rs`,
//! `running.rs` and `ending.rs` are both here (carrying out actions) and in
//! `policy/` (deciding them, without I/O), split differently: the driver's
//! `running.rs` also stops workers and records failures, which the policy
//! decides in `stopping.rs` and `recording.rs`, and its `ending.rs` also
//! carries out the exit barrier (`policy/exit_barrier.rs`).
//!
//! [`state`] names what the agent is doing as one [`state::AgentState`],
//! for the policy and the status endpoint ([`status`]) alike; [`run_store`]
//! holds the run store's keys and protocol; [`ranks`] assigns ranks (and
//! each worker's environment); `watcher.rs` watches the rendezvous;
//! [`events`] are what the agent tells its caller.
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

mod ending;
pub mod events;
mod joining;
pub mod policy;
pub mod ranks;
pub mod run_store;
mod running;
#[cfg(test)]
mod sim;
mod starting;
pub mod state;
pub mod status;
mod watcher;

use std::ffi::OsString;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rallypoint_rendezvous::{RendezvousError, RendezvousHandler, RendezvousInfo};
use rallypoint_store::server::{Server, ServerConfig, ServerHandle};
use rallypoint_store::{Store, StoreError};
use tokio::sync::{mpsc, watch, Notify};

use crate::multiprocessing::stacks::WorkerStacks;
use crate::multiprocessing::{
    signal_name, start_processes, Entrypoint, Exit, LogsSpec, ProcessContext, RunLogs, RunResult,
    StartSpec,
};
pub use crate::time::format_time;
use events::{AgentEvent, Discard, EventSink};
use policy::{Action, Event, Failure, Limits, Phase, Policy, Verdict};
pub use run_store::{FailureRecord, NOT_AVAILABLE, TRACEBACK_MAX};
use state::AgentState;
use status::{Status, WorkerState, WorkerStatus};

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
    /// How often backends that cannot wake the agent are polled, and (kept
    /// within 0.1–1 s) how often a store that does not answer is looked at;
    /// otherwise the agent is woken by the store and does not poll.
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
    /// host when it is this machine's loopback (every node is on this host),
    /// else [`rallypoint_store::host::advertised_addr`].
    pub local_addr: Option<String>,
    /// Put this mark in every worker's environment (`RALLY_AGENT_MARK`) and kill
    /// whatever carries it when a group stops, so no descendant of a worker
    /// outlives its round, even one that called `setsid`; see
    /// [`crate::multiprocessing::watchdog`].
    pub mark: Option<String>,
    /// Before stopping workers for any reason but their own exit, read the
    /// Python stacks of those still running, within this budget for all of
    /// them together (`None`: do not); see [`crate::multiprocessing::stacks`].
    pub stack_dump: Option<Duration>,
    /// Where each local rank runs (`--numa-binding`, see [`crate::numa`]); empty:
    /// unbound.
    pub numa: Vec<crate::numa::Binding>,
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
        /// Where this node's workers were when the agent stopped them (the
        /// last stop of the run's last round; empty when none was running).
        stopped: Vec<WorkerStacks>,
    },
    /// A trapped signal stopped this node; `stopped` as in `Failed`.
    Signaled {
        signal: i32,
        stopped: Vec<WorkerStacks>,
    },
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
            Outcome::Signaled { signal, .. } => 128 + signal,
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
    /// What [`Stopper`]s send: taken into the run's [`Signals`].
    stops: (
        mpsc::UnboundedSender<i32>,
        std::sync::Mutex<Option<mpsc::UnboundedReceiver<i32>>>,
    ),
}

/// Stops a running [`Agent`] from inside the process, exactly as if
/// `signal` had been trapped (the policy's stop, in whatever phase the
/// agent is): an embedder's way to end the run, e.g. `rally run --ft` when
/// the quorum service refuses its replica group's id for good. The
/// outcome is [`Outcome::Signaled`]; the embedder says why.
#[derive(Clone, Debug)]
pub struct Stopper(mpsc::UnboundedSender<i32>);

impl Stopper {
    /// Asks the agent to stop as on `signal` (nothing if it has ended).
    pub fn stop(&self, signal: i32) {
        let _ = self.0.send(signal);
    }
}

/// The round in progress.
struct Round {
    info: RendezvousInfo,
    ranks: ranks::NodeRanks,
    /// The job store this node hosts for the round (rank 0 with an agent store).
    /// Kept until the run ends or the round is left: other nodes' workers may
    /// still use it after this node's workers finished.
    server: Option<ServerHandle>,
    /// With a job secret on and an agent store: the loopback proxy through
    /// which this node's workers (PyTorch's client, which cannot prove the
    /// secret) reach the job store, for the round.
    proxy: Option<rallypoint_store::proxy::Proxy>,
    workers: Option<ProcessContext>,
    started: Instant,
    /// Failures of the last stopped group, to record and report.
    failures: Vec<FailureRecord>,
    /// Where the workers were when the agent stopped them.
    stopped: Vec<WorkerStacks>,
    /// The rendezvous watch, from the start to the end of the round.
    watch: Option<watcher::Watch>,
}
impl Agent {
    pub fn new(spec: AgentSpec, handler: Arc<dyn RendezvousHandler>) -> Agent {
        let status = Status::new(handler.run_id(), &spec.role, spec.max_restarts);
        let (tx, rx) = mpsc::unbounded_channel();
        Agent {
            spec,
            handler,
            events: Arc::new(Discard),
            status: watch::channel(status).0,
            stops: (tx, std::sync::Mutex::new(Some(rx))),
        }
    }

    /// A handle that stops this agent's run as a trapped signal would.
    pub fn stopper(&self) -> Stopper {
        Stopper(self.stops.0.clone())
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
        signals.stops = self.stops.1.lock().expect("lock").take();
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
            kept_store: None,
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
                    bound,
                    after_barrier,
                    serves,
                    ..
                } => self.linger(&mut run, bound, after_barrier, serves).await,
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
                lost,
            } => self.emit(AgentEvent::MembershipChanged {
                round,
                nodes_waiting: waiting,
                members_dead: dead,
                lost,
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

    /// Waits in the current phase when the policy had nothing to do.
    async fn resume(&self, run: &mut Run<'_>) -> Vec<Action> {
        match run.policy.phase() {
            Phase::Running { .. } => self.running(run).await,
            other => unreachable!("the policy never idles in {other:?}"),
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
    /// The previous round's job store, kept after a join that formed no
    /// round (the run closed meanwhile, or the join failed): other nodes'
    /// workers may still use it. It goes when the run ends (see `linger`).
    kept_store: Option<ServerHandle>,
    /// Why the last join failed, for the outcome.
    join_error: Option<RendezvousError>,
    failed_rounds: u64,
    /// The run store of the latest round, to read the verdict after the run
    /// closed while joining.
    last_run_store: Option<Arc<dyn Store>>,
}

/// The trapped signals, as one stream (armed for the agent's whole life),
/// and the agent's [`Stopper`]s' requests.
pub struct Signals {
    streams: Vec<(i32, tokio::signal::unix::Signal)>,
    stops: Option<mpsc::UnboundedReceiver<i32>>,
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
        Ok(Signals {
            streams,
            stops: None,
        })
    }

    /// The next trapped signal. Cancel-safe: a signal is never lost.
    pub async fn recv(&mut self) -> i32 {
        std::future::poll_fn(|cx| {
            for (n, s) in &mut self.streams {
                if s.poll_recv(cx).is_ready() {
                    return std::task::Poll::Ready(*n);
                }
            }
            if let Some(std::task::Poll::Ready(Some(n))) =
                self.stops.as_mut().map(|rx| rx.poll_recv(cx))
            {
                return std::task::Poll::Ready(n);
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

#[cfg(test)]
mod stopper_tests {
    use super::*;

    /// A [`Stopper`]'s request arrives as the signal it names, among the
    /// trapped ones; a trapped signal still arrives beside it.
    #[tokio::test]
    async fn a_stop_request_arrives_as_its_signal() {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut signals = Signals::trap(&[libc::SIGUSR2]).unwrap();
        signals.stops = Some(rx);
        let stopper = Stopper(tx);
        let idle = tokio::time::timeout(Duration::from_millis(50), signals.recv()).await;
        assert!(idle.is_err(), "nothing asked yet");
        stopper.stop(libc::SIGTERM);
        assert_eq!(signals.recv().await, libc::SIGTERM);
        // SAFETY: raising a signal this process traps.
        unsafe { libc::raise(libc::SIGUSR2) };
        let got = tokio::time::timeout(Duration::from_secs(10), signals.recv()).await;
        assert_eq!(got.expect("the trapped signal arrives"), libc::SIGUSR2);
    }
}
