//! torchft's quorum rules as a pure function: who is in the next quorum, or
//! why there is none yet and when to look again.
//!
//! This is torchft's `quorum_compute` (`src/lighthouse.rs`), written anew
//! over the same facts and knobs so that a job behaves the same under either
//! lighthouse. The inputs are a [`Roster`] (the replicas waiting in a
//! `Quorum` call, torchft's `participants`, and the last time each replica
//! was heard from, torchft's `heartbeats`), the previous quorum and the
//! [`Knobs`]. [`compute`] decides, in torchft's order:
//!
//! 1. **Healthy** replicas are those heard from less than
//!    `heartbeat_timeout` ago; healthy participants are the participants
//!    among them. Unhealthy participants count for nothing.
//! 2. **shrink_only**: if any healthy participant of the previous quorum
//!    asked for it, the candidates are only the healthy participants that
//!    were in the previous quorum (joiners keep waiting), unless those are
//!    fewer than `min_replicas`.
//! 3. **Fast quorum**: if every member of the previous quorum is a healthy
//!    participant again, the candidates are issued at once, without the
//!    checks below and without waiting for stragglers (joiners that are
//!    already waiting come in with them).
//! 4. **min_replicas**: fewer healthy participants than `min_replicas`: wait.
//! 5. **The majority guard against split brain**: the healthy participants
//!    must be more than half of all healthy replicas (`participants >
//!    healthy / 2`, torchft's integer division), so that replicas which
//!    heartbeat but have not joined can never be outvoted by a minority.
//! 6. **join_timeout**: if some healthy replica has not joined, wait for it
//!    until `join_timeout` after the first participant joined; then issue
//!    the candidates without it.
//!
//! Two deliberate differences, both found by our simulator as livelocks
//! of torchft's rules under a `shrink_only` call that keeps waiting:
//!
//! * torchft honours `shrink_only` from any participant, so a replica
//!   outside the previous quorum that asks for it keeps itself and every
//!   other joiner out for as long as its call waits; here only members of
//!   the previous quorum can shrink it.
//! * torchft checks `min_replicas` against the healthy participants but
//!   issues the candidates, which `shrink_only` may have cut below
//!   `min_replicas`; here a `shrink_only` that would cut the candidates
//!   below `min_replicas` is ignored (a quorum below `min_replicas` is never
//!   issued, and refusing one would wait forever on the call that asked).
//!
//! A fast quorum holds every member of the previous one, so it is never
//! smaller than the previous quorum.
//!
//! The quorum id ([`next_id`]) rises when the members (by replica id) differ
//! from the previous quorum's or when any member reports
//! `commit_failures > 0`; otherwise the quorum keeps its id (torchft's
//! `_quorum_tick`).

use std::collections::BTreeMap;
use std::fmt;
use std::time::{Duration, Instant, SystemTime};

/// A replica group as it asks for a quorum (torchft's `QuorumMember`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    /// Unique per replica process (torchft appends a uuid at each start).
    pub replica_id: String,
    /// Its manager's address.
    pub address: String,
    /// Its store's address.
    pub store_address: String,
    /// The step it is at.
    pub step: i64,
    /// Ranks in the replica group.
    pub world_size: u64,
    /// Asks that no new replica join this quorum.
    pub shrink_only: bool,
    /// Commits that failed since its last successful one.
    pub commit_failures: i64,
    /// Opaque data the manager passes along.
    pub data: String,
}

/// A quorum as issued.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Quorum {
    /// Rises with every change of membership or a reported commit failure.
    pub id: i64,
    /// Sorted by replica id.
    pub participants: Vec<Member>,
    /// When it was issued (informational).
    pub created: SystemTime,
}

/// The lighthouse's knobs, torchft's names (`torchft_lighthouse --min_replicas
/// ... --join_timeout_ms ... --quorum_tick_ms ... --heartbeat_timeout_ms`).
#[derive(Clone, Debug)]
pub struct Knobs {
    /// The fewest replicas a quorum may have.
    pub min_replicas: u64,
    /// How long a valid quorum waits for healthy replicas that have not
    /// joined, from the first participant's join.
    pub join_timeout: Duration,
    /// How often the service looks again while waiting.
    pub quorum_tick: Duration,
    /// How long a replica may be silent before it is not healthy.
    pub heartbeat_timeout: Duration,
}

impl Knobs {
    /// Our defaults: torchft's join timeout (60 s) and tick (100 ms), and a
    /// 1 s heartbeat timeout, since torchft's managers heartbeat every 100 ms
    /// and a closed connection is noticed at once anyway.
    pub fn ours(min_replicas: u64) -> Knobs {
        Knobs {
            min_replicas,
            join_timeout: Duration::from_secs(60),
            quorum_tick: Duration::from_millis(100),
            heartbeat_timeout: Duration::from_secs(1),
        }
    }

    /// torchft's defaults: 60 s, 100 ms, 5 s.
    pub fn torchft(min_replicas: u64) -> Knobs {
        Knobs {
            heartbeat_timeout: Duration::from_secs(5),
            ..Knobs::ours(min_replicas)
        }
    }
}

/// A replica waiting in a `Quorum` call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Participant {
    /// What it sent.
    pub member: Member,
    /// When it joined (or was last put back to wait).
    pub joined: Instant,
}

/// What the lighthouse knows of one replica.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Replica {
    /// The last time it was heard from (a heartbeat or a join; torchft's
    /// `heartbeats`).
    pub heard: Instant,
    /// Its waiting `Quorum` call, if any (torchft's `participants`).
    pub waiting: Option<Participant>,
}

/// What [`compute`] looks at besides the previous quorum: every replica
/// heard from, by replica id (one map, so that one pass sees everything).
#[derive(Clone, Debug, Default)]
pub struct Roster {
    pub replicas: BTreeMap<String, Replica>,
}

impl Roster {
    /// Notes that `replica_id` was heard from at `now`.
    pub fn heard(&mut self, replica_id: &str, now: Instant) {
        match self.replicas.get_mut(replica_id) {
            Some(r) => r.heard = now,
            None => {
                self.replicas.insert(
                    replica_id.to_owned(),
                    Replica {
                        heard: now,
                        waiting: None,
                    },
                );
            }
        }
    }

    /// `member` asks for a quorum at `now` (also a heartbeat).
    pub fn join(&mut self, member: Member, now: Instant) {
        let r = self
            .replicas
            .entry(member.replica_id.clone())
            .or_insert(Replica {
                heard: now,
                waiting: None,
            });
        r.heard = now;
        r.waiting = Some(Participant {
            member,
            joined: now,
        });
    }

    /// Whether `replica_id` was heard from less than `timeout` before `now`.
    pub fn healthy(&self, replica_id: &str, now: Instant, timeout: Duration) -> bool {
        self.replicas
            .get(replica_id)
            .is_some_and(|r| now.saturating_duration_since(r.heard) < timeout)
    }

    /// The waiting calls, by replica id.
    pub fn waiting(&self) -> impl Iterator<Item = &Participant> {
        self.replicas.values().filter_map(|r| r.waiting.as_ref())
    }
}

/// The counts behind a verdict (torchft's `[a/b participants healthy][c
/// heartbeating][shrink_only=x]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Census {
    /// Participants that are healthy.
    pub healthy_participants: usize,
    /// All participants.
    pub participants: usize,
    /// Healthy replicas, joined or not.
    pub healthy: usize,
    /// Whether a healthy participant of the previous quorum asked for
    /// shrink_only.
    pub shrink_only: bool,
}

impl fmt::Display for Census {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "[{}/{} participants healthy][{} heartbeating][shrink_only={}]",
            self.healthy_participants, self.participants, self.healthy, self.shrink_only
        )
    }
}

/// Why no quorum can be issued yet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Why {
    /// Fewer candidates than `min_replicas`.
    BelowMin { have: usize, need: u64 },
    /// The healthy participants are not more than half the healthy replicas.
    Minority { have: usize, healthy: usize },
    /// A valid quorum waits for healthy replicas that have not joined, until
    /// the join timeout.
    Stragglers { waiting_for: usize, until: Instant },
}

/// [`compute`]'s answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Issue a quorum of these members, sorted by replica id.
    Issue {
        members: Vec<Member>,
        /// Whether it was a fast quorum (every previous member is back).
        fast: bool,
        census: Census,
    },
    /// No quorum yet.
    Wait {
        why: Why,
        census: Census,
        /// The earliest moment time alone could change the verdict (the join
        /// wait ends, a healthy replica that has not joined goes silent);
        /// `None` if only a new event can.
        until: Option<Instant>,
    },
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Verdict::Issue {
                fast: true, census, ..
            } => write!(f, "Fast quorum found! {census}"),
            Verdict::Issue { census, .. } => write!(f, "Valid quorum found {census}"),
            Verdict::Wait { why, census, .. } => match why {
                Why::BelowMin { have, need } => write!(
                    f,
                    "New quorum not ready, only have {have} participants, need min_replicas {need} {census}"
                ),
                Why::Minority { have, healthy } => write!(
                    f,
                    "New quorum not ready, only have {have} participants, need at least half of {healthy} healthy workers {census}"
                ),
                Why::Stragglers { waiting_for, .. } => write!(
                    f,
                    "Valid quorum with {} participants, waiting for {waiting_for} healthy but not participating stragglers due to join timeout {census}",
                    census.healthy_participants
                ),
            },
        }
    }
}

/// Which of torchft's guards [`compute_with`] applies. Every rule is on in
/// [`Rules::ALL`]; switching one off exists only so that the simulator can
/// show that its invariants catch the broken rule.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rules {
    pub min_replicas: bool,
    pub majority_guard: bool,
}

impl Rules {
    pub const ALL: Rules = Rules {
        min_replicas: true,
        majority_guard: true,
    };
}

/// torchft's `quorum_compute` (see the module docs): the next quorum's
/// members, or why there is none yet.
pub fn compute(now: Instant, roster: &Roster, prev: Option<&Quorum>, knobs: &Knobs) -> Verdict {
    compute_with(now, roster, prev, knobs, Rules::ALL)
}

/// [`compute`] with some rules switched off (for the simulator's sabotage).
#[doc(hidden)]
pub fn compute_with(
    now: Instant,
    roster: &Roster,
    prev: Option<&Quorum>,
    knobs: &Knobs,
    rules: Rules,
) -> Verdict {
    let timeout = knobs.heartbeat_timeout;
    let healthy = |r: &Replica| now.saturating_duration_since(r.heard) < timeout;
    // One pass: the counts, the first join, and the moment the first healthy
    // replica that has not joined goes silent.
    let mut census = Census {
        healthy_participants: 0,
        participants: 0,
        healthy: 0,
        shrink_only: false,
    };
    let in_prev = |id: &str| {
        prev.is_some_and(|q| {
            q.participants
                .binary_search_by(|m| m.replica_id.as_str().cmp(id))
                .is_ok()
        })
    };
    let mut first_joined: Option<Instant> = None;
    let mut straggler_expiry: Option<Instant> = None;
    for r in roster.replicas.values() {
        census.participants += usize::from(r.waiting.is_some());
        if !healthy(r) {
            continue;
        }
        census.healthy += 1;
        match &r.waiting {
            Some(p) => {
                census.healthy_participants += 1;
                census.shrink_only |= p.member.shrink_only && in_prev(&p.member.replica_id);
                first_joined = Some(first_joined.map_or(p.joined, |t| t.min(p.joined)));
            }
            None => {
                let t = r.heard + timeout;
                straggler_expiry = Some(straggler_expiry.map_or(t, |s| s.min(t)));
            }
        }
    }
    let is_back = |m: &Member| {
        roster
            .replicas
            .get(&m.replica_id)
            .is_some_and(|r| r.waiting.is_some() && healthy(r))
    };
    // shrink_only keeps the candidates to the previous quorum's members that
    // are back, unless they are fewer than min_replicas: then no quorum
    // could be issued for as long as the call that asked waits, and the
    // request is ignored.
    let back = |q: &Quorum| q.participants.iter().filter(|m| is_back(m)).count();
    let shrink_to = prev.filter(|q| census.shrink_only && back(q) as u64 >= knobs.min_replicas);
    // The candidates: the healthy participants, sorted by replica id as
    // torchft sorts them (the map's order); with shrink_only, only those of
    // the previous quorum.
    let candidates = || -> Vec<Member> {
        let of_prev = |id: &str| shrink_to.is_none() || in_prev(id);
        roster
            .replicas
            .values()
            .filter(|r| healthy(r))
            .filter_map(|r| r.waiting.as_ref())
            .filter(|p| of_prev(&p.member.replica_id))
            .map(|p| p.member.clone())
            .collect()
    };

    if let Some(prev) = prev {
        // Counting first spares the look-ups while members are still coming
        // back (a round of n joins would otherwise look up n²/2 members).
        let enough = census.healthy_participants >= prev.participants.len();
        if enough && prev.participants.iter().all(is_back) {
            return Verdict::Issue {
                members: candidates(),
                fast: true,
                census,
            };
        }
    }

    let have = shrink_to.map_or(census.healthy_participants, back);
    if rules.min_replicas && (have as u64) < knobs.min_replicas {
        return Verdict::Wait {
            why: Why::BelowMin {
                have,
                need: knobs.min_replicas,
            },
            census,
            until: None,
        };
    }
    let joined = census.healthy_participants;
    if rules.majority_guard && joined <= census.healthy / 2 {
        return Verdict::Wait {
            why: Why::Minority {
                have: joined,
                healthy: census.healthy,
            },
            census,
            until: straggler_expiry,
        };
    }
    if joined < census.healthy {
        let until = first_joined.unwrap_or(now) + knobs.join_timeout;
        if now < until {
            return Verdict::Wait {
                why: Why::Stragglers {
                    waiting_for: census.healthy - joined,
                    until,
                },
                census,
                until: Some(straggler_expiry.map_or(until, |t| t.min(until))),
            };
        }
    }
    Verdict::Issue {
        members: candidates(),
        fast: false,
        census,
    }
}

/// Whether `members` differ from the previous quorum's by replica id
/// (torchft's `quorum_changed`; a change of address or step is not one).
pub fn changed(prev: Option<&Quorum>, members: &[Member]) -> bool {
    prev.is_none_or(|q| {
        q.participants.len() != members.len()
            || q.participants
                .iter()
                .zip(members)
                .any(|(a, b)| a.replica_id != b.replica_id)
    })
}

/// The id of a quorum of `members` after `prev`, the last id issued being
/// `last_id`: one more if the membership changed or a member reports a commit
/// failure, else the same.
pub fn next_id(last_id: i64, prev: Option<&Quorum>, members: &[Member]) -> i64 {
    if changed(prev, members) || members.iter().any(|m| m.commit_failures > 0) {
        last_id + 1
    } else {
        last_id
    }
}

#[cfg(test)]
#[path = "quorum/tests.rs"]
pub(crate) mod tests;
