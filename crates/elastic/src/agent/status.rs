//! The agent's live status, served over HTTP when asked for (`--status-port`):
//! `GET /status` gives JSON (round, nodes, per-worker state, restarts) and
//! `GET /metrics` the same as Prometheus text. Off by default.
//!
//! The server is a few lines on tokio: one request per connection, answered from
//! the latest snapshot the agent published on its `watch` channel.

use std::net::SocketAddr;

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

pub use super::state::AgentState;
use crate::multiprocessing::Exit;

/// One worker's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerState {
    Running,
    /// Ended: exit code 0 is success.
    Ended(Exit),
    /// Gone without a known exit.
    Unknown,
}

impl std::fmt::Display for WorkerState {
    /// `running`, `succeeded`, or how it ended (`exit code 1`, `signal 9 (SIGKILL)`).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WorkerState::Running => f.write_str("running"),
            WorkerState::Ended(Exit::Code(0)) => f.write_str("succeeded"),
            WorkerState::Ended(e) => write!(f, "{e}"),
            WorkerState::Unknown => f.write_str("unknown"),
        }
    }
}

/// One worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerStatus {
    pub local_rank: usize,
    pub rank: usize,
    pub pid: u32,
    pub state: WorkerState,
}

/// What the agent is doing.
#[derive(Debug, Clone)]
pub struct Status {
    pub run_id: String,
    pub role: String,
    pub state: AgentState,
    pub round: u64,
    pub group_rank: usize,
    pub nodes: usize,
    pub world_size: usize,
    /// Failed rounds so far, job-wide (the restart budget spent).
    pub failed_rounds: u64,
    pub max_restarts: u32,
    pub workers: Vec<WorkerStatus>,
}

impl Status {
    pub fn new(run_id: &str, role: &str, max_restarts: u32) -> Status {
        Status {
            run_id: run_id.to_owned(),
            role: role.to_owned(),
            state: AgentState::Starting,
            round: 0,
            group_rank: 0,
            nodes: 0,
            world_size: 0,
            failed_rounds: 0,
            max_restarts,
            workers: Vec::new(),
        }
    }

    pub fn to_json(&self) -> Value {
        json!({
            "run_id": self.run_id, "role": self.role, "state": self.state.name(),
            "round": self.round, "group_rank": self.group_rank, "nodes": self.nodes,
            "world_size": self.world_size, "restarts": self.failed_rounds,
            "max_restarts": self.max_restarts,
            "workers": self.workers.iter().map(|w| json!({
                "local_rank": w.local_rank, "rank": w.rank, "pid": w.pid,
                "state": w.state.to_string(),
            })).collect::<Vec<_>>(),
        })
    }

    /// Prometheus text exposition.
    pub fn to_prometheus(&self) -> String {
        let labels = format!(
            "run_id=\"{}\",role=\"{}\"",
            esc(&self.run_id),
            esc(&self.role)
        );
        let running = self
            .workers
            .iter()
            .filter(|w| w.state == WorkerState::Running)
            .count();
        let mut out = String::new();
        for (name, help, value) in [
            (
                "rally_round",
                "Rendezvous round (job-wide attempt number).",
                self.round as f64,
            ),
            (
                "rally_nodes",
                "Nodes in the current round.",
                self.nodes as f64,
            ),
            (
                "rally_world_size",
                "Workers in the job.",
                self.world_size as f64,
            ),
            (
                "rally_restarts_total",
                "Failed rounds so far, job-wide.",
                self.failed_rounds as f64,
            ),
            (
                "rally_max_restarts",
                "Restart budget.",
                f64::from(self.max_restarts),
            ),
            (
                "rally_workers_running",
                "Local workers running.",
                running as f64,
            ),
        ] {
            out.push_str(&format!(
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{labels}}} {value}\n"
            ));
        }
        out
    }
}

fn esc(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Serves `status` on `addr` until the runtime ends. Returns the bound address.
pub async fn serve(
    addr: SocketAddr,
    status: tokio::sync::watch::Receiver<Status>,
) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    tokio::spawn(async move {
        loop {
            let Ok((mut conn, _)) = listener.accept().await else {
                continue;
            };
            let status = status.clone();
            tokio::spawn(async move {
                // Up to the end of the headers: a client may send the request
                // line in several writes, and answering (then closing) early
                // would reset its connection.
                let mut buf = [0u8; 2048];
                let mut n = 0;
                let read_head = async {
                    while n < buf.len() && !buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                        match conn.read(&mut buf[n..]).await {
                            Ok(0) | Err(_) => break,
                            Ok(k) => n += k,
                        }
                    }
                };
                if tokio::time::timeout(std::time::Duration::from_secs(5), read_head)
                    .await
                    .is_err()
                {
                    return;
                }
                let request = String::from_utf8_lossy(&buf[..n]);
                let path = request.split_whitespace().nth(1).unwrap_or("/");
                let snapshot = status.borrow().clone();
                let (code, kind, body) = match path {
                    "/" | "/status" => {
                        ("200 OK", "application/json", snapshot.to_json().to_string())
                    }
                    "/metrics" => (
                        "200 OK",
                        "text/plain; version=0.0.4",
                        snapshot.to_prometheus(),
                    ),
                    _ => (
                        "404 Not Found",
                        "text/plain",
                        "try /status or /metrics\n".into(),
                    ),
                };
                let response = format!(
                    "HTTP/1.1 {code}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = conn.write_all(response.as_bytes()).await;
                let _ = conn.shutdown().await;
            });
        }
    });
    Ok(bound)
}
