//! Flow control: how far a peer may run ahead of the operations that take its
//! frames.
//!
//! A reader task reads every frame from its socket as it comes (it must: the
//! frame an operation waits for may sit behind frames of later operations,
//! and an abort behind both). A frame that arrives before the operation that
//! takes it is filed in the router. Without a bound, a rank that falls behind
//! (a broadcast root, or a sender of point-to-point messages, runs on) piles
//! its peers' data into its memory until it runs out.
//!
//! The bound is per peer, on the receiving side ([`Inbound`]): when the bytes
//! filed from a peer exceed the window, this rank sends it a flow frame with
//! `hold`; when they fall to half the window, one without. A held sender
//! ([`Outbound`]) writes a data frame only for an operation the receiver has
//! asked for with a want frame. A holding receiver asks for every collective
//! it begins and every receive it waits in, and, as it starts to hold, for
//! the collectives it is running and the receives already waiting. So a hold
//! only ever stops operations the receiver has not reached: the frames of one
//! it runs are bounded by its buffers, and must flow (ranks of a ring each
//! send before they receive, and would hold each other forever). A receiver
//! never files more than the window plus what was already on its way when
//! the hold arrived, plus the operations it runs or waits in.
//!
//! Both halves are synchronous and do no I/O; the transport sends the frames
//! they ask for. Flow frames carry an epoch (one counter per receiver), so two
//! sent by different tasks that arrive out of order are applied in order.

use std::collections::{HashMap, HashSet};

/// A flow frame to send to `peer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Signal {
    pub peer: usize,
    pub hold: bool,
    pub epoch: u64,
}

/// The receiving side: bytes filed per peer, and which peers are held.
pub(crate) struct Inbound {
    window: u64,
    filed: HashMap<usize, u64>,
    held: HashSet<usize>,
    epoch: u64,
}

impl Inbound {
    /// `window`: bytes filed from one peer before it is held (0: never).
    pub fn new(window: u64) -> Inbound {
        Inbound {
            window,
            filed: HashMap::new(),
            held: HashSet::new(),
            epoch: 0,
        }
    }

    /// `bytes` from `peer` were filed; a hold to send if they crossed the window.
    pub fn filed(&mut self, peer: usize, bytes: u64) -> Option<Signal> {
        let f = self.filed.entry(peer).or_default();
        *f += bytes;
        (self.window > 0 && *f > self.window && self.held.insert(peer))
            .then(|| self.signal(peer, true))
    }

    /// `bytes` filed from `peer` were taken (or dropped); a resume to send if
    /// they fell to half the window.
    pub fn taken(&mut self, peer: usize, bytes: u64) -> Option<Signal> {
        let f = self.filed.entry(peer).or_default();
        *f = f.saturating_sub(bytes);
        let low = *f <= self.window / 2;
        if *f == 0 {
            self.filed.remove(&peer);
        }
        (low && self.held.remove(&peer)).then(|| self.signal(peer, false))
    }

    /// Whether `peer` is held: a receive from it asks at once.
    pub fn holds(&self, peer: usize) -> bool {
        self.held.contains(&peer)
    }

    /// Bytes filed from every peer.
    pub fn total(&self) -> u64 {
        self.filed.values().sum()
    }

    fn signal(&mut self, peer: usize, hold: bool) -> Signal {
        self.epoch += 1;
        Signal {
            peer,
            hold,
            epoch: self.epoch,
        }
    }
}

/// An operation a held sender may send frames of: a collective (`p2p`
/// false, `tag` 0) or a point-to-point message of a (peer, tag) pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Release {
    pub comm: u64,
    pub p2p: bool,
    pub tag: u32,
    pub seq: u64,
}

#[derive(Default)]
struct Held {
    epoch: u64,
    hold: bool,
    released: HashSet<Release>,
}

/// The sending side: which peers hold this rank, and what they asked for.
#[derive(Default)]
pub(crate) struct Outbound {
    peers: HashMap<usize, Held>,
}

impl Outbound {
    /// Applies a flow frame from `peer`; false if it was older than one applied.
    pub fn signal(&mut self, peer: usize, epoch: u64, hold: bool) -> bool {
        let h = self.peers.entry(peer).or_default();
        if epoch <= h.epoch {
            return false;
        }
        h.epoch = epoch;
        h.hold = hold;
        // What was asked for under one hold is not carried into the next.
        h.released.clear();
        true
    }

    /// `peer` waits for frames of `r`.
    pub fn release(&mut self, peer: usize, r: Release) {
        if let Some(h) = self.peers.get_mut(&peer).filter(|h| h.hold) {
            h.released.insert(r);
        }
    }

    /// Whether a data frame of `r` may go to `peer` now.
    pub fn may_send(&self, peer: usize, r: &Release) -> bool {
        self.peers
            .get(&peer)
            .is_none_or(|h| !h.hold || h.released.contains(r))
    }

    /// Whether `peer` holds this rank.
    pub fn held_by(&self, peer: usize) -> bool {
        self.peers.get(&peer).is_some_and(|h| h.hold)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OP: Release = Release {
        comm: 1,
        p2p: false,
        tag: 0,
        seq: 4,
    };

    #[test]
    fn a_peer_is_held_past_the_window_and_resumed_at_half() {
        let mut i = Inbound::new(100);
        assert_eq!(i.filed(3, 60), None);
        assert_eq!(i.filed(3, 40), None, "at the window, not past it");
        let hold = i.filed(3, 1).expect("past the window");
        assert!(hold.hold && hold.peer == 3);
        assert!(i.holds(3) && !i.holds(4));
        assert_eq!(i.filed(3, 500), None, "held once");
        assert_eq!(i.taken(3, 500), None, "101 left: above half");
        let resume = i.taken(3, 51).expect("50 left: half");
        assert!(!resume.hold && resume.epoch > hold.epoch);
        assert_eq!(i.taken(3, 50), None);
        assert_eq!(i.total(), 0);
    }

    #[test]
    fn peers_are_counted_apart_and_a_zero_window_never_holds() {
        let mut i = Inbound::new(10);
        assert_eq!(i.filed(1, 8), None);
        assert_eq!(i.filed(2, 8), None);
        assert_eq!(i.total(), 16);
        let mut never = Inbound::new(0);
        assert_eq!(never.filed(1, u64::MAX / 2), None);
        assert!(!never.holds(1));
    }

    #[test]
    fn a_held_sender_sends_only_what_was_asked_for() {
        let mut o = Outbound::default();
        assert!(o.may_send(2, &OP), "not held");
        assert!(o.signal(2, 1, true));
        assert!(o.held_by(2) && !o.held_by(5));
        assert!(!o.may_send(2, &OP));
        assert!(o.may_send(5, &OP), "another peer");
        o.release(2, OP);
        assert!(o.may_send(2, &OP));
        let p2p = Release { p2p: true, ..OP };
        assert!(
            !o.may_send(2, &p2p),
            "a message is not the collective of the same number"
        );
        assert!(o.signal(2, 2, false));
        assert!(o.may_send(2, &p2p));
        assert!(o.signal(2, 3, true));
        assert!(!o.may_send(2, &OP), "a new hold forgets the old asks");
    }

    #[test]
    fn flow_frames_out_of_order_apply_in_order() {
        let mut o = Outbound::default();
        assert!(o.signal(2, 2, false));
        assert!(!o.signal(2, 1, true), "the hold was sent before the resume");
        assert!(o.may_send(2, &OP));
        // A release while not held is not kept for a later hold.
        o.release(2, OP);
        assert!(o.signal(2, 3, true));
        assert!(!o.may_send(2, &OP));
    }
}
