//! What the agent tells the world: typed [`AgentEvent`]s sent to an
//! [`EventSink`] the caller chooses. The library never prints; `rally run`
//! renders these as its console lines and as `--events` JSON lines
//! ([`AgentEvent::to_json`]), and a Rust program embedding the agent can route,
//! filter or drop them.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use rallypoint_sync::MutexExt;
use serde_json::{json, Value};

use super::FailureRecord;

/// One thing that happened.
#[derive(Debug, Clone)]
pub enum AgentEvent {
    RendezvousStarted {
        run_id: String,
    },
    /// Still waiting, every 10 s.
    RendezvousWaiting {
        run_id: String,
        waited: Duration,
    },
    RendezvousCompleted {
        run_id: String,
        round: u64,
        group_rank: usize,
        group_world_size: usize,
        duration: Duration,
    },
    RendezvousFailed {
        error: String,
    },
    WorkersStarted {
        round: u64,
        group_rank: usize,
        group_world_size: usize,
        world_size: usize,
        ranks: std::ops::Range<usize>,
        pids: Vec<u32>,
        master_addr: String,
        master_port: u16,
        restarts_used: u64,
    },
    WorkerFailed(Box<FailureRecord>),
    WorkersSucceeded {
        round: u64,
        duration: Duration,
    },
    GroupRestarting {
        failed_rounds: u64,
        max_restarts: u32,
        cause: Option<String>,
    },
    MembershipChanged {
        round: u64,
        nodes_waiting: usize,
        members_dead: usize,
        /// The dead members' node ids, where the backend knows them.
        lost: Vec<String>,
    },
    /// Another node closed the run after success: no more rounds; workers go on.
    RunClosedAfterSuccess {
        round: u64,
    },
    RendezvousUnreachable {
        error: String,
    },
    SignalReceived {
        signal: i32,
        phase: &'static str,
    },
    /// The Python stacks of the workers about to be stopped were read (see
    /// [`crate::multiprocessing::stacks`]).
    StacksDumped {
        round: u64,
        /// Why the workers are being stopped.
        why: String,
        /// One per worker still running: rank, pid, the file it was written
        /// to (none with logs off), why it could not be read.
        workers: Vec<(usize, u32, Option<std::path::PathBuf>, Option<String>)>,
        took: Duration,
    },
    /// Processes that did not die after SIGKILL (stuck in the kernel).
    StopIncomplete {
        pids: Vec<u32>,
    },
    ExitBarrierTimedOut {
        error: String,
    },
    /// A node that hosts a store others use (the rendezvous store, this
    /// round's job store, or both) keeps it up until the other nodes have seen
    /// how the run ended.
    HostLingering {
        nodes_left: usize,
        rendezvous_store: bool,
        job_store: bool,
    },
    /// A store operation at the end of the run failed (closing, publishing).
    CleanupFailed {
        what: &'static str,
        error: String,
    },
    Finished {
        state: &'static str,
        exit_code: i32,
    },
    /// An event of the program that embeds the agent (`rally run --ft`'s
    /// quorum, joins, drops, heals), sent through the same sinks: its
    /// `area.what` name and its fields (a JSON object).
    Embedder {
        name: &'static str,
        fields: Value,
    },
}

impl AgentEvent {
    /// The event's name, `area.what`.
    pub fn name(&self) -> &'static str {
        match self {
            AgentEvent::RendezvousStarted { .. } => "rendezvous.started",
            AgentEvent::RendezvousWaiting { .. } => "rendezvous.waiting",
            AgentEvent::RendezvousCompleted { .. } => "rendezvous.completed",
            AgentEvent::RendezvousFailed { .. } => "rendezvous.failed",
            AgentEvent::WorkersStarted { .. } => "workers.started",
            AgentEvent::WorkerFailed(_) => "worker.failed",
            AgentEvent::WorkersSucceeded { .. } => "workers.succeeded",
            AgentEvent::GroupRestarting { .. } => "group.restarting",
            AgentEvent::MembershipChanged { .. } => "membership.changed",
            AgentEvent::RunClosedAfterSuccess { .. } => "run.closed_after_success",
            AgentEvent::RendezvousUnreachable { .. } => "rendezvous.unreachable",
            AgentEvent::SignalReceived { .. } => "agent.signaled",
            AgentEvent::StacksDumped { .. } => "workers.stacks_dumped",
            AgentEvent::StopIncomplete { .. } => "workers.stop_incomplete",
            AgentEvent::ExitBarrierTimedOut { .. } => "exit_barrier.timed_out",
            AgentEvent::HostLingering { .. } => "host.lingering",
            AgentEvent::CleanupFailed { .. } => "agent.cleanup_failed",
            AgentEvent::Finished { .. } => "agent.finished",
            AgentEvent::Embedder { name, .. } => name,
        }
    }

    /// `{"event": name, "time": <unix seconds>, ...fields}`.
    pub fn to_json(&self) -> Value {
        let ms = |d: &Duration| d.as_millis() as u64;
        let mut v = match self {
            AgentEvent::RendezvousStarted { run_id } => json!({ "run_id": run_id }),
            AgentEvent::RendezvousWaiting { run_id, waited } => {
                json!({ "run_id": run_id, "waited_ms": ms(waited) })
            }
            AgentEvent::RendezvousCompleted {
                run_id,
                round,
                group_rank,
                group_world_size,
                duration,
            } => json!({
                "run_id": run_id, "round": round, "group_rank": group_rank,
                "group_world_size": group_world_size, "duration_ms": ms(duration),
            }),
            AgentEvent::RendezvousFailed { error }
            | AgentEvent::RendezvousUnreachable { error }
            | AgentEvent::ExitBarrierTimedOut { error } => json!({ "error": error }),
            AgentEvent::WorkersStarted {
                round,
                group_rank,
                group_world_size,
                world_size,
                ranks,
                pids,
                master_addr,
                master_port,
                restarts_used,
            } => json!({
                "round": round, "group_rank": group_rank,
                "group_world_size": group_world_size, "world_size": world_size,
                "ranks": ranks.clone().collect::<Vec<_>>(), "pids": pids,
                "master_addr": master_addr, "master_port": master_port,
                "restarts_used": restarts_used,
            }),
            AgentEvent::WorkerFailed(r) => r.to_json(),
            AgentEvent::WorkersSucceeded { round, duration } => {
                json!({ "round": round, "duration_ms": ms(duration) })
            }
            AgentEvent::GroupRestarting {
                failed_rounds,
                max_restarts,
                cause,
            } => json!({
                "failures": failed_rounds, "max_restarts": max_restarts, "cause": cause,
            }),
            AgentEvent::MembershipChanged {
                round,
                nodes_waiting,
                members_dead,
                lost,
            } => json!({
                "round": round, "nodes_waiting": nodes_waiting, "members_dead": members_dead,
                "lost": lost,
            }),
            AgentEvent::RunClosedAfterSuccess { round } => json!({ "round": round }),
            AgentEvent::SignalReceived { signal, phase } => json!({
                "signal": crate::multiprocessing::signal_name(*signal), "phase": phase,
            }),
            AgentEvent::StacksDumped {
                round,
                why,
                workers,
                took,
            } => json!({
                "round": round, "why": why, "took_ms": ms(took),
                "workers": workers.iter().map(|(rank, pid, file, error)| json!({
                    "rank": rank, "pid": pid,
                    "file": file.as_ref().map(|f| f.display().to_string()), "error": error,
                })).collect::<Vec<_>>(),
            }),
            AgentEvent::StopIncomplete { pids } => json!({ "pids": pids }),
            AgentEvent::HostLingering {
                nodes_left,
                rendezvous_store,
                job_store,
            } => json!({
                "nodes_left": nodes_left,
                "rendezvous_store": rendezvous_store,
                "job_store": job_store,
            }),
            AgentEvent::CleanupFailed { what, error } => json!({ "what": what, "error": error }),
            AgentEvent::Finished { state, exit_code } => {
                json!({ "state": state, "exit_code": exit_code })
            }
            AgentEvent::Embedder { fields, .. } => match fields {
                Value::Object(_) => fields.clone(),
                other => json!({ "value": other }),
            },
        };
        if let Value::Object(m) = &mut v {
            m.insert("event".into(), self.name().into());
            // A worker's failure keeps its own time (its error file's, or
            // when the agent saw it end: the root cause is the earliest),
            // not the event's.
            m.entry("time").or_insert_with(|| super::now_secs().into());
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::run_store::FailureRecord;

    #[test]
    fn an_embedders_event_carries_its_name_and_fields() {
        let e = AgentEvent::Embedder {
            name: "ft.quorum",
            fields: json!({ "quorum_id": 3, "members": ["0", "1"] }),
        };
        let v = e.to_json();
        assert_eq!(v["event"], "ft.quorum");
        assert_eq!(v["quorum_id"], 3);
        assert_eq!(v["members"][1], "1");
        assert!(v["time"].as_f64().unwrap() > 0.0);
        let odd = AgentEvent::Embedder {
            name: "x.y",
            fields: json!(5),
        }
        .to_json();
        assert_eq!(odd["value"], 5);
    }

    #[test]
    fn a_worker_failure_event_keeps_the_time_the_worker_failed() {
        let r = FailureRecord {
            time: 1_000.5,
            host: "node1".into(),
            group_rank: 0,
            rank: 3,
            local_rank: 1,
            round: 0,
            pid: 42,
            exitcode: 1,
            exit: "exit code 1".into(),
            message: "boom".into(),
            traceback: String::new(),
            error_file: "<N/A>".into(),
        };
        let v = AgentEvent::WorkerFailed(Box::new(r)).to_json();
        assert_eq!(v["event"], "worker.failed");
        assert_eq!(v["time"], 1_000.5);
        let other = AgentEvent::RendezvousStarted { run_id: "r".into() }.to_json();
        assert!(other["time"].as_f64().unwrap() > 1_000_000.0, "{other}");
    }
}

/// Where events go. Called from the agent's task: keep it quick.
pub trait EventSink: Send + Sync {
    fn emit(&self, event: &AgentEvent);
}

/// Drops everything.
pub struct Discard;

impl EventSink for Discard {
    fn emit(&self, _: &AgentEvent) {}
}

/// Several sinks, in order.
pub struct Fanout(pub Vec<Arc<dyn EventSink>>);

impl EventSink for Fanout {
    fn emit(&self, event: &AgentEvent) {
        for s in &self.0 {
            s.emit(event);
        }
    }
}

/// Keeps every event, for tests and embedding.
#[derive(Default)]
pub struct Recorder(pub Mutex<Vec<AgentEvent>>);

impl EventSink for Recorder {
    fn emit(&self, event: &AgentEvent) {
        self.0.locked().push(event.clone());
    }
}

/// JSON lines to a writer (`--events FILE`).
pub struct JsonLines(pub Mutex<Box<dyn std::io::Write + Send>>);

impl JsonLines {
    pub fn new(out: Box<dyn std::io::Write + Send>) -> JsonLines {
        JsonLines(Mutex::new(out))
    }
}

impl EventSink for JsonLines {
    fn emit(&self, event: &AgentEvent) {
        // One write: on a console shared with the workers (`--events
        // console`), a line in two writes could have theirs in between.
        let mut line = event.to_json().to_string();
        line.push('\n');
        let mut out = self.0.locked();
        let _ = out.write_all(line.as_bytes());
        let _ = out.flush();
    }
}
