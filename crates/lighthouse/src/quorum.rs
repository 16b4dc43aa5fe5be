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
//! 2. **shrink_only**: if any healthy participant asked for it, the
//!    candidates are only the healthy participants that were in the previous
//!    quorum (joiners keep waiting).
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
//! One deliberate difference: torchft checks `min_replicas` against the
//! healthy participants but then issues the candidates, which `shrink_only`
//! may have cut below `min_replicas`; here the candidates must reach
//! `min_replicas` too, so no quorum is ever smaller than `min_replicas`. A
//! fast quorum holds every member of the previous one, so it is never
//! smaller than the previous quorum.
//!
//! The quorum id ([`next_id`]) rises when the members (by replica id) differ
//! from the previous quorum's or when any member reports
//! `commit_failures > 0`; otherwise the quorum keeps its id (torchft's
//! `_quorum_tick`).

use std::collections::{BTreeMap, BTreeSet};
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

/// What [`compute`] looks at besides the previous quorum.
#[derive(Clone, Debug, Default)]
pub struct Roster {
    /// The replicas waiting for a quorum, by replica id.
    pub participants: BTreeMap<String, Participant>,
    /// The last time each replica was heard from (a join counts).
    pub heartbeats: BTreeMap<String, Instant>,
}

impl Roster {
    /// Whether `replica_id` was heard from less than `timeout` before `now`.
    pub fn healthy(&self, replica_id: &str, now: Instant, timeout: Duration) -> bool {
        self.heartbeats
            .get(replica_id)
            .is_some_and(|t| now.saturating_duration_since(*t) < timeout)
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
    /// Whether a healthy participant asked for shrink_only.
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
    let healthy = roster
        .heartbeats
        .values()
        .filter(|t| now.saturating_duration_since(**t) < timeout)
        .count();
    // BTreeMap order: sorted by replica id, as torchft sorts its candidates.
    let joined: Vec<&Participant> = roster
        .participants
        .iter()
        .filter(|(id, _)| roster.healthy(id, now, timeout))
        .map(|(_, p)| p)
        .collect();
    let census = Census {
        healthy_participants: joined.len(),
        participants: roster.participants.len(),
        healthy,
        shrink_only: joined.iter().any(|p| p.member.shrink_only),
    };
    // The earliest moment a healthy replica that has not joined goes silent.
    let straggler_expiry = || {
        roster
            .heartbeats
            .iter()
            .filter(|(id, _)| !roster.participants.contains_key(*id))
            .map(|(_, t)| *t + timeout)
            .filter(|t| *t > now)
            .min()
    };

    let mut candidates: Vec<&Participant> = joined.clone();
    if let Some(prev) = prev {
        let prev_ids: BTreeSet<&str> = prev
            .participants
            .iter()
            .map(|m| m.replica_id.as_str())
            .collect();
        if census.shrink_only {
            candidates.retain(|p| prev_ids.contains(p.member.replica_id.as_str()));
        }
        let fast = prev_ids
            .iter()
            .all(|id| roster.participants.contains_key(*id) && roster.healthy(id, now, timeout));
        if fast {
            return Verdict::Issue {
                members: candidates.iter().map(|p| p.member.clone()).collect(),
                fast: true,
                census,
            };
        }
    }

    let have = candidates.len();
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
    if rules.majority_guard && joined.len() <= healthy / 2 {
        return Verdict::Wait {
            why: Why::Minority {
                have: joined.len(),
                healthy,
            },
            census,
            until: straggler_expiry(),
        };
    }
    if joined.len() < healthy {
        let first = joined.iter().map(|p| p.joined).min().unwrap_or(now);
        let until = first + knobs.join_timeout;
        if now < until {
            return Verdict::Wait {
                why: Why::Stragglers {
                    waiting_for: healthy - joined.len(),
                    until,
                },
                census,
                until: Some(straggler_expiry().map_or(until, |t| t.min(until))),
            };
        }
    }
    Verdict::Issue {
        members: candidates.iter().map(|p| p.member.clone()).collect(),
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
mod tests;
