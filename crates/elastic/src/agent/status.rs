//! The agent's live status, served over HTTP when asked for (`--status-port`):
//! `GET /status` gives JSON (round, nodes, per-worker state, restarts) and
//! `GET /metrics` the same as Prometheus text. Off by default.
//!
//! The server is a few lines on tokio: one request per connection, answered from
//! the latest snapshot the agent published on its `watch` channel.
//!
//! A program embedding the agent can add its own [`Section`]s (`rally run
//! --ft` adds its replica group's quorum): each is one more key of the JSON
//! object and more lines of the Prometheus text, read when a request comes.

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

/// A Prometheus label value, escaped (for a [`Section`]'s labels too).
pub fn esc(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// More status beside the agent's, from the program that embeds it.
pub trait Section: Send + Sync {
    /// Its key in the `/status` JSON object.
    fn name(&self) -> &str;
    /// Its value in the `/status` JSON object, as of now.
    fn to_json(&self) -> Value;
    /// Its lines of the `/metrics` Prometheus text, as of now (each metric
    /// with its `# HELP` and `# TYPE` lines).
    fn to_prometheus(&self) -> String;
}

/// Serves `status` on `addr` until the runtime ends. Returns the bound address.
pub async fn serve(
    addr: SocketAddr,
    status: tokio::sync::watch::Receiver<Status>,
) -> std::io::Result<SocketAddr> {
    serve_with(addr, status, Vec::new()).await
}

/// [`serve`], with `sections` added to both endpoints.
pub async fn serve_with(
    addr: SocketAddr,
    status: tokio::sync::watch::Receiver<Status>,
    sections: Vec<std::sync::Arc<dyn Section>>,
) -> std::io::Result<SocketAddr> {
    let sections = std::sync::Arc::new(sections);
    let listener = TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    tokio::spawn(async move {
        loop {
            let Ok((mut conn, _)) = listener.accept().await else {
                continue;
            };
            let status = status.clone();
            let sections = sections.clone();
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
                        let mut v = snapshot.to_json();
                        for s in sections.iter() {
                            v[s.name()] = s.to_json();
                        }
                        ("200 OK", "application/json", v.to_string())
                    }
                    "/metrics" => {
                        let mut text = snapshot.to_prometheus();
                        for s in sections.iter() {
                            text.push_str(&s.to_prometheus());
                        }
                        ("200 OK", "text/plain; version=0.0.4", text)
                    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    struct Quorum;

    impl Section for Quorum {
        fn name(&self) -> &str {
            "ft"
        }
        fn to_json(&self) -> Value {
            json!({ "quorum_id": 7 })
        }
        fn to_prometheus(&self) -> String {
            "# HELP rally_ft_quorum_id q\n# TYPE rally_ft_quorum_id gauge\nrally_ft_quorum_id 7\n"
                .into()
        }
    }

    async fn get(addr: SocketAddr, path: &str) -> String {
        let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
        c.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut out = String::new();
        c.read_to_string(&mut out).await.unwrap();
        out.split_once("\r\n\r\n").unwrap().1.to_owned()
    }

    #[tokio::test]
    async fn sections_are_served_beside_the_agents_status() {
        let (_tx, rx) = tokio::sync::watch::channel(Status::new("job", "trainer", 3));
        let addr = serve_with("127.0.0.1:0".parse().unwrap(), rx, vec![Arc::new(Quorum)])
            .await
            .unwrap();
        let status: Value = serde_json::from_str(&get(addr, "/status").await).unwrap();
        assert_eq!(status["run_id"], "job");
        assert_eq!(status["ft"]["quorum_id"], 7);
        let metrics = get(addr, "/metrics").await;
        assert!(metrics.contains("rally_max_restarts{"), "{metrics}");
        assert!(metrics.ends_with("rally_ft_quorum_id 7\n"), "{metrics}");
    }
}
