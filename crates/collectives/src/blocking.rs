//! A process group for code without an async runtime.
//!
//! [`BlockingGroup`] owns a small tokio runtime whose one worker thread runs the
//! connections' reader tasks; each call blocks the calling thread on the
//! operation. Any other operation is available through [`BlockingGroup::run`].

use std::future::Future;
use std::sync::Arc;

use rallypoint_store::Store;

use crate::{Element, Error, Options, ProcessGroup, ReduceOp, Result};

/// A [`ProcessGroup`] with blocking methods.
pub struct BlockingGroup {
    rt: tokio::runtime::Runtime,
    pg: ProcessGroup,
}

impl BlockingGroup {
    fn runtime() -> Result<tokio::runtime::Runtime> {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .map_err(|e| Error::Invalid(format!("starting the runtime: {e}")))
    }

    /// [`ProcessGroup::new`], blocking.
    pub fn new(
        store: Arc<dyn Store>,
        rank: usize,
        size: usize,
        opts: Options,
    ) -> Result<BlockingGroup> {
        let rt = Self::runtime()?;
        let pg = rt.block_on(ProcessGroup::new(store, rank, size, opts))?;
        Ok(BlockingGroup { rt, pg })
    }

    /// [`ProcessGroup::from_url`], blocking.
    pub fn from_url(url: &str, opts: Options) -> Result<BlockingGroup> {
        let rt = Self::runtime()?;
        let pg = rt.block_on(ProcessGroup::from_url(url, opts))?;
        Ok(BlockingGroup { rt, pg })
    }

    /// [`ProcessGroup::from_env`], blocking.
    pub fn from_env(opts: Options) -> Result<BlockingGroup> {
        Self::from_url("env://", opts)
    }

    /// The async group, e.g. for [`ProcessGroup::with_timeout`] inside [`BlockingGroup::run`].
    pub fn group(&self) -> &ProcessGroup {
        &self.pg
    }

    pub fn rank(&self) -> usize {
        self.pg.rank()
    }

    pub fn size(&self) -> usize {
        self.pg.size()
    }

    /// Runs any operation to completion: `bg.run(|pg| pg.all_to_all(&a, &mut b))`.
    pub fn run<'a, F, Fut, R>(&'a self, f: F) -> R
    where
        F: FnOnce(&'a ProcessGroup) -> Fut,
        Fut: Future<Output = R>,
    {
        self.rt.block_on(f(&self.pg))
    }

    pub fn barrier(&self) -> Result<()> {
        self.run(|pg| pg.barrier())
    }

    // These three receive large payloads straight into the caller's buffer
    // (see `algorithms/posted.rs`), which is sound because `block_on` runs
    // the op's future to completion, or drops it while unwinding, before the
    // call returns: it is never leaked, and the buffer outlives it.

    pub fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        // SAFETY: the future is run to its end here (above).
        let op = unsafe { self.pg.all_reduce_posting(buf, op) };
        self.rt.block_on(op)
    }

    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        // SAFETY: the future is run to its end here (above).
        let op = unsafe { self.pg.broadcast_posting(buf, root) };
        self.rt.block_on(op)
    }

    pub fn all_gather<T: Element>(&self, input: &[T], out: &mut [T]) -> Result<()> {
        // SAFETY: the future is run to its end here (above).
        let op = unsafe { self.pg.all_gather_posting(input, out) };
        self.rt.block_on(op)
    }

    pub fn send<T: Element>(&self, data: &[T], dst: usize, tag: u32) -> Result<()> {
        self.run(|pg| pg.send(data, dst, tag))
    }

    pub fn recv<T: Element>(&self, out: &mut [T], src: usize, tag: u32) -> Result<()> {
        self.run(|pg| pg.recv(out, src, tag))
    }
}
