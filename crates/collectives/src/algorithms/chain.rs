//! Pipelined chain broadcast: `root → root+1 → …`, every link carrying the
//! buffer once, segment after segment: the choice for large broadcasts.

use super::{nseg, seg_range, Steps};
use crate::element::Element;
use crate::error::Result;
use crate::group::OpCtx;

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
