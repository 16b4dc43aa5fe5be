//! The call book: every collective's local call, from when it begins until
//! [`ENDED_KEPT`] later ones of its group have ended, and the first call a
//! peer sent for a collective not begun here yet, so that every frame and
//! want is compared with the call it is for, before, during or after it.

use std::collections::{BTreeMap, HashMap};

use super::Clash;
use crate::frame::Desc;

/// How many ended collectives per group keep their descriptor for late frames.
pub(crate) const ENDED_KEPT: u64 = 1024;

/// What one rank saw first in a collective it has not started yet.
#[derive(Default)]
struct Check {
    local: Option<Desc>,
    remote: Option<(u32, Desc)>,
}

#[derive(Default)]
pub(super) struct CallBook {
    /// Collectives begun here and not ended, or seen from a peer first.
    checks: HashMap<(u64, u64), Check>,
    /// Per (group, op), in order: pruned by range, as op numbers of
    /// internal groups have gaps (see `ChildLink`).
    ended: BTreeMap<(u64, u64), Desc>,
    /// Per group, one past the highest collective that ended here: a frame
    /// for one more than [`ENDED_KEPT`] below it is dropped unfiled.
    ended_top: HashMap<u64, u64>,
}

impl CallBook {
    /// Records the local call of collective `seq` as it begins; the call the
    /// first peer sent for it, if that differs, is the clash returned.
    pub fn begin(&mut self, comm: u64, seq: u64, desc: Desc) -> Result<(), Clash> {
        let c = self.checks.entry((comm, seq)).or_default();
        c.local = Some(desc);
        match c.remote {
            Some((src, d)) if !d.agrees(&desc) => {
                Err(Clash::new(comm, seq, (None, desc), (src, d)))
            }
            _ => Ok(()),
        }
    }

    /// Collective `seq` ended here: its call is kept for late frames, and
    /// calls [`ENDED_KEPT`] before it are forgotten.
    pub fn end(&mut self, comm: u64, seq: u64) {
        if let Some(local) = self.checks.remove(&(comm, seq)).and_then(|c| c.local) {
            self.ended.insert((comm, seq), local);
        }
        let top = self.ended_top.entry(comm).or_default();
        *top = (*top).max(seq + 1);
        if let Some(old) = seq.checked_sub(ENDED_KEPT) {
            while let Some(&k) = self
                .ended
                .range((comm, 0)..=(comm, old))
                .next()
                .map(|(k, _)| k)
            {
                self.ended.remove(&k);
            }
        }
    }

    /// The local call of collective `seq`: running, or ended and kept.
    pub fn call(&self, comm: u64, seq: u64) -> Option<Desc> {
        self.checks
            .get(&(comm, seq))
            .and_then(|c| c.local)
            .or_else(|| self.ended.get(&(comm, seq)).copied())
    }

    /// The local call of collective `seq`, while it runs.
    pub fn running_call(&self, comm: u64, seq: u64) -> Option<Desc> {
        self.checks.get(&(comm, seq)).and_then(|c| c.local)
    }

    /// Whether collective `seq` ended here (and is kept).
    pub fn ended(&self, comm: u64, seq: u64) -> bool {
        self.ended.contains_key(&(comm, seq))
    }

    /// Whether collective `seq` ended here so long ago that its call is
    /// forgotten: nothing will wait for a frame of it, or compare one. (An
    /// `*_async` op still running while over a thousand later ones ended is
    /// not.)
    pub fn forgotten(&self, comm: u64, seq: u64) -> bool {
        self.running_call(comm, seq).is_none()
            && self
                .ended_top
                .get(&comm)
                .is_some_and(|&top| seq + ENDED_KEPT < top)
    }

    /// Compares `desc`, from world rank `src`, with the local call of
    /// collective `seq`, or keeps it to compare when that call starts.
    pub fn compare(&mut self, comm: u64, seq: u64, src: u32, desc: Desc) -> Option<Clash> {
        if let Some(&l) = self.ended.get(&(comm, seq)) {
            return (!l.agrees(&desc)).then(|| Clash::new(comm, seq, (None, l), (src, desc)));
        }
        let c = self.checks.entry((comm, seq)).or_default();
        match (c.local, c.remote) {
            (Some(l), _) if !l.agrees(&desc) => Some(Clash::new(comm, seq, (None, l), (src, desc))),
            (None, Some((other, d))) if !d.agrees(&desc) => {
                Some(Clash::new(comm, seq, (Some(other), d), (src, desc)))
            }
            (None, None) => {
                c.remote = Some((src, desc));
                None
            }
            _ => None,
        }
    }

    /// The collectives running here (begun, not ended), in (group, op)
    /// order.
    pub fn running(&self) -> Vec<(u64, u64, Desc)> {
        let mut r: Vec<(u64, u64, Desc)> = self
            .checks
            .iter()
            .filter_map(|(&(c, q), chk)| Some((c, q, chk.local?)))
            .collect();
        r.sort_by_key(|&(c, q, _)| (c, q));
        r
    }

    /// The first collective of group `comm` that has not ended here: the
    /// oldest running, or else the next.
    pub fn first_open(&self, comm: u64) -> u64 {
        let running = (self.checks.iter())
            .filter(|((c, _), check)| *c == comm && check.local.is_some())
            .map(|((_, s), _)| *s)
            .min();
        let next = self.ended_top.get(&comm).copied().unwrap_or(0);
        running.map_or(next, |r| r.min(next))
    }

    /// Every group this book knows.
    pub fn groups(&self) -> impl Iterator<Item = u64> + '_ {
        (self.ended_top.keys().copied()).chain(self.checks.keys().map(|(c, _)| *c))
    }

    /// Forgets the calls of group `comm` from collective `from` on (its
    /// abort fails them).
    pub fn forget_from(&mut self, comm: u64, from: u64) {
        self.checks.retain(|(c, s), _| *c != comm || *s < from);
        self.ended.retain(|(c, s), _| *c != comm || *s < from);
    }

    /// Forgets group `comm` (dropped here).
    pub fn retire(&mut self, comm: u64) {
        self.forget_from(comm, 0);
        self.ended_top.remove(&comm);
    }

    #[cfg(test)]
    pub fn sizes(&self) -> [(&'static str, usize); 3] {
        [
            ("checks", self.checks.len()),
            ("ended", self.ended.len()),
            ("ended_top", self.ended_top.len()),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::element::{DType, ReduceOp};
    use crate::frame::{Algo, OpKind, HIST_NONE};

    fn call(count: u64) -> Desc {
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

    #[test]
    fn a_call_is_compared_before_it_begins_while_it_runs_and_after_it_ends() {
        let mut b = CallBook::default();
        // Before: the first peer's call is kept; a second that differs
        // clashes with it; the local call clashes with it as it begins.
        assert_eq!(b.compare(1, 0, 1, call(4)), None);
        let c = b.compare(1, 0, 2, call(5)).unwrap();
        assert_eq!((c.a, c.b), ((Some(1), call(4)), (2, call(5))));
        let c = b.begin(1, 0, call(5)).unwrap_err();
        assert_eq!((c.a, c.b), ((None, call(5)), (1, call(4))));
        // While it runs, and after it ends.
        b.begin(1, 1, call(4)).unwrap();
        assert_eq!(b.running(), vec![(1, 0, call(5)), (1, 1, call(4))]);
        assert!(b.compare(1, 1, 1, call(9)).is_some());
        b.end(1, 1);
        assert!(b.ended(1, 1) && b.call(1, 1) == Some(call(4)));
        assert!(b.compare(1, 1, 2, call(4)).is_none());
        assert!(b.compare(1, 1, 2, call(9)).is_some());
        assert_eq!(b.first_open(1), 0, "op 0 still runs");
    }

    #[test]
    fn ended_calls_are_kept_for_a_while_then_forgotten() {
        let mut b = CallBook::default();
        for seq in 0..ENDED_KEPT + 10 {
            b.begin(1, seq, call(seq)).unwrap();
            b.end(1, seq);
        }
        assert!(b.forgotten(1, 5) && b.call(1, 5).is_none());
        assert!(!b.forgotten(1, 20) && b.call(1, 20).is_some());
        assert_eq!(b.first_open(1), ENDED_KEPT + 10);
        b.forget_from(1, 20);
        assert!(b.call(1, 20).is_none() && b.call(1, 19).is_some());
        b.retire(1);
        assert!(b.sizes().iter().all(|(_, n)| *n == 0));
    }
}
