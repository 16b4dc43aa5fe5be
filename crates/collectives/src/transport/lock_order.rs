//! The transport's locks in one order, checked.
//!
//! Every `std` mutex the transport shares between its tasks is an
//! [`Ordered`]: a mutex with a [`Level`]. A thread may take a lock only
//! while every lock it holds has a lower level; locks of one level (the
//! leaves) are never held together. The order itself is written at
//! [`Shared`](super::Shared), and the levels are the constants below.
//!
//! In debug builds each thread keeps the levels it holds; taking a lock
//! while one of an equal or higher level is held panics, naming both, so a
//! wrong order fails the first test that runs it rather than deadlocking
//! once in a flake loop. The stack is per thread, which is sound because a
//! `std` guard is not `Send`: a task cannot hold one across an `.await`
//! (its future would not be `Send` and could not be spawned), so a guard is
//! taken and dropped on one thread, with no other task's locks in between.
//! Release builds only lock.

use std::ops::{Deref, DerefMut};
use std::sync::{Mutex, MutexGuard};

use rallypoint_sync::MutexExt;

/// A lock's place in the order: lower ranks are taken first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Level {
    pub rank: u8,
    pub name: &'static str,
}

/// The router and each group's entry (see `router.rs`).
pub(crate) const ROUTER: Level = Level {
    rank: 1,
    name: "router",
};
/// This rank's credit with each peer.
pub(crate) const OUTBOUND: Level = Level {
    rank: 2,
    name: "outbound",
};
/// The queues of control frames, per peer.
pub(crate) const CONTROL: Level = Level {
    rank: 3,
    name: "control",
};
/// Leaves: each is taken alone, and nothing is taken while one is held.
const LEAF: u8 = 4;
pub(crate) const PEERS: Level = Level {
    rank: LEAF,
    name: "peers",
};
pub(crate) const ADDRS: Level = Level {
    rank: LEAF,
    name: "addrs",
};
pub(crate) const UNPUBLISHED: Level = Level {
    rank: LEAF,
    name: "unpublished",
};
pub(crate) const CONNECTING: Level = Level {
    rank: LEAF,
    name: "connecting",
};
pub(crate) const HOSTS: Level = Level {
    rank: LEAF,
    name: "hosts",
};
pub(crate) const STORE: Level = Level {
    rank: LEAF,
    name: "store",
};
/// A group's abort as its internal group sees it ([`ChildLink`](super::ChildLink)).
pub(crate) const CHILD_LINK: Level = Level {
    rank: LEAF,
    name: "child link",
};

/// A mutex with a place in the order (see the module docs).
pub(crate) struct Ordered<T> {
    level: Level,
    m: Mutex<T>,
}

impl<T> Ordered<T> {
    pub const fn new(level: Level, value: T) -> Ordered<T> {
        Ordered {
            level,
            m: Mutex::new(value),
        }
    }

    /// Takes the lock (a poisoned one too: see `rallypoint_sync`).
    pub fn lock(&self) -> Guard<'_, T> {
        held::push(self.level);
        Guard {
            g: self.m.locked(),
            level: self.level,
        }
    }
}

impl<T: Default> Ordered<T> {
    pub fn with_default(level: Level) -> Ordered<T> {
        Ordered::new(level, T::default())
    }
}

pub(crate) struct Guard<'a, T> {
    g: MutexGuard<'a, T>,
    level: Level,
}

impl<T> Deref for Guard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.g
    }
}

impl<T> DerefMut for Guard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.g
    }
}

impl<T> Drop for Guard<'_, T> {
    fn drop(&mut self) {
        held::pop(self.level);
    }
}

/// The levels this thread holds (debug builds).
#[cfg(debug_assertions)]
mod held {
    use std::cell::RefCell;

    use super::Level;

    thread_local! {
        static HELD: RefCell<Vec<Level>> = const { RefCell::new(Vec::new()) };
    }

    /// Notes `l` as taken; panics if a lock of its level or a higher one is
    /// held.
    pub fn push(l: Level) {
        let wrong = HELD.with_borrow_mut(|held| {
            let wrong = held.iter().copied().find(|h| h.rank >= l.rank);
            if wrong.is_none() {
                held.push(l);
            }
            wrong
        });
        if let Some(h) = wrong {
            panic!(
                "lock order: taking the {} lock (level {}) while holding the {} lock (level {})",
                l.name, l.rank, h.name, h.rank
            );
        }
    }

    /// Notes `l` as released (guards may be dropped in any order).
    pub fn pop(l: Level) {
        HELD.with_borrow_mut(|held| {
            if let Some(i) = held.iter().rposition(|h| *h == l) {
                held.remove(i);
            }
        });
    }
}

#[cfg(not(debug_assertions))]
mod held {
    use super::Level;

    pub fn push(_: Level) {}
    pub fn pop(_: Level) {}
}

#[cfg(all(test, debug_assertions))]
mod tests {
    use super::*;

    #[test]
    fn locks_taken_in_order_pass() {
        let (r, o, c, p) = (
            Ordered::new(ROUTER, ()),
            Ordered::new(OUTBOUND, ()),
            Ordered::new(CONTROL, ()),
            Ordered::new(PEERS, ()),
        );
        for _ in 0..3 {
            let _r = r.lock();
            let _o = o.lock();
            let _c = c.lock();
            let _p = p.lock();
        }
        // Released out of order, then taken again.
        let gr = r.lock();
        let gc = c.lock();
        drop(gr);
        drop(gc);
        let _r = r.lock();
    }

    #[test]
    #[should_panic(expected = "taking the router lock (level 1) while holding the control lock")]
    fn a_lock_taken_against_the_order_panics() {
        let (r, c) = (Ordered::new(ROUTER, ()), Ordered::new(CONTROL, ()));
        let _c = c.lock();
        let _r = r.lock();
    }

    #[test]
    #[should_panic(expected = "taking the addrs lock (level 4) while holding the peers lock")]
    fn two_leaves_together_panic() {
        let (p, a) = (Ordered::new(PEERS, ()), Ordered::new(ADDRS, ()));
        let _p = p.lock();
        let _a = a.lock();
    }

    /// Every pair of levels, taken both ways: the lower first passes, the
    /// other way (or two of one level) panics.
    #[test]
    fn every_pair_is_checked_both_ways() {
        let all = [
            ROUTER,
            OUTBOUND,
            CONTROL,
            PEERS,
            ADDRS,
            UNPUBLISHED,
            CONNECTING,
            HOSTS,
            CHILD_LINK,
        ];
        for a in all {
            for b in all {
                let (x, y) = (Ordered::new(a, ()), Ordered::new(b, ()));
                let taken = std::panic::catch_unwind(|| {
                    let _x = x.lock();
                    let _y = y.lock();
                });
                assert_eq!(taken.is_ok(), a.rank < b.rank, "{a:?} then {b:?}");
                // The thread's stack is clean after either outcome.
                let _y = y.lock();
            }
        }
    }
}
