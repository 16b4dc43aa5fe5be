//! The end-of-run summary on the console: success with its restarts, or
//! torchrun's failure layout (the root cause across all nodes, and where
//! each stopped worker was, from its stacks), or the signal that stopped
//! the run.

use std::path::Path;

use rallypoint_elastic::agent::Outcome;
use rallypoint_elastic::multiprocessing::stacks::WorkerStacks;

use super::args::RunArgs;

/// Says how the run ended.
pub(super) fn report(outcome: &Outcome, name: &str) {
    match outcome {
        Outcome::Succeeded { attempts, barrier } => {
            let restarts = attempts.saturating_sub(1);
            match barrier {
                None => say!("rally run: job succeeded ({restarts} restart(s))"),
                Some(why) => say!(
                    "rally run: this node's workers succeeded ({restarts} restart(s)); the exit barrier did not complete: {why}"
                ),
            }
        }
        Outcome::NotNeeded => {
            say!("rally run: the job ended without this node (it was a spare)")
        }
        Outcome::Failed {
            reason,
            root_cause,
            failures,
            stopped,
        } => {
            say!("rally run: job FAILED: {reason} (failed rounds: {failures})");
            // torchrun's ChildFailedError layout; the root cause is job-wide here
            // (torchrun's is per node).
            let border = "=".repeat(60);
            let section = "-".repeat(60);
            let root = match root_cause {
                Some(r) => format!("[0]:\n{r}"),
                None => "  <unknown: no worker failure was recorded>".to_owned(),
            };
            let stopped = match stopped.is_empty() {
                true => String::new(),
                false => format!(
                    "\n{section}\nStopped on this node (where each worker was):\n{}",
                    where_stopped(stopped)
                ),
            };
            say!(
                "{border}\n{name} FAILED\n{section}\nRoot Cause (first observed failure, across all nodes):\n{root}{stopped}\n{border}"
            );
        }
        Outcome::Signaled { signal, stopped } => {
            say!(
                "rally run: stopped by {}; workers were sent the signal",
                rallypoint_elastic::multiprocessing::signal_name(*signal)
            );
            if !stopped.is_empty() {
                say!(
                    "rally run: where each worker was:\n{}",
                    where_stopped(stopped)
                );
            }
        }
        Outcome::Rendezvous(e) => say!("rally run: rendezvous failed: {}", chain(e)),
        Outcome::Error(e) => say!("rally run: {e}"),
    }
}

/// The few frames of each stopped worker, and where its whole dump is.
fn where_stopped(stopped: &[WorkerStacks]) -> String {
    stopped
        .iter()
        .map(|w| {
            let t = &w.target;
            let file = match &w.written {
                Some(f) => format!(", stacks in {}", f.display()),
                None => String::new(),
            };
            let frames: String = w
                .stuck_frames(STUCK_FRAMES)
                .iter()
                .map(|l| format!("\n    {l}"))
                .collect();
            format!(
                "  rank {} (local_rank: {}, pid: {}){file}:{frames}",
                t.rank, t.local_rank, t.pid
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Innermost frames of each stopped worker in the failure summary.
const STUCK_FRAMES: usize = 3;

/// The name torchrun titles its failure summary with: the script, module or
/// program.
pub(super) fn script_name(a: &RunArgs) -> String {
    a.command.first().map_or_else(String::new, |c| {
        Path::new(c)
            .file_name()
            .unwrap_or(c)
            .to_string_lossy()
            .into_owned()
    })
}

/// An error and its causes, `: `-separated.
pub(super) fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cause = c.source();
    }
    s
}
