//! Remote references, with PyTorch's owner-based reference counting.
//!
//! An [`RRef<T>`](crate::RRef) names a value held by one worker, its *owner*. Every other
//! worker's handle is a *user*, identified by a fork id unique in the job; the
//! owner keeps the set of fork ids that may still use its value (with the
//! worker holding each), and deletes the value when that set is empty and no
//! local handle is left. The messages and guarantees are PyTorch's ("Note
//! [RRef Protocol]"):
//!
//! * `remote()` creates the first user on the caller; the owner records its
//!   fork when the REMOTE_CALL arrives, and the answer confirms the user.
//! * Passing an RRef in a message forks it: the sender makes a new fork id and
//!   keeps its own handle alive as the child's *parent* until the child has
//!   been accepted (G2: a parent is not deleted before the owner has confirmed
//!   its child). A child on a third worker asks the owner to record it
//!   (FORK_REQUEST), and once the owner has, tells its parent (CHILD_ACCEPT). A
//!   fork made by the owner is recorded at once; a fork sent to the owner
//!   becomes a local handle there.
//! * When the last handle of a user is dropped, the owner is told (USER_DELETE;
//!   G1: the owner is told of every user deletion). A user dropped before it was
//!   confirmed is deleted when the confirmation arrives.
//! * No ordering between workers is assumed: a FORK_REQUEST or USER_DELETE may
//!   reach the owner before the REMOTE_CALL that creates the value.
//!   Control messages are retried, so their handlers are idempotent; the owner
//!   remembers a deleted fork (a tombstone) when a message that registers it
//!   may still come: the deletion came first, or the fork was registered by
//!   a FORK_REQUEST, which is retried. A tombstone is kept for
//!   [`TOMBSTONE_TTL`], longer than any retry lasts; the forks the owner
//!   makes itself (a parameter server handing out its RRef) leave none, so a
//!   long-lived value's bookkeeping does not grow with its users.
//! * User functions run only after every RRef among their arguments is
//!   confirmed.
//!
//! Unlike PyTorch, deletion does not wait for a garbage collector: dropping the
//! last `RRef` handle sends the deletion. At graceful shutdown every user still
//! held is released, owners wait for their users' deletions, and whatever is
//! still referenced when time runs out is reported by name (never dropped
//! silently).
//!
//! # Where the decisions live
//!
//! Every decision of the protocol is made by a pure machine, `table.rs`
//! (events in, effects out); the agent (`agent/rrefs.rs`) holds it under a lock and
//! applies its effects. `sim.rs` (tests only) runs several tables through
//! thousands of seeded schedules of reordered, repeated and delayed
//! messages and killed workers, checking G1, G2, that every wait ends and
//! that shutdown ends, after every step.

use std::fmt;
use std::time::Duration;

pub use crate::wire::{ForkId, Gid, RRefId};

#[cfg(test)]
mod sim;
pub(crate) mod table;

/// How long a deleted fork's tombstone is kept: longer than a FORK_REQUEST
/// is retried (5 attempts, each within a call timeout of 60 s by default).
pub(crate) const TOMBSTONE_TTL: Duration = Duration::from_secs(600);

/// An RRef still referenced when shutdown gave up waiting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leak {
    pub rref: RRefId,
    /// What created it, e.g. `remote "make_model" from worker trainer0`.
    pub what: String,
    /// Workers still holding a reference (by name), or why it is leaked.
    pub held_by: Vec<String>,
}

impl fmt::Display for Leak {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "RRef {} ({}) still referenced by {}",
            self.rref,
            self.what,
            self.held_by.join(", ")
        )
    }
}
