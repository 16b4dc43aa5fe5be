//! Binomial trees, pipelined by segment: broadcast down, reduce up, and
//! all_reduce and barrier as one then the other. `⌈lg n⌉` hops, each rank
//! connected only to its parent and children: the choice for small payloads,
//! and for barriers of many ranks.

use super::{nseg, seg_range, Steps};
use crate::element::{Element, ReduceOp};
use crate::error::Result;
use crate::op::OpCtx;

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
}
