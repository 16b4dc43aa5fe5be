//! The collectives over a shared-memory region, in rounds (see `shm`).
//!
//! A round moves at most a half slot per rank. Each rank copies its part in,
//! every rank meets at a stage, and each copies (or reduces) out what it
//! needs straight from the others' halves: one copy in and one copy out per
//! byte, no staging through sockets.
//!
//! | op | a round |
//! |---|---|
//! | barrier | one stage, no data |
//! | broadcast | the root writes; a stage; the others read |
//! | all_reduce, small | all write; a stage; each reduces every half in rank order (the same on all ranks, so results agree to the bit); with 2 ranks and an op that commutes, each reduces the other's half into its own buffer (one pass less) |
//! | all_reduce, larger | all write the parts the others sum; a stage; rank `r` sums part `r` of every other half into its own buffer, a block at a time, and copies each block into its half; a stage; all read the others' summed parts (rounds of at most [`SHARED_CORE_ROUND`] when ranks take turns on cores) |
//! | reduce | as all_reduce, only the root reads; split, each rank writes its whole buffer and sums in its half (the others' buffers stay as they were) |
//! | all_gather (equal or varying), gather | all write; a stage; all (or the root) read every half |
//! | scatter | the root writes every rank's part; a stage; each reads its own |
//! | reduce_scatter | all write every part; a stage; rank `r` reduces part `r` of every half |
//! | all_to_all | all write every part; a stage; rank `r` reads part `r` of every half |

use std::ops::Range;
use std::sync::Arc;

use super::{shares_cores, Arena, Round};
use crate::algorithms::even_bounds;
use crate::element::{Element, ReduceOp};
use crate::error::Result;
use crate::op::OpCtx;

/// All-reduces of more bytes than this (or than a half), on 2 or more
/// ranks, split the reduction across ranks (two stages a round): each reads
/// its part of every half instead of all of them. Two ranks split too: each
/// then moves a fifth fewer bytes than when it copies its whole round in
/// and reduces the other's (about 7% faster at 64 MiB here, though 10–15%
/// slower while the host slows transfers between cores: the extra stage a
/// round crosses cores; `docs/notes/collectives-shared-memory.md`).
pub const SPLIT_ABOVE: usize = 64 << 10;

/// A split all-reduce's (or reduce's) round, per rank, when ranks take
/// turns on cores (`shares_cores`): at most this many bytes, however
/// large the half.
/// Two ranks on each core then keep their rounds (their buffer's piece and
/// the parts they sum) within the core's caches while they alternate: at 4
/// ranks on 2 cores, 64 MiB took 19.3–19.7 ms in rounds of 256 KiB against
/// 20.3–21.3 in rounds of 1 MiB (128 KiB: 21.9). Only the split
/// reductions: broadcast and all_gather were 30–50% slower in rounds of
/// 256 KiB there, and a rank per core keeps the 1 MiB half
/// (`docs/notes/collectives-shared-memory.md`).
pub const SHARED_CORE_ROUND: usize = 256 << 10;

/// The bytes a rank moves a round in a split shared-memory all-reduce of
/// `ranks` with halves of `slot` bytes on this host: the half, or at most
/// [`SHARED_CORE_ROUND`] when ranks take turns on cores. The region's
/// creator decides (it writes the choice into the region for the others:
/// ranks in different cgroups may count different CPUs, and all must run
/// the same rounds).
pub fn split_round_bytes(ranks: usize, slot: usize) -> usize {
    if shares_cores(ranks) {
        slot.min(SHARED_CORE_ROUND)
    } else {
        slot
    }
}

/// `len` elements in rounds of at most `per` (one empty round for none).
fn rounds(len: usize, per: usize) -> Vec<Range<usize>> {
    if len == 0 {
        return std::iter::once(0..0).collect();
    }
    (0..len)
        .step_by(per.max(1))
        .map(|s| s..(s + per).min(len))
        .collect()
}

/// Whether `a op b` and `b op a` agree to the bit: integers always; floats
/// for sums and products (IEEE addition and multiplication commute, NaN
/// payloads aside), not for min and max (which of +0 and −0 is kept
/// depends on the order).
fn commutes<T: Element>(op: ReduceOp) -> bool {
    !T::DTYPE.is_float() || matches!(op, ReduceOp::Sum | ReduceOp::Avg | ReduceOp::Product)
}

/// Whether a reduction of `bytes` on `n` ranks splits (see [`SPLIT_ABOVE`];
/// a buffer larger than a half splits too, so small halves reach it).
fn split(n: usize, bytes: usize, slot: usize) -> bool {
    n >= 2 && bytes > SPLIT_ABOVE.min(slot)
}

pub(crate) async fn barrier(a: &Arc<Arena>, cx: &OpCtx) -> Result<()> {
    let mut r = Round::begin(a, cx).await?;
    r.stage().await?;
    r.end();
    Ok(())
}

pub(crate) async fn broadcast<T: Element>(
    a: &Arc<Arena>,
    cx: &OpCtx,
    buf: &mut [T],
    root: usize,
) -> Result<()> {
    let mut r = Round::begin(a, cx).await?;
    let me = a.me;
    for c in rounds(buf.len(), r.fits::<T>()) {
        let len = c.len();
        if me == root {
            // SAFETY: the root's half is written by it alone before the stage.
            unsafe { r.view_mut::<T>(me, len) }.copy_from_slice(&buf[c.clone()]);
        }
        r.stage().await?;
        if me != root {
            // SAFETY: written before the stage; rewritten two rounds on.
            buf[c].copy_from_slice(unsafe { r.view::<T>(root, len) });
        }
        r.next();
    }
    r.end();
    Ok(())
}

/// All-reduce (`root` `None`) or reduce to `root`: other ranks' buffers
/// are left as they were. An all-reduce that fails part-way may leave a
/// rank's buffer with some parts summed (split, a rank sums its own part in
/// place before the second stage).
pub(crate) async fn reduce<T: Element>(
    a: &Arc<Arena>,
    cx: &OpCtx,
    buf: &mut [T],
    op: ReduceOp,
    root: Option<usize>,
) -> Result<()> {
    let mut r = Round::begin(a, cx).await?;
    let (n, me) = (a.n, a.me);
    let reads = root.is_none_or(|x| x == me);
    let split = split(n, std::mem::size_of_val(buf), a.slot);
    // An all-reduce overwrites every buffer with the result, so a rank can
    // sum its part in its own buffer (its input is there already) and copy
    // in only what the others sum. A reduce leaves the others' buffers as
    // they were: they sum in their half.
    let in_place = root.is_none();
    let per = if split {
        (a.split_round / std::mem::size_of::<T>()).max(1)
    } else {
        r.fits::<T>()
    };
    for c in rounds(buf.len(), per) {
        let len = c.len();
        let out = &mut buf[c];
        let parts = if split { even_bounds(len, n) } else { vec![] };
        {
            // SAFETY: this rank's half, read by others only after the stage.
            let half = unsafe { r.view_mut::<T>(me, len) };
            if split && in_place {
                for (k, q) in parts.iter().enumerate() {
                    if k != me {
                        half[q.clone()].copy_from_slice(&out[q.clone()]);
                    }
                }
            } else {
                half.copy_from_slice(out);
            }
        }
        r.stage().await?;
        if split {
            let p = parts[me].clone();
            {
                // SAFETY: part `me` of every half is read by this rank only,
                // and written (in its own half) by it only, until the stage.
                let mine = &mut unsafe { r.view_mut::<T>(me, len) }[p.clone()];
                let others: Vec<&[T]> = (0..n)
                    .filter(|&k| k != me)
                    // SAFETY: as above: others' parts `p` are only read.
                    .map(|k| &unsafe { r.view::<T>(k, len) }[p.clone()])
                    .collect();
                if in_place {
                    sum_parts(op, n, &mut out[p.clone()], &others, Some(mine));
                } else {
                    sum_parts(op, n, mine, &others, None);
                }
            }
            r.stage().await?;
            if reads {
                for (k, q) in parts.into_iter().enumerate() {
                    if in_place && k == me {
                        continue;
                    }
                    // SAFETY: reduced before the second stage.
                    out[q.clone()].copy_from_slice(&unsafe { r.view::<T>(k, len) }[q]);
                }
            }
        } else if reads && n == 2 && commutes::<T>(op) {
            // Two ranks: this rank's buffer still holds its input, so one
            // pass reduces the other's half into it (a0 op a1 on one rank,
            // a1 op a0 on the other: the same, since the op commutes).
            // SAFETY: written before the stage.
            T::reduce(op, out, unsafe { r.view::<T>(1 - me, len) });
            if op == ReduceOp::Avg {
                T::divide(out, n);
            }
        } else if reads {
            // SAFETY: every half was written before the stage.
            out.copy_from_slice(unsafe { r.view::<T>(0, len) });
            for k in 1..n {
                // SAFETY: as above.
                T::reduce(op, out, unsafe { r.view::<T>(k, len) });
            }
            if op == ReduceOp::Avg {
                T::divide(out, n);
            }
        }
        r.next();
    }
    r.end();
    Ok(())
}

/// Elements summed at a time: the accumulator's block stays in L1 while
/// every other part's block is added to it.
const BLOCK_BYTES: usize = 8 << 10;

/// `acc op= others[0] op= others[1] ...` (then `/ n` for an average), a
/// block at a time, so the accumulator is read and written once, not once
/// per other part; each finished block is also copied to `copy` (the half
/// the others read it from).
fn sum_parts<T: Element>(
    op: ReduceOp,
    n: usize,
    acc: &mut [T],
    others: &[&[T]],
    mut copy: Option<&mut [T]>,
) {
    let block = (BLOCK_BYTES / std::mem::size_of::<T>()).max(1);
    for at in (0..acc.len()).step_by(block) {
        let b = at..(at + block).min(acc.len());
        let acc = &mut acc[b.clone()];
        for other in others {
            T::reduce(op, acc, &other[b.clone()]);
        }
        if op == ReduceOp::Avg {
            T::divide(acc, n);
        }
        if let Some(copy) = copy.as_deref_mut() {
            copy[b].copy_from_slice(acc);
        }
    }
}

/// Every rank's `input` into `out` at `bounds[rank]` (all ranks, or only
/// where `out` is given: the root of a gather).
pub(crate) async fn gather<T: Element>(
    a: &Arc<Arena>,
    cx: &OpCtx,
    input: &[T],
    bounds: &[Range<usize>],
    mut out: Option<&mut [T]>,
) -> Result<()> {
    let mut r = Round::begin(a, cx).await?;
    let me = a.me;
    let longest = bounds.iter().map(|b| b.len()).max().unwrap_or(0);
    let within = |c: &Range<usize>, len: usize| c.start.min(len)..c.end.min(len);
    for c in rounds(longest, r.fits::<T>()) {
        let m = within(&c, input.len());
        // SAFETY: this rank's half, read by others only after the stage.
        unsafe { r.view_mut::<T>(me, m.len()) }.copy_from_slice(&input[m]);
        r.stage().await?;
        if let Some(out) = out.as_deref_mut() {
            for (k, b) in bounds.iter().enumerate() {
                let t = within(&c, b.len());
                let at = b.start + t.start;
                // SAFETY: written before the stage.
                out[at..at + t.len()].copy_from_slice(unsafe { r.view::<T>(k, t.len()) });
            }
        }
        r.next();
    }
    r.end();
    Ok(())
}

/// The ops where every rank holds one part per rank (`k` elements each):
/// each round, a writer puts up to `per` elements of every part into its
/// half, part `j` at `j * per`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Parts {
    /// The root's `input` part `j` to rank `j`.
    Scatter { root: usize },
    /// Part `r` of every rank's input, reduced, to rank `r`.
    ReduceScatter(ReduceOp),
    /// Part `r` of rank `j`'s input to part `j` of rank `r`'s output.
    AllToAll,
}

pub(crate) async fn parts<T: Element>(
    a: &Arc<Arena>,
    cx: &OpCtx,
    how: Parts,
    input: &[T],
    out: &mut [T],
    k: usize,
) -> Result<()> {
    let mut r = Round::begin(a, cx).await?;
    let (n, me) = (a.n, a.me);
    let per = (r.fits::<T>() / n).max(1);
    let writes = match how {
        Parts::Scatter { root } => root == me,
        _ => true,
    };
    for c in rounds(k, per) {
        let len = c.len();
        if writes {
            // SAFETY: this rank's half (n parts of `per` fit), read by
            // others only after the stage.
            let half = unsafe { r.view_mut::<T>(me, n * per) };
            for j in 0..n {
                half[j * per..j * per + len]
                    .copy_from_slice(&input[j * k + c.start..j * k + c.end]);
            }
        }
        r.stage().await?;
        // SAFETY: every part read below was written before the stage.
        let part = |j: usize| &unsafe { r.view::<T>(j, n * per) }[me * per..me * per + len];
        match how {
            Parts::Scatter { root } => out[c].copy_from_slice(part(root)),
            Parts::ReduceScatter(op) => {
                let o = &mut out[c];
                o.copy_from_slice(part(0));
                for j in 1..n {
                    T::reduce(op, o, part(j));
                }
                if op == ReduceOp::Avg {
                    T::divide(o, n);
                }
            }
            Parts::AllToAll => {
                for j in 0..n {
                    out[j * k + c.start..j * k + c.end].copy_from_slice(part(j));
                }
            }
        }
        r.next();
    }
    r.end();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_cover_the_buffer_once_and_empty_buffers_get_one() {
        assert_eq!(rounds(0, 4).len(), 1);
        assert!(rounds(0, 4)[0].is_empty());
        assert_eq!(rounds(9, 4), vec![0..4, 4..8, 8..9]);
        assert_eq!(rounds(8, 4), vec![0..4, 4..8]);
    }

    /// Block by block gives what one pass per part gives, to the bit, for
    /// parts of several blocks and a remainder, with and without the copy,
    /// and for an average (divided once, after every part).
    #[test]
    fn summing_parts_by_blocks_is_summing_them_whole() {
        let block = BLOCK_BYTES / 4;
        for len in [0, 1, block - 1, block, 3 * block + 7] {
            let val = |k: usize, i: usize| ((i * 7 + k * 3) % 11) as f32 * 0.25 - 1.0;
            let others: Vec<Vec<f32>> = (1..4)
                .map(|k| (0..len).map(|i| val(k, i)).collect())
                .collect();
            let refs: Vec<&[f32]> = others.iter().map(|o| o.as_slice()).collect();
            for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Avg] {
                let mut want: Vec<f32> = (0..len).map(|i| val(0, i)).collect();
                for o in &others {
                    f32::reduce(op, &mut want, o);
                }
                if op == ReduceOp::Avg {
                    f32::divide(&mut want, 4);
                }
                let mut acc: Vec<f32> = (0..len).map(|i| val(0, i)).collect();
                let mut copy = vec![f32::NAN; len];
                sum_parts(op, 4, &mut acc, &refs, Some(&mut copy));
                assert_eq!(acc, want, "{op} of {len}");
                assert_eq!(copy, want, "{op} of {len}, the copy");
                let mut alone: Vec<f32> = (0..len).map(|i| val(0, i)).collect();
                sum_parts(op, 4, &mut alone, &refs, None);
                assert_eq!(alone, want, "{op} of {len}, no copy");
            }
        }
    }
}
