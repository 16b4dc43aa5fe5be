//! The agent's decisions, without I/O: `(phase, event, now) -> actions`.
//!
//! The driver in `mod.rs` performs every [`Action`] (a store round trip, a start,
//! a stop), reports what happened as an [`Event`] with the time, and applies what
//! [`Policy::on`] returns. Nothing here blocks, reads a clock or touches a store,
//! so every row of the table below is tested with simulated time, and the seeded
//! simulator (`agent::sim`) drives many agents' policies through random failure
//! orders.
//!
//! | phase | event | actions | next phase |
//! |---|---|---|---|
//! | `Rendezvous` | joined round r | start workers | `Starting` |
//! | `Rendezvous` | join ended: run closed, or spare not needed | read the verdict | `Ending(reading)` |
//! | `Rendezvous` | join failed (timeout, store gone) | finish (a host lingers first) | `Done` or `Ending(linger)` |
//! | `Starting` | started | | `Running` |
//! | `Starting` | start failed on the stores (a member lost) | join | `Rendezvous` |
//! | `Starting` | start failed on the stores, fixed group (`static`) | publish *failed* | `Ending` |
//! | `Starting` | start failed here (cannot spawn) | publish *failed* | `Ending` |
//! | `Starting` | check: members lost or waiting | join (re-form) | `Rendezvous` |
//! | `Starting` | check: a member lost in a fixed group (`static`) | publish *failed* | `Ending` |
//! | `Starting` | check: closed after a failure | publish nothing, close | `Ending` |
//! | `Starting` | check: unreachable for `lost_grace` | finish failed, outcome unknown (a host lingers first) | `Done` or `Ending(linger)` |
//! | `Running` | all workers succeeded | enter the exit barrier | `ExitBarrier` |
//! | `Running` | a worker failed | stop the rest (SIGTERM) | `Stopping(failure)` |
//! | `Running` | check: a member died, or nodes wait and no member finished | stop | `Stopping(re-form)` |
//! | `Running` | check: nodes wait but a member already finished | none (they wait for a next round) | `Running` |
//! | `Running` | check: run closed after a success elsewhere | none: the workers go on, no more rounds | `Running(closed)` |
//! | `Running(closed)` | check: a member died | stop | `Stopping(member lost)` |
//! | `Running` | check: a member died in a fixed group (`static`) | stop | `Stopping(member lost)` |
//! | `Running` | check: run closed after a failure elsewhere | stop (SIGTERM) | `Stopping(failed elsewhere)` |
//! | `Running` | check: unreachable for `lost_grace` | stop (SIGTERM) | `Stopping(lost)` |
//! | `Running` | signal N | stop with N | `Stopping(signal N)` |
//! | `Stopping(failure)` | stopped | record the failure | `RecordingFailure` |
//! | `Stopping(re-form)` | stopped | join | `Rendezvous` |
//! | `Stopping(other)` | stopped | end with that verdict (lost rendezvous: a host lingers first) | `Ending` |
//! | `Stopping(..)` | signal N | end as signalled once stopped; a second signal kills | `Stopping(signal N)` |
//! | `RecordingFailure` | recorded, a member finished, fixed group (`static`) | publish *failed* | `Ending` |
//! | `RecordingFailure` | recorded, budget left, run open | join | `Rendezvous` |
//! | `RecordingFailure` | recorded, budget spent or run closed | publish *failed* | `Ending` |
//! | `RecordingFailure` | not recorded, within `lost_grace` | record again | `RecordingFailure` |
//! | `RecordingFailure` | not recorded for `lost_grace` | finish failed, without closing (a host lingers first) | `Done` or `Ending(linger)` |
//! | `ExitBarrier` | passed | publish *succeeded* | `Ending` |
//! | `ExitBarrier` | failed: timed out, the run not failed | publish *succeeded* (noting the barrier) | `Ending` |
//! | `ExitBarrier` | failed: the run failed elsewhere | close | `Ending` |
//! | `ExitBarrier` | failed: store unreachable | finish failed, outcome unknown (a host lingers first) | `Done` or `Ending(linger)` |
//! | `ExitBarrier` | check: closed after a failure | close | `Ending` |
//! | `ExitBarrier` | check: unreachable for `lost_grace` | finish failed, outcome unknown (a host lingers first) | `Done` or `Ending(linger)` |
//! | `Ending(publish)` | published: the store holds *failed* | close (the verdict is the store's) | `Ending(close)` |
//! | `Ending(publish)` | published: *succeeded* | close | `Ending(close)` |
//! | `Ending(publish)` | not published | finish failed, without closing (a host lingers first) | `Done` or `Ending(linger)` |
//! | `Ending(read)` | verdict read | finish: failed if the run failed, else not needed | `Done` |
//! | `Ending(close)` | closed | leave the rendezvous (counted out of the run) | `Ending(mark)` |
//! | `Ending(mark)` | marked | linger if this node hosts a store others use | `Ending(linger)` or `Done` |
//! | `Ending(linger)` | every other node of the run left or dead (or the bound) | finish (failed if a failure was published meanwhile) | `Done` |
//! | `Ending(..)` | signal N | finish with the verdict decided | `Done` |
//!
//! Rules the table keeps:
//!
//! - A run is closed only once its verdict is in the run store (*failed* or
//!   *succeeded*, one key), so no node reads a close as a success that was not
//!   one; a verdict that cannot be published is never followed by a close.
//! - A closed run is never a reason by itself to stop healthy workers: only a
//!   published failure is (torchrun stops the workers of a node whose exit
//!   barrier ran out while another node closed the run after success).
//! - A worker failure after the run closed cannot be retried (no more rounds):
//!   it fails the job, and the failure is published.
//! - Every store that another node's workers may use outlives them: the job store
//!   and the rendezvous store stay up until every node of the round counted itself
//!   finished, left, or was found dead.
//! - A worker that exits while the group re-forms is part of the stop; the round
//!   is restarted whatever it returned.

use std::time::{Duration, Instant};

pub use super::run_store::Publish;
use super::run_store::{Closed, FailureRecord};
use super::state::AgentState;

/// Why the workers are being stopped.
#[derive(Debug, Clone, PartialEq)]
pub enum StopReason {
    /// A local worker failed; the rest go down with it (all or nothing).
    WorkerFailed,
    /// Nodes are waiting or a member died: the group re-forms.
    Reform,
    /// Another node published the run's failure.
    FailedElsewhere(Option<Box<FailureRecord>>),
    /// A member died after the run was closed: no round can replace it.
    MemberLostAfterClose,
    /// A member died and the group cannot re-form (`static`).
    MemberLostFixedGroup,
    /// The rendezvous store has been unreachable for the grace period.
    LostRendezvous,
    /// A trapped signal (forwarded to the workers).
    Signal(i32),
}

/// The phase in which the rendezvous store was lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum During {
    Starting,
    Running,
    ExitBarrier,
}

impl std::fmt::Display for During {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            During::Starting => "the start",
            During::Running => "running",
            During::ExitBarrier => "the exit barrier",
        })
    }
}

/// The round this node is (or was last) a member of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Membership {
    pub round: u64,
    /// Nodes in the round.
    pub nodes: usize,
    /// This node serves a store the round's other nodes use (the job store, or
    /// the rendezvous store).
    pub hosts: bool,
}

/// Where the agent is.
#[derive(Debug, Clone, PartialEq)]
pub enum Phase {
    /// Joining the next round.
    Rendezvous,
    /// Ranks, the job store, spawning; the rendezvous is watched meanwhile.
    Starting {
        round: u64,
        /// Since when the rendezvous cannot be read.
        unreachable_since: Option<Instant>,
    },
    /// Workers running. `closed` once another node closed the run after success
    /// (no more rounds); `unreachable_since` while the rendezvous cannot be read.
    Running {
        round: u64,
        closed: bool,
        unreachable_since: Option<Instant>,
    },
    Stopping {
        round: u64,
        why: StopReason,
        closed: bool,
    },
    /// Recording the failure in the run store and counting the round; retried
    /// until `lost_grace` after `since`.
    RecordingFailure {
        round: u64,
        closed: bool,
        since: Instant,
    },
    /// Local workers succeeded; waiting for every node.
    ExitBarrier {
        round: u64,
        /// Since when the rendezvous cannot be read.
        unreachable_since: Option<Instant>,
    },
    /// The verdict is decided; publishing it, closing the run, lingering.
    Ending {
        verdict: Verdict,
        step: EndStep,
    },
    Done(Verdict),
}

/// The steps of the end of a run, in order (each may be skipped).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndStep {
    /// Writing the verdict to the run store.
    Publish,
    /// Reading the verdict (the run closed while this node joined).
    ReadVerdict,
    /// Closing the rendezvous (no more rounds).
    Close,
    /// Leaving the rendezvous: counted out of the run.
    MarkFinished,
    /// Keeping hosted stores up for the other nodes.
    Linger,
}

impl Phase {
    /// A short name, for status and events.
    pub fn name(&self) -> &'static str {
        self.state().name()
    }

    /// What the status endpoint shows.
    pub fn state(&self) -> AgentState {
        match self {
            Phase::Rendezvous => AgentState::Rendezvous,
            Phase::Starting { .. } => AgentState::Starting,
            Phase::Running { .. } => AgentState::Running,
            Phase::Stopping { .. } => AgentState::Stopping,
            Phase::RecordingFailure { .. } => AgentState::RecordingFailure,
            Phase::ExitBarrier { .. } => AgentState::ExitBarrier,
            Phase::Ending { .. } => AgentState::Ending,
            Phase::Done(v) => v.state(),
        }
    }
}

/// Why the job failed, as this node knows it.
#[derive(Debug, Clone, PartialEq)]
pub enum Failure {
    /// Workers failed beyond the restart budget (job-wide count).
    OutOfRestarts { failed_rounds: u64 },
    /// Workers failed after the run was closed: no more rounds to retry in.
    AfterClose,
    /// A member died after the run was closed.
    MemberLostAfterClose,
    /// A member died and the group cannot re-form without it (`static`).
    MemberLostFixedGroup,
    /// Workers failed after another member's had finished, in a group that
    /// cannot re-form without it (`static`).
    FixedGroupFinished,
    /// A fixed group's round could not start (a member did not come).
    FixedGroupStart(String),
    /// Workers failed and the failure could not be recorded (store gone).
    Unrecorded,
    /// Another node published the failure.
    Elsewhere,
    /// The rendezvous store went away.
    LostRendezvous { during: During },
    /// Workers could not be started here.
    StartFailed(String),
    /// The verdict could not be published (store gone).
    Unpublished(String),
}

/// How the run ended for this node.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    Succeeded {
        round: u64,
        /// Set when the exit barrier did not complete (with why).
        barrier: Option<String>,
    },
    Failed {
        why: Failure,
        /// The root cause, from the published verdict (or this node's own).
        root: Option<Box<FailureRecord>>,
    },
    Signaled(i32),
    /// A spare, or a node whose join ended when the run closed after success.
    NotNeeded,
    /// The join failed (timeout, unreachable, ...).
    JoinFailed(String),
}

impl Verdict {
    pub fn name(&self) -> &'static str {
        self.state().name()
    }

    pub fn state(&self) -> AgentState {
        match self {
            Verdict::Succeeded { .. } => AgentState::Succeeded,
            Verdict::NotNeeded => AgentState::NotNeeded,
            Verdict::Signaled(_) => AgentState::Signaled,
            Verdict::Failed { .. } | Verdict::JoinFailed(_) => AgentState::Failed,
        }
    }

    fn failed(why: Failure) -> Verdict {
        Verdict::Failed { why, root: None }
    }
}

/// What the rendezvous looks like from a node whose round is under way.
#[derive(Debug, Clone, PartialEq)]
pub enum Observation {
    Healthy,
    /// The membership changed: `waiting` nodes want to join, `dead` members
    /// stopped keeping alive; `finishing` when a member of the round already
    /// finished (is in the exit barrier or gone after success).
    Changed {
        waiting: usize,
        dead: usize,
        finishing: bool,
        /// The dead members' node ids, where the backend knows them.
        lost: Vec<String>,
    },
    /// The run's verdict is published.
    Closed(Closed),
    /// A check failed or did not answer in time.
    Unreachable(String),
}

/// Why starting failed.
#[derive(Debug, Clone, PartialEq)]
pub enum StartError {
    /// A store step (ranks, the job store's address) failed: a member or the
    /// store went away; the group re-forms.
    Store(String),
    /// This node cannot start its workers (no such program, log directory).
    Local(String),
}

/// What the driver observed.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Joined {
        round: u64,
        nodes: usize,
    },
    /// The join ended because the run closed (`spare`: it never was needed).
    JoinClosed,
    JoinFailed(String),
    /// Workers started; `hosts_job_store` when this node serves the round's store.
    Started {
        hosts_job_store: bool,
    },
    StartFailed(StartError),
    WorkersSucceeded,
    WorkerFailed,
    Checked(Observation),
    Stopped {
        /// The first failure of the stopped group, if a worker failed.
        failure: Option<Box<FailureRecord>>,
    },
    FailureRecorded {
        failed_rounds: u64,
        /// A member of the round had already finished (entered the exit
        /// barrier): it will not join a next round.
        finishing: bool,
    },
    FailureNotRecorded(String),
    BarrierPassed,
    /// The barrier ended in error; `seen` is the rendezvous looked at right after.
    BarrierFailed {
        error: String,
        timed_out: bool,
        seen: Observation,
    },
    /// The verdict the run store holds after this node's write.
    Published(Closed),
    NotPublished(String),
    /// The verdict read after the run closed (`None`: none published).
    VerdictRead(Option<Closed>),
    // (A verdict that cannot be read or written answers `NotPublished`.)
    RendezvousClosed,
    MarkedFinished,
    /// Lingering ended; the verdict read at its end (a failure published while
    /// this node lingered after a success fails it too).
    Lingered(Option<Closed>),
    Signal(i32),
}

/// What the driver must do.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    Join,
    Start {
        round: u64,
    },
    /// Signal every worker group, SIGKILL after the grace; answer [`Event::Stopped`].
    Stop {
        signal: i32,
    },
    /// SIGKILL whatever still runs now (a second signal while stopping).
    Kill,
    RecordFailure {
        round: u64,
    },
    EnterBarrier {
        round: u64,
    },
    Publish(Publish),
    ReadVerdict,
    CloseRendezvous,
    MarkFinished {
        round: u64,
    },
    /// Keep this node's stores up until every other node of the run left or
    /// died, or `bound` passed (`round` and `nodes`: its last round, for
    /// reports). `after_barrier`: the exit barrier passed, so no worker
    /// needs the stores any more; a node whose rendezvous host has ended
    /// (the host leaves last) then stops at once instead of waiting out
    /// `lost_grace` for a store that will not come back. `serves`: this
    /// node serves a store the round's other nodes use (its job store, or
    /// the rendezvous store), so it gives up on an unreachable rendezvous
    /// only once the others must have stopped their workers.
    Linger {
        round: u64,
        nodes: usize,
        bound: Option<Duration>,
        after_barrier: bool,
        serves: bool,
    },
    /// Another node closed the run after success: no more rounds.
    NoteClosedAfterSuccess {
        round: u64,
    },
    /// The rendezvous stopped answering; say so once.
    NoteUnreachable {
        error: String,
    },
    /// Re-forming for nodes waiting or lost.
    NoteReform {
        round: u64,
        waiting: usize,
        dead: usize,
        /// The dead members' node ids, where known.
        lost: Vec<String>,
    },
    /// A failure within the budget: the group restarts.
    NoteRestart {
        failed_rounds: u64,
    },
    /// Recording the failure failed; trying again.
    NoteRecordRetry {
        error: String,
    },
    Finish(Verdict),
}

/// The agent's policy knobs.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_restarts: u32,
    /// How long the rendezvous may stay unreachable while workers run, and how
    /// long recording a failure is retried.
    pub lost_grace: Duration,
    /// This node serves the rendezvous store (every round's nodes use it).
    pub hosts_rendezvous: bool,
    /// How long a host lingers for the others after a failure (their stop).
    pub linger_after_failure: Duration,
    /// How long after a success; `None` where the rendezvous notices dead
    /// members, so the host waits exactly as long as some node still runs.
    pub linger_after_success: Option<Duration>,
    /// The group can re-form with other members; `false` for a fixed group
    /// (`static`), where a dead member fails the job.
    pub reforms: bool,
}

/// The policy of one agent.
#[derive(Debug, Clone)]
pub struct Policy {
    limits: Limits,
    phase: Phase,
    /// The round this node last joined.
    member: Option<Membership>,
    /// The first failure of this node's last failed round.
    local_failure: Option<Box<FailureRecord>>,
}

impl Policy {
    /// A policy that starts by joining; returns it and the first action.
    pub fn start(limits: Limits) -> (Policy, Action) {
        (
            Policy {
                limits,
                phase: Phase::Rendezvous,
                member: None,
                local_failure: None,
            },
            Action::Join,
        )
    }

    pub fn phase(&self) -> &Phase {
        &self.phase
    }

    /// The round this node last joined.
    pub fn member(&self) -> Option<Membership> {
        self.member
    }

    /// The actions after `event`, observed at `now`.
    pub fn on(&mut self, event: Event, now: Instant) -> Vec<Action> {
        let phase = std::mem::replace(&mut self.phase, Phase::Rendezvous);
        let (next, actions) = self.transition(phase, event, now);
        self.phase = next;
        actions
    }

    fn transition(&mut self, phase: Phase, event: Event, now: Instant) -> (Phase, Vec<Action>) {
        use Action as A;
        use Event as E;
        match (phase, event) {
            // ---- Rendezvous
            (Phase::Rendezvous, E::Joined { round, nodes }) => {
                self.member = Some(Membership {
                    round,
                    nodes,
                    hosts: self.limits.hosts_rendezvous,
                });
                (
                    Phase::Starting {
                        round,
                        unreachable_since: None,
                    },
                    vec![A::Start { round }],
                )
            }
            (Phase::Rendezvous, E::JoinClosed) => (
                Phase::Ending {
                    verdict: Verdict::NotNeeded,
                    step: EndStep::ReadVerdict,
                },
                vec![A::ReadVerdict],
            ),
            // A host whose own store stalls keeps it up for the others.
            (Phase::Rendezvous, E::JoinFailed(e)) => {
                self.end_lingering_unpublished(Verdict::JoinFailed(e))
            }
            (Phase::Rendezvous, E::Signal(s)) => finish(Verdict::Signaled(s)),
            (
                p @ Phase::Rendezvous,
                e @ (E::Started { .. }
                | E::StartFailed(_)
                | E::WorkersSucceeded
                | E::WorkerFailed
                | E::Checked(_)
                | E::Stopped { .. }
                | E::FailureRecorded { .. }
                | E::FailureNotRecorded(_)
                | E::BarrierPassed
                | E::BarrierFailed { .. }
                | E::Published(_)
                | E::NotPublished(_)
                | E::VerdictRead(_)
                | E::RendezvousClosed
                | E::MarkedFinished
                | E::Lingered(_)),
            ) => stale(p, e),

            // ---- Starting
            (Phase::Starting { round, .. }, E::Started { hosts_job_store }) => {
                if let Some(m) = &mut self.member {
                    m.hosts |= hosts_job_store;
                }
                (
                    Phase::Running {
                        round,
                        closed: false,
                        unreachable_since: None,
                    },
                    vec![],
                )
            }
            (Phase::Starting { .. }, E::StartFailed(StartError::Store(e)))
                if !self.limits.reforms =>
            {
                self.end_publishing_failure(Failure::FixedGroupStart(e))
            }
            (Phase::Starting { round, .. }, E::StartFailed(StartError::Store(e))) => (
                Phase::Rendezvous,
                vec![
                    A::NoteReform {
                        round,
                        waiting: 0,
                        dead: 0,
                        lost: Vec::new(),
                    },
                    A::NoteUnreachable { error: e },
                    A::Join,
                ],
            ),
            (Phase::Starting { .. }, E::StartFailed(StartError::Local(e))) => {
                self.end_publishing_failure(Failure::StartFailed(e))
            }
            (
                Phase::Starting {
                    round,
                    unreachable_since,
                },
                E::Checked(obs),
            ) => match obs {
                Observation::Changed { dead, .. } if dead > 0 && !self.limits.reforms => {
                    self.end_publishing_failure(Failure::MemberLostFixedGroup)
                }
                Observation::Changed {
                    waiting,
                    dead,
                    lost,
                    ..
                } if dead > 0 || waiting > 0 => (
                    Phase::Rendezvous,
                    vec![
                        A::NoteReform {
                            round,
                            waiting,
                            dead,
                            lost,
                        },
                        A::Join,
                    ],
                ),
                Observation::Closed(Closed::Failed(root)) => self.end_closing(Verdict::Failed {
                    why: Failure::Elsewhere,
                    root,
                }),
                // The start's own store calls wait up to the store's timeout:
                // a store gone for `lost_grace` ends it sooner.
                Observation::Unreachable(error) => match unreachable_since {
                    None => (
                        Phase::Starting {
                            round,
                            unreachable_since: Some(now),
                        },
                        vec![A::NoteUnreachable { error }],
                    ),
                    Some(since)
                        if now.saturating_duration_since(since) >= self.limits.lost_grace =>
                    {
                        self.end_lingering_unpublished(Verdict::Failed {
                            why: Failure::LostRendezvous {
                                during: During::Starting,
                            },
                            root: None,
                        })
                    }
                    Some(since) => (
                        Phase::Starting {
                            round,
                            unreachable_since: Some(since),
                        },
                        vec![],
                    ),
                },
                // A success closed elsewhere does not stop a start (the workers
                // will run to their end, as on a running node).
                Observation::Healthy
                | Observation::Changed { .. }
                | Observation::Closed(Closed::Succeeded) => (
                    Phase::Starting {
                        round,
                        unreachable_since: None,
                    },
                    vec![],
                ),
            },
            (Phase::Starting { .. }, E::Signal(s)) => finish(Verdict::Signaled(s)),
            (
                p @ Phase::Starting { .. },
                e @ (E::Joined { .. }
                | E::JoinClosed
                | E::JoinFailed(_)
                | E::WorkersSucceeded
                | E::WorkerFailed
                | E::Stopped { .. }
                | E::FailureRecorded { .. }
                | E::FailureNotRecorded(_)
                | E::BarrierPassed
                | E::BarrierFailed { .. }
                | E::Published(_)
                | E::NotPublished(_)
                | E::VerdictRead(_)
                | E::RendezvousClosed
                | E::MarkedFinished
                | E::Lingered(_)),
            ) => stale(p, e),

            // ---- Running
            (Phase::Running { round, closed, .. }, E::WorkersSucceeded) => {
                let _ = closed;
                (
                    Phase::ExitBarrier {
                        round,
                        unreachable_since: None,
                    },
                    vec![A::EnterBarrier { round }],
                )
            }
            (Phase::Running { round, closed, .. }, E::WorkerFailed) => {
                stop(round, StopReason::WorkerFailed, closed)
            }
            (
                Phase::Running {
                    round,
                    closed,
                    unreachable_since,
                },
                E::Checked(obs),
            ) => self.running_checked(round, closed, unreachable_since, obs, now),
            (Phase::Running { round, closed, .. }, E::Signal(s)) => (
                Phase::Stopping {
                    round,
                    why: StopReason::Signal(s),
                    closed,
                },
                vec![A::Stop { signal: s }],
            ),
            (
                p @ Phase::Running { .. },
                e @ (E::Joined { .. }
                | E::JoinClosed
                | E::JoinFailed(_)
                | E::Started { .. }
                | E::StartFailed(_)
                | E::Stopped { .. }
                | E::FailureRecorded { .. }
                | E::FailureNotRecorded(_)
                | E::BarrierPassed
                | E::BarrierFailed { .. }
                | E::Published(_)
                | E::NotPublished(_)
                | E::VerdictRead(_)
                | E::RendezvousClosed
                | E::MarkedFinished
                | E::Lingered(_)),
            ) => stale(p, e),

            // ---- Stopping
            (Phase::Stopping { round, why, closed }, E::Stopped { failure }) => {
                if failure.is_some() {
                    self.local_failure = failure;
                }
                match why {
                    StopReason::WorkerFailed => (
                        Phase::RecordingFailure {
                            round,
                            closed,
                            since: now,
                        },
                        vec![A::RecordFailure { round }],
                    ),
                    StopReason::Reform => (Phase::Rendezvous, vec![A::Join]),
                    StopReason::FailedElsewhere(root) => self.end_closing(Verdict::Failed {
                        why: Failure::Elsewhere,
                        root,
                    }),
                    StopReason::MemberLostAfterClose => {
                        self.end_publishing_failure(Failure::MemberLostAfterClose)
                    }
                    StopReason::MemberLostFixedGroup => {
                        self.end_publishing_failure(Failure::MemberLostFixedGroup)
                    }
                    StopReason::LostRendezvous => self.end_lingering_unpublished(Verdict::Failed {
                        why: Failure::LostRendezvous {
                            during: During::Running,
                        },
                        root: self.local_failure.clone(),
                    }),
                    StopReason::Signal(s) => finish(Verdict::Signaled(s)),
                }
            }
            // Already stopping: end as signalled; a second signal kills.
            (
                Phase::Stopping {
                    round, why, closed, ..
                },
                E::Signal(s),
            ) => {
                let again = matches!(why, StopReason::Signal(_));
                (
                    Phase::Stopping {
                        round,
                        why: StopReason::Signal(s),
                        closed,
                    },
                    if again { vec![A::Kill] } else { vec![] },
                )
            }
            // Workers exiting while being stopped are part of the stop.
            (
                p @ Phase::Stopping { .. },
                e @ (E::Joined { .. }
                | E::JoinClosed
                | E::JoinFailed(_)
                | E::Started { .. }
                | E::StartFailed(_)
                | E::WorkersSucceeded
                | E::WorkerFailed
                | E::Checked(_)
                | E::FailureRecorded { .. }
                | E::FailureNotRecorded(_)
                | E::BarrierPassed
                | E::BarrierFailed { .. }
                | E::Published(_)
                | E::NotPublished(_)
                | E::VerdictRead(_)
                | E::RendezvousClosed
                | E::MarkedFinished
                | E::Lingered(_)),
            ) => stale(p, e),

            // ---- RecordingFailure
            (
                Phase::RecordingFailure { closed, .. },
                E::FailureRecorded {
                    failed_rounds,
                    finishing,
                },
            ) => {
                if closed {
                    self.end_publishing_failure(Failure::AfterClose)
                } else if finishing && !self.limits.reforms {
                    self.end_publishing_failure(Failure::FixedGroupFinished)
                } else if failed_rounds <= u64::from(self.limits.max_restarts) {
                    (
                        Phase::Rendezvous,
                        vec![A::NoteRestart { failed_rounds }, A::Join],
                    )
                } else {
                    self.end_publishing_failure(Failure::OutOfRestarts { failed_rounds })
                }
            }
            (
                Phase::RecordingFailure {
                    round,
                    closed,
                    since,
                },
                E::FailureNotRecorded(error),
            ) => {
                if now.saturating_duration_since(since) < self.limits.lost_grace {
                    (
                        Phase::RecordingFailure {
                            round,
                            closed,
                            since,
                        },
                        vec![A::NoteRecordRetry { error }, A::RecordFailure { round }],
                    )
                } else {
                    // Never closed without a verdict: the others notice this node
                    // gone (heartbeats) or fail on their own.
                    self.end_lingering_unpublished(Verdict::Failed {
                        why: Failure::Unrecorded,
                        root: self.local_failure.clone(),
                    })
                }
            }
            (Phase::RecordingFailure { .. }, E::Signal(s)) => finish(Verdict::Signaled(s)),
            (
                p @ Phase::RecordingFailure { .. },
                e @ (E::Joined { .. }
                | E::JoinClosed
                | E::JoinFailed(_)
                | E::Started { .. }
                | E::StartFailed(_)
                | E::WorkersSucceeded
                | E::WorkerFailed
                | E::Checked(_)
                | E::Stopped { .. }
                | E::BarrierPassed
                | E::BarrierFailed { .. }
                | E::Published(_)
                | E::NotPublished(_)
                | E::VerdictRead(_)
                | E::RendezvousClosed
                | E::MarkedFinished
                | E::Lingered(_)),
            ) => stale(p, e),

            // ---- ExitBarrier
            (Phase::ExitBarrier { round, .. }, E::BarrierPassed) => self.end_publishing(
                Verdict::Succeeded {
                    round,
                    barrier: None,
                },
                Publish::Succeeded,
            ),
            (
                Phase::ExitBarrier { round, .. },
                E::BarrierFailed {
                    error,
                    timed_out,
                    seen,
                },
            ) => match seen {
                Observation::Closed(Closed::Failed(root)) => self.end_closing(Verdict::Failed {
                    why: Failure::Elsewhere,
                    root,
                }),
                Observation::Unreachable(why) => {
                    let _ = why;
                    self.end_lingering_unpublished(Verdict::Failed {
                        why: Failure::LostRendezvous {
                            during: During::ExitBarrier,
                        },
                        root: None,
                    })
                }
                Observation::Healthy
                | Observation::Changed { .. }
                | Observation::Closed(Closed::Succeeded) => {
                    if timed_out {
                        // torchrun's exit barrier: this node's workers succeeded;
                        // the publish re-reads the verdict, so a failure published
                        // meanwhile still wins.
                        self.end_publishing(
                            Verdict::Succeeded {
                                round,
                                barrier: Some(error),
                            },
                            Publish::Succeeded,
                        )
                    } else {
                        self.end_lingering_unpublished(Verdict::Failed {
                            why: Failure::LostRendezvous {
                                during: During::ExitBarrier,
                            },
                            root: None,
                        })
                    }
                }
            },
            (Phase::ExitBarrier { .. }, E::Checked(Observation::Closed(Closed::Failed(root)))) => {
                self.end_closing(Verdict::Failed {
                    why: Failure::Elsewhere,
                    root,
                })
            }
            // A store gone for `lost_grace` ends the wait (the barrier's own
            // timeout may be far longer): the outcome is unknown.
            (
                Phase::ExitBarrier {
                    round,
                    unreachable_since,
                },
                E::Checked(Observation::Unreachable(error)),
            ) => match unreachable_since {
                None => (
                    Phase::ExitBarrier {
                        round,
                        unreachable_since: Some(now),
                    },
                    vec![A::NoteUnreachable { error }],
                ),
                Some(since) if now.saturating_duration_since(since) >= self.limits.lost_grace => {
                    self.end_lingering_unpublished(Verdict::Failed {
                        why: Failure::LostRendezvous {
                            during: During::ExitBarrier,
                        },
                        root: None,
                    })
                }
                Some(since) => (
                    Phase::ExitBarrier {
                        round,
                        unreachable_since: Some(since),
                    },
                    vec![],
                ),
            },
            // Membership changes after this node finished do not concern it.
            (
                Phase::ExitBarrier { round, .. },
                E::Checked(
                    Observation::Healthy
                    | Observation::Changed { .. }
                    | Observation::Closed(Closed::Succeeded),
                ),
            ) => (
                Phase::ExitBarrier {
                    round,
                    unreachable_since: None,
                },
                vec![],
            ),
            (Phase::ExitBarrier { .. }, E::Signal(s)) => finish(Verdict::Signaled(s)),
            (
                p @ Phase::ExitBarrier { .. },
                e @ (E::Joined { .. }
                | E::JoinClosed
                | E::JoinFailed(_)
                | E::Started { .. }
                | E::StartFailed(_)
                | E::WorkersSucceeded
                | E::WorkerFailed
                | E::Stopped { .. }
                | E::FailureRecorded { .. }
                | E::FailureNotRecorded(_)
                | E::Published(_)
                | E::NotPublished(_)
                | E::VerdictRead(_)
                | E::RendezvousClosed
                | E::MarkedFinished
                | E::Lingered(_)),
            ) => stale(p, e),

            // ---- Ending
            (
                Phase::Ending {
                    verdict,
                    step: EndStep::Publish,
                },
                E::Published(closed),
            ) => {
                let verdict = match (verdict, closed) {
                    // Someone published a failure first: the run failed.
                    (Verdict::Succeeded { .. }, Closed::Failed(root)) => Verdict::Failed {
                        why: Failure::Elsewhere,
                        root,
                    },
                    // The store's root cause is the run's, even none (a node
                    // lost): every node reports the same one.
                    (Verdict::Failed { why, .. }, Closed::Failed(published)) => Verdict::Failed {
                        why,
                        root: published,
                    },
                    (v, _) => v,
                };
                self.end_closing(verdict)
            }
            (
                Phase::Ending {
                    verdict,
                    step: EndStep::Publish | EndStep::ReadVerdict,
                },
                E::NotPublished(e),
            ) => self.end_lingering_unpublished(match verdict {
                Verdict::Failed { why, root } => Verdict::Failed {
                    why,
                    root: root.or_else(|| self.local_failure.clone()),
                },
                // A success that cannot be published is not known to be one.
                _ => Verdict::failed(Failure::Unpublished(e)),
            }),
            (
                Phase::Ending {
                    verdict,
                    step: EndStep::ReadVerdict,
                },
                E::VerdictRead(read),
            ) => match read {
                Some(Closed::Failed(root)) => self.end_after_close(Verdict::Failed {
                    why: Failure::Elsewhere,
                    root,
                }),
                // Nothing failed: a node not needed (exits 0).
                Some(Closed::Succeeded) | None => self.end_after_close(verdict),
            },
            (
                Phase::Ending {
                    verdict,
                    step: EndStep::Close,
                },
                E::RendezvousClosed,
            ) => self.end_after_close(verdict),
            (
                Phase::Ending {
                    verdict,
                    step: EndStep::MarkFinished,
                },
                E::MarkedFinished,
            ) => self.end_lingering(verdict),
            (
                Phase::Ending {
                    verdict,
                    step: EndStep::Linger,
                },
                E::Lingered(seen),
            ) => finish(match (verdict, seen) {
                (Verdict::Succeeded { .. } | Verdict::NotNeeded, Some(Closed::Failed(root))) => {
                    Verdict::Failed {
                        why: Failure::Elsewhere,
                        root,
                    }
                }
                // The run's root cause, as every node reports it.
                (Verdict::Failed { why, .. }, Some(Closed::Failed(root))) => {
                    Verdict::Failed { why, root }
                }
                (v, _) => v,
            }),
            (Phase::Ending { verdict, .. }, E::Signal(_)) => finish(verdict),
            // An answer to another step of the end: stale.
            (
                p @ Phase::Ending { .. },
                e @ (E::Published(_)
                | E::NotPublished(_)
                | E::VerdictRead(_)
                | E::RendezvousClosed
                | E::MarkedFinished
                | E::Lingered(_)),
            ) => stale(p, e),
            (
                p @ Phase::Ending { .. },
                e @ (E::Joined { .. }
                | E::JoinClosed
                | E::JoinFailed(_)
                | E::Started { .. }
                | E::StartFailed(_)
                | E::WorkersSucceeded
                | E::WorkerFailed
                | E::Checked(_)
                | E::Stopped { .. }
                | E::FailureRecorded { .. }
                | E::FailureNotRecorded(_)
                | E::BarrierPassed
                | E::BarrierFailed { .. }),
            ) => stale(p, e),

            (
                p @ Phase::Done(_),
                e @ (E::Joined { .. }
                | E::JoinClosed
                | E::JoinFailed(_)
                | E::Started { .. }
                | E::StartFailed(_)
                | E::WorkersSucceeded
                | E::WorkerFailed
                | E::Checked(_)
                | E::Stopped { .. }
                | E::FailureRecorded { .. }
                | E::FailureNotRecorded(_)
                | E::BarrierPassed
                | E::BarrierFailed { .. }
                | E::Published(_)
                | E::NotPublished(_)
                | E::VerdictRead(_)
                | E::RendezvousClosed
                | E::MarkedFinished
                | E::Lingered(_)
                | E::Signal(_)),
            ) => stale(p, e),
        }
    }

    fn running_checked(
        &self,
        round: u64,
        closed: bool,
        unreachable_since: Option<Instant>,
        obs: Observation,
        now: Instant,
    ) -> (Phase, Vec<Action>) {
        let running = |closed, unreachable_since| Phase::Running {
            round,
            closed,
            unreachable_since,
        };
        match obs {
            Observation::Healthy => (running(closed, None), vec![]),
            // No more rounds once the run is closed: a dead member cannot be
            // replaced, and the job cannot complete.
            Observation::Changed { dead, .. } if closed && dead > 0 => {
                stop(round, StopReason::MemberLostAfterClose, closed)
            }
            // A fixed group (`static`) cannot replace a dead member: the job
            // fails now, not when a collective times out.
            Observation::Changed { dead, .. } if dead > 0 && !self.limits.reforms => {
                stop(round, StopReason::MemberLostFixedGroup, closed)
            }
            Observation::Changed {
                waiting,
                dead,
                finishing,
                lost,
            } if dead > 0 || (waiting > 0 && !finishing && !closed) => {
                let (p, mut a) = stop(round, StopReason::Reform, closed);
                a.insert(
                    0,
                    Action::NoteReform {
                        round,
                        waiting,
                        dead,
                        lost,
                    },
                );
                (p, a)
            }
            // Nodes waiting while a member already finished (or the run is
            // closed): the round is ending; they wait for a next round.
            Observation::Changed { .. } => (running(closed, None), vec![]),
            Observation::Closed(Closed::Succeeded) if closed => (running(true, None), vec![]),
            Observation::Closed(Closed::Succeeded) => (
                running(true, None),
                vec![Action::NoteClosedAfterSuccess { round }],
            ),
            Observation::Closed(Closed::Failed(r)) => {
                stop(round, StopReason::FailedElsewhere(r), closed)
            }
            Observation::Unreachable(error) => match unreachable_since {
                None => (
                    running(closed, Some(now)),
                    vec![Action::NoteUnreachable { error }],
                ),
                Some(since) if now.saturating_duration_since(since) >= self.limits.lost_grace => {
                    stop(round, StopReason::LostRendezvous, closed)
                }
                Some(since) => (running(closed, Some(since)), vec![]),
            },
        }
    }

    /// Ends with a failure this node publishes.
    fn end_publishing_failure(&self, why: Failure) -> (Phase, Vec<Action>) {
        let local = self.local_failure.clone();
        self.end_publishing(
            Verdict::Failed {
                why,
                root: local.clone(),
            },
            Publish::Failed { local },
        )
    }

    fn end_publishing(&self, verdict: Verdict, publish: Publish) -> (Phase, Vec<Action>) {
        (
            Phase::Ending {
                verdict,
                step: EndStep::Publish,
            },
            vec![Action::Publish(publish)],
        )
    }

    /// The verdict is in the store: close the rendezvous.
    fn end_closing(&self, verdict: Verdict) -> (Phase, Vec<Action>) {
        (
            Phase::Ending {
                verdict,
                step: EndStep::Close,
            },
            vec![Action::CloseRendezvous],
        )
    }

    /// Closed: leave the rendezvous (counted out of the run), if this node
    /// was ever a member.
    fn end_after_close(&self, verdict: Verdict) -> (Phase, Vec<Action>) {
        match self.member {
            Some(m) => (
                Phase::Ending {
                    verdict,
                    step: EndStep::MarkFinished,
                },
                vec![Action::MarkFinished { round: m.round }],
            ),
            None => self.end_lingering(verdict),
        }
    }

    /// Left: linger if others use a store this node serves. The rendezvous
    /// store's host lingers even if it never was a member (a spare that came
    /// first): every node uses its store to the end. Also the way out when
    /// this node cannot reach the run store: for a host that is its own store
    /// stalled, which the others still need once it answers again.
    fn end_lingering(&self, verdict: Verdict) -> (Phase, Vec<Action>) {
        self.linger(verdict, true)
    }

    /// [`Self::end_lingering`] with a failure the others were not told of (the
    /// store did not answer): a host waits for them as after a success, since
    /// nothing tells them to stop.
    fn end_lingering_unpublished(&self, verdict: Verdict) -> (Phase, Vec<Action>) {
        self.linger(verdict, false)
    }

    fn linger(&self, verdict: Verdict, published: bool) -> (Phase, Vec<Action>) {
        let job_store = self.member.is_some_and(|m| m.hosts && m.nodes > 1);
        if !(job_store || self.limits.hosts_rendezvous) {
            return finish(verdict);
        }
        let bound = match verdict {
            Verdict::Failed { .. } if published => Some(self.limits.linger_after_failure),
            // The exit barrier passed: every member's workers are done, and no
            // later round formed; the others only read how the run ended. A
            // node that vanished without leaving cannot hold the host then.
            Verdict::Succeeded { barrier: None, .. } => Some(self.limits.linger_after_failure),
            _ => self.limits.linger_after_success,
        };
        let (round, nodes) = self.member.map_or((0, 0), |m| (m.round, m.nodes));
        let after_barrier = matches!(verdict, Verdict::Succeeded { barrier: None, .. });
        (
            Phase::Ending {
                verdict,
                step: EndStep::Linger,
            },
            vec![Action::Linger {
                round,
                nodes,
                bound,
                after_barrier,
                serves: job_store,
            }],
        )
    }
}

fn finish(v: Verdict) -> (Phase, Vec<Action>) {
    (Phase::Done(v.clone()), vec![Action::Finish(v)])
}

/// An event that does not concern `phase` (a check that raced a phase change,
/// a worker exiting during a stop): ignored.
fn stale(phase: Phase, _event: Event) -> (Phase, Vec<Action>) {
    (phase, vec![])
}

fn stop(round: u64, why: StopReason, closed: bool) -> (Phase, Vec<Action>) {
    (
        Phase::Stopping { round, why, closed },
        vec![Action::Stop {
            signal: libc::SIGTERM,
        }],
    )
}

#[cfg(test)]
mod tests;
