//! Locks taken the one way rallypoint takes them: past a poisoned lock.
//!
//! A std lock is poisoned when a thread panics while holding it; `lock()`
//! then returns an error on every later call. rallypoint takes every lock
//! past that error, with the data as the panicking thread left it, and says
//! so once, here, rather than at each of its hundred-odd locks:
//!
//! * Nothing under these locks is a multi-step invariant that a panic could
//!   leave half-made: each critical section is a map insert or removal, a
//!   counter, a swap of one value. The state a panic leaves is state some
//!   other thread could have seen anyway.
//! * A panic in a library thread is a defect that is already being
//!   reported (the task's join error, the test's failure). Failing every
//!   later caller of the lock as well would turn one defect into a hung or
//!   crashed job: a store server that stops serving every client, a
//!   collective that cannot be aborted, a Python process that cannot exit.
//!
//! A lock whose data a panic *could* leave inconsistent must not use these:
//! handle the poison there and say why.
//!
//! ```
//! use std::sync::Mutex;
//! use rallypoint_sync::MutexExt;
//!
//! let m = Mutex::new(1);
//! *m.locked() += 1;
//! assert_eq!(*m.locked(), 2);
//! ```

use std::sync::{
    Condvar, Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard,
    WaitTimeoutResult,
};
use std::time::Duration;

/// [`Mutex::lock`], past poison (see the crate's docs).
pub trait MutexExt<T: ?Sized> {
    /// The lock, taken even if a thread panicked while holding it.
    fn locked(&self) -> MutexGuard<'_, T>;
}

impl<T: ?Sized> MutexExt<T> for Mutex<T> {
    fn locked(&self) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// [`RwLock::read`] and [`RwLock::write`], past poison (see the crate's
/// docs).
pub trait RwLockExt<T: ?Sized> {
    /// A read lock, taken even if a writer panicked.
    fn read_locked(&self) -> RwLockReadGuard<'_, T>;
    /// The write lock, taken even if a writer panicked.
    fn write_locked(&self) -> RwLockWriteGuard<'_, T>;
}

impl<T: ?Sized> RwLockExt<T> for RwLock<T> {
    fn read_locked(&self) -> RwLockReadGuard<'_, T> {
        self.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write_locked(&self) -> RwLockWriteGuard<'_, T> {
        self.write().unwrap_or_else(PoisonError::into_inner)
    }
}

/// [`Condvar::wait_timeout`], past poison (see the crate's docs).
pub trait CondvarExt {
    /// Waits on `guard` for a notification or `timeout`, taking the lock
    /// back even if a thread panicked while holding it.
    fn wait_timeout_locked<'a, T>(
        &self,
        guard: MutexGuard<'a, T>,
        timeout: Duration,
    ) -> (MutexGuard<'a, T>, WaitTimeoutResult);
}

impl CondvarExt for Condvar {
    fn wait_timeout_locked<'a, T>(
        &self,
        guard: MutexGuard<'a, T>,
        timeout: Duration,
    ) -> (MutexGuard<'a, T>, WaitTimeoutResult) {
        self.wait_timeout(guard, timeout)
            .unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lock_poisoned_by_a_panic_is_taken_with_the_data_left() {
        let m = Mutex::new(vec![1]);
        let rw = RwLock::new(5);
        std::thread::scope(|s| {
            let poisoned = s
                .spawn(|| {
                    let _r = rw.write_locked();
                    let mut g = m.locked();
                    g.push(2);
                    panic!("a defect, reported where it happened");
                })
                .join();
            assert!(poisoned.is_err());
        });
        assert!(m.is_poisoned() && rw.is_poisoned());
        assert_eq!(*m.locked(), [1, 2]);
        *rw.write_locked() += 1;
        assert_eq!(*rw.read_locked(), 6);
    }
}
