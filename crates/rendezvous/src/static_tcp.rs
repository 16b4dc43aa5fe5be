//! The `static` backend: a fixed number of nodes (`max_nodes`), each told its rank
//! (`rank` option, torchrun's `--node-rank`), with a TCP store hosted by rank 0 at the
//! endpoint (`--master-addr:--master-port`), which is also the workers' store
//! (`MASTER_ADDR`/`MASTER_PORT`), as under torchrun. It never re-forms and nobody
//! waits: a restart returns the same store and ranks. Agents' keys live under
//! `PrefixStore(run_id)`, as in PyTorch, so one store can serve several runs.
//!
//! The agent watches it like any backend: the run store is the same prefixed
//! store, so a failure another node publishes stops this node's workers, and a
//! lost host shows as an unreachable store. Rank 0 hosts the store
//! ([`RendezvousHandler::hosts_store`]), so it keeps it up at the end until the
//! other nodes have finished, left or died.
//!
//! Unlike PyTorch's static handler, nodes keep alive as `c10d` members do (a
//! heartbeat counter per node, watched as [`crate::dynamic::Keepalive`] says:
//! `r0/hb/<rank>`, `r0/left/<rank>`, `r0/dead`, and the wake keys the agent
//! blocks on, [`crate::wake`]; `keep_alive_interval` and
//! `keep_alive_max_attempt` in `--rdzv-conf`), so a node that dies silently is
//! noticed. A static group cannot re-form without it
//! ([`RendezvousHandler::reforms`] is false): the agent fails the job at once
//! instead of waiting for a collective to time out, and rank 0 does not wait
//! for a dead node before it takes the store down.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use rallypoint_store::{PrefixStore, Store, TcpStore};
use rallypoint_sync::MutexExt;
use tokio::sync::OnceCell;
use tokio::task::JoinHandle;

use crate::api::Created;
use crate::api::{
    BootstrapStoreInfo, MembershipChange, RendezvousError, RendezvousHandler, RendezvousInfo,
    RendezvousParameters,
};
use crate::dynamic::{Beat, CounterKeepalive, Keepalive, Timing};

/// PyTorch's default store port (torchrun's `--master-port`, `MASTER_PORT`):
/// where `rally run` puts the static backend's store when no endpoint is given,
/// and where `rally store serve` listens by default.
pub const DEFAULT_PORT: u16 = 29500;

/// PyTorch's default timeout for the static backend when none is given.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

/// The static rendezvous of one run.
pub struct StaticTcpRendezvous {
    run_id: String,
    host: String,
    port: u16,
    rank: usize,
    world_size: usize,
    timeout: Duration,
    store: OnceCell<Arc<dyn Store>>,
    /// Rounds so far: every node restarts together, so counting locally agrees.
    rounds: std::sync::atomic::AtomicU64,
    /// The keep-alive period and misses (`keep_alive_interval`,
    /// `keep_alive_max_attempt`).
    timing: Timing,
    /// This node's keep-alive, from its first round until it is shut down.
    heartbeat: Mutex<Option<JoinHandle<()>>>,
    /// Cleared when it leaves: no more beats, the watching goes on.
    beating: Arc<std::sync::atomic::AtomicBool>,
    /// Left the run: counted out of the census, or tried to be (a count cut
    /// short is never retried).
    left: tokio::sync::Mutex<bool>,
    /// Its standing in the census (see `census`).
    standing: Arc<crate::census::Standing>,
    /// The heartbeats a lingering rank 0 looks at.
    pulse: tokio::sync::Mutex<crate::census::Pulse>,
    /// When the census last read 0 (see [`crate::census::Zero`]).
    zero: tokio::sync::Mutex<crate::census::Zero>,
    /// Whether this node's beats reach the store.
    health: crate::Health,
}

/// The keys of the keep-alive: one "round" for the whole run.
const ROUND: u64 = 0;

impl StaticTcpRendezvous {
    /// Checks the parameters: an endpoint with a port, and a rank below max_nodes.
    pub fn from_parameters(p: &RendezvousParameters) -> Result<Self, RendezvousError> {
        let bad = crate::api::config_error;
        let (host, port) = p.endpoint_host_port()?;
        let port = port.ok_or_else(|| {
            bad(
                "endpoint",
                &p.endpoint,
                "host:port (the static backend needs a port)",
            )
        })?;
        let rank = p
            .get_as_int("rank")?
            .ok_or_else(|| bad("rank", "", "this node's rank (--node-rank)"))?;
        if rank < 0 || rank as usize >= p.max_nodes {
            return Err(bad(
                "rank",
                &rank.to_string(),
                &format!("0..{}", p.max_nodes),
            ));
        }
        Ok(StaticTcpRendezvous {
            run_id: p.run_id.clone(),
            host,
            port,
            rank: rank as usize,
            world_size: p.max_nodes,
            timeout: p.get_as_secs("timeout", DEFAULT_TIMEOUT)?,
            store: OnceCell::new(),
            rounds: Default::default(),
            timing: Timing::from_params(p)?,
            heartbeat: Mutex::new(None),
            beating: Arc::new(std::sync::atomic::AtomicBool::new(true)),
            left: tokio::sync::Mutex::new(false),
            standing: crate::census::Standing::new(ROUND, rank as usize),
            pulse: Default::default(),
            zero: Default::default(),
            health: Default::default(),
        })
    }
}

/// The registry's creator.
pub fn create(p: RendezvousParameters) -> Created {
    Box::pin(async move {
        let h = StaticTcpRendezvous::from_parameters(&p)?;
        Ok(Box::new(h) as Box<dyn RendezvousHandler>)
    })
}

#[async_trait::async_trait]
impl RendezvousHandler for StaticTcpRendezvous {
    fn backend(&self) -> &str {
        "static"
    }

    async fn next_rendezvous(&self) -> Result<RendezvousInfo, RendezvousError> {
        let store = self
            .store
            .get_or_try_init(|| async {
                let tcp = TcpStore::builder(self.host.clone(), self.port)
                    .is_master(self.rank == 0)
                    .world_size(self.world_size)
                    .timeout(self.timeout)
                    .connect()
                    .await
                    .map_err(|source| match source {
                        rallypoint_store::StoreError::WorkersTimeout {
                            joined,
                            expected,
                            waited,
                        } => RendezvousError::Timeout {
                            run_id: self.run_id.clone(),
                            waited,
                            joined: vec![format!("{joined} node(s)")],
                            expected: format!("{expected} nodes"),
                            lost: Vec::new(),
                        },
                        rallypoint_store::StoreError::Listen { source, .. } if self.rank == 0 => {
                            RendezvousError::Config {
                                option: "endpoint".into(),
                                value: format!("{}:{}", self.host, self.port),
                                expected: format!(
                                    "a port free on this node, where rank 0 hosts the job's store (--master-port): {source}"
                                ),
                            }
                        }
                        source => RendezvousError::Connection {
                            run_id: self.run_id.clone(),
                            source: Box::new(source),
                        },
                    })?;
                let prefixed: Arc<dyn Store> =
                    Arc::new(PrefixStore::new(self.run_id.clone(), Arc::new(tcp)));
                crate::census::joined(&*prefixed)
                    .await
                    .map_err(|e| self.connection(e))?;
                *self.heartbeat.locked() =
                    Some(self.keep_alive(prefixed.clone()));
                Ok::<_, RendezvousError>(prefixed)
            })
            .await?;
        let round = self
            .rounds
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(RendezvousInfo {
            round,
            run_store: store.clone(),
            store: store.clone(),
            rank: self.rank,
            world_size: self.world_size,
            bootstrap: BootstrapStoreInfo {
                master_addr: self.host.clone(),
                master_port: self.port,
            },
        })
    }

    async fn is_closed(&self) -> Result<bool, RendezvousError> {
        Ok(false)
    }

    async fn set_closed(&self) -> Result<(), RendezvousError> {
        Ok(())
    }

    async fn num_nodes_waiting(&self) -> Result<usize, RendezvousError> {
        Ok(0)
    }

    /// Blocks on the wake key ([`crate::wake`]) that a watcher finding a dead
    /// node sets.
    async fn changed(&self, seen: u64, poll: Duration) -> Result<u64, RendezvousError> {
        let Some(store) = self.store.get() else {
            tokio::time::sleep(poll).await;
            return Ok(seen);
        };
        crate::wake::wait(&**store, &format!("r{ROUND}"), seen, &self.health)
            .await
            .map_err(|reason| RendezvousError::Unreachable {
                run_id: self.run_id.clone(),
                reason,
            })
    }

    /// Nobody ever waits; dead nodes are counted by the keep-alive watchers.
    async fn membership(&self) -> Result<MembershipChange, RendezvousError> {
        let Some(store) = self.store.get() else {
            return Ok(MembershipChange::default());
        };
        let dead = store
            .add(&format!("r{ROUND}/dead"), 0)
            .await
            .map_err(|e| self.connection(e))?;
        Ok(MembershipChange {
            waiting: 0,
            dead: dead.max(0) as usize,
            lost: Vec::new(),
        })
    }

    fn detects_dead_members(&self) -> bool {
        true
    }

    fn reforms(&self) -> bool {
        false
    }

    fn endpoint(&self) -> Option<String> {
        Some(format!("{}:{}", self.host, self.port))
    }

    /// Stops beating and says so, so the node watching this one does not count
    /// it dead. Once counted out (or tried to be), later calls do nothing;
    /// a call cut short before is retried.
    async fn leave(&self) -> Result<(), RendezvousError> {
        let mut left = self.left.lock().await;
        let Some(store) = self.store.get() else {
            return Ok(());
        };
        if *left {
            return Ok(());
        }
        // Said before the beats stop, so the watcher never sees them stop
        // without the reason; the watching goes on (a lingering rank 0 still
        // notices the last nodes die). Counted in (again, if a watcher found
        // it dead while it was partitioned), then out, once.
        store
            .set(&format!("r{ROUND}/left/{}", self.rank), b"1")
            .await
            .map_err(|e| self.connection(e))?;
        self.beating
            .store(false, std::sync::atomic::Ordering::Release);
        self.standing
            .reconcile(&**store)
            .await
            .map_err(|e| self.connection(e))?;
        // Never retried: a lost count keeps rank 0 waiting, a double one
        // could take its store from under a running node.
        *left = true;
        crate::census::gone(&**store)
            .await
            .map_err(|e| self.connection(e))?;
        Ok(())
    }

    async fn remaining(&self) -> Result<usize, RendezvousError> {
        let Some(store) = self.store.get() else {
            return Ok(0);
        };
        let counted_in = !*self.left.lock().await;
        // A 0 is held from an answered read on (see `census::Zero`).
        let count = match crate::census::remaining(&**store, counted_in).await {
            Ok(c) => c,
            Err(e) => {
                *self.zero.lock().await = Default::default();
                return Err(self.connection(e));
            }
        };
        let n = self.zero.lock().await.hold(count, self.timing.keep_alive);
        if n == 0 {
            return Ok(0);
        }
        // Nobody else beating for an expiry: the rest vanished unwatched.
        let keys: Vec<String> = (0..self.world_size)
            .filter(|&r| r != self.rank)
            .map(|r| format!("r{ROUND}/hb/{r}"))
            .collect();
        let t = self.timing;
        let beating = self
            .pulse
            .lock()
            .await
            .beating(
                &**store,
                &keys,
                t.keep_alive / 2,
                t.keep_alive * (t.max_misses + 1),
            )
            .await
            .map_err(|e| self.connection(e))?;
        Ok(if beating { n } else { 0 })
    }

    fn run_id(&self) -> &str {
        &self.run_id
    }

    async fn shutdown(&self) -> Result<bool, RendezvousError> {
        self.stop_heartbeat();
        Ok(true)
    }

    fn job_store_at_bootstrap(&self) -> bool {
        true
    }

    fn hosts_store(&self) -> bool {
        self.rank == 0
    }
}

/// Set by rank 0 once every node connected (its store waits for them all).
const ALL_IN: &str = "r0/all_in";

/// Aborts the task when dropped (with the task that owns it).
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl StaticTcpRendezvous {
    /// The keep-alive, from the moment every node is in: a client's connect
    /// returns before the others have come (only rank 0 waits for them), and
    /// a node that has not come yet must not be watched as one that died.
    fn keep_alive(&self, store: Arc<dyn Store>) -> JoinHandle<()> {
        let beat = Beat {
            store: store.clone(),
            namespace: format!("{}/", self.run_id),
            round: ROUND,
            rank: self.rank,
            members: self.world_size,
            timing: self.timing,
            beating: self.beating.clone(),
            health: self.health.clone(),
            standing: self.standing.clone(),
        };
        let host = self.rank == 0;
        tokio::spawn(async move {
            // Every counter exists before anyone watches it.
            let beats: Vec<String> = (0..beat.members)
                .map(|r| format!("r{ROUND}/hb/{r}"))
                .collect();
            let zeros: Vec<(&str, &[u8])> = beats.iter().map(|k| (k.as_str(), &b"0"[..])).collect();
            if host
                && (store.multi_set(&zeros).await.is_err()
                    || store.set(ALL_IN, b"1").await.is_err())
            {
                return;
            }
            // The store's timeout bounds the wait; a node that never comes
            // fails the start (rank assignment), not the keep-alive.
            if store.wait(&[ALL_IN]).await.is_err() {
                return;
            }
            let mut beating = AbortOnDrop(CounterKeepalive.spawn(beat));
            let _ = (&mut beating.0).await;
        })
    }

    fn connection(&self, source: rallypoint_store::StoreError) -> RendezvousError {
        RendezvousError::Connection {
            run_id: self.run_id.clone(),
            source: Box::new(source),
        }
    }

    fn stop_heartbeat(&self) {
        if let Some(h) = self.heartbeat.locked().take() {
            h.abort();
        }
    }
}

impl Drop for StaticTcpRendezvous {
    fn drop(&mut self) {
        self.stop_heartbeat();
    }
}
