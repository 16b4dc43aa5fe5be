//! The console of `rally run`: its opening line, and the lines it prints as
//! the agent's events arrive ([`Console`]), beside the JSON lines of
//! `--events` / `--event-log-handler console` when asked for. Every line goes
//! out in one write (`say!`), so a worker's output never lands inside one.

use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context};
use rallypoint_elastic::agent::events::{AgentEvent, EventSink, Fanout, JsonLines};

use super::args::RunArgs;
use super::plan::Plan;

/// The line that opens a run: its id, where it meets, and its size.
pub(super) fn announce(plan: &Plan) {
    let nodes = match (plan.min_nodes, plan.max_nodes) {
        (a, b) if a == b => a.to_string(),
        (a, b) => format!("{a}:{b}"),
    };
    say!(
        "rally run: run {} | {} rendezvous at {} | nodes {nodes} | {} worker(s) per node | max restarts {}",
        plan.params.run_id,
        plan.params.backend,
        if plan.params.endpoint.is_empty() { "-" } else { &plan.params.endpoint },
        plan.spec.local_world_size,
        plan.spec.max_restarts
    );
}

/// Where the agent's events go: the console, and JSON lines to `--events`
/// (`-`: stderr) or, as torchrun's `--event-log-handler console`, stderr.
pub(super) fn sinks(a: &RunArgs) -> anyhow::Result<Arc<dyn EventSink>> {
    let json: Option<Arc<dyn EventSink>> = match (a.events.as_deref(), a.event_log_handler.as_str())
    {
        (Some(p), _) if p == Path::new("-") => {
            Some(Arc::new(JsonLines::new(Box::new(std::io::stderr()))))
        }
        (Some(p), _) => Some(Arc::new(JsonLines::new(Box::new(
            std::fs::File::create(p).with_context(|| format!("--events {}", p.display()))?,
        )))),
        (None, "console") => Some(Arc::new(JsonLines::new(Box::new(std::io::stderr())))),
        (None, "null") => None,
        (None, other) => bail!("--event-log-handler {other:?}: expected null or console"),
    };
    let mut sinks: Vec<Arc<dyn EventSink>> = vec![Arc::new(Console)];
    sinks.extend(json);
    Ok(Arc::new(Fanout(sinks)))
}

/// The console lines of `rally run`, rendered from the agent's events.
struct Console;

impl EventSink for Console {
    fn emit(&self, event: &AgentEvent) {
        match event {
            AgentEvent::RendezvousWaiting { run_id, waited } => say!(
                "rally run: still waiting for the rendezvous of run {run_id:?} after {:.0?}",
                waited
            ),
            AgentEvent::WorkersStarted {
                round,
                group_rank,
                group_world_size,
                world_size,
                ranks,
                master_addr,
                master_port,
                ..
            } => say!(
                "rally run: round {round} formed: node {group_rank} of {group_world_size}, ranks {}..{} of {world_size}, job store {master_addr}:{master_port}",
                ranks.start, ranks.end
            ),
            AgentEvent::MembershipChanged {
                nodes_waiting,
                members_dead,
                lost,
                ..
            } => {
                let who = if lost.is_empty() {
                    String::new()
                } else {
                    format!(": {}", lost.join(", "))
                };
                say!(
                    "rally run: membership changed ({nodes_waiting} node(s) waiting, {members_dead} lost{who}); re-forming the group"
                )
            }
            AgentEvent::GroupRestarting {
                failed_rounds,
                max_restarts,
                cause,
            } => say!(
                "rally run: worker failed ({}); restarting the group (restart {failed_rounds} of {max_restarts})",
                cause.as_deref().unwrap_or("unknown")
            ),
            AgentEvent::RunClosedAfterSuccess { .. } => say!(
                "rally run: another node finished and closed the run; this node's workers keep running (no more restarts)"
            ),
            AgentEvent::RendezvousUnreachable { error } => say!(
                "rally run: cannot reach the rendezvous ({error}); the workers keep running for now"
            ),
            AgentEvent::SignalReceived { signal, phase } => say!(
                "rally run: {} received during {phase}; stopping",
                rallypoint_elastic::multiprocessing::signal_name(*signal)
            ),
            AgentEvent::StacksDumped { workers, took, .. } => {
                let read = workers.iter().filter(|(.., error)| error.is_none()).count();
                say!(
                    "rally run: read the stacks of {read} of {} running worker(s) in {took:.0?} before stopping them",
                    workers.len()
                );
            }
            AgentEvent::StopIncomplete { pids } => say!(
                "rally run: processes {pids:?} did not die after SIGKILL (stuck in the kernel?)"
            ),
            AgentEvent::ExitBarrierTimedOut { error } => {
                say!("rally run: exit barrier did not complete: {error}")
            }
            AgentEvent::HostLingering {
                nodes_left,
                rendezvous_store,
                job_store,
            } => {
                let what = match (rendezvous_store, job_store) {
                    (true, true) => "the rendezvous store and the job store",
                    (true, false) => "the rendezvous store",
                    _ => "the job store",
                };
                say!("rally run: keeping {what} up until {nodes_left} other node(s) have seen the outcome")
            }
            AgentEvent::CleanupFailed { what, error } => {
                tracing::warn!(%error, "{what} failed")
            }
            _ => {}
        }
    }
}
