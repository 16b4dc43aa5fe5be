//! A group's state shared by every handle to it ([`Comm`]): its transport,
//! members and options, and the numbering of its operations.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rallypoint_sync::MutexExt;
use tokio::time::Instant;

use super::{OpCtx, Turn};
use crate::frame::{hist_after, Desc, HIST_START};
use crate::options::Options;
use crate::transport::{Members, Shared, Transport};

/// The per-group state shared by every handle to it.
pub(crate) struct Comm {
    pub(crate) t: Arc<Transport>,
    pub(crate) id: u64,
    pub(crate) members: Members,
    /// This rank's place in `members`.
    pub(crate) rank: usize,
    /// Collective sequence numbers taken, and the history of calls.
    calls: Mutex<Calls>,
    /// Message numbers per (is-receive, peer, tag).
    pub(crate) p2p: Mutex<HashMap<(bool, usize, u32), u64>>,
    pub(crate) subgroups: Mutex<HashMap<Vec<usize>, u64>>,
    pub(crate) opts: Arc<Options>,
    /// Collectives' turns at the shared memory.
    pub(crate) turn: Turn,
}

/// A group's collectives so far, in the order they were called here.
struct Calls {
    /// The next collective's sequence number.
    next: u64,
    /// [`Desc::hist`] of the next collective: a hash of every call before it.
    hist: u32,
}

impl Default for Calls {
    fn default() -> Calls {
        Calls {
            next: 0,
            // Tracked from the first op on.
            hist: HIST_START,
        }
    }
}

impl Comm {
    pub(crate) fn sh(&self) -> &Arc<Shared> {
        &self.t.shared
    }

    /// Takes the next sequence number for `call`: the number, and the
    /// history of the calls before it.
    pub(crate) fn take_seq(&self, call: &Desc) -> (u64, u32) {
        let mut c = self.calls.locked();
        let taken = (c.next, c.hist);
        c.next += 1;
        c.hist = hist_after(c.hist, call);
        taken
    }

    /// The sequence number the next collective will take.
    pub(crate) fn next_seq(&self) -> u64 {
        self.calls.locked().next
    }

    pub(crate) fn new(
        t: Arc<Transport>,
        id: u64,
        members: Members,
        rank: usize,
        opts: Arc<Options>,
    ) -> Comm {
        Comm {
            t,
            id,
            members,
            rank,
            calls: Mutex::default(),
            p2p: Mutex::default(),
            subgroups: Mutex::default(),
            opts,
            turn: Turn::default(),
        }
    }

    /// An internal group of this group (see `two_level`): no messages.
    pub(crate) fn internal(&self, id: u64, members: Members, rank: usize) -> Arc<Comm> {
        self.sh().register_members(id, members.clone());
        Arc::new(Comm::new(
            self.t.clone(),
            id,
            members,
            rank,
            self.opts.clone(),
        ))
    }

    /// A step of a two-level op on this internal group: op `seq` (owned by
    /// the group op), with the group op's call, deadline and timeout.
    pub(crate) fn step_ctx(
        self: &Arc<Comm>,
        seq: u64,
        desc: Desc,
        deadline: Instant,
        timeout: Duration,
    ) -> OpCtx {
        // Every earlier internal op has ended here (the group's turn orders
        // two-level ops); those the group's ops left unused never will.
        self.turn.skip_to(seq);
        let mut cx = OpCtx::new(self.clone(), desc, seq, false, timeout);
        cx.deadline = deadline;
        if let Err(clash) = self.sh().begin_seq(self.id, seq, desc) {
            // The group's mismatch, at its op: raised on the group, whose
            // abort reaches this internal group (and fails the step).
            self.sh().raise(clash);
        }
        match self.sh().aborted_for(self.id, Some(seq)) {
            Some(e) => cx.doom(e),
            None => cx,
        }
    }
}

impl Drop for Comm {
    /// The group's last handle and op are gone here: its state goes too,
    /// after a grace (see `Shared::dropped`), so that `new_group` in a loop
    /// grows nothing but 8 bytes a group.
    fn drop(&mut self) {
        self.sh().dropped(self.id);
    }
}
