//! What the driver tells the policy ([`Event`]), with what a check of the
//! rendezvous saw ([`Observation`]), and each event's kind without its data,
//! which the stale table (`stale.rs`) is keyed by.

use crate::agent::run_store::{Closed, FailureRecord};

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

/// An [`Event`] without its data: what the stale table is keyed by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    Joined,
    JoinClosed,
    JoinFailed,
    Started,
    StartFailed,
    WorkersSucceeded,
    WorkerFailed,
    Checked,
    Stopped,
    FailureRecorded,
    FailureNotRecorded,
    BarrierPassed,
    BarrierFailed,
    Published,
    NotPublished,
    VerdictRead,
    RendezvousClosed,
    MarkedFinished,
    Lingered,
    Signal,
}

impl Event {
    /// Which event this is, without its data.
    pub fn kind(&self) -> EventKind {
        use EventKind as K;
        match self {
            Event::Joined { .. } => K::Joined,
            Event::JoinClosed => K::JoinClosed,
            Event::JoinFailed(_) => K::JoinFailed,
            Event::Started { .. } => K::Started,
            Event::StartFailed(_) => K::StartFailed,
            Event::WorkersSucceeded => K::WorkersSucceeded,
            Event::WorkerFailed => K::WorkerFailed,
            Event::Checked(_) => K::Checked,
            Event::Stopped { .. } => K::Stopped,
            Event::FailureRecorded { .. } => K::FailureRecorded,
            Event::FailureNotRecorded(_) => K::FailureNotRecorded,
            Event::BarrierPassed => K::BarrierPassed,
            Event::BarrierFailed { .. } => K::BarrierFailed,
            Event::Published(_) => K::Published,
            Event::NotPublished(_) => K::NotPublished,
            Event::VerdictRead(_) => K::VerdictRead,
            Event::RendezvousClosed => K::RendezvousClosed,
            Event::MarkedFinished => K::MarkedFinished,
            Event::Lingered(_) => K::Lingered,
            Event::Signal(_) => K::Signal,
        }
    }
}
