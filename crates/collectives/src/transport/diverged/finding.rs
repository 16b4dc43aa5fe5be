//! A group's finding of diverged calls as a state machine without I/O:
//! what a new finding does to the one held (start a grace, lower it, abort
//! at once, or nothing), what the grace's end reports and how, what an op
//! whose deadline passed reports, and whether an op failing on a peer gone
//! waits. `diverged.rs` holds one per group (with the watch that says the
//! grace settled) and carries the answers out; the rules are tested here.

use super::Origin;
use crate::error::Error;

/// The calls found diverged on a group, held (see `diverged.rs`).
#[derive(Debug, Clone)]
pub(crate) struct Finding {
    /// The lowest op found diverged so far.
    seq: u64,
    /// The error it reports.
    err: Error,
    /// The grace ended (later findings abort at once).
    ended: bool,
}

/// What a new finding does.
#[derive(Debug, Clone)]
pub(crate) enum Found {
    /// The group's first: held, and its grace starts.
    StartGrace(Finding),
    /// At a lower op than the one held, in its grace: held instead.
    Lowered,
    /// At a lower op than the one held, after its grace: the group aborts
    /// from it at once, as a failure found here.
    AbortNow { seq: u64, err: Error },
    /// At the op held or a later one: nothing new.
    Ignore,
}

/// A finding at op `seq` reporting `err`, with `held` the group's finding
/// so far, if any (which it may lower).
pub(crate) fn found(held: Option<&mut Finding>, seq: u64, err: Error) -> Found {
    match held {
        None => Found::StartGrace(Finding {
            seq,
            err,
            ended: false,
        }),
        Some(h) if seq < h.seq => {
            h.seq = seq;
            h.err = err.clone();
            if h.ended {
                Found::AbortNow { seq, err }
            } else {
                Found::Lowered
            }
        }
        Some(_) => Found::Ignore,
    }
}

impl Finding {
    /// The grace ended (`leaving`: cut short as the transport stops, this
    /// rank leaving the group): the group aborts from the lowest op found,
    /// with what was found there; final, or provisional when leaving (it
    /// replaces this rank's own provisional report, made as an op's
    /// deadline passed, once final).
    pub fn end_grace(&mut self, leaving: bool) -> (u64, Error, Origin) {
        self.ended = true;
        let how = if leaving {
            Origin::Leaving
        } else {
            Origin::Here
        };
        (self.seq, self.err.clone(), how)
    }

    /// For an op at `seq` whose deadline passed: what to report,
    /// provisionally, from the op found (when it is `seq` or before: the
    /// finding is why the op waited).
    pub fn give_up(&self, seq: u64) -> Option<(u64, Error)> {
        (self.seq <= seq).then(|| (self.seq, self.err.clone()))
    }

    /// The op found, while the grace runs (an op failing on a peer gone
    /// waits for it to settle, unless an abort fails that op already).
    pub fn in_grace(&self) -> Option<u64> {
        (!self.ended).then_some(self.seq)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Compared by their debug text (errors have no equality).
    fn text(x: &impl std::fmt::Debug) -> String {
        format!("{x:?}")
    }

    fn err(why: &str) -> Error {
        Error::Aborted {
            group: "g".into(),
            reason: why.into(),
            by: None,
        }
    }

    fn at(seq: u64, ended: bool) -> Finding {
        Finding {
            seq,
            err: err(&format!("at {seq}")),
            ended,
        }
    }

    /// (held before, new finding's op) -> (what it does, held after).
    #[test]
    fn a_new_finding_starts_a_grace_lowers_aborts_or_is_ignored() {
        let cases: [(Option<Finding>, u64, Found, Option<Finding>); 7] = [
            (None, 5, Found::StartGrace(at(5, false)), None),
            (Some(at(5, false)), 3, Found::Lowered, Some(at(3, false))),
            (Some(at(5, false)), 5, Found::Ignore, Some(at(5, false))),
            (Some(at(5, false)), 7, Found::Ignore, Some(at(5, false))),
            (
                Some(at(5, true)),
                3,
                Found::AbortNow {
                    seq: 3,
                    err: err("at 3"),
                },
                Some(at(3, true)),
            ),
            (Some(at(5, true)), 5, Found::Ignore, Some(at(5, true))),
            (Some(at(5, true)), 9, Found::Ignore, Some(at(5, true))),
        ];
        for (before, seq, want, after) in cases {
            let mut held = before.clone();
            let got = found(held.as_mut(), seq, err(&format!("at {seq}")));
            assert_eq!(text(&got), text(&want), "{before:?} then {seq}");
            assert_eq!(text(&held), text(&after), "{before:?} then {seq}");
        }
    }

    #[test]
    fn the_grace_ends_final_or_provisional_when_leaving() {
        for (leaving, how) in [(false, Origin::Here), (true, Origin::Leaving)] {
            let mut f = at(4, false);
            assert_eq!(f.in_grace(), Some(4));
            assert_eq!(text(&f.end_grace(leaving)), text(&(4, err("at 4"), how)));
            assert_eq!(f.in_grace(), None, "settled");
            // A lower op found now aborts at once.
            assert!(matches!(
                found(Some(&mut f), 2, err("at 2")),
                Found::AbortNow { seq: 2, .. }
            ));
        }
    }

    #[test]
    fn an_op_giving_up_reports_a_finding_at_it_or_before() {
        // (op found, op giving up) -> reported
        for (held, seq, want) in [(4, 3, None), (4, 4, Some(4)), (4, 9, Some(4))] {
            let f = at(held, false);
            let got = f.give_up(seq).map(|(s, _)| s);
            assert_eq!(got, want, "found at {held}, giving up at {seq}");
        }
    }
}
