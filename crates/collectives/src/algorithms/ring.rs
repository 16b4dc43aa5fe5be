//! The segmented, pipelined ring: reduce-scatter and all-gather, and
//! all_reduce and reduce built of them. Every rank sends and receives
//! `(n − 1)/n` of the buffer per pass, the least any algorithm can: the
//! choice for large payloads.

use std::collections::VecDeque;
use std::ops::Range;

use super::direct::gather_direct;
use super::posted::{Place, Posted, Posts};
use super::{even_bounds, nseg, seg_range, Steps};
use crate::element::{Element, ReduceOp};
use crate::error::Result;
use crate::op::OpCtx;

/// Ring reduce-scatter over `bounds`: at step `t` rank `r` sends chunk
/// `r − t − 1` and reduces chunk `r − t − 2` into its buffer, forwarding each
/// reduced segment at once; afterwards chunk `r` holds the full reduction.
/// Uses phases `phase0 .. phase0 + n − 1`.
pub(crate) async fn ring_reduce_scatter<T: Element>(
    cx: &OpCtx,
    buf: &mut [T],
    bounds: &[Range<usize>],
    op: ReduceOp,
    phase0: usize,
) -> Result<()> {
    let Some(ring) = Ring::new::<T>(cx, bounds, phase0 + cx.n() - 1)? else {
        return Ok(());
    };
    let place = Place::new(buf);
    ring.pass(&place, Some(op), phase0, None, &mut [], |_| {})
        .await
}

/// Ring all-gather over `bounds`: chunk `r` is this rank's; at step `t` rank `r`
/// sends chunk `r − t` and receives chunk `r − t − 1`, forwarding each segment at
/// once. Uses phases `phase0 .. phase0 + n − 1`. Where the op may, every
/// receive is posted as the pass starts, so each segment lands in place (see
/// `posted.rs`): the chunks it receives are not otherwise touched until
/// received.
pub(crate) async fn ring_all_gather<T: Element>(
    cx: &OpCtx,
    buf: &mut [T],
    bounds: &[Range<usize>],
    phase0: usize,
) -> Result<()> {
    let Some(ring) = Ring::new::<T>(cx, bounds, phase0 + cx.n() - 1)? else {
        return Ok(());
    };
    let place = Place::new(buf);
    let mut posts = Posts::of(cx, &place);
    let mut ahead: Vec<VecDeque<Posted>> = match posts.as_mut() {
        // SAFETY: nothing else touches the chunks received (above).
        Some(p) => (0..ring.n - 1)
            .map(|t| unsafe { ring.post_gather_step(p, &place, phase0, t) })
            .collect(),
        None => Vec::new(),
    };
    ring.pass(&place, None, phase0, posts.as_ref(), &mut ahead, |_| {})
        .await
}

/// Ring all-reduce: reduce-scatter, the mean taken on the owned chunk,
/// all-gather. Where the op may, the all-gather's receives are posted during
/// the reduce-scatter, each chunk's as soon as the reduce-scatter is done
/// with it, so that segments sent by a neighbour that reached its all-gather
/// first land in place too.
pub(crate) async fn ring_all_reduce<T: Element>(
    cx: &OpCtx,
    buf: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let n = cx.n();
    let bounds = even_bounds(buf.len(), n);
    let Some(ring) = Ring::new::<T>(cx, &bounds, 2 * n - 2)? else {
        return Ok(());
    };
    let gather0 = n - 1;
    let place = Place::new(buf);
    let mut posts = Posts::of(cx, &place);
    let mut ahead: Vec<VecDeque<Posted>> = (0..n - 1).map(|_| VecDeque::new()).collect();
    let after_step = |t: usize| {
        let Some(p) = posts.as_mut() else { return };
        // The reduce-scatter's step `t` was the last to touch the chunk the
        // all-gather receives at step `t + 1` (and step 0 sent the one it
        // receives at step 0); later steps touch neither.
        let free = if t == 0 { 0..2 } else { t + 1..t + 2 };
        for g in free.filter(|&g| g < n - 1) {
            // SAFETY: as above; the all-gather touches a received chunk only
            // once received.
            ahead[g] = unsafe { ring.post_gather_step(p, &place, gather0, g) };
        }
    };
    ring.pass(&place, Some(op), 0, None, &mut [], after_step)
        .await?;
    if op == ReduceOp::Avg {
        // SAFETY: chunk `r` is never received in the all-gather.
        T::divide(unsafe { place.range(bounds[cx.me()].clone()) }, n);
    }
    ring.pass(&place, None, gather0, posts.as_ref(), &mut ahead, |_| {})
        .await
}

/// One ring over `bounds`: who is next and previous, the segment size, and
/// the step keys of both passes.
struct Ring<'a, 'c> {
    cx: &'c OpCtx,
    bounds: &'a [Range<usize>],
    n: usize,
    r: usize,
    next: usize,
    prev: usize,
    seg: usize,
    steps: Steps,
}

impl<'a, 'c> Ring<'a, 'c> {
    /// `None` for a group of one, where a pass does nothing. `phases`: how
    /// many phases the op's step keys must hold.
    fn new<T: Element>(
        cx: &'c OpCtx,
        bounds: &'a [Range<usize>],
        phases: usize,
    ) -> Result<Option<Self>> {
        let (n, r) = (cx.n(), cx.me());
        if n == 1 {
            return Ok(None);
        }
        // Every rank knows every chunk's length, so all choose one size.
        let seg = cx.seg_for::<T>(bounds.iter().map(Range::len).sum());
        let stride = (0..n)
            .map(|c| nseg(bounds[c].len(), seg))
            .max()
            .unwrap_or(1);
        let steps = Steps::new(cx, phases, stride)?;
        Ok(Some(Ring {
            cx,
            bounds,
            n,
            r,
            next: (r + 1) % n,
            prev: (r + n - 1) % n,
            seg,
            steps,
        }))
    }

    fn segs(&self, c: usize) -> usize {
        nseg(self.bounds[c].len(), self.seg)
    }

    /// The chunk received at step `t` of a pass shifted by `shift`.
    fn chunk_in(&self, t: usize, shift: usize) -> usize {
        (self.r + 2 * self.n - t - 1 - shift) % self.n
    }

    /// Posts the receives of an all-gather pass's step `t` (phase `phase0 +
    /// t`), one per segment, in order.
    ///
    /// # Safety
    ///
    /// The chunk that step receives must be untouched until each receive
    /// returns or `p` is dropped.
    unsafe fn post_gather_step<T: Element>(
        &self,
        p: &mut Posts<'_>,
        place: &Place<'_, T>,
        phase0: usize,
        t: usize,
    ) -> VecDeque<Posted> {
        let c = self.chunk_in(t, 0);
        (0..self.segs(c))
            .map(|s| {
                let rg = seg_range(&self.bounds[c], self.seg, s);
                p.post(self.prev, self.steps.at(phase0 + t, s), place, rg)
            })
            .collect()
    }

    /// One pass around the ring, the shape both ring phases share: at step
    /// `t` rank `r` sends chunk `r − t − shift` to `r + 1` and receives chunk
    /// `r − t − 1 − shift` from `r − 1`, reducing it in (`reduce`, shift 1)
    /// or copying it (shift 0), and forwards each received segment at the
    /// next step without waiting for the rest of its chunk. `ahead`: the
    /// receives posted for each step of a copying pass (empty where none
    /// were); `after_step` runs after each step.
    ///
    /// Sound only if whatever `after_step` posts (or `ahead` holds) is a
    /// chunk the rest of the pass touches only through those receives:
    /// step `t` touches its chunk in, and at step 0 the chunk sent first.
    async fn pass<T: Element>(
        &self,
        place: &Place<'_, T>,
        reduce: Option<ReduceOp>,
        phase0: usize,
        posts: Option<&Posts<'_>>,
        ahead: &mut [VecDeque<Posted>],
        mut after_step: impl FnMut(usize),
    ) -> Result<()> {
        let (cx, n, next, prev) = (self.cx, self.n, self.next, self.prev);
        let shift = usize::from(reduce.is_some());
        let first_out = (self.r + n - shift) % n;
        for t in 0..n - 1 {
            let cin = self.chunk_in(t, shift);
            let m = if t == 0 {
                self.segs(cin).max(self.segs(first_out))
            } else {
                self.segs(cin)
            };
            for s in 0..m {
                if t == 0 && s < self.segs(first_out) {
                    let out = seg_range(&self.bounds[first_out], self.seg, s);
                    // SAFETY: not posted before step 0 ends (this rank's own
                    // chunk, or, in an all_reduce's reduce-scatter, the one
                    // `after_step(0)` posts after it is sent).
                    cx.send(next, self.steps.at(phase0, s), unsafe { place.get(out) })
                        .await?;
                }
                if s < self.segs(cin) {
                    let rg = seg_range(&self.bounds[cin], self.seg, s);
                    let at = self.steps.at(phase0 + t, s);
                    let one = ahead.get_mut(t).and_then(VecDeque::pop_front);
                    debug_assert!(
                        reduce.is_none() || one.is_none(),
                        "a reducing pass posts nothing"
                    );
                    debug_assert!(
                        one.is_some() || posts.is_none() || ahead.is_empty(),
                        "every segment of a posting pass is posted"
                    );
                    match (reduce, posts, one) {
                        (Some(op), ..) => {
                            // SAFETY: segment `rg` of chunk `cin` is used by
                            // this step alone.
                            let seg = unsafe { place.range(rg.clone()) };
                            cx.recv_reduce(prev, at, seg, op).await?
                        }
                        (None, Some(p), Some(one)) => p.recv(one, place, rg.clone()).await?,
                        (None, ..) => {
                            // SAFETY: as above.
                            let seg = unsafe { place.range(rg.clone()) };
                            cx.recv_copy(prev, at, seg).await?
                        }
                    }
                    if t + 2 < n {
                        // SAFETY: segment `rg`, used by this step alone, was
                        // received (or posted and landed) just above.
                        let seg = unsafe { place.get(rg) };
                        cx.send(next, self.steps.at(phase0 + t + 1, s), seg).await?;
                    }
                }
            }
            after_step(t);
        }
        Ok(())
    }
}

/// Large reduce: ring reduce-scatter, then every rank sends its reduced chunk to
/// the root. `buf` is the root's output or a scratch copy elsewhere.
pub(crate) async fn ring_reduce<T: Element>(
    cx: &OpCtx,
    buf: &mut [T],
    op: ReduceOp,
    root: usize,
) -> Result<()> {
    let (n, r) = (cx.n(), cx.me());
    let bounds = even_bounds(buf.len(), n);
    ring_reduce_scatter(cx, buf, &bounds, op, 0).await?;
    // The ring's segments (sized by the buffer): with `segment_bytes`'
    // instead the stride differed, and the gather's keys fell among the
    // ring's last phase's.
    let seg = cx.seg_for::<T>(buf.len());
    gather_direct(cx, buf, &bounds, root, n - 1, seg).await?;
    if op == ReduceOp::Avg && r == root {
        T::divide(buf, n);
    }
    Ok(())
}
