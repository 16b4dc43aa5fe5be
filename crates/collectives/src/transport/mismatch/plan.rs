//! What a clash of calls raises, decided without I/O from the groups'
//! entries: which group and op it is about (a step of an internal group is
//! its group's op), and whether it is held (calls that diverged earlier),
//! dropped (a group retired here) or aborts the group; and, for two ranks
//! met in shared memory at steps of different ops, which op differs and
//! which rank names the mismatch. `mismatch.rs` carries the answers out;
//! the rules are tested here.

use crate::transport::router::Groups;
use crate::transport::{ChildLink, Clash};

/// What a clash raises.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Raise {
    /// The calls diverged before this op: held for a grace, for the first
    /// mismatch's abort (`diverged.rs`).
    Hold(Clash),
    /// The group's mismatch: it aborts from the clash's op.
    Abort(Clash),
    /// Found after the group's grace ended here (see `Shared::dropped`):
    /// it has no members to tell.
    Ignore,
}

/// What clash `c` raises. A step of a two-level op: the mismatch is the
/// group's, at its op (its abort aborts the step's internal group). The
/// step may have ended here, and its op with it: a late frame must still
/// fail the group, not only the internal group.
pub(crate) fn raise(groups: &Groups, mut c: Clash) -> Raise {
    while let Some(l) = groups.get(c.comm).and_then(|g| g.parent.as_ref()) {
        c.comm = l.parent;
        c.seq = l.parent_seq(c.seq);
    }
    if c.diverged {
        Raise::Hold(c)
    } else if groups.is_retired(c.comm) {
        Raise::Ignore
    } else {
        Raise::Abort(c)
    }
}

/// Two ranks at steps of different ops of an internal group's group (see
/// `Shared::steps_apart`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Apart {
    /// The group's op this rank's step belongs to.
    pub mine: u64,
    /// The group's op the other rank's step belongs to.
    pub theirs: u64,
    /// This rank is past the other's op, so knows both calls there: it
    /// raises the mismatch, at the other's op. (The rank at the earlier op
    /// knows only its own call, and leaves the naming to the other.)
    pub raises: bool,
}

/// Internal ops `mine` here and `theirs` on another rank, of internal group
/// `link`: apart when they are steps of different ops of its group.
pub(crate) fn apart(link: &ChildLink, mine: u64, theirs: u64) -> Option<Apart> {
    let (pm, pt) = (link.parent_seq(mine), link.parent_seq(theirs));
    (pm != pt).then_some(Apart {
        mine: pm,
        theirs: pt,
        raises: pt < pm,
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::element::{DType, ReduceOp};
    use crate::frame::{Algo, Desc, OpKind, HIST_NONE};

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

    fn clash(comm: u64, seq: u64, diverged: bool) -> Clash {
        Clash {
            comm,
            seq,
            a: (None, desc(4)),
            b: (2, desc(5)),
            diverged,
        }
    }

    /// Group 1 with internal group 2 (three internal ops per op); group 3
    /// retired, with internal group 4 (one per op).
    fn groups() -> Groups {
        let mut g = Groups::default();
        g.add_child(1, Arc::new(ChildLink::new(2, 1, 3)));
        g.add_child(3, Arc::new(ChildLink::new(4, 3, 1)));
        g.retire(3);
        g
    }

    #[test]
    fn a_clash_is_raised_on_its_group_held_dropped_or_aborting() {
        let g = groups();
        // (clash's group, op, diverged) -> raised
        let cases = [
            (1, 7, false, Raise::Abort(clash(1, 7, false))),
            (1, 7, true, Raise::Hold(clash(1, 7, true))),
            (2, 7, false, Raise::Abort(clash(1, 2, false))),
            (2, 7, true, Raise::Hold(clash(1, 2, true))),
            (3, 7, false, Raise::Ignore),
            (3, 7, true, Raise::Hold(clash(3, 7, true))),
            (4, 7, false, Raise::Ignore),
            (9, 0, false, Raise::Abort(clash(9, 0, false))),
        ];
        for (comm, seq, diverged, want) in cases {
            assert_eq!(
                raise(&g, clash(comm, seq, diverged)),
                want,
                "group {comm} op {seq} diverged {diverged}"
            );
        }
    }

    #[test]
    fn steps_of_different_ops_are_apart_and_the_rank_past_names_them() {
        let link = ChildLink::new(2, 1, 3);
        // (mine, theirs) -> apart
        let cases = [
            (6, 8, None),
            (6, 6, None),
            (
                9,
                8,
                Some(Apart {
                    mine: 3,
                    theirs: 2,
                    raises: true,
                }),
            ),
            (
                5,
                6,
                Some(Apart {
                    mine: 1,
                    theirs: 2,
                    raises: false,
                }),
            ),
        ];
        for (mine, theirs, want) in cases {
            assert_eq!(apart(&link, mine, theirs), want, "{mine} and {theirs}");
        }
    }
}
