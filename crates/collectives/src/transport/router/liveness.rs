//! Peers gone, and frames cut off: which receives fail because their
//! sender died (it is gone), or because a connection with a sender that
//! lives on broke part-way through a frame (that frame is lost) or where no
//! frame names what it lost (the peer's connection is broken).

use std::collections::HashMap;

use super::{Fail, Key};

/// A connection with a live peer that broke where no frame names what it
/// lost (see `Router::lose_peer`).
struct Broken {
    /// Per group, the first collective whose frames from the peer may be
    /// lost: the oldest running here when the connection broke, or else the
    /// next. Groups not known then are not affected.
    from: HashMap<u64, u64>,
    reason: String,
}

impl Broken {
    fn fails(&self, key: &Key) -> bool {
        key.p2p
            || self
                .from
                .get(&key.comm)
                .is_some_and(|&from| key.seq >= from)
    }
}

#[derive(Default)]
pub(super) struct Liveness {
    gone: HashMap<usize, String>,
    /// Frames cut off by a broken connection before any receive waited for
    /// them: the reason, for the receive to come.
    lost: HashMap<Key, String>,
    /// Peers whose connection broke between frames or in a header while
    /// they lived on.
    broken: HashMap<usize, Broken>,
}

impl Liveness {
    /// Why `peer` is gone, if it is.
    /// Every peer marked gone.
    pub fn gone_peers(&self) -> Vec<usize> {
        self.gone.keys().copied().collect()
    }

    pub fn gone(&self, peer: usize) -> Option<&String> {
        self.gone.get(&peer)
    }

    /// Marks `peer` gone; false if it was. Its frames cut off go with it:
    /// its being gone fails their receives.
    pub fn mark_gone(&mut self, peer: usize, reason: &str) -> bool {
        if self.gone.contains_key(&peer) {
            return false;
        }
        self.gone.insert(peer, reason.to_owned());
        self.lost.retain(|k, _| k.src as usize != peer);
        true
    }

    /// The frame at `key` was cut off, for the receive that starts later.
    pub fn lose(&mut self, key: Key, reason: &str) {
        self.lost.insert(key, reason.to_owned());
    }

    /// Whether `peer`'s connection is known broken (or the peer gone): a
    /// second break adds nothing.
    pub fn broke(&self, peer: usize) -> bool {
        self.gone.contains_key(&peer) || self.broken.contains_key(&peer)
    }

    /// `peer`'s connection broke while it lived on, where no frame was
    /// part-way: its frames of each group's collectives from `from` on (and
    /// every message) may be lost.
    pub fn break_peer(&mut self, peer: usize, from: HashMap<u64, u64>, reason: &str) {
        let reason = reason.to_owned();
        self.broken.insert(peer, Broken { from, reason });
    }

    /// Why the receive for `key` fails: its sender gone, its frame lost
    /// (the note is taken), or its connection broken. `None`: it may wait.
    pub fn fails(&mut self, key: &Key) -> Option<Fail> {
        let rank = key.src as usize;
        if let Some(reason) = self.gone.get(&rank) {
            let reason = reason.clone();
            return Some(Fail::Gone { rank, reason });
        }
        if let Some(reason) = self.lost.remove(key) {
            return Some(Fail::Lost { rank, reason });
        }
        self.broken_fails(key)
    }

    /// [`Liveness::fails`] for a broken connection alone.
    pub fn broken_fails(&self, key: &Key) -> Option<Fail> {
        let rank = key.src as usize;
        let b = self.broken.get(&rank).filter(|b| b.fails(key))?;
        Some(Fail::Lost {
            rank,
            reason: b.reason.clone(),
        })
    }

    /// Forgets the frames cut off that `which` picks (no receive for them is
    /// to come).
    pub fn forget_lost(&mut self, which: impl Fn(&Key) -> bool) {
        self.lost.retain(|k, _| !which(k));
    }

    /// Forgets group `comm` (dropped here).
    pub fn retire(&mut self, comm: u64) {
        self.forget_lost(|k| k.comm == comm);
        for b in self.broken.values_mut() {
            b.from.remove(&comm);
        }
    }

    #[cfg(test)]
    pub fn lost_and_broken(&self) -> (usize, usize) {
        (self.lost.len(), self.broken.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(src: u32, comm: u64, seq: u64, p2p: bool) -> Key {
        Key {
            comm,
            src,
            p2p,
            tag: 0,
            seq,
            step: 0,
        }
    }

    #[test]
    fn a_receive_fails_for_a_peer_gone_a_frame_lost_or_a_connection_broken() {
        let mut l = Liveness::default();
        assert!(l.fails(&key(1, 1, 0, false)).is_none());
        // Lost: once, for that key.
        l.lose(key(1, 1, 0, false), "reset");
        assert!(matches!(
            l.fails(&key(1, 1, 0, false)),
            Some(Fail::Lost { rank: 1, .. })
        ));
        assert!(l.fails(&key(1, 1, 0, false)).is_none());
        // Broken from op 3 of group 1: later ops and every message fail.
        l.break_peer(1, HashMap::from([(1, 3)]), "reset between frames");
        assert!(l.broke(1));
        assert!(l.fails(&key(1, 1, 2, false)).is_none());
        assert!(l.fails(&key(1, 1, 3, false)).is_some());
        assert!(
            l.fails(&key(1, 2, 0, false)).is_none(),
            "a group not known then"
        );
        assert!(l.fails(&key(1, 2, 0, true)).is_some());
        // Gone: everything, and what was lost goes.
        l.lose(key(2, 1, 0, false), "reset");
        assert!(l.mark_gone(2, "it died") && !l.mark_gone(2, "again"));
        assert!(matches!(
            l.fails(&key(2, 1, 9, false)),
            Some(Fail::Gone { rank: 2, .. })
        ));
        assert_eq!(l.lost_and_broken(), (0, 1));
    }
}
