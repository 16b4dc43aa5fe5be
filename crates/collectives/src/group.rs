//! The process group: bootstrap, the operation context, and the collectives.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rallypoint_store::{PrefixStore, Store};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::net::TcpListener;
use tokio::time::{timeout_at, Instant};

use crate::algorithms as algo;
use crate::algorithms::choice;
use crate::element::{bytes_of, bytes_of_mut, Buf, DType, Element, ReduceOp};
use crate::error::{Error, Result};
use crate::frame::{hist_after, Algo, Desc, Header, OpKind, HIST_NONE, HIST_START, MAX_PAYLOAD};
use crate::shm::{self, ops as shm_ops, Arena, Plan, Turn};
use crate::transport::{Config, Fail, Key, Members, Origin, Shared, Transport};
use crate::two_level::{self, TwoLevel};

mod started;

/// gloo's default operation timeout.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// How a group is set up. Every rank must use the same segment size and
/// thresholds (the handshake refuses a peer whose differ).
#[derive(Debug, Clone)]
pub struct Options {
    /// The group's name: its keys live under `rallypoint/collectives/<prefix>/` in
    /// the store. A new group on the same store needs a new prefix.
    pub prefix: String,
    /// Bound on every operation (and on set-up's store waits).
    pub timeout: Duration,
    /// The address peers connect to. Default: the local address of the route to
    /// `MASTER_ADDR` if set, else of the route to this host's name, else loopback.
    pub advertise: Option<IpAddr>,
    /// Largest frame payload; larger buffers are cut into segments and
    /// pipelined. The pipelined algorithms (ring and chain) cut a buffer into
    /// segments of a quarter of each rank's share of it (`bytes / 4n`),
    /// within `[min(256 KiB, segment_bytes), segment_bytes]`: large segments
    /// where a buffer has many (each costs a frame, a wake-up and a hand-off,
    /// so over loopback TCP at 4 ranks a 64 MiB broadcast is about 25% faster
    /// at 1 MiB than at 256 KiB), and at least four per share, so that a
    /// chain or ring of many ranks still pipelines. The other algorithms use
    /// `segment_bytes`. Default 1 MiB (`docs/benchmarks.md`, issue 20's tenth
    /// part).
    pub segment_bytes: usize,
    /// Buffers up to this size use the latency algorithms (recursive doubling, trees).
    pub small_bytes: usize,
    /// Barriers of more ranks than this use a tree, which needs `n − 1`
    /// connections, rather than dissemination's `n lg n`.
    pub dissemination_max_ranks: usize,
    /// TCP connections to open per peer; segments are spread over them.
    pub streams_per_peer: usize,
    /// How long a receive waits before asking the peer for its part (which
    /// opens a connection if there is none, so a dead peer is noticed by the
    /// refusal, and compares the two calls).
    pub probe_after: Duration,
    /// How long a peer may take to answer a new connection's handshake. A
    /// listener that accepts but never answers is a stopped or hung process,
    /// and its rank is named gone after this.
    pub handshake_timeout: Duration,
    /// A connection whose peer's host stops answering (crashed, partitioned)
    /// fails after about this long: TCP keepalive probes while idle, and
    /// `TCP_USER_TIMEOUT` while data waits unacknowledged. Zero: the kernel's
    /// defaults (minutes).
    pub peer_timeout: Duration,
    /// Ranks that are all on one host (and a world of at most
    /// 64) run collectives over shared memory rather than loopback TCP;
    /// `false` keeps them on TCP. Every rank must agree.
    pub shared_memory: bool,
    /// Bytes of each half of a rank's shared-memory slot: the most a rank
    /// moves per round (at least 64 per rank, rounded up to 64).
    pub shm_slot_bytes: usize,
    /// Credit per peer: the bytes this rank may have sent a peer that the
    /// peer's operations have not taken yet (frames that arrive before their
    /// receive is posted: a broadcast root or a sender of messages runs on
    /// while the peer is behind). Out of credit, a rank sends only frames of
    /// operations the peer has begun or waits in (it asks for them). So a
    /// rank files at most this from each peer for operations it has not
    /// reached. Every rank should use the same; 0: no flow control
    /// (unbounded memory).
    pub receive_window: usize,
    /// This rank's host, as far as shared memory is concerned: ranks with
    /// equal ids share memory. Default: the host name, boot id and PID
    /// namespace (or `RALLY_HOST_ID`). Set it to keep ranks apart that could
    /// share memory (tests of several hosts in one process), never to join
    /// ranks that cannot.
    pub host_id: Option<String>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            prefix: "default_pg".into(),
            timeout: DEFAULT_TIMEOUT,
            advertise: None,
            segment_bytes: 1 << 20,
            small_bytes: 64 << 10,
            dissemination_max_ranks: 64,
            streams_per_peer: 1,
            probe_after: Duration::from_millis(250),
            handshake_timeout: Duration::from_secs(2),
            peer_timeout: Duration::from_secs(10),
            shared_memory: true,
            shm_slot_bytes: 1 << 20,
            receive_window: 32 << 20,
            host_id: None,
        }
    }
}

impl Options {
    /// What the handshake compares: a fixed hash (never `DefaultHasher`, whose
    /// algorithm may change between Rust releases), so ranks built by
    /// different toolchains agree.
    fn layout_hash(&self) -> u64 {
        stable_hash(&[
            self.segment_bytes as u64,
            self.small_bytes as u64,
            self.dissemination_max_ranks as u64,
        ])
    }
}

/// The smallest segment a pipelined op chooses by size (or `segment_bytes`,
/// if that is less).
pub(crate) const MIN_PIPELINE_SEGMENT: usize = 256 << 10;

/// Segment length, in elements of `size` bytes, for a pipelined op over
/// `total` elements on `n` ranks with `segment_bytes` the largest: a
/// quarter of each rank's share, rounded up (so a share is at most four
/// segments), within `[min(MIN_PIPELINE_SEGMENT, segment_bytes),
/// segment_bytes]` in bytes; at least one element.
pub(crate) fn pipeline_segment(total: usize, size: usize, n: usize, segment_bytes: usize) -> usize {
    let size = size.max(1);
    let max = (segment_bytes / size).max(1);
    let min = (MIN_PIPELINE_SEGMENT.min(segment_bytes) / size).clamp(1, max);
    total.div_ceil(4 * n.max(1)).clamp(min, max)
}

/// FNV-1a (64 bits) of `words` in little-endian order: the same on every
/// platform and toolchain, forever.
pub(crate) fn stable_hash(words: &[u64]) -> u64 {
    words
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .fold(0xcbf2_9ce4_8422_2325, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
}

/// The per-group state shared by every handle to it.
pub(crate) struct Comm {
    t: Arc<Transport>,
    id: u64,
    members: Members,
    /// This rank's place in `members`.
    rank: usize,
    /// Collective sequence numbers taken, and the history of calls.
    calls: Mutex<Calls>,
    /// Message numbers per (is-receive, peer, tag).
    p2p: Mutex<HashMap<(bool, usize, u32), u64>>,
    subgroups: Mutex<HashMap<Vec<usize>, u64>>,
    opts: Arc<Options>,
    /// How the group runs its collectives, once its first has decided.
    plan: tokio::sync::OnceCell<Plan>,
    /// Collectives' turns at the shared memory.
    turn: Turn,
}

/// A group's collectives so far, in the order they were called here.
struct Calls {
    /// The next collective's sequence number.
    next: u64,
    /// [`Desc::hist`] of the next collective: a hash of every call before it.
    hist: u32,
}

impl Default for Calls {
    fn default() -> Calls {
        Calls {
            next: 0,
            // Tracked from the first op on.
            hist: HIST_START,
        }
    }
}

/// The call that stands for the data's half of an all-gather of varying
/// sizes in the history: its length is known only once the lengths' half
/// has run, after later calls may have taken their numbers.
const VARYING_DATA: Desc = Desc {
    op: OpKind::AllGatherV,
    dtype: crate::element::DType::U8,
    reduce: None,
    algo: Algo::Direct,
    root: 0,
    count: 0,
    hist: HIST_NONE,
};

impl Comm {
    fn sh(&self) -> &Arc<Shared> {
        &self.t.shared
    }

    /// Takes the next sequence number for `call`: the number, and the
    /// history of the calls before it.
    fn take_seq(&self, call: &Desc) -> (u64, u32) {
        let mut c = self.calls.lock().unwrap_or_else(|e| e.into_inner());
        let taken = (c.next, c.hist);
        c.next += 1;
        c.hist = hist_after(c.hist, call);
        taken
    }

    /// The sequence number the next collective will take.
    fn next_seq(&self) -> u64 {
        self.calls.lock().unwrap_or_else(|e| e.into_inner()).next
    }

    pub(crate) fn plan_cell(&self) -> &tokio::sync::OnceCell<Plan> {
        &self.plan
    }

    pub(crate) fn new(
        t: Arc<Transport>,
        id: u64,
        members: Members,
        rank: usize,
        opts: Arc<Options>,
    ) -> Comm {
        Comm {
            t,
            id,
            members,
            rank,
            calls: Mutex::default(),
            p2p: Mutex::default(),
            subgroups: Mutex::default(),
            opts,
            plan: tokio::sync::OnceCell::new(),
            turn: Turn::default(),
        }
    }
}

/// A group of ranks that run collectives together.
///
/// Cheap to clone; clones share the group (and its sequence of operations). All
/// members must call the same collectives in the same order; a rank that does
/// not is caught at the first frame and both sides are named in the error.
#[derive(Clone)]
pub struct ProcessGroup {
    comm: Arc<Comm>,
    timeout: Duration,
    all_reduce_algo: Option<Algo>,
    broadcast_algo: Option<Algo>,
}

/// Which all-reduce algorithm to run (default: chosen by size).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllReduceAlgorithm {
    Ring,
    RecursiveDoubling,
    Tree,
}

/// Which broadcast algorithm to run (default: chosen by size).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BroadcastAlgorithm {
    Tree,
    Chain,
}

fn setup_err(group: String) -> impl Fn(String) -> Error {
    move |reason| Error::Setup {
        group: group.clone(),
        reason,
    }
}

/// The local address on the route to `host`.
pub fn route_ip(host: &str) -> Option<IpAddr> {
    let to = (host, 9).to_socket_addrs().ok()?.next()?;
    rallypoint_store::host::source_addr_towards(to)
}

/// The host of `host:port` or `[v6]:port`.
fn host_of(authority: &str) -> &str {
    if let Some(rest) = authority.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    authority.rsplit_once(':').map_or(authority, |(h, _)| h)
}

fn default_ip() -> IpAddr {
    std::env::var("MASTER_ADDR")
        .ok()
        .and_then(|h| route_ip(&h))
        .or_else(|| route_ip(&rallypoint_store::host::advertised_addr()))
        .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST))
}

impl ProcessGroup {
    /// Forms a group of `size` ranks through `store`, as rank `rank`.
    ///
    /// Binds a listener, publishes its address under the group's prefix and
    /// returns without waiting for the others: connections open when an
    /// operation first needs them. Rank 0 publishes the group's generation (a
    /// random nonce); a prefix that already holds one is an error, so stale keys
    /// of an earlier group are never mistaken for this one's.
    pub async fn new(
        store: Arc<dyn Store>,
        rank: usize,
        size: usize,
        opts: Options,
    ) -> Result<ProcessGroup> {
        let name = opts.prefix.clone();
        let err = setup_err(name.clone());
        if size == 0 || rank >= size {
            return Err(Error::Invalid(format!(
                "rank {rank} is not in a group of {size}"
            )));
        }
        if opts.segment_bytes < 8 || opts.segment_bytes as u64 > MAX_PAYLOAD {
            return Err(Error::Invalid(format!(
                "segment_bytes {} is outside 8..={MAX_PAYLOAD}",
                opts.segment_bytes
            )));
        }
        let store: Arc<dyn Store> = Arc::new(PrefixStore::new(
            format!("rallypoint/collectives/{name}"),
            store,
        ));
        let ip = opts.advertise.unwrap_or_else(default_ip);
        let listener = TcpListener::bind((ip, 0))
            .await
            .map_err(|e| err(format!("listening on {ip}: {e}")))?;
        let addr = listener.local_addr().map_err(|e| err(e.to_string()))?;
        let store_err = |what: &str, e: rallypoint_store::StoreError| err(format!("{what}: {e}"));

        let nonce = if rank == 0 {
            let mine = format!("{:016x}", fastrand::u64(1..));
            let now = store
                .compare_set("generation", b"", mine.as_bytes())
                .await
                .map_err(|e| store_err("publishing the generation", e))?;
            if now != mine.as_bytes() {
                return Err(err(format!(
                    "the prefix already holds a group (generation {}); form a new group under a new prefix",
                    String::from_utf8_lossy(&now)
                )));
            }
            mine
        } else {
            store
                .wait_timeout(&["generation"], opts.timeout)
                .await
                .map_err(|e| store_err("waiting for rank 0 to publish the generation", e))?;
            String::from_utf8_lossy(
                &store
                    .get_now("generation")
                    .await
                    .map_err(|e| store_err("reading the generation", e))?,
            )
            .into_owned()
        };
        let nonce = u64::from_str_radix(&nonce, 16)
            .map_err(|_| err(format!("bad generation {nonce:?} in the store")))?;
        let me = addr.to_string();
        let key = format!("addr/{rank}");
        let now = store
            .compare_set(&key, b"", me.as_bytes())
            .await
            .map_err(|e| store_err("publishing this rank's address", e))?;
        if now != me.as_bytes() {
            return Err(err(format!(
                "rank {rank} is already taken under this prefix (by {}): two processes with one rank, or an earlier group",
                String::from_utf8_lossy(&now)
            )));
        }
        let cfg = Config {
            name: name.clone(),
            rank,
            world: size,
            nonce,
            layout: opts.layout_hash(),
            streams: opts.streams_per_peer.max(1),
            probe_after: opts.probe_after,
            handshake_timeout: opts.handshake_timeout,
            peer_timeout: opts.peer_timeout,
            segment_bytes: opts.segment_bytes,
            receive_window: opts.receive_window as u64,
        };
        let t = Transport::start(cfg, store, listener).map_err(|e| err(e.to_string()))?;
        let members = Members {
            name,
            ranks: (0..size).collect(),
        };
        t.shared.register_members(0, members.clone());
        if size >= 2 {
            let entry = shm::host_entry(rank, opts.shared_memory, opts.host_id.as_deref());
            t.shared
                .store()
                .set(&format!("host/{rank}"), entry.as_bytes())
                .await
                .map_err(|e| store_err("publishing this rank's host", e))?;
        }
        Ok(ProcessGroup::with_comm(Comm::new(
            Arc::new(t),
            0,
            members,
            rank,
            Arc::new(opts),
        )))
    }

    /// Forms a group through PyTorch's URL init: `env://` (the default under
    /// `rally run`: `MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE`),
    /// `tcp://host:port?rank=R&world_size=N` or `file:///path?rank=R&world_size=N`.
    ///
    /// Under `rally run` the prefix gets the restart count
    /// (`TORCHELASTIC_RESTART_COUNT`), so each round of an elastic job forms a
    /// fresh group on the job's store.
    pub async fn from_url(url: &str, mut opts: Options) -> Result<ProcessGroup> {
        let args = rallypoint_rendezvous::init::InitArgs {
            timeout: opts.timeout.min(rallypoint_store::DEFAULT_TIMEOUT),
            ..Default::default()
        };
        let err = setup_err(opts.prefix.clone());
        let mut rdzv =
            rallypoint_rendezvous::init::rendezvous(url, args).map_err(|e| err(e.to_string()))?;
        let r = rdzv.next().await.map_err(|e| err(e.to_string()))?;
        if let Ok(n) = std::env::var("TORCHELASTIC_RESTART_COUNT") {
            opts.prefix = format!("round{n}/{}", opts.prefix);
        }
        if opts.advertise.is_none() {
            let from_url = rallypoint_rendezvous::url::Url::parse(url)
                .ok()
                .filter(|u| u.scheme == "tcp")
                .map(|u| host_of(&u.authority).to_owned());
            if let Some(host) = from_url.or_else(|| std::env::var("MASTER_ADDR").ok()) {
                opts.advertise = route_ip(&host);
            }
        }
        ProcessGroup::new(r.store, r.rank, r.world_size, opts).await
    }

    /// [`ProcessGroup::from_url`] with `env://`.
    pub async fn from_env(opts: Options) -> Result<ProcessGroup> {
        ProcessGroup::from_url("env://", opts).await
    }

    fn with_comm(comm: Comm) -> ProcessGroup {
        ProcessGroup {
            timeout: comm.opts.timeout,
            comm: Arc::new(comm),
            all_reduce_algo: None,
            broadcast_algo: None,
        }
    }

    /// This rank in the group.
    pub fn rank(&self) -> usize {
        self.comm.rank
    }

    /// Ranks in the group.
    pub fn size(&self) -> usize {
        self.comm.members.ranks.len()
    }

    /// The group's name (its prefix; subgroups add their ranks).
    pub fn name(&self) -> &str {
        &self.comm.members.name
    }

    /// Where this rank listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.comm.sh().local_addr
    }

    /// Connections this rank's listener refused (bad handshakes).
    pub fn refused_connections(&self) -> u64 {
        self.comm.sh().refused()
    }

    /// This group with another operation timeout (the rest is shared).
    pub fn with_timeout(&self, timeout: Duration) -> ProcessGroup {
        ProcessGroup {
            timeout,
            ..self.clone()
        }
    }

    /// This group with the all-reduce algorithm fixed, over TCP (a group
    /// over shared memory has one algorithm per op). Every rank must choose the same.
    pub fn with_all_reduce_algorithm(&self, a: AllReduceAlgorithm) -> ProcessGroup {
        let algo = match a {
            AllReduceAlgorithm::Ring => Algo::Ring,
            AllReduceAlgorithm::RecursiveDoubling => Algo::RecursiveDoubling,
            AllReduceAlgorithm::Tree => Algo::Tree,
        };
        ProcessGroup {
            all_reduce_algo: Some(algo),
            ..self.clone()
        }
    }

    /// This group with the broadcast algorithm fixed, over TCP (a group
    /// over shared memory has one algorithm per op). Every rank must choose the same.
    pub fn with_broadcast_algorithm(&self, a: BroadcastAlgorithm) -> ProcessGroup {
        let algo = match a {
            BroadcastAlgorithm::Tree => Algo::Tree,
            BroadcastAlgorithm::Chain => Algo::Chain,
        };
        ProcessGroup {
            broadcast_algo: Some(algo),
            ..self.clone()
        }
    }

    /// Aborts the group: pending and later operations fail, and every member is told.
    pub fn abort(&self, reason: &str) {
        let err = Error::Aborted {
            group: self.name().to_owned(),
            reason: format!("rank {} aborted it: {reason}", self.rank()).into(),
            by: Some(self.rank()),
        };
        self.comm.sh().abort(self.comm.id, err, Origin::Here, 0);
    }

    /// Test fault (feature `faults`): this rank dies now, as a SIGKILLed
    /// process does: its connections and listener close with no goodbye, it
    /// tells no one and writes nothing to the store; its operations fail.
    #[cfg(feature = "faults")]
    pub fn kill(&self) {
        self.comm.sh().kill();
    }

    /// Test fault (feature `faults`): [`ProcessGroup::kill`] when this rank is
    /// about to send its `n`-th data frame from now (0: the next), on any group
    /// of its transport.
    #[cfg(feature = "faults")]
    pub fn kill_at_frame(&self, n: u64) {
        self.comm.sh().kill_at_frame(n);
    }

    /// Test fault (feature `faults`): when this rank is about to send its
    /// `n`-th TCP data frame from now (0: the next), on any group of its
    /// transport, it writes the first `after` bytes of it and resets the
    /// connection, living on; the send reports success.
    #[cfg(feature = "faults")]
    pub fn break_at_frame(&self, n: u64, after: u64) {
        self.comm.sh().break_at_frame(n, after);
    }

    /// Test fault (feature `faults`): whether [`ProcessGroup::break_at_frame`]
    /// broke a connection.
    #[cfg(feature = "faults")]
    pub fn broke(&self) -> bool {
        self.comm.sh().broke()
    }

    /// Test fault (feature `faults`): whether this rank was killed.
    #[cfg(feature = "faults")]
    pub fn killed(&self) -> bool {
        self.comm.sh().killed()
    }

    /// Whether this group's collectives run over shared memory (every rank
    /// on this host), or over TCP; `None` until its first collective has
    /// decided.
    pub fn shared_memory(&self) -> Option<bool> {
        self.comm.plan.get().map(|p| matches!(p, Plan::Shm(_)))
    }

    /// Whether this group spans hosts and runs all_reduce, broadcast and
    /// barrier in two levels (shared memory within each host, TCP between);
    /// `None` until its first collective has decided.
    pub fn two_level(&self) -> Option<bool> {
        self.comm.plan.get().map(|p| matches!(p, Plan::TwoLevel(_)))
    }

    /// An internal group of `cx`'s group (see `two_level`): no messages.
    pub(crate) fn internal(cx: &OpCtx, id: u64, members: Members, rank: usize) -> ProcessGroup {
        let c = &cx.comm;
        c.sh().register_members(id, members.clone());
        ProcessGroup {
            comm: Arc::new(Comm::new(c.t.clone(), id, members, rank, c.opts.clone())),
            timeout: cx.timeout,
            all_reduce_algo: None,
            broadcast_algo: None,
        }
    }

    /// A step of a two-level op on this internal group: op `seq` (owned by
    /// the group op), with the group op's call and deadline.
    pub(crate) fn step_ctx(&self, seq: u64, desc: Desc, deadline: Instant) -> OpCtx {
        let c = &self.comm;
        // Every earlier internal op has ended here (the group's turn orders
        // two-level ops); those the group's ops left unused never will.
        c.turn.skip_to(seq);
        let mut cx = self.ctx(desc, seq, false);
        cx.deadline = deadline;
        if let Err(clash) = c.sh().begin_seq(c.id, seq, desc) {
            // The group's mismatch, at its op: raised on the group, whose
            // abort reaches this internal group (and fails the step).
            c.sh().raise(clash);
        }
        match c.sh().aborted_for(c.id, Some(seq)) {
            Some(e) => cx.doom(e),
            None => cx,
        }
    }

    /// Bytes received from peers ahead of the operations that will take
    /// them, for this group and every group of its world. Bounded per peer by
    /// [`Options::receive_window`] (plus the frames of operations this rank
    /// asked for: those it runs or waits in).
    pub fn received_ahead_bytes(&self) -> u64 {
        self.comm.sh().filed_bytes()
    }

    /// Payload bytes received over TCP straight into the caller's buffers,
    /// for this group and every group of its world. Posted, so received in
    /// place: the chain broadcast's receives (large broadcasts of 3 ranks or
    /// more) and the ring's all-gather pass (large all_reduce, all_gather),
    /// also as steps of a two-level op, in the `*_async` forms and in
    /// [`crate::blocking::BlockingGroup`]'s methods. The borrowing `async`
    /// methods copy each segment out of a receive buffer instead: their
    /// future could be leaked, ending the buffer's borrow while the reader
    /// still writes into it (see `algorithms/posted.rs`).
    pub fn received_in_place_bytes(&self) -> u64 {
        self.comm.sh().landed_bytes()
    }

    /// The error operations fail with, if the group is aborted.
    pub fn aborted(&self) -> Option<Error> {
        self.comm.sh().aborted(self.comm.id)
    }

    /// A subgroup of `ranks` (ranks of this group; any order, no repeats). As in
    /// PyTorch, its ranks are numbered in sorted order. Returns `None` on a rank
    /// that is not a member; members must create their subgroups in the same order.
    pub fn new_group(&self, ranks: &[usize]) -> Result<Option<ProcessGroup>> {
        let mut sorted = ranks.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() != ranks.len()
            || sorted.is_empty()
            || sorted.iter().any(|&r| r >= self.size())
        {
            return Err(Error::Invalid(format!(
                "new_group({ranks:?}): ranks must be distinct members of this group of {}",
                self.size()
            )));
        }
        let Some(rank) = sorted.iter().position(|&r| r == self.rank()) else {
            return Ok(None);
        };
        let nth = {
            let mut s = self
                .comm
                .subgroups
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            let c = s.entry(sorted.clone()).or_default();
            *c += 1;
            *c
        };
        let mut words = vec![self.comm.id, nth];
        words.extend(sorted.iter().map(|&r| r as u64));
        let id = stable_hash(&words) | 1;
        let world: Arc<[usize]> = sorted.iter().map(|&r| self.comm.members.ranks[r]).collect();
        let members = Members {
            name: format!("{}/sub{sorted:?}#{nth}", self.name()),
            ranks: world,
        };
        self.comm.sh().register_members(id, members.clone());
        Ok(Some(ProcessGroup {
            comm: Arc::new(Comm::new(
                self.comm.t.clone(),
                id,
                members,
                rank,
                self.comm.opts.clone(),
            )),
            ..self.clone()
        }))
    }

    // ---- operation plumbing -------------------------------------------------

    /// Starts collective `desc`: checks the group, takes the next sequence number
    /// and compares with what peers already sent.
    fn begin(&self, desc: Desc) -> Result<OpCtx> {
        let (seq, hist) = self.comm.take_seq(&desc);
        self.begin_at((seq, hist), desc)
    }

    /// [`ProcessGroup::begin`] with a sequence number (and the history
    /// before it) taken earlier.
    fn begin_at(&self, (seq, hist): (u64, u32), desc: Desc) -> Result<OpCtx> {
        let desc = Desc { hist, ..desc };
        let c = &self.comm;
        let cx = self.ctx(desc, seq, false);
        if let Some(e) = c.sh().aborted_for(c.id, Some(seq)) {
            // Fails at its first await, after the abort (perhaps raised here
            // by a peer's frame, before this op began) is recorded and told.
            return Ok(cx.doom(e));
        }
        if let Err(clash) = c.sh().begin_seq(c.id, seq, desc) {
            if clash.diverged {
                // Not the first mismatch: the op waits for the abort of
                // the one that is (see `Shared::raise`).
                c.sh().raise(clash);
                return Ok(cx);
            }
            let (src, theirs) = clash.b;
            let err = Error::Mismatch {
                group: self.name().to_owned(),
                seq,
                rank_a: self.rank(),
                desc_a: desc.to_string(),
                rank_b: c.members.group_rank(src as usize),
                desc_b: theirs.to_string(),
            };
            // Fail the group now (no frame of this op is sent), and the op
            // at its first await, after the others have been told.
            cx.fail(err.clone());
            return Ok(cx.doom(err));
        }
        Ok(cx)
    }

    /// Starts point-to-point message `desc` with `peer` (receive side if `recv`).
    fn begin_p2p(&self, desc: Desc, peer: usize, recv: bool) -> Result<OpCtx> {
        let c = &self.comm;
        let seq = {
            let mut m = c.p2p.lock().unwrap_or_else(|e| e.into_inner());
            let n = m.entry((recv, peer, desc.root)).or_default();
            *n += 1;
            *n - 1
        };
        let cx = self.ctx(desc, seq, true);
        match c.sh().aborted_for(c.id, None) {
            Some(e) => Ok(cx.doom(e)),
            None => Ok(cx),
        }
    }

    fn ctx(&self, desc: Desc, seq: u64, p2p: bool) -> OpCtx {
        OpCtx {
            comm: self.comm.clone(),
            seq,
            desc,
            p2p,

            timeout: self.timeout,
            deadline: Instant::now() + self.timeout,
            waiting: Mutex::new(None),
            note: Mutex::new(None),
            noted: Mutex::new(None),
            done: AtomicBool::new(false),
            doomed: Mutex::new(None),
            posting: false,
        }
    }

    fn check_rank(&self, what: &str, r: usize) -> Result<u32> {
        if r >= self.size() {
            return Err(Error::Invalid(format!(
                "{what} {r} is not a rank of group {:?} of {}",
                self.name(),
                self.size()
            )));
        }
        Ok(r as u32)
    }

    fn desc<T: Element>(
        &self,
        op: OpKind,
        reduce: Option<ReduceOp>,
        algo: Algo,
        root: u32,
        count: usize,
    ) -> Result<Desc> {
        if let Some(r) = reduce {
            if !r.supports(T::DTYPE) {
                return Err(Error::Invalid(format!(
                    "{}: {r} does not apply to {} (AVG is for floating-point types, BAND/BOR/BXOR for integers)",
                    op.name(),
                    T::DTYPE
                )));
            }
        }
        Ok(Desc {
            op,
            dtype: T::DTYPE,
            reduce,
            algo,
            root,
            count: count as u64,
            // Set as the call takes its number (`Comm::take_seq`).
            hist: HIST_NONE,
        })
    }

    /// The algorithm `op` of `bytes` takes here (see `algorithms/choice.rs`).
    fn choose(&self, op: OpKind, bytes: usize) -> Algo {
        let o = &self.comm.opts;
        choice::choose(
            op,
            self.size(),
            bytes,
            choice::Limits {
                small_bytes: o.small_bytes,
                dissemination_max_ranks: o.dissemination_max_ranks,
            },
        )
    }

    fn expect_len(&self, what: &str, got: usize, want: usize) -> Result<()> {
        if got != want {
            return Err(Error::Invalid(format!(
                "{what} has {got} elements; expected {want}"
            )));
        }
        Ok(())
    }

    // ---- collectives ---------------------------------------------------------

    /// Waits until every rank has called `barrier`.
    pub async fn barrier(&self) -> Result<()> {
        let cx = self.begin_barrier()?;
        drive(&cx, barrier_impl(&cx)).await
    }

    fn begin_barrier(&self) -> Result<OpCtx> {
        let algo = self.choose(OpKind::Barrier, 0);
        self.begin(self.desc::<u8>(OpKind::Barrier, None, algo, 0, 0)?)
    }

    /// Copies `root`'s buffer into every rank's.
    pub async fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        let cx = self.begin_broadcast::<T>(buf.len(), root)?;
        drive(&cx, broadcast_impl(&cx, buf, root)).await
    }

    fn begin_broadcast<T: Element>(&self, len: usize, root: usize) -> Result<OpCtx> {
        let root32 = self.check_rank("root", root)?;
        let algo = self
            .broadcast_algo
            .unwrap_or_else(|| self.choose(OpKind::Broadcast, len * T::DTYPE.size()));
        self.begin(self.desc::<T>(OpKind::Broadcast, None, algo, root32, len)?)
    }

    /// Reduces every rank's buffer element-wise with `op`; every rank gets the result.
    pub async fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let cx = self.begin_all_reduce::<T>(buf.len(), op)?;
        drive(&cx, all_reduce_impl(&cx, buf, op)).await
    }

    /// [`ProcessGroup::all_reduce`], receiving large payloads straight into
    /// `buf`.
    ///
    /// # Safety
    ///
    /// The future must not be leaked: run it to completion or drop it
    /// before `buf`'s borrow ends (see [`OpCtx::allow_posting`]).
    pub(crate) async unsafe fn all_reduce_posting<T: Element>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let cx = self.begin_all_reduce::<T>(buf.len(), op)?.allow_posting();
        drive(&cx, all_reduce_impl(&cx, buf, op)).await
    }

    /// [`ProcessGroup::broadcast`], receiving into `buf` in place.
    ///
    /// # Safety
    ///
    /// As [`ProcessGroup::all_reduce_posting`].
    pub(crate) async unsafe fn broadcast_posting<T: Element>(
        &self,
        buf: &mut [T],
        root: usize,
    ) -> Result<()> {
        let cx = self.begin_broadcast::<T>(buf.len(), root)?.allow_posting();
        drive(&cx, broadcast_impl(&cx, buf, root)).await
    }

    /// [`ProcessGroup::all_gather`], receiving into `out` in place.
    ///
    /// # Safety
    ///
    /// As [`ProcessGroup::all_reduce_posting`].
    pub(crate) async unsafe fn all_gather_posting<T: Element>(
        &self,
        input: &[T],
        out: &mut [T],
    ) -> Result<()> {
        self.expect_len("all_gather output", out.len(), input.len() * self.size())?;
        let cx = self.begin_all_gather::<T>(input.len())?.allow_posting();
        drive(&cx, all_gather_impl(&cx, input, out)).await
    }

    fn begin_all_reduce<T: Element>(&self, len: usize, op: ReduceOp) -> Result<OpCtx> {
        let algo = self
            .all_reduce_algo
            .unwrap_or_else(|| self.choose(OpKind::AllReduce, len * T::DTYPE.size()));
        self.begin(self.desc::<T>(OpKind::AllReduce, Some(op), algo, 0, len)?)
    }

    /// Reduces every rank's buffer into `root`'s; other ranks' buffers are unchanged.
    pub async fn reduce<T: Element>(&self, buf: &mut [T], root: usize, op: ReduceOp) -> Result<()> {
        let cx = self.begin_reduce::<T>(buf.len(), root, op)?;
        drive(&cx, reduce_impl(&cx, buf, root, op)).await
    }

    fn begin_reduce<T: Element>(&self, len: usize, root: usize, op: ReduceOp) -> Result<OpCtx> {
        let root32 = self.check_rank("root", root)?;
        let algo = self.choose(OpKind::Reduce, len * T::DTYPE.size());
        self.begin(self.desc::<T>(OpKind::Reduce, Some(op), algo, root32, len)?)
    }

    /// Every rank's `input` (all the same length) into `out`, in rank order.
    pub async fn all_gather<T: Element>(&self, input: &[T], out: &mut [T]) -> Result<()> {
        self.expect_len("all_gather output", out.len(), input.len() * self.size())?;
        let cx = self.begin_all_gather::<T>(input.len())?;
        drive(&cx, all_gather_impl(&cx, input, out)).await
    }

    fn begin_all_gather<T: Element>(&self, len: usize) -> Result<OpCtx> {
        self.begin(self.desc::<T>(
            OpKind::AllGather,
            None,
            self.choose(OpKind::AllGather, len * T::DTYPE.size()),
            0,
            len,
        )?)
    }

    /// Every rank's `input`, whatever its length, in rank order. Exchanges the
    /// lengths first (a small all-gather), then runs a ring over unequal chunks.
    pub async fn all_gather_varying<T: Element>(&self, input: &[T]) -> Result<Vec<Vec<T>>> {
        let (lens, seq) = self.begin_all_gather_varying()?;
        all_gather_varying_impl(self, lens, seq, input).await
    }

    /// The two sequence numbers of an all-gather of varying sizes, taken
    /// now: the lengths' all-gather (begun) and the data's (whose call,
    /// with the total length, is known only after the first), with its
    /// history.
    fn begin_all_gather_varying(&self) -> Result<(OpCtx, (u64, u32))> {
        let lens = self.begin_all_gather::<u64>(1)?;
        Ok((lens, self.comm.take_seq(&VARYING_DATA)))
    }

    /// Every rank's `input` (all the same length) to `root`, in rank order;
    /// `None` on other ranks.
    pub async fn gather<T: Element>(&self, input: &[T], root: usize) -> Result<Option<Vec<T>>> {
        let cx = self.begin_gather::<T>(input.len(), root)?;
        drive(&cx, gather_impl(&cx, input, root)).await
    }

    fn begin_gather<T: Element>(&self, len: usize, root: usize) -> Result<OpCtx> {
        let root32 = self.check_rank("root", root)?;
        self.begin(self.desc::<T>(
            OpKind::Gather,
            None,
            self.choose(OpKind::Gather, len * T::DTYPE.size()),
            root32,
            len,
        )?)
    }

    /// Chunk `i` of `root`'s `input` (`size × out.len()` elements) to rank `i`'s
    /// `out`. Other ranks pass `None`.
    pub async fn scatter<T: Element>(
        &self,
        input: Option<&[T]>,
        out: &mut [T],
        root: usize,
    ) -> Result<()> {
        let cx = self.begin_scatter::<T>(input.map(<[T]>::len), out.len(), root)?;
        let input = if self.rank() == root {
            input.unwrap_or(&[])
        } else {
            &[]
        };
        drive(&cx, scatter_impl(&cx, input, out, root)).await
    }

    /// `input`: the length the root passed (others' is ignored).
    fn begin_scatter<T: Element>(
        &self,
        input: Option<usize>,
        len: usize,
        root: usize,
    ) -> Result<OpCtx> {
        let root32 = self.check_rank("root", root)?;
        if self.rank() == root {
            let i = input
                .ok_or_else(|| Error::Invalid("scatter: the root must pass its input".into()))?;
            self.expect_len("scatter input", i, len * self.size())?;
        }
        self.begin(self.desc::<T>(
            OpKind::Scatter,
            None,
            self.choose(OpKind::Scatter, len * T::DTYPE.size()),
            root32,
            len,
        )?)
    }

    /// Reduces every rank's `input` (`size × out.len()` elements) with `op` and
    /// gives rank `i` chunk `i` of the result.
    pub async fn reduce_scatter<T: Element>(
        &self,
        input: &[T],
        out: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.expect_len("reduce_scatter input", input.len(), out.len() * self.size())?;
        let cx = self.begin_reduce_scatter::<T>(out.len(), op)?;
        drive(&cx, reduce_scatter_impl(&cx, input, out, op)).await
    }

    fn begin_reduce_scatter<T: Element>(&self, len: usize, op: ReduceOp) -> Result<OpCtx> {
        self.begin(self.desc::<T>(
            OpKind::ReduceScatter,
            Some(op),
            self.choose(OpKind::ReduceScatter, len * T::DTYPE.size()),
            0,
            len,
        )?)
    }

    /// Chunk `j` of rank `i`'s `input` becomes chunk `i` of rank `j`'s `out`
    /// (both `size × k` elements).
    pub async fn all_to_all<T: Element>(&self, input: &[T], out: &mut [T]) -> Result<()> {
        self.expect_len("all_to_all output", out.len(), input.len())?;
        let cx = self.begin_all_to_all::<T>(input.len())?;
        drive(&cx, all_to_all_impl(&cx, input, out)).await
    }

    fn begin_all_to_all<T: Element>(&self, len: usize) -> Result<OpCtx> {
        let n = self.size();
        if len % n != 0 {
            return Err(Error::Invalid(format!(
                "all_to_all input of {len} elements does not split into {n} equal chunks"
            )));
        }
        self.begin(self.desc::<T>(
            OpKind::AllToAll,
            None,
            self.choose(OpKind::AllToAll, (len / n) * T::DTYPE.size()),
            0,
            len / n,
        )?)
    }

    /// Sends `data` to rank `dst` under `tag`; the matching [`ProcessGroup::recv`]
    /// must expect the same type and length.
    pub async fn send<T: Element>(&self, data: &[T], dst: usize, tag: u32) -> Result<()> {
        let cx = self.begin_send::<T>(data.len(), dst, tag)?;
        drive(&cx, algo::send_message(&cx, dst, data)).await
    }

    fn begin_send<T: Element>(&self, len: usize, dst: usize, tag: u32) -> Result<OpCtx> {
        self.check_rank("destination", dst)?;
        if dst == self.rank() {
            return Err(Error::Invalid("send to self".into()));
        }
        self.begin_p2p(
            self.desc::<T>(
                OpKind::Send,
                None,
                self.choose(OpKind::Send, len * T::DTYPE.size()),
                tag,
                len,
            )?,
            dst,
            false,
        )
    }

    /// Receives the next message from `src` under `tag` into `out`.
    pub async fn recv<T: Element>(&self, out: &mut [T], src: usize, tag: u32) -> Result<()> {
        let cx = self.begin_recv::<T>(out.len(), src, tag)?;
        drive(&cx, algo::recv_message(&cx, src, out)).await
    }

    fn begin_recv<T: Element>(&self, len: usize, src: usize, tag: u32) -> Result<OpCtx> {
        self.check_rank("source", src)?;
        if src == self.rank() {
            return Err(Error::Invalid("recv from self".into()));
        }
        self.begin_p2p(
            self.desc::<T>(
                OpKind::Send,
                None,
                self.choose(OpKind::Send, len * T::DTYPE.size()),
                tag,
                len,
            )?,
            src,
            true,
        )
    }

    // ---- objects ---------------------------------------------------------------

    /// Every rank's object, in rank order (serialised with postcard).
    pub async fn all_gather_object<S: Serialize + DeserializeOwned>(
        &self,
        obj: &S,
    ) -> Result<Vec<S>> {
        let bytes = postcard::to_allocvec(obj).map_err(|e| Error::Codec(e.to_string()))?;
        self.all_gather_varying(&bytes)
            .await?
            .iter()
            .map(|b| postcard::from_bytes(b).map_err(|e| Error::Codec(e.to_string())))
            .collect()
    }

    /// `root`'s object on every rank; the root passes `Some`, others `None`.
    pub async fn broadcast_object<S: Serialize + DeserializeOwned>(
        &self,
        obj: Option<&S>,
        root: usize,
    ) -> Result<S> {
        let mut bytes = match (self.rank() == root, obj) {
            (true, Some(o)) => postcard::to_allocvec(o).map_err(|e| Error::Codec(e.to_string()))?,
            (true, None) => {
                return Err(Error::Invalid(
                    "broadcast_object: the root must pass its object".into(),
                ))
            }
            (false, _) => Vec::new(),
        };
        let mut len = [bytes.len() as u64];
        self.broadcast(&mut len, root).await?;
        bytes.resize(len[0] as usize, 0);
        self.broadcast(&mut bytes, root).await?;
        postcard::from_bytes(&bytes).map_err(|e| Error::Codec(e.to_string()))
    }

    // ---- handles ---------------------------------------------------------------
    //
    // Every collective has an `*_async` form: it takes its sequence number
    // (and checks its arguments) now, so operations started in order run in
    // order, and runs on the group's runtime, owning its buffers.

    /// Starts an op begun as `cx` (or failed to begin) with `body`.
    fn spawn_op<C, R, F>(&self, cx: Result<C>, body: impl FnOnce(C) -> F) -> Work<R>
    where
        R: Send + 'static,
        F: std::future::Future<Output = Result<R>> + Send + 'static,
    {
        let rt = &self.comm.sh().rt;
        match cx {
            Ok(cx) => Work::spawn(rt, body(cx)),
            Err(e) => Work::spawn(rt, async move { Err(e) }),
        }
    }

    /// Starts a barrier; see [`ProcessGroup::all_reduce_async`].
    pub fn barrier_async(&self) -> Work<()> {
        self.spawn_op(self.begin_barrier(), |cx| async move {
            drive(&cx, barrier_impl(&cx)).await
        })
    }

    /// Starts an all-reduce of `buf` and returns at once; the sequence number is
    /// taken now, so operations started in order run in order.
    ///
    /// Large payloads are received straight into `buf` (see
    /// `algorithms/posted.rs`); the borrowing [`ProcessGroup::all_reduce`]
    /// copies each received segment once more.
    pub fn all_reduce_async<T: Element>(&self, buf: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        // SAFETY: the task owns `buf`, declared before the op's future, which
        // is dropped first however the task ends.
        let cx = self
            .begin_all_reduce::<T>(buf.len(), op)
            .map(|cx| unsafe { cx.allow_posting() });
        self.spawn_op(cx, |cx| async move {
            let mut buf = buf;
            drive(&cx, all_reduce_impl(&cx, &mut buf, op)).await?;
            Ok(buf)
        })
    }

    /// Starts a broadcast; see [`ProcessGroup::all_reduce_async`].
    pub fn broadcast_async<T: Element>(&self, buf: Vec<T>, root: usize) -> Work<Vec<T>> {
        // SAFETY: as in `all_reduce_async`.
        let cx = self
            .begin_broadcast::<T>(buf.len(), root)
            .map(|cx| unsafe { cx.allow_posting() });
        self.spawn_op(cx, |cx| async move {
            let mut buf = buf;
            drive(&cx, broadcast_impl(&cx, &mut buf, root)).await?;
            Ok(buf)
        })
    }

    /// Starts a reduce to `root` (whose result the work returns; other ranks
    /// get their `buf` back unchanged); see [`ProcessGroup::all_reduce_async`].
    pub fn reduce_async<T: Element>(
        &self,
        mut buf: Vec<T>,
        root: usize,
        op: ReduceOp,
    ) -> Work<Vec<T>> {
        self.spawn_op(
            self.begin_reduce::<T>(buf.len(), root, op),
            |cx| async move {
                drive(&cx, reduce_impl(&cx, &mut buf, root, op)).await?;
                Ok(buf)
            },
        )
    }

    /// Starts an all-gather; see [`ProcessGroup::all_reduce_async`].
    pub fn all_gather_async<T: Element>(&self, input: Vec<T>) -> Work<Vec<T>> {
        let n = self.size();
        // SAFETY: as in `all_reduce_async` (`out` is the task's).
        let cx = self
            .begin_all_gather::<T>(input.len())
            .map(|cx| unsafe { cx.allow_posting() });
        self.spawn_op(cx, |cx| async move {
            let mut out = vec![T::from_i8(0); input.len() * n];
            drive(&cx, all_gather_impl(&cx, &input, &mut out)).await?;
            Ok(out)
        })
    }

    /// Starts an all-gather of varying sizes (it takes two sequence
    /// numbers); see [`ProcessGroup::all_reduce_async`].
    pub fn all_gather_varying_async<T: Element>(&self, input: Vec<T>) -> Work<Vec<Vec<T>>> {
        let pg = self.clone();
        self.spawn_op(self.begin_all_gather_varying(), |(lens, seq)| async move {
            all_gather_varying_impl(&pg, lens, seq, &input).await
        })
    }

    /// Starts a gather to `root` (`Some` there, `None` elsewhere); see
    /// [`ProcessGroup::all_reduce_async`].
    pub fn gather_async<T: Element>(&self, input: Vec<T>, root: usize) -> Work<Option<Vec<T>>> {
        self.spawn_op(self.begin_gather::<T>(input.len(), root), |cx| async move {
            drive(&cx, gather_impl(&cx, &input, root)).await
        })
    }

    /// Starts a scatter from `root` (which passes `Some` input) of `len`
    /// elements per rank; see [`ProcessGroup::all_reduce_async`].
    pub fn scatter_async<T: Element>(
        &self,
        input: Option<Vec<T>>,
        len: usize,
        root: usize,
    ) -> Work<Vec<T>> {
        let cx = self.begin_scatter::<T>(input.as_ref().map(Vec::len), len, root);
        self.spawn_op(cx, |cx| async move {
            let mut out = vec![T::from_i8(0); len];
            let input = input.filter(|_| cx.me() == root).unwrap_or_default();
            drive(&cx, scatter_impl(&cx, &input, &mut out, root)).await?;
            Ok(out)
        })
    }

    /// Starts a reduce-scatter of `input` (`size × k` elements; the work
    /// returns this rank's `k`); see [`ProcessGroup::all_reduce_async`].
    pub fn reduce_scatter_async<T: Element>(&self, input: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        let n = self.size();
        let cx = if input.len() % n == 0 {
            self.begin_reduce_scatter::<T>(input.len() / n, op)
        } else {
            Err(Error::Invalid(format!(
                "reduce_scatter input of {} elements does not split into {n} equal chunks",
                input.len()
            )))
        };
        self.spawn_op(cx, |cx| async move {
            let mut out = vec![T::from_i8(0); input.len() / n];
            drive(&cx, reduce_scatter_impl(&cx, &input, &mut out, op)).await?;
            Ok(out)
        })
    }

    /// Starts an all-to-all; see [`ProcessGroup::all_reduce_async`].
    pub fn all_to_all_async<T: Element>(&self, input: Vec<T>) -> Work<Vec<T>> {
        self.spawn_op(self.begin_all_to_all::<T>(input.len()), |cx| async move {
            let mut out = vec![T::from_i8(0); input.len()];
            drive(&cx, all_to_all_impl(&cx, &input, &mut out)).await?;
            Ok(out)
        })
    }

    /// Starts a send; see [`ProcessGroup::all_reduce_async`].
    pub fn send_async<T: Element>(&self, data: Vec<T>, dst: usize, tag: u32) -> Work<()> {
        self.spawn_op(
            self.begin_send::<T>(data.len(), dst, tag),
            |cx| async move { drive(&cx, algo::send_message(&cx, dst, &data)).await },
        )
    }

    /// Starts a receive of `len` elements; see [`ProcessGroup::all_reduce_async`].
    pub fn recv_async<T: Element>(&self, len: usize, src: usize, tag: u32) -> Work<Vec<T>> {
        self.spawn_op(self.begin_recv::<T>(len, src, tag), |cx| async move {
            let mut out = vec![T::from_i8(0); len];
            drive(&cx, algo::recv_message(&cx, src, &mut out)).await?;
            Ok(out)
        })
    }
}

/// Runs an op's body within its deadline and ends it (see [`OpCtx::finish`]):
/// every operation, blocking or `*_async`, goes through here.
async fn drive<R>(cx: &OpCtx, body: impl std::future::Future<Output = Result<R>>) -> Result<R> {
    cx.finish(timeout_at(cx.deadline, body).await).await
}

async fn barrier_impl(cx: &OpCtx) -> Result<()> {
    if let Some(t) = cx.two_level().await? {
        return two_level::barrier(&t, cx).await;
    }
    barrier_flat(cx).await
}

/// The op over this group alone (shared memory or TCP): also a step of a
/// two-level op.
pub(crate) async fn barrier_flat(cx: &OpCtx) -> Result<()> {
    if let Some(a) = cx.shm().await? {
        return shm_ops::barrier(&a, cx).await;
    }
    match cx.desc.algo {
        Algo::Dissemination => algo::barrier_dissemination(cx).await,
        _ => algo::barrier_tree(cx).await,
    }
}

pub(crate) async fn reduce_impl<T: Element>(
    cx: &OpCtx,
    buf: &mut [T],
    root: usize,
    op: ReduceOp,
) -> Result<()> {
    if let Some(a) = cx.shm().await? {
        return shm_ops::reduce(&a, cx, buf, op, Some(root)).await;
    }
    let mut scratch;
    let acc: &mut [T] = if cx.me() == root {
        buf
    } else {
        scratch = buf.to_vec();
        &mut scratch
    };
    match cx.desc.algo {
        Algo::Tree => {
            algo::tree_reduce(cx, acc, op, root, 0).await?;
            if op == ReduceOp::Avg && cx.me() == root {
                T::divide(acc, cx.n());
            }
            Ok(())
        }
        _ => algo::ring_reduce(cx, acc, op, root).await,
    }
}

/// The lengths' all-gather (`lens`, begun), then the data's as op `seq`.
async fn all_gather_varying_impl<T: Element>(
    pg: &ProcessGroup,
    lens: OpCtx,
    seq: (u64, u32),
    input: &[T],
) -> Result<Vec<Vec<T>>> {
    let mut all_lens = vec![0u64; pg.size()];
    let first = drive(
        &lens,
        all_gather_impl(&lens, &[input.len() as u64], &mut all_lens),
    )
    .await;
    // Ended: over shared memory its turn passes to the next op (the data's)
    // when it is dropped.
    drop(lens);
    // The data's op, begun even when the first failed (its number is taken;
    // the group is aborted then, so it fails at once).
    let mut bounds = Vec::with_capacity(all_lens.len());
    let mut at = 0usize;
    for &l in &all_lens {
        bounds.push(at..at + l as usize);
        at += l as usize;
    }
    let cx = pg.begin_at(
        seq,
        pg.desc::<T>(
            OpKind::AllGatherV,
            None,
            pg.choose(OpKind::AllGatherV, at * T::DTYPE.size()),
            0,
            at,
        )?,
    )?;
    if let Err(e) = first {
        cx.done.store(true, Ordering::Relaxed);
        return Err(e);
    }
    let mut all = vec![T::from_i8(0); at];
    let fut = async {
        if let Some(a) = cx.shm().await? {
            return shm_ops::gather(&a, &cx, input, &bounds, Some(&mut all)).await;
        }
        all[bounds[cx.me()].clone()].copy_from_slice(input);
        algo::ring_all_gather(&cx, &mut all, &bounds, 0).await
    };
    drive(&cx, fut).await?;
    Ok(bounds.into_iter().map(|b| all[b].to_vec()).collect())
}

async fn gather_impl<T: Element>(cx: &OpCtx, input: &[T], root: usize) -> Result<Option<Vec<T>>> {
    let (n, k) = (cx.n(), input.len());
    let bounds = algo::equal_bounds(k, n);
    if let Some(a) = cx.shm().await? {
        let mut all = vec![T::from_i8(0); if cx.me() == root { n * k } else { 0 }];
        let out = (cx.me() == root).then_some(&mut all[..]);
        shm_ops::gather(&a, cx, input, &bounds, out).await?;
        return Ok((cx.me() == root).then_some(all));
    }
    if cx.me() == root {
        let mut all = vec![T::from_i8(0); n * k];
        all[bounds[root].clone()].copy_from_slice(input);
        algo::gather_direct(cx, &mut all, &bounds, root, 0, cx.seg::<T>()).await?;
        Ok(Some(all))
    } else {
        algo::send_to_root(cx, input, root, 0, algo::nseg(k, cx.seg::<T>())).await?;
        Ok(None)
    }
}

async fn scatter_impl<T: Element>(
    cx: &OpCtx,
    input: &[T],
    out: &mut [T],
    root: usize,
) -> Result<()> {
    if let Some(a) = cx.shm().await? {
        let (how, k) = (shm_ops::Parts::Scatter { root }, out.len());
        return shm_ops::parts(&a, cx, how, input, out, k).await;
    }
    algo::scatter_direct(cx, input, out, root).await
}

async fn reduce_scatter_impl<T: Element>(
    cx: &OpCtx,
    input: &[T],
    out: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    if let Some(a) = cx.shm().await? {
        let (how, k) = (shm_ops::Parts::ReduceScatter(op), out.len());
        return shm_ops::parts(&a, cx, how, input, out, k).await;
    }
    let mut acc = input.to_vec();
    let bounds = algo::equal_bounds(out.len(), cx.n());
    algo::ring_reduce_scatter(cx, &mut acc, &bounds, op, 0).await?;
    let mine = &mut acc[bounds[cx.me()].clone()];
    if op == ReduceOp::Avg {
        T::divide(mine, cx.n());
    }
    out.copy_from_slice(mine);
    Ok(())
}

async fn all_to_all_impl<T: Element>(cx: &OpCtx, input: &[T], out: &mut [T]) -> Result<()> {
    if let Some(a) = cx.shm().await? {
        let k = input.len() / cx.n();
        return shm_ops::parts(&a, cx, shm_ops::Parts::AllToAll, input, out, k).await;
    }
    algo::all_to_all_pairwise(cx, input, out).await
}

async fn broadcast_impl<T: Element>(cx: &OpCtx, buf: &mut [T], root: usize) -> Result<()> {
    if let Some(t) = cx.two_level().await? {
        return two_level::broadcast(&t, cx, buf, root).await;
    }
    broadcast_flat(cx, buf, root).await
}

/// The op over this group alone (shared memory or TCP): also a step of a
/// two-level op.
pub(crate) async fn broadcast_flat<T: Element>(
    cx: &OpCtx,
    buf: &mut [T],
    root: usize,
) -> Result<()> {
    if let Some(a) = cx.shm().await? {
        return shm_ops::broadcast(&a, cx, buf, root).await;
    }
    match cx.desc.algo {
        Algo::Chain => algo::chain_broadcast(cx, buf, root).await,
        _ => algo::tree_broadcast(cx, buf, root, 0).await,
    }
}

async fn all_reduce_impl<T: Element>(cx: &OpCtx, buf: &mut [T], op: ReduceOp) -> Result<()> {
    if let Some(t) = cx.two_level().await? {
        return two_level::all_reduce(&t, cx, buf, op).await;
    }
    all_reduce_flat(cx, buf, op).await
}

/// The op over this group alone (shared memory or TCP): also a step of a
/// two-level op.
pub(crate) async fn all_reduce_flat<T: Element>(
    cx: &OpCtx,
    buf: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    if let Some(a) = cx.shm().await? {
        return shm_ops::reduce(&a, cx, buf, op, None).await;
    }
    match cx.desc.algo {
        Algo::Ring => algo::ring_all_reduce(cx, buf, op).await,
        Algo::Tree => algo::tree_all_reduce(cx, buf, op).await,
        _ => algo::recursive_doubling(cx, buf, op).await,
    }
}

async fn all_gather_impl<T: Element>(cx: &OpCtx, input: &[T], out: &mut [T]) -> Result<()> {
    let bounds = algo::equal_bounds(input.len(), cx.n());
    if let Some(a) = cx.shm().await? {
        return shm_ops::gather(&a, cx, input, &bounds, Some(out)).await;
    }
    out[bounds[cx.me()].clone()].copy_from_slice(input);
    algo::ring_all_gather(cx, out, &bounds, 0).await
}

/// A started operation (PyTorch's `Work`).
pub struct Work<T> {
    handle: tokio::task::JoinHandle<Result<T>>,
}

impl<T: Send + 'static> Work<T> {
    fn spawn(
        rt: &tokio::runtime::Handle,
        f: impl std::future::Future<Output = Result<T>> + Send + 'static,
    ) -> Work<T> {
        Work {
            handle: rt.spawn(f),
        }
    }

    /// Whether the operation has finished (successfully or not).
    pub fn is_completed(&self) -> bool {
        self.handle.is_finished()
    }

    /// Waits for the operation.
    pub async fn wait(self) -> Result<T> {
        self.handle
            .await
            .unwrap_or_else(|e| Err(Error::Invalid(format!("the operation's task failed: {e}"))))
    }
}

/// One operation in flight: its group, sequence number and descriptor, its
/// deadline, and whom it is waiting for (for the timeout message). Dropping it
/// unfinished aborts the group, since peers would otherwise wait for frames that
/// will never come.
pub(crate) struct OpCtx {
    comm: Arc<Comm>,
    seq: u64,
    desc: Desc,
    p2p: bool,
    timeout: Duration,
    pub(crate) deadline: Instant,
    waiting: Mutex<Option<(usize, u32, bool)>>,
    /// What the op waits for when that is not a rank's step (set-up).
    note: Mutex<Option<String>>,
    /// The rank and stage a note is about (shared memory).
    noted: Mutex<Option<(usize, u32)>>,
    done: AtomicBool,
    /// The op's result when it was doomed as it began (a mismatch found then,
    /// or its group already aborted for it), whatever the body did: every
    /// send and receive of an op the group's abort fails fails at once.
    doomed: Mutex<Option<Error>>,
    /// Whether the op's future is dropped before its buffers' borrows end
    /// (it cannot be leaked), so that it may post receives into them (see
    /// `algorithms/posted.rs`).
    posting: bool,
}

impl OpCtx {
    /// The group's two levels, if it spans hosts (see `two_level`).
    async fn two_level(&self) -> Result<Option<Arc<TwoLevel>>> {
        if self.p2p || self.is_doomed() {
            return Ok(None);
        }
        Ok(match shm::plan_of(self).await? {
            Plan::TwoLevel(t) => Some(t),
            _ => None,
        })
    }

    fn is_doomed(&self) -> bool {
        self.doomed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// A two-level step that succeeded (see `two_level`).
    pub(crate) fn step_done(self) {
        self.done.store(true, Ordering::Relaxed);
        self.comm.sh().end_seq(self.comm.id, self.seq);
    }

    /// A two-level step that failed: the group op's abort aborts this
    /// internal group, not the step.
    pub(crate) fn step_failed(self) {
        self.done.store(true, Ordering::Relaxed);
    }

    /// The rank (of this op's group) and step the op last waited for.
    pub(crate) fn waiting_rank(&self) -> Option<(usize, u32)> {
        self.waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .map(|(r, step, _)| (r, step))
            .or(*self.noted.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// The group's abort as this rank knows it: told, or recorded.
    pub(crate) async fn known_abort(&self) -> Option<Error> {
        shm::known_abort(self).await
    }

    pub(crate) fn op_name(&self) -> String {
        self.name()
    }

    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The op's timeout error, as its deadline passes.
    pub(crate) fn timed_out(&self) -> Error {
        self.timeout_error()
    }

    /// The group's shared memory, if this op runs over it.
    async fn shm(&self) -> Result<Option<Arc<Arena>>> {
        if self.p2p
            || self
                .doomed
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_some()
        {
            return Ok(None);
        }
        shm::arena_of(self).await
    }

    pub(crate) fn sh(&self) -> &Arc<Shared> {
        self.comm.sh()
    }

    pub(crate) fn comm_arc(&self) -> &Arc<Comm> {
        &self.comm
    }

    /// The group rank of world rank `w`, for messages.
    pub(crate) fn group_rank_of(&self, w: usize) -> usize {
        self.comm.members.group_rank(w)
    }

    pub(crate) fn comm_id(&self) -> u64 {
        self.comm.id
    }

    pub(crate) fn seq(&self) -> u64 {
        self.seq
    }

    pub(crate) fn desc(&self) -> Desc {
        self.desc
    }

    pub(crate) fn opts(&self) -> &Options {
        &self.comm.opts
    }

    pub(crate) fn turn(&self) -> &Turn {
        &self.comm.turn
    }

    pub(crate) fn group_name(&self) -> String {
        self.comm.members.name.clone()
    }

    /// Rank `k` (of the group) is gone, for `reason`.
    pub(crate) fn gone(&self, k: usize, reason: String) -> Error {
        self.error(Fail::Gone {
            rank: self.world(k),
            reason,
        })
    }

    /// What the op waits for, for its timeout message, when that is not a
    /// rank's step.
    pub(crate) fn note_waiting(&self, what: String) {
        *self.note.lock().unwrap_or_else(|e| e.into_inner()) = Some(what);
    }

    /// [`OpCtx::note_waiting`], in place of a rank's step; `rank`: the rank
    /// (of the group) and stage the note is about, if one.
    pub(crate) fn wait_note(&self, what: String, rank: Option<(usize, u32)>) {
        *self.waiting.lock().unwrap_or_else(|e| e.into_inner()) = None;
        *self.noted.lock().unwrap_or_else(|e| e.into_inner()) = rank;
        self.note_waiting(what);
    }

    pub(crate) fn n(&self) -> usize {
        self.comm.members.ranks.len()
    }

    pub(crate) fn me(&self) -> usize {
        self.comm.rank
    }

    /// Segment length in elements of `T`.
    pub(crate) fn seg<T: Element>(&self) -> usize {
        (self.comm.opts.segment_bytes / std::mem::size_of::<T>()).max(1)
    }

    /// Segment length in elements of `T` for a pipelined op (ring, chain)
    /// over a buffer of `total` elements, the same on every rank (see
    /// [`Options::segment_bytes`] and [`pipeline_segment`]).
    pub(crate) fn seg_for<T: Element>(&self, total: usize) -> usize {
        pipeline_segment(
            total,
            std::mem::size_of::<T>(),
            self.n(),
            self.comm.opts.segment_bytes,
        )
    }

    pub(crate) fn check_steps(&self, phases: usize, stride: usize) -> Result<()> {
        if phases
            .checked_mul(stride)
            .is_none_or(|s| s > u32::MAX as usize)
        {
            return Err(Error::Invalid(format!(
                "{}: {phases} phases of {stride} segments do not fit in a frame's step field; use a larger segment size",
                self.desc
            )));
        }
        Ok(())
    }

    /// This op fails with `e` at its first await, once its group's abort is
    /// recorded and told: every send and receive of an op the abort fails
    /// fails at once, so no frame of it is sent.
    fn doom(self, e: Error) -> OpCtx {
        self.done.store(true, Ordering::Relaxed);
        *self.doomed.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
        self
    }

    /// The first collective this op's failure fails: itself, or, for a
    /// message, the next collective this rank begins. The ones before go on,
    /// here and elsewhere: run one after another, this rank has sent all
    /// their frames; an earlier `*_async` op still running here goes on
    /// sending its own (and one dropped unfinished aborts from itself). What
    /// needs a dead rank fails on its own.
    fn abort_from(&self) -> u64 {
        if self.p2p {
            self.comm.next_seq()
        } else {
            self.seq
        }
    }

    /// The sequence number aborts compare with (none for point-to-point).
    fn collective_seq(&self) -> Option<u64> {
        (!self.p2p).then_some(self.seq)
    }

    fn name(&self) -> String {
        if self.p2p {
            format!("{} (message #{})", self.desc, self.seq)
        } else {
            format!("{} (op #{})", self.desc, self.seq)
        }
    }

    pub(crate) fn world(&self, grank: usize) -> usize {
        self.comm.members.ranks[grank]
    }

    pub(crate) fn error(&self, f: Fail) -> Error {
        let group = self.comm.members.name.clone();
        match f {
            Fail::Aborted(e) => e,
            Fail::Gone { rank, reason } | Fail::Unanswered { rank, reason } => Error::PeerGone {
                group,
                op: self.name(),
                rank: self.comm.members.group_rank(rank),
                reason: self.where_(rank, reason),
            },
            Fail::Refused { rank, reason } => Error::Protocol {
                group,
                rank: self.comm.members.group_rank(rank),
                reason,
            },
            Fail::Lost { rank, reason } => Error::ConnectionLost {
                group,
                op: self.name(),
                rank: self.comm.members.group_rank(rank),
                reason,
            },
            Fail::Timeout => self.timeout_error(),
        }
    }

    /// `reason` with where world rank `rank` listened, when this rank knows
    /// and the reason does not say: the host of a rank that died.
    fn where_(&self, rank: usize, reason: String) -> String {
        match self.sh().known_addr(rank) {
            Some(a) if !reason.contains(&a.ip().to_string()) => {
                format!("{reason} (it listened at {a})")
            }
            _ => reason,
        }
    }

    fn timeout_error(&self) -> Error {
        let waiting = *self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        let waiting_for = match waiting {
            Some((r, _, _)) if self.comm.sh().awaiting_address(self.world(r)) => format!(
                "rank {r}, which never published its address: it never formed the group (not started, or died during set-up)"
            ),
            Some((r, step, false)) => format!("rank {r} (step {step})"),
            Some((r, step, true))
                if self.comm.sh().held_by(
                    self.world(r),
                    self.comm.id,
                    self.seq,
                    self.p2p,
                    self.desc.root,
                ) =>
            {
                format!(
                "rank {r} to take step {step}: this rank is out of credit with it (its operations have not taken the last Options::receive_window bytes sent to it) and it has not asked for this op's frames: it has not reached this op"
            )
            }
            Some((r, step, true)) => format!("rank {r} to take step {step}"),
            None => self
                .note
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
                .unwrap_or_else(|| "the operation to start".into()),
        };
        Error::Timeout {
            group: self.comm.members.name.clone(),
            op: self.name(),
            timeout: self.timeout,
            waiting_for,
        }
    }

    pub(crate) fn set_waiting(&self, r: usize, step: u32, sending: bool) {
        *self.waiting.lock().unwrap_or_else(|e| e.into_inner()) = Some((r, step, sending));
    }

    pub(crate) async fn send<T: Element>(&self, to: usize, step: u32, data: &[T]) -> Result<()> {
        self.set_waiting(to, step, true);
        let bytes = bytes_of(data);
        let h = Header::Data {
            comm: self.comm.id,
            seq: self.seq,
            step,
            desc: self.desc,
            len: bytes.len() as u64,
        };
        self.comm
            .sh()
            .send(self.world(to), &h, bytes, step as usize, self.deadline)
            .await
            .map_err(|f| self.error(f))
    }

    /// The key of this op's frame from `from` at `step`.
    pub(crate) fn key(&self, from: usize, step: u32) -> Key {
        Key {
            comm: self.comm.id,
            src: self.world(from) as u32,
            p2p: self.p2p,
            tag: if self.p2p { self.desc.root } else { 0 },
            seq: self.seq,
            step,
        }
    }

    /// Whether the op may post receives into its buffers: its future is
    /// dropped before their borrows end (see `algorithms/posted.rs`).
    pub(crate) fn may_post(&self) -> bool {
        self.posting && !self.p2p
    }

    /// Lets the op post receives into its buffers.
    ///
    /// # Safety
    ///
    /// The op's future must be dropped (or run to completion) before the
    /// borrows of the buffers it is given end: it is never leaked. True of a
    /// future owned by a task that owns the buffers (`*_async`), and of one
    /// run within a blocking call ([`crate::blocking::BlockingGroup`]).
    pub(crate) unsafe fn allow_posting(mut self) -> OpCtx {
        self.posting = true;
        self
    }

    async fn recv(&self, from: usize, step: u32, elems: usize, dtype: DType) -> Result<Buf> {
        self.set_waiting(from, step, false);
        let key = self.key(from, step);
        let f = self
            .comm
            .sh()
            .recv(key, (!self.p2p).then_some(self.desc), self.deadline)
            .await
            .map_err(|f| self.error(f))?;
        if self.p2p && (f.desc.dtype != dtype || f.desc.count != self.desc.count) {
            return Err(Error::MessageMismatch {
                group: self.comm.members.name.clone(),
                tag: self.desc.root,
                seq: self.seq,
                sender: from,
                sent: format!("{} x {}", f.desc.dtype, f.desc.count),
                receiver: self.me(),
                expected: format!("{} x {}", self.desc.dtype, self.desc.count),
            });
        }
        self.check_len(from, step, f.buf.len(), elems * dtype.size())?;
        Ok(f.buf)
    }

    /// A frame from `from` at `step` of `got` bytes where `want` were due.
    pub(crate) fn check_len(&self, from: usize, step: u32, got: usize, want: usize) -> Result<()> {
        if got != want {
            return Err(Error::Protocol {
                group: self.comm.members.name.clone(),
                rank: from,
                reason: format!(
                    "sent {got} bytes for step {step} of {}; expected {want}",
                    self.name()
                ),
            });
        }
        Ok(())
    }

    pub(crate) async fn recv_copy<T: Element>(
        &self,
        from: usize,
        step: u32,
        out: &mut [T],
    ) -> Result<()> {
        let b = self.recv(from, step, out.len(), T::DTYPE).await?;
        bytes_of_mut(out).copy_from_slice(b.bytes());
        Ok(())
    }

    pub(crate) async fn recv_reduce<T: Element>(
        &self,
        from: usize,
        step: u32,
        out: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let b = self.recv(from, step, out.len(), T::DTYPE).await?;
        T::reduce(op, out, b.typed());
        Ok(())
    }

    /// Ends the operation with the algorithm's result (or its deadline). A
    /// failure aborts the group and returns once the other members have been
    /// told (bounded), so a rank that exits on the error does not leave them to
    /// find only that it, too, is gone.
    pub(crate) async fn finish<R>(
        &self,
        r: Result<Result<R>, tokio::time::error::Elapsed>,
    ) -> Result<R> {
        let doomed = self.doomed.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(e) = doomed {
            self.comm.sh().told(self.comm.id).await;
            return Err(e);
        }
        match r {
            Ok(Ok(v)) => {
                self.done.store(true, Ordering::Relaxed);
                if !self.p2p {
                    self.comm.sh().end_seq(self.comm.id, self.seq);
                }
                // An abort raised while the op ran (a peer's frame for it that
                // did not match, say) fails it even though its part is done,
                // once recorded and told like any failure (this rank may exit
                // on the error: simulator seed 973).
                match self
                    .comm
                    .sh()
                    .aborted_for(self.comm.id, self.collective_seq())
                {
                    Some(e) => {
                        self.comm.sh().told(self.comm.id).await;
                        Err(e)
                    }
                    None => Ok(v),
                }
            }
            Ok(Err(e)) => Err(self.fail_told(e).await),
            Err(_) => Err(self.fail_told(self.timeout_error()).await),
        }
    }

    /// Fails the group with `e` and returns `e` once the others have been
    /// told (bounded), so a rank that exits on the error does not leave them
    /// to find only that it, too, is gone.
    async fn fail_told(&self, e: Error) -> Error {
        let e = self.explain(e).await;
        let e = self.fail(e);
        self.comm.sh().told(self.comm.id).await;
        e
    }

    /// A timeout while calls found diverged are held is explained by them.
    ///
    /// A member found gone may be a bystander that exited on being told of an
    /// abort (or whose process ended before the telling reached us, or that
    /// finished its part of calls found diverged here): the group's abort
    /// (once the grace of calls found diverged has settled, see
    /// `transport/diverged.rs`), or else its record in the store, names the
    /// cause.
    async fn explain(&self, e: Error) -> Error {
        let (sh, id, seq) = (self.comm.sh(), self.comm.id, self.collective_seq());
        let held = || seq.and_then(|s| sh.give_up_diverged(id, s));
        if matches!(e, Error::Timeout { .. }) {
            return held().unwrap_or(e);
        }
        // A rank gone, or a connection lost with a rank that lives on, may
        // be the trace of a failure elsewhere (a rank that exited on being
        // told): the cause is then the abort, or its record.
        if !matches!(e, Error::PeerGone { .. } | Error::ConnectionLost { .. }) {
            return e;
        }
        if let Some(a) = sh.aborted_for(id, seq) {
            return a;
        }
        sh.settle_diverged(id, self.deadline).await;
        if Instant::now() >= self.deadline {
            if let Some(d) = held() {
                return d;
            }
        }
        if let Some(a) = sh.aborted_for(id, seq) {
            return a;
        }
        let record = self.comm.sh().abort_record(self.comm.id).await;
        tracing::debug!(
            rank = self.comm.sh().cfg.rank,
            op = %self.name(),
            found = record.is_some(),
            "a peer gone: looked for the abort's record"
        );
        match record {
            Some(record) => Error::Aborted {
                group: self.comm.members.name.clone(),
                reason: record.into(),
                by: None,
            },
            None => e,
        }
    }

    /// Aborts the group with `e` (unless it is aborted already) and returns
    /// `e`; the other members are told in the background.
    fn fail(&self, e: Error) -> Error {
        self.done.store(true, Ordering::Relaxed);
        // The group's abort is in place for this op already: nothing to add
        // (and a provisional one must stay so, see `transport/diverged.rs`).
        if !self.p2p
            && self
                .comm
                .sh()
                .aborted_for(self.comm.id, Some(self.seq))
                .is_some()
        {
            return e;
        }
        let from = self.abort_from();
        if e.is_aborted() {
            // A message fails under any abort of its group: when one is
            // recorded, that is why, and widening it to the collectives this
            // rank had not begun when the message began would fail ones the
            // abort leaves to finish.
            if self.p2p && self.comm.sh().aborted_for(self.comm.id, None).is_some() {
                return e;
            }
            // Usually recorded already, from this op or an earlier one (then
            // this changes nothing); not when it came from the store, or from
            // a later op (then it widens to this one).
            self.comm
                .sh()
                .abort(self.comm.id, e.clone(), Origin::Passed(None), from);
            return e;
        }
        let reason = Error::Aborted {
            group: self.comm.members.name.clone(),
            reason: e.to_string().into(),
            by: None,
        };
        self.comm
            .sh()
            .abort(self.comm.id, reason, Origin::Here, from);
        e
    }
}

impl Drop for OpCtx {
    fn drop(&mut self) {
        // The turn passes at the end, after any abort: the next op must
        // see it before it touches the shared memory.
        struct PassTurn<'a>(&'a OpCtx);
        impl Drop for PassTurn<'_> {
            fn drop(&mut self) {
                if !self.0.p2p {
                    self.0.comm.turn.done(self.0.seq);
                }
            }
        }
        let _turn = PassTurn(self);
        if !self.done.load(Ordering::Relaxed) {
            let reason = Error::Aborted {
                group: self.comm.members.name.clone(),
                reason: format!(
                    "rank {} dropped {} before it finished",
                    self.me(),
                    self.name()
                )
                .into(),
                by: None,
            };
            let from = self.abort_from();
            self.comm
                .sh()
                .abort(self.comm.id, reason, Origin::Here, from);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An op whose own part is done when its group is aborted (a peer's
    /// frame for it that did not match came while it ran: simulator seed
    /// 973) returns the abort only once it is recorded in the store, as any
    /// failing op does: its rank may exit at once, and a rank that then
    /// finds it gone reads the record to name the cause (it named the
    /// bystander). On a current-thread runtime the recording task runs only
    /// when the op yields, so an op that returns without waiting shows.
    #[tokio::test(flavor = "current_thread")]
    async fn an_op_done_when_its_group_is_aborted_returns_once_the_abort_is_recorded() {
        let store: Arc<dyn Store> = Arc::new(rallypoint_store::MemoryStore::new());
        let o = Options {
            advertise: Some(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)),
            shared_memory: false,
            ..Options::default()
        };
        let pg = ProcessGroup::new(store.clone(), 0, 1, o).await.unwrap();
        let cx = pg.begin_barrier().unwrap();
        let found = Error::Invalid("a peer's frame for the op did not match".into());
        pg.comm.sh().abort(pg.comm.id, found, Origin::Here, cx.seq);
        assert!(cx.finish(Ok(Ok(()))).await.is_err());
        let keys = store.list_keys().await.unwrap();
        assert!(
            keys.iter().any(|k| k.contains("/abort/")),
            "the op returned before its abort was recorded: {keys:?}"
        );
    }

    #[test]
    fn pipelined_segments_are_a_quarter_share_within_bounds() {
        const M: usize = 1 << 20;
        let seg = |bytes: usize, n: usize, max: usize| pipeline_segment(bytes / 4, 4, n, max) * 4;
        // Many segments: the largest.
        assert_eq!(seg(64 * M, 4, M), M);
        assert_eq!(seg(16 * M, 4, M), M);
        // Fewer: a quarter of each rank's share, so at most four per share.
        assert_eq!(seg(8 * M, 4, M), M / 2);
        assert_eq!(seg(16 * M, 8, M), M / 2);
        // Never below 256 KiB, nor above the option.
        assert_eq!(seg(M, 4, M), MIN_PIPELINE_SEGMENT);
        assert_eq!(seg(4, 4, M), MIN_PIPELINE_SEGMENT);
        assert_eq!(seg(1 << 30, 2, 4 * M), 4 * M);
        // A small `segment_bytes` (tests cut buffers finely) is used as is.
        assert_eq!(seg(64 * M, 4, 512), 512);
        assert_eq!(pipeline_segment(0, 4, 1, 16), 4);
        // Below one element: one element.
        assert_eq!(pipeline_segment(100, 8, 2, 4), 1);
        // Uneven buffers: every share is at most four segments.
        for (total, n) in [
            ((1 << 20) + 3, 2),
            ((1 << 20) + 3, 3),
            ((3 << 20) + 5, 4),
            (999_999, 7),
        ] {
            let s = pipeline_segment(total, 4, n, M);
            let share = total.div_ceil(n);
            assert!(share.div_ceil(s) <= 4, "{total} on {n}: {s}");
        }
    }

    #[test]
    fn the_layout_hash_never_changes() {
        // FNV-1a vectors computed independently: ranks built by any toolchain,
        // past or future, must agree on them.
        assert_eq!(stable_hash(&[]), 0xcbf2_9ce4_8422_2325);
        assert_eq!(stable_hash(&[0x61]), 0x6926_124a_7b14_33c4);
        // The defaults' hash changes only with a default (1 MiB segments since
        // issue 20's tenth part: 0x4136_1f82_2124_e188 before), and ranks with
        // different defaults refuse each other at the handshake, by name.
        assert_eq!(Options::default().layout_hash(), 0x40f5_f653_0dbb_6b7c);
    }
}
