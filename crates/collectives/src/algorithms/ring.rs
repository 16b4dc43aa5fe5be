//! The segmented, pipelined ring: reduce-scatter and all-gather, and
//! all_reduce and reduce built of them. Every rank sends and receives
//! `(n − 1)/n` of the buffer per pass, the least any algorithm can: the
//! choice for large payloads.

use std::ops::Range;

use super::direct::gather_direct;
use super::posted::{Place, Posted, Posts};
use super::{even_bounds, nseg, seg_range, Steps};
use crate::element::{Element, ReduceOp};
use crate::error::Result;
use crate::group::OpCtx;

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
/// rest of its chunk. An all-gather pass, where the op may, posts every
/// receive as it starts, so each segment lands in place (see `posted.rs`):
/// the chunks it receives are not otherwise touched until received.
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
    let chunk_in = |t: usize| (r + 2 * n - t - 1 - shift) % n;
    let place = Place::new(buf);
    let mut posts = reduce.is_none().then(|| Posts::of(cx, &place)).flatten();
    // Per step, its segments' posted receives, in order.
    let mut posted: Vec<std::vec::IntoIter<Posted>> = match posts.as_mut() {
        Some(p) => (0..n - 1)
            .map(|t| {
                let c = chunk_in(t);
                (0..segs(c))
                    .map(|s| {
                        let rg = seg_range(&bounds[c], seg, s);
                        // SAFETY: chunks received are touched only once
                        // received (the one sent first is this rank's own).
                        unsafe { p.post(prev, steps.at(phase0 + t, s), &place, rg) }
                    })
                    .collect::<Vec<_>>()
                    .into_iter()
            })
            .collect(),
        None => Vec::new(),
    };
    let mut posted_by_step = posted.iter_mut();
    for t in 0..n - 1 {
        let mut posted_here = posted_by_step.next();
        let cin = chunk_in(t);
        let m = if t == 0 {
            segs(cin).max(segs(first_out))
        } else {
            segs(cin)
        };
        for s in 0..m {
            if t == 0 && s < segs(first_out) {
                let out = seg_range(&bounds[first_out], seg, s);
                // SAFETY: never posted (this rank's own, or reduced into below).
                cx.send(next, steps.at(phase0, s), unsafe { place.get(out) })
                    .await?;
            }
            if s < segs(cin) {
                let rg = seg_range(&bounds[cin], seg, s);
                let at = steps.at(phase0 + t, s);
                // SAFETY (each arm): segment `rg` of chunk `cin` is used by
                // this step alone, after its receive when it was posted.
                match (reduce, &posts) {
                    (Some(op), _) => {
                        cx.recv_reduce(prev, at, unsafe { place.range(rg.clone()) }, op)
                            .await?
                    }
                    (None, Some(p)) => {
                        let one = posted_here
                            .as_mut()
                            .and_then(|it| it.next())
                            .expect("every segment was posted");
                        p.recv(one, &place, rg.clone()).await?
                    }
                    (None, None) => {
                        cx.recv_copy(prev, at, unsafe { place.range(rg.clone()) })
                            .await?
                    }
                }
                if t + 2 < n {
                    cx.send(next, steps.at(phase0 + t + 1, s), unsafe { place.get(rg) })
                        .await?;
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
