//! Operations' turns, in the order of their sequence numbers: what makes
//! `*_async` operations started together run one after another where they
//! share one resource (a group's shared memory, a two-level op's steps).

use std::collections::BTreeSet;
use std::sync::Mutex;

use rallypoint_sync::MutexExt;

/// Operations' turns in sequence order: an operation waits
/// until every earlier one of its group has ended (here).
#[derive(Default)]
pub(crate) struct Turn {
    /// The first sequence number not yet ended, and those ended past it.
    state: Mutex<(u64, BTreeSet<u64>)>,
    moved: tokio::sync::Notify,
}

impl Turn {
    pub async fn wait(&self, seq: u64) {
        loop {
            let moved = self.moved.notified();
            tokio::pin!(moved);
            moved.as_mut().enable();
            if self.state.locked().0 >= seq {
                return;
            }
            moved.await;
        }
    }

    /// Every op before `seq` has ended, or will never run (see
    /// `Comm::step_ctx`).
    pub fn skip_to(&self, seq: u64) {
        {
            let mut g = self.state.locked();
            let (next, ended) = &mut *g;
            if seq <= *next {
                return;
            }
            *next = seq;
            *ended = ended.split_off(&seq);
            while ended.remove(next) {
                *next += 1;
            }
        }
        self.moved.notify_waiters();
    }

    pub fn done(&self, seq: u64) {
        {
            let mut g = self.state.locked();
            let (next, ended) = &mut *g;
            ended.insert(seq);
            while ended.remove(next) {
                *next += 1;
            }
        }
        self.moved.notify_waiters();
    }
}
