//! Errors. Every error a collective returns names the group, the operation and,
//! where one is to blame, the rank; errors are cheap to clone because one failure
//! is delivered to every pending operation of the group.

use std::sync::Arc;
use std::time::Duration;

/// How long at least a rank that finds calls diverged (see
/// [`Error::Diverged`]) waits for the abort of the first mismatch before it
/// reports what it found (four probes if longer). Any mismatch makes every
/// later call's history differ, so this wait is the common path of every
/// mismatch with ops in flight, and the abort it waits for may need a probe,
/// a store write and a connection on a loaded machine: 1 s was short once
/// in 18 runs of the simulator beside two CPU-bound processes. The wait
/// ends only the rare case where no rank reports the first mismatch.
pub const DIVERGED_GRACE: Duration = Duration::from_secs(5);

/// A collective's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Why a collective (or setting up a group) failed. New kinds of failure
/// may be added (as `MessageMismatch` was): match with a catch-all arm.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A peer's connection ended (EOF, reset, refused) while this rank needed it.
    #[error("{op} on group {group:?}: rank {rank} is gone: {reason}")]
    PeerGone {
        group: String,
        op: String,
        rank: usize,
        reason: String,
    },
    /// The operation's deadline passed.
    #[error("{op} on group {group:?} timed out after {timeout:?} waiting for {waiting_for}")]
    Timeout {
        group: String,
        op: String,
        timeout: Duration,
        /// Who never came, e.g. "rank 3 (step 2)".
        waiting_for: String,
    },
    /// Ranks called different collectives at the same point.
    #[error("mismatched collectives on group {group:?} at op #{seq}: rank {rank_a} called {desc_a} but rank {rank_b} called {desc_b}")]
    Mismatch {
        group: String,
        seq: u64,
        rank_a: usize,
        desc_a: String,
        rank_b: usize,
        desc_b: String,
    },
    /// Ranks' calls diverged before op `seq` (one called a collective that
    /// takes another number of ops, such as an all-gather of varying sizes,
    /// where another called a single op), and no rank reported the first
    /// difference within a grace (five seconds, or four of
    /// `Options::probe_after` if longer; or by the op's deadline, if that
    /// comes first): the calls named are the first that met, not the first
    /// that differed, shown with their histories.
    #[error("mismatched collectives on group {group:?}: the calls of ranks {rank_a} and {rank_b} diverged before op #{seq} (an earlier call differed, and no rank reported it), at op #{seq}: rank {rank_a} called {desc_a} but rank {rank_b} called {desc_b}")]
    Diverged {
        group: String,
        seq: u64,
        rank_a: usize,
        desc_a: String,
        rank_b: usize,
        desc_b: String,
    },
    /// A point-to-point message arrived with another type or length than its
    /// receive asked for (messages are matched by sender, tag and order).
    #[error("mismatched message on group {group:?}: rank {sender} sent message #{seq} of tag {tag} as {sent} but rank {receiver} expected {expected}")]
    MessageMismatch {
        group: String,
        tag: u32,
        /// The message's number among the sender's messages of this tag to
        /// this receiver.
        seq: u64,
        sender: usize,
        sent: String,
        receiver: usize,
        expected: String,
    },
    /// A connection with `rank` broke part-way through this op's data while
    /// the rank lived on (reset by the network, or timed out by the kernel
    /// while its host did not answer): a frame cut off as it was read, or a
    /// write that failed. What was in flight is lost and nothing sends it
    /// again, so the op, and the group, fail.
    #[error("{op} on group {group:?}: the connection with rank {rank} broke part-way through this op's data ({reason}); rank {rank} still answers, but what was in flight is lost")]
    ConnectionLost {
        group: String,
        op: String,
        rank: usize,
        reason: String,
    },
    /// The group was aborted, here or by another rank; every later op fails at once.
    #[error("group {group:?} is aborted: {reason}")]
    Aborted {
        group: String,
        reason: Arc<str>,
        /// The rank (of the group) that called [`crate::ProcessGroup::abort`]
        /// and told the others, when one did (not an op failing here).
        by: Option<usize>,
    },
    /// A peer sent something this rank cannot accept.
    #[error("group {group:?}: rank {rank} broke the protocol: {reason}")]
    Protocol {
        group: String,
        rank: usize,
        reason: String,
    },
    /// The job-secret handshake with a peer failed (see
    /// [`crate::Options::secret`]): it holds another secret, or one of the
    /// two holds none. The job is misconfigured; trying again cannot help.
    #[error("group {group:?}: no connection with rank {rank}: {reason}")]
    JobSecret {
        group: String,
        rank: usize,
        reason: String,
    },
    /// The caller's arguments are wrong (checked before anything is sent).
    #[error("{0}")]
    Invalid(String),
    /// Bootstrapping through the store or the URL rendezvous failed.
    #[error("setting up group {group:?}: {reason}")]
    Setup { group: String, reason: String },
    /// Serialising or deserialising an object (the `*_object` ops).
    #[error("object (de)serialisation: {0}")]
    Codec(String),
}

impl Error {
    /// Whether the error came from this group being aborted (here or elsewhere).
    pub fn is_aborted(&self) -> bool {
        matches!(self, Error::Aborted { .. })
    }
}
