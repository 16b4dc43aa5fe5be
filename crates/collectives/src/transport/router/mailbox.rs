//! The mailbox: per frame key, the frame filed until its operation asks,
//! or the receive waiting for it (into a receive buffer, or posted into the
//! operation's own memory: a landing).

use std::collections::HashMap;

use tokio::sync::oneshot;

use super::{Fail, Frame, Key};
use crate::transport::landing::Landing;

type Waiter = oneshot::Sender<Result<Frame, Fail>>;

enum Slot {
    Ready(Frame),
    /// A receive waits; with a [`Landing`], its payload may be read straight
    /// into the waiter's buffer.
    Waiting(Waiter, Option<Landing>),
    /// A reader is reading the frame's payload into the waiter's landing.
    Landing(Waiter),
}

impl Slot {
    fn waits(&self) -> bool {
        !matches!(self, Slot::Ready(_))
    }

    fn into_waiter(self) -> Option<Waiter> {
        match self {
            Slot::Waiting(tx, _) | Slot::Landing(tx) => Some(tx),
            Slot::Ready(_) => None,
        }
    }
}

/// What became of a frame put in the mailbox.
#[derive(Debug, PartialEq)]
pub(super) enum Put {
    /// Handed to the receive waiting for it.
    Handed,
    /// Filed until its operation asks.
    Filed,
    /// A frame for the key is filed or landing already.
    Duplicate,
}

/// What the mailbox holds for a key.
#[derive(Debug, PartialEq)]
pub(super) enum Held {
    Nothing,
    /// A whole frame, filed.
    Filed,
    /// A receive waits (or its frame is landing).
    Waiting,
}

#[derive(Default)]
pub(super) struct Mailbox {
    slots: HashMap<Key, Slot>,
}

impl Mailbox {
    pub fn held(&self, key: &Key) -> Held {
        match self.slots.get(key) {
            None => Held::Nothing,
            Some(s) if s.waits() => Held::Waiting,
            Some(_) => Held::Filed,
        }
    }

    /// Hands `frame` to the receive waiting for `key`, or files it.
    pub fn put(&mut self, key: Key, frame: Frame) -> Put {
        match self.slots.remove(&key) {
            Some(Slot::Waiting(tx, _)) => {
                let _ = tx.send(Ok(frame));
                Put::Handed
            }
            Some(old @ (Slot::Ready(_) | Slot::Landing(_))) => {
                self.slots.insert(key, old);
                Put::Duplicate
            }
            None => {
                self.slots.insert(key, Slot::Ready(frame));
                Put::Filed
            }
        }
    }

    /// The frame filed for `key`, taken. Panics if a receive waits for it:
    /// two operations never wait for one key.
    pub fn take(&mut self, key: &Key) -> Option<Frame> {
        match self.slots.remove(key) {
            Some(Slot::Ready(f)) => Some(f),
            Some(_) => unreachable!("two operations wait for one frame key"),
            None => None,
        }
    }

    /// A receive waits for `key` (into `landing`, if one).
    pub fn wait(
        &mut self,
        key: Key,
        landing: Option<Landing>,
    ) -> oneshot::Receiver<Result<Frame, Fail>> {
        let (tx, rx) = oneshot::channel();
        self.slots.insert(key, Slot::Waiting(tx, landing));
        rx
    }

    /// Fails the receive waiting for `key`, if one is.
    pub fn fail(&mut self, key: &Key, f: Fail) {
        if self.slots.get(key).is_some_and(Slot::waits) {
            if let Some(tx) = self.slots.remove(key).and_then(Slot::into_waiter) {
                let _ = tx.send(Err(f));
            }
        }
    }

    /// Fails every receive waiting for a key that `which` picks, with `fail`.
    pub fn fail_waiting(&mut self, which: impl Fn(&Key) -> bool, fail: impl Fn() -> Fail) {
        let keys: Vec<Key> = (self.slots.iter())
            .filter(|(k, s)| s.waits() && which(k))
            .map(|(k, _)| *k)
            .collect();
        for k in keys {
            if let Some(tx) = self.slots.remove(&k).and_then(Slot::into_waiter) {
                let _ = tx.send(Err(fail()));
            }
        }
    }

    /// Stops waiting for `key`.
    pub fn cancel(&mut self, key: &Key) {
        if self.slots.get(key).is_some_and(Slot::waits) {
            self.slots.remove(key);
        }
    }

    /// Drops the frames filed for keys that `which` picks; returns each
    /// one's key and payload length (its sender's credit to give back).
    pub fn drop_filed(&mut self, which: impl Fn(&Key) -> bool) -> Vec<(Key, usize)> {
        let keys: Vec<Key> = (self.slots.iter())
            .filter(|(k, s)| !s.waits() && which(k))
            .map(|(k, _)| *k)
            .collect();
        keys.into_iter()
            .filter_map(|k| match self.slots.remove(&k) {
                Some(Slot::Ready(f)) => Some((k, f.buf.len())),
                _ => None,
            })
            .collect()
    }

    /// The keys receives wait for from `peer`, in (group, kind, tag, op,
    /// step) order.
    pub fn waiting_from(&self, peer: usize) -> Vec<Key> {
        let mut w: Vec<Key> = (self.slots.iter())
            .filter(|(k, s)| k.src as usize == peer && matches!(s, Slot::Waiting(..)))
            .map(|(k, _)| *k)
            .collect();
        w.sort_by_key(|k| (k.comm, k.p2p, k.tag, k.seq, k.step));
        w
    }

    /// Whether a receive for `key` posted a landing of `len` bytes.
    pub fn posted(&self, key: &Key, len: usize) -> bool {
        matches!(self.slots.get(key), Some(Slot::Waiting(_, Some(l))) if l.len() == len)
    }

    /// Takes the landing posted for `key` (see [`Mailbox::posted`]): the
    /// slot then waits for [`Mailbox::landed`].
    pub fn start_landing(&mut self, key: Key) -> Option<Landing> {
        match self.slots.remove(&key) {
            Some(Slot::Waiting(tx, l)) => {
                self.slots.insert(key, Slot::Landing(tx));
                l
            }
            Some(other) => {
                self.slots.insert(key, other);
                None
            }
            None => None,
        }
    }

    /// The payload landed for `key` is in: its waiter, if it still waits,
    /// gets `frame`.
    pub fn landed(&mut self, key: &Key, frame: Frame) {
        if matches!(self.slots.get(key), Some(Slot::Landing(_))) {
            if let Some(tx) = self.slots.remove(key).and_then(Slot::into_waiter) {
                let _ = tx.send(Ok(frame));
            }
        }
    }

    /// Every group with a frame or a receive here.
    pub fn groups(&self) -> impl Iterator<Item = u64> + '_ {
        self.slots.keys().map(|k| k.comm)
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.slots.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::element::{Buf, DType, Pool, ReduceOp};
    use crate::frame::{Algo, Desc, OpKind, HIST_NONE};

    fn key(seq: u64) -> Key {
        Key {
            comm: 1,
            src: 1,
            p2p: false,
            tag: 0,
            seq,
            step: 0,
        }
    }

    fn frame(len: usize) -> Frame {
        let buf: Buf = Pool::new(64, 0).get(len);
        Frame {
            desc: Desc {
                op: OpKind::AllReduce,
                dtype: DType::U8,
                reduce: Some(ReduceOp::Sum),
                algo: Algo::Ring,
                root: 0,
                count: len as u64,
                hist: HIST_NONE,
            },
            buf,
            landed: false,
        }
    }

    #[test]
    fn a_frame_is_filed_or_handed_and_a_second_for_its_key_is_refused() {
        let mut m = Mailbox::default();
        assert_eq!(m.put(key(0), frame(8)), Put::Filed);
        assert_eq!(m.put(key(0), frame(8)), Put::Duplicate);
        assert_eq!(m.held(&key(0)), Held::Filed);
        assert_eq!(m.take(&key(0)).unwrap().buf.len(), 8);
        let mut rx = m.wait(key(1), None);
        assert_eq!(m.held(&key(1)), Held::Waiting);
        assert_eq!(m.waiting_from(1), vec![key(1)]);
        assert_eq!(m.put(key(1), frame(4)), Put::Handed);
        assert_eq!(rx.try_recv().unwrap().ok().unwrap().buf.len(), 4);
        assert!(m.is_empty());
    }

    #[test]
    fn waiting_receives_fail_or_are_cancelled_and_filed_frames_are_dropped() {
        let mut m = Mailbox::default();
        let mut a = m.wait(key(0), None);
        let _b = m.wait(key(1), None);
        m.put(key(2), frame(16));
        m.fail_waiting(|k| k.seq == 0, || Fail::Timeout);
        assert!(matches!(a.try_recv().unwrap(), Err(Fail::Timeout)));
        m.cancel(&key(1));
        m.cancel(&key(2));
        assert_eq!(m.held(&key(2)), Held::Filed, "cancel leaves a filed frame");
        assert_eq!(m.drop_filed(|_| true), vec![(key(2), 16)]);
        assert!(m.is_empty());
    }
}
