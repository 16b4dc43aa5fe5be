//! The elastic rendezvous interface (PyTorch's `elastic/rendezvous/api.py`).
//!
//! An agent calls [`RendezvousHandler::next_rendezvous`] before every (re)start of
//! its workers and gets back the job's store, its rank among the nodes, the number of
//! nodes, and where workers reach the job's store. Between rounds it asks
//! [`RendezvousHandler::num_nodes_waiting`] whether the group should re-form, and at
//! the end it closes the rendezvous so every other node stops too.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use rallypoint_store::{Store, StoreError};

/// The rendezvous store's read timeout when `--rdzv-conf read_timeout` is not
/// given (PyTorch's default for `c10d` and `etcd`): see
/// [`RendezvousParameters::read_timeout`].
pub const DEFAULT_READ_TIMEOUT: Duration = Duration::from_secs(60);

fn not_back(lost: &[String]) -> String {
    match lost {
        [] => String::new(),
        _ => format!("; not back from the last round: {}", lost.join(", ")),
    }
}

/// Why a rendezvous failed.
#[derive(Debug, thiserror::Error)]
pub enum RendezvousError {
    /// The rendezvous was closed; the job is over.
    #[error("rendezvous {run_id:?} is closed")]
    Closed { run_id: String },
    /// Not enough nodes came in time. Names who joined, how many were
    /// expected, and the members of the last round that did not come back.
    #[error("rendezvous {run_id:?} timed out after {waited:?}: {} joined ({}), expected {expected}{}", .joined.len(), .joined.join(", "), not_back(.lost))]
    Timeout {
        run_id: String,
        waited: Duration,
        joined: Vec<String>,
        expected: String,
        /// Nodes of the last round that did not join this one (a node lost).
        lost: Vec<String>,
    },
    /// The store could not be reached.
    #[error("rendezvous {run_id:?} cannot reach its store")]
    Connection {
        run_id: String,
        #[source]
        source: Box<StoreError>,
    },
    /// The store stopped answering while this node waited on it (its beats
    /// failed).
    #[error("rendezvous {run_id:?} cannot reach its store: {reason}")]
    Unreachable { run_id: String, reason: String },
    /// The shared state is not what the protocol allows.
    #[error("rendezvous {run_id:?} is in an invalid state: {reason}")]
    State { run_id: String, reason: String },
    /// This node is not needed (the group is full and closed); not a failure.
    #[error("rendezvous {run_id:?} closed while this node was a spare; exiting gracefully")]
    GracefulExit { run_id: String },
    /// A bad parameter or option; names it.
    #[error("rendezvous option {option:?} = {value:?} is invalid: {expected}")]
    Config {
        option: String,
        value: String,
        expected: String,
    },
    /// A backend registry problem.
    #[error("{0}")]
    Registry(String),
}

/// How workers reach the job's store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootstrapStoreInfo {
    pub master_addr: String,
    pub master_port: u16,
}

/// The outcome of one rendezvous round.
#[derive(Clone)]
pub struct RendezvousInfo {
    /// The job's store, namespaced for this round.
    pub store: Arc<dyn Store>,
    /// This node's rank among the nodes (the agent's group rank).
    pub rank: usize,
    /// Number of nodes in the round.
    pub world_size: usize,
    pub bootstrap: BootstrapStoreInfo,
    /// The round's number, the same on every node: how many times the group
    /// formed before this one (the agent's job-wide attempt number).
    pub round: u64,
    /// A store shared by every node for the whole run, across rounds.
    pub run_store: Arc<dyn Store>,
}

impl std::fmt::Debug for RendezvousInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RendezvousInfo")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("bootstrap", &self.bootstrap)
            .field("round", &self.round)
            .finish_non_exhaustive()
    }
}

/// A rendezvous backend, for one run.
#[async_trait::async_trait]
pub trait RendezvousHandler: Send + Sync {
    /// The backend's registered name (`static`, `c10d`, `etcd`, ...).
    fn backend(&self) -> &str;

    /// Joins the next round and waits for it to complete.
    async fn next_rendezvous(&self) -> Result<RendezvousInfo, RendezvousError>;

    /// Whether the rendezvous has been closed.
    async fn is_closed(&self) -> Result<bool, RendezvousError>;

    /// Closes the rendezvous: every later join, on any node, fails with
    /// [`RendezvousError::Closed`].
    async fn set_closed(&self) -> Result<(), RendezvousError>;

    /// Nodes waiting to join, which the agent reacts to by re-forming the group.
    async fn num_nodes_waiting(&self) -> Result<usize, RendezvousError>;

    /// How this node's round changed: nodes waiting to join, and members found
    /// dead (that stopped keeping alive without leaving). Backends that do not
    /// watch members report every change as waiting.
    async fn membership(&self) -> Result<MembershipChange, RendezvousError> {
        Ok(MembershipChange {
            waiting: self.num_nodes_waiting().await?,
            ..MembershipChange::default()
        })
    }

    /// Waits until this node's round may have changed after wake `seen` (0 at
    /// first, then what the last call returned) and returns the new mark: the
    /// caller then reads [`Self::membership`] again. Fails when the store stops
    /// answering meanwhile. Backends that are not woken by their store wait
    /// `poll` and return (the caller polls).
    async fn changed(&self, seen: u64, poll: Duration) -> Result<u64, RendezvousError> {
        tokio::time::sleep(poll).await;
        Ok(seen.wrapping_add(1))
    }

    /// The run store ([`RendezvousInfo::run_store`]) before any round formed, so a
    /// node whose join ended when the run closed can read how it ended.
    fn run_store(&self) -> Option<Arc<dyn Store>> {
        None
    }

    /// Whether [`Self::membership`] notices members that died.
    fn detects_dead_members(&self) -> bool {
        false
    }

    /// Nodes of the run still running besides this one: every node that was a
    /// member of a round, less those that left and those found dead. A node
    /// serving a store the others use keeps it up until this is 0. A 0 while
    /// some node was found dead is answered only once it has held for two
    /// keep-alive intervals (that node may be back from a partition and about
    /// to count itself in again). Backends that do not count answer 0.
    async fn remaining(&self) -> Result<usize, RendezvousError> {
        Ok(0)
    }

    /// Where the rendezvous store is (`host:port`, a path), for errors.
    fn endpoint(&self) -> Option<String> {
        None
    }

    /// Whether the node (or server) that served the rendezvous store has
    /// ended: nothing listens at its endpoint any more (a connection is
    /// refused), as opposed to a store that does not answer (stalled, or cut
    /// off from this node), which may come back. `false` where the backend
    /// cannot tell, or where this node serves the store itself. A `c10d`
    /// client says so of any server at its endpoint, a `rally store serve`
    /// included; the agent asks only once the exit barrier passed, when no
    /// worker needs the stores any more.
    async fn store_host_ended(&self) -> bool {
        false
    }

    /// Whether a round can re-form with other members (a dead member replaced
    /// or dropped). `static` cannot: its nodes are fixed.
    fn reforms(&self) -> bool {
        true
    }

    /// This node leaves its round for good (it is ending): it stops keeping
    /// alive and says so, so the others do not count it dead. Does not close
    /// the rendezvous.
    async fn leave(&self) -> Result<(), RendezvousError> {
        Ok(())
    }

    /// The run id shared by every node of the job.
    fn run_id(&self) -> &str;

    /// Closes the rendezvous and releases resources; `Ok(false)` if it could not.
    async fn shutdown(&self) -> Result<bool, RendezvousError>;

    /// Whether this node hosts the rendezvous store itself (the first `c10d`
    /// node): it then keeps it up until the other nodes have seen how the run
    /// ended.
    fn hosts_store(&self) -> bool {
        false
    }

    /// Whether the workers' store is the rendezvous store itself, at the
    /// bootstrap address: torchrun's `static` backend, whose workers get
    /// `MASTER_ADDR`/`MASTER_PORT` equal to `--master-addr`/`--master-port`, so a
    /// job needs one open port. Otherwise the agent hosts a fresh job store per
    /// round on a free port.
    fn job_store_at_bootstrap(&self) -> bool {
        false
    }

    /// Whether workers connect to the store as clients only
    /// (`TORCHELASTIC_USE_AGENT_STORE=True`).
    fn use_agent_store(&self) -> bool {
        true
    }
}

/// How a round's membership changed since it formed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MembershipChange {
    /// Nodes waiting to join (or members coming back).
    pub waiting: usize,
    /// Members that stopped keeping alive without leaving.
    pub dead: usize,
    /// The node ids of those members, where the backend knows them.
    pub lost: Vec<String>,
}

/// What a backend is created from (torchrun's `--rdzv-*` flags).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RendezvousParameters {
    pub backend: String,
    /// `host[:port]` (or a path, for file-backed stores).
    pub endpoint: String,
    pub run_id: String,
    pub min_nodes: usize,
    pub max_nodes: usize,
    /// The address this node advertises (`--local-addr`).
    pub local_addr: Option<String>,
    /// Backend options (`--rdzv-conf k=v,...`).
    pub config: BTreeMap<String, String>,
}

/// A [`RendezvousError::Config`] naming the option.
/// What a backend's creator returns (the backend contract; the registry
/// holds creators by name, and the backends depend only on this module).
pub type Created = std::pin::Pin<
    Box<
        dyn std::future::Future<Output = Result<Box<dyn RendezvousHandler>, RendezvousError>>
            + Send,
    >,
>;
/// Makes a handler from parameters.
pub type Creator = fn(RendezvousParameters) -> Created;

pub(crate) fn config_error(option: &str, value: &str, expected: &str) -> RendezvousError {
    RendezvousError::Config {
        option: option.to_owned(),
        value: value.to_owned(),
        expected: expected.to_owned(),
    }
}

impl RendezvousParameters {
    /// Checks the node counts and names, as PyTorch does.
    pub fn new(
        backend: &str,
        endpoint: &str,
        run_id: &str,
        min_nodes: usize,
        max_nodes: usize,
    ) -> Result<Self, RendezvousError> {
        if backend.is_empty() {
            return Err(config_error("backend", backend, "a backend name"));
        }
        if run_id.is_empty() {
            return Err(config_error("run_id", run_id, "a non-empty run id"));
        }
        if min_nodes < 1 {
            return Err(config_error(
                "min_nodes",
                &min_nodes.to_string(),
                "at least 1",
            ));
        }
        if max_nodes < min_nodes {
            return Err(config_error(
                "max_nodes",
                &max_nodes.to_string(),
                &format!("at least min_nodes ({min_nodes})"),
            ));
        }
        Ok(RendezvousParameters {
            backend: backend.to_owned(),
            endpoint: endpoint.to_owned(),
            run_id: run_id.to_owned(),
            min_nodes,
            max_nodes,
            local_addr: None,
            config: BTreeMap::new(),
        })
    }

    /// Parses `--rdzv-conf`: `k1=v1,k2=v2`. Empty values are rejected, as torchrun does.
    pub fn parse_conf(conf: &str) -> Result<BTreeMap<String, String>, RendezvousError> {
        let mut map = BTreeMap::new();
        for pair in conf.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = pair
                .split_once('=')
                .ok_or_else(|| config_error(pair, "", "key=value"))?;
            let (k, v) = (k.trim(), v.trim());
            if k.is_empty() || v.is_empty() {
                return Err(config_error(k, v, "a non-empty key and value"));
            }
            map.insert(k.to_owned(), v.to_owned());
        }
        Ok(map)
    }

    /// The endpoint as host and optional port (`host`, `host:port`, `[v6]:port`).
    pub fn endpoint_host_port(&self) -> Result<(String, Option<u16>), RendezvousError> {
        crate::url::Url::parse(&format!("tcp://{}", self.endpoint))
            .and_then(|u| u.host_port())
            .map_err(|e| config_error("endpoint", &self.endpoint, &e))
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        self.config.get(key).map(String::as_str)
    }

    /// `1/true/t/yes/y` and `0/false/f/no/n` (any case); anything else is an error
    /// naming the option.
    pub fn get_as_bool(&self, key: &str) -> Result<Option<bool>, RendezvousError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        match v.to_ascii_lowercase().as_str() {
            "1" | "true" | "t" | "yes" | "y" => Ok(Some(true)),
            "0" | "false" | "f" | "no" | "n" => Ok(Some(false)),
            _ => Err(config_error(
                key,
                v,
                "a boolean (1/true/t/yes/y or 0/false/f/no/n)",
            )),
        }
    }

    pub fn get_as_int(&self, key: &str) -> Result<Option<i64>, RendezvousError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        v.trim()
            .parse()
            .map(Some)
            .map_err(|_| config_error(key, v, "an integer"))
    }

    /// `read_timeout`: how long a request to the rendezvous store may take
    /// before it fails ([`DEFAULT_READ_TIMEOUT`] when not given). The `c10d`
    /// and `etcd` backends set their store's timeout from it; `rally run`
    /// also takes it as how long the store may stay unreachable.
    pub fn read_timeout(&self) -> Result<Duration, RendezvousError> {
        self.get_as_secs("read_timeout", DEFAULT_READ_TIMEOUT)
    }

    /// A duration option given in seconds (integer or decimal), with a default.
    pub fn get_as_secs(&self, key: &str, default: Duration) -> Result<Duration, RendezvousError> {
        let Some(v) = self.get(key) else {
            return Ok(default);
        };
        match v.trim().parse::<f64>() {
            Ok(s) if s.is_finite() && s >= 0.0 => Ok(Duration::from_secs_f64(s)),
            _ => Err(config_error(key, v, "a non-negative number of seconds")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_validate_and_parse_options() {
        assert!(RendezvousParameters::new("c10d", "h:1", "job", 0, 1).is_err());
        let e = RendezvousParameters::new("c10d", "h:1", "job", 3, 2).unwrap_err();
        assert!(e.to_string().contains("max_nodes"), "{e}");
        let mut p = RendezvousParameters::new("c10d", "h:1", "job", 1, 2).unwrap();
        p.config = RendezvousParameters::parse_conf("is_host=Yes, timeout=30,ratio=x").unwrap();
        assert_eq!(p.get_as_bool("is_host").unwrap(), Some(true));
        assert_eq!(p.get_as_int("timeout").unwrap(), Some(30));
        assert_eq!(p.get_as_bool("missing").unwrap(), None);
        let e = p.get_as_int("ratio").unwrap_err();
        assert!(e.to_string().contains("\"ratio\""), "{e}");
        let e = p.get_as_bool("timeout").unwrap_err();
        assert!(e.to_string().contains("boolean"), "{e}");
        assert_eq!(
            p.get_as_secs("timeout", Duration::ZERO).unwrap(),
            Duration::from_secs(30)
        );
        assert!(RendezvousParameters::parse_conf("a=").is_err());
        assert!(RendezvousParameters::parse_conf("novalue").is_err());
    }
}
