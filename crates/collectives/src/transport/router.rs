//! Frame matching: which operation a frame is for, whether it matches that
//! operation, and what fails when a peer goes or a group aborts.
//!
//! The router is synchronous and does no I/O: the transport holds it under
//! one lock, so that a waiter can never miss the event that would fail it, and
//! acts on what it returns (tell a peer of an abort, raise a mismatch). The
//! handles a group's entry holds (its hearer, its links to internal groups,
//! its telling watch) are stored here but never called here: the transport
//! clones them out and calls them with the router's lock released.
//!
//! Frames are addressed by [`Key`]. A collective's frames are compared with
//! the local call of the same sequence number: while it runs, after it ended
//! (the last `calls::ENDED_KEPT` per group: a broadcast root that only sends ends
//! before its frames arrive), or, before it starts, with what the first peer
//! sent (compared when it starts). A [`Want`](crate::frame::Header::Want) from
//! a peer that waits for us is compared the same way. Calls compare with
//! their histories ([`Desc::hist`]): a frame of a call with another history
//! is never delivered, even if the calls look alike, and its clash is marked
//! [`Clash::diverged`], a consequence of an earlier mismatch, which the
//! transport holds back (see `Shared::raise`); a call that begins diverged
//! from the first peer's drops the frames filed for it.
//!
//! An abort fails the group's operations from sequence number `from` on (a
//! mismatch at op #7 leaves op #6, whose frames were all sent, to finish),
//! and every point-to-point message.
//!
//! The router also counts the bytes it files per peer ([`Inbound`]) and
//! queues the flow and want frames that flow control asks for
//! ([`Router::take_control`]), in the order decided, so that the transport
//! sends them in that order.
//!
//! The router is five named parts and what ties them:
//!
//! | part | what it holds |
//! |---|---|
//! | `mailbox.rs` | per frame key, the frame filed or the receive waiting (or landing) |
//! | `calls.rs` | the call book: local calls running and ended, the first peer's call of one not begun |
//! | `aborts.rs` | each group's abort, the signal that wakes its sends, who has been told |
//! | `liveness.rs` | peers gone, frames lost part-way, connections broken between frames |
//! | `groups.rs` | per group, one entry: members, hearer, links to internal and parent groups, telling watch, calls found diverged; or retired |
//!
//! The router itself keeps flow control's accounting and the control frames
//! it queues, and decides
//! across the parts (a frame for an aborted group is not filed; an abort
//! fails the receives waiting and drops the frames filed).

mod aborts;
mod calls;
mod groups;
mod liveness;
mod mailbox;

use std::collections::HashSet;

use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use super::flow::{Inbound, Signal};
use super::landing::Landing;
use super::Members;
use crate::element::{Buf, DType};
use crate::error::Error;
use crate::frame::{Algo, Desc, Header, OpKind, HIST_NONE};
use aborts::Aborts;
use calls::CallBook;
#[cfg(test)]
use calls::ENDED_KEPT;
pub(crate) use groups::Groups;
use liveness::Liveness;
use mailbox::{Held, Mailbox, Put};

/// A frame's address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Key {
    pub comm: u64,
    /// World rank of the sender.
    pub src: u32,
    /// Point-to-point messages have their own sequence numbers per (peer, tag).
    pub p2p: bool,
    pub tag: u32,
    pub seq: u64,
    pub step: u32,
}

impl Key {
    /// The collective sequence number an abort compares with (none for
    /// point-to-point, which every abort fails).
    fn collective_seq(&self) -> Option<u64> {
        (!self.p2p).then_some(self.seq)
    }
}

/// A received data frame.
pub(crate) struct Frame {
    pub desc: Desc,
    /// The payload; empty when it `landed`.
    pub buf: Buf,
    /// The payload was read straight into the waiter's posted buffer.
    pub landed: bool,
}

/// Why a transport operation failed, before the op adds its names.
pub(crate) enum Fail {
    /// The peer (world rank) is gone.
    Gone { rank: usize, reason: String },
    /// The group was aborted; the error to return.
    Aborted(Error),
    /// The peer refused the handshake or broke the protocol.
    Refused { rank: usize, reason: String },
    /// The job-secret handshake with the peer failed: it holds another
    /// secret, or none where this rank holds one (or the other way round).
    /// Final: the job is misconfigured, and trying again cannot help.
    Secret { rank: usize, reason: String },
    /// The peer accepted a connection but did not answer its handshake in
    /// time (stopped or hung): fails this operation, without marking the peer
    /// gone for the others (it may only be slow).
    Unanswered { rank: usize, reason: String },
    /// The connection with the peer (world rank) broke part-way through this
    /// frame (read or written) while the peer lived on: it is lost for good.
    Lost { rank: usize, reason: String },
    /// The deadline passed.
    Timeout,
}

/// Two calls of one collective that differ. `a`'s rank is `None` for this rank.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Clash {
    pub comm: u64,
    pub seq: u64,
    pub a: (Option<u32>, Desc),
    pub b: (u32, Desc),
    /// The two histories differ: the calls diverged before this op, and
    /// the first mismatch is elsewhere (see [`Desc::hist`]).
    pub diverged: bool,
}

impl Clash {
    pub fn new(comm: u64, seq: u64, a: (Option<u32>, Desc), b: (u32, Desc)) -> Clash {
        Clash {
            comm,
            seq,
            diverged: a.1.diverged_from(&b.1),
            a,
            b,
        }
    }
}

/// What became of a frame handed to the router.
#[derive(Debug, PartialEq)]
pub(crate) enum Delivery {
    /// Handed to its waiter or filed (or, for a want, nothing to do).
    Taken,
    /// For an operation the group's abort fails: dropped; tell the sender.
    TellAbort,
    /// It does not match the call it is for.
    Clash(Clash),
    /// A second frame for one key: the sender broke the protocol.
    Duplicate(String),
    /// Filed until its operation asks (within `Router`; returned as `Taken`).
    Filed,
}

/// How a receive starts.
pub(crate) enum Start {
    Ready(Frame),
    Failed(Fail),
    Wait(oneshot::Receiver<Result<Frame, Fail>>),
}

/// Frames, waiters, dead peers and aborted groups: the four parts, and
/// what ties them (flow control's accounting, the control frames queued),
/// and each group's entry.
pub(crate) struct Router {
    mail: Mailbox,
    calls: CallBook,
    aborts: Aborts,
    live: Liveness,
    /// Bytes filed per peer, and which peers are out of credit (asked for ops).
    flow: Inbound,
    /// Flow and want frames to send, per peer, in the order decided.
    control: Vec<(usize, Header)>,
    /// Each group's state, or that it was dropped here (see
    /// [`Router::retire`]: frames and wants for it are dropped; ids are
    /// never reused, so each stays, a few bytes a group against the tables
    /// it frees). A peer out of credit is asked for a group's running
    /// collectives if it is one of the members.
    groups: Groups,
}

impl Router {
    /// `window`: the bytes a peer may send that ops have not taken before it
    /// sends only frames asked for (0: no bound).
    pub fn new(window: u64) -> Router {
        Router {
            mail: Mailbox::default(),
            calls: CallBook::default(),
            aborts: Aborts::default(),
            live: Liveness::default(),
            flow: Inbound::new(window),
            control: Vec::new(),
            groups: Groups::default(),
        }
    }

    /// See `Shared::group_tables`.
    #[cfg(test)]
    pub fn group_tables(&self) -> Vec<(&'static str, usize)> {
        let mut t = vec![("slots", self.mail.len())];
        t.extend(self.calls.sizes());
        t.extend(self.aborts.sizes());
        t.extend(self.groups.sizes());
        t
    }

    /// Forgets group `comm`, dropped here (no op of it runs, or ever will):
    /// its filed frames (their senders' credit comes back), calls, abort,
    /// and its entry (members, hearer, links). A frame or want for it that
    /// arrives later is dropped.
    pub fn retire(&mut self, comm: u64) {
        self.groups.retire(comm);
        // Only filed frames: a waiting receive belongs to an op, which holds
        // its group.
        for (k, len) in self.mail.drop_filed(|k| k.comm == comm) {
            self.took(&k, len);
        }
        self.calls.retire(comm);
        self.aborts.retire(comm);
        self.live.retire(comm);
    }

    /// Registers group `comm`'s members (unless it was retired).
    pub fn set_members(&mut self, comm: u64, m: Members) {
        if let Some(g) = self.groups.entry(comm) {
            g.members = Some(m);
        }
    }

    /// Each group's entry.
    pub fn groups(&self) -> &Groups {
        &self.groups
    }

    pub fn groups_mut(&mut self) -> &mut Groups {
        &mut self.groups
    }

    /// Whether world rank `peer` is a member of group `comm`.
    fn member(&self, comm: u64, peer: usize) -> bool {
        self.groups
            .members(comm)
            .is_some_and(|m| m.ranks.contains(&peer))
    }

    /// The flow and want frames to send, oldest first.
    pub fn take_control(&mut self) -> Vec<(usize, Header)> {
        std::mem::take(&mut self.control)
    }

    /// Bytes filed, not yet taken by an operation, from every peer.
    pub fn filed_bytes(&self) -> u64 {
        self.flow.total()
    }

    /// Queues a credit to send, if any.
    fn credit(&mut self, s: Option<Signal>) {
        if let Some(s) = s {
            self.control.push((
                s.peer,
                Header::Flow {
                    credit: s.credit,
                    blocked: false,
                },
            ));
        }
    }

    /// `peer` is out of credit with this rank: it gets back what was taken,
    /// and every collective running here that it is in, and every receive
    /// waiting on it, asks for its frames (it may be waiting to send exactly
    /// those). From now until the next credit, so does every collective
    /// that begins and every receive that waits.
    pub fn peer_blocked(&mut self, peer: usize) {
        let c = self.flow.peer_blocked(peer);
        self.credit(c);
        for (comm, seq, desc) in self.calls.running() {
            if self.member(comm, peer) {
                self.control.push((
                    peer,
                    Header::Want {
                        comm,
                        seq,
                        step: 0,
                        desc,
                    },
                ));
            }
        }
        let mut waiting = self.mail.waiting_from(peer);
        // One ask per op or message releases all its frames (an op that
        // posted its receives waits on many keys at once).
        waiting.dedup_by_key(|k| (k.comm, k.p2p, k.tag, k.seq));
        for k in waiting {
            self.ask(k);
        }
    }

    /// Queues a want frame for `key`, which waits on a peer out of credit.
    fn ask(&mut self, key: Key) {
        let desc = if key.p2p {
            Some(p2p_want(key.tag))
        } else {
            self.calls.running_call(key.comm, key.seq)
        };
        if let Some(desc) = desc {
            self.control.push((
                key.src as usize,
                Header::Want {
                    comm: key.comm,
                    seq: key.seq,
                    step: key.step,
                    desc,
                },
            ));
        }
    }

    /// A filed frame was taken (or dropped).
    fn took(&mut self, key: &Key, bytes: usize) {
        let s = self.flow.taken(key.src as usize, bytes as u64);
        self.credit(s);
    }

    /// A frame was used (or dropped) as it arrived.
    fn consumed(&mut self, key: &Key, bytes: usize) {
        let s = self.flow.consumed(key.src as usize, bytes as u64);
        self.credit(s);
    }

    /// The group's abort, whatever it fails.
    pub fn aborted(&self, comm: u64) -> Option<&Error> {
        self.aborts.get(comm)
    }

    /// The first collective the group's abort fails (0: all).
    pub fn aborted_from(&self, comm: u64) -> Option<u64> {
        self.aborts.from(comm)
    }

    /// Whether the group's abort is provisional (see [`Router::abort`]).
    pub fn aborted_provisional(&self, comm: u64) -> bool {
        self.aborts.provisional(comm)
    }

    /// Marks the group's abort, just made, provisional: calls found diverged
    /// that a rank gave up waiting on; the members told hold it for the
    /// first mismatch. A later abort (one that fails more) is not.
    pub fn mark_provisional(&mut self, comm: u64) {
        self.aborts.mark_provisional(comm);
    }

    /// The abort that fails collective `seq` (`None`: a point-to-point message).
    pub fn aborted_for(&self, comm: u64, seq: Option<u64>) -> Option<Error> {
        self.aborts.fails(comm, seq)
    }

    pub fn abort_signal(&mut self, comm: u64) -> CancellationToken {
        if self.groups.is_retired(comm) {
            return CancellationToken::new();
        }
        self.aborts.signal(comm)
    }

    /// Notes that `peer` has group `comm`'s abort; false if it was known.
    pub fn note_told(&mut self, comm: u64, peer: usize) -> bool {
        !self.groups.is_retired(comm) && self.aborts.note_told(comm, peer)
    }

    /// Forgets that `peer` has the abort (telling it failed or was skipped),
    /// so that its next contact tells it.
    pub fn unnote_told(&mut self, comm: u64, peer: usize) {
        self.aborts.unnote_told(comm, peer);
    }

    pub fn was_told(&self, comm: u64, peer: usize) -> bool {
        self.aborts.was_told(comm, peer)
    }

    /// Groups aborted here.
    pub fn aborted_groups(&self) -> Vec<u64> {
        self.aborts.groups()
    }

    pub fn gone_peers(&self) -> Vec<usize> {
        self.live.gone_peers()
    }

    pub fn gone(&self, peer: usize) -> Option<&String> {
        self.live.gone(peer)
    }

    /// Records the local call of collective `seq`; a mismatch with what a peer
    /// already sent is returned.
    pub fn begin_seq(&mut self, comm: u64, seq: u64, desc: Desc) -> Result<(), Clash> {
        // Peers out of credit send this op's frames (see `peer_blocked`).
        let mut blocked: Vec<usize> = self
            .groups
            .members(comm)
            .map(|m| {
                m.ranks
                    .iter()
                    .copied()
                    .filter(|&p| self.flow.asks(p))
                    .collect()
            })
            .unwrap_or_default();
        blocked.sort_unstable();
        for p in blocked {
            self.control.push((
                p,
                Header::Want {
                    comm,
                    seq,
                    step: 0,
                    desc,
                },
            ));
        }
        let r = self.calls.begin(comm, seq, desc);
        if let Err(clash) = &r {
            if clash.diverged {
                // The op runs on until an abort fails it (see
                // `Shared::raise`): the frames filed for it agree with the
                // first peer's call, not with this one, so none is for it.
                for (k, len) in self
                    .mail
                    .drop_filed(|k| k.comm == comm && k.collective_seq() == Some(seq))
                {
                    self.took(&k, len);
                }
            }
        }
        r
    }

    /// The local call of collective `seq`: running, or ended and kept.
    pub fn call(&self, comm: u64, seq: u64) -> Option<Desc> {
        self.calls.call(comm, seq)
    }

    pub fn end_seq(&mut self, comm: u64, seq: u64) {
        self.calls.end(comm, seq);
    }

    /// Starts waiting for the frame at `key`; with a `landing`, its payload
    /// may be read straight into it (see [`Router::land`]).
    pub fn start_recv(&mut self, key: Key, landing: Option<Landing>) -> Start {
        if let Some(e) = self.aborted_for(key.comm, key.collective_seq()) {
            return Start::Failed(Fail::Aborted(e));
        }
        if let Some(f) = self.mail.take(&key) {
            self.took(&key, f.buf.len());
            return Start::Ready(f);
        }
        if let Some(f) = self.live.fails(&key) {
            return Start::Failed(f);
        }
        // A posted receive needs no ask of its own: its op asked for all its
        // frames as it began (`begin_seq`), and posts many receives at once.
        if self.flow.asks(key.src as usize) && landing.is_none() {
            self.ask(key);
        }
        Start::Wait(self.mail.wait(key, landing))
    }

    /// Fails the receive waiting for `key`, if one is.
    pub fn fail_recv(&mut self, key: Key, f: Fail) {
        self.mail.fail(&key, f);
    }

    /// The frame at `key` was cut off part-way by its connection breaking
    /// while its sender lived on (`reason`, what the read said): nothing
    /// will send it again. Fails the receive that waits for it (into a
    /// receive buffer or its landing), or the one that starts later.
    pub fn lose(&mut self, key: Key, reason: &str) {
        let rank = key.src as usize;
        // Gone: its waiters failed naming that, and later receives will.
        // Aborted, or a collective ended or forgotten here: no receive
        // for the key is to come.
        if self.live.gone(rank).is_some()
            || self.groups.is_retired(key.comm)
            || self.aborted_for(key.comm, key.collective_seq()).is_some()
            || (!key.p2p
                && (self.calls.ended(key.comm, key.seq) || self.calls.forgotten(key.comm, key.seq)))
        {
            return;
        }
        match self.mail.held(&key) {
            Held::Waiting => self.mail.fail(
                &key,
                Fail::Lost {
                    rank,
                    reason: reason.to_owned(),
                },
            ),
            // A whole frame for the key is filed already: not this one.
            Held::Filed => {}
            Held::Nothing => self.live.lose(key, reason),
        }
    }

    /// A connection with `peer` broke while it lived on, where no frame was
    /// part-way (`reason`, what the read said): between frames, or inside a
    /// header. Whatever the peer had written to it and we had not read is
    /// lost, and which frames those were is not known: the frames of any
    /// collective that has not ended here (the oldest running, or else the
    /// next, and every later one), and every message. So every receive from
    /// the peer for those fails, waiting now or started later, rather than
    /// wait for its op's timeout; frames already filed are whole and are
    /// taken as usual. Its op fails, and with it the group, as a reset
    /// connection fails a gloo context.
    pub fn lose_peer(&mut self, peer: usize, reason: &str) {
        if self.live.broke(peer) {
            return;
        }
        let registered = self.groups.live().filter(|(_, g)| g.members.is_some());
        let comms: HashSet<u64> = (registered.map(|(c, _)| c))
            .chain(self.calls.groups())
            .chain(self.mail.groups())
            .collect();
        let from = comms
            .into_iter()
            .map(|comm| (comm, self.calls.first_open(comm)))
            .collect();
        self.live.break_peer(peer, from, reason);
        let live = &self.live;
        self.mail.fail_waiting(
            |k| k.src as usize == peer && live.broken_fails(k).is_some(),
            || Fail::Lost {
                rank: peer,
                reason: reason.to_owned(),
            },
        );
    }

    /// Stops waiting for `key` (the deadline passed, or the op ended).
    pub fn cancel_recv(&mut self, key: Key) {
        self.mail.cancel(&key);
    }

    /// Hands a data frame from `src` to its waiter or files it.
    pub fn deliver(&mut self, key: Key, desc: Desc, buf: Buf) -> Delivery {
        let len = buf.len();
        let d = self.file(key, desc, buf);
        // Every frame but one filed is used or dropped now: its sender's
        // credit comes back (a filed one's when it is taken).
        if !matches!(d, Delivery::Filed) {
            self.consumed(&key, len);
        }
        match d {
            Delivery::Filed => Delivery::Taken,
            d => d,
        }
    }

    fn file(&mut self, key: Key, desc: Desc, buf: Buf) -> Delivery {
        if self.groups.is_retired(key.comm) {
            return Delivery::Taken;
        }
        if self.aborted_for(key.comm, key.collective_seq()).is_some() {
            return Delivery::TellAbort;
        }
        if !key.p2p {
            if self.calls.forgotten(key.comm, key.seq) {
                return Delivery::Taken;
            }
            if self.calls.ended(key.comm, key.seq) {
                // Late for an op that ended here: compare, then drop it
                // (nobody will ever wait for it).
                return match self.calls.compare(key.comm, key.seq, key.src, desc) {
                    Some(c) => Delivery::Clash(c),
                    None => Delivery::Taken,
                };
            }
            if let Some(c) = self.calls.compare(key.comm, key.seq, key.src, desc) {
                return Delivery::Clash(c);
            }
        }
        let len = buf.len() as u64;
        let frame = Frame {
            desc,
            buf,
            landed: false,
        };
        match self.mail.put(key, frame) {
            Put::Handed => Delivery::Taken,
            Put::Duplicate => Delivery::Duplicate(format!("sent a second frame for {key:?}")),
            Put::Filed => {
                self.flow.filed(key.src as usize, len);
                Delivery::Filed
            }
        }
    }

    /// A data frame's header, of a `len`-byte payload: the landing its
    /// waiter posted, if the frame may go straight into it (the same checks
    /// as [`Router::deliver`] pass, and the sizes agree). The slot then
    /// waits for [`Router::landed`]; any other frame for the key is a
    /// duplicate. `None`: read the payload and deliver it as usual (which
    /// raises what the checks found).
    pub fn land(&mut self, key: Key, desc: Desc, len: usize) -> Option<Landing> {
        if !self.mail.posted(&key, len)
            || key.p2p
            || self.groups.is_retired(key.comm)
            || self.aborted_for(key.comm, key.collective_seq()).is_some()
            || self.calls.forgotten(key.comm, key.seq)
            || self.calls.ended(key.comm, key.seq)
            || self
                .calls
                .compare(key.comm, key.seq, key.src, desc)
                .is_some()
        {
            return None;
        }
        self.mail.start_landing(key)
    }

    /// The payload of the frame [`Router::land`] took a landing for is in
    /// it (or, the landing revoked, was read and dropped): the waiter, if it
    /// still waits, gets the frame.
    pub fn landed(&mut self, key: Key, desc: Desc, len: usize) {
        self.consumed(&key, len);
        let frame = Frame {
            desc,
            buf: Buf::new(0),
            landed: true,
        };
        self.mail.landed(&key, frame);
    }

    /// A peer waits for our part of collective `seq`, which it called as `desc`.
    pub fn want(&mut self, comm: u64, seq: u64, src: u32, desc: Desc) -> Delivery {
        if self.groups.is_retired(comm) {
            return Delivery::Taken;
        }
        if self.aborted_for(comm, Some(seq)).is_some() {
            return Delivery::TellAbort;
        }
        if self.calls.forgotten(comm, seq) {
            return Delivery::Taken;
        }
        match self.calls.compare(comm, seq, src, desc) {
            Some(c) => Delivery::Clash(c),
            None => Delivery::Taken,
        }
    }

    /// Marks `peer` gone and fails everything waiting on it; false if it was.
    pub fn mark_gone(&mut self, peer: usize, reason: &str) -> bool {
        if !self.live.mark_gone(peer, reason) {
            return false;
        }
        self.mail.fail_waiting(
            |k| k.src as usize == peer,
            || Fail::Gone {
                rank: peer,
                reason: reason.to_owned(),
            },
        );
        true
    }

    /// Aborts group `comm` from collective `from` on. The first abort wins,
    /// except that one failing earlier collectives replaces it (a mismatch
    /// found at op #6 after one at op #7), and any replaces a provisional
    /// one from the same op. Returns whether anything changed;
    /// then whoever had the abort must be told again.
    pub fn abort(&mut self, comm: u64, err: Error, from: u64) -> bool {
        if self.groups.is_retired(comm) || !self.aborts.abort(comm, err.clone(), from) {
            return false;
        }
        let fails = |k: &Key| k.comm == comm && k.collective_seq().is_none_or(|s| s >= from);
        self.mail.fail_waiting(fails, || Fail::Aborted(err.clone()));
        for (k, len) in self.mail.drop_filed(fails) {
            self.took(&k, len);
        }
        self.live.forget_lost(fails);
        self.calls.forget_from(comm, from);
        true
    }
}

/// The call a want for a point-to-point message carries: only its kind and
/// tag are read (a want for a message is compared with nothing).
fn p2p_want(tag: u32) -> Desc {
    Desc {
        op: OpKind::Send,
        dtype: DType::U8,
        reduce: None,
        algo: Algo::Direct,
        root: tag,
        count: 0,
        hist: HIST_NONE,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::element::{DType, Pool, ReduceOp};
    use crate::frame::{Algo, OpKind};

    fn desc(count: u64) -> Desc {
        Desc {
            op: OpKind::AllReduce,
            dtype: DType::F32,
            reduce: Some(ReduceOp::Sum),
            algo: Algo::Ring,
            root: 0,
            count,
            hist: HIST_NONE,
        }
    }

    fn key(src: u32, seq: u64) -> Key {
        Key {
            comm: 1,
            src,
            p2p: false,
            tag: 0,
            seq,
            step: 0,
        }
    }

    fn buf() -> Buf {
        Pool::new(64, 0).get(0)
    }

    fn aborted(why: &str) -> Error {
        Error::Aborted {
            group: "g".into(),
            reason: why.into(),
            by: None,
        }
    }

    fn waiting(r: &mut Router, k: Key) -> oneshot::Receiver<Result<Frame, Fail>> {
        match r.start_recv(k, None) {
            Start::Wait(rx) => rx,
            _ => panic!("expected to wait"),
        }
    }

    /// A group dropped here: what it filed is given back, and what comes
    /// later for it leaves nothing.
    #[test]
    fn a_retired_group_gives_back_its_filed_bytes_and_drops_later_frames() {
        let mut r = Router::new(1 << 20);
        r.set_members(1, vec![0, 1].into());
        let b = || Pool::new(64, 0).get(16);
        // Filed ahead of an op this rank never runs, then the group is dropped.
        assert_eq!(r.deliver(key(1, 0), desc(4), b()), Delivery::Taken);
        assert_eq!(r.filed_bytes(), 16);
        r.begin_seq(1, 1, desc(4)).unwrap();
        r.retire(1);
        assert_eq!(r.filed_bytes(), 0, "the sender's credit comes back");
        assert!(
            r.group_tables().iter().all(|(_, n)| *n == 0),
            "{:?}",
            r.group_tables()
        );
        // Late frames, wants and aborts for it leave nothing either.
        assert_eq!(r.deliver(key(1, 2), desc(4), b()), Delivery::Taken);
        assert_eq!(r.want(1, 3, 1, desc(4)), Delivery::Taken);
        assert!(!r.abort(1, aborted("late"), 0));
        let _ = r.abort_signal(1);
        assert!(!r.note_told(1, 1));
        assert_eq!(r.filed_bytes(), 0);
        assert!(
            r.group_tables().iter().all(|(_, n)| *n == 0),
            "{:?}",
            r.group_tables()
        );
    }

    /// An internal group's op numbers have gaps (two per group op, one of
    /// them unused by a broadcast, both by a flat op): ended calls are
    /// still kept for the last `ENDED_KEPT` numbers only, not forever.
    #[test]
    fn ended_calls_are_pruned_across_gaps_in_op_numbers() {
        let mut r = Router::new(0);
        for seq in (0..20 * ENDED_KEPT).step_by(3) {
            r.begin_seq(1, seq, desc(4)).unwrap();
            r.end_seq(1, seq);
        }
        let kept = r.calls.sizes()[1].1 as u64;
        assert!(kept <= ENDED_KEPT / 3 + 1, "{kept} ended calls kept");
        let last = 20 * ENDED_KEPT - 1 - (20 * ENDED_KEPT - 1) % 3;
        assert_eq!(r.call(1, last), Some(desc(4)), "the recent ones are kept");
    }

    #[test]
    fn a_frame_meets_its_waiter_in_either_order() {
        let mut r = Router::new(0);
        r.begin_seq(1, 0, desc(4)).unwrap();
        assert_eq!(r.deliver(key(2, 0), desc(4), buf()), Delivery::Taken);
        assert!(matches!(r.start_recv(key(2, 0), None), Start::Ready(_)));
        let mut rx = waiting(&mut r, key(3, 0));
        assert_eq!(r.deliver(key(3, 0), desc(4), buf()), Delivery::Taken);
        assert!(matches!(rx.try_recv(), Ok(Ok(_))));
        assert!(matches!(
            r.deliver(key(2, 0), desc(4), buf()),
            Delivery::Taken
        ));
        assert!(matches!(
            r.deliver(key(2, 0), desc(4), buf()),
            Delivery::Duplicate(_)
        ));
    }

    /// A receive posted with a landing of `len` bytes (into `mem`).
    fn posted(r: &mut Router, k: Key, mem: &mut [u8]) -> oneshot::Receiver<Result<Frame, Fail>> {
        let gate = std::sync::Arc::new(super::super::landing::Gate::default());
        // SAFETY: the buffer outlives the landing: the test ends it (or
        // revokes it) before the buffer is dropped.
        let l = unsafe { Landing::new(mem.as_mut_ptr(), mem.len(), gate) };
        match r.start_recv(k, Some(l)) {
            Start::Wait(rx) => rx,
            _ => panic!("expected to wait"),
        }
    }

    /// A frame for a posted receive lands once: the waiter gets it as
    /// landed, a second frame for the key is a duplicate, and its bytes are
    /// never counted as filed (the sender's credit comes back at once).
    #[test]
    fn a_posted_receive_lands_once() {
        let mut r = Router::new(1 << 20);
        r.begin_seq(1, 0, desc(4)).unwrap();
        let mut mem = [0u8; 16];
        let mut rx = posted(&mut r, key(2, 0), &mut mem);
        assert!(r.land(key(2, 0), desc(4), 16).is_some());
        assert!(r.land(key(2, 0), desc(4), 16).is_none(), "landed twice");
        assert!(matches!(
            r.deliver(key(2, 0), desc(4), buf()),
            Delivery::Duplicate(_)
        ));
        assert!(rx.try_recv().is_err(), "woken before the payload was in");
        r.landed(key(2, 0), desc(4), 16);
        assert!(matches!(rx.try_recv(), Ok(Ok(f)) if f.landed));
        assert_eq!(r.filed_bytes(), 0);
    }

    /// A frame that does not fit its posted receive (another size, or
    /// another call) is not landed: it is delivered as usual, so the size
    /// check or the mismatch names it.
    #[test]
    fn a_frame_unlike_its_posted_receive_is_delivered_as_usual() {
        let mut r = Router::new(0);
        r.begin_seq(1, 0, desc(4)).unwrap();
        let mut mem = [0u8; 16];
        let mut rx = posted(&mut r, key(2, 0), &mut mem);
        assert!(r.land(key(2, 0), desc(4), 12).is_none(), "other size");
        assert_eq!(r.deliver(key(2, 0), desc(4), buf()), Delivery::Taken);
        assert!(matches!(rx.try_recv(), Ok(Ok(f)) if !f.landed));
        let mut rx = posted(&mut r, key(3, 0), &mut mem);
        assert!(r.land(key(3, 0), desc(5), 16).is_none(), "other call");
        assert!(matches!(
            r.deliver(key(3, 0), desc(5), buf()),
            Delivery::Clash(_)
        ));
        assert!(rx.try_recv().is_err());
    }

    /// An abort, or the peer gone, while a payload is landing fails the
    /// waiter at once; the landing's end then finds nobody to wake.
    #[test]
    fn a_landing_receive_fails_on_abort_or_gone() {
        let mut r = Router::new(0);
        r.begin_seq(1, 0, desc(4)).unwrap();
        let mut mem = [0u8; 16];
        let mut rx = posted(&mut r, key(2, 0), &mut mem);
        assert!(r.land(key(2, 0), desc(4), 16).is_some());
        r.abort(1, aborted("x"), 0);
        assert!(matches!(rx.try_recv(), Ok(Err(Fail::Aborted(_)))));
        r.landed(key(2, 0), desc(4), 16);
        let mut r = Router::new(0);
        r.begin_seq(1, 0, desc(4)).unwrap();
        let mut rx = posted(&mut r, key(2, 0), &mut mem);
        assert!(r.land(key(2, 0), desc(4), 16).is_some());
        r.mark_gone(2, "it died");
        assert!(matches!(rx.try_recv(), Ok(Err(Fail::Gone { rank: 2, .. }))));
        r.landed(key(2, 0), desc(4), 16);
        // Stopped (its op ended) while landing: nothing is left behind.
        let mut rx = posted(&mut r, key(3, 0), &mut mem);
        assert!(r.land(key(3, 0), desc(4), 16).is_some());
        r.cancel_recv(key(3, 0));
        r.landed(key(3, 0), desc(4), 16);
        assert!(rx.try_recv().is_err());
        assert!(r.mail.is_empty());
    }

    /// A frame cut off by its connection fails the receive for it: one
    /// waiting (into a receive buffer or landing), or one that starts
    /// later; not a whole frame filed for the key, and not once the group
    /// is aborted (the abort is the cause then, and forgets the loss).
    #[test]
    fn a_frame_cut_off_fails_its_receive_now_or_later() {
        let lost = |f: Result<Frame, Fail>| matches!(f, Err(Fail::Lost { rank: 2, .. }));
        let mut r = Router::new(0);
        for seq in 0..5 {
            r.begin_seq(1, seq, desc(4)).unwrap();
        }
        let mut rx = waiting(&mut r, key(2, 0));
        r.lose(key(2, 0), "early eof");
        assert!(lost(rx.try_recv().unwrap()));
        let mut mem = [0u8; 16];
        let mut rx = posted(&mut r, key(2, 1), &mut mem);
        assert!(r.land(key(2, 1), desc(4), 16).is_some());
        r.lose(key(2, 1), "reset");
        assert!(lost(rx.try_recv().unwrap()));
        r.lose(key(2, 2), "reset");
        match r.start_recv(key(2, 2), None) {
            Start::Failed(f) => assert!(lost(Err(f))),
            _ => panic!("a receive for a frame cut off began"),
        }
        assert_eq!(r.live.lost_and_broken().0, 0);
        // A whole frame filed for the key is not the one cut off.
        assert_eq!(r.deliver(key(2, 3), desc(4), buf()), Delivery::Taken);
        r.lose(key(2, 3), "reset");
        assert!(matches!(r.start_recv(key(2, 3), None), Start::Ready(_)));
        // Aborted: the abort's error, not the loss.
        r.lose(key(2, 4), "reset");
        r.abort(1, aborted("x"), 0);
        assert_eq!(r.live.lost_and_broken().0, 0);
        assert!(matches!(
            r.start_recv(key(2, 4), None),
            Start::Failed(Fail::Aborted(_))
        ));
    }

    #[test]
    fn frames_are_compared_before_during_and_after_the_call() {
        // Before: the first peer's call is kept and compared at the start.
        let mut r = Router::new(0);
        assert_eq!(r.deliver(key(2, 0), desc(5), buf()), Delivery::Taken);
        assert_eq!(
            r.begin_seq(1, 0, desc(4)),
            Err(Clash::new(1, 0, (None, desc(4)), (2, desc(5))))
        );
        // Before, two peers that differ from each other.
        let mut r = Router::new(0);
        r.deliver(key(2, 0), desc(5), buf());
        assert_eq!(
            r.deliver(key(3, 0), desc(6), buf()),
            Delivery::Clash(Clash {
                comm: 1,
                seq: 0,
                a: (Some(2), desc(5)),
                b: (3, desc(6)),
                diverged: false,
            })
        );
        // During.
        let mut r = Router::new(0);
        r.begin_seq(1, 0, desc(4)).unwrap();
        assert!(matches!(
            r.deliver(key(2, 0), desc(5), buf()),
            Delivery::Clash(Clash { a: (None, _), .. })
        ));
        // After the call ended here (a root that only sends).
        let mut r = Router::new(0);
        r.begin_seq(1, 0, desc(4)).unwrap();
        r.end_seq(1, 0);
        assert!(matches!(
            r.deliver(key(2, 0), desc(5), buf()),
            Delivery::Clash(_)
        ));
        assert_eq!(r.deliver(key(3, 0), desc(4), buf()), Delivery::Taken);
        // A want is compared the same way.
        assert!(matches!(r.want(1, 0, 2, desc(9)), Delivery::Clash(_)));
        assert_eq!(r.want(1, 0, 2, desc(4)), Delivery::Taken);
        let mut r = Router::new(0);
        assert_eq!(r.want(1, 3, 2, desc(9)), Delivery::Taken);
        assert_eq!(
            r.begin_seq(1, 3, desc(4)),
            Err(Clash::new(1, 3, (None, desc(4)), (2, desc(9))))
        );
    }

    #[test]
    fn a_clash_of_calls_with_different_histories_is_marked_diverged() {
        let with = |count, hist| Desc {
            hist,
            ..desc(count)
        };
        let clash = |r: &mut Router, src, d| match r.deliver(key(src, 0), d, buf()) {
            Delivery::Clash(c) => Some(c.diverged),
            _ => None,
        };
        // The same call after different calls: a clash, and a consequence.
        let mut r = Router::new(0);
        r.begin_seq(1, 0, with(4, 7)).unwrap();
        assert_eq!(clash(&mut r, 2, with(4, 8)), Some(true));
        // Another call after the same calls: the first mismatch.
        assert_eq!(clash(&mut r, 3, with(5, 7)), Some(false));
        // An untracked history agrees with any.
        assert_eq!(clash(&mut r, 4, with(4, HIST_NONE)), None);
        let mut r = Router::new(0);
        r.begin_seq(1, 0, with(4, HIST_NONE)).unwrap();
        assert_eq!(clash(&mut r, 2, with(4, 8)), None);
        // Before the call, between two peers; and when it begins.
        let mut r = Router::new(0);
        r.deliver(key(2, 0), with(4, 7), buf());
        assert_eq!(clash(&mut r, 3, with(4, 9)), Some(true));
        let e = r.begin_seq(1, 0, with(4, 5)).unwrap_err();
        assert!(e.diverged && e.b == (2, with(4, 7)));
        // Their frames are not for this call: dropped, and their credit
        // goes back.
        assert!(r.mail.is_empty());
        assert_eq!(r.filed_bytes(), 0);
    }

    #[test]
    fn a_provisional_abort_gives_way_to_any_from_its_op_or_before() {
        let mut r = Router::new(0);
        assert!(r.abort(1, aborted("diverged, provisional"), 3));
        r.mark_provisional(1);
        assert!(!r.abort(1, aborted("a later op"), 4));
        assert!(r.aborted_provisional(1));
        assert!(r.abort(1, aborted("the same op, final"), 3));
        assert!(!r.aborted_provisional(1));
        assert!(!r.abort(1, aborted("the same op again"), 3));
        assert_eq!(r.aborted_from(1), Some(3));
    }

    #[test]
    fn an_abort_from_a_later_op_lets_earlier_ones_finish() {
        let mut r = Router::new(0);
        let mut six = waiting(&mut r, key(2, 6));
        let mut seven = waiting(&mut r, key(2, 7));
        let mut p2p = waiting(
            &mut r,
            Key {
                p2p: true,
                ..key(2, 0)
            },
        );
        r.deliver(key(3, 6), desc(4), buf());
        assert!(r.abort(1, aborted("mismatch at 7"), 7));
        assert!(matches!(seven.try_recv(), Ok(Err(Fail::Aborted(_)))));
        assert!(matches!(p2p.try_recv(), Ok(Err(Fail::Aborted(_)))));
        assert!(six.try_recv().is_err(), "op 6 still waits");
        assert_eq!(r.deliver(key(2, 6), desc(4), buf()), Delivery::Taken);
        assert!(matches!(six.try_recv(), Ok(Ok(_))));
        assert!(matches!(r.start_recv(key(3, 6), None), Start::Ready(_)));
        assert_eq!(r.deliver(key(2, 7), desc(4), buf()), Delivery::TellAbort);
        assert!(r.aborted_for(1, Some(6)).is_none());
        assert!(r.aborted_for(1, Some(7)).is_some());
        assert!(r.aborted_for(1, None).is_some());
        // A later abort changes nothing; an earlier one replaces it.
        assert!(!r.abort(1, aborted("later"), 9));
        let mut six = waiting(&mut r, key(4, 6));
        assert!(r.abort(1, aborted("mismatch at 5"), 5));
        assert!(matches!(six.try_recv(), Ok(Err(Fail::Aborted(_)))));
        assert!(r.aborted(1).unwrap().to_string().contains("at 5"));
    }

    #[test]
    fn a_frame_for_a_long_forgotten_op_is_dropped_unfiled() {
        let mut r = Router::new(0);
        for seq in 0..=ENDED_KEPT + 1 {
            r.begin_seq(1, seq, desc(4)).unwrap();
            r.end_seq(1, seq);
        }
        // Op 0's call is forgotten: its frame and a want for it leave nothing.
        assert_eq!(r.deliver(key(2, 0), desc(4), buf()), Delivery::Taken);
        assert_eq!(r.want(1, 0, 2, desc(9)), Delivery::Taken);
        assert!(r.mail.is_empty() && r.calls.sizes()[0].1 == 0);
        // Recent ones are still compared.
        assert!(matches!(
            r.deliver(key(2, ENDED_KEPT + 1), desc(5), buf()),
            Delivery::Clash(_)
        ));
    }

    /// A connection with a live peer broken between frames (or in a
    /// header): every receive from it for a collective not ended here fails
    /// with `Lost`, waiting or started later, and every message; a frame
    /// filed whole is taken; ended ops, other peers and groups unknown then
    /// are not affected.
    #[test]
    fn a_connection_broken_between_frames_fails_what_may_be_lost() {
        let lost = |f: Result<Frame, Fail>| matches!(f, Err(Fail::Lost { rank: 2, .. }));
        let mut r = Router::new(0);
        for seq in 0..3 {
            r.begin_seq(1, seq, desc(4)).unwrap();
        }
        r.end_seq(1, 0);
        let mut from2 = waiting(&mut r, key(2, 1));
        let mut from3 = waiting(&mut r, key(3, 1));
        assert_eq!(r.deliver(key(2, 2), desc(4), buf()), Delivery::Taken);
        r.lose_peer(2, "connection reset by peer");
        assert!(lost(from2.try_recv().unwrap()));
        assert!(from3.try_recv().is_err(), "another peer's receive failed");
        assert!(matches!(r.start_recv(key(2, 2), None), Start::Ready(_)));
        for k in [
            key(2, 3),
            Key {
                p2p: true,
                ..key(2, 0)
            },
        ] {
            match r.start_recv(k, None) {
                Start::Failed(f) => assert!(lost(Err(f)), "{k:?}"),
                _ => panic!("a receive from a broken connection began: {k:?}"),
            }
        }
        // A group created later is not affected.
        assert!(matches!(
            r.start_recv(
                Key {
                    comm: 9,
                    ..key(2, 0)
                },
                None
            ),
            Start::Wait(_)
        ));
        // With nothing running, the next op on is lost.
        let mut r = Router::new(0);
        r.begin_seq(1, 0, desc(4)).unwrap();
        r.end_seq(1, 0);
        r.lose_peer(2, "connection reset by peer");
        assert!(matches!(r.start_recv(key(2, 1), None), Start::Failed(_)));
        // Gone first: the waiters were failed naming that.
        let mut r = Router::new(0);
        r.mark_gone(2, "EOF");
        r.lose_peer(2, "reset");
        assert_eq!(r.live.lost_and_broken().1, 0);
    }

    #[test]
    fn a_gone_peer_fails_only_what_waits_on_it() {
        let mut r = Router::new(0);
        let mut from2 = waiting(&mut r, key(2, 0));
        let mut from3 = waiting(&mut r, key(3, 0));
        r.deliver(key(2, 1), desc(4), buf());
        assert!(r.mark_gone(2, "EOF"));
        assert!(!r.mark_gone(2, "again"));
        assert!(matches!(
            from2.try_recv(),
            Ok(Err(Fail::Gone { rank: 2, .. }))
        ));
        assert!(from3.try_recv().is_err());
        // What it sent before it went is still there.
        assert!(matches!(r.start_recv(key(2, 1), None), Start::Ready(_)));
        assert!(matches!(
            r.start_recv(key(2, 2), None),
            Start::Failed(Fail::Gone { .. })
        ));
    }
}
