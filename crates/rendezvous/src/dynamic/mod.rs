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
//! `join` (in `join.rs`) only performs the store operation each [`state::Step`] asks for
//! and reports what happened; the keep-alive is pluggable ([`Keepalive`]: counters
//! here, etcd leases in the etcd backend).
//!
//! Where PyTorch's c10d backend differs: its state is one pickled blob rewritten by
//! compare-and-set and polled every second (O(N) bytes per node per poll, O(N²)
//! per round); ranks follow string order (`node10` before `node2`) and are not
//! kept across rounds; a silent participant of a completed round is not noticed.

mod c10d;
mod join;
mod keepalive;
pub mod state;
mod timing;

pub use c10d::{advertised_addr, create, default_node_id};
pub use keepalive::{Beat, CounterKeepalive, Keepalive, RING_INTERVALS, WATCHERS};
pub use timing::Timing;

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
use state::Bounds;

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

    /// This node's id.
    pub fn node_id(&self) -> &str {
        &self.node_id
    }

    fn err(&self) -> impl Fn(StoreError) -> RendezvousError + '_ {
        conn(&self.run_id)
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
