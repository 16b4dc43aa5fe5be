//! Which way each op of a group runs, by the group's plan (see `plan`):
//! all_reduce, broadcast and barrier in two levels when the group spans
//! hosts (see `two_level`), every other op flat (see `flat`), over the
//! group's shared memory when it has one.
//!
//! The group's handle owns its plan cell and hands it to these with the op.

use crate::element::{Element, ReduceOp};
use crate::error::Result;
use crate::flat;
use crate::op::OpCtx;
use crate::plan::{plan_for, Plan, PlanCell};
use crate::two_level;

pub(crate) async fn barrier(cx: &OpCtx, plan: &PlanCell) -> Result<()> {
    match plan_for(cx, plan).await? {
        Plan::TwoLevel(t) => two_level::barrier(&t, cx).await,
        p => flat::barrier(cx, p.arena()).await,
    }
}

pub(crate) async fn all_reduce<T: Element>(
    cx: &OpCtx,
    plan: &PlanCell,
    buf: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    match plan_for(cx, plan).await? {
        Plan::TwoLevel(t) => two_level::all_reduce(&t, cx, buf, op).await,
        p => flat::all_reduce(cx, p.arena(), buf, op).await,
    }
}

pub(crate) async fn broadcast<T: Element>(
    cx: &OpCtx,
    plan: &PlanCell,
    buf: &mut [T],
    root: usize,
) -> Result<()> {
    match plan_for(cx, plan).await? {
        Plan::TwoLevel(t) => two_level::broadcast(&t, cx, buf, root).await,
        p => flat::broadcast(cx, p.arena(), buf, root).await,
    }
}

pub(crate) async fn reduce<T: Element>(
    cx: &OpCtx,
    plan: &PlanCell,
    buf: &mut [T],
    root: usize,
    op: ReduceOp,
) -> Result<()> {
    let p = plan_for(cx, plan).await?;
    flat::reduce(cx, p.arena(), buf, root, op).await
}

pub(crate) async fn all_gather<T: Element>(
    cx: &OpCtx,
    plan: &PlanCell,
    input: &[T],
    out: &mut [T],
) -> Result<()> {
    let p = plan_for(cx, plan).await?;
    flat::all_gather(cx, p.arena(), input, out).await
}

/// An all-gather of varying sizes: rank `k` contributes `out[bounds[k]]`.
pub(crate) async fn all_gather_in<T: Element>(
    cx: &OpCtx,
    plan: &PlanCell,
    input: &[T],
    bounds: &[std::ops::Range<usize>],
    out: &mut [T],
) -> Result<()> {
    let p = plan_for(cx, plan).await?;
    flat::all_gather_in(cx, p.arena(), input, bounds, out).await
}

pub(crate) async fn gather<T: Element>(
    cx: &OpCtx,
    plan: &PlanCell,
    input: &[T],
    root: usize,
) -> Result<Option<Vec<T>>> {
    let p = plan_for(cx, plan).await?;
    flat::gather(cx, p.arena(), input, root).await
}

pub(crate) async fn scatter<T: Element>(
    cx: &OpCtx,
    plan: &PlanCell,
    input: &[T],
    out: &mut [T],
    root: usize,
) -> Result<()> {
    let p = plan_for(cx, plan).await?;
    flat::scatter(cx, p.arena(), input, out, root).await
}

pub(crate) async fn reduce_scatter<T: Element>(
    cx: &OpCtx,
    plan: &PlanCell,
    input: &[T],
    out: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let p = plan_for(cx, plan).await?;
    flat::reduce_scatter(cx, p.arena(), input, out, op).await
}

pub(crate) async fn all_to_all<T: Element>(
    cx: &OpCtx,
    plan: &PlanCell,
    input: &[T],
    out: &mut [T],
) -> Result<()> {
    let p = plan_for(cx, plan).await?;
    flat::all_to_all(cx, p.arena(), input, out).await
}
