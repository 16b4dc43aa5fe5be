//! Calls compared: each collective's local call is recorded as it begins
//! and compared with the peers' frames; a clash is raised as the group's
//! mismatch (or held, when the calls had diverged earlier: `diverged.rs`).
//! What a clash raises is decided in `mismatch/plan.rs`, without I/O.

mod plan;

use std::sync::Arc;

use super::router::Clash;
use super::{lock, Origin, Shared};
use crate::error::Error;
use crate::frame::Desc;
use plan::Raise;

impl Shared {
    /// Records the local call of collective `seq`; a mismatch with what a peer
    /// already sent is returned as (peer world rank, its descriptor).
    pub fn begin_seq(self: &Arc<Self>, comm: u64, seq: u64, desc: Desc) -> Result<(), Clash> {
        self.route(|r| r.begin_seq(comm, seq, desc))
    }

    pub fn end_seq(&self, comm: u64, seq: u64) {
        lock(&self.outbound).ended(comm, seq);
        lock(&self.router).end_seq(comm, seq)
    }

    /// Aborts the group of a mismatch, naming both sides, from its op on.
    ///
    /// A clash of calls whose histories differ ([`Clash::diverged`]) is not
    /// the first mismatch: it is held for a grace, for the first mismatch's
    /// abort (`diverged.rs`). A step of a two-level op raises on its
    /// group, at its op; a clash found after the group retired here is
    /// dropped (see [`plan::raise`]).
    pub fn raise(self: &Arc<Self>, c: Clash) {
        let raised = plan::raise(lock(&self.router).groups(), c);
        match raised {
            Raise::Hold(c) => self.hold(c),
            Raise::Abort(c) => {
                let err = self.clash_error(&c);
                self.abort(c.comm, err, Origin::Here, c.seq);
            }
            Raise::Ignore => {}
        }
    }

    /// The error a clash raises, naming both sides by group rank.
    pub(super) fn clash_error(&self, c: &Clash) -> Error {
        let m = self.members(c.comm);
        let group = m
            .as_ref()
            .map_or_else(|| self.cfg.name.clone(), |m| m.name.clone());
        let grank = |w: usize| m.as_ref().map_or(w, |m| m.group_rank(w));
        let (seq, rank_a, desc_a, rank_b, desc_b) = (
            c.seq,
            grank(c.a.0.map_or(self.cfg.rank, |r| r as usize)),
            c.a.1.to_string(),
            grank(c.b.0 as usize),
            c.b.1.to_string(),
        );
        if c.diverged {
            // The calls may be alike: their histories tell them apart.
            let after = |d: &Desc| format!(" after calls {:06x}", d.hist);
            Error::Diverged {
                group,
                seq,
                rank_a,
                desc_a: desc_a + &after(&c.a.1),
                rank_b,
                desc_b: desc_b + &after(&c.b.1),
            }
        } else {
            Error::Mismatch {
                group,
                seq,
                rank_a,
                desc_a,
                rank_b,
                desc_b,
            }
        }
    }

    /// Two ranks' calls at one place of internal group `comm`'s shared
    /// memory are steps of different ops of its group: internal op `mine`
    /// here, `theirs` (called `desc`) on world rank `src`. So at the earlier
    /// of the two ops the ranks called different things, one of them an op
    /// that does not run in two levels (or it would own this place).
    ///
    /// The rank past that op knows both calls there: it raises the mismatch
    /// (at the group's op, naming both). The rank at it knows only its own,
    /// and leaves the naming to the other. Either way the step fails with an
    /// abort, which the group's (the mismatch) replaces once in place.
    /// `None` when `comm` is not an internal group.
    pub fn steps_apart(
        self: &Arc<Self>,
        comm: u64,
        mine: u64,
        src: u32,
        theirs: u64,
        desc: Desc,
    ) -> Option<Error> {
        let l = self.parent_link(comm)?;
        let plan::Apart {
            mine: pm,
            theirs: pt,
            raises,
        } = plan::apart(&l, mine, theirs)?;
        let m = self.members(l.parent);
        let grank = |w: usize| m.as_ref().map_or(w, |m| m.group_rank(w));
        if raises {
            let local = lock(&self.router).call(l.parent, pt);
            if let Some(local) = local {
                self.raise(Clash::new(l.parent, pt, (None, local), (src, desc)));
            }
        }
        Some(Error::Aborted {
            group: self.members(comm).map_or_else(String::new, |m| m.name),
            reason: format!(
                "rank {} called op #{pt} where this rank called op #{pm}: they called different ops at op #{}",
                grank(src as usize),
                pt.min(pm)
            )
            .into(),
            by: None,
        })
    }
}
