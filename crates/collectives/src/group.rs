//! The process group: the public API.
//!
//! | file | what it owns |
//! |---|---|
//! | `group.rs` | [`ProcessGroup`]: its state, accessors, subgroups, and how an op begins (its number, its call checked, a mismatch found as it begins) |
//! | `bootstrap.rs` | forming a group from a store, a URL or the environment |
//! | `reform.rs` | a group whose members change: each generation over the last one's connections |
//! | `lineage.rs` | who keeps their connections at a generation's round, decided alike by every member |
//! | `ops.rs` | the collectives, messages and object collectives |
//! | `work.rs` | the `*_async` forms and [`Work`] |
//! | `started.rs` | the `start_*` forms, numbered when called |

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rallypoint_auth::RefusalCounts;
use rallypoint_sync::MutexExt;

use crate::algorithms as algo;
use crate::algorithms::choice;
use crate::element::{Element, ReduceOp};
use crate::error::{Error, Result};
use crate::frame::{Algo, Desc, OpKind, HIST_NONE};
use crate::hash::stable_hash;
use crate::op::{Comm, OpCtx};
use crate::options::{AllReduceAlgorithm, BroadcastAlgorithm};
use crate::plan::{Plan, PlanCell};
use crate::transport::{Members, Origin};

mod bootstrap;
mod lineage;
mod ops;
mod reform;
mod started;
#[cfg(test)]
mod tests;
mod work;

pub use bootstrap::route_ip;
pub use work::Work;

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

impl ProcessGroup {
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

    /// Connections this rank's listener refused: bad hellos, and those the
    /// job-secret handshake refused ([`ProcessGroup::secret_refusals`]).
    pub fn refused_connections(&self) -> u64 {
        self.comm.sh().refused()
    }

    /// Connections this rank's listener refused at the job-secret handshake
    /// ([`crate::Options::secret`]), by kind: a wrong proof, not the
    /// handshake at all (no secret, junk), unfinished (stalled past its
    /// deadline, closed). Each was also logged, naming the peer. Zero
    /// without a secret. Shared by every group over this rank's transport.
    pub fn secret_refusals(&self) -> RefusalCounts {
        self.comm.sh().secret_refusals()
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
    /// [`crate::Options::receive_window`] (plus the frames of operations this rank
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
            let mut s = self.comm.subgroups.locked();
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
            let mut m = c.p2p.locked();
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
}
