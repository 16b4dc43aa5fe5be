//! Pipelined chain broadcast: `root → root+1 → …`, every link carrying the
//! buffer once, segment after segment: the choice for large broadcasts.

use super::posted::{Place, Posts};
use super::{nseg, seg_range, Steps};
use crate::element::Element;
use crate::error::Result;
use crate::op::OpCtx;

/// Pipelined chain broadcast: `root → root+1 → …`, one segment behind another,
/// so every link carries the buffer once. Where the op may, every segment's
/// receive is posted at once, so each lands in place (see `posted.rs`).
pub(crate) async fn chain_broadcast<T: Element>(
    cx: &OpCtx,
    buf: &mut [T],
    root: usize,
) -> Result<()> {
    let (n, r) = (cx.n(), cx.me());
    let v = (r + n - root) % n;
    let seg = cx.seg_for::<T>(buf.len());
    let ns = nseg(buf.len(), seg);
    let steps = Steps::new(cx, 1, ns)?;
    let all = 0..buf.len();
    let (prev, next) = ((r + n - 1) % n, (r + 1) % n);
    if v > 0 && cx.may_post() {
        let place = Place::new(buf);
        let mut posts = Posts::of(cx, &place).expect("the op may post");
        // SAFETY: each segment is touched only once its receive returned.
        let posted: Vec<_> = (0..ns)
            .map(|s| unsafe { posts.post(prev, steps.at(0, s), &place, seg_range(&all, seg, s)) })
            .collect();
        for (s, p) in posted.into_iter().enumerate() {
            let rg = seg_range(&all, seg, s);
            posts.recv(p, &place, rg.clone()).await?;
            if v + 1 < n {
                // SAFETY: received; only read from now on.
                cx.send(next, steps.at(0, s), unsafe { place.get(rg) })
                    .await?;
            }
        }
        return Ok(());
    }
    for s in 0..ns {
        let rg = seg_range(&all, seg, s);
        if v > 0 {
            cx.recv_copy(prev, steps.at(0, s), &mut buf[rg.clone()])
                .await?;
        }
        if v + 1 < n {
            cx.send(next, steps.at(0, s), &buf[rg]).await?;
        }
    }
    Ok(())
}
