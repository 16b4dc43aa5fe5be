//! Aborted groups: each group's abort (the error, the first collective it
//! fails, whether it is provisional), the signal that wakes its sends, and
//! which peers have it.

use std::collections::{HashMap, HashSet};

use tokio_util::sync::CancellationToken;

use crate::error::Error;

struct Aborted {
    err: Error,
    /// The first collective sequence number the abort fails.
    from: u64,
    /// Calls found diverged, reported by a rank as it gave up waiting for
    /// the first mismatch (see `diverged.rs`): told marked so.
    provisional: bool,
}

#[derive(Default)]
pub(super) struct Aborts {
    aborted: HashMap<u64, Aborted>,
    /// Cancelled when its group aborts: wakes sends blocked on a full socket.
    signals: HashMap<u64, CancellationToken>,
    /// (group, peer) pairs where the peer has the abort: it sent it to us, or
    /// we have written it to the peer.
    told: HashSet<(u64, usize)>,
}

impl Aborts {
    /// Records group `comm`'s abort from collective `from` on. The first
    /// abort wins, except that one failing earlier collectives replaces it,
    /// and any replaces a provisional one from the same op. Returns whether
    /// it changed: then the group's sends wake, and every peer must be told
    /// again.
    pub fn abort(&mut self, comm: u64, err: Error, from: u64) -> bool {
        let stays = |a: &Aborted| a.from < from || (a.from == from && !a.provisional);
        if self.aborted.get(&comm).is_some_and(stays) {
            return false;
        }
        self.aborted.insert(
            comm,
            Aborted {
                err,
                from,
                provisional: false,
            },
        );
        self.told.retain(|(c, _)| *c != comm);
        // Wake every send of the group; a send the abort does not fail takes
        // a fresh signal, which a later, wider abort fires again.
        if let Some(old) = self.signals.remove(&comm) {
            old.cancel();
        }
        true
    }

    /// The group's abort, whatever it fails.
    pub fn get(&self, comm: u64) -> Option<&Error> {
        self.aborted.get(&comm).map(|a| &a.err)
    }

    /// The first collective the group's abort fails (0: all).
    pub fn from(&self, comm: u64) -> Option<u64> {
        self.aborted.get(&comm).map(|a| a.from)
    }

    /// The abort that fails collective `seq` (`None`: a point-to-point message).
    pub fn fails(&self, comm: u64, seq: Option<u64>) -> Option<Error> {
        let a = self.aborted.get(&comm)?;
        seq.is_none_or(|s| s >= a.from).then(|| a.err.clone())
    }

    pub fn provisional(&self, comm: u64) -> bool {
        self.aborted.get(&comm).is_some_and(|a| a.provisional)
    }

    /// Marks the group's abort, just made, provisional.
    pub fn mark_provisional(&mut self, comm: u64) {
        if let Some(a) = self.aborted.get_mut(&comm) {
            a.provisional = true;
        }
    }

    /// The signal the group's next abort fires.
    pub fn signal(&mut self, comm: u64) -> CancellationToken {
        self.signals.entry(comm).or_default().clone()
    }

    /// Notes that `peer` has group `comm`'s abort; false if it was known.
    pub fn note_told(&mut self, comm: u64, peer: usize) -> bool {
        self.told.insert((comm, peer))
    }

    pub fn unnote_told(&mut self, comm: u64, peer: usize) {
        self.told.remove(&(comm, peer));
    }

    pub fn was_told(&self, comm: u64, peer: usize) -> bool {
        self.told.contains(&(comm, peer))
    }

    pub fn groups(&self) -> Vec<u64> {
        self.aborted.keys().copied().collect()
    }

    /// Forgets group `comm` (dropped here).
    pub fn retire(&mut self, comm: u64) {
        self.aborted.remove(&comm);
        self.signals.remove(&comm);
        self.told.retain(|(c, _)| *c != comm);
    }

    #[cfg(test)]
    pub fn sizes(&self) -> [(&'static str, usize); 3] {
        [
            ("aborted", self.aborted.len()),
            ("abort_signals", self.signals.len()),
            ("told", self.told.len()),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(why: &str) -> Error {
        Error::Aborted {
            group: "g".into(),
            reason: why.into(),
            by: None,
        }
    }

    #[test]
    fn the_first_abort_wins_unless_a_later_one_fails_more() {
        let mut a = Aborts::default();
        let woken = a.signal(1);
        assert!(a.abort(1, err("at 7"), 7));
        assert!(woken.is_cancelled());
        assert!(a.fails(1, Some(6)).is_none() && a.fails(1, Some(7)).is_some());
        assert!(a.fails(1, None).is_some(), "every message fails");
        assert!(!a.abort(1, err("at 8"), 8));
        assert!(!a.abort(1, err("again at 7"), 7));
        assert!(a.note_told(1, 2) && !a.note_told(1, 2));
        assert!(a.abort(1, err("at 5"), 5));
        assert!(!a.was_told(1, 2), "a wider abort is told again");
        assert_eq!(a.from(1), Some(5));
    }

    #[test]
    fn a_provisional_abort_gives_way_to_any_from_its_op_or_before() {
        let mut a = Aborts::default();
        assert!(a.abort(1, err("diverged"), 4));
        a.mark_provisional(1);
        assert!(a.provisional(1));
        assert!(!a.abort(1, err("later"), 5));
        assert!(a.abort(1, err("first mismatch"), 4));
        assert!(!a.provisional(1));
        assert!(a.get(1).unwrap().to_string().contains("first mismatch"));
        a.retire(1);
        assert!(a.sizes().iter().all(|(_, n)| *n == 0));
    }
}
