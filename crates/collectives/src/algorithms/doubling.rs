//! Recursive doubling all_reduce: `lg n` exchanges of the whole buffer, the
//! fewest rounds: the choice for small payloads.

use super::{nseg, recv_segs, send_segs, Steps};
use crate::element::{Element, ReduceOp};
use crate::error::Result;
use crate::op::OpCtx;

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
