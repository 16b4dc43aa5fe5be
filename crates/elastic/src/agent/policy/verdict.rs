//! How a run ended for this node ([`Verdict`]) and, when it failed, why
//! ([`Failure`], with [`During`]: the phase in which the rendezvous was lost).

use crate::agent::run_store::FailureRecord;
use crate::agent::state::AgentState;

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

    pub(super) fn failed(why: Failure) -> Verdict {
        Verdict::Failed { why, root: None }
    }
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
