//! What the agent is doing, as one name: the phases of its policy while it runs
//! and how it ended after.
//!
//! Both the pure policy (`policy/`, which maps each phase and verdict to a
//! state) and the status server (`status.rs`, which shows it in `/status` and
//! `/metrics`) use it; it lives apart so that the policy does not depend on the
//! server.

/// What the agent is doing: a phase while it runs, how it ended after.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AgentState {
    Starting,
    Rendezvous,
    Running,
    Stopping,
    RecordingFailure,
    ExitBarrier,
    Ending,
    Succeeded,
    Failed,
    Signaled,
    NotNeeded,
}

impl AgentState {
    /// The name in `/status`, `/metrics` and events.
    pub fn name(self) -> &'static str {
        match self {
            AgentState::Starting => "starting",
            AgentState::Rendezvous => "rendezvous",
            AgentState::Running => "running",
            AgentState::Stopping => "stopping",
            AgentState::RecordingFailure => "recording_failure",
            AgentState::ExitBarrier => "exit_barrier",
            AgentState::Ending => "ending",
            AgentState::Succeeded => "succeeded",
            AgentState::Failed => "failed",
            AgentState::Signaled => "signaled",
            AgentState::NotNeeded => "not_needed",
        }
    }
}
