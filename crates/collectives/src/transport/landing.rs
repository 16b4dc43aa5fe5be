//! Posted receives: a frame's payload read from the socket straight into the
//! operation's own buffer, as gloo does, instead of into a pool buffer that
//! the operation then copies out of.
//!
//! An operation posts a [`Landing`] (a place in its buffer) with a receive;
//! the connection's reader, on that frame's header, takes the landing from
//! the router (which first checks the frame as it checks any other) and
//! reads the payload into it, then tells the router it landed. The operation
//! does not touch a posted place until its receive returns.
//!
//! **Why this is sound.** A landing is a raw pointer into memory the reader
//! does not own. The reader writes through it only while holding its op's
//! [`Gate`] open, one non-blocking read at a time; the op closes the gate
//! ([`Gate::revoke`]) when it ends, however it ends (its `Posts` guard is
//! dropped when the op's future completes or is dropped), and from then on
//! the reader drains the rest of the payload into scratch. So nothing is
//! written after the op's future is gone, provided that future is dropped
//! before the buffer's borrow ends. That holds only where the future
//! cannot be leaked: the op's `*_async` form, whose task owns its buffer,
//! and [`crate::blocking::BlockingGroup`], which runs the future to
//! completion (or drops it while unwinding) within the call. A borrowing
//! `async fn` op can be leaked by its caller (`mem::forget` after a poll),
//! ending the borrow with the reader still writing, so those ops do not post
//! and copy instead (see `OpCtx::allow_posting`).

use std::sync::{Arc, Mutex};

use rallypoint_sync::MutexExt;

/// Closes every landing of one op at once.
#[derive(Default)]
pub(crate) struct Gate {
    revoked: Mutex<bool>,
}

impl Gate {
    /// No landing of this gate is written to after this returns.
    pub fn revoke(&self) {
        *self.revoked.locked() = true;
    }
}

/// A place in an operation's buffer that one frame's payload may be read into.
pub(crate) struct Landing {
    ptr: *mut u8,
    len: usize,
    gate: Arc<Gate>,
}

// SAFETY: the pointer is written only under the gate's lock, while the op
// that owns the memory has not revoked it (see the module docs).
unsafe impl Send for Landing {}
// SAFETY: a shared `Landing` writes only through `write`, under the lock.
unsafe impl Sync for Landing {}

impl Landing {
    /// # Safety
    ///
    /// `ptr` must be valid for writes of `len` bytes until `gate` is
    /// revoked, and nothing else may read or write those bytes until the
    /// receive this landing is posted with returns or `gate` is revoked.
    pub unsafe fn new(ptr: *mut u8, len: usize, gate: Arc<Gate>) -> Landing {
        Landing { ptr, len, gate }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Runs `f` on the bytes from `at` on, unless the gate is revoked
    /// (`None`). `f` must not block: the op's end waits for it.
    pub fn write<R>(&self, at: usize, f: impl FnOnce(&mut [u8]) -> R) -> Option<R> {
        let revoked = self.gate.revoked.locked();
        if *revoked {
            return None;
        }
        assert!(at <= self.len);
        // SAFETY: valid until revoked (checked under the lock, held until `f`
        // returns), and nobody else touches these bytes meanwhile.
        let s = unsafe { std::slice::from_raw_parts_mut(self.ptr.add(at), self.len - at) };
        Some(f(s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_is_written_once_revoked() {
        let mut buf = vec![0u8; 8];
        let gate = Arc::new(Gate::default());
        // SAFETY: the buffer outlives the landing: the test ends it (or
        // revokes it) before the buffer is dropped.
        let l = unsafe { Landing::new(buf.as_mut_ptr(), buf.len(), gate.clone()) };
        assert_eq!(
            l.write(2, |s| {
                s[0] = 7;
                s.len()
            }),
            Some(6)
        );
        gate.revoke();
        assert_eq!(l.write(0, |s| s[0] = 9), None);
        drop(l);
        assert_eq!(buf, [0, 0, 7, 0, 0, 0, 0, 0]);
    }
}
