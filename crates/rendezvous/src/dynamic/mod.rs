//! The dynamic (`c10d`) backend over any rallypoint store: between `min_nodes` and
//! `max_nodes` nodes, joining and leaving between rounds.
//!
//! # Protocol
//!
//! Keys live under `rally.rendezvous.<run_id>/` (round `r` as `r<r>/`):
//!
//! | key | written by | meaning |
//! |---|---|---|
//! | `round` | members moving on | the newest round (a hint for newcomers) |
//! | `r/join` | every arrival, `ADD 1` | its arrival index `i` (1-based) |
//! | `r/node/<i>` | arrival `i` | its node id |
//! | `r/min` | the `min`-th arrival | the last call has begun |
//! | `r/complete` | the `max`-th arrival, or whoever's last call ends first (`compare_set`) | the member count `K`: arrivals `1..=K` |
//! | `r/rank/<i>`, `r/assigned` | arrival 1, for all members | rank of each member; `assigned` is `abandoned` when the members gave the round up |
//! | `r/waiting`, `r/dead` | late arrivals and members coming back; heartbeat watchers | the group should re-form |
//! | `r/dead/<rank>` | the first watcher to find member `rank` dead | marks each death once |
//! | `r/census/<rank>` | the first of: a watcher finding member `rank` dead (counts it out of the run), the member itself back from a partition, re-joining or leaving (see `census`) | one owner of the member's count-out per round |
//! | `r/wakes`, `r/wake/<n>` | whoever counts `waiting` or `dead` | wakes the members ([`crate::wake`]) |
//! | `r/hb/<rank>` | arrival 1 (at 0), then each member, every keep-alive interval | its heartbeat counter |
//! | `r/left/<rank>` | a member ending for good | it stopped keeping alive on purpose: not dead |
//! | `r/reform` | the first member to re-join | round `r+1` may form |
//! | `ranks` | arrival 1 | `node=rank` lines of the last round, so nodes keep their ranks, and `node=` for the run's other nodes counted in the census |
//! | `closed` | `set_closed` | the run is over |
//! | `r/master` | rank 0, when workers host the job's store (etcd) | its `addr:port` |
//!
//! A node costs O(1) store operations per round, and every wait is a store `WAIT`
//! (woken by the store, never sleep-and-poll); only arrival 1 reads the K node ids
//! (one `multi_get`) and writes the K ranks (one `multi_set`), so a round moves O(K)
//! bytes in all, not O(K²). Each member heartbeats once per interval; the first
//! ranks watch everyone and the others their successor ([`keepalive`]). A dead
//! member marks the round changed (and counts in `r/dead`), which wakes every
//! member blocked in [`RendezvousHandler::changed`], so survivors re-form without
//! waiting for a collective to time out, and nobody polls: a member in the
//! running phase costs one store operation per keep-alive interval. A member
//! that ends on purpose says so (`r/left/<rank>`, [`RendezvousHandler::leave`]);
//! its watchers then skip it, so a finished node is never counted dead. A join can stop at any step (a
//! signal, a crash): a completed round whose ranks are not assigned within
//! `keep_alive_interval * keep_alive_max_attempt` (a member took an arrival index
//! and never published its id, or arrival 1 never assigned) is abandoned by its
//! members, who re-form in the next round without the phantom; a member that
//! stopped after the round formed is caught by the heartbeats. A node waiting for
//! the group to grow gives up at `join_timeout`, as PyTorch's does (a spare, for
//! which the group is full, waits as long as the run lasts). The decisions are made without
//! I/O in [`state`]: a node's join is the state machine [`state::Join`], and
//! `join` below only performs the store operation each [`state::Step`] asks for
//! and reports what happened; the keep-alive is pluggable ([`Keepalive`]: counters
//! here, etcd leases in the etcd backend).
//!
//! Where PyTorch's c10d backend differs: its state is one pickled blob rewritten by
//! compare-and-set and polled every second (O(N) bytes per node per poll, O(N²)
//! per round); ranks follow string order (`node10` before `node2`) and are not
//! kept across rounds; a silent participant of a completed round is not noticed.

mod c10d;
mod keepalive;
pub mod state;
mod timing;

pub use c10d::{advertised_addr, create, default_node_id};
pub use keepalive::{Beat, CounterKeepalive, Keepalive, RING_INTERVALS, WATCHERS};
pub use timing::Timing;

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use rallypoint_store::{PrefixStore, Store, StoreError};
use tokio::sync::Mutex;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::api::{
    BootstrapStoreInfo, MembershipChange, RendezvousError, RendezvousHandler, RendezvousInfo,
    RendezvousParameters,
};
use state::{Bounds, Event, Join, JoinFailure, Step};

/// The value of `r/assigned` for a round given up before its ranks were assigned.
const ABANDONED: &[u8] = b"abandoned";

/// Default port of the c10d rendezvous store.
pub const DEFAULT_PORT: u16 = 29400;

impl Node {
    /// Reconciles the standings not reconciled yet; keeps those the store
    /// did not take, and returns the first error.
    async fn settle(&mut self, store: &dyn Store) -> Result<(), StoreError> {
        let mut first = Ok(());
        let mut left = Vec::new();
        for st in self.unsettled.drain(..) {
            if let Err(e) = st.reconcile(store).await {
                left.push(st);
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        self.unsettled = left;
        first
    }
}

/// This node's place in its latest round.
#[derive(Default)]
struct Node {
    /// The round it was a member of, with its rank and the member count.
    member_of: Option<(u64, usize, usize)>,
    heartbeat: Option<JoinHandle<()>>,
    /// Cleared to stop the heartbeat's beats (the watching goes on).
    beating: Option<Arc<std::sync::atomic::AtomicBool>>,
    /// Counted in the run's census (at its first round), and out (it left).
    counted_in: bool,
    left: bool,
    /// Counted gone, or tried to be: a count cut short is never retried (a
    /// lost count keeps a host waiting; a double one could take its store
    /// from under a running node).
    counted_out: bool,
    /// Its standing in the census in its latest round (see `census`), and
    /// those of earlier rounds not reconciled yet (the store did not answer).
    standing: Option<Arc<crate::census::Standing>>,
    unsettled: Vec<Arc<crate::census::Standing>>,
    /// The heartbeats a lingering host looks at (see [`crate::census::Pulse`]).
    pulse: crate::census::Pulse,
    /// When the census last read 0 (see [`crate::census::Zero`]).
    zero: crate::census::Zero,
    /// Whether this node's beats in its round reach the store.
    health: crate::Health,
}

/// A dynamic rendezvous of one run, for one node.
pub struct DynamicRendezvous {
    run_id: String,
    node_id: String,
    base: Arc<dyn Store>,
    store: Arc<dyn Store>,
    bounds: Bounds,
    timing: Timing,
    bootstrap: Bootstrap,
    backend: &'static str,
    keepalive: Arc<dyn Keepalive>,
    node: Mutex<Node>,
    /// This node serves the rendezvous store (the first `c10d` node).
    hosts_store: bool,
    /// Where the rendezvous store is, for errors.
    endpoint: Option<String>,
    /// The store is served at `endpoint` by another node of the job (or a
    /// `rally store serve`), whose end a refused connection shows.
    served_by_peer: bool,
}

/// How workers reach the job's store.
#[derive(Debug, Clone)]
enum Bootstrap {
    /// Workers join the agents' store at this address as clients.
    Agent(BootstrapStoreInfo),
    /// The rendezvous store is not one workers can speak to (etcd): the node with
    /// rank 0 picks a free port at this address and its worker 0 hosts the job's
    /// store there (`TORCHELASTIC_USE_AGENT_STORE=False`).
    Worker { advertise: String },
}

fn conn(run_id: &str) -> impl Fn(StoreError) -> RendezvousError + '_ {
    move |source| RendezvousError::Connection {
        run_id: run_id.to_owned(),
        source: Box::new(source),
    }
}

/// Counts one more reason to re-form round `r` (`waiting` or `dead`) and wakes
/// its members ([`crate::wake`]).
async fn mark_changed(store: &dyn Store, r: &str, counter: &str) -> Result<(), StoreError> {
    store.add(&format!("{r}/{counter}"), 1).await?;
    crate::wake::wake(store, r).await
}

impl DynamicRendezvous {
    /// A rendezvous over `store` (shared by every node of the run).
    pub fn new(
        store: Arc<dyn Store>,
        run_id: &str,
        node_id: String,
        bounds: Bounds,
        timing: Timing,
        bootstrap: BootstrapStoreInfo,
    ) -> Self {
        let own: Arc<dyn Store> = Arc::new(PrefixStore::new(
            format!("rally.rendezvous.{run_id}"),
            store.clone(),
        ));
        DynamicRendezvous {
            run_id: run_id.to_owned(),
            node_id,
            base: store,
            store: own,
            bounds,
            timing,
            bootstrap: Bootstrap::Agent(bootstrap),
            backend: "c10d",
            keepalive: Arc::new(CounterKeepalive),
            node: Mutex::new(Node::default()),
            hosts_store: false,
            endpoint: None,
            served_by_peer: false,
        }
    }

    /// The store at the endpoint is served by another node of the job (a
    /// `c10d` client): see [`RendezvousHandler::store_host_ended`].
    pub fn served_by_peer(mut self) -> Self {
        self.served_by_peer = true;
        self
    }

    /// Names where the rendezvous store is (for errors).
    pub fn with_endpoint(mut self, endpoint: String) -> Self {
        self.endpoint = Some(endpoint);
        self
    }

    /// Reports `name` as the backend (for backends built on this one).
    pub fn with_backend_name(mut self, name: &'static str) -> Self {
        self.backend = name;
        self
    }

    /// This node serves the rendezvous store: when it goes, the store goes.
    pub fn hosting_store(mut self) -> Self {
        self.hosts_store = true;
        self
    }

    /// Keeps members alive with `keepalive` instead of heartbeat counters.
    pub fn with_keepalive(mut self, keepalive: Arc<dyn Keepalive>) -> Self {
        self.keepalive = keepalive;
        self
    }

    /// Workers cannot use the rendezvous store: rank 0's worker hosts the job's
    /// store on a free port at `advertise`, which every node learns from the round.
    pub fn with_worker_hosted_store(mut self, advertise: String) -> Self {
        self.bootstrap = Bootstrap::Worker { advertise };
        self
    }

    /// A rendezvous for the node described by `p` over a store workers cannot use
    /// (a file, etcd): rank 0's worker hosts the job's store.
    pub fn worker_hosted(store: Arc<dyn Store>, p: &RendezvousParameters, timing: Timing) -> Self {
        let addr = advertised_addr(p);
        DynamicRendezvous::new(
            store,
            &p.run_id,
            default_node_id(&addr),
            Bounds {
                min: p.min_nodes,
                max: p.max_nodes,
            },
            timing,
            BootstrapStoreInfo {
                master_addr: addr.clone(),
                master_port: 0,
            },
        )
        .with_worker_hosted_store(addr)
    }

    /// Where workers of `round` reach the job's store.
    async fn bootstrap_for(
        &self,
        round: u64,
        rank: usize,
        deadline: Instant,
    ) -> Result<BootstrapStoreInfo, RendezvousError> {
        let advertise = match &self.bootstrap {
            Bootstrap::Agent(info) => return Ok(info.clone()),
            Bootstrap::Worker { advertise } => advertise,
        };
        let key = format!("r{round}/master");
        if rank == 0 {
            let port = std::net::TcpListener::bind(("0.0.0.0", 0))
                .and_then(|l| l.local_addr())
                .map_err(|e| RendezvousError::State {
                    run_id: self.run_id.clone(),
                    reason: format!("no free port for the job's store: {e}"),
                })?
                .port();
            let value = format!("{advertise}:{port}");
            self.store
                .set(&key, value.as_bytes())
                .await
                .map_err(self.err())?;
            return Ok(BootstrapStoreInfo {
                master_addr: advertise.clone(),
                master_port: port,
            });
        }
        if !self.wait_key(&key, Some(deadline)).await? {
            return Err(RendezvousError::State {
                run_id: self.run_id.clone(),
                reason: format!("rank 0 of round {round} never published the job's store address"),
            });
        }
        let v = self.store.get_now(&key).await.map_err(self.err())?;
        let v = String::from_utf8_lossy(&v);
        v.rsplit_once(':')
            .and_then(|(h, p)| Some((h.to_owned(), p.parse().ok()?)))
            .map(|(master_addr, master_port)| BootstrapStoreInfo {
                master_addr,
                master_port,
            })
            .ok_or_else(|| RendezvousError::State {
                run_id: self.run_id.clone(),
                reason: format!("round {round} published an invalid store address {v:?}"),
            })
    }

    /// This node's id.
    pub fn node_id(&self) -> &str {
        &self.node_id
    }

    fn err(&self) -> impl Fn(StoreError) -> RendezvousError + '_ {
        conn(&self.run_id)
    }

    /// The error a join ends with when the run is closed: a spare was never
    /// needed, which is not a failure.
    fn closed_error(&self, spare: bool) -> RendezvousError {
        let run_id = self.run_id.clone();
        match spare {
            true => RendezvousError::GracefulExit { run_id },
            false => RendezvousError::Closed { run_id },
        }
    }

    async fn closed(&self) -> Result<bool, RendezvousError> {
        self.store.check(&["closed"]).await.map_err(self.err())
    }

    /// Waits for `key` until `deadline` (`None`: no limit); false on timeout.
    async fn wait_key(
        &self,
        key: &str,
        deadline: Option<Instant>,
    ) -> Result<bool, RendezvousError> {
        let left = match deadline {
            Some(d) => d.saturating_duration_since(Instant::now()),
            None => Duration::from_secs(365 * 24 * 3600),
        };
        match self.store.wait_timeout(&[key], left).await {
            Ok(()) => Ok(true),
            Err(e) if e.is_timeout() => Ok(false),
            Err(e) => Err(self.err()(e)),
        }
    }

    /// How many nodes arrived in round `round`, and the ids of the first 16.
    async fn arrivals(&self, round: u64) -> (usize, Vec<String>) {
        let arrived = self
            .store
            .add(&format!("r{round}/join"), 0)
            .await
            .unwrap_or(0)
            .max(0) as usize;
        let mut ids = Vec::new();
        for i in 1..=arrived.min(16) {
            if let Ok(v) = self.store.get_now(&format!("r{round}/node/{i}")).await {
                ids.push(String::from_utf8_lossy(&v).into_owned());
            }
        }
        (arrived, ids)
    }

    /// The node ids of `round`'s members marked dead (`r/dead/<rank>`), read
    /// only once some are (to say who, as the group re-forms): at most 16,
    /// then how many more. A read that fails leaves a member out.
    async fn dead_members(&self, round: u64, members: usize) -> Vec<String> {
        let mut lost = Vec::new();
        for i in 1..=members {
            let r = format!("r{round}");
            let (Ok(rank), Ok(node)) = (
                self.store.get_now(&format!("{r}/rank/{i}")).await,
                self.store.get_now(&format!("{r}/node/{i}")).await,
            ) else {
                continue;
            };
            let rank = String::from_utf8_lossy(&rank).into_owned();
            let marked = self.store.add(&format!("{r}/dead/{rank}"), 0).await;
            if marked.is_ok_and(|n| n > 0) {
                lost.push(String::from_utf8_lossy(&node).into_owned());
            }
        }
        if lost.len() > 16 {
            let more = lost.len() - 16;
            lost.truncate(16);
            lost.push(format!("and {more} more"));
        }
        lost
    }

    async fn timeout_error(&self, round: u64, started: Instant) -> RendezvousError {
        let (arrived, mut joined) = self.arrivals(round).await;
        // The last round's nodes that did not come back: the ones this
        // round waited for in vain (a host lost, say).
        let lost = match round.checked_sub(1) {
            Some(last) => self.arrivals(last).await.1,
            None => Vec::new(),
        }
        .into_iter()
        .filter(|id| !joined.contains(id))
        .collect();
        if arrived > 16 {
            joined.push(format!("and {} more", arrived - 16));
        }
        RendezvousError::Timeout {
            run_id: self.run_id.clone(),
            waited: started.elapsed(),
            joined,
            expected: format!("{}..={} nodes", self.bounds.min, self.bounds.max),
            lost,
        }
    }

    /// How long a completed round may take to get its ranks before its members
    /// give it up: a member that stopped between its steps (after taking an
    /// arrival index, before publishing its id; or arrival 1, before assigning)
    /// would otherwise make the others wait for a phantom until the join deadline.
    fn assign_grace(&self) -> Duration {
        self.timing.keep_alive * self.timing.max_misses
    }

    /// Gives up round `round`: its ranks are never assigned (first writer wins
    /// `assigned`), waiting nodes are released, and the next round is opened.
    /// `None` if the round was assigned after all.
    async fn abandon(&self, round: u64) -> Result<Option<()>, RendezvousError> {
        let r = format!("r{round}");
        let v = self
            .store
            .compare_set(&format!("{r}/assigned"), b"", ABANDONED)
            .await
            .map_err(self.err())?;
        if v != ABANDONED {
            return Ok(None);
        }
        tracing::warn!(
            round,
            "a member of the round stopped before it got its ranks; re-forming without it"
        );
        self.store
            .set(&format!("{r}/reform"), b"1")
            .await
            .map_err(self.err())?;
        let _ = self
            .store
            .compare_set(
                "round",
                round.to_string().as_bytes(),
                (round + 1).to_string().as_bytes(),
            )
            .await;
        Ok(Some(()))
    }

    /// Member of `round` with arrival `index` of `members`: learns its rank, or
    /// `None` if the round was abandoned (see [`Self::assign_grace`]).
    async fn rank_in(
        &self,
        round: u64,
        index: usize,
        members: usize,
        deadline: Instant,
    ) -> Result<Option<usize>, RendezvousError> {
        let r = format!("r{round}");
        let grace = (Instant::now() + self.assign_grace()).min(deadline);
        if index == 1 {
            let keys: Vec<String> = (1..=members).map(|i| format!("{r}/node/{i}")).collect();
            let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            // Every member publishes its id right after arriving; one that has
            // not within the grace stopped: abandon the round.
            match self
                .store
                .wait_timeout(&refs, grace.saturating_duration_since(Instant::now()))
                .await
            {
                Ok(()) => {}
                Err(e) if e.is_timeout() => {
                    if self.abandon(round).await?.is_some() {
                        return Ok(None);
                    }
                }
                Err(e) => return Err(self.err()(e)),
            }
            let nodes: Vec<String> = self
                .store
                .multi_get(&refs)
                .await
                .map_err(self.err())?
                .into_iter()
                .map(|v| String::from_utf8_lossy(&v).into_owned())
                .collect();
            // The run's nodes: one key read and written once per round by
            // arrival 1 alone, `node=rank` for the last round's members and
            // `node=` for nodes counted in before. It keeps ranks across
            // rounds, and arrival 1 counts the members it does not list into
            // the census (crate::census), first, so a crash before the write
            // can only count a node twice.
            let table = self.store.get_now("ranks").await.map_err(self.err())?;
            let table = String::from_utf8_lossy(&table);
            let known: Vec<(&str, Option<usize>)> = table
                .lines()
                .filter_map(|l| {
                    let (n, r) = l.rsplit_once('=')?;
                    Some((n, r.parse().ok()))
                })
                .collect();
            let previous: HashMap<String, usize> = known
                .iter()
                .filter_map(|&(n, r)| Some((n.to_owned(), r?)))
                .collect();
            let ranks = state::assign_ranks(&nodes, &previous);
            let listed: std::collections::HashSet<&str> = known.iter().map(|k| k.0).collect();
            let new = nodes
                .iter()
                .filter(|n| !listed.contains(n.as_str()))
                .count();
            crate::census::joined_many(&*self.store, new)
                .await
                .map_err(self.err())?;
            let rank_keys: Vec<String> = (1..=members).map(|i| format!("{r}/rank/{i}")).collect();
            let values: Vec<String> = ranks.iter().map(usize::to_string).collect();
            let mut table_out = String::new();
            for (n, v) in nodes.iter().zip(&values) {
                table_out.push_str(n);
                table_out.push('=');
                table_out.push_str(v);
                table_out.push('\n');
            }
            let members_now: std::collections::HashSet<&str> =
                nodes.iter().map(String::as_str).collect();
            for (n, _) in known.iter().filter(|k| !members_now.contains(k.0)) {
                table_out.push_str(n);
                table_out.push_str("=\n");
            }
            let table = table_out;
            let mut pairs: Vec<(&str, &[u8])> = rank_keys
                .iter()
                .zip(&values)
                .map(|(k, v)| (k.as_str(), v.as_bytes()))
                .collect();
            pairs.push(("ranks", table.as_bytes()));
            // Every heartbeat counter exists before anyone watches it, so a
            // member that never beats is seen to stop like any other.
            let beats: Vec<String> = (0..members).map(|m| format!("{r}/hb/{m}")).collect();
            pairs.extend(beats.iter().map(|k| (k.as_str(), &b"0"[..])));
            self.store.multi_set(&pairs).await.map_err(self.err())?;
            let won = self
                .store
                .compare_set(&format!("{r}/assigned"), b"", b"1")
                .await
                .map_err(self.err())?;
            // Others may have given the round up while we assigned.
            return Ok((won != ABANDONED).then_some(ranks[0]));
        }
        // Arrival 1 assigns; twice the grace, so its own give-up comes first.
        let key = format!("{r}/assigned");
        let until = (Instant::now() + 2 * self.assign_grace()).min(deadline);
        if !self.wait_key(&key, Some(until)).await? && self.abandon(round).await?.is_some() {
            return Ok(None);
        }
        if self.store.get_now(&key).await.map_err(self.err())? == ABANDONED {
            return Ok(None);
        }
        self.read_number(
            &format!("{r}/rank/{index}"),
            &format!("rank of arrival {index} in round {round}"),
        )
        .await
        .map(Some)
    }

    /// A decimal number the protocol stored at `key`; a State error naming `what`
    /// otherwise.
    async fn read_number(&self, key: &str, what: &str) -> Result<usize, RendezvousError> {
        let v = self.store.get_now(key).await.map_err(self.err())?;
        String::from_utf8_lossy(&v)
            .parse()
            .map_err(|_| RendezvousError::State {
                run_id: self.run_id.clone(),
                reason: format!("{what} is {v:?}"),
            })
    }

    async fn join(&self) -> Result<RendezvousInfo, RendezvousError> {
        let started = Instant::now();
        let mut node = self.node.lock().await;
        // Leaving the last round for the next: said first, so a member still
        // in it (slow to stop its workers) does not count this node dead.
        if let (Some((round, rank, _)), Some(_)) = (node.member_of, &node.heartbeat) {
            let _ = self.store.set(&format!("r{round}/left/{rank}"), b"1").await;
        }
        if let Some(h) = node.heartbeat.take() {
            h.abort();
        }
        // Members of a round move to the next and let late arrivals follow.
        let pointer = {
            let v = self
                .store
                .compare_set("round", b"", b"0")
                .await
                .map_err(self.err())?;
            String::from_utf8_lossy(&v).parse::<u64>().unwrap_or(0)
        };
        let round = match node.member_of.take() {
            Some((r, _, _)) => {
                // The other members see a member coming back as a node waiting
                // (PyTorch's wait list) and re-form too.
                mark_changed(&*self.store, &format!("r{r}"), "waiting")
                    .await
                    .map_err(self.err())?;
                self.store
                    .set(&format!("r{r}/reform"), b"1")
                    .await
                    .map_err(self.err())?;
                let next = (r + 1).max(pointer);
                let _ = self
                    .store
                    .compare_set(
                        "round",
                        r.to_string().as_bytes(),
                        next.to_string().as_bytes(),
                    )
                    .await;
                next
            }
            None => pointer,
        };
        // The decisions are the state machine's; this loop does the store I/O
        // each step asks for and reports back what happened.
        let (mut machine, mut step) = Join::start(
            self.bounds,
            self.timing.join,
            self.timing.last_call,
            round,
            started.into_std(),
        );
        loop {
            let r = format!("r{}", machine.round());
            let event = match step {
                Step::Arrive { round } => {
                    if self.closed().await? {
                        Event::Closed
                    } else {
                        let index = self
                            .store
                            .add(&format!("r{round}/join"), 1)
                            .await
                            .map_err(self.err())? as usize;
                        self.store
                            .set(&format!("r{round}/node/{index}"), self.node_id.as_bytes())
                            .await
                            .map_err(self.err())?;
                        Event::Arrived { index }
                    }
                }
                Step::Announce {
                    marks_min,
                    completes_with,
                } => {
                    if marks_min {
                        self.store
                            .set(&format!("{r}/min"), b"1")
                            .await
                            .map_err(self.err())?;
                    }
                    if let Some(k) = completes_with {
                        self.store
                            .compare_set(&format!("{r}/complete"), b"", k.to_string().as_bytes())
                            .await
                            .map_err(self.err())?;
                    }
                    Event::Announced
                }
                Step::WaitMin { until } => match self
                    .wait_key(&format!("{r}/min"), until.map(Instant::from_std))
                    .await?
                {
                    true => Event::MinReached,
                    false => Event::TimedOut,
                },
                Step::WaitComplete { until } => {
                    let until = Some(Instant::from_std(until));
                    match self.wait_key(&format!("{r}/complete"), until).await? {
                        true => Event::Completed {
                            members: self.members(&r).await?,
                        },
                        false => Event::LastCallEnded {
                            arrivals: self
                                .store
                                .add(&format!("{r}/join"), 0)
                                .await
                                .map_err(self.err())?
                                .max(0) as usize,
                        },
                    }
                }
                Step::Complete { members } => {
                    self.store
                        .compare_set(
                            &format!("{r}/complete"),
                            b"",
                            members.to_string().as_bytes(),
                        )
                        .await
                        .map_err(self.err())?;
                    Event::Completed {
                        members: self.members(&r).await?,
                    }
                }
                Step::CountWaiting => {
                    mark_changed(&*self.store, &r, "waiting")
                        .await
                        .map_err(self.err())?;
                    Event::Counted
                }
                Step::WaitReform { until } => match self
                    .wait_key(&format!("{r}/reform"), until.map(Instant::from_std))
                    .await?
                {
                    true => Event::Reformed,
                    false => Event::TimedOut,
                },
                Step::Fail(JoinFailure::Timeout { round }) => {
                    return Err(self.timeout_error(round, started).await)
                }
                Step::Fail(JoinFailure::Closed) => return Err(self.closed_error(false)),
                Step::Fail(JoinFailure::GracefulExit) => return Err(self.closed_error(true)),
                Step::Member {
                    round,
                    index,
                    members,
                } => {
                    let deadline = machine
                        .deadline()
                        .map_or(started + self.timing.join, Instant::from_std);
                    let Some(rank) = self.rank_in(round, index, members, deadline).await? else {
                        step = machine.on(Event::Abandoned, std::time::Instant::now());
                        continue;
                    };
                    let bootstrap = self.bootstrap_for(round, rank, deadline).await?;
                    // Arrival 1 counted every member in (crate::census),
                    // once per run; a node found dead in an earlier round
                    // (partitioned for an expiry) counts itself in again.
                    // Not a reason to fail the join: one the store did not
                    // take now is taken up at the next join or the leave.
                    let old = node.standing.take();
                    node.unsettled.extend(old);
                    if let Err(e) = node.settle(&*self.store).await {
                        tracing::warn!(error = %e, "could not reconcile this node's census standing; will at its leave");
                    }
                    let standing = crate::census::Standing::new(round, rank);
                    node.standing = Some(standing.clone());
                    node.counted_in = true;
                    node.member_of = Some((round, rank, members));
                    let beating = Arc::new(std::sync::atomic::AtomicBool::new(true));
                    node.beating = Some(beating.clone());
                    node.health = crate::Health::default();
                    node.heartbeat = Some(self.keepalive.spawn(Beat {
                        store: self.store.clone(),
                        namespace: format!("rally.rendezvous.{}/", self.run_id),
                        round,
                        rank,
                        members,
                        timing: self.timing,
                        beating,
                        health: node.health.clone(),
                        standing,
                    }));
                    let job: Arc<dyn Store> = Arc::new(PrefixStore::new(
                        format!("torch.rendezvous.{}.{round}", self.run_id),
                        self.base.clone(),
                    ));
                    return Ok(RendezvousInfo {
                        round,
                        run_store: self.run_store_of_run(),
                        store: job,
                        rank,
                        world_size: members,
                        bootstrap,
                    });
                }
            };
            step = machine.on(event, std::time::Instant::now());
        }
    }

    /// The store every node of the run shares across rounds.
    fn run_store_of_run(&self) -> Arc<dyn Store> {
        Arc::new(PrefixStore::new(
            format!("rally.run.{}", self.run_id),
            self.base.clone(),
        ))
    }

    /// The member count round `r` completed with.
    async fn members(&self, r: &str) -> Result<usize, RendezvousError> {
        self.read_number(
            &format!("{r}/complete"),
            &format!("the member count of {r}"),
        )
        .await
    }
}

#[async_trait::async_trait]
impl RendezvousHandler for DynamicRendezvous {
    fn backend(&self) -> &str {
        self.backend
    }

    async fn next_rendezvous(&self) -> Result<RendezvousInfo, RendezvousError> {
        self.join().await
    }

    async fn is_closed(&self) -> Result<bool, RendezvousError> {
        self.closed().await
    }

    /// Closes the run and wakes every node waiting in any phase of the newest
    /// round, so they see it at once.
    async fn set_closed(&self) -> Result<(), RendezvousError> {
        self.store.set("closed", b"1").await.map_err(self.err())?;
        let v = self.store.get_now("round").await.map_err(self.err())?;
        let newest: u64 = String::from_utf8_lossy(&v).parse().unwrap_or(0);
        let member = self.node.lock().await.member_of.map(|m| m.0);
        for round in [Some(newest), Some(newest + 1), member]
            .into_iter()
            .flatten()
        {
            let r = format!("r{round}");
            self.store
                .set(&format!("{r}/min"), b"1")
                .await
                .map_err(self.err())?;
            self.store
                .compare_set(&format!("{r}/complete"), b"", b"0")
                .await
                .map_err(self.err())?;
            self.store
                .set(&format!("{r}/reform"), b"1")
                .await
                .map_err(self.err())?;
        }
        Ok(())
    }

    /// Late arrivals waiting to join, plus members found dead: either way the group
    /// should re-form.
    async fn num_nodes_waiting(&self) -> Result<usize, RendezvousError> {
        let m = self.membership().await?;
        Ok(m.waiting + m.dead)
    }

    /// Blocks on the round's wake key ([`crate::wake`]): no store operation
    /// while nothing happens.
    async fn changed(&self, seen: u64, poll: Duration) -> Result<u64, RendezvousError> {
        let (round, health) = {
            let node = self.node.lock().await;
            (node.member_of.map(|m| m.0), node.health.clone())
        };
        let Some(round) = round else {
            tokio::time::sleep(poll).await;
            return Ok(seen);
        };
        crate::wake::wait(&*self.store, &format!("r{round}"), seen, &health)
            .await
            .map_err(|reason| RendezvousError::Unreachable {
                run_id: self.run_id.clone(),
                reason,
            })
    }

    async fn membership(&self) -> Result<MembershipChange, RendezvousError> {
        let Some((round, _, members)) = self.node.lock().await.member_of else {
            return Ok(MembershipChange::default());
        };
        let waiting = self
            .store
            .add(&format!("r{round}/waiting"), 0)
            .await
            .map_err(self.err())?;
        let dead = self
            .store
            .add(&format!("r{round}/dead"), 0)
            .await
            .map_err(self.err())?;
        let lost = if dead > 0 {
            self.dead_members(round, members).await
        } else {
            Vec::new()
        };
        Ok(MembershipChange {
            waiting: waiting.max(0) as usize,
            dead: dead.max(0) as usize,
            lost,
        })
    }

    fn detects_dead_members(&self) -> bool {
        true
    }

    fn run_store(&self) -> Option<Arc<dyn Store>> {
        Some(self.run_store_of_run())
    }

    /// Stops beating and says so (`r/left/<rank>`), so the member watching
    /// this one skips it instead of counting it dead; goes on watching its
    /// successor until shut down (a lingering host notices the last members
    /// die). Counted out of the census at most once, even if a call is cut
    /// short: a lost count keeps a host waiting, a double one could take its
    /// store from under a running node.
    async fn leave(&self) -> Result<(), RendezvousError> {
        let mut node = self.node.lock().await;
        if node.left && (node.counted_out || !node.counted_in) {
            return Ok(());
        }
        // Said before the beats stop, so the watcher never sees them stop
        // without the reason.
        if let Some((round, rank, _)) = node.member_of {
            self.store
                .set(&format!("r{round}/left/{rank}"), b"1")
                .await
                .map_err(self.err())?;
        }
        node.left = true;
        if let Some(b) = &node.beating {
            b.store(false, Ordering::Release);
        }
        if node.counted_in && !node.counted_out {
            // Counted in now (even if found dead while partitioned, in this
            // round or an earlier one), and never counted dead in this round
            // after: then out, once.
            let current = node.standing.take();
            node.unsettled.extend(current);
            node.settle(&*self.store).await.map_err(self.err())?;
            node.counted_out = true;
            crate::census::gone(&*self.store)
                .await
                .map_err(self.err())?;
        }
        Ok(())
    }

    /// The census; 0 also once no member of this node's round, or of a newer
    /// one, has beaten for a keep-alive expiry (those counted in are then gone
    /// where nobody could count them out).
    async fn remaining(&self) -> Result<usize, RendezvousError> {
        let mut node = self.node.lock().await;
        // A 0 is held from an answered read on (see `census::Zero`).
        let count = match crate::census::remaining(
            &*self.store,
            node.counted_in && !node.counted_out,
        )
        .await
        {
            Ok(c) => c,
            Err(e) => {
                node.zero = Default::default();
                return Err(self.err()(e));
            }
        };
        let n = node.zero.hold(count, self.timing.keep_alive);
        if n == 0 {
            return Ok(0);
        }
        let mut keys = Vec::new();
        let mut own = None;
        if let Some((r, rank, members)) = node.member_of {
            own = Some(r);
            keys.extend(
                (0..members)
                    .filter(|&m| m != rank)
                    .map(|m| format!("r{r}/hb/{m}")),
            );
        }
        // A round formed after this node's (others re-formed without it).
        if let Ok(v) = self.store.get_now("round").await {
            if let Ok(latest) = String::from_utf8_lossy(&v).parse::<u64>() {
                for r in [latest, latest.saturating_sub(1)] {
                    if own.is_some_and(|o| r <= o) {
                        continue;
                    }
                    if self
                        .store
                        .check(&[&format!("r{r}/complete")])
                        .await
                        .unwrap_or(false)
                    {
                        let members = self.members(&format!("r{r}")).await?;
                        keys.extend((0..members).map(|m| format!("r{r}/hb/{m}")));
                        break;
                    }
                }
            }
        }
        let t = self.timing;
        let beating = node
            .pulse
            .beating(
                &*self.store,
                &keys,
                t.keep_alive / 2,
                t.keep_alive * (t.max_misses + 1),
            )
            .await
            .map_err(self.err())?;
        Ok(if beating { n } else { 0 })
    }

    fn run_id(&self) -> &str {
        &self.run_id
    }

    fn use_agent_store(&self) -> bool {
        matches!(self.bootstrap, Bootstrap::Agent(_))
    }

    fn hosts_store(&self) -> bool {
        self.hosts_store
    }

    fn endpoint(&self) -> Option<String> {
        self.endpoint.clone()
    }

    async fn store_host_ended(&self) -> bool {
        let Some(endpoint) = self.endpoint.as_deref().filter(|_| self.served_by_peer) else {
            return false;
        };
        // A process that ended leaves nothing listening: the connect is
        // refused at once. A stalled one still accepts (its kernel does), and
        // a host cut off times out: both may come back.
        matches!(
            tokio::time::timeout(
                std::time::Duration::from_secs(1),
                tokio::net::TcpStream::connect(endpoint),
            )
            .await,
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused
        )
    }

    async fn shutdown(&self) -> Result<bool, RendezvousError> {
        if let Some(h) = self.node.lock().await.heartbeat.take() {
            h.abort();
        }
        match self.set_closed().await {
            Ok(()) => Ok(true),
            Err(e) => {
                tracing::warn!(error = %e, "could not close the rendezvous");
                Ok(false)
            }
        }
    }
}

impl Drop for DynamicRendezvous {
    fn drop(&mut self) {
        if let Ok(mut node) = self.node.try_lock() {
            if let Some(h) = node.heartbeat.take() {
                h.abort();
            }
        }
    }
}
