//! Receives posted into the op's own buffer: the connection's reader reads
//! the payload straight into place (see `transport/landing.rs`), sparing the
//! copy out of a pool buffer, which was most of what a large broadcast over
//! TCP cost beyond the socket itself.
//!
//! Only ops whose future cannot be leaked post ([`OpCtx::may_post`]); the
//! others get `None` from [`Posts::of`] and copy as before. While a place is
//! posted the op must not touch it, so the algorithms that post hold their
//! buffer as a [`Place`] and take slices of it range by range, never one of
//! the whole buffer.

use std::marker::PhantomData;
use std::ops::Range;
use std::sync::Arc;

use crate::element::{bytes_of_mut, Element};
use crate::error::Result;
use crate::op::OpCtx;
use crate::transport::{Gate, Key, Landing, Start};

/// An op's buffer, handed out range by range.
pub(crate) struct Place<'a, T> {
    ptr: *mut T,
    len: usize,
    _buf: PhantomData<&'a mut [T]>,
}

// SAFETY: as `&mut [T]`, which a `Place` stands for; its slices are taken
// through its unsafe methods, whose callers keep them apart.
unsafe impl<T: Send> Send for Place<'_, T> {}
// SAFETY: as `&mut [T]` (above).
unsafe impl<T: Send + Sync> Sync for Place<'_, T> {}

impl<'a, T> Place<'a, T> {
    pub(crate) fn new(buf: &'a mut [T]) -> Place<'a, T> {
        Place {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
            _buf: PhantomData,
        }
    }

    /// The elements in `r`, to change.
    ///
    /// # Safety
    ///
    /// No other slice of `r` may be in use, nor `r` posted and not yet
    /// received.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn range(&self, r: Range<usize>) -> &mut [T] {
        std::slice::from_raw_parts_mut(self.at(&r), r.len())
    }

    /// The elements in `r`, to read.
    ///
    /// # Safety
    ///
    /// No slice of `r` to change may be in use, nor `r` posted and not yet
    /// received.
    pub(crate) unsafe fn get(&self, r: Range<usize>) -> &[T] {
        std::slice::from_raw_parts(self.at(&r), r.len())
    }

    fn at(&self, r: &Range<usize>) -> *mut T {
        assert!(r.start <= r.end && r.end <= self.len);
        // SAFETY: within the buffer.
        unsafe { self.ptr.add(r.start) }
    }
}

/// The receives one op posted; dropping it, as the op ends however it ends,
/// stops them and revokes their landings.
pub(crate) struct Posts<'a> {
    cx: &'a OpCtx,
    gate: Arc<Gate>,
    keys: Vec<Key>,
}

/// One posted receive.
pub(crate) struct Posted {
    key: Key,
    from: usize,
    step: u32,
    start: Start,
}

impl<'a> Posts<'a> {
    /// `None` where the op may not post (see the module docs). Borrows
    /// `place` while the posts live, so the buffer cannot be used whole
    /// until they are dropped.
    pub(crate) fn of<T>(cx: &'a OpCtx, _place: &'a Place<'_, T>) -> Option<Posts<'a>> {
        cx.may_post().then(|| Posts {
            cx,
            gate: Arc::default(),
            keys: Vec::new(),
        })
    }

    /// Posts the receive of `step` from `from` into `r` of `place`.
    ///
    /// # Safety
    ///
    /// `r` must stay untouched until [`Posts::recv`] returns for it or this
    /// `Posts` is dropped.
    pub(crate) unsafe fn post<T: Element>(
        &mut self,
        from: usize,
        step: u32,
        place: &Place<'_, T>,
        r: Range<usize>,
    ) -> Posted {
        let key = self.cx.key(from, step);
        let len = std::mem::size_of::<T>() * r.len();
        // SAFETY: the caller's promise, and the op's (`OpCtx::allow_posting`)
        // that this `Posts` is dropped before the buffer's borrow ends.
        let landing = Landing::new(place.at(&r).cast::<u8>(), len, self.gate.clone());
        let start = self.cx.sh().start_recv(key, Some(landing));
        self.keys.push(key);
        Posted {
            key,
            from,
            step,
            start,
        }
    }

    /// Waits for a posted receive: its payload landed in place, or (filed
    /// before it was posted) is copied into `r` of `place`, the place posted.
    pub(crate) async fn recv<T: Element>(
        &self,
        p: Posted,
        place: &Place<'_, T>,
        r: Range<usize>,
    ) -> Result<()> {
        let cx = self.cx;
        cx.set_waiting(p.from, p.step, false);
        let f = cx
            .sh()
            .wait_recv(p.key, p.start, Some(cx.desc()), cx.deadline)
            .await
            .map_err(|f| cx.error(f))?;
        if !f.landed {
            // SAFETY: nothing was posted into `r` (the frame was filed
            // first) or the reader is done with it.
            let out = bytes_of_mut(unsafe { place.range(r) });
            cx.check_len(p.from, p.step, f.buf.len(), out.len())?;
            out.copy_from_slice(f.buf.bytes());
        }
        Ok(())
    }
}

impl Drop for Posts<'_> {
    fn drop(&mut self) {
        self.cx.sh().cancel_recvs(&self.keys);
        self.gate.revoke();
    }
}
