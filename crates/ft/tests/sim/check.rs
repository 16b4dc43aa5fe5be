//! The simulator's invariants, checked as the events happen (see the
//! module docs of `tests/sim.rs` for what each says).

use std::collections::BTreeMap;

use rallypoint_ft::round;
use rallypoint_lighthouse::machine::Session;
use rallypoint_lighthouse::proto::Quorum;

use super::world::{Phase, Sabotage, Sim, EPOCH_MS};

/// The invariants, numbered as in the module docs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Invariant {
    /// 1: one quorum id, one view of it.
    SameQuorum,
    /// 2: a call is answered at most once.
    AnsweredOnce,
    /// 3: the lighthouse is called only when all W ranks called.
    AllRanksCalled,
    /// 4: participants enter an allreduce in the same state; commits at
    /// the same step in the same line are the same state.
    SameState,
    /// 5: a stop fails the waiting calls and closes the session first.
    StopCloses,
    /// 6: every live group commits again within the bound.
    Liveness,
}

/// A broken invariant and what showed it.
#[derive(Debug)]
pub struct Broken {
    pub invariant: Invariant,
    pub what: String,
}

impl Sim {
    pub fn broken<T>(&self, invariant: Invariant, what: String) -> Result<T, Broken> {
        Err(Broken {
            invariant,
            what: format!("at {} ms: {what}", self.t),
        })
    }

    /// Breaks the manager's actions on purpose (the sabotage tests).
    pub fn sabotage_actions(&mut self, stop: bool, actions: &mut Vec<round::Action>) {
        match self.sabotage {
            Sabotage::ShiftedReplicaRank => {
                for a in actions.iter_mut() {
                    if let round::Action::AnswerQuorum { rank: 1, result } = a {
                        result.replica_rank = (result.replica_rank + 1) % result.replica_world_size;
                    }
                }
            }
            Sabotage::AnswerTwice => {
                let twice: Vec<round::Action> = actions
                    .iter()
                    .filter(|a| matches!(a, round::Action::AnswerQuorum { .. }))
                    .cloned()
                    .collect();
                actions.extend(twice);
            }
            Sabotage::StopKeepsConnection if stop => {
                actions.retain(|a| !matches!(a, round::Action::DropConnection { .. }));
            }
            Sabotage::StopKeepsCalls if stop => {
                actions.retain(|a| !matches!(a, round::Action::Fail { .. }));
            }
            _ => {}
        }
    }

    /// Invariants 1 to 3 on the round's actions.
    pub fn check_actions(&mut self, g: usize, actions: &[round::Action]) -> Result<(), Broken> {
        for a in actions {
            let rank = match a {
                round::Action::AnswerQuorum { rank, .. }
                | round::Action::AnswerCommit { rank, .. }
                | round::Action::Fail { rank, .. } => *rank,
                round::Action::CallLighthouse { call, .. } => {
                    self.check_all_called(g, *call)?;
                    continue;
                }
                _ => continue,
            };
            if self.groups[g].pending.remove(&rank).is_none() {
                return self.broken(
                    Invariant::AnsweredOnce,
                    format!("g{g} answered rank {rank} with {a:?}, but no call of that rank waits (answered already)"),
                );
            }
            if let round::Action::AnswerQuorum { rank, result } = a {
                self.check_result(g, *rank, result)?;
            }
        }
        Ok(())
    }

    /// Invariant 3: every one of the W ranks waits in a quorum call.
    fn check_all_called(&self, g: usize, call: u64) -> Result<(), Broken> {
        let grp = &self.groups[g];
        let missing: Vec<usize> = (0..self.sc.ranks)
            .filter(|r| {
                grp.pending.get(r) != Some(&"quorum") || grp.workers[*r].phase != Phase::InQuorum
            })
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        self.broken(
            Invariant::AllRanksCalled,
            format!("g{g} made lighthouse call {call} while ranks {missing:?} had not called quorum in this round"),
        )
    }

    /// Invariant 1: one view of a quorum id, consistent with the group.
    fn check_result(
        &mut self,
        g: usize,
        rank: usize,
        res: &rallypoint_ft::results::QuorumResult,
    ) -> Result<(), Broken> {
        let q = res.quorum_id;
        let qs = q - EPOCH_MS;
        let ids = &res.replica_ids;
        let me = &self.groups[g].id;
        let bad = if ids.get(res.replica_rank as usize) != Some(me) {
            Some(format!(
                "replica rank {} names {:?}, not this group",
                res.replica_rank,
                ids.get(res.replica_rank as usize)
            ))
        } else if res.replica_world_size as usize != ids.len() {
            Some(format!(
                "replica world size {} for {} participants",
                res.replica_world_size,
                ids.len()
            ))
        } else if self.issued.get(&q) != Some(ids) {
            Some(format!(
                "participants {ids:?}, the lighthouse issued {:?}",
                self.issued.get(&q)
            ))
        } else {
            self.told
                .get(&q)
                .filter(|s| *s != ids)
                .map(|seen| format!("participants {ids:?}, another rank was told {seen:?}"))
        };
        if let Some(bad) = bad {
            return self.broken(
                Invariant::SameQuorum,
                format!("g{g} rank {rank}'s answer for quorum {qs}: {bad}"),
            );
        }
        self.told.insert(q, ids.clone());
        Ok(())
    }

    /// Invariant 5, right after a stop.
    pub fn check_stopped(&mut self, g: usize) -> Result<(), Broken> {
        let grp = &self.groups[g];
        if !grp.pending.is_empty() {
            let left = grp.pending.clone();
            return self.broken(
                Invariant::StopCloses,
                format!("g{g} stopped with calls still waiting: {left:?}"),
            );
        }
        if let Some(s) = grp.session {
            return self.broken(
                Invariant::StopCloses,
                format!("g{g} stopped but its lighthouse session s{s} stays open"),
            );
        }
        self.groups[g].stop_mark = self.last_session();
        Ok(())
    }

    /// Invariant 5: no call over a session open at a stop.
    pub fn check_join(&self, g: usize, session: Session) -> Result<(), Broken> {
        let mark = self.groups[g].stop_mark;
        if session <= mark {
            return self.broken(
                Invariant::StopCloses,
                format!("g{g} called the lighthouse over s{session}, a session open when the group stopped (up to s{mark})"),
            );
        }
        Ok(())
    }

    /// Records an issued quorum; forgets commits above its max step (the
    /// groups that made them are not in it: their line is lost).
    pub fn check_issue(&mut self, q: &Quorum, ids: &[String]) -> Result<(), Broken> {
        self.issued.insert(q.quorum_id, ids.to_vec());
        let max = q.participants.iter().map(|m| m.step).max().unwrap_or(0);
        let before = self.committed.len();
        self.committed.retain(|(_, step, _), _| *step <= max);
        if self.committed.len() < before {
            self.lost_history += 1;
        }
        Ok(())
    }

    /// Invariant 4 at an issue: the premise of the lines. Two workers of
    /// one group rank waiting in this quorum at the same step with the
    /// same known line hold the same state (`rallypoint_ft::results`
    /// heals nobody between them).
    pub fn check_lines(&self, q: &Quorum) -> Result<(), Broken> {
        let mut seen: BTreeMap<(usize, i64, i64), (usize, u64)> = BTreeMap::new();
        for m in &q.participants {
            let g: usize = m.replica_id.parse().expect("group ids are numbers");
            for (r, w) in self.groups[g].workers.iter().enumerate() {
                let Some(line) = w.line.filter(|_| w.phase == Phase::InQuorum) else {
                    continue;
                };
                match seen.get(&(r, w.step, line)) {
                    Some(&(other, state)) if state != w.state => {
                        return self.broken(
                            Invariant::SameState,
                            format!(
                                "quorum {}: g{other} and g{g} rank {r} at step {} in line {} hold states {:x} and {:x}",
                                q.quorum_id - EPOCH_MS,
                                w.step,
                                line - EPOCH_MS,
                                state & 0xffff,
                                w.state & 0xffff
                            ),
                        );
                    }
                    _ => {
                        seen.insert((r, w.step, line), (g, w.state));
                    }
                }
            }
        }
        Ok(())
    }

    /// Invariant 4 at an allreduce: every participant is in one state.
    pub fn check_allreduce(
        &self,
        (q, _, r): (i64, i64, usize),
        arrived: &[(usize, (u64, i64, u64))],
    ) -> Result<(), Broken> {
        let first = arrived[0].1;
        if arrived
            .iter()
            .all(|(_, v)| (v.1, v.2) == (first.1, first.2))
        {
            return Ok(());
        }
        let all: Vec<String> = arrived
            .iter()
            .map(|(g, v)| format!("g{g} step {} state {:x}", v.1, v.2 & 0xffff))
            .collect();
        self.broken(
            Invariant::SameState,
            format!(
                "rank {r}'s allreduce of quorum {}: participants in different states: {all:?}",
                q - EPOCH_MS
            ),
        )
    }

    /// Invariant 4 at a commit: the same step in the same line (the
    /// quorum it was made in), the same state. Two lines may commit one
    /// step (a quorum formed without the groups ahead, or a group alone
    /// under `min_replicas` 1); where they meet, the later one's state is
    /// the one taken (`rallypoint_ft::results`), which the allreduce check
    /// sees.
    pub fn committed_at(
        &mut self,
        (g, r): (usize, usize),
        step: i64,
        line: i64,
        state: u64,
    ) -> Result<(), Broken> {
        self.log(|| {
            format!(
                "g{g}r{r} committed step {step} in quorum {}",
                line - EPOCH_MS
            )
        });
        match self.committed.get(&(r, step, line)) {
            Some(s) if *s != state => self.broken(
                Invariant::SameState,
                format!(
                    "g{g} rank {r} committed step {step} in quorum {} in state {:x}, another group in {:x}",
                    line - EPOCH_MS,
                    state & 0xffff,
                    s & 0xffff
                ),
            ),
            _ => {
                self.committed.insert((r, step, line), state);
                Ok(())
            }
        }
    }

    /// Invariant 6, at the end.
    pub fn liveness(&mut self) -> Result<(), Broken> {
        let (from, to) = (self.settled, self.settled + self.sc.bound());
        for g in 0..self.groups.len() {
            let first = self.groups[g]
                .commits
                .iter()
                .find(|t| (from..=to).contains(*t));
            match first {
                Some(t) => self.slowest = self.slowest.max(t - from),
                None => {
                    return Err(Broken {
                        invariant: Invariant::Liveness,
                        what: format!(
                            "g{g} committed nothing from {from} ms (the last fault settled) to {to} ms (the bound)"
                        ),
                    })
                }
            }
        }
        Ok(())
    }

    fn last_session(&self) -> Session {
        self.next_session_peek() - 1
    }
}
