//! What an abort does here, decided without I/O: whether it is taken at
//! all, and then what it sets off (marked provisional, who already has it,
//! passed to internal groups, marked in shared memory, recorded, told to
//! whom). [`Shared::abort`](super::Shared::abort) asks [`admit`] before it
//! touches the router and [`effects`] after, and only carries the answer
//! out; the rules are tested here, case by case.

use super::Origin;

/// Whether an abort is taken, decided before it touches the router.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Admit {
    /// Dropped: a provisional report about a group with no members here,
    /// or one that an abort in place already covers (a provisional report
    /// never replaces what is in place).
    Ignore,
    /// A group whose members are not known here (an internal group's
    /// abort arriving first, a group retired): the abort is put in place
    /// and passed to internal groups (as this origin), and nobody is told.
    Unregistered(Origin),
    /// Put in place; then [`effects`] says what follows.
    Apply,
}

/// Decides whether an abort coming `how` is taken. `registered`: the
/// group's members are known here; `covered`: an abort in place already
/// fails the abort's first op.
pub(crate) fn admit(how: Origin, registered: bool, covered: bool) -> Admit {
    match (how, registered) {
        (Origin::Leaving, false) => Admit::Ignore,
        (_, false) => Admit::Unregistered(passed_down(how)),
        (Origin::Leaving, true) if covered => Admit::Ignore,
        _ => Admit::Apply,
    }
}

/// How internal groups get their group's abort: passed on (told, like any
/// passed-on abort, to the members this rank is connected to), and a
/// provisional one stays provisional (a member told holds it for the
/// group: see `diverged.rs`).
pub(crate) fn passed_down(how: Origin) -> Origin {
    match how {
        Origin::Leaving => Origin::Leaving,
        _ => Origin::Passed(None),
    }
}

/// Whom the abort goes to, once recorded (or not).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tell {
    /// The failure happened here: record it in the store first; tell every
    /// member if the record is the first ([`tell_everyone`]), else those
    /// this rank is connected with.
    RecordThenTell,
    /// Passed on, or provisional: tell the members this rank is connected
    /// with (not the one that sent it, noted as told).
    Connected,
}

/// What an abort the router took sets off, in this order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Effects {
    /// Mark the abort provisional in the router (calls found diverged,
    /// reported by a rank that could not wait).
    pub provisional: bool,
    /// The member that sent the abort has it: noted, so it is not told back.
    pub told_by: Option<usize>,
    /// Keep a watch of how far its telling has come (for `Shared::told`).
    pub telling: bool,
    /// Pass it to the group's internal groups, as this origin.
    pub children: Option<Origin>,
    /// Mark it in the group's shared memory, waking its sleepers.
    pub hearer: bool,
    /// Record and tell it (in the background).
    pub tell: Option<Tell>,
}

/// What an abort admitted ([`Admit::Apply`]) sets off. `changed`: the router
/// took it (it is the first, or fails more, or replaces a provisional one).
/// A rank found killed before the hearer is marked takes
/// [`Effects::killed`] instead.
pub(crate) fn effects(how: Origin, changed: bool) -> Effects {
    if !changed {
        return Effects::default();
    }
    Effects {
        provisional: how == Origin::Leaving,
        told_by: match how {
            Origin::Passed(sender) => sender,
            _ => None,
        },
        telling: true,
        children: Some(passed_down(how)),
        // A provisional report is not marked in shared memory, which would
        // fail the members there for good.
        hearer: how != Origin::Leaving,
        tell: Some(match how {
            Origin::Here => Tell::RecordThenTell,
            _ => Tell::Connected,
        }),
    }
}

impl Effects {
    /// The effects left to a rank that was killed (fault injection): it
    /// writes nothing, in the region as in the store. The transport looks
    /// after passing the abort down, just before the first of these, so that
    /// a kill landing meanwhile is seen.
    pub(crate) fn killed(self) -> Effects {
        Effects {
            hearer: false,
            tell: None,
            ..self
        }
    }
}

/// How writing the abort record to the store went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Record {
    /// This rank's record is the store's first.
    First,
    /// Another rank's record was there first.
    Second,
    /// The store failed or did not answer in time: it cannot say.
    Unknown,
}

/// Whether the origin tells every member (opening connections as needed)
/// rather than only those it is connected with: its record is the first, or
/// the store could not say. So many ranks failing at once open O(n)
/// connections, not n².
pub(crate) fn tell_everyone(tell: Tell, record: Option<Record>) -> bool {
    tell == Tell::RecordThenTell && matches!(record, Some(Record::First | Record::Unknown))
}

/// The members to tell: every other one, or only those connected with
/// this rank.
pub(crate) fn targets(
    members: &[usize],
    me: usize,
    everyone: bool,
    connected: impl Fn(usize) -> bool,
) -> Vec<usize> {
    members
        .iter()
        .copied()
        .filter(|&m| m != me && (everyone || connected(m)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const HERE: Origin = Origin::Here;
    const LEAVING: Origin = Origin::Leaving;
    const FROM_3: Origin = Origin::Passed(Some(3));
    const PASSED: Origin = Origin::Passed(None);

    #[test]
    fn admit_takes_all_but_provisional_reports_it_cannot_use() {
        // (how, registered, covered) -> admitted
        let cases = [
            (HERE, true, false, Admit::Apply),
            (HERE, true, true, Admit::Apply),
            (FROM_3, true, true, Admit::Apply),
            (PASSED, true, false, Admit::Apply),
            (LEAVING, true, false, Admit::Apply),
            (LEAVING, true, true, Admit::Ignore),
            (LEAVING, false, false, Admit::Ignore),
            (HERE, false, false, Admit::Unregistered(PASSED)),
            (FROM_3, false, true, Admit::Unregistered(PASSED)),
            (PASSED, false, false, Admit::Unregistered(PASSED)),
        ];
        for (how, registered, covered, want) in cases {
            assert_eq!(
                admit(how, registered, covered),
                want,
                "{how:?} registered {registered} covered {covered}"
            );
        }
    }

    #[test]
    fn effects_follow_the_origin() {
        let none = Effects::default();
        let here = Effects {
            provisional: false,
            told_by: None,
            telling: true,
            children: Some(PASSED),
            hearer: true,
            tell: Some(Tell::RecordThenTell),
        };
        let dead = Effects::killed;
        let from_3 = Effects {
            told_by: Some(3),
            tell: Some(Tell::Connected),
            ..here
        };
        let passed = Effects {
            told_by: None,
            ..from_3
        };
        let leaving = Effects {
            provisional: true,
            children: Some(LEAVING),
            hearer: false,
            ..passed
        };
        // (how, changed, dead) -> effects
        let cases = [
            (HERE, false, false, none),
            (LEAVING, false, false, none),
            (FROM_3, false, true, none),
            (HERE, true, false, here),
            (HERE, true, true, dead(here)),
            (FROM_3, true, false, from_3),
            (FROM_3, true, true, dead(from_3)),
            (PASSED, true, false, passed),
            (LEAVING, true, false, leaving),
            (LEAVING, true, true, dead(leaving)),
        ];
        for (how, changed, is_dead, want) in cases {
            let fx = effects(how, changed);
            assert_eq!(
                if is_dead { fx.killed() } else { fx },
                want,
                "{how:?} changed {changed} dead {is_dead}"
            );
        }
    }

    #[test]
    fn only_an_origin_whose_record_may_be_first_tells_everyone() {
        let cases = [
            (Tell::RecordThenTell, Some(Record::First), true),
            (Tell::RecordThenTell, Some(Record::Unknown), true),
            (Tell::RecordThenTell, Some(Record::Second), false),
            (Tell::RecordThenTell, None, false),
            (Tell::Connected, Some(Record::First), false),
            (Tell::Connected, None, false),
        ];
        for (tell, record, want) in cases {
            assert_eq!(tell_everyone(tell, record), want, "{tell:?} {record:?}");
        }
    }

    #[test]
    fn targets_are_the_other_members_or_the_connected_ones() {
        let members = [0, 1, 2, 3];
        let connected = |m: usize| m == 2;
        assert_eq!(targets(&members, 1, true, connected), [0, 2, 3]);
        assert_eq!(targets(&members, 1, false, connected), [2]);
        assert_eq!(targets(&members, 2, false, connected), [] as [usize; 0]);
    }
}
