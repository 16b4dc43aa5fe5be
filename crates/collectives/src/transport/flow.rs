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
//! **Credit.** A sender counts the data bytes it has sent each peer that the
//! peer has not yet acknowledged ([`Outbound`]). The peer acknowledges bytes
//! as its operations take them (or as it drops them), in a flow frame once a
//! quarter of the window has gathered ([`Inbound`]). A data frame goes out
//! only while the count plus the frame stays within the window, or when the
//! peer has asked for the frame's operation with a want frame.
//!
//! **Asking.** A sender out of credit says so (a flow frame with `blocked`);
//! the peer then acknowledges what it has taken at once, and asks (want
//! frames) for every collective it is running and every receive it waits in,
//! and from then on for every collective it begins and every receive that
//! waits, until it next sends credit. So a sender waits only for operations
//! the peer has not reached: the frames of one it runs are bounded by its
//! buffers, and must flow (ranks of a ring each send before they receive, and
//! would otherwise wait for each other forever).
//!
//! The bound is the sender's count, so it holds whatever the scheduling: a
//! rank never has more than the window filed from one peer, plus the frames
//! of operations it runs or waits in.
//!
//! Both halves are synchronous and do no I/O; the transport sends the frames
//! they ask for, through one ordered queue per peer.

use std::collections::{HashMap, HashSet};

/// A flow frame to send to `peer`: `credit` bytes taken (receiver to
/// sender), or `blocked` (sender to receiver).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Signal {
    pub peer: usize,
    pub credit: u64,
    pub blocked: bool,
}

/// The receiving side: bytes filed and bytes taken but not yet acknowledged,
/// per peer, and which peers are out of credit.
pub(crate) struct Inbound {
    window: u64,
    filed: HashMap<usize, u64>,
    unacked: HashMap<usize, u64>,
    blocked: HashSet<usize>,
}

impl Inbound {
    /// `window`: the credit each peer has (0: no flow control).
    pub fn new(window: u64) -> Inbound {
        Inbound {
            window,
            filed: HashMap::new(),
            unacked: HashMap::new(),
            blocked: HashSet::new(),
        }
    }

    /// `bytes` from `peer` were filed.
    pub fn filed(&mut self, peer: usize, bytes: u64) {
        *self.filed.entry(peer).or_default() += bytes;
    }

    /// `bytes` filed from `peer` were taken (or dropped); the credit to send.
    pub fn taken(&mut self, peer: usize, bytes: u64) -> Option<Signal> {
        if let Some(f) = self.filed.get_mut(&peer) {
            *f = f.saturating_sub(bytes);
            if *f == 0 {
                self.filed.remove(&peer);
            }
        }
        self.consumed(peer, bytes)
    }

    /// `bytes` from `peer` were used (or dropped) as they arrived; the
    /// credit to send.
    pub fn consumed(&mut self, peer: usize, bytes: u64) -> Option<Signal> {
        if self.window == 0 {
            return None;
        }
        let u = self.unacked.entry(peer).or_default();
        *u += bytes;
        (*u >= self.window / 4 || self.blocked.contains(&peer)).then(|| self.credit(peer))?
    }

    /// `peer` is out of credit: what it has taken goes back at once, and its
    /// wanted operations are asked for until then.
    pub fn peer_blocked(&mut self, peer: usize) -> Option<Signal> {
        self.blocked.insert(peer);
        self.credit(peer)
    }

    /// Whether `peer` is out of credit (its operations are asked for).
    pub fn asks(&self, peer: usize) -> bool {
        self.blocked.contains(&peer)
    }

    /// Bytes filed from every peer.
    pub fn total(&self) -> u64 {
        self.filed.values().sum()
    }

    fn credit(&mut self, peer: usize) -> Option<Signal> {
        let credit = self.unacked.remove(&peer).filter(|&c| c > 0)?;
        // Sent credit lets the peer go on; if it runs out again it says so.
        self.blocked.remove(&peer);
        Some(Signal {
            peer,
            credit,
            blocked: false,
        })
    }
}

/// An operation a sender out of credit may send frames of: a collective
/// (`p2p` false, `tag` 0) or a point-to-point message of a (peer, tag) pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Release {
    pub comm: u64,
    pub p2p: bool,
    pub tag: u32,
    pub seq: u64,
}

impl Release {
    /// The operation of a frame of `comm` numbered `seq` with call `desc`
    /// (a message's tag is its call's root).
    pub fn of(comm: u64, seq: u64, desc: &crate::frame::Desc) -> Release {
        let p2p = desc.op == crate::frame::OpKind::Send;
        Release {
            comm,
            p2p,
            tag: if p2p { desc.root } else { 0 },
            seq,
        }
    }
}

#[derive(Default)]
struct Credit {
    unacked: u64,
    /// Operations the peer asked for.
    released: HashSet<Release>,
    /// A `blocked` flow frame went out since the last credit came.
    said: bool,
}

/// Whether a data frame may go now.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Go {
    Now,
    /// Wait for credit or a want; `say`: first send the peer a `blocked`.
    Wait {
        say: bool,
    },
}

/// The sending side: per peer, the bytes sent and not acknowledged, and
/// the operations the peer asked for.
pub(crate) struct Outbound {
    window: u64,
    peers: HashMap<usize, Credit>,
}

impl Outbound {
    pub fn new(window: u64) -> Outbound {
        Outbound {
            window,
            peers: HashMap::new(),
        }
    }

    /// Whether a frame of `len` bytes of `r` may go to `peer` now; if so it
    /// is counted as sent.
    pub fn send(&mut self, peer: usize, r: &Release, len: u64) -> Go {
        if self.window == 0 {
            return Go::Now;
        }
        let c = self.peers.entry(peer).or_default();
        // A frame larger than the window goes when nothing is outstanding.
        let fits = c.unacked == 0 || c.unacked + len <= self.window;
        if fits || c.released.contains(r) {
            c.unacked += len;
            return Go::Now;
        }
        let say = !std::mem::replace(&mut c.said, true);
        Go::Wait { say }
    }

    /// `peer` acknowledged `bytes`.
    pub fn credit(&mut self, peer: usize, bytes: u64) {
        let window = self.window;
        let c = self.peers.entry(peer).or_default();
        c.unacked = c.unacked.saturating_sub(bytes);
        c.said = false;
        // Asks are for a shortage; with half the window free there is none.
        if c.unacked <= window / 2 {
            c.released.clear();
        }
    }

    /// `peer` waits for frames of `r`.
    pub fn release(&mut self, peer: usize, r: Release) {
        self.peers.entry(peer).or_default().released.insert(r);
    }

    /// Whether this rank is out of credit with `peer` (it said so) and
    /// `peer` has not asked for `r`.
    pub fn waits_for(&self, peer: usize, r: &Release) -> bool {
        self.peers
            .get(&peer)
            .is_some_and(|c| c.said && !c.released.contains(r))
    }

    /// Collective `seq` of `comm` ended here: no frame of it is sent again,
    /// so asks for it are forgotten.
    pub fn ended(&mut self, comm: u64, seq: u64) {
        let r = Release {
            comm,
            p2p: false,
            tag: 0,
            seq,
        };
        for c in self.peers.values_mut() {
            c.released.remove(&r);
        }
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
    fn a_sender_stops_at_the_window_and_goes_on_with_credit() {
        let mut o = Outbound::new(100);
        assert_eq!(o.send(2, &OP, 60), Go::Now);
        assert_eq!(o.send(2, &OP, 40), Go::Now, "up to the window");
        assert_eq!(o.send(2, &OP, 1), Go::Wait { say: true });
        assert_eq!(o.send(2, &OP, 1), Go::Wait { say: false }, "said once");
        assert!(o.waits_for(2, &OP) && !o.waits_for(3, &OP));
        assert_eq!(o.send(3, &OP, 100), Go::Now, "peers have their own credit");
        o.credit(2, 30);
        assert_eq!(o.send(2, &OP, 30), Go::Now);
        assert_eq!(
            o.send(2, &OP, 1),
            Go::Wait { say: true },
            "said again after credit"
        );
    }

    #[test]
    fn an_asked_for_operation_goes_without_credit_until_half_is_free() {
        let mut o = Outbound::new(100);
        assert_eq!(o.send(2, &OP, 100), Go::Now);
        let other = Release { seq: 5, ..OP };
        o.release(2, OP);
        assert_eq!(o.send(2, &OP, 50), Go::Now, "asked for");
        assert_eq!(o.send(2, &other, 1), Go::Wait { say: true });
        let p2p = Release { p2p: true, ..OP };
        assert_eq!(
            o.send(2, &p2p, 1),
            Go::Wait { say: false },
            "a message is not the collective"
        );
        o.credit(2, 100);
        assert_eq!(
            o.send(2, &OP, 60),
            Go::Wait { say: true },
            "50 left; the ask was cleared at half free"
        );
        assert_eq!(o.send(2, &OP, 50), Go::Now);
    }

    #[test]
    fn a_frame_larger_than_the_window_goes_alone() {
        let mut o = Outbound::new(10);
        assert_eq!(o.send(1, &OP, 64), Go::Now);
        assert_eq!(o.send(1, &OP, 1), Go::Wait { say: true });
        o.credit(1, 64);
        assert_eq!(o.send(1, &OP, 1), Go::Now);
    }

    #[test]
    fn a_receiver_acknowledges_by_quarters_and_at_once_for_a_blocked_peer() {
        let mut i = Inbound::new(100);
        i.filed(3, 60);
        assert_eq!(i.total(), 60);
        assert_eq!(i.consumed(3, 10), None, "under a quarter");
        let c = i.taken(3, 20).expect("30 taken: a quarter");
        assert_eq!((c.peer, c.credit, c.blocked), (3, 30, false));
        assert_eq!(i.total(), 40);
        assert_eq!(i.peer_blocked(3), None, "nothing to acknowledge");
        assert!(i.asks(3));
        let c = i.taken(3, 1).expect("a blocked peer gets what there is");
        assert_eq!(c.credit, 1);
        assert!(!i.asks(3), "credit sent: it says again if it must");
    }

    #[test]
    fn no_window_no_flow_control() {
        let mut o = Outbound::new(0);
        assert_eq!(o.send(1, &OP, u64::MAX / 2), Go::Now);
        let mut i = Inbound::new(0);
        assert_eq!(i.consumed(1, 1 << 40), None);
    }
}
