//! The collectives, messages and object collectives of the public API,
//! each begun (its number taken, its call checked) and run within its
//! deadline through `dispatch`.

use serde::de::DeserializeOwned;
use serde::Serialize;

use super::{ProcessGroup, VARYING_DATA};
use crate::algorithms as algo;
use crate::dispatch;
use crate::element::{Element, ReduceOp};
use crate::error::{Error, Result};
use crate::frame::OpKind;
use crate::op::{drive, OpCtx};

impl ProcessGroup {
    // ---- collectives ---------------------------------------------------------

    /// Waits until every rank has called `barrier`.
    pub async fn barrier(&self) -> Result<()> {
        let cx = self.begin_barrier()?;
        drive(&cx, dispatch::barrier(&cx, &self.plan)).await
    }

    pub(super) fn begin_barrier(&self) -> Result<OpCtx> {
        let algo = self.choose(OpKind::Barrier, 0);
        self.begin(self.desc::<u8>(OpKind::Barrier, None, algo, 0, 0)?)
    }

    /// Copies `root`'s buffer into every rank's.
    pub async fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        let cx = self.begin_broadcast::<T>(buf.len(), root)?;
        drive(&cx, dispatch::broadcast(&cx, &self.plan, buf, root)).await
    }

    pub(super) fn begin_broadcast<T: Element>(&self, len: usize, root: usize) -> Result<OpCtx> {
        let root32 = self.check_rank("root", root)?;
        let algo = self
            .broadcast_algo
            .unwrap_or_else(|| self.choose(OpKind::Broadcast, len * T::DTYPE.size()));
        self.begin(self.desc::<T>(OpKind::Broadcast, None, algo, root32, len)?)
    }

    /// Reduces every rank's buffer element-wise with `op`; every rank gets the result.
    pub async fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let cx = self.begin_all_reduce::<T>(buf.len(), op)?;
        drive(&cx, dispatch::all_reduce(&cx, &self.plan, buf, op)).await
    }

    /// [`ProcessGroup::all_reduce`], receiving large payloads straight into
    /// `buf`.
    ///
    /// # Safety
    ///
    /// The future must not be leaked: run it to completion or drop it
    /// before `buf`'s borrow ends (see [`OpCtx::allow_posting`]).
    pub(crate) async unsafe fn all_reduce_posting<T: Element>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let cx = self.begin_all_reduce::<T>(buf.len(), op)?.allow_posting();
        drive(&cx, dispatch::all_reduce(&cx, &self.plan, buf, op)).await
    }

    /// [`ProcessGroup::broadcast`], receiving into `buf` in place.
    ///
    /// # Safety
    ///
    /// As [`ProcessGroup::all_reduce_posting`].
    pub(crate) async unsafe fn broadcast_posting<T: Element>(
        &self,
        buf: &mut [T],
        root: usize,
    ) -> Result<()> {
        let cx = self.begin_broadcast::<T>(buf.len(), root)?.allow_posting();
        drive(&cx, dispatch::broadcast(&cx, &self.plan, buf, root)).await
    }

    /// [`ProcessGroup::all_gather`], receiving into `out` in place.
    ///
    /// # Safety
    ///
    /// As [`ProcessGroup::all_reduce_posting`].
    pub(crate) async unsafe fn all_gather_posting<T: Element>(
        &self,
        input: &[T],
        out: &mut [T],
    ) -> Result<()> {
        self.expect_len("all_gather output", out.len(), input.len() * self.size())?;
        let cx = self.begin_all_gather::<T>(input.len())?.allow_posting();
        drive(&cx, dispatch::all_gather(&cx, &self.plan, input, out)).await
    }

    pub(super) fn begin_all_reduce<T: Element>(&self, len: usize, op: ReduceOp) -> Result<OpCtx> {
        let algo = self
            .all_reduce_algo
            .unwrap_or_else(|| self.choose(OpKind::AllReduce, len * T::DTYPE.size()));
        self.begin(self.desc::<T>(OpKind::AllReduce, Some(op), algo, 0, len)?)
    }

    /// Reduces every rank's buffer into `root`'s; other ranks' buffers are unchanged.
    pub async fn reduce<T: Element>(&self, buf: &mut [T], root: usize, op: ReduceOp) -> Result<()> {
        let cx = self.begin_reduce::<T>(buf.len(), root, op)?;
        drive(&cx, dispatch::reduce(&cx, &self.plan, buf, root, op)).await
    }

    pub(super) fn begin_reduce<T: Element>(
        &self,
        len: usize,
        root: usize,
        op: ReduceOp,
    ) -> Result<OpCtx> {
        let root32 = self.check_rank("root", root)?;
        let algo = self.choose(OpKind::Reduce, len * T::DTYPE.size());
        self.begin(self.desc::<T>(OpKind::Reduce, Some(op), algo, root32, len)?)
    }

    /// Every rank's `input` (all the same length) into `out`, in rank order.
    pub async fn all_gather<T: Element>(&self, input: &[T], out: &mut [T]) -> Result<()> {
        self.expect_len("all_gather output", out.len(), input.len() * self.size())?;
        let cx = self.begin_all_gather::<T>(input.len())?;
        drive(&cx, dispatch::all_gather(&cx, &self.plan, input, out)).await
    }

    pub(super) fn begin_all_gather<T: Element>(&self, len: usize) -> Result<OpCtx> {
        self.begin(self.desc::<T>(
            OpKind::AllGather,
            None,
            self.choose(OpKind::AllGather, len * T::DTYPE.size()),
            0,
            len,
        )?)
    }

    /// Every rank's `input`, whatever its length, in rank order. Exchanges the
    /// lengths first (a small all-gather), then runs a ring over unequal chunks.
    pub async fn all_gather_varying<T: Element>(&self, input: &[T]) -> Result<Vec<Vec<T>>> {
        let (lens, seq) = self.begin_all_gather_varying()?;
        all_gather_varying_impl(self, lens, seq, input).await
    }

    /// The two sequence numbers of an all-gather of varying sizes, taken
    /// now: the lengths' all-gather (begun) and the data's (whose call,
    /// with the total length, is known only after the first), with its
    /// history.
    pub(super) fn begin_all_gather_varying(&self) -> Result<(OpCtx, (u64, u32))> {
        let lens = self.begin_all_gather::<u64>(1)?;
        Ok((lens, self.comm.take_seq(&VARYING_DATA)))
    }

    /// Every rank's `input` (all the same length) to `root`, in rank order;
    /// `None` on other ranks.
    pub async fn gather<T: Element>(&self, input: &[T], root: usize) -> Result<Option<Vec<T>>> {
        let cx = self.begin_gather::<T>(input.len(), root)?;
        drive(&cx, dispatch::gather(&cx, &self.plan, input, root)).await
    }

    pub(super) fn begin_gather<T: Element>(&self, len: usize, root: usize) -> Result<OpCtx> {
        let root32 = self.check_rank("root", root)?;
        self.begin(self.desc::<T>(
            OpKind::Gather,
            None,
            self.choose(OpKind::Gather, len * T::DTYPE.size()),
            root32,
            len,
        )?)
    }

    /// Chunk `i` of `root`'s `input` (`size × out.len()` elements) to rank `i`'s
    /// `out`. Other ranks pass `None`.
    pub async fn scatter<T: Element>(
        &self,
        input: Option<&[T]>,
        out: &mut [T],
        root: usize,
    ) -> Result<()> {
        let cx = self.begin_scatter::<T>(input.map(<[T]>::len), out.len(), root)?;
        let input = if self.rank() == root {
            input.unwrap_or(&[])
        } else {
            &[]
        };
        drive(&cx, dispatch::scatter(&cx, &self.plan, input, out, root)).await
    }

    /// `input`: the length the root passed (others' is ignored).
    pub(super) fn begin_scatter<T: Element>(
        &self,
        input: Option<usize>,
        len: usize,
        root: usize,
    ) -> Result<OpCtx> {
        let root32 = self.check_rank("root", root)?;
        if self.rank() == root {
            let i = input
                .ok_or_else(|| Error::Invalid("scatter: the root must pass its input".into()))?;
            self.expect_len("scatter input", i, len * self.size())?;
        }
        self.begin(self.desc::<T>(
            OpKind::Scatter,
            None,
            self.choose(OpKind::Scatter, len * T::DTYPE.size()),
            root32,
            len,
        )?)
    }

    /// Reduces every rank's `input` (`size × out.len()` elements) with `op` and
    /// gives rank `i` chunk `i` of the result.
    pub async fn reduce_scatter<T: Element>(
        &self,
        input: &[T],
        out: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.expect_len("reduce_scatter input", input.len(), out.len() * self.size())?;
        let cx = self.begin_reduce_scatter::<T>(out.len(), op)?;
        drive(
            &cx,
            dispatch::reduce_scatter(&cx, &self.plan, input, out, op),
        )
        .await
    }

    pub(super) fn begin_reduce_scatter<T: Element>(
        &self,
        len: usize,
        op: ReduceOp,
    ) -> Result<OpCtx> {
        self.begin(self.desc::<T>(
            OpKind::ReduceScatter,
            Some(op),
            self.choose(OpKind::ReduceScatter, len * T::DTYPE.size()),
            0,
            len,
        )?)
    }

    /// Chunk `j` of rank `i`'s `input` becomes chunk `i` of rank `j`'s `out`
    /// (both `size × k` elements).
    pub async fn all_to_all<T: Element>(&self, input: &[T], out: &mut [T]) -> Result<()> {
        self.expect_len("all_to_all output", out.len(), input.len())?;
        let cx = self.begin_all_to_all::<T>(input.len())?;
        drive(&cx, dispatch::all_to_all(&cx, &self.plan, input, out)).await
    }

    pub(super) fn begin_all_to_all<T: Element>(&self, len: usize) -> Result<OpCtx> {
        let n = self.size();
        if !len.is_multiple_of(n) {
            return Err(Error::Invalid(format!(
                "all_to_all input of {len} elements does not split into {n} equal chunks"
            )));
        }
        self.begin(self.desc::<T>(
            OpKind::AllToAll,
            None,
            self.choose(OpKind::AllToAll, (len / n) * T::DTYPE.size()),
            0,
            len / n,
        )?)
    }

    /// Sends `data` to rank `dst` under `tag`; the matching [`ProcessGroup::recv`]
    /// must expect the same type and length.
    pub async fn send<T: Element>(&self, data: &[T], dst: usize, tag: u32) -> Result<()> {
        let cx = self.begin_send::<T>(data.len(), dst, tag)?;
        drive(&cx, algo::send_message(&cx, dst, data)).await
    }

    pub(super) fn begin_send<T: Element>(&self, len: usize, dst: usize, tag: u32) -> Result<OpCtx> {
        self.check_rank("destination", dst)?;
        if dst == self.rank() {
            return Err(Error::Invalid("send to self".into()));
        }
        self.begin_p2p(
            self.desc::<T>(
                OpKind::Send,
                None,
                self.choose(OpKind::Send, len * T::DTYPE.size()),
                tag,
                len,
            )?,
            dst,
            false,
        )
    }

    /// Receives the next message from `src` under `tag` into `out`.
    pub async fn recv<T: Element>(&self, out: &mut [T], src: usize, tag: u32) -> Result<()> {
        let cx = self.begin_recv::<T>(out.len(), src, tag)?;
        drive(&cx, algo::recv_message(&cx, src, out)).await
    }

    pub(super) fn begin_recv<T: Element>(&self, len: usize, src: usize, tag: u32) -> Result<OpCtx> {
        self.check_rank("source", src)?;
        if src == self.rank() {
            return Err(Error::Invalid("recv from self".into()));
        }
        self.begin_p2p(
            self.desc::<T>(
                OpKind::Send,
                None,
                self.choose(OpKind::Send, len * T::DTYPE.size()),
                tag,
                len,
            )?,
            src,
            true,
        )
    }

    // ---- objects ---------------------------------------------------------------

    /// Every rank's object, in rank order (serialised with postcard).
    pub async fn all_gather_object<S: Serialize + DeserializeOwned>(
        &self,
        obj: &S,
    ) -> Result<Vec<S>> {
        let bytes = postcard::to_allocvec(obj).map_err(|e| Error::Codec(e.to_string()))?;
        self.all_gather_varying(&bytes)
            .await?
            .iter()
            .map(|b| postcard::from_bytes(b).map_err(|e| Error::Codec(e.to_string())))
            .collect()
    }

    /// `root`'s object on every rank; the root passes `Some`, others `None`.
    pub async fn broadcast_object<S: Serialize + DeserializeOwned>(
        &self,
        obj: Option<&S>,
        root: usize,
    ) -> Result<S> {
        let mut bytes = match (self.rank() == root, obj) {
            (true, Some(o)) => postcard::to_allocvec(o).map_err(|e| Error::Codec(e.to_string()))?,
            (true, None) => {
                return Err(Error::Invalid(
                    "broadcast_object: the root must pass its object".into(),
                ))
            }
            (false, _) => Vec::new(),
        };
        let mut len = [bytes.len() as u64];
        self.broadcast(&mut len, root).await?;
        bytes.resize(len[0] as usize, 0);
        self.broadcast(&mut bytes, root).await?;
        postcard::from_bytes(&bytes).map_err(|e| Error::Codec(e.to_string()))
    }
}

/// The lengths' all-gather (`lens`, begun), then the data's as op `seq`.
pub(super) async fn all_gather_varying_impl<T: Element>(
    pg: &ProcessGroup,
    lens: OpCtx,
    seq: (u64, u32),
    input: &[T],
) -> Result<Vec<Vec<T>>> {
    let mut all_lens = vec![0u64; pg.size()];
    let first = drive(
        &lens,
        dispatch::all_gather(&lens, &pg.plan, &[input.len() as u64], &mut all_lens),
    )
    .await;
    // Ended: over shared memory its turn passes to the next op (the data's)
    // when it is dropped.
    drop(lens);
    // The data's op, begun even when the first failed (its number is taken;
    // the group is aborted then, so it fails at once).
    let mut bounds = Vec::with_capacity(all_lens.len());
    let mut at = 0usize;
    for &l in &all_lens {
        bounds.push(at..at + l as usize);
        at += l as usize;
    }
    let cx = pg.begin_at(
        seq,
        pg.desc::<T>(
            OpKind::AllGatherV,
            None,
            pg.choose(OpKind::AllGatherV, at * T::DTYPE.size()),
            0,
            at,
        )?,
    )?;
    if let Err(e) = first {
        cx.never_ran();
        return Err(e);
    }
    let mut all = vec![T::from_i8(0); at];
    drive(
        &cx,
        dispatch::all_gather_in(&cx, &pg.plan, input, &bounds, &mut all),
    )
    .await?;
    Ok(bounds.into_iter().map(|b| all[b].to_vec()).collect())
}
