//! The process group: bootstrap, the operation context, and the collectives.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use rallypoint_store::{PrefixStore, Store};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::net::TcpListener;

use crate::algorithms as algo;
use crate::algorithms::choice;
use crate::dispatch;
use crate::element::{Element, ReduceOp};
use crate::error::{Error, Result};
use crate::frame::{Algo, Desc, OpKind, HIST_NONE, MAX_PAYLOAD};
use crate::hash::stable_hash;
use crate::op::{drive, Comm, OpCtx};
use crate::options::{AllReduceAlgorithm, BroadcastAlgorithm, Options};
use crate::plan::{self, Plan, PlanCell};
use crate::transport::{Config, Members, Origin, Transport};

mod started;

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

/// A group of ranks that run collectives together.
///
/// Cheap to clone; clones share the group (and its sequence of operations). All
/// members must call the same collectives in the same order; a rank that does
/// not is caught at the first frame and both sides are named in the error.
#[derive(Clone)]
pub struct ProcessGroup {
    comm: Arc<Comm>,
    /// How the group runs its collectives, once its first has decided:
    /// shared by clones, handed down to each op.
    plan: Arc<PlanCell>,
    timeout: Duration,
    all_reduce_algo: Option<Algo>,
    broadcast_algo: Option<Algo>,
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
            let entry = plan::host_entry(rank, opts.shared_memory, opts.host_id.as_deref());
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
            plan: Arc::default(),
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
        self.plan.get().map(|p| matches!(p, Plan::Shm(_)))
    }

    /// Whether this group spans hosts and runs all_reduce, broadcast and
    /// barrier in two levels (shared memory within each host, TCP between);
    /// `None` until its first collective has decided.
    pub fn two_level(&self) -> Option<bool> {
        self.plan.get().map(|p| matches!(p, Plan::TwoLevel(_)))
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
            plan: Arc::default(),
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
        let cx = OpCtx::new(self.comm.clone(), desc, seq, false, self.timeout);
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
        let cx = OpCtx::new(self.comm.clone(), desc, seq, true, self.timeout);
        match c.sh().aborted_for(c.id, None) {
            Some(e) => Ok(cx.doom(e)),
            None => Ok(cx),
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
        drive(&cx, dispatch::barrier(&cx, &self.plan)).await
    }

    fn begin_barrier(&self) -> Result<OpCtx> {
        let algo = self.choose(OpKind::Barrier, 0);
        self.begin(self.desc::<u8>(OpKind::Barrier, None, algo, 0, 0)?)
    }

    /// Copies `root`'s buffer into every rank's.
    pub async fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        let cx = self.begin_broadcast::<T>(buf.len(), root)?;
        drive(&cx, dispatch::broadcast(&cx, &self.plan, buf, root)).await
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
        drive(&cx, dispatch::all_reduce(&cx, &self.plan, buf, op)).await
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
        drive(&cx, dispatch::all_reduce(&cx, &self.plan, buf, op)).await
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
        drive(&cx, dispatch::broadcast(&cx, &self.plan, buf, root)).await
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
        drive(&cx, dispatch::all_gather(&cx, &self.plan, input, out)).await
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
        drive(&cx, dispatch::reduce(&cx, &self.plan, buf, root, op)).await
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
        drive(&cx, dispatch::all_gather(&cx, &self.plan, input, out)).await
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
        drive(&cx, dispatch::gather(&cx, &self.plan, input, root)).await
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
        drive(&cx, dispatch::scatter(&cx, &self.plan, input, out, root)).await
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
        drive(
            &cx,
            dispatch::reduce_scatter(&cx, &self.plan, input, out, op),
        )
        .await
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
        drive(&cx, dispatch::all_to_all(&cx, &self.plan, input, out)).await
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
    fn spawn_op<C, R, F>(&self, cx: Result<C>, body: impl FnOnce(C, Arc<PlanCell>) -> F) -> Work<R>
    where
        R: Send + 'static,
        F: std::future::Future<Output = Result<R>> + Send + 'static,
    {
        let rt = &self.comm.sh().rt;
        match cx {
            Ok(cx) => Work::spawn(rt, body(cx, self.plan.clone())),
            Err(e) => Work::spawn(rt, async move { Err(e) }),
        }
    }

    /// Starts a barrier; see [`ProcessGroup::all_reduce_async`].
    pub fn barrier_async(&self) -> Work<()> {
        self.spawn_op(self.begin_barrier(), |cx, plan| async move {
            drive(&cx, dispatch::barrier(&cx, &plan)).await
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
        self.spawn_op(cx, |cx, plan| async move {
            let mut buf = buf;
            drive(&cx, dispatch::all_reduce(&cx, &plan, &mut buf, op)).await?;
            Ok(buf)
        })
    }

    /// Starts a broadcast; see [`ProcessGroup::all_reduce_async`].
    pub fn broadcast_async<T: Element>(&self, buf: Vec<T>, root: usize) -> Work<Vec<T>> {
        // SAFETY: as in `all_reduce_async`.
        let cx = self
            .begin_broadcast::<T>(buf.len(), root)
            .map(|cx| unsafe { cx.allow_posting() });
        self.spawn_op(cx, |cx, plan| async move {
            let mut buf = buf;
            drive(&cx, dispatch::broadcast(&cx, &plan, &mut buf, root)).await?;
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
            |cx, plan| async move {
                drive(&cx, dispatch::reduce(&cx, &plan, &mut buf, root, op)).await?;
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
        self.spawn_op(cx, |cx, plan| async move {
            let mut out = vec![T::from_i8(0); input.len() * n];
            drive(&cx, dispatch::all_gather(&cx, &plan, &input, &mut out)).await?;
            Ok(out)
        })
    }

    /// Starts an all-gather of varying sizes (it takes two sequence
    /// numbers); see [`ProcessGroup::all_reduce_async`].
    pub fn all_gather_varying_async<T: Element>(&self, input: Vec<T>) -> Work<Vec<Vec<T>>> {
        let pg = self.clone();
        self.spawn_op(
            self.begin_all_gather_varying(),
            |(lens, seq), _| async move { all_gather_varying_impl(&pg, lens, seq, &input).await },
        )
    }

    /// Starts a gather to `root` (`Some` there, `None` elsewhere); see
    /// [`ProcessGroup::all_reduce_async`].
    pub fn gather_async<T: Element>(&self, input: Vec<T>, root: usize) -> Work<Option<Vec<T>>> {
        self.spawn_op(
            self.begin_gather::<T>(input.len(), root),
            |cx, plan| async move { drive(&cx, dispatch::gather(&cx, &plan, &input, root)).await },
        )
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
        self.spawn_op(cx, |cx, plan| async move {
            let mut out = vec![T::from_i8(0); len];
            let input = input.filter(|_| cx.me() == root).unwrap_or_default();
            drive(&cx, dispatch::scatter(&cx, &plan, &input, &mut out, root)).await?;
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
        self.spawn_op(cx, |cx, plan| async move {
            let mut out = vec![T::from_i8(0); input.len() / n];
            drive(
                &cx,
                dispatch::reduce_scatter(&cx, &plan, &input, &mut out, op),
            )
            .await?;
            Ok(out)
        })
    }

    /// Starts an all-to-all; see [`ProcessGroup::all_reduce_async`].
    pub fn all_to_all_async<T: Element>(&self, input: Vec<T>) -> Work<Vec<T>> {
        self.spawn_op(
            self.begin_all_to_all::<T>(input.len()),
            |cx, plan| async move {
                let mut out = vec![T::from_i8(0); input.len()];
                drive(&cx, dispatch::all_to_all(&cx, &plan, &input, &mut out)).await?;
                Ok(out)
            },
        )
    }

    /// Starts a send; see [`ProcessGroup::all_reduce_async`].
    pub fn send_async<T: Element>(&self, data: Vec<T>, dst: usize, tag: u32) -> Work<()> {
        self.spawn_op(
            self.begin_send::<T>(data.len(), dst, tag),
            |cx, _| async move { drive(&cx, algo::send_message(&cx, dst, &data)).await },
        )
    }

    /// Starts a receive of `len` elements; see [`ProcessGroup::all_reduce_async`].
    pub fn recv_async<T: Element>(&self, len: usize, src: usize, tag: u32) -> Work<Vec<T>> {
        self.spawn_op(self.begin_recv::<T>(len, src, tag), |cx, _| async move {
            let mut out = vec![T::from_i8(0); len];
            drive(&cx, algo::recv_message(&cx, src, &mut out)).await?;
            Ok(out)
        })
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
        dispatch::all_gather(&lens, &pg.plan, &[input.len() as u64], &mut all_lens),
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
        cx.never_ran();
        return Err(e);
    }
    let mut all = vec![T::from_i8(0); at];
    drive(
        &cx,
        dispatch::all_gather_in(&cx, &pg.plan, input, &bounds, &mut all),
    )
    .await?;
    Ok(bounds.into_iter().map(|b| all[b].to_vec()).collect())
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Ranks `0..hosts.len()` of one world in this process, rank `k` on
    /// host `hosts[k]` (as far as shared memory is concerned).
    async fn world(hosts: &[&str]) -> Vec<ProcessGroup> {
        let store: Arc<dyn Store> = Arc::new(rallypoint_store::MemoryStore::new());
        let n = hosts.len();
        let joins: Vec<_> = hosts
            .iter()
            .enumerate()
            .map(|(r, h)| {
                let o = Options {
                    advertise: Some(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)),
                    host_id: Some((*h).to_owned()),
                    timeout: Duration::from_secs(30),
                    ..Options::default()
                };
                tokio::spawn(ProcessGroup::new(store.clone(), r, n, o))
            })
            .collect();
        let mut pgs = Vec::new();
        for j in joins {
            pgs.push(j.await.unwrap().unwrap());
        }
        pgs
    }

    /// On every rank: a subgroup of all, one all_reduce and one broadcast
    /// on it, then dropped.
    async fn a_group_used_and_dropped(pgs: &[ProcessGroup]) {
        let all: Vec<usize> = (0..pgs.len()).collect();
        let runs: Vec<_> = pgs
            .iter()
            .map(|pg| {
                let sub = pg.new_group(&all).unwrap().unwrap();
                tokio::spawn(async move {
                    let mut v = [1.0f32; 64];
                    sub.all_reduce(&mut v, ReduceOp::Sum).await.unwrap();
                    sub.broadcast(&mut v, 0).await.unwrap();
                    sub.shared_memory().unwrap() || sub.two_level().unwrap()
                })
            })
            .collect();
        for r in runs {
            assert!(r.await.unwrap(), "the subgroup ran over shared memory");
        }
    }

    /// What this process's descriptors name (regions are memfds, peers'
    /// processes pidfds), but sockets: the world's connections are opened
    /// on demand (a probe of a late peer, say) and kept for every group.
    fn open_fds() -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .map(|p| p.display().to_string())
            .filter(|p| !p.starts_with("socket:"))
            .collect();
        v.sort();
        v
    }

    /// `new_group` in a loop: every group's state here (its members, its
    /// router entries, abort signals, regions and internal groups) goes
    /// with its last handle, so nothing grows.
    async fn dropped_groups_leave_nothing_behind(hosts: &[&str]) {
        let pgs = world(hosts).await;
        a_group_used_and_dropped(&pgs).await;
        let before: Vec<_> = pgs.iter().map(|pg| pg.comm.sh().group_tables()).collect();
        let fds = open_fds();
        for _ in 0..20 {
            a_group_used_and_dropped(&pgs).await;
        }
        let after: Vec<_> = pgs.iter().map(|pg| pg.comm.sh().group_tables()).collect();
        assert_eq!(after, before, "per-group tables grew");
        assert_eq!(open_fds(), fds, "descriptors were left open");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dropped_groups_over_shared_memory_leave_nothing_behind() {
        dropped_groups_leave_nothing_behind(&["a", "a"]).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dropped_groups_in_two_levels_leave_nothing_behind() {
        dropped_groups_leave_nothing_behind(&["a", "a", "b", "b"]).await;
    }

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
        pg.comm
            .sh()
            .abort(pg.comm.id, found, Origin::Here, cx.seq());
        assert!(cx.finish(Ok(Ok(()))).await.is_err());
        let keys = store.list_keys().await.unwrap();
        assert!(
            keys.iter().any(|k| k.contains("/abort/")),
            "the op returned before its abort was recorded: {keys:?}"
        );
    }
}
