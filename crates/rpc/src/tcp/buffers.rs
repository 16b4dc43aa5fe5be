//! Receive buffers for messages' bulk, reused.
//!
//! A fresh 256 MiB buffer costs about as much as its transfer: the kernel
//! faults its 65,536 pages in as the bytes arrive, and unmaps them when it is
//! freed. The bulk a message delivers is a [`Bytes`] whose owner gives its
//! buffer back here when the program drops it, and the next message of about
//! that size reuses it. Small buffers are not kept, and at most [`KEEP`]
//! buffers of [`KEEP_BYTES`] in all.
//!
//! A message in parts is read by several readers at once, each into its own
//! piece of one buffer ([`Pieces`]): the parts are never copied together.

use std::ops::Range;
use std::sync::{Arc, Mutex, Weak};

use bytes::Bytes;
use rallypoint_sync::MutexExt;

/// Buffers smaller than this are not kept.
const KEEP_FROM: usize = 1 << 20;
/// At most this many buffers are kept, and this many bytes in all.
const KEEP: usize = 4;
const KEEP_BYTES: usize = 512 << 20;

#[derive(Default)]
pub(super) struct Pool {
    free: Mutex<Vec<Vec<u8>>>,
}

/// A buffer of exactly the length asked for; its contents are whatever was
/// there (every byte is overwritten before it is read).
pub(super) struct Buf {
    v: Vec<u8>,
    pool: Weak<Pool>,
}

impl Pool {
    /// A buffer of `n` bytes: a kept one of between `n` and `2n` bytes of
    /// capacity, or a new one.
    pub(super) fn take(self: &Arc<Self>, n: usize) -> Buf {
        if n >= KEEP_FROM {
            let mut free = self.free.locked();
            if let Some(i) = free
                .iter()
                .position(|v| v.capacity() >= n && v.capacity() <= 2 * n)
            {
                let mut v = free.swap_remove(i);
                drop(free);
                // Shrinking or growing within the capacity: the bytes are
                // initialised either way (old contents, or zeros).
                v.resize(n, 0);
                return Buf {
                    v,
                    pool: Arc::downgrade(self),
                };
            }
        }
        Buf {
            v: vec![0u8; n],
            pool: if n >= KEEP_FROM {
                Arc::downgrade(self)
            } else {
                Weak::new()
            },
        }
    }

    fn give(&self, v: Vec<u8>) {
        let mut free = self.free.locked();
        let kept: usize = free.iter().map(Vec::capacity).sum();
        if free.len() < KEEP && kept + v.capacity() <= KEEP_BYTES {
            free.push(v);
        }
    }

    /// Buffers kept now (for tests).
    #[cfg(test)]
    fn kept(&self) -> usize {
        self.free.locked().len()
    }
}

impl Buf {
    /// The buffer as the bulk of a message; it comes back to the pool when
    /// the last `Bytes` of it is dropped.
    pub(super) fn freeze(self) -> Bytes {
        if self.v.len() < KEEP_FROM {
            let mut me = std::mem::ManuallyDrop::new(self);
            return Bytes::from(std::mem::take(&mut me.v));
        }
        Bytes::from_owner(self)
    }
}

impl AsRef<[u8]> for Buf {
    fn as_ref(&self) -> &[u8] {
        &self.v
    }
}

impl std::ops::Deref for Buf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.v
    }
}

impl std::ops::DerefMut for Buf {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.v
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.upgrade() {
            pool.give(std::mem::take(&mut self.v));
        }
    }
}

/// One buffer filled in disjoint pieces by several readers at once. The
/// pieces are made from a raw pointer, never through a reference to the
/// whole buffer, so one reader's piece never aliases another's.
pub(super) struct Pieces {
    buf: Buf,
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: the bytes are only reached through `piece`, whose callers hand each
// range to one reader (see its contract); `buf` itself is not touched until
// `into_inner`, which owns the whole.
unsafe impl Send for Pieces {}
// SAFETY: as for `Send` (above).
unsafe impl Sync for Pieces {}

impl Pieces {
    pub(super) fn new(mut buf: Buf) -> Pieces {
        let len = buf.v.len();
        let ptr = std::ptr::NonNull::new(buf.v.as_mut_ptr()).expect("a Vec's pointer is not null");
        Pieces { buf, ptr, len }
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// The bytes of `r`, to fill.
    ///
    /// # Safety
    ///
    /// No two callers may hold pieces whose ranges overlap. (The message's
    /// part table gives each part's range to one reader: the part's slot
    /// goes from free to reading under its lock.)
    #[expect(
        clippy::mut_from_ref,
        reason = "disjoint pieces, by the contract above"
    )]
    pub(super) unsafe fn piece(&self, r: Range<usize>) -> &mut [u8] {
        assert!(
            r.start <= r.end && r.end <= self.len,
            "a piece outside the buffer"
        );
        // SAFETY: in bounds (asserted); not aliased (the caller's contract);
        // the buffer lives as long as `self`, and its Vec is never touched
        // while pieces are out.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(r.start), r.len()) }
    }

    pub(super) fn into_inner(self) -> Buf {
        self.buf
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_come_back_when_their_bytes_are_dropped() {
        let pool = Arc::new(Pool::default());
        let mut b = pool.take(4 << 20);
        b[0] = 7;
        let ptr = b.as_ptr();
        let bytes = b.freeze();
        let part = bytes.slice(10..20);
        drop(bytes);
        assert_eq!(pool.kept(), 0, "a slice still holds it");
        drop(part);
        assert_eq!(pool.kept(), 1);
        // A message of about that size reuses it; a much smaller one does not.
        let small = pool.take(1 << 20);
        assert_ne!(small.as_ptr(), ptr);
        drop(small);
        let again = pool.take(3 << 20);
        assert_eq!(again.as_ptr(), ptr);
        assert_eq!(again.len(), 3 << 20);
        // Small buffers are plain.
        let tiny = pool.take(100).freeze();
        assert_eq!(tiny.len(), 100);
    }

    #[test]
    fn pieces_fill_one_buffer() {
        let pool = Arc::new(Pool::default());
        let p = Arc::new(Pieces::new(pool.take(10)));
        let (a, b) = (p.clone(), p.clone());
        let t = std::thread::spawn(move || {
            // SAFETY: 0..5 and 5..10 are disjoint and each is given once.
            unsafe { a.piece(0..5) }.fill(1);
        });
        // SAFETY: as above.
        unsafe { b.piece(5..10) }.fill(2);
        t.join().unwrap();
        drop(b);
        let all = Arc::try_unwrap(p).ok().unwrap().into_inner().freeze();
        assert_eq!(&all[..], &[1, 1, 1, 1, 1, 2, 2, 2, 2, 2]);
    }
}
