//! The collectives of one flat group: over its shared memory when it has
//! one (every member on this host, see `shm`), else over TCP with the
//! algorithm its call names (see `algorithms`). A two-level op runs each of
//! its steps as one of these, on an internal group.
//!
//! Each takes the group's region, if any, from the layer above (`dispatch`
//! for a group's own ops, `two_level` for its steps): nothing here decides
//! how a group runs.

use std::ops::Range;
use std::sync::Arc;

use crate::algorithms as algo;
use crate::element::{Element, ReduceOp};
use crate::error::Result;
use crate::frame::Algo;
use crate::op::OpCtx;
use crate::shm::ops as shm_ops;
use crate::shm::Arena;

pub(crate) async fn barrier(cx: &OpCtx, shm: Option<&Arc<Arena>>) -> Result<()> {
    if let Some(a) = shm {
        return shm_ops::barrier(a, cx).await;
    }
    match cx.desc().algo {
        Algo::Dissemination => algo::barrier_dissemination(cx).await,
        _ => algo::barrier_tree(cx).await,
    }
}

pub(crate) async fn reduce<T: Element>(
    cx: &OpCtx,
    shm: Option<&Arc<Arena>>,
    buf: &mut [T],
    root: usize,
    op: ReduceOp,
) -> Result<()> {
    if let Some(a) = shm {
        return shm_ops::reduce(a, cx, buf, op, Some(root)).await;
    }
    let mut scratch;
    let acc: &mut [T] = if cx.me() == root {
        buf
    } else {
        scratch = buf.to_vec();
        &mut scratch
    };
    match cx.desc().algo {
        Algo::Tree => {
            algo::tree_reduce(cx, acc, op, root, 0).await?;
            if op == ReduceOp::Avg && cx.me() == root {
                T::divide(acc, cx.n());
            }
            Ok(())
        }
        _ => algo::ring_reduce(cx, acc, op, root).await,
    }
}

pub(crate) async fn gather<T: Element>(
    cx: &OpCtx,
    shm: Option<&Arc<Arena>>,
    input: &[T],
    root: usize,
) -> Result<Option<Vec<T>>> {
    let (n, k) = (cx.n(), input.len());
    let bounds = algo::equal_bounds(k, n);
    if let Some(a) = shm {
        let mut all = vec![T::from_i8(0); if cx.me() == root { n * k } else { 0 }];
        let out = (cx.me() == root).then_some(&mut all[..]);
        shm_ops::gather(a, cx, input, &bounds, out).await?;
        return Ok((cx.me() == root).then_some(all));
    }
    if cx.me() == root {
        let mut all = vec![T::from_i8(0); n * k];
        all[bounds[root].clone()].copy_from_slice(input);
        algo::gather_direct(cx, &mut all, &bounds, root, 0, cx.seg::<T>()).await?;
        Ok(Some(all))
    } else {
        algo::send_to_root(cx, input, root, 0, algo::nseg(k, cx.seg::<T>())).await?;
        Ok(None)
    }
}

pub(crate) async fn scatter<T: Element>(
    cx: &OpCtx,
    shm: Option<&Arc<Arena>>,
    input: &[T],
    out: &mut [T],
    root: usize,
) -> Result<()> {
    if let Some(a) = shm {
        let (how, k) = (shm_ops::Parts::Scatter { root }, out.len());
        return shm_ops::parts(a, cx, how, input, out, k).await;
    }
    algo::scatter_direct(cx, input, out, root).await
}

pub(crate) async fn reduce_scatter<T: Element>(
    cx: &OpCtx,
    shm: Option<&Arc<Arena>>,
    input: &[T],
    out: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    if let Some(a) = shm {
        let (how, k) = (shm_ops::Parts::ReduceScatter(op), out.len());
        return shm_ops::parts(a, cx, how, input, out, k).await;
    }
    let mut acc = input.to_vec();
    let bounds = algo::equal_bounds(out.len(), cx.n());
    algo::ring_reduce_scatter(cx, &mut acc, &bounds, op, 0).await?;
    let mine = &mut acc[bounds[cx.me()].clone()];
    if op == ReduceOp::Avg {
        T::divide(mine, cx.n());
    }
    out.copy_from_slice(mine);
    Ok(())
}

pub(crate) async fn all_to_all<T: Element>(
    cx: &OpCtx,
    shm: Option<&Arc<Arena>>,
    input: &[T],
    out: &mut [T],
) -> Result<()> {
    if let Some(a) = shm {
        let k = input.len() / cx.n();
        return shm_ops::parts(a, cx, shm_ops::Parts::AllToAll, input, out, k).await;
    }
    algo::all_to_all_pairwise(cx, input, out).await
}

pub(crate) async fn broadcast<T: Element>(
    cx: &OpCtx,
    shm: Option<&Arc<Arena>>,
    buf: &mut [T],
    root: usize,
) -> Result<()> {
    if let Some(a) = shm {
        return shm_ops::broadcast(a, cx, buf, root).await;
    }
    match cx.desc().algo {
        Algo::Chain => algo::chain_broadcast(cx, buf, root).await,
        _ => algo::tree_broadcast(cx, buf, root, 0).await,
    }
}

pub(crate) async fn all_reduce<T: Element>(
    cx: &OpCtx,
    shm: Option<&Arc<Arena>>,
    buf: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    if let Some(a) = shm {
        return shm_ops::reduce(a, cx, buf, op, None).await;
    }
    match cx.desc().algo {
        Algo::Ring => algo::ring_all_reduce(cx, buf, op).await,
        Algo::Tree => algo::tree_all_reduce(cx, buf, op).await,
        _ => algo::recursive_doubling(cx, buf, op).await,
    }
}

pub(crate) async fn all_gather<T: Element>(
    cx: &OpCtx,
    shm: Option<&Arc<Arena>>,
    input: &[T],
    out: &mut [T],
) -> Result<()> {
    let bounds = algo::equal_bounds(input.len(), cx.n());
    all_gather_in(cx, shm, input, &bounds, out).await
}

/// An all-gather whose rank `k` contributes `out[bounds[k]]` (`input`
/// here): of varying sizes when the bounds vary.
pub(crate) async fn all_gather_in<T: Element>(
    cx: &OpCtx,
    shm: Option<&Arc<Arena>>,
    input: &[T],
    bounds: &[Range<usize>],
    out: &mut [T],
) -> Result<()> {
    if let Some(a) = shm {
        return shm_ops::gather(a, cx, input, bounds, Some(out)).await;
    }
    out[bounds[cx.me()].clone()].copy_from_slice(input);
    algo::ring_all_gather(cx, out, bounds, 0).await
}
