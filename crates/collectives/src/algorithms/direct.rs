//! Ops whose every pair of ranks exchanges directly: gather and scatter
//! through the root, all_to_all by pairwise exchange, and point-to-point
//! messages. One algorithm each.

use std::ops::Range;

use super::{nseg, recv_segs, send_segs, Steps};
use crate::element::Element;
use crate::error::Result;
use crate::op::OpCtx;

/// Every rank's chunk `bounds[rank]` of `buf` to the root's `buf`, in
/// segments of `seg` elements at `phase`. After another algorithm's phases
/// (a ring reduce's), `seg` must be that algorithm's, so that the strides
/// agree and the step keys of the two stay apart.
pub(crate) async fn gather_direct<T: Element>(
    cx: &OpCtx,
    buf: &mut [T],
    bounds: &[Range<usize>],
    root: usize,
    phase: usize,
    seg: usize,
) -> Result<()> {
    let (n, r) = (cx.n(), cx.me());
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
