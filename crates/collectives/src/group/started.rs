//! Operations over memory the caller owns that take their place in the
//! group's order when called, not when first polled: for callers that hand
//! the op to a runtime of their own (the torch backend spawns each op, and
//! tokio may poll two spawned ops in either order, so an `async fn`'s
//! sequence number, taken at its first poll, could differ between ranks).
//!
//! Each `start_*` checks its arguments and takes its sequence number (or
//! message number) now, and returns the future that runs it. The future
//! borrows nothing from the group.

use std::future::Future;

use super::{algo, ProcessGroup};
use crate::dispatch;
use crate::op::drive;
use crate::{Element, ReduceOp, Result};

impl ProcessGroup {
    /// [`ProcessGroup::barrier`], started now.
    pub fn start_barrier(&self) -> impl Future<Output = Result<()>> + Send + 'static {
        let cx = self.begin_barrier();
        let plan = self.plan.clone();
        async move {
            let cx = cx?;
            drive(&cx, dispatch::barrier(&cx, &plan)).await
        }
    }

    /// [`ProcessGroup::all_reduce`], started now, receiving large payloads
    /// straight into `buf`.
    ///
    /// # Safety
    ///
    /// The future must not be leaked: run it to its end or drop it before
    /// `buf`'s borrow ends (see `OpCtx::allow_posting`).
    pub unsafe fn start_all_reduce<'a, T: Element>(
        &self,
        buf: &'a mut [T],
        op: ReduceOp,
    ) -> impl Future<Output = Result<()>> + Send + 'a {
        // SAFETY: the caller's promise.
        let cx = self
            .begin_all_reduce::<T>(buf.len(), op)
            .map(|cx| unsafe { cx.allow_posting() });
        let plan = self.plan.clone();
        async move {
            let cx = cx?;
            drive(&cx, dispatch::all_reduce(&cx, &plan, buf, op)).await
        }
    }

    /// [`ProcessGroup::broadcast`], started now, receiving into `buf`.
    ///
    /// # Safety
    ///
    /// As [`ProcessGroup::start_all_reduce`].
    pub unsafe fn start_broadcast<'a, T: Element>(
        &self,
        buf: &'a mut [T],
        root: usize,
    ) -> impl Future<Output = Result<()>> + Send + 'a {
        // SAFETY: the caller's promise.
        let cx = self
            .begin_broadcast::<T>(buf.len(), root)
            .map(|cx| unsafe { cx.allow_posting() });
        let plan = self.plan.clone();
        async move {
            let cx = cx?;
            drive(&cx, dispatch::broadcast(&cx, &plan, buf, root)).await
        }
    }

    /// [`ProcessGroup::all_gather`], started now, receiving into `out`.
    ///
    /// # Safety
    ///
    /// As [`ProcessGroup::start_all_reduce`].
    pub unsafe fn start_all_gather<'a, T: Element>(
        &self,
        input: &'a [T],
        out: &'a mut [T],
    ) -> impl Future<Output = Result<()>> + Send + 'a {
        let cx = self
            .expect_len("all_gather output", out.len(), input.len() * self.size())
            .and_then(|()| self.begin_all_gather::<T>(input.len()))
            // SAFETY: the caller's promise.
            .map(|cx| unsafe { cx.allow_posting() });
        let plan = self.plan.clone();
        async move {
            let cx = cx?;
            drive(&cx, dispatch::all_gather(&cx, &plan, input, out)).await
        }
    }

    /// [`ProcessGroup::reduce`], started now.
    pub fn start_reduce<'a, T: Element>(
        &self,
        buf: &'a mut [T],
        root: usize,
        op: ReduceOp,
    ) -> impl Future<Output = Result<()>> + Send + 'a {
        let cx = self.begin_reduce::<T>(buf.len(), root, op);
        let plan = self.plan.clone();
        async move {
            let cx = cx?;
            drive(&cx, dispatch::reduce(&cx, &plan, buf, root, op)).await
        }
    }

    /// [`ProcessGroup::gather`], started now.
    pub fn start_gather<'a, T: Element>(
        &self,
        input: &'a [T],
        root: usize,
    ) -> impl Future<Output = Result<Option<Vec<T>>>> + Send + 'a {
        let cx = self.begin_gather::<T>(input.len(), root);
        let plan = self.plan.clone();
        async move {
            let cx = cx?;
            drive(&cx, dispatch::gather(&cx, &plan, input, root)).await
        }
    }

    /// [`ProcessGroup::scatter`], started now.
    pub fn start_scatter<'a, T: Element>(
        &self,
        input: Option<&'a [T]>,
        out: &'a mut [T],
        root: usize,
    ) -> impl Future<Output = Result<()>> + Send + 'a {
        let cx = self.begin_scatter::<T>(input.map(<[T]>::len), out.len(), root);
        let input = if self.rank() == root {
            input.unwrap_or(&[])
        } else {
            &[]
        };
        let plan = self.plan.clone();
        async move {
            let cx = cx?;
            drive(&cx, dispatch::scatter(&cx, &plan, input, out, root)).await
        }
    }

    /// [`ProcessGroup::reduce_scatter`], started now.
    pub fn start_reduce_scatter<'a, T: Element>(
        &self,
        input: &'a [T],
        out: &'a mut [T],
        op: ReduceOp,
    ) -> impl Future<Output = Result<()>> + Send + 'a {
        let cx = self
            .expect_len("reduce_scatter input", input.len(), out.len() * self.size())
            .and_then(|()| self.begin_reduce_scatter::<T>(out.len(), op));
        let plan = self.plan.clone();
        async move {
            let cx = cx?;
            drive(&cx, dispatch::reduce_scatter(&cx, &plan, input, out, op)).await
        }
    }

    /// [`ProcessGroup::all_to_all`], started now.
    pub fn start_all_to_all<'a, T: Element>(
        &self,
        input: &'a [T],
        out: &'a mut [T],
    ) -> impl Future<Output = Result<()>> + Send + 'a {
        let cx = self
            .expect_len("all_to_all output", out.len(), input.len())
            .and_then(|()| self.begin_all_to_all::<T>(input.len()));
        let plan = self.plan.clone();
        async move {
            let cx = cx?;
            drive(&cx, dispatch::all_to_all(&cx, &plan, input, out)).await
        }
    }

    /// [`ProcessGroup::send`], numbered among this tag's messages now.
    pub fn start_send<'a, T: Element>(
        &self,
        data: &'a [T],
        dst: usize,
        tag: u32,
    ) -> impl Future<Output = Result<()>> + Send + 'a {
        let cx = self.begin_send::<T>(data.len(), dst, tag);
        async move {
            let cx = cx?;
            drive(&cx, algo::send_message(&cx, dst, data)).await
        }
    }

    /// [`ProcessGroup::recv`], numbered among this tag's messages now.
    pub fn start_recv<'a, T: Element>(
        &self,
        out: &'a mut [T],
        src: usize,
        tag: u32,
    ) -> impl Future<Output = Result<()>> + Send + 'a {
        let cx = self.begin_recv::<T>(out.len(), src, tag);
        async move {
            let cx = cx?;
            drive(&cx, algo::recv_message(&cx, src, out)).await
        }
    }
}
