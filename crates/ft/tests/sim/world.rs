//! The simulated job: N groups, each its manager's [`Round`] and W
//! workers, and one lighthouse [`Lighthouse`] machine, on a simulated
//! clock (ms) with a queue of events. It carries out the round's and the
//! lighthouse's actions as `server.rs`, `lighthouse.rs` and the lighthouse
//! service do, and the workers' decisions as the Python `Manager` does.
//! The checks are in `check.rs`.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap};
use std::time::{Duration, Instant};

use rallypoint_ft::results::QuorumResult;
use rallypoint_ft::round::{self, QuorumCall, Round, Setup};
use rallypoint_lighthouse::machine::{self as lhm, Lighthouse, Session};
use rallypoint_lighthouse::proto::{Quorum, QuorumMember};
use rallypoint_lighthouse::quorum::{self as lq, Member};

use super::check::{Broken, Invariant};
use super::scenario::{Fault, Rng, Scenario, BACKOFF_MS, BEAT_MS, FORGET_MS};

/// A rule broken on purpose, so that a test can show an invariant
/// catches it. Each breaks the manager (its actions, as `server.rs` would
/// carry them out) or a worker's decision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sabotage {
    None,
    /// Invariant 1: group rank 1's answers name the next replica rank.
    ShiftedReplicaRank,
    /// Invariant 2: every quorum answer is sent twice.
    AnswerTwice,
    /// Invariant 3: the manager believes its group has one rank fewer.
    WorldSizeShort,
    /// Invariant 4: a worker told to heal does not.
    SkipHeal,
    /// Invariant 4: workers call quorum with `init_sync: false`.
    NoInitSync,
    /// Invariant 5: a stop keeps the lighthouse connection.
    StopKeepsConnection,
    /// Invariant 5: a stop leaves the waiting calls waiting.
    StopKeepsCalls,
    /// Invariant 6: a failed lighthouse call is never reported to the
    /// round (the call task's result is lost).
    LoseCallFailure,
    /// Invariant 4: the groups' lines are taken out of their members'
    /// data, so two histories at one step look like one (torchft's rule).
    NoLine,
}

/// Where a worker is in its loop.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Phase {
    Dead,
    /// Its quorum call waits.
    InQuorum,
    /// Reading the source's checkpoint, until the deadline.
    Healing {
        until: u64,
    },
    Computing,
    /// In the allreduce of quorum `q`.
    Allreduce {
        q: i64,
    },
    /// Its should_commit vote waits.
    Voting,
}

/// A worker process (group rank `r` of its group).
#[derive(Clone, Debug)]
pub struct Worker {
    pub phase: Phase,
    pub step: i64,
    /// A hash of its model's state.
    pub state: u64,
    /// The quorum its state was committed in (the `Manager`'s line,
    /// carried by heals), if known.
    pub line: Option<i64>,
    pub commit_failures: i64,
    /// The quorum of this step, once answered.
    pub cur: Option<QuorumResult>,
    /// Nothing failed in this step so far.
    pub ok: bool,
    /// The state after this step, once the allreduce is done.
    pub next_state: Option<u64>,
    /// A healed step, state and line, loaded only on a commit (the
    /// Python `Manager`'s `should_commit`): a heal that failed on another
    /// rank of the group is dropped on every rank.
    pub pending: Option<(i64, u64, Option<i64>)>,
    /// Counts this worker's allreduces: a timeout is for one of them.
    pub allreduces: u64,
    pub stalled_until: Option<u64>,
}

/// The manager's lighthouse call in flight.
#[derive(Clone, Debug)]
pub struct LhCall {
    pub id: u64,
    pub member: QuorumMember,
    /// The session its `Join` went over.
    pub joined_on: Option<Session>,
    /// The group's `forgotten` when its `Join` was sent: an answer to it
    /// after a forget is not remembered (as the client).
    pub forgotten: u64,
}

/// A replica group: its manager and workers.
pub struct Group {
    pub id: String,
    pub round: Round,
    pub workers: Vec<Worker>,
    /// Bumped at every restart of the workers.
    pub inc: u64,
    /// The manager's open lighthouse session.
    pub session: Option<Session>,
    /// A connection is wanted (between `Connect` and `DropConnection`).
    pub want_conn: bool,
    pub conn_gen: u64,
    pub backoff: u64,
    pub call: Option<LhCall>,
    /// Cut from the lighthouse until then.
    pub cut_until: Option<u64>,
    /// Messages held by the cut, either way.
    pub held: Vec<Ev>,
    /// The next answer of the lighthouse is delayed by / lost.
    pub delay_next: Option<u64>,
    pub lose_next: bool,
    /// The `Join` the lighthouse holds for this group: its session and
    /// the manager's call it came from (an issued quorum answers it).
    pub lh_join: Option<(Session, u64)>,
    /// Sessions up to this one were open at a stop: no call may use them.
    pub stop_mark: Session,
    /// Commits (ms) of group rank 0.
    pub commits: Vec<u64>,
    /// Ranks with a call waiting at the manager: (rank, kind).
    pub pending: BTreeMap<usize, &'static str>,
    /// A restart of the workers is scheduled.
    pub restarting: bool,
    /// The last quorum the manager's client was issued, sent with its
    /// `Join`s; forgotten as the client forgets it (a drop of the
    /// connection, a heartbeat without an answer).
    pub remembered: Option<lhm::Remembered>,
    /// When the current cut began.
    pub cut_started: u64,
    /// Counts the forgets of `remembered`.
    pub forgotten: u64,
}

/// Events of the simulation.
#[derive(Clone, Debug)]
pub enum Ev {
    Hello {
        g: usize,
        r: usize,
        inc: u64,
    },
    CallQuorum {
        g: usize,
        r: usize,
        inc: u64,
    },
    /// The manager's answer reaches the worker.
    Answer {
        g: usize,
        r: usize,
        inc: u64,
        ans: Ans,
    },
    HealTry {
        g: usize,
        r: usize,
        inc: u64,
    },
    Computed {
        g: usize,
        r: usize,
        inc: u64,
    },
    AllreduceDone {
        g: usize,
        r: usize,
        inc: u64,
        q: i64,
        ok: bool,
    },
    AllreduceTimeout {
        g: usize,
        r: usize,
        inc: u64,
        q: i64,
        /// The worker's allreduce it is for ([`Worker::allreduces`]).
        n: u64,
    },
    RoundTick {
        g: usize,
    },
    CallDeadline {
        g: usize,
        call: u64,
    },
    /// To the manager: the lighthouse's answer or refusal.
    LhAnswer {
        g: usize,
        call: u64,
        session: Session,
        quorum: Option<Quorum>,
        error: Option<String>,
    },
    /// To the lighthouse from a manager.
    ToLh {
        g: usize,
        ev: lhm::Event,
        /// The manager's call a `Join` carries.
        call: Option<u64>,
    },
    Dial {
        g: usize,
        gen: u64,
    },
    Beat {
        g: usize,
        session: Session,
    },
    /// A heartbeat sent at `sent` during a cut has had no answer for
    /// [`FORGET_MS`]: if that cut still lasts, the memory is forgotten.
    BeatUnanswered {
        g: usize,
        sent: u64,
    },
    LhTick {
        service: u64,
    },
    /// The lighthouse's next deadline (a tick that does not repeat).
    LhDeadline {
        service: u64,
    },
    LhUp,
    CutEnd {
        g: usize,
    },
    AgentStop {
        g: usize,
        inc: u64,
    },
    Restart {
        g: usize,
    },
    Resume {
        g: usize,
        r: usize,
        inc: u64,
    },
    Fault(usize),
}

#[derive(Clone, Debug)]
pub enum Ans {
    Quorum(QuorumResult),
    Commit(bool),
    Fail(String),
}

/// An allreduce of quorum `q` among group rank `r` of its participants.
#[derive(Debug, Default)]
pub struct Allreduce {
    pub participants: Vec<usize>,
    /// Who arrived: group -> (incarnation, step, state).
    pub arrived: BTreeMap<usize, (u64, i64, u64)>,
    pub over: bool,
}

/// Quorum ids in the trace are shown above this.
pub const EPOCH_MS: i64 = 1_800_000_000_000;

pub struct Sim {
    pub sc: Scenario,
    pub seed: u64,
    pub rng: Rng,
    pub sabotage: Sabotage,
    pub base: Instant,
    pub t: u64,
    seq: u64,
    queue: BinaryHeap<Reverse<(u64, u64)>>,
    events: HashMap<u64, Ev>,
    pub lh: Option<Lighthouse>,
    pub service: u64,
    next_session: Session,
    pub groups: Vec<Group>,
    /// By (quorum id, max step, group rank): a quorum id is issued again
    /// at every step while nothing changes.
    pub allreduces: BTreeMap<(i64, i64, usize), Allreduce>,
    /// Quorum ids the lighthouse aborted: their generation is dead, an
    /// allreduce in it fails at once (the process group heard the abort).
    pub aborted: BTreeSet<i64>,
    /// Issued quorums: id -> sorted replica ids (across restarts).
    pub issued: BTreeMap<i64, Vec<String>>,
    /// The participants the first rank answered within a quorum id was
    /// told.
    pub told: BTreeMap<i64, Vec<String>>,
    /// Commits: (rank, step after, the quorum it was made in) -> state.
    pub committed: BTreeMap<(usize, i64, i64), u64>,
    pub fired: [u64; 7],
    round_ticks: BTreeSet<(usize, u64)>,
    lh_deadlines: BTreeSet<u64>,
    /// When the last fault settled.
    pub settled: u64,
    /// The longest a group took to commit after that (ms).
    pub slowest: u64,
    /// Lineages lost: quorums issued below an earlier commit's step.
    pub lost_history: u64,
    /// Lighthouses that a restart ended whose first quorum came on the
    /// managers' memory of the last one, before the startup grace.
    recalled: u64,
    /// The current lighthouse's `first_id`.
    lh_first: i64,
    /// Quorums below this id are dead to their watchers (a restarted
    /// lighthouse heard a manager's memory: `AbortPredecessor`).
    dead_below: i64,
    pub trace: Vec<String>,
    pub tracing: bool,
}

fn h(parts: &[u64]) -> u64 {
    let mut x = 0xcbf2_9ce4_8422_2325u64;
    for p in parts {
        x ^= *p;
        x = x.wrapping_mul(0x1000_0000_01b3);
        x ^= x >> 29;
    }
    x
}

fn to_member(m: QuorumMember) -> Member {
    Member {
        replica_id: m.replica_id,
        address: m.address,
        store_address: m.store_address,
        step: m.step,
        world_size: m.world_size,
        shrink_only: m.shrink_only,
        commit_failures: m.commit_failures,
        data: m.data,
    }
}

fn to_proto(q: lq::Quorum) -> Quorum {
    let participants = q.participants.into_iter().map(|m| QuorumMember {
        replica_id: m.replica_id,
        address: m.address,
        store_address: m.store_address,
        step: m.step,
        world_size: m.world_size,
        shrink_only: m.shrink_only,
        commit_failures: m.commit_failures,
        data: m.data,
    });
    Quorum {
        quorum_id: q.id,
        participants: participants.collect(),
        created: None,
    }
}

impl Sim {
    pub fn new(seed: u64, sabotage: Sabotage, tracing: bool) -> Sim {
        let sc = Scenario::draw(seed);
        let mut sim = Sim {
            seed,
            rng: Rng(seed ^ 0x5a5a_0f0f),
            sabotage,
            base: Instant::now(),
            t: 0,
            seq: 0,
            queue: BinaryHeap::new(),
            events: HashMap::new(),
            lh: None,
            service: 0,
            next_session: 1,
            groups: Vec::new(),
            allreduces: BTreeMap::new(),
            aborted: BTreeSet::new(),
            issued: BTreeMap::new(),
            told: BTreeMap::new(),
            committed: BTreeMap::new(),
            fired: [0; 7],
            round_ticks: BTreeSet::new(),
            lh_deadlines: BTreeSet::new(),
            settled: 0,
            slowest: 0,
            lost_history: 0,
            recalled: 0,
            lh_first: 0,
            dead_below: 0,
            trace: Vec::new(),
            tracing,
            sc,
        };
        sim.lh_up();
        for g in 0..sim.sc.groups {
            let id = g.to_string();
            let setup = Setup {
                replica_id: id.clone(),
                address: format!("manager-{g}:1"),
                store_address: format!("store-{g}:2"),
                lighthouse: "http://lighthouse:29510".into(),
                world_size: sim.sc.ranks,
            };
            sim.groups.push(Group {
                id,
                round: Round::new(setup),
                workers: Vec::new(),
                inc: 0,
                session: None,
                want_conn: false,
                conn_gen: 0,
                backoff: 100,
                call: None,
                cut_until: None,
                held: Vec::new(),
                delay_next: None,
                lose_next: false,
                lh_join: None,
                stop_mark: 0,
                commits: Vec::new(),
                pending: BTreeMap::new(),
                restarting: false,
                remembered: None,
                cut_started: 0,
                forgotten: 0,
            });
            sim.start_workers(g);
        }
        for i in 0..sim.sc.faults.len() {
            sim.at(sim.sc.faults[i].at, Ev::Fault(i));
        }
        sim
    }

    pub fn at(&mut self, t: u64, ev: Ev) {
        self.seq += 1;
        self.queue.push(Reverse((t, self.seq)));
        self.events.insert(self.seq, ev);
    }

    pub fn log(&mut self, line: impl FnOnce() -> String) {
        if self.tracing {
            let line = line();
            self.trace.push(format!("{:>6} ms  {line}", self.t));
        }
    }

    /// Lighthouses whose first quorum came on the managers' memory of the
    /// last one, before the startup grace.
    pub fn recalled(&self) -> u64 {
        let now = self.now();
        self.recalled
            + self
                .lh
                .as_ref()
                .map_or(0, |l| l.status(now).counters.recalled)
    }

    pub fn now(&self) -> Instant {
        self.base + Duration::from_millis(self.t)
    }

    fn ms(&self, i: Instant) -> u64 {
        let d = i.saturating_duration_since(self.base);
        d.as_millis() as u64 + u64::from(!d.subsec_nanos().is_multiple_of(1_000_000))
    }

    /// Runs to the end; the first broken invariant.
    pub fn run(&mut self) -> Result<(), Broken> {
        let end = self.sc.faults.iter().map(|f| f.at).max().unwrap_or(0) + 3_000;
        while let Some(Reverse((t, seq))) = self.queue.pop() {
            let ev = self.events.remove(&seq).expect("queued");
            let pending = self.lh.is_none() || self.groups.iter().any(|g| g.restarting);
            if !pending && t > end && t > self.settled + self.sc.bound() + 200 {
                break;
            }
            self.t = t;
            self.step(ev)?;
        }
        self.liveness()
    }

    fn step(&mut self, ev: Ev) -> Result<(), Broken> {
        match ev {
            Ev::Hello { g, r, inc } => self.hello(g, r, inc),
            Ev::CallQuorum { g, r, inc } => {
                if self.worker_ready(g, r, inc, &Ev::CallQuorum { g, r, inc }) {
                    self.call_quorum(g, r)?;
                }
                Ok(())
            }
            ev @ (Ev::Answer { .. }
            | Ev::HealTry { .. }
            | Ev::Computed { .. }
            | Ev::AllreduceDone { .. }
            | Ev::AllreduceTimeout { .. }) => self.worker_event(ev),
            Ev::RoundTick { g } => {
                self.round_ticks
                    .retain(|(gg, t)| !(*gg == g && *t <= self.t));
                let now = self.now();
                self.feed(g, round::Event::Tick { now })
            }
            Ev::CallDeadline { g, call } => self.call_deadline(g, call),
            Ev::LhAnswer {
                g,
                call,
                session,
                quorum,
                error,
            } => self.lh_answer(g, call, session, quorum, error),
            Ev::ToLh { g, ev, call } => self.send_lh_call(g, ev, call),
            Ev::Dial { g, gen } => self.dial(g, gen),
            Ev::Beat { g, session } => {
                if self.groups[g].session == Some(session) {
                    self.at(self.t + BEAT_MS, Ev::Beat { g, session });
                    if self.groups[g].cut_until.is_some() {
                        let sent = self.t;
                        self.at(self.t + FORGET_MS, Ev::BeatUnanswered { g, sent });
                    }
                    let replica_id = self.groups[g].id.clone();
                    self.send_lh(
                        g,
                        lhm::Event::Heartbeat {
                            session,
                            replica_id,
                        },
                    )?;
                }
                Ok(())
            }
            Ev::LhTick { service } => {
                if service == self.service && self.lh.is_some() {
                    self.at(self.t + 100, Ev::LhTick { service });
                    self.lh_send(lhm::Event::Tick)?;
                }
                Ok(())
            }
            Ev::LhDeadline { service } => {
                self.lh_deadlines.remove(&self.t);
                if service == self.service && self.lh.is_some() {
                    self.lh_send(lhm::Event::Tick)?;
                }
                Ok(())
            }
            Ev::LhUp => {
                self.lh_up();
                Ok(())
            }
            Ev::BeatUnanswered { g, sent } => {
                let grp = &mut self.groups[g];
                if grp.cut_until.is_some() && grp.cut_started <= sent && grp.remembered.is_some() {
                    grp.remembered = None;
                    grp.forgotten += 1;
                    self.log(|| format!("g{g} forgets its last quorum (a heartbeat unanswered)"));
                }
                Ok(())
            }
            Ev::CutEnd { g } => {
                self.groups[g].cut_until = None;
                for ev in std::mem::take(&mut self.groups[g].held) {
                    self.at(self.t, ev);
                }
                self.log(|| format!("g{g} cut healed"));
                Ok(())
            }
            Ev::AgentStop { g, inc } => self.agent_stop(g, inc, None),
            Ev::Restart { g } => {
                self.groups[g].restarting = false;
                self.start_workers(g);
                Ok(())
            }
            Ev::Resume { g, r, inc } => {
                if self.groups[g].inc == inc {
                    self.groups[g].workers[r].stalled_until = None;
                    self.log(|| format!("g{g}r{r} resumes"));
                }
                Ok(())
            }
            Ev::Fault(i) => self.fault(i),
        }
    }

    /// Whether the worker of `inc` is alive and running; a stalled one
    /// gets `ev` again when it resumes.
    fn worker_ready(&mut self, g: usize, r: usize, inc: u64, ev: &Ev) -> bool {
        if self.groups[g].inc != inc || self.groups[g].workers[r].phase == Phase::Dead {
            return false;
        }
        if let Some(until) = self.groups[g].workers[r].stalled_until {
            self.at(until, ev.clone());
            return false;
        }
        true
    }

    // ---- workers ----

    fn start_workers(&mut self, g: usize) {
        let grp = &mut self.groups[g];
        grp.inc += 1;
        let inc = grp.inc;
        let seed = self.seed;
        grp.workers = (0..self.sc.ranks)
            .map(|r| Worker {
                phase: Phase::Dead,
                step: 0,
                // A fresh process's random init.
                state: h(&[seed, g as u64, r as u64, inc]),
                line: None,
                commit_failures: 0,
                cur: None,
                ok: true,
                next_state: None,
                pending: None,
                allreduces: 0,
                stalled_until: None,
            })
            .collect();
        for r in 0..self.sc.ranks {
            let at = self.t + self.rng.range(0, 50);
            self.at(at, Ev::Hello { g, r, inc });
        }
        self.log(|| format!("g{g} workers start (incarnation {inc})"));
    }

    fn hello(&mut self, g: usize, r: usize, inc: u64) -> Result<(), Broken> {
        // A worker the agent stopped before its hello was killed with the
        // others: its process says nothing more (found by the census: a
        // stopped incarnation's late hello made the next one's round
        // call the lighthouse one rank short, seeds 1482, 4095, 5149).
        if self.groups[g].inc != inc || self.groups[g].restarting {
            return Ok(());
        }
        let ev = round::Event::Hello {
            rank: r as u64,
            world_size: self.sc.ranks as u64,
        };
        let actions = self.round_handle(g, ev, false)?;
        let mut welcomed = false;
        for a in &actions {
            match a {
                round::Action::Welcome { .. } => welcomed = true,
                round::Action::HelloRefused { error } => {
                    let e = error.clone();
                    self.log(|| format!("g{g}r{r} hello refused: {e}"));
                }
                _ => {}
            }
        }
        self.act(g, actions)?;
        if welcomed {
            self.groups[g].workers[r].phase = Phase::Computing;
            if self.sabotage == Sabotage::WorldSizeShort && self.sc.ranks > 1 {
                let all = self.groups[g]
                    .workers
                    .iter()
                    .all(|w| w.phase != Phase::Dead);
                if all {
                    let n = self.sc.ranks - 1;
                    self.round_handle(g, round::Event::SetWorldSize(n), false)?;
                }
            }
            self.at(self.t + 1, Ev::CallQuorum { g, r, inc });
        } else {
            self.at(self.t + 200, Ev::Hello { g, r, inc });
        }
        Ok(())
    }

    fn call_quorum(&mut self, g: usize, r: usize) -> Result<(), Broken> {
        let w = &mut self.groups[g].workers[r];
        w.phase = Phase::InQuorum;
        w.cur = None;
        w.ok = true;
        w.next_state = None;
        w.pending = None;
        let call = QuorumCall {
            step: w.step,
            metadata: format!("transport-{g}-{r}"),
            shrink_only: false,
            init_sync: self.sabotage != Sabotage::NoInitSync,
            commit_failures: w.commit_failures,
            timeout: Duration::from_millis(self.sc.timing.call),
            line: w.line,
        };
        self.groups[g].pending.insert(r, "quorum");
        let now = self.now();
        self.feed(g, round::Event::Quorum { rank: r, call, now })
    }

    fn vote(&mut self, g: usize, r: usize) -> Result<(), Broken> {
        let w = &mut self.groups[g].workers[r];
        w.phase = Phase::Voting;
        let (step, line) = w.pending.map_or((w.step, w.line), |p| (p.0, p.2));
        let vote = w.ok && w.next_state.is_some();
        self.groups[g].pending.insert(r, "should_commit");
        let now = self.now();
        let timeout = Duration::from_millis(self.sc.timing.call);
        self.feed(
            g,
            round::Event::Vote {
                rank: r,
                step,
                line,
                vote,
                timeout,
                now,
            },
        )
    }

    fn worker_event(&mut self, ev: Ev) -> Result<(), Broken> {
        let (g, r, inc) = match &ev {
            Ev::Answer { g, r, inc, .. }
            | Ev::HealTry { g, r, inc }
            | Ev::Computed { g, r, inc }
            | Ev::AllreduceDone { g, r, inc, .. }
            | Ev::AllreduceTimeout { g, r, inc, .. } => (*g, *r, *inc),
            _ => unreachable!("a worker's event"),
        };
        if !self.worker_ready(g, r, inc, &ev) {
            return Ok(());
        }
        let t = self.sc.timing;
        match ev {
            Ev::Answer { ans, .. } => self.answered(g, r, inc, ans),
            Ev::HealTry { .. } => self.heal_try(g, r, inc),
            Ev::Computed { .. } => {
                if self.groups[g].workers[r].phase != Phase::Computing {
                    return Ok(());
                }
                let q = self.groups[g].workers[r]
                    .cur
                    .as_ref()
                    .expect("answered")
                    .quorum_id;
                let w = &mut self.groups[g].workers[r];
                w.phase = Phase::Allreduce { q };
                w.allreduces += 1;
                let n = w.allreduces;
                self.at(
                    self.t + t.allreduce,
                    Ev::AllreduceTimeout { g, r, inc, q, n },
                );
                self.arrive(g, r, q)
            }
            Ev::AllreduceDone { q, ok, .. } => self.allreduce_over(g, r, q, ok),
            Ev::AllreduceTimeout { q, n, .. } => {
                let w = &self.groups[g].workers[r];
                if w.phase != (Phase::Allreduce { q }) || w.allreduces != n {
                    return Ok(()); // a timer of an allreduce that ended
                }
                // As a real collective: one participant giving up fails it
                // for all (a late peer must not complete it afterwards and
                // hand the others a result of a step they have left).
                let max_step = w.cur.as_ref().map(|c| c.max_step);
                self.fail_allreduces(|k, _| (k.0, Some(k.1), k.2) == (q, max_step, r));
                self.allreduce_over(g, r, q, false)
            }
            _ => unreachable!("a worker's event"),
        }
    }

    fn allreduce_over(&mut self, g: usize, r: usize, q: i64, ok: bool) -> Result<(), Broken> {
        if self.groups[g].workers[r].phase != (Phase::Allreduce { q }) {
            return Ok(());
        }
        if !ok {
            self.groups[g].workers[r].ok = false;
            self.log(|| format!("g{g}r{r} allreduce of {} failed", q - EPOCH_MS));
        }
        self.vote(g, r)
    }

    fn answered(&mut self, g: usize, r: usize, inc: u64, ans: Ans) -> Result<(), Broken> {
        let phase = self.groups[g].workers[r].phase.clone();
        let t = self.sc.timing;
        match (phase, ans) {
            (Phase::InQuorum, Ans::Quorum(res)) => {
                let heal = res.heal && self.sabotage != Sabotage::SkipHeal;
                self.groups[g].workers[r].cur = Some(res);
                if heal {
                    let until = self.t + t.call;
                    self.groups[g].workers[r].phase = Phase::Healing { until };
                    self.at(self.t + t.heal, Ev::HealTry { g, r, inc });
                } else {
                    self.compute(g, r, inc);
                }
                Ok(())
            }
            (Phase::InQuorum, Ans::Fail(e)) => {
                self.log(|| format!("g{g}r{r} quorum failed: {e}"));
                self.groups[g].workers[r].ok = false;
                self.vote(g, r)
            }
            (Phase::Voting, Ans::Commit(c)) => {
                let w = &mut self.groups[g].workers[r];
                let pending = w.pending.take();
                match w.next_state.filter(|_| c) {
                    Some(state) => {
                        // A heal is loaded on the commit only.
                        w.step = pending.map_or(w.step, |p| p.0) + 1;
                        w.state = state;
                        w.commit_failures = 0;
                        let step = w.step;
                        let line = w.cur.as_ref().expect("answered").quorum_id;
                        w.line = Some(line);
                        self.committed_at((g, r), step, line, state)?;
                    }
                    None => w.commit_failures += 1,
                }
                self.at(self.t + 1, Ev::CallQuorum { g, r, inc });
                Ok(())
            }
            (Phase::Voting, Ans::Fail(e)) => {
                self.log(|| format!("g{g}r{r} should_commit failed: {e}"));
                self.groups[g].workers[r].commit_failures += 1;
                self.at(self.t + 1, Ev::CallQuorum { g, r, inc });
                Ok(())
            }
            (phase, ans) => self.broken(
                Invariant::AnsweredOnce,
                format!("g{g}r{r} in {phase:?} got {ans:?}, which answers no call of its"),
            ),
        }
    }

    fn compute(&mut self, g: usize, r: usize, inc: u64) {
        let (lo, hi) = self.sc.timing.step;
        self.groups[g].workers[r].phase = Phase::Computing;
        let at = self.t + self.rng.range(lo, hi);
        self.at(at, Ev::Computed { g, r, inc });
    }

    /// Reads the source's checkpoint: its worker of the same group rank
    /// must be alive, in the same quorum and at the quorum's max step.
    fn heal_try(&mut self, g: usize, r: usize, inc: u64) -> Result<(), Broken> {
        let Phase::Healing { until } = self.groups[g].workers[r].phase else {
            return Ok(());
        };
        let res = self.groups[g].workers[r].cur.clone().expect("answered");
        let src = res.recover_src_replica_rank.expect("heals") as usize;
        let sg: usize = res.replica_ids[src].parse().expect("group ids are numbers");
        let sw = &self.groups[sg].workers[r];
        let ready = sw.phase != Phase::Dead
            && sw
                .cur
                .as_ref()
                .is_some_and(|c| c.quorum_id == res.quorum_id)
            && sw.step == res.max_step;
        if ready {
            let (step, state) = (sw.step, sw.state);
            let line = sw.line;
            self.groups[g].workers[r].pending = Some((step, state, line));
            self.log(|| format!("g{g}r{r} healed from g{sg} to step {step}"));
            self.compute(g, r, inc);
            Ok(())
        } else if self.t < until {
            self.at(self.t + 50, Ev::HealTry { g, r, inc });
            Ok(())
        } else {
            self.log(|| format!("g{g}r{r} heal from g{sg} timed out"));
            self.groups[g].workers[r].ok = false;
            self.vote(g, r)
        }
    }

    /// Group `g`'s rank `r` arrives at quorum `q`'s allreduce.
    fn arrive(&mut self, g: usize, r: usize, q: i64) -> Result<(), Broken> {
        let w = &self.groups[g].workers[r];
        // A healing worker takes part as it will be once its heal loads.
        let (step, state, _) = w.pending.unwrap_or((w.step, w.state, w.line));
        let inc = self.groups[g].inc;
        let cur = w.cur.as_ref().expect("answered");
        let key = (q, cur.max_step, r);
        let participants: Vec<usize> = cur
            .replica_ids
            .iter()
            .map(|id| id.parse().expect("group ids are numbers"))
            .collect();
        let dead = self.aborted.contains(&q) || q < self.dead_below;
        let ar = self.allreduces.entry(key).or_default();
        if ar.over || dead {
            self.at(
                self.t,
                Ev::AllreduceDone {
                    g,
                    r,
                    inc,
                    q,
                    ok: false,
                },
            );
            return Ok(());
        }
        ar.participants = participants;
        ar.arrived.insert(g, (inc, step, state));
        if ar.arrived.len() < ar.participants.len() {
            return Ok(());
        }
        ar.over = true;
        let arrived: Vec<(usize, (u64, i64, u64))> =
            ar.arrived.iter().map(|(g, v)| (*g, *v)).collect();
        self.check_allreduce(key, &arrived)?;
        // The average depends on who took part (each group trains on its
        // own data): two quorums of different groups that commit a step
        // from one state commit two states.
        let who = arrived.iter().fold(0u64, |m, (pg, _)| m | 1 << pg);
        for (pg, (pinc, step, state)) in arrived {
            if self.groups[pg].inc == pinc {
                self.groups[pg].workers[r].next_state = Some(h(&[state, step as u64, who]));
            }
            self.at(
                self.t,
                Ev::AllreduceDone {
                    g: pg,
                    r,
                    inc: pinc,
                    q,
                    ok: true,
                },
            );
        }
        Ok(())
    }

    /// Fails the allreduces not over that `pred` selects (a participant
    /// died, the lighthouse aborted the quorum).
    fn fail_allreduces(&mut self, pred: impl Fn(&(i64, i64, usize), &Allreduce) -> bool) {
        let mut fail = Vec::new();
        for (key, ar) in self.allreduces.iter_mut() {
            if !ar.over && pred(key, ar) {
                ar.over = true;
                for (g, (inc, ..)) in &ar.arrived {
                    fail.push((*g, key.2, *inc, key.0));
                }
            }
        }
        for (g, r, inc, q) in fail {
            self.at(
                self.t,
                Ev::AllreduceDone {
                    g,
                    r,
                    inc,
                    q,
                    ok: false,
                },
            );
        }
    }

    // ---- faults and the agent ----

    fn fault(&mut self, i: usize) -> Result<(), Broken> {
        let f = self.sc.faults[i];
        let (g, r) = (f.group, f.rank);
        let settle = |sim: &mut Sim, at: u64| sim.settled = sim.settled.max(at);
        let restart = self.sc.timing.restart;
        let fired = match f.kind {
            Fault::Kill | Fault::Stop => {
                if self.groups[g].restarting {
                    false
                } else {
                    let inc = self.groups[g].inc;
                    if f.kind == Fault::Kill {
                        self.kill_worker(g, r)?;
                        self.at(self.t + 20, Ev::AgentStop { g, inc });
                    } else {
                        self.agent_stop(g, inc, Some("the agent stopped the workers"))?;
                    }
                    settle(self, self.t + 20 + restart + 50);
                    true
                }
            }
            Fault::Stall => {
                let inc = self.groups[g].inc;
                let w = &mut self.groups[g].workers[r];
                if w.phase == Phase::Dead || w.stalled_until.is_some() {
                    false
                } else {
                    w.stalled_until = Some(self.t + f.ms);
                    self.at(self.t + f.ms, Ev::Resume { g, r, inc });
                    settle(self, self.t + f.ms);
                    true
                }
            }
            Fault::Delay => {
                self.groups[g].delay_next = Some(f.ms);
                settle(self, self.t + f.ms);
                true
            }
            Fault::Lose => {
                self.groups[g].lose_next = true;
                settle(self, self.t);
                true
            }
            Fault::Restart => {
                if self.lh.is_none() {
                    false
                } else {
                    if let Some(old) = self.lh.take() {
                        self.recalled += old.status(self.now()).counters.recalled;
                    }
                    self.lh_deadlines.clear();
                    for grp in &mut self.groups {
                        grp.session = None;
                        if let Some(c) = grp.call.as_mut() {
                            c.joined_on = None;
                        }
                    }
                    for g in 0..self.groups.len() {
                        if self.groups[g].want_conn {
                            let gen = self.groups[g].conn_gen;
                            let at = self.t + self.groups[g].backoff;
                            self.at(at, Ev::Dial { g, gen });
                        }
                    }
                    self.at(self.t + f.ms, Ev::LhUp);
                    settle(self, self.t + f.ms);
                    true
                }
            }
            Fault::Cut => {
                if self.groups[g].cut_until.is_some() {
                    false
                } else {
                    self.groups[g].cut_until = Some(self.t + f.ms);
                    self.groups[g].cut_started = self.t;
                    self.at(self.t + f.ms, Ev::CutEnd { g });
                    settle(self, self.t + f.ms);
                    true
                }
            }
        };
        self.log(|| {
            format!(
                "FAULT {} g{g} r{r} {} ms{}",
                f.kind.name(),
                f.ms,
                if fired { "" } else { " (did not fire)" }
            )
        });
        if fired {
            self.fired[f.kind.index()] += 1;
        }
        Ok(())
    }

    fn kill_worker(&mut self, g: usize, r: usize) -> Result<(), Broken> {
        if self.groups[g].workers[r].phase == Phase::Dead {
            return Ok(());
        }
        self.groups[g].workers[r].phase = Phase::Dead;
        self.log(|| format!("g{g}r{r} dies"));
        // Its peers' collectives see its transport close.
        self.fail_allreduces(|key, ar| key.2 == r && ar.participants.contains(&g));
        self.stop_event(g, round::Event::RankGone { rank: r })
    }

    /// The agent stops the group's workers (saying so first when
    /// `reason`), and restarts them later.
    fn agent_stop(&mut self, g: usize, inc: u64, reason: Option<&str>) -> Result<(), Broken> {
        if self.groups[g].inc != inc || self.groups[g].restarting {
            return Ok(());
        }
        if let Some(reason) = reason {
            let ev = round::Event::WorkersStopped {
                reason: reason.into(),
            };
            self.stop_event(g, ev)?;
        }
        for r in 0..self.sc.ranks {
            self.kill_worker(g, r)?;
        }
        self.groups[g].restarting = true;
        self.at(self.t + self.sc.timing.restart, Ev::Restart { g });
        Ok(())
    }

    // ---- the manager ----

    /// Feeds the round and carries out its actions.
    pub fn feed(&mut self, g: usize, ev: round::Event) -> Result<(), Broken> {
        let actions = self.round_handle(g, ev, false)?;
        self.act(g, actions)
    }

    /// The round's actions for `ev` (sabotaged if asked), checked.
    pub fn round_handle(
        &mut self,
        g: usize,
        ev: round::Event,
        stop: bool,
    ) -> Result<Vec<round::Action>, Broken> {
        let short = if self.tracing {
            format!("{ev:?}")
        } else {
            String::new()
        };
        let mut actions = self.groups[g].round.handle(ev);
        self.sabotage_actions(stop, &mut actions);
        if let Some(d) = self.groups[g].round.next_deadline() {
            let at = self.ms(d);
            if self.round_ticks.insert((g, at)) {
                self.at(at, Ev::RoundTick { g });
            }
        }
        if self.tracing {
            let short: String = short.chars().take(120).collect();
            let acts: Vec<String> = actions
                .iter()
                .map(|a| format!("{a:?}").chars().take(100).collect())
                .collect();
            self.log(|| format!("g{g} round <- {short} -> {acts:?}"));
        }
        self.check_actions(g, &actions)?;
        Ok(actions)
    }

    /// A stop (a rank gone, the agent's call), checked for invariant 5.
    fn stop_event(&mut self, g: usize, ev: round::Event) -> Result<(), Broken> {
        let actions = self.round_handle(g, ev, true)?;
        self.act(g, actions)?;
        self.check_stopped(g)
    }

    fn act(&mut self, g: usize, actions: Vec<round::Action>) -> Result<(), Broken> {
        let inc = self.groups[g].inc;
        for a in actions {
            match a {
                round::Action::Welcome { .. } | round::Action::HelloRefused { .. } => {}
                round::Action::Connect => {
                    let grp = &mut self.groups[g];
                    grp.want_conn = true;
                    grp.conn_gen += 1;
                    grp.backoff = 100;
                    let gen = grp.conn_gen;
                    self.at(self.t + 1, Ev::Dial { g, gen });
                }
                round::Action::CallLighthouse {
                    call,
                    mut member,
                    deadline,
                } => {
                    if self.sabotage == Sabotage::NoLine {
                        let mut v: serde_json::Value =
                            serde_json::from_str(&member.data).expect("the round's json");
                        v.as_object_mut().expect("an object").remove("lines");
                        member.data = v.to_string();
                    }
                    let deadline = self.ms(deadline);
                    self.groups[g].call = Some(LhCall {
                        id: call,
                        member,
                        joined_on: None,
                        forgotten: 0,
                    });
                    self.at(deadline, Ev::CallDeadline { g, call });
                    self.join(g)?;
                }
                round::Action::AnswerQuorum { rank, result } => {
                    let ans = Ans::Quorum(result);
                    self.at(
                        self.t,
                        Ev::Answer {
                            g,
                            r: rank,
                            inc,
                            ans,
                        },
                    );
                }
                round::Action::AnswerCommit { rank, commit } => {
                    if commit && rank == 0 {
                        self.groups[g].commits.push(self.t);
                    }
                    let ans = Ans::Commit(commit);
                    self.at(
                        self.t,
                        Ev::Answer {
                            g,
                            r: rank,
                            inc,
                            ans,
                        },
                    );
                }
                round::Action::Fail { rank, error } => {
                    let ans = Ans::Fail(error);
                    self.at(
                        self.t,
                        Ev::Answer {
                            g,
                            r: rank,
                            inc,
                            ans,
                        },
                    );
                }
                round::Action::DropConnection { reason } => {
                    let grp = &mut self.groups[g];
                    grp.want_conn = false;
                    grp.conn_gen += 1;
                    grp.call = None;
                    grp.remembered = None;
                    grp.forgotten += 1;
                    if let Some(session) = grp.session.take() {
                        self.log(|| format!("g{g} drops s{session}: {reason}"));
                        self.send_lh(g, lhm::Event::Closed { session })?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Sends the call in flight over the open session, once.
    fn join(&mut self, g: usize) -> Result<(), Broken> {
        let grp = &mut self.groups[g];
        let (Some(session), Some(call)) = (grp.session, grp.call.as_mut()) else {
            return Ok(());
        };
        if call.joined_on == Some(session) {
            return Ok(());
        }
        call.joined_on = Some(session);
        call.forgotten = grp.forgotten;
        let (id, member) = (call.id, to_member(call.member.clone()));
        self.check_join(g, session)?;
        let remembered = self.groups[g].remembered.clone();
        let join = lhm::Event::Join {
            session,
            member,
            remembered,
        };
        self.send_lh_call(g, join, Some(id))
    }

    fn dial(&mut self, g: usize, gen: u64) -> Result<(), Broken> {
        let grp = &mut self.groups[g];
        if grp.conn_gen != gen || !grp.want_conn || grp.session.is_some() {
            return Ok(());
        }
        if self.lh.is_none() {
            grp.backoff = (grp.backoff * 2).min(BACKOFF_MS);
            let at = self.t + grp.backoff;
            self.at(at, Ev::Dial { g, gen });
            return Ok(());
        }
        if self.groups[g].cut_until.is_some() {
            // The dial cannot get through the cut: retried.
            let grp = &mut self.groups[g];
            grp.backoff = (grp.backoff * 2).min(BACKOFF_MS);
            let at = self.t + grp.backoff;
            self.at(at, Ev::Dial { g, gen });
            return Ok(());
        }
        let session = self.next_session;
        self.next_session += 1;
        let grp = &mut self.groups[g];
        grp.session = Some(session);
        grp.backoff = 100;
        self.log(|| format!("g{g} connected s{session}"));
        let replica_id = self.groups[g].id.clone();
        self.send_lh(
            g,
            lhm::Event::Heartbeat {
                session,
                replica_id,
            },
        )?;
        self.at(self.t + BEAT_MS, Ev::Beat { g, session });
        self.join(g)
    }

    /// The call's deadline: it fails, and the lighthouse hears it ended.
    fn call_deadline(&mut self, g: usize, call: u64) -> Result<(), Broken> {
        let Some(c) = self.groups[g].call.clone().filter(|c| c.id == call) else {
            return Ok(());
        };
        self.groups[g].call = None;
        if let Some(session) = c.joined_on.filter(|s| self.groups[g].session == Some(*s)) {
            let replica_id = self.groups[g].id.clone();
            self.send_lh(
                g,
                lhm::Event::Left {
                    session,
                    replica_id,
                },
            )?;
        }
        if self.sabotage == Sabotage::LoseCallFailure {
            return Ok(());
        }
        let error = "the lighthouse issued no quorum before the caller's deadline".to_string();
        self.feed(g, round::Event::LighthouseFailed { call, error })
    }

    fn lh_answer(
        &mut self,
        g: usize,
        call: u64,
        session: Session,
        quorum: Option<Quorum>,
        error: Option<String>,
    ) -> Result<(), Broken> {
        if self.groups[g].cut_until.is_some() {
            // Held by the cut, delivered when it heals.
            let ev = Ev::LhAnswer {
                g,
                call,
                session,
                quorum,
                error,
            };
            self.groups[g].held.push(ev);
            return Ok(());
        }
        let live = self.groups[g].call.as_ref().is_some_and(|c| c.id == call)
            && self.groups[g].session == Some(session);
        if !live {
            return Ok(());
        }
        let sent = self.groups[g].call.take().map(|c| c.forgotten);
        match (quorum, error) {
            (Some(quorum), _) if !self.groups[g].lose_next => {
                if sent == Some(self.groups[g].forgotten) {
                    self.groups[g].remembered = Some(lhm::Remembered {
                        quorum_id: quorum.quorum_id,
                        replica_ids: quorum
                            .participants
                            .iter()
                            .map(|m| m.replica_id.clone())
                            .collect(),
                    });
                }
                self.feed(g, round::Event::LighthouseAnswered { call, quorum })
            }
            (_, error) => {
                self.groups[g].lose_next = false;
                if self.sabotage == Sabotage::LoseCallFailure {
                    return Ok(());
                }
                let error = error.unwrap_or_else(|| "the lighthouse's answer was lost".into());
                self.feed(g, round::Event::LighthouseFailed { call, error })
            }
        }
    }

    // ---- the lighthouse ----

    fn lh_up(&mut self) {
        self.service += 1;
        let first = EPOCH_MS + self.t as i64;
        self.lh_first = first;
        self.lh = Some(Lighthouse::new(self.sc.knobs.clone(), first));
        self.lh_deadlines.clear();
        let service = self.service;
        self.at(self.t + 100, Ev::LhTick { service });
        self.log(|| format!("lighthouse {service} up"));
    }

    /// A manager's message to the lighthouse (held while cut).
    fn send_lh(&mut self, g: usize, ev: lhm::Event) -> Result<(), Broken> {
        self.send_lh_call(g, ev, None)
    }

    /// [`Sim::to_lh`] of a `Join` carrying the manager's `call`.
    fn send_lh_call(&mut self, g: usize, ev: lhm::Event, call: Option<u64>) -> Result<(), Broken> {
        if self.groups[g].cut_until.is_some() {
            if !matches!(ev, lhm::Event::Heartbeat { .. }) {
                self.groups[g].held.push(Ev::ToLh { g, ev, call });
            }
            return Ok(());
        }
        if let (lhm::Event::Join { session, .. }, Some(call)) = (&ev, call) {
            self.groups[g].lh_join = Some((*session, call));
        }
        self.lh_send(ev)
    }

    fn lh_send(&mut self, ev: lhm::Event) -> Result<(), Broken> {
        let now = self.now();
        let Some(lh) = self.lh.as_mut() else {
            return Ok(());
        };
        let short = if self.tracing {
            format!("{ev:?}")
        } else {
            String::new()
        };
        let actions = lh.handle(now, ev);
        let next = lh.next_deadline();
        if let Some(d) = next {
            let at = self.ms(d).max(self.t + 1);
            if self.lh_deadlines.insert(at) {
                let service = self.service;
                self.at(at, Ev::LhDeadline { service });
            }
        }
        if self.tracing && !actions.is_empty() {
            let short: String = short.chars().take(100).collect();
            let acts: Vec<String> = actions
                .iter()
                .map(|a| format!("{a:?}").chars().take(160).collect())
                .collect();
            self.log(|| format!("lighthouse <- {short} -> {acts:?}"));
        }
        for a in actions {
            match a {
                lhm::Action::Issue(q) => self.issue(to_proto(q))?,
                lhm::Action::Refuse {
                    session,
                    replica_id,
                    reason,
                } => {
                    let g: usize = replica_id.parse().expect("group ids are numbers");
                    if let Some(c) = self.groups[g]
                        .call
                        .as_ref()
                        .filter(|c| c.joined_on == Some(session))
                    {
                        let call = c.id;
                        let ev = Ev::LhAnswer {
                            g,
                            call,
                            session,
                            quorum: None,
                            error: Some(reason),
                        };
                        self.at(self.t + 1, ev);
                    }
                }
                lhm::Action::Abort { quorum_id, .. } => {
                    self.aborted.insert(quorum_id);
                    self.fail_allreduces(|key, _| key.0 == quorum_id);
                }
                lhm::Action::Dropped { .. } => {}
                lhm::Action::AbortPredecessor { .. } => {
                    // Every quorum of an earlier service is answered as
                    // dropped to its watchers from now on.
                    let below = self.lh_first;
                    self.dead_below = below;
                    self.fail_allreduces(|key, _| key.0 < below);
                }
            }
        }
        Ok(())
    }

    /// The lighthouse answers its members' waiting calls.
    fn issue(&mut self, q: Quorum) -> Result<(), Broken> {
        let ids: Vec<String> = q
            .participants
            .iter()
            .map(|m| m.replica_id.clone())
            .collect();
        self.check_issue(&q, &ids)?;
        self.check_lines(&q)?;
        for id in ids {
            let g: usize = id.parse().expect("group ids are numbers");
            // The call whose `Join` the lighthouse holds, wherever the
            // manager is now.
            let Some((session, call)) = self.groups[g].lh_join.take() else {
                continue;
            };
            let delay = self.groups[g]
                .delay_next
                .take()
                .unwrap_or(self.rng.range(0, 2));
            let ev = Ev::LhAnswer {
                g,
                call,
                session,
                quorum: Some(q.clone()),
                error: None,
            };
            self.at(self.t + delay, ev);
        }
        Ok(())
    }

    /// The next session's number.
    pub fn next_session_peek(&self) -> Session {
        self.next_session
    }

    /// The scenario in one line.
    pub fn summary(&self) -> String {
        let sc = &self.sc;
        format!(
            "{} groups x {} ranks, knobs {:?}, timing {:?}, faults {:?}",
            sc.groups, sc.ranks, sc.knobs, sc.timing, sc.faults
        )
    }
}
