//! The algorithms, written against [`OpCtx`]'s keyed send and receive: one
//! family per file, and which one an op takes in [`choice`].
//!
//! Every payload larger than a segment is cut into segments, and each
//! (phase, segment) pair has its own step key, `phase * stride + segment`, so a
//! receiver never depends on arrival order. The ring and chain size their
//! segments by the buffer (`OpCtx::seg_for`: a quarter of each rank's share,
//! 256 KiB to `segment_bytes`), the others use `segment_bytes`; an op that
//! runs a second algorithm after the ring (a reduce's gather) uses the ring's
//! segments, so the strides agree and the keys of the two never meet. The ring and chain algorithms are
//! pipelined at segment granularity: a segment received (and reduced) in one
//! phase is forwarded at once, while the connection's reader task is already
//! receiving the next one, so reduction overlaps transfer.
//!
//! | file | family | ops |
//! |---|---|---|
//! | `dissemination.rs` | dissemination, `⌈lg n⌉` rounds | barrier |
//! | `tree.rs` | binomial tree, pipelined by segment | barrier, broadcast, reduce, all_reduce |
//! | `chain.rs` | pipelined chain | broadcast |
//! | `ring.rs` | segmented, pipelined ring | all_reduce, reduce, all_gather, reduce_scatter |
//! | `doubling.rs` | recursive doubling | all_reduce |
//! | `direct.rs` | to, from or between every pair directly | gather, scatter, all_to_all, messages |
//!
//! This file holds what they share: segments, chunk bounds, step keys, and
//! sending or receiving a run of segments.

use std::ops::Range;

use crate::element::{Element, ReduceOp};
use crate::error::Result;
use crate::op::OpCtx;

mod chain;
pub(crate) mod choice;
mod direct;
mod dissemination;
mod doubling;
mod posted;
mod ring;
mod tree;

pub(crate) use chain::chain_broadcast;
pub(crate) use direct::{
    all_to_all_pairwise, gather_direct, recv_message, scatter_direct, send_message, send_to_root,
};
pub(crate) use dissemination::barrier_dissemination;
pub(crate) use doubling::recursive_doubling;
pub(crate) use ring::{ring_all_gather, ring_all_reduce, ring_reduce, ring_reduce_scatter};
pub(crate) use tree::{barrier_tree, tree_all_reduce, tree_broadcast, tree_reduce};

/// Segments of a `len`-element payload (at least one, so empty payloads still
/// send one frame and receivers have something to wait for).
pub(crate) fn nseg(len: usize, seg: usize) -> usize {
    len.div_ceil(seg).max(1)
}

pub(super) fn seg_range(b: &Range<usize>, seg: usize, s: usize) -> Range<usize> {
    let lo = (b.start + s * seg).min(b.end);
    lo..(lo + seg).min(b.end)
}

/// `n` chunks of `len` elements, as even as possible.
pub(crate) fn even_bounds(len: usize, n: usize) -> Vec<Range<usize>> {
    (0..n).map(|i| i * len / n..(i + 1) * len / n).collect()
}

/// Equal chunks of `k` elements.
pub(crate) fn equal_bounds(k: usize, n: usize) -> Vec<Range<usize>> {
    (0..n).map(|i| i * k..(i + 1) * k).collect()
}

/// Step keys for `phases` phases of up to `stride` segments.
pub(super) struct Steps {
    stride: usize,
}

impl Steps {
    pub(super) fn new(cx: &OpCtx, phases: usize, stride: usize) -> Result<Steps> {
        cx.check_steps(phases, stride)?;
        Ok(Steps { stride })
    }

    pub(super) fn at(&self, phase: usize, seg: usize) -> u32 {
        (phase * self.stride + seg) as u32
    }
}

pub(super) async fn send_segs<T: Element>(
    cx: &OpCtx,
    to: usize,
    steps: &Steps,
    phase: usize,
    data: &[T],
) -> Result<()> {
    let seg = cx.seg::<T>();
    let all = 0..data.len();
    for s in 0..nseg(data.len(), seg) {
        cx.send(to, steps.at(phase, s), &data[seg_range(&all, seg, s)])
            .await?;
    }
    Ok(())
}

pub(super) async fn recv_segs<T: Element>(
    cx: &OpCtx,
    from: usize,
    steps: &Steps,
    phase: usize,
    out: &mut [T],
    reduce: Option<ReduceOp>,
) -> Result<()> {
    let seg = cx.seg::<T>();
    let all = 0..out.len();
    for s in 0..nseg(out.len(), seg) {
        let r = seg_range(&all, seg, s);
        match reduce {
            Some(op) => {
                cx.recv_reduce(from, steps.at(phase, s), &mut out[r], op)
                    .await?
            }
            None => cx.recv_copy(from, steps.at(phase, s), &mut out[r]).await?,
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_partition() {
        for len in [0, 1, 7, 100] {
            for n in 1..=9 {
                let b = even_bounds(len, n);
                assert_eq!(b[0].start, 0);
                assert_eq!(b[n - 1].end, len);
                assert!(b.windows(2).all(|w| w[0].end == w[1].start));
            }
        }
        assert_eq!(nseg(0, 4), 1);
        assert_eq!(nseg(9, 4), 3);
        assert_eq!(seg_range(&(10..19), 4, 2), 18..19);
    }
}
