//! What the policy tells the driver to do ([`Action`]).

use std::time::Duration;

use super::verdict::Verdict;
use crate::agent::run_store::Publish;

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
