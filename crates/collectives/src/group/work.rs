//! Started operations: every collective's `*_async` form takes its number
//! (and checks its arguments) now and runs on the group's runtime, owning
//! its buffers; [`Work`] is its handle.

use std::sync::Arc;

use super::ProcessGroup;
use crate::algorithms as algo;
use crate::dispatch;
use crate::element::{Element, ReduceOp};
use crate::error::{Error, Result};
use crate::op::drive;
use crate::plan::PlanCell;

impl ProcessGroup {
    // ---- handles ---------------------------------------------------------------
    //
    // Every collective has an `*_async` form: it takes its sequence number
    // (and checks its arguments) now, so operations started in order run in
    // order, and runs on the group's runtime, owning its buffers.

    /// Starts an op begun as `cx` (or failed to begin) with `body`.
    pub(super) fn spawn_op<C, R, F>(
        &self,
        cx: Result<C>,
        body: impl FnOnce(C, Arc<PlanCell>) -> F,
    ) -> Work<R>
    where
        R: Send + 'static,
        F: std::future::Future<Output = Result<R>> + Send + 'static,
    {
        let rt = &self.comm.sh().rt;
        match cx {
            Ok(cx) => Work::spawn(rt, body(cx, self.plan.clone())),
            Err(e) => Work::spawn(rt, async move { Err(e) }),
        }
    }

    /// Starts a barrier; see [`ProcessGroup::all_reduce_async`].
    pub fn barrier_async(&self) -> Work<()> {
        self.spawn_op(self.begin_barrier(), |cx, plan| async move {
            drive(&cx, dispatch::barrier(&cx, &plan)).await
        })
    }

    /// Starts an all-reduce of `buf` and returns at once; the sequence number is
    /// taken now, so operations started in order run in order.
    ///
    /// Large payloads are received straight into `buf` (see
    /// `algorithms/posted.rs`); the borrowing [`ProcessGroup::all_reduce`]
    /// copies each received segment once more.
    pub fn all_reduce_async<T: Element>(&self, buf: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        // SAFETY: the task owns `buf`, declared before the op's future, which
        // is dropped first however the task ends.
        let cx = self
            .begin_all_reduce::<T>(buf.len(), op)
            .map(|cx| unsafe { cx.allow_posting() });
        self.spawn_op(cx, |cx, plan| async move {
            let mut buf = buf;
            drive(&cx, dispatch::all_reduce(&cx, &plan, &mut buf, op)).await?;
            Ok(buf)
        })
    }

    /// Starts a broadcast; see [`ProcessGroup::all_reduce_async`].
    pub fn broadcast_async<T: Element>(&self, buf: Vec<T>, root: usize) -> Work<Vec<T>> {
        // SAFETY: as in `all_reduce_async`.
        let cx = self
            .begin_broadcast::<T>(buf.len(), root)
            .map(|cx| unsafe { cx.allow_posting() });
        self.spawn_op(cx, |cx, plan| async move {
            let mut buf = buf;
            drive(&cx, dispatch::broadcast(&cx, &plan, &mut buf, root)).await?;
            Ok(buf)
        })
    }

    /// Starts a reduce to `root` (whose result the work returns; other ranks
    /// get their `buf` back unchanged); see [`ProcessGroup::all_reduce_async`].
    pub fn reduce_async<T: Element>(
        &self,
        mut buf: Vec<T>,
        root: usize,
        op: ReduceOp,
    ) -> Work<Vec<T>> {
        self.spawn_op(
            self.begin_reduce::<T>(buf.len(), root, op),
            |cx, plan| async move {
                drive(&cx, dispatch::reduce(&cx, &plan, &mut buf, root, op)).await?;
                Ok(buf)
            },
        )
    }

    /// Starts an all-gather; see [`ProcessGroup::all_reduce_async`].
    pub fn all_gather_async<T: Element>(&self, input: Vec<T>) -> Work<Vec<T>> {
        let n = self.size();
        // SAFETY: as in `all_reduce_async` (`out` is the task's).
        let cx = self
            .begin_all_gather::<T>(input.len())
            .map(|cx| unsafe { cx.allow_posting() });
        self.spawn_op(cx, |cx, plan| async move {
            let mut out = vec![T::from_i8(0); input.len() * n];
            drive(&cx, dispatch::all_gather(&cx, &plan, &input, &mut out)).await?;
            Ok(out)
        })
    }

    /// Starts an all-gather of varying sizes (it takes two sequence
    /// numbers); see [`ProcessGroup::all_reduce_async`].
    pub fn all_gather_varying_async<T: Element>(&self, input: Vec<T>) -> Work<Vec<Vec<T>>> {
        let pg = self.clone();
        self.spawn_op(
            self.begin_all_gather_varying(),
            |(lens, seq), _| async move {
                super::ops::all_gather_varying_impl(&pg, lens, seq, &input).await
            },
        )
    }

    /// Starts a gather to `root` (`Some` there, `None` elsewhere); see
    /// [`ProcessGroup::all_reduce_async`].
    pub fn gather_async<T: Element>(&self, input: Vec<T>, root: usize) -> Work<Option<Vec<T>>> {
        self.spawn_op(
            self.begin_gather::<T>(input.len(), root),
            |cx, plan| async move { drive(&cx, dispatch::gather(&cx, &plan, &input, root)).await },
        )
    }

    /// Starts a scatter from `root` (which passes `Some` input) of `len`
    /// elements per rank; see [`ProcessGroup::all_reduce_async`].
    pub fn scatter_async<T: Element>(
        &self,
        input: Option<Vec<T>>,
        len: usize,
        root: usize,
    ) -> Work<Vec<T>> {
        let cx = self.begin_scatter::<T>(input.as_ref().map(Vec::len), len, root);
        self.spawn_op(cx, |cx, plan| async move {
            let mut out = vec![T::from_i8(0); len];
            let input = input.filter(|_| cx.me() == root).unwrap_or_default();
            drive(&cx, dispatch::scatter(&cx, &plan, &input, &mut out, root)).await?;
            Ok(out)
        })
    }

    /// Starts a reduce-scatter of `input` (`size × k` elements; the work
    /// returns this rank's `k`); see [`ProcessGroup::all_reduce_async`].
    pub fn reduce_scatter_async<T: Element>(&self, input: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        let n = self.size();
        let cx = if input.len().is_multiple_of(n) {
            self.begin_reduce_scatter::<T>(input.len() / n, op)
        } else {
            Err(Error::Invalid(format!(
                "reduce_scatter input of {} elements does not split into {n} equal chunks",
                input.len()
            )))
        };
        self.spawn_op(cx, |cx, plan| async move {
            let mut out = vec![T::from_i8(0); input.len() / n];
            drive(
                &cx,
                dispatch::reduce_scatter(&cx, &plan, &input, &mut out, op),
            )
            .await?;
            Ok(out)
        })
    }

    /// Starts an all-to-all; see [`ProcessGroup::all_reduce_async`].
    pub fn all_to_all_async<T: Element>(&self, input: Vec<T>) -> Work<Vec<T>> {
        self.spawn_op(
            self.begin_all_to_all::<T>(input.len()),
            |cx, plan| async move {
                let mut out = vec![T::from_i8(0); input.len()];
                drive(&cx, dispatch::all_to_all(&cx, &plan, &input, &mut out)).await?;
                Ok(out)
            },
        )
    }

    /// Starts a send; see [`ProcessGroup::all_reduce_async`].
    pub fn send_async<T: Element>(&self, data: Vec<T>, dst: usize, tag: u32) -> Work<()> {
        self.spawn_op(
            self.begin_send::<T>(data.len(), dst, tag),
            |cx, _| async move { drive(&cx, algo::send_message(&cx, dst, &data)).await },
        )
    }

    /// Starts a receive of `len` elements; see [`ProcessGroup::all_reduce_async`].
    pub fn recv_async<T: Element>(&self, len: usize, src: usize, tag: u32) -> Work<Vec<T>> {
        self.spawn_op(self.begin_recv::<T>(len, src, tag), |cx, _| async move {
            let mut out = vec![T::from_i8(0); len];
            drive(&cx, algo::recv_message(&cx, src, &mut out)).await?;
            Ok(out)
        })
    }
}

/// A started operation (PyTorch's `Work`).
pub struct Work<T> {
    handle: tokio::task::JoinHandle<Result<T>>,
}

impl<T: Send + 'static> Work<T> {
    pub(super) fn spawn(
        rt: &tokio::runtime::Handle,
        f: impl std::future::Future<Output = Result<T>> + Send + 'static,
    ) -> Work<T> {
        Work {
            handle: rt.spawn(f),
        }
    }

    /// Whether the operation has finished (successfully or not).
    pub fn is_completed(&self) -> bool {
        self.handle.is_finished()
    }

    /// Waits for the operation.
    pub async fn wait(self) -> Result<T> {
        self.handle
            .await
            .unwrap_or_else(|e| Err(Error::Invalid(format!("the operation's task failed: {e}"))))
    }
}
