//! Which algorithm each op takes over TCP, in one table.
//!
//! Four ops have two algorithms: one for small inputs (few rounds, latency
//! bound) and one for large (least bytes per link, bandwidth bound); the
//! others have one, in both columns. The table says which, and what "small"
//! measures: the payload against
//! [`Options::small_bytes`](crate::Options::small_bytes) (64 KiB), or, for the
//! barrier, the group's ranks against
//! [`Options::dissemination_max_ranks`](crate::Options::dissemination_max_ranks)
//! (64: past it a dissemination barrier would connect every rank to
//! `2⌈lg n⌉` peers, where the tree keeps each at its parent and children).
//! Every rank of a group computes the same choice from the same call (the
//! handshake refuses peers whose limits differ), and the choice travels in
//! each frame's descriptor, so ranks that override it differently
//! (`with_*_algorithm` on some ranks only) are a mismatch, not a hang.
//!
//! [`ProcessGroup::with_all_reduce_algorithm`](crate::ProcessGroup::with_all_reduce_algorithm)
//! and [`ProcessGroup::with_broadcast_algorithm`](crate::ProcessGroup::with_broadcast_algorithm)
//! override the table. A group over shared memory has one algorithm per op
//! (`shm/ops.rs`), and one on several hosts runs some ops in two levels
//! (`two_level.rs`).

use crate::frame::{Algo, OpKind};

/// What decides between an op's small and large algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum By {
    /// The payload in bytes, against `small_bytes`.
    Bytes,
    /// The group's ranks, against `dissemination_max_ranks`.
    Ranks,
}

/// (op, what decides, small, large). The segment sizes are measured in
/// `docs/notes/collectives-tcp.md`; the small-to-large cut-over is
/// [`crate::Options::small_bytes`] (64 KiB by default; not measured here).
const TABLE: [(OpKind, By, Algo, Algo); 11] = [
    (OpKind::Barrier, By::Ranks, Algo::Dissemination, Algo::Tree),
    (OpKind::Broadcast, By::Bytes, Algo::Tree, Algo::Chain),
    (
        OpKind::AllReduce,
        By::Bytes,
        Algo::RecursiveDoubling,
        Algo::Ring,
    ),
    (OpKind::Reduce, By::Bytes, Algo::Tree, Algo::Ring),
    (OpKind::AllGather, By::Bytes, Algo::Ring, Algo::Ring),
    (OpKind::AllGatherV, By::Bytes, Algo::Ring, Algo::Ring),
    (OpKind::ReduceScatter, By::Bytes, Algo::Ring, Algo::Ring),
    (OpKind::Gather, By::Bytes, Algo::Direct, Algo::Direct),
    (OpKind::Scatter, By::Bytes, Algo::Direct, Algo::Direct),
    (OpKind::AllToAll, By::Bytes, Algo::Direct, Algo::Direct),
    (OpKind::Send, By::Bytes, Algo::Direct, Algo::Direct),
];

/// The limits the table compares with.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub small_bytes: usize,
    pub dissemination_max_ranks: usize,
}

/// The algorithm for `op` of `bytes` in a group of `ranks`.
pub(crate) fn choose(op: OpKind, ranks: usize, bytes: usize, l: Limits) -> Algo {
    let (_, by, small, large) = TABLE
        .iter()
        .find(|row| row.0 == op)
        .copied()
        .unwrap_or_else(|| unreachable!("every op has a row (tested)"));
    // A chain of two ranks is the tree of two.
    if op == OpKind::Broadcast && ranks <= 2 {
        return small;
    }
    let is_small = match by {
        By::Bytes => bytes <= l.small_bytes,
        By::Ranks => ranks <= l.dissemination_max_ranks,
    };
    if is_small {
        small
    } else {
        large
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const L: Limits = Limits {
        small_bytes: 64 << 10,
        dissemination_max_ranks: 64,
    };

    #[test]
    fn every_op_has_one_row() {
        for op in OpKind::ALL {
            assert_eq!(TABLE.iter().filter(|r| r.0 == op).count(), 1, "{op:?}");
        }
    }

    #[test]
    fn the_cut_overs() {
        use OpKind::*;
        assert_eq!(choose(AllReduce, 4, 64 << 10, L), Algo::RecursiveDoubling);
        assert_eq!(choose(AllReduce, 4, (64 << 10) + 1, L), Algo::Ring);
        assert_eq!(choose(Broadcast, 4, 1 << 20, L), Algo::Chain);
        assert_eq!(choose(Broadcast, 2, 1 << 20, L), Algo::Tree);
        assert_eq!(choose(Broadcast, 4, 4, L), Algo::Tree);
        assert_eq!(choose(Reduce, 4, 1 << 20, L), Algo::Ring);
        assert_eq!(choose(Barrier, 64, 0, L), Algo::Dissemination);
        assert_eq!(choose(Barrier, 65, 0, L), Algo::Tree);
        assert_eq!(choose(AllToAll, 4, 1 << 30, L), Algo::Direct);
    }
}
