//! A seeded simulation of the RRef protocol: several workers' [`Table`]s,
//! a program on each making, forking, using and dropping references, and a
//! network that delays, reorders, repeats and loses messages, with workers
//! killed at random steps. Every decision is the real table's; the simulator
//! plays the agent's part (it applies the effects: sends, retries, wakes) and
//! the network's, in simulated time.
//!
//! # The model
//!
//! * Requests and responses (a message carrying forks, a REMOTE_CALL and its
//!   answer, a fetch) between live workers arrive once, after a random delay,
//!   in any order. A message from or to a dead worker is lost.
//! * Control messages are sent as the agent sends them: up to 5 tries with
//!   the agent's back-off (1 s, x1.5). A try may be lost, or arrive and have
//!   its answer lost, and a lost try may still arrive later: the receiver sees
//!   it late or twice. Between live workers one of the 5 tries gets through.
//! * A worker killed stops at once; every other worker hears that it is gone
//!   (its process group says so) after a random delay of up to 2 s.
//! * A live worker may be **suspected**: one other worker hears that it is
//!   gone while it lives on, as the heartbeat concludes of a worker cut off
//!   past its deadline that comes back. The suspecter acts as on a death:
//!   it forgets the suspect's users of its values and fails its calls and
//!   fetches towards it, but still retries control messages to it (only a
//!   proven death stops them). Drawn
//!   from a generator of its own, so every seed's schedule without one is
//!   what it was.
//! * A call may time out before its answer; a send may fail before it leaves
//!   (its forks are cancelled); a message may be undecodable (its forks are
//!   adopted and dropped at once); a `remote()` function may fail.
//! * The run ends in one of two ways: every program drops its handles; or
//!   every live worker shuts down gracefully (releases its users, waits for
//!   its children and its owned values' users) and then drops its handles.
//!
//! # The invariants, checked after every step
//!
//! 1. **G1: no value is deleted while a user holds a reference.** When an
//!    owner deletes a value, no live worker's program holds a user of it,
//!    and no message in flight between live workers carries a fork of it;
//!    a fetch by a live user never finds its value gone. Values a killed
//!    worker held or owned are exempt: a parent that dies before its child
//!    is accepted takes the owner's record of that child with it (as in
//!    PyTorch). So are, from a suspicion on, the values the suspect held or
//!    owned and those of forks on their way to it from its suspecter: the
//!    suspecter released what it knew of them, as for a death, so a live
//!    suspect's use may find its value gone (an error naming it, never
//!    another value). The other invariants hold for suspects as for anyone.
//! 2. **G2: nothing leaks.** Once every handle is dropped and the system is
//!    quiet (and tombstones have expired), every live worker's table is
//!    empty: no owned value, no user, no child.
//! 3. **Every wait ends**: a use with a deadline ends by it, and every use
//!    (with or without one) has ended once the system is quiet.
//! 4. **Shutdown ends**: once quiet after every live worker began a graceful
//!    shutdown, each is settled (nothing left to wait for).
//! 5. A handle the program holds always has its entry in its worker's table.
//!
//! A run that never gets quiet (2,000,000 steps) breaks 3: something waits
//! forever. A failing seed prints the command that replays it with its trace.
//!
//! # Proof that it tests something
//!
//! A fault drawn is not a fault that happened: a kill needs its program step
//! and a second live worker, a loss needs a message to lose. [`Fired`] counts
//! the faults that happened, by kind; the seeds test prints them and fails if
//! a kind stops happening. And each invariant has a test that breaks one rule
//! on purpose ([`Sabotage`]) and requires the first seed that fails to break
//! that invariant: a check that cannot fail would pass it too.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::time::{Duration, Instant};

use super::table::{Adoption, Control, Effect, OwnerState, Parent, Table, UserStatus};
use super::{ForkId, Gid, RRefId, TOMBSTONE_TTL};
use crate::error::Error;

#[cfg(test)]
mod tests;

/// Faults that happened in a run, by kind (not those drawn: see the module
/// docs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Fired {
    /// Workers killed.
    pub kills: u64,
    /// Live workers taken for gone by another.
    pub suspicions: u64,
    /// Tries of control messages lost between live workers.
    pub lost: u64,
    /// Lost tries that arrived after all (late, or a second time).
    pub late: u64,
    /// Sends that failed before they left (their forks cancelled).
    pub cancelled: u64,
    /// Messages that reached a live worker undecodable.
    pub undecodable: u64,
    /// `remote()` functions that failed.
    pub failed: u64,
    /// Calls and uses that reached their deadline unanswered.
    pub timeouts: u64,
}

impl Fired {
    /// Each kind with its count, in a fixed order.
    pub fn kinds(&self) -> [(&'static str, u64); 8] {
        [
            ("kills", self.kills),
            ("suspicions", self.suspicions),
            ("lost tries", self.lost),
            ("late tries", self.late),
            ("cancelled sends", self.cancelled),
            ("undecodable messages", self.undecodable),
            ("failed functions", self.failed),
            ("timeouts", self.timeouts),
        ]
    }
}

/// A rule broken on purpose, to show that an invariant can fail (the tests
/// `invariant_*_catches_*`). Each breaks what one invariant relies on, in
/// the agent's part that the simulator plays or in the program; the tables
/// stay as they are (their own test hook is [`Sim::broken`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sabotage {
    /// Invariant 1 (G1): a worker that receives a fork from a user accepts
    /// it to its parent at once, before the owner has recorded it, so the
    /// parent may go, and the value with it.
    EarlyAccept,
    /// Invariant 2 (G2): the agent never sends a USER_DELETE, so owners keep
    /// their users' records. (With a graceful shutdown, invariant 4 finds
    /// the owner waiting for them first.)
    LostUserDelete,
    /// Invariant 3: an owner never answers a fetch.
    UnansweredFetch,
    /// Invariant 4: a graceful shutdown does not release the users held.
    NoRelease,
    /// Invariant 5: the program keeps an owner handle it dropped.
    KeptOwnerHandle,
}

/// What a seed draws.
#[derive(Debug, Clone)]
pub struct Config {
    pub workers: u32,
    /// Program steps before the end.
    pub ops: usize,
    pub max_delay_ms: u64,
    /// Chance that a control message's try is lost (and perhaps delivered late).
    pub loss: f64,
    pub cancel: f64,
    pub undecodable: f64,
    pub fail: f64,
    /// Timeout of calls and uses (`None`: none).
    pub timeout_ms: Option<u64>,
    pub kills: usize,
    pub shutdown: bool,
    /// Live workers suspected dead by one other (drawn apart: see the
    /// module docs).
    pub suspicions: usize,
}

impl Config {
    fn draw(rng: &mut fastrand::Rng) -> Config {
        Config {
            workers: rng.u32(2..=5),
            ops: rng.usize(20..200),
            max_delay_ms: [1, 20, 300][rng.usize(0..3)],
            loss: [0.0, 0.1, 0.4][rng.usize(0..3)],
            cancel: [0.0, 0.05][rng.usize(0..2)],
            undecodable: [0.0, 0.1][rng.usize(0..2)],
            fail: [0.0, 0.1][rng.usize(0..2)],
            timeout_ms: [None, Some(100), Some(2_000)][rng.usize(0..3)],
            kills: [0, 0, 1, 2][rng.usize(0..4)],
            shutdown: rng.bool(),
            suspicions: 0,
        }
    }
}

/// The generator of suspicions, apart from the run's (see the module docs).
fn suspicion_rng(seed: u64) -> fastrand::Rng {
    fastrand::Rng::with_seed(seed ^ 0x5005_9ec7)
}

/// A handle a program holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Held {
    Owner(RRefId),
    User { rref: RRefId, fork: ForkId },
}

impl Held {
    fn rref(self) -> RRefId {
        match self {
            Held::Owner(r) | Held::User { rref: r, .. } => r,
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Fork {
    owner: u32,
    rref: RRefId,
    fork: ForkId,
    parent: u32,
}

#[derive(Debug, Clone)]
enum Msg {
    /// Try `attempt` of a control message; `answer`: its sender hears the
    /// outcome.
    Control {
        c: Control,
        answer: bool,
        attempt: u32,
    },
    /// A request or response carrying forks.
    Carry {
        forks: Vec<Fork>,
        undecodable: bool,
    },
    RemoteCall {
        rref: RRefId,
        fork: ForkId,
        ok: bool,
        call: u64,
    },
    RemoteRet {
        ok: bool,
        call: u64,
    },
    Fetch {
        rref: RRefId,
        wait: u64,
    },
    FetchRet {
        wait: u64,
        result: Result<(), String>,
    },
}

#[derive(Debug, Clone)]
enum Ev {
    /// A program step on some worker.
    Op,
    /// The program phase is over.
    End,
    Deliver {
        from: u32,
        to: u32,
        msg: Msg,
    },
    /// A try of a control message from `at` to `to`.
    Try {
        at: u32,
        to: u32,
        msg: Control,
        attempt: u32,
    },
    /// The control message's sender heard the outcome.
    ControlDone {
        at: u32,
        msg: Control,
        ok: bool,
    },
    Gone {
        at: u32,
        peer: u32,
    },
    /// A live worker is suspected dead by another (both picked then).
    Suspect,
    FunctionDone {
        at: u32,
        rref: RRefId,
        ok: bool,
        reply: Option<(u32, u64)>,
    },
    /// A use's deadline, at the user.
    UseDeadline {
        wait: u64,
    },
    /// A remote call's deadline, at the caller.
    CallDeadline {
        call: u64,
    },
    /// The owner stops waiting for a pending value for a fetch.
    FetchDeadline {
        at: u32,
        wait: u64,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Confirming,
    Fetching,
}

struct Use {
    at: u32,
    fork: ForkId,
    rref: RRefId,
    owner: u32,
    deadline: Option<u64>,
    stage: Stage,
    /// Its deadline passed while its fetch was out: the program has its
    /// timeout error, the answer is still checked (G1).
    expired: bool,
}

struct Call {
    at: u32,
    to: u32,
    fork: ForkId,
    done: bool,
}

struct Worker {
    table: Table<u64>,
    alive: bool,
    held: Vec<Held>,
    shutting: bool,
    /// Workers it heard died: control messages to them are not retried.
    gone: BTreeSet<u32>,
    /// Live workers it took for gone (see `Sim::suspect`).
    suspected: BTreeSet<u32>,
    next: u64,
    /// Fetches waiting here for a pending value: (wait, from, rref).
    fetches: Vec<(u64, u32, RRefId)>,
}

/// A simulated run.
pub struct Sim {
    pub seed: u64,
    pub cfg: Config,
    rng: fastrand::Rng,
    now: u64,
    base: Instant,
    seq: u64,
    queue: BinaryHeap<Reverse<(u64, u64)>>,
    events: BTreeMap<u64, Ev>,
    workers: Vec<Worker>,
    uses: BTreeMap<u64, Use>,
    calls: BTreeMap<u64, Call>,
    next_id: u64,
    ops_left: usize,
    kills_left: usize,
    /// Values a killed worker held or owned (exempt from G1).
    tainted: BTreeSet<RRefId>,
    /// Draws the suspicions (see the module docs).
    srng: fastrand::Rng,
    pub trace: Vec<String>,
    keep_trace: bool,
    /// The first broken invariant: its number and what broke it.
    broken: Option<(u8, String)>,
    /// Steps taken (events handled).
    pub steps: u64,
    /// Faults that happened so far.
    pub fired: Fired,
    /// A rule broken on purpose (see [`Sabotage`]).
    sabotage: Option<Sabotage>,
}

/// A broken invariant, with the trace that led to it.
#[derive(Debug)]
pub struct Violation {
    pub seed: u64,
    /// Its number in the module docs (G1 is 1, G2 is 2).
    pub invariant: u8,
    pub what: String,
    pub trace: Vec<String>,
    /// The rule broken on purpose in that run, if any.
    pub sabotage: Option<Sabotage>,
}

/// The command that replays `seed` with its trace.
pub fn replay_command(seed: u64) -> String {
    rallypoint_simkit::replay_command(
        "rallypoint-rpc",
        "--lib",
        "rref::sim::tests::ten_thousand_seeds_keep_every_invariant",
        seed,
    )
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "seed {}: invariant {}: {}",
            self.seed, self.invariant, self.what
        )?;
        match self.sabotage {
            None => writeln!(f, "replay: {}", replay_command(self.seed))?,
            Some(s) => writeln!(f, "(with {s:?} broken on purpose)")?,
        }
        for l in self.trace.iter().rev().take(60).rev() {
            writeln!(f, "  {l}")?;
        }
        Ok(())
    }
}

const BACKOFF_MS: [u64; 5] = [0, 1_000, 1_500, 2_250, 3_375];

impl Sim {
    /// A run whose tables break G2 on purpose (a parent is deleted before
    /// its child is accepted): the invariants must catch it.
    pub fn broken(seed: u64) -> Sim {
        let mut sim = Sim::new(seed, false);
        for w in &mut sim.workers {
            w.table.broken = true;
        }
        sim
    }

    pub fn new(seed: u64, keep_trace: bool) -> Sim {
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut cfg = Config::draw(&mut rng);
        let mut srng = suspicion_rng(seed);
        cfg.suspicions = [0, 0, 1, 2][srng.usize(0..4)];
        let base = Instant::now();
        let workers = (0..cfg.workers)
            .map(|i| Worker {
                table: Table::new(i, base),
                alive: true,
                held: Vec::new(),
                shutting: false,
                gone: BTreeSet::new(),
                suspected: BTreeSet::new(),
                next: 1,
                fetches: Vec::new(),
            })
            .collect();
        let mut sim = Sim {
            seed,
            ops_left: cfg.ops,
            kills_left: cfg.kills,
            cfg,
            rng,
            now: 0,
            base,
            seq: 0,
            queue: BinaryHeap::new(),
            events: BTreeMap::new(),
            workers,
            uses: BTreeMap::new(),
            calls: BTreeMap::new(),
            next_id: 1,
            tainted: BTreeSet::new(),
            srng,
            trace: Vec::new(),
            keep_trace,
            broken: None,
            steps: 0,
            fired: Fired::default(),
            sabotage: None,
        };
        sim.at(0, Ev::Op);
        // During the program (its ops are about 10 ms apart).
        for _ in 0..sim.cfg.suspicions {
            let t = sim.srng.u64(0..=sim.cfg.ops as u64 * 10);
            sim.at(t, Ev::Suspect);
        }
        sim
    }

    /// This run with `rule` broken (see [`Sabotage`]).
    pub fn sabotaged(mut self, rule: Sabotage) -> Sim {
        self.sabotage = Some(rule);
        self
    }

    fn is_sabotaged(&self, rule: Sabotage) -> bool {
        self.sabotage == Some(rule)
    }

    fn at(&mut self, delay: u64, ev: Ev) {
        self.seq += 1;
        self.queue.push(Reverse((self.now + delay, self.seq)));
        self.events.insert(self.seq, ev);
    }

    fn delay(&mut self) -> u64 {
        self.rng.u64(0..=self.cfg.max_delay_ms)
    }

    fn clock(&self) -> Instant {
        self.base + Duration::from_millis(self.now)
    }

    fn log(&mut self, f: impl FnOnce() -> String) {
        if self.keep_trace {
            let line = format!("{:>8} ms  {}", self.now, f());
            self.trace.push(line);
        }
    }

    /// Invariant `invariant` (numbered as in the module docs) is broken.
    fn violate(&mut self, invariant: u8, what: String) {
        if self.broken.is_none() {
            self.log(|| format!("BROKEN: invariant {invariant}: {what}"));
            self.broken = Some((invariant, what));
        }
    }

    fn gid(&mut self, w: u32) -> Gid {
        let wk = &mut self.workers[w as usize];
        wk.next += 1;
        Gid {
            created_on: w,
            local: wk.next,
        }
    }

    fn live(&self) -> Vec<u32> {
        (0..self.cfg.workers)
            .filter(|w| self.workers[*w as usize].alive)
            .collect()
    }

    fn pick<T: Copy>(&mut self, v: &[T]) -> Option<T> {
        (!v.is_empty()).then(|| v[self.rng.usize(0..v.len())])
    }

    /// Runs to the end; the first broken invariant, if any.
    pub fn run(mut self) -> Result<Sim, Violation> {
        let mut phase = 0;
        loop {
            while let Some(Reverse((t, seq))) = self.queue.pop() {
                self.now = t;
                let ev = self.events.remove(&seq).expect("scheduled");
                self.steps += 1;
                self.step(ev);
                self.check_held();
                if self.broken.is_some() {
                    break;
                }
                if self.steps > 2_000_000 {
                    self.violate(3, "the run did not end (2,000,000 steps)".into());
                    break;
                }
            }
            if self.broken.is_some() {
                break;
            }
            // Quiet: nothing in flight, no timer set.
            phase += 1;
            match phase {
                1 => self.quiet_after_program(),
                2 => self.quiet_after_shutdown(),
                3 => self.quiet_after_drops(),
                _ => {
                    self.check_empty();
                    break;
                }
            }
            if self.broken.is_some() {
                break;
            }
        }
        match self.broken.take() {
            None => Ok(self),
            Some((invariant, what)) => Err(Violation {
                seed: self.seed,
                invariant,
                what,
                trace: std::mem::take(&mut self.trace),
                sabotage: self.sabotage,
            }),
        }
    }

    // ---- the program ----

    fn step(&mut self, ev: Ev) {
        match ev {
            Ev::Op => self.op(),
            Ev::End => self.log(|| "program phase over".into()),
            Ev::Deliver { from, to, msg } => self.deliver(from, to, msg),
            Ev::Try {
                at,
                to,
                msg,
                attempt,
            } => self.try_control(at, to, msg, attempt),
            Ev::ControlDone { at, msg, ok } => {
                if !self.workers[at as usize].alive {
                    return;
                }
                self.log(|| format!("w{at}: {msg:?} done, ok={ok}"));
                if let Control::ForkRequest { fork, .. } = msg {
                    let r = if ok {
                        Ok(())
                    } else {
                        Err(Error::WorkerGone {
                            worker: "owner".into(),
                            what: "fork request".into(),
                            reason: "gone".into(),
                        })
                    };
                    self.on(at, |t, out| t.fork_registered(fork, r, out));
                }
            }
            Ev::Gone { at, peer } => self.gone(at, peer),
            Ev::Suspect => self.suspect(),
            Ev::FunctionDone {
                at,
                rref,
                ok,
                reply,
            } => {
                if !self.workers[at as usize].alive {
                    return;
                }
                self.log(|| format!("w{at}: function for {rref} done, ok={ok}"));
                if !ok {
                    self.fired.failed += 1;
                }
                let v = if ok {
                    Ok(rref.local)
                } else {
                    Err("the function failed".to_owned())
                };
                self.on(at, |t, out| t.set_value(rref, v, out));
                if let Some((to, call)) = reply {
                    self.send(at, to, Msg::RemoteRet { ok, call });
                }
            }
            Ev::UseDeadline { wait } => {
                let Some(stage) = self.uses.get(&wait).map(|u| u.stage) else {
                    return;
                };
                self.fired.timeouts += 1;
                self.log(|| format!("use {wait}: deadline"));
                match stage {
                    Stage::Confirming => {
                        self.uses.remove(&wait);
                    }
                    Stage::Fetching => {
                        if let Some(u) = self.uses.get_mut(&wait) {
                            u.expired = true;
                        }
                    }
                }
            }
            Ev::CallDeadline { call } => {
                let Some(c) = self.calls.get_mut(&call) else {
                    return;
                };
                if c.done || !self.workers[c.at as usize].alive {
                    return;
                }
                c.done = true;
                let (at, fork) = (c.at, c.fork);
                self.fired.timeouts += 1;
                self.log(|| format!("w{at}: remote call {call} timed out"));
                let e = Error::Timeout {
                    worker: "owner".into(),
                    what: "RRef creation via rpc.remote()".into(),
                    ms: 0,
                };
                self.on(at, |t, out| t.confirm(fork, Some(e), out));
            }
            Ev::FetchDeadline { at, wait } => {
                let wk = &mut self.workers[at as usize];
                if let Some(i) = wk.fetches.iter().position(|f| f.0 == wait) {
                    let (_, from, rref) = wk.fetches.remove(i);
                    let result = Err(format!("{rref} not ready in time"));
                    self.send(at, from, Msg::FetchRet { wait, result });
                }
            }
        }
    }

    fn op(&mut self) {
        if self.ops_left == 0 {
            self.at(0, Ev::End);
            return;
        }
        self.ops_left -= 1;
        let gap = self.rng.u64(0..=20);
        self.at(gap, Ev::Op);
        let live = self.live();
        let Some(w) = self.pick(&live) else {
            return;
        };
        match self.rng.u32(0..100) {
            0..=9 => self.new_local(w),
            10..=24 => {
                let to = self.pick(&live).expect("w is live");
                self.remote(w, to);
            }
            25..=54 => self.send_forks(w),
            55..=74 => self.drop_one(w),
            75..=97 => self.use_one(w),
            _ => self.kill(w),
        }
    }

    fn new_local(&mut self, w: u32) {
        let rref = self.gid(w);
        self.log(|| format!("w{w}: RRef({rref})"));
        self.on(w, |t, _| t.new_owned(rref, "local"));
        self.on(w, |t, out| t.set_value(rref, Ok(rref.local), out));
        self.workers[w as usize].held.push(Held::Owner(rref));
    }

    fn remote(&mut self, w: u32, to: u32) {
        let rref = self.gid(w);
        let ok = !chance(&mut self.rng, self.cfg.fail);
        if to == w {
            self.log(|| format!("w{w}: remote to itself -> {rref}"));
            self.on(w, |t, _| t.new_owned(rref, "remote to self"));
            self.workers[w as usize].held.push(Held::Owner(rref));
            let d = self.delay();
            self.at(
                d,
                Ev::FunctionDone {
                    at: w,
                    rref,
                    ok,
                    reply: None,
                },
            );
            return;
        }
        let fork = self.gid(w);
        self.log(|| format!("w{w}: remote to w{to} -> {rref} as user {fork}"));
        self.on(w, |t, _| t.new_user(rref, fork, to, "remote"));
        self.workers[w as usize]
            .held
            .push(Held::User { rref, fork });
        let call = self.next_id;
        self.next_id += 1;
        self.calls.insert(
            call,
            Call {
                at: w,
                to,
                fork,
                done: false,
            },
        );
        if let Some(t) = self.cfg.timeout_ms {
            self.at(t, Ev::CallDeadline { call });
        }
        self.send(
            w,
            to,
            Msg::RemoteCall {
                rref,
                fork,
                ok,
                call,
            },
        );
    }

    fn send_forks(&mut self, w: u32) {
        let live = self.live();
        let dest = if chance(&mut self.rng, 0.1) {
            w
        } else {
            self.pick(&live).expect("w is live")
        };
        let n = self.rng.usize(1..=3);
        let mut forks = Vec::new();
        let mut made = Vec::new();
        for _ in 0..n {
            let held = self.workers[w as usize].held.clone();
            let Some(h) = self.pick(&held) else {
                break;
            };
            let fork = self.gid(w);
            let (parent, owner) = match h {
                Held::Owner(r) => (Parent::Owner(r), w),
                Held::User { fork: f, rref } => (Parent::User(f), self.owner_of(w, rref, f)),
            };
            match self.workers[w as usize].table.fork(parent, fork, dest) {
                Ok(()) => {
                    made.push(fork);
                    forks.push(Fork {
                        owner,
                        rref: h.rref(),
                        fork,
                        parent: w,
                    });
                }
                // A released or failed handle cannot be sent: the call
                // fails before anything leaves.
                Err(e) => self.log(|| format!("w{w}: fork of {h:?} refused: {e}")),
            }
        }
        if forks.is_empty() {
            return;
        }
        if chance(&mut self.rng, self.cfg.cancel) {
            self.fired.cancelled += 1;
            self.log(|| format!("w{w}: send of {made:?} to w{dest} failed before it left"));
            self.on(w, |t, out| t.cancel_children(&made, out));
            return;
        }
        let undecodable = chance(&mut self.rng, self.cfg.undecodable);
        self.log(|| {
            format!(
                "w{w}: sends forks {:?} to w{dest}{}",
                forks.iter().map(|f| f.fork).collect::<Vec<_>>(),
                if undecodable { " (undecodable)" } else { "" }
            )
        });
        self.send(w, dest, Msg::Carry { forks, undecodable });
    }

    fn owner_of(&self, w: u32, rref: RRefId, fork: ForkId) -> u32 {
        self.workers[w as usize]
            .table
            .user_list()
            .into_iter()
            .find(|u| u.0 == fork)
            .map(|u| u.2)
            .unwrap_or_else(|| panic!("w{w} holds user {fork} of {rref} without its entry"))
    }

    /// Handles with a use in progress cannot be dropped (the use borrows them).
    fn in_use(&self, w: u32, h: Held) -> bool {
        match h {
            Held::Owner(_) => false,
            Held::User { fork, .. } => self
                .uses
                .values()
                .any(|u| u.at == w && u.fork == fork && !u.expired),
        }
    }

    fn drop_one(&mut self, w: u32) {
        let held = self.workers[w as usize].held.clone();
        let free: Vec<usize> = (0..held.len())
            .filter(|i| !self.in_use(w, held[*i]))
            .collect();
        let Some(i) = self.pick(&free) else {
            return;
        };
        let h = held[i];
        // Sabotage: an owner handle dropped stays in the program's hands.
        let kept = self.is_sabotaged(Sabotage::KeptOwnerHandle) && matches!(h, Held::Owner(_));
        if !kept {
            self.workers[w as usize].held.remove(i);
        }
        self.drop_handle(w, h);
    }

    fn drop_handle(&mut self, w: u32, h: Held) {
        self.log(|| format!("w{w}: drops {h:?}"));
        match h {
            Held::Owner(r) => self.on(w, |t, out| t.owner_dropped(r, out)),
            Held::User { fork, .. } => self.on(w, |t, out| t.user_dropped(fork, out)),
        }
    }

    fn use_one(&mut self, w: u32) {
        let held = self.workers[w as usize].held.clone();
        let Some(h) = self.pick(&held) else {
            return;
        };
        match h {
            Held::Owner(r) => {
                // A handle of a value deleted on a suspicion (or a death) is
                // of nothing: its use fails.
                if self.workers[w as usize].table.value(r).is_none() && !self.tainted.contains(&r) {
                    self.violate(
                        5,
                        format!("w{w} holds an owner handle of {r} with no entry"),
                    );
                }
            }
            Held::User { rref, fork } => {
                let id = self.next_id;
                self.next_id += 1;
                let owner = self.owner_of(w, rref, fork);
                let deadline = self.cfg.timeout_ms.map(|t| self.now + t);
                self.log(|| format!("w{w}: use {id} of user {fork} ({rref})"));
                self.uses.insert(
                    id,
                    Use {
                        at: w,
                        fork,
                        rref,
                        owner,
                        deadline,
                        stage: Stage::Confirming,
                        expired: false,
                    },
                );
                if let Some(t) = self.cfg.timeout_ms {
                    self.at(t, Ev::UseDeadline { wait: id });
                }
                self.advance_use(id);
            }
        }
    }

    /// Looks at a use again (it was started, or its user changed).
    fn advance_use(&mut self, id: u64) {
        let Some(u) = self.uses.get(&id) else {
            return;
        };
        if u.stage != Stage::Confirming {
            return;
        }
        let (w, fork, rref, owner) = (u.at, u.fork, u.rref, u.owner);
        match self.workers[w as usize].table.user(fork) {
            UserStatus::Unconfirmed => {}
            UserStatus::Confirmed => {
                self.uses.get_mut(&id).expect("present").stage = Stage::Fetching;
                self.send(w, owner, Msg::Fetch { rref, wait: id });
            }
            UserStatus::Failed(_) | UserStatus::Released { .. } => {
                self.log(|| format!("use {id}: ends with the user's error"));
                self.uses.remove(&id);
            }
            UserStatus::Unknown => self.violate(
                5,
                format!("w{w}: use {id} of a held user {fork} with no entry"),
            ),
        }
    }

    fn kill(&mut self, w: u32) {
        if self.kills_left == 0 || self.live().len() <= 1 {
            return;
        }
        self.kills_left -= 1;
        self.fired.kills += 1;
        self.log(|| format!("w{w}: KILLED"));
        let t = &self.workers[w as usize].table;
        let mut tainted: Vec<RRefId> = t.owned();
        tainted.extend(t.user_list().into_iter().map(|u| u.1));
        self.tainted.extend(tainted);
        let wk = &mut self.workers[w as usize];
        wk.alive = false;
        wk.held.clear();
        wk.fetches.clear();
        self.uses.retain(|_, u| u.at != w);
        for other in self.live() {
            let d = self.rng.u64(0..=2_000);
            self.at(d, Ev::Gone { at: other, peer: w });
        }
    }

    /// A live worker is suspected dead by another, which acts as on a death.
    fn suspect(&mut self) {
        let live = self.live();
        if live.len() < 2 {
            return;
        }
        let at = live[self.srng.usize(0..live.len())];
        let others: Vec<u32> = live.into_iter().filter(|&w| w != at).collect();
        let peer = others[self.srng.usize(0..others.len())];
        self.fired.suspicions += 1;
        self.log(|| format!("w{at}: SUSPECTS live w{peer}"));
        // As for a kill, the values the suspect holds or owns are exempt
        // from G1 from now on, and so are those of forks on their way to it
        // from its suspecter (whose parents the suspecter now releases).
        let t = &self.workers[peer as usize].table;
        let mut tainted: Vec<RRefId> = t.owned();
        tainted.extend(t.user_list().into_iter().map(|u| u.1));
        for e in self.events.values() {
            if let Ev::Deliver {
                from,
                to,
                msg: Msg::Carry { forks, .. },
            } = e
            {
                if *from == at && *to == peer {
                    tainted.extend(forks.iter().map(|f| f.rref));
                }
            }
        }
        self.tainted.extend(tainted);
        self.workers[at as usize].suspected.insert(peer);
        self.lose(at, peer);
    }

    /// `at` hears that `peer` died (its process group says so).
    fn gone(&mut self, at: u32, peer: u32) {
        if !self.workers[at as usize].alive {
            return;
        }
        self.log(|| format!("w{at}: hears w{peer} is gone"));
        self.workers[at as usize].gone.insert(peer);
        self.lose(at, peer);
    }

    /// What `at` does when it takes `peer` for gone, proven or suspected:
    /// releases its references, fails its calls and fetches towards it.
    fn lose(&mut self, at: u32, peer: u32) {
        self.on(at, |t, out| {
            t.peer_gone(peer, "dead", out);
        });
        // Calls waiting on it fail at once.
        let calls: Vec<(u64, ForkId)> = self
            .calls
            .iter()
            .filter(|(_, c)| c.at == at && c.to == peer && !c.done)
            .map(|(id, c)| (*id, c.fork))
            .collect();
        for (id, fork) in calls {
            self.calls.get_mut(&id).expect("present").done = true;
            let e = Error::WorkerGone {
                worker: format!("w{peer}"),
                what: "remote".into(),
                reason: "gone".into(),
            };
            self.on(at, |t, out| t.confirm(fork, Some(e), out));
        }
        let fetching: Vec<u64> = self
            .uses
            .iter()
            .filter(|(_, u)| u.at == at && u.owner == peer && u.stage == Stage::Fetching)
            .map(|(id, _)| *id)
            .collect();
        for id in fetching {
            self.log(|| format!("use {id}: its owner is gone"));
            self.uses.remove(&id);
        }
    }

    // ---- the agent's part: effects, sends, retries ----

    /// Runs one event on worker `w`'s table and applies its effects.
    fn on<R>(&mut self, w: u32, f: impl FnOnce(&mut Table<u64>, &mut Vec<Effect<u64>>) -> R) -> R {
        let mut out = Vec::new();
        let now = self.clock();
        let t = &mut self.workers[w as usize].table;
        t.tick(now);
        let r = f(t, &mut out);
        self.apply(w, out);
        // Sabotage: shutdown forgets to release the users held.
        if self.workers[w as usize].shutting && !self.is_sabotaged(Sabotage::NoRelease) {
            let mut out = Vec::new();
            self.workers[w as usize].table.release_users(&mut out);
            self.apply(w, out);
        }
        r
    }

    fn apply(&mut self, w: u32, out: Vec<Effect<u64>>) {
        for e in out {
            match e {
                Effect::Send {
                    msg: Control::UserDelete { rref, fork },
                    to,
                } if self.is_sabotaged(Sabotage::LostUserDelete) => {
                    self.log(|| format!("w{w}: loses USER_DELETE of {fork} ({rref}) to w{to}"));
                }
                Effect::Send { to, msg } => {
                    self.log(|| format!("w{w}: sends {msg:?} to w{to}"));
                    self.at(
                        0,
                        Ev::Try {
                            at: w,
                            to,
                            msg,
                            attempt: 0,
                        },
                    );
                }
                Effect::UserChanged => {
                    let ids: Vec<u64> = self
                        .uses
                        .iter()
                        .filter(|(_, u)| u.at == w)
                        .map(|(id, _)| *id)
                        .collect();
                    for id in ids {
                        self.advance_use(id);
                    }
                }
                Effect::ValueSettled => self.answer_fetches(w),
                Effect::Drained | Effect::Dispose(_) => {}
                Effect::Deleted { rref, value } => {
                    self.log(|| format!("w{w}: deletes {rref} (value: {value:?})"));
                    if value.is_some() {
                        self.check_g1(w, rref);
                    }
                }
            }
        }
    }

    fn send(&mut self, from: u32, to: u32, msg: Msg) {
        let d = if from == to { 0 } else { self.delay() };
        self.at(d, Ev::Deliver { from, to, msg });
    }

    fn try_control(&mut self, at: u32, to: u32, msg: Control, attempt: u32) {
        if !self.workers[at as usize].alive {
            return;
        }
        let fail = |s: &mut Sim| {
            s.at(
                0,
                Ev::ControlDone {
                    at,
                    msg: msg.clone(),
                    ok: false,
                },
            )
        };
        // The agent does not retry towards a worker it knows is gone.
        if attempt > 0 && self.workers[at as usize].gone.contains(&to) {
            return fail(self);
        }
        let last = attempt == 4;
        if !self.workers[to as usize].alive {
            if last {
                return fail(self);
            }
            let next = BACKOFF_MS[attempt as usize + 1];
            return self.at(
                next,
                Ev::Try {
                    at,
                    to,
                    msg,
                    attempt: attempt + 1,
                },
            );
        }
        // Between live workers, one of the five tries gets through.
        let lost = !last && chance(&mut self.rng, self.cfg.loss);
        let d = self.delay();
        if lost {
            self.fired.lost += 1;
            // Lost, or only its answer was: it may still arrive, late.
            if self.rng.bool() {
                let late = d + self.rng.u64(0..=5_000);
                self.at(
                    late,
                    Ev::Deliver {
                        from: at,
                        to,
                        msg: Msg::Control {
                            c: msg.clone(),
                            answer: false,
                            attempt,
                        },
                    },
                );
            }
            let next = BACKOFF_MS[attempt as usize + 1];
            self.at(
                next,
                Ev::Try {
                    at,
                    to,
                    msg,
                    attempt: attempt + 1,
                },
            );
        } else {
            self.at(
                d,
                Ev::Deliver {
                    from: at,
                    to,
                    msg: Msg::Control {
                        c: msg,
                        answer: true,
                        attempt,
                    },
                },
            );
        }
    }

    fn deliver(&mut self, from: u32, to: u32, msg: Msg) {
        if !self.workers[from as usize].alive {
            return;
        }
        if !self.workers[to as usize].alive {
            return self.undeliverable(from, to, msg);
        }
        match msg {
            Msg::Control { c, answer, .. } => {
                // Only a lost try arrives unanswered: it came late after all.
                if !answer {
                    self.fired.late += 1;
                }
                self.log(|| format!("w{to}: receives {c:?} from w{from}"));
                let r = match c.clone() {
                    Control::UserDelete { rref, fork } => {
                        self.on(to, |t, out| t.user_delete(rref, fork, out));
                        Ok(())
                    }
                    Control::ForkRequest { rref, fork } => {
                        self.on(to, |t, out| t.fork_request(rref, fork, from, out))
                    }
                    Control::ChildAccept { fork } => {
                        self.on(to, |t, out| t.child_accept(fork, out));
                        Ok(())
                    }
                };
                if answer {
                    let back = self.delay();
                    self.at(
                        back,
                        Ev::ControlDone {
                            at: from,
                            msg: c,
                            ok: r.is_ok(),
                        },
                    );
                }
            }
            Msg::Carry { forks, undecodable } => {
                if undecodable {
                    self.fired.undecodable += 1;
                }
                self.log(|| format!("w{to}: receives forks from w{from}"));
                let mut adopted = Vec::new();
                for f in forks {
                    let kind = self.on(to, |t, out| {
                        t.adopt(f.owner, f.rref, f.fork, f.parent, "forked", out)
                    });
                    if self.is_sabotaged(Sabotage::EarlyAccept)
                        && matches!(kind, Adoption::User { unconfirmed: true })
                    {
                        // Sabotage: accepted before the owner recorded it.
                        self.log(|| format!("w{to}: accepts {} at once", f.fork));
                        self.at(
                            0,
                            Ev::Try {
                                at: to,
                                to: f.parent,
                                msg: Control::ChildAccept { fork: f.fork },
                                attempt: 0,
                            },
                        );
                    }
                    adopted.push(match kind {
                        Adoption::Owner => Held::Owner(f.rref),
                        Adoption::User { .. } => Held::User {
                            rref: f.rref,
                            fork: f.fork,
                        },
                    });
                }
                for h in adopted {
                    if undecodable || !self.workers[to as usize].alive {
                        self.drop_handle(to, h);
                    } else {
                        self.workers[to as usize].held.push(h);
                    }
                }
            }
            Msg::RemoteCall {
                rref,
                fork,
                ok,
                call,
            } => {
                self.log(|| format!("w{to}: REMOTE_CALL {rref} from w{from}"));
                self.on(to, |t, _| t.remote_arrived(rref, fork, from, "remote"));
                let d = self.delay();
                self.at(
                    d,
                    Ev::FunctionDone {
                        at: to,
                        rref,
                        ok,
                        reply: Some((from, call)),
                    },
                );
            }
            Msg::RemoteRet { ok, call } => {
                let Some(c) = self.calls.get_mut(&call) else {
                    return;
                };
                if c.done {
                    return;
                }
                c.done = true;
                let fork = c.fork;
                self.log(|| format!("w{to}: REMOTE_RET for user {fork}, ok={ok}"));
                let e = (!ok).then(|| Error::Remote {
                    worker: format!("w{from}"),
                    what: "remote".into(),
                    message: "failed".into(),
                });
                self.on(to, |t, out| t.confirm(fork, e, out));
            }
            Msg::Fetch { rref, wait } => {
                self.workers[to as usize].fetches.push((wait, from, rref));
                self.answer_fetches(to);
                if let Some(t) = self.cfg.timeout_ms {
                    self.at(t, Ev::FetchDeadline { at: to, wait });
                }
            }
            Msg::FetchRet { wait, result } => {
                let Some(u) = self.uses.remove(&wait) else {
                    return;
                };
                self.log(|| format!("use {wait}: fetched: {result:?}"));
                // A use that timed out still holds its user if the program
                // has not dropped it since (a dropped handle is never held
                // again): then its value must still be there too.
                let held = !u.expired
                    || self.workers[u.at as usize].held.contains(&Held::User {
                        rref: u.rref,
                        fork: u.fork,
                    });
                if let Err(e) = result {
                    if held && e.contains("gone") && !self.tainted.contains(&u.rref) {
                        self.violate(1, format!(
                            "G1: w{}'s use {wait} of user {} found {} deleted at its owner w{} ({e})",
                            u.at, u.fork, u.rref, u.owner
                        ));
                    }
                }
            }
        }
    }

    /// A message reached a dead worker: its sender's call fails (the
    /// connection is refused or reset), as the transport reports it.
    fn undeliverable(&mut self, from: u32, to: u32, msg: Msg) {
        match msg {
            Msg::Control {
                c,
                answer: true,
                attempt,
            } => {
                // This try failed: the next one, after the back-off.
                if attempt == 4 {
                    self.at(
                        0,
                        Ev::ControlDone {
                            at: from,
                            msg: c,
                            ok: false,
                        },
                    );
                } else {
                    let next = BACKOFF_MS[attempt as usize + 1];
                    self.at(
                        next,
                        Ev::Try {
                            at: from,
                            to,
                            msg: c,
                            attempt: attempt + 1,
                        },
                    );
                }
            }
            Msg::Control { answer: false, .. } | Msg::RemoteRet { .. } | Msg::FetchRet { .. } => {}
            Msg::Carry { forks, .. } => {
                self.log(|| format!("w{from}: send to dead w{to} fails"));
                let made: Vec<ForkId> = forks.iter().map(|f| f.fork).collect();
                self.on(from, |t, out| t.cancel_children(&made, out));
            }
            Msg::RemoteCall { call, .. } => {
                let Some(c) = self.calls.get_mut(&call) else {
                    return;
                };
                if c.done {
                    return;
                }
                c.done = true;
                let fork = c.fork;
                let e = Error::WorkerGone {
                    worker: format!("w{to}"),
                    what: "remote".into(),
                    reason: "connection refused".into(),
                };
                self.on(from, |t, out| t.confirm(fork, Some(e), out));
            }
            Msg::Fetch { wait, .. } => {
                self.log(|| format!("use {wait}: its owner is unreachable"));
                self.uses.remove(&wait);
            }
        }
    }

    /// The owner answers the fetches waiting for values that are settled.
    fn answer_fetches(&mut self, w: u32) {
        let fetches = std::mem::take(&mut self.workers[w as usize].fetches);
        let mut keep = Vec::new();
        for (wait, from, rref) in fetches {
            let result = match self.workers[w as usize].table.value(rref) {
                Some(OwnerState::Pending) => {
                    keep.push((wait, from, rref));
                    continue;
                }
                // Sabotage: the owner never answers.
                _ if self.is_sabotaged(Sabotage::UnansweredFetch) => continue,
                Some(OwnerState::Ready(_)) => Ok(()),
                Some(OwnerState::Failed(m)) => Err(format!("failed: {m}")),
                None => Err(format!("{rref} is gone")),
            };
            self.send(w, from, Msg::FetchRet { wait, result });
        }
        self.workers[w as usize].fetches.extend(keep);
    }

    // ---- the end ----

    fn quiet_after_program(&mut self) {
        // Invariant 3: every use has ended (or timed out).
        let hung = self
            .uses
            .iter()
            .find(|(_, u)| !u.expired && !self.tainted.contains(&u.rref));
        if let Some((id, u)) = hung {
            let what = format!(
                "use {id} of user {} ({}) on w{} never ended ({:?}, deadline {:?})",
                u.fork, u.rref, u.at, u.stage, u.deadline
            );
            return self.violate(3, what);
        }
        self.uses.clear();
        if self.cfg.shutdown {
            self.log(|| "graceful shutdown everywhere".into());
            for w in self.live() {
                self.workers[w as usize].shutting = true;
                self.on(w, |_, _| ());
            }
        }
    }

    fn quiet_after_shutdown(&mut self) {
        if self.cfg.shutdown {
            // Invariant 4: each live worker's shutdown has nothing left to
            // wait for.
            for w in self.live() {
                if !self.workers[w as usize].table.settled(true) {
                    let t = &self.workers[w as usize].table;
                    let what = format!(
                        "shutdown of w{w} never settles: counts {:?}, users {:?}",
                        t.counts(),
                        t.user_list()
                    );
                    return self.violate(4, what);
                }
            }
        }
        for w in self.live() {
            let held = std::mem::take(&mut self.workers[w as usize].held);
            for h in held {
                self.drop_handle(w, h);
            }
        }
    }

    fn quiet_after_drops(&mut self) {
        // Tombstones and placeholders expire.
        self.now += (TOMBSTONE_TTL + Duration::from_secs(61)).as_millis() as u64;
        self.log(|| "tombstones expire".into());
        for w in self.live() {
            self.on(w, |t, out| t.sweep(true, out));
        }
    }

    /// Invariant 2: nothing is left on any live worker.
    fn check_empty(&mut self) {
        for w in self.live() {
            let t = &self.workers[w as usize].table;
            if t.counts() != (0, 0, 0) {
                let what = format!(
                    "G2: w{w} keeps (owned, users, children) = {:?} after every handle was dropped: owned {:?}, users {:?}",
                    t.counts(),
                    t.owned(),
                    t.user_list()
                );
                return self.violate(2, what);
            }
        }
    }

    /// Invariant 1 at the moment `owner` deletes `rref`.
    fn check_g1(&mut self, owner: u32, rref: RRefId) {
        if self.tainted.contains(&rref) {
            return;
        }
        for w in self.live() {
            for (fork, r, _, held) in self.workers[w as usize].table.user_list() {
                if r == rref && held {
                    return self.violate(
                        1,
                        format!("G1: w{owner} deleted {rref} while w{w} holds its user {fork}"),
                    );
                }
            }
        }
        let carried = self.events.values().any(|e| match e {
            Ev::Deliver {
                from,
                to,
                msg: Msg::Carry { forks, .. },
            } => {
                self.workers[*from as usize].alive
                    && self.workers[*to as usize].alive
                    && forks.iter().any(|f| f.rref == rref)
            }
            _ => false,
        });
        if carried {
            self.violate(
                1,
                format!("G1: w{owner} deleted {rref} while a message carries a fork of it"),
            );
        }
    }

    /// Invariant 5: what a program holds is in its table.
    fn check_held(&mut self) {
        for w in self.live() {
            let wk = &self.workers[w as usize];
            for h in &wk.held {
                if self.tainted.contains(&h.rref()) {
                    continue;
                }
                let ok = match h {
                    Held::Owner(r) => wk.table.value(*r).is_some(),
                    Held::User { fork, .. } => wk.table.user(*fork) != UserStatus::Unknown,
                };
                if !ok {
                    let what = format!("w{w} holds {h:?}, which its table does not know");
                    return self.violate(5, what);
                }
            }
        }
    }
}

fn chance(rng: &mut fastrand::Rng, p: f64) -> bool {
    rng.f64() < p
}
