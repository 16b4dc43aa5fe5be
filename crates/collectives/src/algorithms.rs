//! The algorithms, written against [`OpCtx`]'s keyed send and receive.
//!
//! Every payload larger than the segment size is cut into segments, and each
//! (phase, segment) pair has its own step key, `phase * stride + segment`, so a
//! receiver never depends on arrival order. The ring algorithms are pipelined at
//! segment granularity: a segment received and reduced in one phase is forwarded
//! at once, while the connection's reader task is already receiving the next one,
//! so reduction overlaps transfer.
//!
//! | op | small | large |
//! |---|---|---|
//! | barrier | dissemination (`⌈lg n⌉` rounds) | binomial tree up and down when `n` > 64, to keep connections at `n − 1` |
//! | broadcast | binomial tree | pipelined chain |
//! | all_reduce | recursive doubling (`lg n` exchanges, extra ranks folded in) | ring: reduce-scatter then all-gather |
//! | reduce | binomial tree | ring reduce-scatter, then each rank's chunk to the root |
//! | all_gather, reduce_scatter | ring | ring |
//! | gather, scatter | direct to or from the root | direct |
//! | all_to_all | pairwise exchange | pairwise exchange |

use std::ops::Range;

use crate::element::{Element, ReduceOp};
use crate::error::Result;
use crate::group::OpCtx;

/// Segments of a `len`-element payload (at least one, so empty payloads still
/// send one frame and receivers have something to wait for).
pub(crate) fn nseg(len: usize, seg: usize) -> usize {
    len.div_ceil(seg).max(1)
}

fn seg_range(b: &Range<usize>, seg: usize, s: usize) -> Range<usize> {
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
struct Steps {
    stride: usize,
}

impl Steps {
    fn new(cx: &OpCtx, phases: usize, stride: usize) -> Result<Steps> {
        cx.check_steps(phases, stride)?;
        Ok(Steps { stride })
    }

    fn at(&self, phase: usize, seg: usize) -> u32 {
        (phase * self.stride + seg) as u32
    }
}

async fn send_segs<T: Element>(
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

async fn recv_segs<T: Element>(
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

/// Dissemination barrier: in round `k` rank `r` signals `r + 2^k` and waits for
/// `r − 2^k`; after `⌈lg n⌉` rounds everyone has heard from everyone.
pub(crate) async fn barrier_dissemination(cx: &OpCtx) -> Result<()> {
    let (n, r) = (cx.n(), cx.me());
    let mut k = 0;
    while (1usize << k) < n {
        let d = 1 << k;
        cx.send::<u8>((r + d) % n, k, &[]).await?;
        cx.recv_copy::<u8>((r + n - d) % n, k, &mut []).await?;
        k += 1;
    }
    Ok(())
}

/// Tree barrier: an empty reduce up a binomial tree, then an empty broadcast down.
pub(crate) async fn barrier_tree(cx: &OpCtx) -> Result<()> {
    tree_reduce::<u8>(cx, &mut [], ReduceOp::Sum, 0, 0).await?;
    tree_broadcast::<u8>(cx, &mut [], 0, 1).await
}

/// The binomial tree around `root`: (parent, children) of this rank, children
/// largest subtree first.
fn binomial(n: usize, r: usize, root: usize) -> (Option<usize>, Vec<usize>) {
    let v = (r + n - root) % n;
    let real = |x: usize| (x + root) % n;
    let low = if v == 0 {
        n.next_power_of_two()
    } else {
        v & v.wrapping_neg()
    };
    let parent = (v != 0).then(|| real(v - low));
    let mut children = Vec::new();
    let mut mask = low >> 1;
    while mask > 0 {
        if v + mask < n {
            children.push(real(v + mask));
        }
        mask >>= 1;
    }
    (parent, children)
}

/// Binomial-tree broadcast, pipelined by segment.
pub(crate) async fn tree_broadcast<T: Element>(
    cx: &OpCtx,
    buf: &mut [T],
    root: usize,
    phase: usize,
) -> Result<()> {
    let (parent, children) = binomial(cx.n(), cx.me(), root);
    let seg = cx.seg::<T>();
    let ns = nseg(buf.len(), seg);
    let steps = Steps::new(cx, phase + 1, ns)?;
    let all = 0..buf.len();
    for s in 0..ns {
        let r = seg_range(&all, seg, s);
        if let Some(p) = parent {
            cx.recv_copy(p, steps.at(phase, s), &mut buf[r.clone()])
                .await?;
        }
        for &c in &children {
            cx.send(c, steps.at(phase, s), &buf[r.clone()]).await?;
        }
    }
    Ok(())
}

/// Binomial-tree reduce into `buf` (the root ends with the result; other ranks
/// with partial sums), pipelined by segment.
pub(crate) async fn tree_reduce<T: Element>(
    cx: &OpCtx,
    buf: &mut [T],
    op: ReduceOp,
    root: usize,
    phase: usize,
) -> Result<()> {
    let (parent, children) = binomial(cx.n(), cx.me(), root);
    let seg = cx.seg::<T>();
    let ns = nseg(buf.len(), seg);
    let steps = Steps::new(cx, phase + 1, ns)?;
    let all = 0..buf.len();
    for s in 0..ns {
        let r = seg_range(&all, seg, s);
        for &c in children.iter().rev() {
            cx.recv_reduce(c, steps.at(phase, s), &mut buf[r.clone()], op)
                .await?;
        }
        if let Some(p) = parent {
            cx.send(p, steps.at(phase, s), &buf[r.clone()]).await?;
        }
    }
    Ok(())
}

/// Pipelined chain broadcast: `root → root+1 → …`, one segment behind another,
/// so every link carries the buffer once.
pub(crate) async fn chain_broadcast<T: Element>(
    cx: &OpCtx,
    buf: &mut [T],
    root: usize,
) -> Result<()> {
    let (n, r) = (cx.n(), cx.me());
    let v = (r + n - root) % n;
    let seg = cx.seg::<T>();
    let ns = nseg(buf.len(), seg);
    let steps = Steps::new(cx, 1, ns)?;
    let all = 0..buf.len();
    for s in 0..ns {
        let rg = seg_range(&all, seg, s);
        if v > 0 {
            cx.recv_copy((r + n - 1) % n, steps.at(0, s), &mut buf[rg.clone()])
                .await?;
        }
        if v + 1 < n {
            cx.send((r + 1) % n, steps.at(0, s), &buf[rg]).await?;
        }
    }
    Ok(())
}

/// Ring reduce-scatter over `bounds`: at step `t` rank `r` sends chunk
/// `r − t − 1` and reduces chunk `r − t − 2` into its buffer, forwarding each
/// reduced segment at once; afterwards chunk `r` holds the full reduction.
/// Uses phases `phase0 .. phase0 + n − 1`.
pub(crate) async fn ring_reduce_scatter<T: Element>(
    cx: &OpCtx,
    buf: &mut [T],
    bounds: &[Range<usize>],
    op: ReduceOp,
    phase0: usize,
) -> Result<()> {
    ring_pass(cx, buf, bounds, Some(op), 1, phase0).await
}

/// Ring all-gather over `bounds`: chunk `r` is this rank's; at step `t` rank `r`
/// sends chunk `r − t` and receives chunk `r − t − 1`, forwarding each segment at
/// once. Uses phases `phase0 .. phase0 + n − 1`.
pub(crate) async fn ring_all_gather<T: Element>(
    cx: &OpCtx,
    buf: &mut [T],
    bounds: &[Range<usize>],
    phase0: usize,
) -> Result<()> {
    ring_pass(cx, buf, bounds, None, 0, phase0).await
}

/// One pass around the ring, the shape both ring phases share: at step `t` rank
/// `r` sends chunk `r − t − shift` to `r + 1` and receives chunk
/// `r − t − 1 − shift` from `r − 1`, reducing it in (`reduce`) or copying it,
/// and forwards each received segment at the next step without waiting for the
/// rest of its chunk.
async fn ring_pass<T: Element>(
    cx: &OpCtx,
    buf: &mut [T],
    bounds: &[Range<usize>],
    reduce: Option<ReduceOp>,
    shift: usize,
    phase0: usize,
) -> Result<()> {
    let (n, r) = (cx.n(), cx.me());
    if n == 1 {
        return Ok(());
    }
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let seg = cx.seg::<T>();
    let segs = |c: usize| nseg(bounds[c].len(), seg);
    let steps = Steps::new(cx, phase0 + n - 1, (0..n).map(segs).max().unwrap_or(1))?;
    let first_out = (r + n - shift) % n;
    for t in 0..n - 1 {
        let cin = (r + 2 * n - t - 1 - shift) % n;
        let m = if t == 0 {
            segs(cin).max(segs(first_out))
        } else {
            segs(cin)
        };
        for s in 0..m {
            if t == 0 && s < segs(first_out) {
                let out = seg_range(&bounds[first_out], seg, s);
                cx.send(next, steps.at(phase0, s), &buf[out]).await?;
            }
            if s < segs(cin) {
                let rg = seg_range(&bounds[cin], seg, s);
                let at = steps.at(phase0 + t, s);
                match reduce {
                    Some(op) => cx.recv_reduce(prev, at, &mut buf[rg.clone()], op).await?,
                    None => cx.recv_copy(prev, at, &mut buf[rg.clone()]).await?,
                }
                if t + 2 < n {
                    cx.send(next, steps.at(phase0 + t + 1, s), &buf[rg]).await?;
                }
            }
        }
    }
    Ok(())
}

/// Ring all-reduce: reduce-scatter, the mean taken on the owned chunk, all-gather.
pub(crate) async fn ring_all_reduce<T: Element>(
    cx: &OpCtx,
    buf: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let n = cx.n();
    let bounds = even_bounds(buf.len(), n);
    ring_reduce_scatter(cx, buf, &bounds, op, 0).await?;
    if op == ReduceOp::Avg {
        T::divide(&mut buf[bounds[cx.me()].clone()], n);
    }
    ring_all_gather(cx, buf, &bounds, n - 1).await
}

/// Recursive doubling: with `p` the largest power of two ≤ `n`, the first
/// `2(n − p)` ranks pair up and the even one folds its data into the odd one;
/// the `p` remaining ranks exchange whole buffers with partners at distance
/// 1, 2, 4, …; then the folded ranks get the result back. Each exchange computes
/// `a ∘ b` on one side and `b ∘ a` on the other, equal for commutative operators,
/// so every rank ends with the same bits.
pub(crate) async fn recursive_doubling<T: Element>(
    cx: &OpCtx,
    buf: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let (n, r) = (cx.n(), cx.me());
    let p = if n.is_power_of_two() {
        n
    } else {
        n.next_power_of_two() / 2
    };
    let rem = n - p;
    let rounds = p.trailing_zeros() as usize;
    let seg = cx.seg::<T>();
    let steps = Steps::new(cx, rounds + 2, nseg(buf.len(), seg))?;
    let vrank = if r < 2 * rem {
        if r % 2 == 0 {
            send_segs(cx, r + 1, &steps, 0, buf).await?;
            None
        } else {
            recv_segs(cx, r - 1, &steps, 0, buf, Some(op)).await?;
            Some(r / 2)
        }
    } else {
        Some(r - rem)
    };
    if let Some(v) = vrank {
        for k in 0..rounds {
            let pv = v ^ (1 << k);
            let partner = if pv < rem { pv * 2 + 1 } else { pv + rem };
            send_segs(cx, partner, &steps, k + 1, buf).await?;
            recv_segs(cx, partner, &steps, k + 1, buf, Some(op)).await?;
        }
        if op == ReduceOp::Avg {
            T::divide(buf, n);
        }
    }
    if r < 2 * rem {
        if r % 2 == 1 {
            send_segs(cx, r - 1, &steps, rounds + 1, buf).await?;
        } else {
            recv_segs(cx, r + 1, &steps, rounds + 1, buf, None).await?;
        }
    }
    Ok(())
}

/// Tree all-reduce: binomial reduce to rank 0, then binomial broadcast.
pub(crate) async fn tree_all_reduce<T: Element>(
    cx: &OpCtx,
    buf: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    tree_reduce(cx, buf, op, 0, 0).await?;
    if op == ReduceOp::Avg && cx.me() == 0 {
        T::divide(buf, cx.n());
    }
    tree_broadcast(cx, buf, 0, 1).await
}

/// Large reduce: ring reduce-scatter, then every rank sends its reduced chunk to
/// the root. `buf` is the root's output or a scratch copy elsewhere.
pub(crate) async fn ring_reduce<T: Element>(
    cx: &OpCtx,
    buf: &mut [T],
    op: ReduceOp,
    root: usize,
) -> Result<()> {
    let (n, r) = (cx.n(), cx.me());
    let bounds = even_bounds(buf.len(), n);
    ring_reduce_scatter(cx, buf, &bounds, op, 0).await?;
    gather_direct(cx, buf, &bounds, root, n - 1).await?;
    if op == ReduceOp::Avg && r == root {
        T::divide(buf, n);
    }
    Ok(())
}

/// Every rank's chunk `bounds[rank]` of `buf` to the root's `buf`.
pub(crate) async fn gather_direct<T: Element>(
    cx: &OpCtx,
    buf: &mut [T],
    bounds: &[Range<usize>],
    root: usize,
    phase: usize,
) -> Result<()> {
    let (n, r) = (cx.n(), cx.me());
    let seg = cx.seg::<T>();
    let stride = bounds.iter().map(|b| nseg(b.len(), seg)).max().unwrap_or(1);
    if r != root {
        return send_to_root(cx, &buf[bounds[r].clone()], root, phase, stride).await;
    }
    let steps = Steps::new(cx, phase + 1, stride)?;
    for i in (0..n).filter(|&i| i != root) {
        recv_segs(cx, i, &steps, phase, &mut buf[bounds[i].clone()], None).await?;
    }
    Ok(())
}

/// A non-root rank's part of [`gather_direct`]: `stride` must be the root's.
pub(crate) async fn send_to_root<T: Element>(
    cx: &OpCtx,
    mine: &[T],
    root: usize,
    phase: usize,
    stride: usize,
) -> Result<()> {
    let steps = Steps::new(cx, phase + 1, stride)?;
    send_segs(cx, root, &steps, phase, mine).await
}

/// The root sends chunk `i` of `input` to rank `i`.
pub(crate) async fn scatter_direct<T: Element>(
    cx: &OpCtx,
    input: &[T],
    out: &mut [T],
    root: usize,
) -> Result<()> {
    let (n, r) = (cx.n(), cx.me());
    let k = out.len();
    let steps = Steps::new(cx, 1, nseg(k, cx.seg::<T>()))?;
    if r == root {
        for i in (0..n).filter(|&i| i != root) {
            send_segs(cx, i, &steps, 0, &input[i * k..(i + 1) * k]).await?;
        }
        out.copy_from_slice(&input[r * k..(r + 1) * k]);
    } else {
        recv_segs(cx, root, &steps, 0, out, None).await?;
    }
    Ok(())
}

/// Pairwise exchange: at step `i` rank `r` sends its chunk for `r + i` and
/// receives the chunk `r − i` has for it.
pub(crate) async fn all_to_all_pairwise<T: Element>(
    cx: &OpCtx,
    input: &[T],
    out: &mut [T],
) -> Result<()> {
    let (n, r) = (cx.n(), cx.me());
    let k = input.len() / n;
    out[r * k..(r + 1) * k].copy_from_slice(&input[r * k..(r + 1) * k]);
    let steps = Steps::new(cx, n, nseg(k, cx.seg::<T>()))?;
    for i in 1..n {
        let (to, from) = ((r + i) % n, (r + n - i) % n);
        send_segs(cx, to, &steps, i, &input[to * k..(to + 1) * k]).await?;
        recv_segs(
            cx,
            from,
            &steps,
            i,
            &mut out[from * k..(from + 1) * k],
            None,
        )
        .await?;
    }
    Ok(())
}

/// A point-to-point message, segmented.
pub(crate) async fn send_message<T: Element>(cx: &OpCtx, to: usize, data: &[T]) -> Result<()> {
    let steps = Steps::new(cx, 1, nseg(data.len(), cx.seg::<T>()))?;
    send_segs(cx, to, &steps, 0, data).await
}

pub(crate) async fn recv_message<T: Element>(cx: &OpCtx, from: usize, out: &mut [T]) -> Result<()> {
    let steps = Steps::new(cx, 1, nseg(out.len(), cx.seg::<T>()))?;
    recv_segs(cx, from, &steps, 0, out, None).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binomial_trees_cover_every_rank_once() {
        for n in 1..=40 {
            for root in [0, n / 2, n - 1] {
                let parent_of: Vec<Option<usize>> = (0..n)
                    .map(|r| {
                        let (p, children) = binomial(n, r, root);
                        for c in children {
                            assert_eq!(binomial(n, c, root).0, Some(r), "n={n} root={root}");
                        }
                        p
                    })
                    .collect();
                assert_eq!(parent_of[root], None);
                // Every rank reaches the root.
                for r in 0..n {
                    let (mut x, mut hops) = (r, 0);
                    while let Some(p) = parent_of[x] {
                        x = p;
                        hops += 1;
                        assert!(hops <= n);
                    }
                    assert_eq!(x, root);
                }
            }
        }
    }

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
