//! The round of one replica group, as a state machine: events in, actions
//! out. No I/O and no clock: the server feeds [`Round::handle`] what
//! happened with the time it happened, carries out the [`Action`]s, and
//! sends a [`Event::Tick`] at [`Round::next_deadline`].
//!
//! * **Hello**: a connection claims a group rank. It is refused if the
//!   rank is out of range, held by a live connection, or the world size it
//!   names is not the manager's. The first accepted hello while the
//!   lighthouse connection is down asks for one ([`Action::Connect`]).
//! * **Quorum**: each rank's call waits; when all W ranks have called (and
//!   no lighthouse call is in flight), one lighthouse call is made
//!   ([`Action::CallLighthouse`]) for the group: its step, any
//!   `shrink_only`, the max of the commit failures, the ranks' metadata
//!   and steps in `data`; its step is the ranks' (the lowest when they
//!   differ: see [`crate::results`]). Its answer gives each waiting rank its own result
//!   ([`crate::results::compute`]); its failure fails them. A call's
//!   answer that comes after the round was stopped is ignored (calls are
//!   numbered), and it answers only the ranks' calls it was made for: a
//!   rank whose call timed out and that called again waits for the next
//!   lighthouse call, made once the one in flight ends.
//! * **should_commit**: a barrier of the W ranks for one step; the
//!   decision is the AND of the votes. Votes for different steps, or from
//!   states of different lines (a heal loaded on some ranks only), fail
//!   every voter, naming them. A rank that calls quorum has left its
//!   step: the votes still waiting fail at once, and a vote while ranks
//!   wait in quorum fails at once, so ranks split between the two
//!   barriers (one stalled past a deadline) meet in the next quorum
//!   instead of timing out on each other forever (found by
//!   `tests/sim.rs`).
//! * **Deadlines**: a quorum call past its deadline fails naming what it
//!   waited for: the group ranks that never called, or the lighthouse and
//!   its address; a vote past its deadline fails naming the ranks that
//!   never voted.
//! * **Stop**: a rank whose connection ended ([`Event::RankGone`]) or the
//!   agent's [`Event::WorkersStopped`] fails every waiting call with the
//!   reason and drops the lighthouse connection at once
//!   ([`Action::DropConnection`]), so the lighthouse drops this group from
//!   the quorum and tells the survivors; the next hello reconnects. A
//!   `WorkersStopped` also releases every rank: the stopped workers' calls
//!   (they may still run until the agent's signal lands) are refused, so
//!   the dying group never rejoins the quorum, and the new workers' hellos
//!   are welcome at once, before the old connections end.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use rallypoint_lighthouse::proto::{Quorum, QuorumMember};

use crate::results::{self, QuorumResult};

/// A group rank (0..W).
pub type Rank = usize;

/// The longest wait a call may ask for (a longer `timeout_ms` is cut to
/// it): a week.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(7 * 24 * 3600);

/// What the round needs to know of its manager.
#[derive(Clone, Debug)]
pub struct Setup {
    pub replica_id: String,
    /// The manager's `host:port` (its `QuorumMember.address`).
    pub address: String,
    /// The manager's store `host:port`.
    pub store_address: String,
    /// The lighthouse's address, for errors.
    pub lighthouse: String,
    /// W, the group's number of ranks.
    pub world_size: usize,
}

/// One rank's `quorum` call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuorumCall {
    pub step: i64,
    pub metadata: String,
    pub shrink_only: bool,
    pub init_sync: bool,
    pub commit_failures: i64,
    pub timeout: Duration,
    /// The line of the rank's state (see [`crate::results`]).
    pub line: Option<i64>,
}

/// What happened.
#[derive(Clone, Debug)]
pub enum Event {
    /// A connection's `hello`.
    Hello { rank: u64, world_size: u64 },
    /// The connection of a rank that said hello ended.
    RankGone { rank: Rank },
    /// A rank's `quorum` call, made at `now`.
    Quorum {
        rank: Rank,
        call: QuorumCall,
        now: Instant,
    },
    /// The lighthouse answered call number `call`.
    LighthouseAnswered { call: u64, quorum: Quorum },
    /// Lighthouse call number `call` failed (after its retries).
    LighthouseFailed { call: u64, error: String },
    /// A rank's `should_commit` vote, made at `now`.
    Vote {
        rank: Rank,
        step: i64,
        /// The line of the state the rank votes from.
        line: Option<i64>,
        vote: bool,
        timeout: Duration,
        now: Instant,
    },
    /// Time passed.
    Tick { now: Instant },
    /// The agent says the group's workers stopped.
    WorkersStopped { reason: String },
    /// The group's number of ranks changed (for the next hellos).
    SetWorldSize(usize),
}

/// What to do.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Accept the hello.
    Welcome { rank: Rank },
    /// Refuse the hello with this error.
    HelloRefused { error: String },
    /// (Re)connect to the lighthouse and heartbeat.
    Connect,
    /// Ask the lighthouse for a quorum with this member, until `deadline`.
    CallLighthouse {
        call: u64,
        member: QuorumMember,
        deadline: Instant,
    },
    /// Answer rank's `quorum` call.
    AnswerQuorum { rank: Rank, result: QuorumResult },
    /// Answer rank's `should_commit` call.
    AnswerCommit { rank: Rank, commit: bool },
    /// Fail rank's waiting call with this error.
    Fail { rank: Rank, error: String },
    /// Close the lighthouse connection at once and stop heartbeating.
    DropConnection { reason: String },
}

#[derive(Clone, Debug)]
struct Waiting {
    call: QuorumCall,
    deadline: Instant,
    /// Which of the rank's calls this is (a lighthouse call answers only
    /// the calls it was made for).
    seq: u64,
}

#[derive(Clone, Debug)]
struct Ballot {
    step: i64,
    line: Option<i64>,
    vote: bool,
    timeout: Duration,
    deadline: Instant,
}

#[derive(Clone, Debug)]
struct InFlight {
    id: u64,
    /// The ranks' calls it was made for: (rank, call seq).
    ranks: BTreeMap<Rank, u64>,
}

/// The round's state.
#[derive(Debug)]
pub struct Round {
    setup: Setup,
    held: BTreeSet<Rank>,
    connected: bool,
    waiting: BTreeMap<Rank, Waiting>,
    in_flight: Option<InFlight>,
    calls: u64,
    /// Numbers the ranks' quorum calls.
    seq: u64,
    ballots: BTreeMap<Rank, Ballot>,
}

impl Round {
    /// A round with no rank and no lighthouse connection.
    pub fn new(setup: Setup) -> Round {
        Round {
            setup,
            held: BTreeSet::new(),
            connected: false,
            waiting: BTreeMap::new(),
            in_flight: None,
            calls: 0,
            seq: 0,
            ballots: BTreeMap::new(),
        }
    }

    /// The setup (with the current world size).
    pub fn setup(&self) -> &Setup {
        &self.setup
    }

    /// Whether lighthouse call `call` is the one in flight: an answer to
    /// any other is stale (the round was stopped, or the call's ranks
    /// moved on) and is ignored.
    pub fn awaits(&self, call: u64) -> bool {
        self.in_flight.as_ref().is_some_and(|f| f.id == call)
    }

    /// When the next [`Event::Tick`] is due, if any call waits.
    pub fn next_deadline(&self) -> Option<Instant> {
        let q = self.waiting.values().map(|w| w.deadline);
        let v = self.ballots.values().map(|b| b.deadline);
        q.chain(v).min()
    }

    /// Handles one event; the actions to carry out, in order.
    pub fn handle(&mut self, event: Event) -> Vec<Action> {
        let mut out = Vec::new();
        match event {
            Event::Hello { rank, world_size } => self.hello(rank, world_size, &mut out),
            Event::RankGone { rank } => {
                if self.held.remove(&rank) {
                    let why = format!("group rank {rank}'s connection to the manager ended");
                    self.stop(&why, &mut out);
                }
            }
            Event::Quorum { rank, call, now } => self.quorum(rank, call, now, &mut out),
            Event::LighthouseAnswered { call, quorum } => {
                for (rank, w) in self.take_in_flight(call) {
                    out.push(self.result(rank, &w, &quorum));
                }
                self.call_if_ready(&mut out);
            }
            Event::LighthouseFailed { call, error } => {
                for (rank, _) in self.take_in_flight(call) {
                    let error = error.clone();
                    out.push(Action::Fail { rank, error });
                }
                self.call_if_ready(&mut out);
            }
            Event::Vote {
                rank,
                step,
                line,
                vote,
                timeout,
                now,
            } => self.vote(rank, (step, line), vote, timeout, now, &mut out),
            Event::Tick { now } => self.tick(now, &mut out),
            Event::WorkersStopped { reason } => {
                self.stop(&reason, &mut out);
                self.held.clear();
            }
            Event::SetWorldSize(n) => self.setup.world_size = n,
        }
        out
    }

    fn hello(&mut self, rank: u64, world_size: u64, out: &mut Vec<Action>) {
        let w = self.setup.world_size;
        let error = if world_size != w as u64 {
            format!(
                "this replica group has {w} ranks; the hello names group_world_size {world_size}"
            )
        } else if rank >= w as u64 {
            format!("group rank {rank} is out of range: this replica group has {w} ranks")
        } else if self.held.contains(&(rank as Rank)) {
            format!("group rank {rank} is already held by a live connection to this manager")
        } else {
            self.held.insert(rank as Rank);
            out.push(Action::Welcome { rank: rank as Rank });
            if !self.connected {
                self.connected = true;
                out.push(Action::Connect);
            }
            return;
        };
        out.push(Action::HelloRefused { error });
    }

    fn quorum(&mut self, rank: Rank, call: QuorumCall, now: Instant, out: &mut Vec<Action>) {
        if let Some(error) = self.refuse_call(rank, self.waiting.contains_key(&rank), "quorum") {
            out.push(Action::Fail { rank, error });
            return;
        }
        // This rank left its step: the votes still waiting for that step
        // can never be matched (else the ranks, split between the two
        // barriers, time out waiting for each other forever).
        for (r, b) in std::mem::take(&mut self.ballots) {
            let error = format!(
                "should_commit (step {}) failed: group ranks [{rank}] left step {} (called quorum)",
                b.step, b.step
            );
            out.push(Action::Fail { rank: r, error });
        }
        let deadline = now + call.timeout.min(MAX_TIMEOUT);
        self.seq += 1;
        let seq = self.seq;
        self.waiting.insert(
            rank,
            Waiting {
                call,
                deadline,
                seq,
            },
        );
        self.call_if_ready(out);
    }

    /// Makes the group's lighthouse call once every rank's call waits and
    /// none is in flight.
    fn call_if_ready(&mut self, out: &mut Vec<Action>) {
        if self.in_flight.is_some() || self.waiting.len() < self.setup.world_size {
            return;
        }
        let member = self.member();
        let deadline = self.waiting.values().map(|w| w.deadline).min();
        let deadline = deadline.expect("W > 0 calls wait");
        self.calls += 1;
        self.in_flight = Some(InFlight {
            id: self.calls,
            ranks: self.waiting.iter().map(|(r, w)| (*r, w.seq)).collect(),
        });
        if !self.connected {
            self.connected = true;
            out.push(Action::Connect);
        }
        out.push(Action::CallLighthouse {
            call: self.calls,
            member,
            deadline,
        });
    }

    /// Why a rank's call is refused: it never said hello, or it already
    /// has a call of this kind waiting.
    fn refuse_call(&self, rank: Rank, busy: bool, op: &str) -> Option<String> {
        if !self.held.contains(&rank) {
            Some(format!("group rank {rank} called {op} without a hello"))
        } else if busy {
            Some(format!("group rank {rank} already has a {op} call waiting"))
        } else {
            None
        }
    }

    /// The group's member for the lighthouse, from every waiting call.
    fn member(&self) -> QuorumMember {
        let calls = || self.waiting.values().map(|w| &w.call);
        let metadata: Vec<String> = calls().map(|c| c.metadata.clone()).collect();
        let steps: Vec<i64> = calls().map(|c| c.step).collect();
        let lines: Vec<Option<i64>> = calls().map(|c| c.line).collect();
        QuorumMember {
            replica_id: self.setup.replica_id.clone(),
            address: self.setup.address.clone(),
            store_address: self.setup.store_address.clone(),
            step: results::member_step(&steps),
            world_size: self.setup.world_size as u64,
            shrink_only: calls().any(|c| c.shrink_only),
            commit_failures: calls().map(|c| c.commit_failures).max().unwrap_or(0),
            data: results::member_data(&metadata, &steps, &lines),
        }
    }

    /// Ends lighthouse call `call` if it is the one in flight: the calls
    /// it was made for that still wait (a rank that timed out and called
    /// again waits in a new call, which this answer is not for).
    fn take_in_flight(&mut self, call: u64) -> Vec<(Rank, Waiting)> {
        let Some(f) = self.in_flight.take_if(|f| f.id == call) else {
            return Vec::new();
        };
        let mut mine = Vec::new();
        for (rank, seq) in f.ranks {
            if self.waiting.get(&rank).is_some_and(|w| w.seq == seq) {
                mine.push((rank, self.waiting.remove(&rank).expect("waits")));
            }
        }
        mine
    }

    fn result(&self, rank: Rank, w: &Waiting, quorum: &Quorum) -> Action {
        let id = &self.setup.replica_id;
        match results::compute(id, rank, quorum, w.call.init_sync) {
            Ok(result) => Action::AnswerQuorum { rank, result },
            Err(e) => Action::Fail {
                rank,
                error: format!("the lighthouse's quorum {}: {e}", quorum.quorum_id),
            },
        }
    }

    fn vote(
        &mut self,
        rank: Rank,
        (step, line): (i64, Option<i64>),
        vote: bool,
        timeout: Duration,
        now: Instant,
        out: &mut Vec<Action>,
    ) {
        let busy = self.ballots.contains_key(&rank);
        if let Some(error) = self.refuse_call(rank, busy, "should_commit") {
            out.push(Action::Fail { rank, error });
            return;
        }
        if !self.waiting.is_empty() {
            // Ranks already left this step for the next quorum: this vote
            // can never be matched; its rank follows them into the quorum.
            let ahead: Vec<Rank> = self.waiting.keys().copied().collect();
            let error = format!(
                "should_commit (step {step}) failed: group ranks {ahead:?} already wait in quorum (they left the step)"
            );
            out.push(Action::Fail { rank, error });
            return;
        }
        let deadline = now + timeout.min(MAX_TIMEOUT);
        let b = Ballot {
            step,
            line,
            vote,
            timeout,
            deadline,
        };
        self.ballots.insert(rank, b);
        if self.ballots.len() < self.setup.world_size {
            return;
        }
        let ballots = std::mem::take(&mut self.ballots);
        let steps: BTreeSet<i64> = ballots.values().map(|b| b.step).collect();
        let lines: BTreeSet<Option<i64>> = ballots.values().map(|b| b.line).collect();
        let commit = ballots.values().all(|b| b.vote);
        for (&rank, _) in ballots.iter() {
            if steps.len() == 1 && lines.len() == 1 {
                out.push(Action::AnswerCommit { rank, commit });
            } else if steps.len() > 1 {
                let by_rank: Vec<(Rank, i64)> = ballots.iter().map(|(&r, b)| (r, b.step)).collect();
                let error =
                    format!("should_commit: the group ranks voted on different steps (rank, step): {by_rank:?}");
                out.push(Action::Fail { rank, error });
            } else {
                let by_rank: Vec<(Rank, Option<i64>)> =
                    ballots.iter().map(|(&r, b)| (r, b.line)).collect();
                let error = format!(
                    "should_commit: the group ranks voted from states of different lines (a heal loaded on some ranks only) (rank, line): {by_rank:?}"
                );
                out.push(Action::Fail { rank, error });
            }
        }
    }

    fn tick(&mut self, now: Instant, out: &mut Vec<Action>) {
        let late: Vec<Rank> = self
            .waiting
            .iter()
            .filter(|(_, w)| w.deadline <= now)
            .map(|(&r, _)| r)
            .collect();
        for rank in late {
            let w = self.waiting.remove(&rank).expect("late");
            let in_call = self
                .in_flight
                .as_ref()
                .is_some_and(|f| f.ranks.get(&rank) == Some(&w.seq));
            let waited = if in_call {
                format!(
                    "the lighthouse at {} to issue a quorum",
                    self.setup.lighthouse
                )
            } else {
                let never: Vec<Rank> = (0..self.setup.world_size)
                    .filter(|r| *r != rank && !self.waiting.contains_key(r))
                    .collect();
                format!("group ranks {never:?} to call quorum")
            };
            let error = format!(
                "quorum (step {}) timed out after {:?} waiting for {waited}",
                w.call.step, w.call.timeout
            );
            out.push(Action::Fail { rank, error });
        }
        let late: Vec<Rank> = self
            .ballots
            .iter()
            .filter(|(_, b)| b.deadline <= now)
            .map(|(&r, _)| r)
            .collect();
        for rank in late {
            let b = self.ballots.remove(&rank).expect("late");
            let never: Vec<Rank> = (0..self.setup.world_size)
                .filter(|r| *r != rank && !self.ballots.contains_key(r))
                .collect();
            let error = format!(
                "should_commit (step {}) timed out after {:?}: group ranks {never:?} never voted",
                b.step, b.timeout
            );
            out.push(Action::Fail { rank, error });
        }
    }

    fn stop(&mut self, reason: &str, out: &mut Vec<Action>) {
        for rank in std::mem::take(&mut self.waiting).into_keys() {
            let error = format!("quorum stopped: {reason}");
            out.push(Action::Fail { rank, error });
        }
        for rank in std::mem::take(&mut self.ballots).into_keys() {
            let error = format!("should_commit stopped: {reason}");
            out.push(Action::Fail { rank, error });
        }
        self.in_flight = None;
        if self.connected {
            self.connected = false;
            let reason = reason.to_owned();
            out.push(Action::DropConnection { reason });
        }
    }
}

#[cfg(test)]
#[path = "round/tests.rs"]
mod tests;
