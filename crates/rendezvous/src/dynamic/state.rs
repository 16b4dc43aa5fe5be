//! The dynamic rendezvous's decisions, without I/O. [`Join`] is one node's join
//! as a state machine: the driver in `mod.rs` performs the [`Step`] it asks for
//! (a store write or wait), tells it what happened as an [`Event`] with the time,
//! and gets the next step. The smaller decisions — what an arrival does, who is a
//! member once a round completes, how ranks are assigned, when a silent peer is
//! dead — are plain functions it uses. The tests here drive all of it with
//! simulated time.

use std::cmp::Ordering;
use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

/// Node-count bounds of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    pub min: usize,
    pub max: usize,
}

/// What the node that took arrival index `index` (1-based) must do at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Arrival {
    /// It is the min-th or later: it starts the last call for everyone (every
    /// later arrival says so again, so a min-th arrival that stopped before
    /// saying it does not hold the round back).
    pub marks_min: bool,
    /// It is the max-th: the round is full and completes now.
    pub completes: bool,
}

pub fn on_arrival(index: usize, b: Bounds) -> Arrival {
    Arrival {
        marks_min: index >= b.min,
        completes: index == b.max,
    }
}

/// How many members a round gets when its last call ends with `arrivals` so far.
pub fn members_at_last_call(arrivals: usize, b: Bounds) -> usize {
    arrivals.clamp(b.min, b.max)
}

/// A node's place once its round completed with `members` members.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Membership {
    /// Arrival index within the members: it runs.
    Member,
    /// Too late, but the group could grow: it waits, and counts as waiting (the
    /// members re-form to take it in).
    Waiting,
    /// Too late and the group is full: it waits without forcing a re-form.
    Spare,
}

pub fn membership(index: usize, members: usize, b: Bounds) -> Membership {
    if index <= members {
        Membership::Member
    } else if members < b.max {
        Membership::Waiting
    } else {
        Membership::Spare
    }
}

/// Compares names the way people read them: runs of digits by value, so `node2`
/// sorts before `node10`.
pub fn natural_cmp(a: &str, b: &str) -> Ordering {
    let (mut a, mut b) = (a.as_bytes(), b.as_bytes());
    // Equal numbers written with different leading zeros ("2", "02") decide only
    // if nothing else does.
    let mut zeros = Ordering::Equal;
    loop {
        match (a.first(), b.first()) {
            (None, None) => return zeros,
            (None, Some(_)) => return Ordering::Less,
            (Some(_), None) => return Ordering::Greater,
            (Some(x), Some(y)) if x.is_ascii_digit() && y.is_ascii_digit() => {
                let da = a.iter().take_while(|c| c.is_ascii_digit()).count();
                let db = b.iter().take_while(|c| c.is_ascii_digit()).count();
                let (na, nb) = (&a[..da], &b[..db]);
                // By value: strip leading zeros, then compare length, then digits.
                let ta = &na[na.iter().take_while(|c| **c == b'0').count()..];
                let tb = &nb[nb.iter().take_while(|c| **c == b'0').count()..];
                let ord = ta.len().cmp(&tb.len()).then_with(|| ta.cmp(tb));
                if ord != Ordering::Equal {
                    return ord;
                }
                if zeros == Ordering::Equal {
                    zeros = da.cmp(&db);
                }
                a = &a[da..];
                b = &b[db..];
            }
            (Some(x), Some(y)) => {
                if x != y {
                    return x.cmp(y);
                }
                a = &a[1..];
                b = &b[1..];
            }
        }
    }
}

/// Ranks for the members `nodes` (by arrival order). A node keeps its previous
/// rank when that rank still exists and no one else claims it; the others fill
/// the free ranks in natural order of their ids. Returns the rank of each node, in
/// the order given. Deterministic, whatever the arrival order.
pub fn assign_ranks(nodes: &[String], previous: &HashMap<String, usize>) -> Vec<usize> {
    let n = nodes.len();
    let mut rank = vec![usize::MAX; n];
    let mut taken = vec![false; n];
    // Keepers: in natural order, so a contested rank goes to the same node always.
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&x, &y| natural_cmp(&nodes[x], &nodes[y]));
    for &i in &order {
        if let Some(&r) = previous.get(&nodes[i]) {
            if r < n && !taken[r] {
                taken[r] = true;
                rank[i] = r;
            }
        }
    }
    let mut free = (0..n).filter(|r| !taken[*r]);
    for &i in &order {
        if rank[i] == usize::MAX {
            rank[i] = free.next().expect("as many ranks as nodes");
        }
    }
    rank
}

/// Watches one peer's heartbeat counter and decides, from observations and the
/// time alone, when the peer is dead: its counter has not moved for
/// `interval * max_misses`.
#[derive(Debug, Clone)]
pub struct Liveness {
    expiry: Duration,
    last_value: Option<i64>,
    last_change: Instant,
}

impl Liveness {
    pub fn new(interval: Duration, max_misses: u32, now: Instant) -> Self {
        Liveness {
            expiry: interval * max_misses,
            last_value: None,
            last_change: now,
        }
    }

    /// Records the counter read at `now`; true once the peer counts as dead.
    pub fn observe(&mut self, value: i64, now: Instant) -> bool {
        if self.last_value != Some(value) {
            self.last_value = Some(value);
            self.last_change = now;
        }
        now.duration_since(self.last_change) >= self.expiry
    }
}

/// What the driver must do next for a joining node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Check the run is open, take an arrival index in `round` and publish this
    /// node's id under it; answer [`Event::Arrived`] (or [`Event::Closed`]).
    Arrive { round: u64 },
    /// Publish that the last call began and/or complete the round with
    /// `completes_with` members (first proposal wins); answer [`Event::Announced`].
    Announce {
        marks_min: bool,
        completes_with: Option<usize>,
    },
    /// Wait for the min-th arrival, until `until` (`None`: no limit); answer
    /// [`Event::MinReached`] or [`Event::TimedOut`].
    WaitMin { until: Option<Instant> },
    /// Wait for the round to complete until the last call ends; answer
    /// [`Event::Completed`] or [`Event::LastCallEnded`].
    WaitComplete { until: Instant },
    /// Propose completing the round with `members` (first proposal wins), then
    /// answer [`Event::Completed`] with the round's actual count.
    Complete { members: usize },
    /// Count as a node waiting for the group to grow; answer [`Event::Counted`].
    CountWaiting,
    /// Wait for the members to re-form (or the run to close) until `until`
    /// (`None`, a spare: no limit); answer [`Event::Reformed`] or
    /// [`Event::TimedOut`].
    WaitReform { until: Option<Instant> },
    /// Done: a member of `round` as arrival `index` of `members`.
    Member {
        round: u64,
        index: usize,
        members: usize,
    },
    /// Done: failed.
    Fail(JoinFailure),
}

/// How a join fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JoinFailure {
    /// Not enough nodes before the join deadline, in `round`.
    Timeout { round: u64 },
    /// The run is closed.
    Closed,
    /// The run closed while this node was a spare: it was never needed.
    GracefulExit,
}

/// What the driver observed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    Closed,
    Arrived {
        index: usize,
    },
    Announced,
    MinReached,
    /// The round completed with this many members (0: closed).
    Completed {
        members: usize,
    },
    /// The last call ran out with `arrivals` arrivals so far.
    LastCallEnded {
        arrivals: usize,
    },
    Counted,
    Reformed,
    TimedOut,
    /// The round this node was a member of never got its ranks (a member
    /// stopped between its steps): every member moves on to the next round.
    Abandoned,
}

/// One node's join: bounds, timeouts, and where it is.
#[derive(Debug, Clone)]
pub struct Join {
    bounds: Bounds,
    join_timeout: Duration,
    last_call: Duration,
    /// The join deadline; `None` while a spare waits (a full group may run for
    /// days).
    deadline: Option<Instant>,
    round: u64,
    index: usize,
    spare: bool,
}

impl Join {
    /// Starts a join at `round`; returns the machine and its first step.
    pub fn start(
        bounds: Bounds,
        join_timeout: Duration,
        last_call: Duration,
        round: u64,
        now: Instant,
    ) -> (Join, Step) {
        let j = Join {
            bounds,
            join_timeout,
            last_call,
            deadline: Some(now + join_timeout),
            round,
            index: 0,
            spare: false,
        };
        (j, Step::Arrive { round })
    }

    /// `min` arrived: the last call runs (bounded by the join deadline).
    fn min_reached(&self, now: Instant) -> Step {
        let last_call = now + self.last_call;
        Step::WaitComplete {
            until: self.deadline.map_or(last_call, |d| d.min(last_call)),
        }
    }

    /// The round this node is in.
    pub fn round(&self) -> u64 {
        self.round
    }

    /// The join deadline, if any.
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// The next step after `event`, observed at `now`.
    pub fn on(&mut self, event: Event, now: Instant) -> Step {
        match event {
            Event::Closed => Step::Fail(self.closed()),
            Event::TimedOut => Step::Fail(JoinFailure::Timeout { round: self.round }),
            Event::Arrived { index } => {
                self.index = index;
                let a = on_arrival(index, self.bounds);
                Step::Announce {
                    marks_min: a.marks_min,
                    completes_with: a.completes.then_some(self.bounds.max),
                }
            }
            Event::Announced => match self.deadline {
                // It marked `min` itself (it arrived at or past it).
                _ if self.index >= self.bounds.min => self.min_reached(now),
                // With min = max the max-th arrival marks `min` and completes
                // the round in one step: wait for the completion alone, until
                // the join deadline (one store wait less per node).
                Some(until) if self.bounds.min == self.bounds.max => Step::WaitComplete { until },
                until => Step::WaitMin { until },
            },
            Event::MinReached => self.min_reached(now),
            // Only without `min` reached (min = max, at the join deadline): too
            // few nodes came.
            Event::LastCallEnded { arrivals } if arrivals < self.bounds.min => {
                Step::Fail(JoinFailure::Timeout { round: self.round })
            }
            Event::LastCallEnded { arrivals } => Step::Complete {
                members: members_at_last_call(arrivals, self.bounds),
            },
            // Only a close completes a round with nobody.
            Event::Completed { members: 0 } => Step::Fail(self.closed()),
            Event::Completed { members } => match membership(self.index, members, self.bounds) {
                Membership::Member => Step::Member {
                    round: self.round,
                    index: self.index,
                    members,
                },
                Membership::Waiting => {
                    self.spare = false;
                    Step::CountWaiting
                }
                Membership::Spare => {
                    // A spare waits as long as the group stays full (PyTorch: the
                    // redundancy list has no timeout).
                    self.spare = true;
                    self.deadline = None;
                    Step::WaitReform { until: None }
                }
            },
            // A waiting node gives up at its join deadline, as PyTorch's.
            Event::Counted => Step::WaitReform {
                until: self.deadline,
            },
            Event::Abandoned => {
                self.round += 1;
                self.index = 0;
                Step::Arrive { round: self.round }
            }
            Event::Reformed => {
                // Join the next round; a spare's join timeout starts afresh.
                self.round += 1;
                if self.deadline.is_none() {
                    self.deadline = Some(now + self.join_timeout);
                }
                Step::Arrive { round: self.round }
            }
        }
    }

    fn closed(&self) -> JoinFailure {
        match self.spare {
            true => JoinFailure::GracefulExit,
            false => JoinFailure::Closed,
        }
    }
}

/// The distinct ranks in a round, for checks.
pub fn is_permutation(ranks: &[usize]) -> bool {
    let set: BTreeSet<usize> = ranks.iter().copied().collect();
    set.len() == ranks.len() && ranks.iter().all(|&r| r < ranks.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    const B: Bounds = Bounds { min: 2, max: 4 };

    #[test]
    fn arrivals_mark_min_and_complete_at_max() {
        let table = [
            (1, false, false),
            (2, true, false),
            (3, true, false),
            (4, true, true),
            (5, true, false),
        ];
        for (i, marks, completes) in table {
            assert_eq!(
                on_arrival(i, B),
                Arrival {
                    marks_min: marks,
                    completes
                },
                "arrival {i}"
            );
        }
        assert_eq!(
            on_arrival(1, Bounds { min: 1, max: 1 }),
            Arrival {
                marks_min: true,
                completes: true
            }
        );
    }

    #[test]
    fn membership_table() {
        // (arrival, members, expected)
        let table = [
            (1, 3, Membership::Member),
            (3, 3, Membership::Member),
            (4, 3, Membership::Waiting),
            (9, 3, Membership::Waiting),
            (5, 4, Membership::Spare),
        ];
        for (i, k, want) in table {
            assert_eq!(membership(i, k, B), want, "arrival {i} of {k}");
        }
        assert_eq!(members_at_last_call(3, B), 3);
        assert_eq!(members_at_last_call(7, B), 4);
    }

    #[test]
    fn natural_order() {
        let mut v = vec![
            "node10", "node2", "node1", "node02", "a", "node2b", "node2a",
        ];
        v.sort_by(|a, b| natural_cmp(a, b));
        assert_eq!(
            v,
            ["a", "node1", "node2", "node02", "node2a", "node2b", "node10"]
        );
    }

    #[test]
    fn ranks_are_natural_then_stable() {
        let nodes: Vec<String> = ["node10", "node2", "node1"].map(String::from).to_vec();
        let first = assign_ranks(&nodes, &HashMap::new());
        assert_eq!(first, [2, 1, 0], "node1 < node2 < node10");
        // node2 leaves, node3 comes: node10 and node1 keep their ranks where they can.
        let previous: HashMap<String, usize> = nodes.iter().cloned().zip(first).collect();
        let next: Vec<String> = ["node3", "node10", "node1"].map(String::from).to_vec();
        let r = assign_ranks(&next, &previous);
        assert_eq!(r[2], 0, "node1 keeps 0");
        assert_eq!(r[1], 2, "node10 keeps 2");
        assert_eq!(r[0], 1, "node3 takes the free rank");
        // A shrunk group: node10's old rank 2 no longer exists.
        let r = assign_ranks(&["node10".into(), "node1".into()], &previous);
        assert_eq!(r, [1, 0]);
        assert!(is_permutation(&r));
    }

    #[test]
    fn liveness_expires_after_interval_times_misses() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut l = Liveness::new(s, 3, t0);
        assert!(!l.observe(1, t0));
        assert!(!l.observe(2, t0 + s));
        assert!(!l.observe(2, t0 + 3 * s), "2 s of silence < 3 s");
        assert!(!l.observe(3, t0 + 3 * s + s / 2), "it moved");
        assert!(l.observe(3, t0 + 6 * s + s / 2), "3 s of silence");
    }

    const MS: Duration = Duration::from_millis(1);

    fn join(round: u64, t0: Instant) -> (Join, Step) {
        Join::start(B, 1000 * MS, 100 * MS, round, t0)
    }

    #[test]
    fn with_min_equal_to_max_a_node_waits_for_completion_alone_until_its_deadline() {
        let t0 = Instant::now();
        let b = Bounds { min: 3, max: 3 };
        let (mut j, _) = Join::start(b, 1000 * MS, 100 * MS, 0, t0);
        j.on(Event::Arrived { index: 1 }, t0);
        assert_eq!(
            j.on(Event::Announced, t0),
            Step::WaitComplete {
                until: t0 + 1000 * MS
            }
        );
        // The deadline passed with 2 of 3: a timeout, never a round of 2.
        assert_eq!(
            j.on(Event::LastCallEnded { arrivals: 2 }, t0 + 1000 * MS),
            Step::Fail(JoinFailure::Timeout { round: 0 })
        );
    }

    #[test]
    fn the_max_th_arrival_completes_the_round_at_once() {
        let t0 = Instant::now();
        let (mut j, step) = join(7, t0);
        assert_eq!(step, Step::Arrive { round: 7 });
        assert_eq!(
            j.on(Event::Arrived { index: 4 }, t0),
            Step::Announce {
                marks_min: true,
                completes_with: Some(4)
            }
        );
        // It marked `min` itself: no wait for it.
        assert_eq!(
            j.on(Event::Announced, t0),
            Step::WaitComplete {
                until: t0 + 100 * MS
            }
        );
        assert_eq!(
            j.on(Event::Completed { members: 4 }, t0),
            Step::Member {
                round: 7,
                index: 4,
                members: 4
            }
        );
    }

    #[test]
    fn the_last_call_is_cut_short_by_the_join_deadline() {
        let t0 = Instant::now();
        let (mut j, _) = join(0, t0);
        j.on(Event::Arrived { index: 2 }, t0);
        j.on(Event::Announced, t0);
        // Min reached 950 ms in: the last call would end at 1050 ms, the deadline is 1000.
        assert_eq!(
            j.on(Event::MinReached, t0 + 950 * MS),
            Step::WaitComplete {
                until: t0 + 1000 * MS
            }
        );
        assert_eq!(
            j.on(Event::LastCallEnded { arrivals: 3 }, t0 + 1000 * MS),
            Step::Complete { members: 3 }
        );
        assert_eq!(
            j.on(Event::Completed { members: 3 }, t0 + 1000 * MS),
            Step::Member {
                round: 0,
                index: 2,
                members: 3
            }
        );
    }

    #[test]
    fn too_few_nodes_time_out_in_their_round() {
        let t0 = Instant::now();
        let (mut j, _) = join(3, t0);
        j.on(Event::Arrived { index: 1 }, t0);
        assert_eq!(
            j.on(Event::Announced, t0),
            Step::WaitMin {
                until: Some(t0 + 1000 * MS)
            }
        );
        assert_eq!(
            j.on(Event::TimedOut, t0 + 1000 * MS),
            Step::Fail(JoinFailure::Timeout { round: 3 })
        );
    }

    #[test]
    fn a_late_node_counts_as_waiting_and_joins_the_next_round_with_its_deadline() {
        let t0 = Instant::now();
        let (mut j, _) = join(0, t0);
        j.on(Event::Arrived { index: 4 }, t0);
        j.on(Event::Announced, t0);
        j.on(Event::MinReached, t0);
        // The round completed with 3 < max: this node waits and asks to grow.
        assert_eq!(
            j.on(Event::Completed { members: 3 }, t0),
            Step::CountWaiting
        );
        assert_eq!(
            j.on(Event::Counted, t0),
            Step::WaitReform {
                until: Some(t0 + 1000 * MS)
            }
        );
        assert_eq!(
            j.on(Event::Reformed, t0 + 500 * MS),
            Step::Arrive { round: 1 }
        );
        assert_eq!(
            j.deadline(),
            Some(t0 + 1000 * MS),
            "the deadline still runs"
        );
    }

    #[test]
    fn a_spare_waits_without_deadline_and_exits_gracefully_on_close() {
        let t0 = Instant::now();
        let (mut j, _) = join(0, t0);
        j.on(Event::Arrived { index: 5 }, t0);
        j.on(Event::Announced, t0);
        j.on(Event::MinReached, t0);
        assert_eq!(
            j.on(Event::Completed { members: 4 }, t0),
            Step::WaitReform { until: None }
        );
        assert_eq!(j.deadline(), None);
        // Re-formed a day later: a fresh join timeout for the next round.
        let later = t0 + Duration::from_secs(86_400);
        assert_eq!(j.on(Event::Reformed, later), Step::Arrive { round: 1 });
        assert_eq!(j.deadline(), Some(later + 1000 * MS));
        // Still a spare there; then the run closes.
        j.on(Event::Arrived { index: 6 }, later);
        j.on(Event::Announced, later);
        j.on(Event::MinReached, later);
        assert_eq!(
            j.on(Event::Completed { members: 4 }, later),
            Step::WaitReform { until: None }
        );
        assert_eq!(
            j.on(Event::Closed, later),
            Step::Fail(JoinFailure::GracefulExit)
        );
    }

    #[test]
    fn a_member_of_a_closed_round_is_closed() {
        let t0 = Instant::now();
        let (mut j, _) = join(0, t0);
        j.on(Event::Arrived { index: 1 }, t0);
        j.on(Event::Announced, t0);
        j.on(Event::MinReached, t0);
        assert_eq!(
            j.on(Event::Completed { members: 0 }, t0),
            Step::Fail(JoinFailure::Closed)
        );
        let (mut j, _) = join(0, t0);
        assert_eq!(j.on(Event::Closed, t0), Step::Fail(JoinFailure::Closed));
    }

    #[test]
    fn a_waiting_node_gives_up_at_its_join_deadline() {
        let t0 = Instant::now();
        let (mut j, _) = join(0, t0);
        j.on(Event::Arrived { index: 4 }, t0);
        j.on(Event::Announced, t0);
        j.on(Event::MinReached, t0);
        j.on(Event::Completed { members: 3 }, t0);
        j.on(Event::Counted, t0);
        assert_eq!(
            j.on(Event::TimedOut, t0 + 1000 * MS),
            Step::Fail(JoinFailure::Timeout { round: 0 })
        );
    }

    #[test]
    fn an_abandoned_round_moves_every_member_to_the_next_with_its_deadline() {
        let t0 = Instant::now();
        let (mut j, _) = join(3, t0);
        j.on(Event::Arrived { index: 2 }, t0);
        j.on(Event::Announced, t0);
        j.on(Event::MinReached, t0);
        assert!(matches!(
            j.on(Event::Completed { members: 3 }, t0),
            Step::Member { round: 3, .. }
        ));
        assert_eq!(
            j.on(Event::Abandoned, t0 + 200 * MS),
            Step::Arrive { round: 4 }
        );
        assert_eq!(j.deadline(), Some(t0 + 1000 * MS));
    }
}
