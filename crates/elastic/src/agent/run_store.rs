//! The run store: what the nodes of one run tell each other, under typed keys.
//!
//! Every node of a run shares a run store (from the rendezvous). The agent keeps
//! these keys there:
//!
//! | key | written by | meaning |
//! |---|---|---|
//! | `agent/closed` | the node that decides the run's verdict | `succeeded`, or `failed` and the root cause (JSON): one key, so a close always carries its verdict |
//! | `agent/closed_failed` | every node that published or read a failed verdict | set once the verdict is a failure: what a node that read a success waits on |
//! | `agent/root` | every failing node, by compare-and-set | the earliest failure recorded so far |
//! | `agent/failures/<round>/<node>` | the failing node | its failures in that round (JSON lines) |
//! | `agent/failed/<round>`, `agent/failed_rounds` | the first node to fail in a round | each failed round counted once, job-wide |
//! | `agent/r<round>/finishing` | a node entering the exit barrier | a member of the round finished: nodes arriving now wait for a next round |
//!
//! The verdict is written with compare-and-set: *succeeded* only where nothing is
//! published yet, *failed* over nothing or over a success, never over an earlier
//! failure (whose root cause stands). A reader therefore sees at most
//! `none -> succeeded -> failed`, and every node that reads a failure reads the
//! same root cause. Each operation here is a bounded number of store round
//! trips, O(1) in the number of nodes: no node reads another's records.

use std::time::{Duration, UNIX_EPOCH};

use rallypoint_store::{Store, StoreError};
use serde_json::{json, Value};

/// The run's published verdict.
#[derive(Debug, Clone, PartialEq)]
pub enum Closed {
    Succeeded,
    /// With the root cause (the earliest failure recorded when it was published).
    Failed(Option<Box<FailureRecord>>),
}

impl Closed {
    /// The bytes stored under [`keys::CLOSED`].
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Closed::Succeeded => b"succeeded".to_vec(),
            Closed::Failed(root) => {
                let mut v = b"failed\n".to_vec();
                if let Some(r) = root {
                    v.extend_from_slice(r.to_json().to_string().as_bytes());
                }
                v
            }
        }
    }

    /// Decodes a stored verdict; `None` for an empty value (nothing published).
    /// Anything that is not a success is read as a failure: a verdict this
    /// version cannot read must not pass for a success.
    pub fn decode(v: &[u8]) -> Option<Closed> {
        if v.is_empty() {
            return None;
        }
        if v == b"succeeded" {
            return Some(Closed::Succeeded);
        }
        let root = v
            .strip_prefix(b"failed\n")
            .and_then(|j| serde_json::from_slice::<Value>(j).ok())
            .and_then(|j| FailureRecord::from_json(&j))
            .map(Box::new);
        Some(Closed::Failed(root))
    }
}

/// The keys (see the module doc).
pub mod keys {
    pub const CLOSED: &str = "agent/closed";
    pub const FAILED: &str = "agent/closed_failed";
    pub const ROOT: &str = "agent/root";
    pub const FAILED_ROUNDS: &str = "agent/failed_rounds";

    pub fn failures(round: u64, node: usize) -> String {
        format!("agent/failures/{round}/{node}")
    }

    pub fn failed_round(round: u64) -> String {
        format!("agent/failed/{round}")
    }

    pub fn finishing(round: u64) -> String {
        format!("agent/r{round}/finishing")
    }
}

/// The verdict published so far, if any.
pub async fn read_verdict(store: &dyn Store) -> Result<Option<Closed>, StoreError> {
    let v = store.get_now(keys::CLOSED).await?;
    Ok(Closed::decode(&v))
}

/// Records this node's `failures` of `round` (node rank `node`), lowers the root
/// cause if one of them is earlier, and counts the round once job-wide. Returns
/// the failed rounds so far.
pub async fn record_failure(
    store: &dyn Store,
    round: u64,
    node: usize,
    failures: &[FailureRecord],
) -> Result<u64, StoreError> {
    let mut lines = String::new();
    for f in failures {
        lines.push_str(&f.to_json().to_string());
        lines.push('\n');
    }
    store
        .set(&keys::failures(round, node), lines.as_bytes())
        .await?;
    if let Some(first) = failures.iter().min_by(|a, b| a.time.total_cmp(&b.time)) {
        lower_root(store, first).await?;
    }
    // The first node to report a failure in this round counts it.
    let n = if store.add(&keys::failed_round(round), 1).await? == 1 {
        store.add(keys::FAILED_ROUNDS, 1).await?
    } else {
        store.add(keys::FAILED_ROUNDS, 0).await?
    };
    Ok(n.max(0) as u64)
}

/// Sets the root cause to `f` if none is recorded or `f` is earlier. Each retry
/// follows another node's successful write, so it ends.
async fn lower_root(store: &dyn Store, f: &FailureRecord) -> Result<(), StoreError> {
    let mine = f.to_json().to_string().into_bytes();
    let mut current = store.get_now(keys::ROOT).await?;
    loop {
        if let Some(old) = root_of(&current) {
            if old.time <= f.time {
                return Ok(());
            }
        }
        let now = store.compare_set(keys::ROOT, &current, &mine).await?;
        if now == mine {
            return Ok(());
        }
        current = now;
    }
}

fn root_of(v: &[u8]) -> Option<FailureRecord> {
    serde_json::from_slice::<Value>(v)
        .ok()
        .and_then(|j| FailureRecord::from_json(&j))
}

/// The earliest failure recorded so far.
pub async fn root_cause(store: &dyn Store) -> Result<Option<FailureRecord>, StoreError> {
    Ok(root_of(&store.get_now(keys::ROOT).await?))
}

/// Job-wide failed rounds so far.
pub async fn failed_rounds(store: &dyn Store) -> Result<u64, StoreError> {
    Ok(store.add(keys::FAILED_ROUNDS, 0).await?.max(0) as u64)
}

/// The verdict to write to the run store.
#[derive(Debug, Clone, PartialEq)]
pub enum Publish {
    /// Only if nothing is published yet.
    Succeeded,
    /// Over a success, never over an earlier failure; the root cause is the
    /// earliest recorded failure, or `local`.
    Failed { local: Option<Box<FailureRecord>> },
}

/// Publishes the verdict: `Succeeded` only over nothing; `Failed` over nothing or
/// a success, with the earliest recorded failure (or `local`) as root cause.
/// Returns what the store holds afterwards (an earlier failure stands).
pub async fn publish(store: &dyn Store, verdict: &Publish) -> Result<Closed, StoreError> {
    let mine = match verdict {
        Publish::Succeeded => Closed::Succeeded,
        Publish::Failed { local } => {
            let recorded = root_cause(store).await?.map(Box::new);
            let root = match (recorded, local.clone()) {
                (Some(a), Some(b)) => Some(if b.time < a.time { b } else { a }),
                (a, b) => a.or(b),
            };
            Closed::Failed(root)
        }
    };
    let bytes = mine.encode();
    let mut current = store.get_now(keys::CLOSED).await?;
    // At most two rounds: none -> succeeded -> failed.
    loop {
        match Closed::decode(&current) {
            Some(c @ Closed::Failed(_)) => {
                // Again, in case the node that wrote it stopped before this.
                store.set(keys::FAILED, b"1").await?;
                return Ok(c);
            }
            Some(Closed::Succeeded) if mine == Closed::Succeeded => return Ok(Closed::Succeeded),
            Some(Closed::Succeeded) | None => {}
        }
        let now = store.compare_set(keys::CLOSED, &current, &bytes).await?;
        if now == bytes {
            if matches!(mine, Closed::Failed(_)) {
                store.set(keys::FAILED, b"1").await?;
            }
            return Ok(mine);
        }
        current = now;
    }
}

/// Says that a member of `round` finished its workers: late arrivals wait.
pub async fn mark_finishing(store: &dyn Store, round: u64) -> Result<(), StoreError> {
    store.set(&keys::finishing(round), b"1").await
}

/// Whether a member of `round` finished its workers.
pub async fn finishing(store: &dyn Store, round: u64) -> Result<bool, StoreError> {
    store.check(&[&keys::finishing(round)]).await
}

/// A worker failure, as recorded in the run store (one JSON line each).
#[derive(Debug, Clone, PartialEq)]
pub struct FailureRecord {
    /// Seconds since the epoch.
    pub time: f64,
    pub host: String,
    pub group_rank: usize,
    pub rank: usize,
    pub local_rank: usize,
    pub round: u64,
    pub pid: u32,
    /// torchrun's convention: the exit code, or minus the signal number.
    pub exitcode: i32,
    /// "exit code 3" or "signal SIGKILL".
    pub exit: String,
    /// The error file's message, or a description of the exit.
    pub message: String,
    /// The error file's traceback (at most [`TRACEBACK_MAX`] bytes), if it had one.
    pub traceback: String,
    /// The worker's error file, or `<N/A>` if it wrote none (as torchrun).
    pub error_file: String,
}

/// Longest traceback kept in the failure log (its tail: the raise is at the end).
pub const TRACEBACK_MAX: usize = 16 * 1024;

/// What torchrun shows for a missing error file.
pub const NOT_AVAILABLE: &str = "<N/A>";

impl FailureRecord {
    pub fn to_json(&self) -> Value {
        json!({
            "time": self.time, "host": self.host, "group_rank": self.group_rank,
            "rank": self.rank, "local_rank": self.local_rank, "round": self.round,
            "pid": self.pid, "exitcode": self.exitcode, "exit": self.exit,
            "message": self.message, "traceback": self.traceback,
            "error_file": self.error_file,
        })
    }

    pub fn from_json(v: &Value) -> Option<FailureRecord> {
        let s = |k: &str| v.get(k).and_then(Value::as_str).unwrap_or("").to_owned();
        let n = |k: &str| v.get(k).and_then(Value::as_u64).unwrap_or(0);
        Some(FailureRecord {
            time: v.get("time")?.as_f64()?,
            host: s("host"),
            group_rank: n("group_rank") as usize,
            rank: n("rank") as usize,
            local_rank: n("local_rank") as usize,
            round: n("round"),
            pid: n("pid") as u32,
            exitcode: v.get("exitcode").and_then(Value::as_i64).unwrap_or(1) as i32,
            exit: s("exit"),
            message: s("message"),
            traceback: s("traceback"),
            error_file: s("error_file"),
        })
    }

    /// The earliest failure in a failure log.
    pub fn first_in(log: &[u8]) -> Option<FailureRecord> {
        String::from_utf8_lossy(log)
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter_map(|v| FailureRecord::from_json(&v))
            .min_by(|a, b| a.time.total_cmp(&b.time))
    }

    /// The error-file JSON a launcher writes for this failure (torchrun's
    /// `dump_error_file` layout, with `errorCode`), so a scheduler reading the
    /// launcher's `TORCHELASTIC_ERROR_FILE` sees the root cause.
    pub fn error_json(&self) -> Value {
        let callstack = if self.traceback.is_empty() {
            &self.message
        } else {
            &self.traceback
        };
        let when = UNIX_EPOCH + Duration::from_secs_f64(self.time.max(0.0));
        let mut v = crate::errors::error_json(&self.message, callstack, when);
        v["message"]["errorCode"] = json!(self.exitcode);
        v
    }
}

/// torchrun's layout of one failure (`_FAILURE_FORMAT_TEMPLATE`), with the node
/// and attempt added; the traceback indented under `traceback :`.
impl std::fmt::Display for FailureRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "  time      : {}",
            crate::time::format_time(self.time).replace(' ', "_")
        )?;
        writeln!(f, "  host      : {}", self.host)?;
        writeln!(
            f,
            "  rank      : {} (local_rank: {}, node: {})",
            self.rank, self.local_rank, self.group_rank
        )?;
        let signal = self
            .exit
            .strip_prefix("signal ")
            .map(|s| format!(" ({s})"))
            .unwrap_or_default();
        writeln!(
            f,
            "  exitcode  : {} (pid: {}){signal}",
            self.exitcode, self.pid
        )?;
        writeln!(f, "  attempt   : {}", self.round)?;
        writeln!(f, "  error_file: {}", self.error_file)?;
        let tb = if self.traceback.is_empty() {
            &self.message
        } else {
            &self.traceback
        };
        write!(f, "  traceback : {}", tb.trim_end().replace('\n', "\n  "))
    }
}
