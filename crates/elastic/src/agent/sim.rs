//! A seeded simulator of whole runs: N agents' real [`Policy`] machines over a
//! simulated run store, rendezvous, clock, network and workers, driven through
//! random schedules of failures, with the run's invariants checked after every
//! step. In the spirit of FoundationDB's simulation and TigerBeetle's VOPR: one
//! `u64` seed decides everything (the run's shape, every latency and every
//! fault), so a failing seed replays exactly:
//!
//! ```text
//! RALLY_SIM_SEED=<seed> cargo nextest run -p rallypoint-elastic --lib agent::sim::tests::ten_thousand_seeds_keep_every_invariant --no-capture
//! ```
//!
//! # Why our own executor, not turmoil
//!
//! The decisions live in pure machines (events in, actions out), so simulating
//! them needs no network stack at all: a discrete-event loop over a priority
//! queue of timed events runs a 64-node run in microseconds, 10,000 seeds in
//! seconds, fully deterministically (no tokio scheduler, no wall clock). turmoil
//! would run the real async driver over simulated TCP, which needs the real
//! workers (processes) and their signals, which it cannot simulate. What the
//! simulator models instead of running is stated here, so a reader can judge it:
//!
//! - **The driver's actions.** Each [`Action`] is performed as the driver in
//!   `mod.rs` performs it, against the modelled store, with a latency; a store
//!   call that cannot reach the store answers its error after the driver's bound
//!   ([`CHECK_MS`]); rank assignment waits for every member, up to the store
//!   timeout; the job store is rank 0's and goes away when that node ends its
//!   round; the run store lives with the rendezvous host (node 0). Ranks of a
//!   `c10d` round follow the nodes' ids, drawn from the seed (the real
//!   rendezvous sorts by node id), so the rendezvous host is rank 0 only
//!   sometimes. A host that ended (exited or killed) refuses connections, so
//!   a lingering node can tell it from a stalled one.
//! - **The watch** (`watcher.rs`): a node looks at the run 0.1 s (or one
//!   monitor interval) after its round starts, then only when woken: a verdict published, a node waiting or a
//!   member found dead in its round, the host gone (every wait reads EOF), or
//!   its keep-alive beat failing (the store stalled or the node partitioned:
//!   at the next beat, within an interval, plus the beat's bound of one
//!   interval). While the store does not answer it looks every monitor
//!   interval, kept within 0.1–1 s. A look reaches the policy only between the node's actions.
//! - **The run store protocol** of `run_store.rs`: the verdict's
//!   compare-and-set (a failure is never overwritten), the root cause lowered to
//!   the earliest record, the failed-round count, `finishing`.
//! - **The rendezvous**: `c10d` (a round forms at `max` nodes at once, or with
//!   `min` or more after a last call, and only once no member of the last
//!   round is still in it; a node arriving meanwhile, or a member coming back,
//!   marks the round waiting; a killed member is marked dead by its watcher
//!   after the keep-alive expiry; a member that leaves is skipped; a join ends
//!   at `join_timeout`) or `static` (fixed nodes, each restart a new round
//!   number, never re-formed; a killed node is marked dead by its watcher after
//!   the keep-alive expiry unless it left). A watcher is a live member still in
//!   the round (one that re-joins stops watching it; one that left goes on);
//!   ranks below `WATCHERS` mark at the expiry, the others only after the
//!   ring's slow read (`RING_INTERVALS` intervals later); nobody watching,
//!   nobody marks. A node partitioned from the store for an expiry looks
//!   dead to its watchers as a killed one does; its first beat back claims
//!   its census key (`census::Standing`) and counts it in again if it was
//!   counted dead, as do its next join and its leave. Both keep the census (nodes in, out, dead)
//!   that hosts linger on, and the pulse: a lingering host stops once no member
//!   of its round or the newest one has beaten for an expiry. A join probes the
//!   store and fails after `lost_grace` without it.
//! - **Workers**: each round's group on each node runs for a random time, then
//!   succeeds or fails; when one group fails or is stopped, the others of the
//!   round fail soon after (a broken collective) unless the run drew
//!   independent workers.
//!
//! # Faults
//!
//! Worker failures in any phase, nodes killed at any moment (the host
//! included), the store stalled for everyone or one node partitioned from it for
//! a while, slow nodes, signals, nodes arriving late (c10d), short exit-barrier
//! timeouts.
//!
//! A fault is drawn with its moment when the run starts; it *happens* only if
//! the run reaches that moment with its target there ([`Fired`]): a kill or a
//! signal of a node still running, a stall while some node runs (or boots
//! during it), a partition of a running node other than the run store's host
//! (node 0, never cut off from its own store), a worker group failing while it
//! still runs, a late node booting. A group that fails because another went
//! (a broken collective, a lost job store) follows a fault and is not one.
//!
//! # Invariants (checked after every event)
//!
//! 1. No node exits 0 if the run's failure was published before it last read
//!    the verdict (its decision: the publish, the read after a closed join, the
//!    end of its linger). A node that decided success earlier is right to exit
//!    0: torchrun's exit-barrier timeout lets a node finish before another fails.
//! 2. No running worker is stopped in a run that has had no fault at all
//!    (another node finishing is not a reason): no fault has *happened*
//!    before the stop, whatever is drawn for later.
//! 3. A job store (or the static run store, or the `c10d` rendezvous host,
//!    without which a node's agent fails its run) is never shut by its host
//!    while another node's workers of that round still run and have not been
//!    told to stop, unless the host was
//!    signalled (a user stopping that node takes its store with it) or that
//!    node is cut off from the store at the time (a partition longer than the
//!    keep-alive expiry looks like a death to the host, and its workers cannot
//!    use the store anyway).
//! 4. Every node ends: within a bound after a failure is published; after
//!    the exit barrier passed, within a bound once its rendezvous host has
//!    ended (killed, or exited: the host leaves last, so nobody needs a
//!    lingering node's stores any more; its connection is refused, unlike a
//!    stalled store's); and by the end of the simulated time otherwise (no
//!    hang).
//! 5. Every node that read the published failure reports the same root cause,
//!    the earliest failure recorded when it was published (a node that could
//!    not reach the store reports its own).
//!
//! # Proof that it tests something
//!
//! The seeds test counts the faults that happened, by kind, prints them and
//! fails if a kind stops happening. Each invariant has a test that breaks one
//! rule on purpose ([`Sabotage`]) and requires the first seed that fails to
//! break that invariant: a check that cannot fail would pass it too.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, VecDeque};
use std::time::{Duration, Instant};

use super::policy::{
    Action, Event, Limits, Observation, Phase, Policy, Publish, StartError, Verdict,
};
use super::run_store::{Closed, FailureRecord};
use rallypoint_rendezvous::dynamic::{RING_INTERVALS, WATCHERS};

/// How long a job store keeps a dead client's connection open: the server's
/// TCP keep-alive (30 s idle, then three probes 10 s apart) and, with data
/// unanswered, its `TCP_USER_TIMEOUT` (60 s).
const KEEPALIVE_DROP_MS: u64 = 60_000;
/// The static backend's dead marks are of one round for the whole run.
const STATIC_ROUND: u64 = u64::MAX;
/// The driver's bound on one store call at the end of a run (`CHECK_TIMEOUT`).
const CHECK_MS: u64 = 2_000;
/// The store client's timeout (rank assignment, the job store's address).
const STORE_TIMEOUT_MS: u64 = 60_000;
/// How often a join probes the run store (`JOIN_PROBE`).
const JOIN_PROBE_MS: u64 = 1_000;
/// The rendezvous' bound on one join (`join_timeout`, PyTorch's 600 s).
const JOIN_TIMEOUT_MS: u64 = 600_000;
/// Simulated time after which a node still running is a hang.
const HORIZON_MS: u64 = 3_600_000;

/// A small, fast, seedable generator (splitmix64).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }

    pub fn chance(&mut self, p: f64) -> bool {
        ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64) < p
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Static,
    C10d,
}

/// The shape of one simulated run, drawn from the seed.
#[derive(Debug, Clone)]
pub struct Config {
    pub seed: u64,
    pub backend: Backend,
    /// Nodes started at time 0.
    pub nodes: usize,
    /// Nodes that arrive later (c10d only).
    pub late: usize,
    pub min_nodes: usize,
    pub max_restarts: u32,
    pub monitor_ms: u64,
    pub lost_grace_ms: u64,
    pub shutdown_ms: u64,
    pub exit_barrier_ms: u64,
    pub keep_alive_ms: u64,
    pub misses: u64,
    pub last_call_ms: u64,
    /// Workers whose failure does not bring down the other nodes' workers.
    pub independent_workers: bool,
}

impl Config {
    pub fn from_seed(seed: u64) -> Config {
        let mut r = Rng::new(seed ^ 0x5151_5151);
        let backend = if r.chance(0.4) {
            Backend::Static
        } else {
            Backend::C10d
        };
        let nodes = match r.range(0, 9) {
            0 => r.range(9, 64) as usize,
            1..=3 => 2,
            _ => r.range(3, 8) as usize,
        };
        let late = match backend {
            Backend::C10d if r.chance(0.2) => r.range(1, 2) as usize,
            _ => 0,
        };
        let min_nodes = match backend {
            Backend::Static => nodes,
            Backend::C10d => r.range(1, nodes as u64) as usize,
        };
        Config {
            seed,
            backend,
            nodes,
            late,
            min_nodes,
            max_restarts: r.range(0, 3) as u32,
            monitor_ms: [100, 500, 1000][r.range(0, 2) as usize],
            lost_grace_ms: [2_000, 5_000, 10_000][r.range(0, 2) as usize],
            shutdown_ms: [100, 1_000, 5_000][r.range(0, 2) as usize],
            exit_barrier_ms: if r.chance(0.3) { 1_000 } else { 300_000 },
            keep_alive_ms: [200, 1_000, 5_000][r.range(0, 2) as usize],
            misses: r.range(1, 3),
            last_call_ms: [100, 1_000][r.range(0, 1) as usize],
            independent_workers: r.chance(0.2),
        }
    }
}

/// Faults that happened in a run, by kind (see "Faults" in the module docs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Fired {
    pub kills: u64,
    pub signals: u64,
    pub stalls: u64,
    pub partitions: u64,
    /// Worker groups that failed of themselves.
    pub worker_failures: u64,
    /// Nodes that arrived late (c10d).
    pub late_nodes: u64,
}

impl Fired {
    /// Each kind with its count, in a fixed order.
    pub fn kinds(&self) -> [(&'static str, u64); 6] {
        [
            ("kills", self.kills),
            ("signals", self.signals),
            ("stalls", self.stalls),
            ("partitions", self.partitions),
            ("worker failures", self.worker_failures),
            ("late nodes", self.late_nodes),
        ]
    }

    /// Faults of every kind (invariant 2).
    pub fn total(&self) -> u64 {
        self.kinds().iter().map(|(_, n)| n).sum()
    }
}

/// A rule broken on purpose, to show that an invariant can fail (the tests
/// `invariant_*_catches_*`). The policy is the real one and cannot be broken
/// from here: each breaks the model of the world around it (what a store
/// answers, how a node lingers) or of what to expect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sabotage {
    /// Invariant 1: a lingering node's last read of the verdict is stale: it
    /// does not see a failure published meanwhile.
    StaleLingerRead,
    /// Invariant 2: the model does not count a worker group's own failure as
    /// a fault.
    UncountedWorkerFailure,
    /// Invariant 3: a lingering node ends at its first look, without
    /// waiting for the nodes that use its stores.
    NoLinger,
    /// Invariant 4: a lingering node never ends (the answer to its linger is
    /// lost).
    EndlessLinger,
    /// Invariant 5: the run store answers each reader of a failed verdict
    /// with a root cause of the reader's own.
    OwnRootCause,
}

/// How a worker group's run ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Succeeds,
    /// It fails of itself (drawn at its spawn): a fault, when it happens.
    Fails,
    /// It fails because another group or its job store went: a consequence
    /// of something else.
    Broken,
}

/// A fault that lasts a while: it happens once, when some node it concerns
/// runs during it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Window {
    /// The store stall of that index in `Shared::stalls`.
    Stall(usize),
    /// Node `i`'s partition from the run store.
    Partition(usize),
}

/// One worker group (a node's workers in one round).
#[derive(Debug, Clone)]
struct Workers {
    round: u64,
    /// Running; `told` once the agent signalled them to stop.
    running: bool,
    told: bool,
    failure: Option<Box<FailureRecord>>,
}

#[derive(Debug, Clone, PartialEq)]
enum Life {
    NotStarted,
    Alive,
    Killed,
    Exited(Verdict),
}

#[derive(Debug, Clone)]
struct Node {
    policy: Policy,
    queue: VecDeque<Action>,
    life: Life,
    /// Bumped whenever the node's pending waits become stale (an action
    /// completes, the phase changes); a timed event carries the value it saw.
    gen: u64,
    latency: u64,
    partitioned: (u64, u64),
    /// Its watch looks every monitor interval (the store did not answer).
    polling: bool,
    /// The round it is a member of, with its rank and the member count.
    round: Option<(u64, usize, usize)>,
    /// Static: the node's own count of rounds.
    local_round: u64,
    workers: Option<Workers>,
    /// The round whose job store this node serves, while it does.
    job_store: Option<u64>,
    /// In a join, waiting for the round to form.
    joining: bool,
    /// Joins so far (tells a join's timeout from a later join's).
    joins: u64,
    /// A signal reached it.
    signalled: bool,
    exited_at: Option<u64>,
    killed_at: Option<u64>,
    /// Since when it lingers after the exit barrier passed.
    lingering_after_barrier: Option<u64>,
    /// It lingers serving a store others use (the policy's word).
    linger_serves: bool,
    /// The step at which an answer carrying the verdict reached it.
    read_at: Option<u64>,
    /// Counted in the census; left the rendezvous (counted out).
    counted_in: bool,
    left: bool,
    /// It claimed its census key in its current round (`Standing::reconcile`).
    reconciled: bool,
    /// The step at which it last read or wrote the verdict (its decision,
    /// invariant 1). Steps, not milliseconds: two events of one millisecond
    /// still happen in an order.
    decided_at: Option<u64>,
}

#[derive(Debug, Clone)]
enum Ev {
    Boot(usize),
    /// Perform the node's next queued action.
    Act(usize),
    Deliver(usize, Event),
    /// The node's watch looks at the run: woken by the store (with the round
    /// it was woken for: only while still a member of it), or its first look.
    Wake(usize, Option<u64>),
    /// The watch looks again while the store does not answer.
    Poll(usize),
    WorkersEnd(usize, u64, End),
    Kill(usize),
    Signal(usize, i32),
    LastCall(u64),
    /// Node, round, and whether the slow ring watch already waited.
    DeadCheck(usize, u64, bool),
    /// Node `i` spawns the workers of `round`, if it still starts it.
    Spawn(usize, u64),
    /// Join number `n` of node `i` reaches `join_timeout`.
    JoinTimeout(usize, u64),
    /// Join number `n` of node `i` probes the run store (unreachable since).
    JoinProbe(usize, u64, Option<u64>),
    /// Static: the keep-alive watcher of node `i` looks at its heartbeat.
    StaticDeadCheck(usize, bool),
    /// Node `i`, partitioned, has not beaten for a keep-alive expiry: if it
    /// still does not reach the store, its watcher finds it as it finds a
    /// node that stopped keeping alive.
    SilentCheck(usize),
    /// Node `i`'s first beat after a partition or a stall: it reconciles
    /// its standing in the census (it may have been found dead meanwhile).
    BeatBack(usize),
    BarrierTimeout(usize, u64, u64),
    StartTimeout(usize, u64, u64),
    /// A lingering node looks again.
    LingerPoll(Linger),
    /// The store stall of that index begins.
    StallBegins(usize),
    /// Node `i`'s partition from the run store, drawn to begin at `t`, begins.
    PartitionBegins(usize, u64),
}

/// One lingering node's state between its polls.
#[derive(Debug, Clone, Copy)]
struct Linger {
    node: usize,
    gen: u64,
    /// The bound, if any.
    until: Option<u64>,
    unreachable_since: Option<u64>,
    /// Since when no member it could wait for beats.
    quiet_since: Option<u64>,
    /// Since when the census (or the pulse) says everyone is out.
    out_since: Option<u64>,
    /// Since when the census reads 0 (`census::Zero`).
    zero_since: Option<u64>,
    /// The exit barrier passed.
    after_barrier: bool,
}

/// The shared run store and rendezvous.
#[derive(Debug, Default)]
struct Shared {
    verdict: Option<Closed>,
    /// When a failure was first published, and the earliest recorded failure then.
    failed_at: Option<u64>,
    /// The step at which the failure was published.
    failed_step: Option<u64>,
    root_at_publish: Option<Box<FailureRecord>>,
    root: Option<Box<FailureRecord>>,
    failed_round: BTreeSet<u64>,
    failed_rounds: u64,
    finishing: BTreeSet<u64>,
    // Rendezvous.
    closed: bool,
    next_round: u64,
    joiners: Vec<usize>,
    last_call_armed: bool,
    members: BTreeMap<u64, Vec<usize>>,
    waiting: BTreeMap<u64, usize>,
    dead: BTreeMap<u64, BTreeSet<usize>>,
    left: BTreeMap<u64, BTreeSet<usize>>,
    /// The rendezvous' census: nodes counted in, out, and found dead.
    census_joined: i64,
    census_gone: i64,
    census_dead: i64,
    /// Census keys claimed, by a watcher that found the node dead or by the
    /// node itself, per (round, node); `STATIC_ROUND` for the static
    /// backend's one set of keys (`census::Standing`: whoever is first
    /// decides who counts the node out).
    census_keys: BTreeSet<(u64, usize)>,
    /// Static: nodes found dead by their watcher, and nodes that left.
    static_dead: BTreeSet<usize>,
    static_left: BTreeSet<usize>,
    started: BTreeMap<u64, BTreeSet<usize>>,
    barrier: BTreeMap<u64, BTreeSet<usize>>,
    /// Store stalls: (from, until).
    stalls: Vec<(u64, u64)>,
}

/// A simulated run.
pub struct Sim {
    pub cfg: Config,
    rng: Rng,
    now: u64,
    /// Events handled so far: the order of everything that happens.
    steps: u64,
    seq: u64,
    queue: BinaryHeap<Reverse<(u64, u64, usize)>>,
    events: Vec<Option<Ev>>,
    nodes: Vec<Node>,
    s: Shared,
    base: Instant,
    /// Faults that happened so far (invariant 2).
    pub fired: Fired,
    /// Lasting faults that happened already (each counts once).
    windows: BTreeSet<Window>,
    pub trace: Vec<String>,
    keep_trace: bool,
    /// The first broken invariant.
    broken: Option<String>,
    /// The invariants enforced (by number); the others are not checked.
    enforced: Vec<u8>,
    /// A rule broken on purpose (see [`Sabotage`]).
    sabotage: Option<Sabotage>,
}

/// A broken invariant, with the trace that led to it.
#[derive(Debug)]
pub struct Violation {
    pub seed: u64,
    pub what: String,
    pub trace: Vec<String>,
    /// The rule broken on purpose in that run, if any.
    pub sabotage: Option<Sabotage>,
}

impl Violation {
    /// The number of the invariant broken (`None`: a check of the model
    /// itself, such as a node finishing with its workers running).
    pub fn invariant(&self) -> Option<u8> {
        invariant_of(&self.what)
    }
}

/// The invariant a violation's text names (`invariant N: ...`).
fn invariant_of(what: &str) -> Option<u8> {
    what.strip_prefix("invariant ")?
        .split(':')
        .next()?
        .parse()
        .ok()
}

/// The command that replays `seed` with its trace.
pub fn replay_command(seed: u64) -> String {
    rallypoint_simkit::replay_command(
        "rallypoint-elastic",
        "--lib",
        "agent::sim::tests::ten_thousand_seeds_keep_every_invariant",
        seed,
    )
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "seed {}: {}", self.seed, self.what)?;
        match self.sabotage {
            None => writeln!(f, "replay: {}", replay_command(self.seed))?,
            Some(s) => writeln!(f, "(with {s:?} broken on purpose)")?,
        }
        for l in self.trace.iter().rev().take(40).rev() {
            writeln!(f, "  {l}")?;
        }
        Ok(())
    }
}

impl Sim {
    pub fn new(seed: u64, keep_trace: bool) -> Sim {
        let cfg = Config::from_seed(seed);
        let mut rng = Rng::new(seed);
        let total = cfg.nodes + cfg.late;
        let limits = |i: usize| Limits {
            max_restarts: cfg.max_restarts,
            lost_grace: Duration::from_millis(cfg.lost_grace_ms),
            hosts_rendezvous: i == 0,
            linger_after_failure: Duration::from_millis(
                cfg.shutdown_ms + cfg.monitor_ms + 2 * CHECK_MS + cfg.lost_grace_ms,
            ),
            linger_after_success: None,
            reforms: cfg.backend == Backend::C10d,
        };
        let nodes = (0..total)
            .map(|i| {
                let (policy, first) = Policy::start(limits(i));
                Node {
                    policy,
                    queue: VecDeque::from([first]),
                    life: Life::NotStarted,
                    gen: 0,
                    latency: if rng.chance(0.1) {
                        rng.range(20, 200)
                    } else {
                        rng.range(1, 5)
                    },
                    partitioned: (0, 0),
                    polling: false,
                    round: None,
                    local_round: 0,
                    workers: None,
                    job_store: None,
                    joining: false,
                    joins: 0,
                    signalled: false,
                    exited_at: None,
                    killed_at: None,
                    lingering_after_barrier: None,
                    linger_serves: false,
                    decided_at: None,
                    read_at: None,
                    counted_in: false,
                    reconciled: false,
                    left: false,
                }
            })
            .collect();
        let mut sim = Sim {
            cfg,
            rng,
            now: 0,
            steps: 0,
            seq: 0,
            queue: BinaryHeap::new(),
            events: Vec::new(),
            nodes,
            s: Shared::default(),
            base: Instant::now(),
            fired: Fired::default(),
            windows: BTreeSet::new(),
            trace: Vec::new(),
            keep_trace,
            broken: None,
            enforced: vec![1, 2, 3, 4, 5],
            sabotage: None,
        };
        sim.schedule_faults();
        sim
    }

    fn at(&mut self, t: u64, ev: Ev) {
        self.seq += 1;
        self.events.push(Some(ev));
        self.queue
            .push(Reverse((t, self.seq, self.events.len() - 1)));
    }

    fn note(&mut self, f: impl FnOnce() -> String) {
        if self.keep_trace {
            let line = format!("{:>9} ms  {}", self.now, f());
            self.trace.push(line);
        }
    }

    fn schedule_faults(&mut self) {
        let n = self.cfg.nodes;
        for i in 0..n {
            let t = self.rng.range(0, 50);
            self.at(t, Ev::Boot(i));
        }
        for i in n..n + self.cfg.late {
            let t = self.rng.range(1_000, 60_000);
            self.at(t, Ev::Boot(i));
        }
        let total = n + self.cfg.late;
        let faults = self.rng.range(0, 4);
        for _ in 0..faults {
            let t = self.rng.range(0, 120_000);
            match self.rng.range(0, 3) {
                0 => {
                    let who = self.rng.range(0, total as u64 - 1) as usize;
                    self.at(t, Ev::Kill(who));
                }
                1 => {
                    let d = self.rng.range(100, 2 * self.cfg.lost_grace_ms);
                    self.s.stalls.push((t, t + d));
                    self.at(t, Ev::StallBegins(self.s.stalls.len() - 1));
                    for k in 0..total {
                        self.beat_fails(k, t);
                        let back = t + d + self.rng.range(0, self.cfg.keep_alive_ms);
                        self.at(back, Ev::BeatBack(k));
                    }
                }
                2 => {
                    let who = self.rng.range(0, total as u64 - 1) as usize;
                    let d = self.rng.range(100, 2 * self.cfg.lost_grace_ms);
                    self.nodes[who].partitioned = (t, t + d);
                    self.at(t, Ev::PartitionBegins(who, t));
                    self.beat_fails(who, t);
                    // Its beats stop reaching the store: for a watcher it
                    // looks dead once they are stale (see `DeadCheck`).
                    let stale =
                        t + self.cfg.keep_alive_ms * self.cfg.misses + self.cfg.keep_alive_ms / 4;
                    self.at(stale, Ev::SilentCheck(who));
                    let back = t + d + self.rng.range(0, self.cfg.keep_alive_ms);
                    self.at(back, Ev::BeatBack(who));
                }
                _ => {
                    let who = self.rng.range(0, total as u64 - 1) as usize;
                    let sig = if self.rng.chance(0.5) {
                        libc::SIGTERM
                    } else {
                        libc::SIGINT
                    };
                    self.at(t, Ev::Signal(who, sig));
                }
            }
        }
    }

    /// A lasting fault happens (once).
    fn window_fired(&mut self, w: Window) {
        if !self.windows.insert(w) {
            return;
        }
        match w {
            Window::Stall(_) => self.fired.stalls += 1,
            Window::Partition(_) => self.fired.partitions += 1,
        }
        self.note(|| format!("{w:?} happens"));
    }

    /// Node `i` boots: a stall, or its partition, under way happens to it.
    fn windows_at_boot(&mut self, i: usize) {
        let t = self.now;
        let stalls: Vec<usize> = (0..self.s.stalls.len())
            .filter(|&k| {
                let (a, b) = self.s.stalls[k];
                a <= t && t < b
            })
            .collect();
        for k in stalls {
            self.window_fired(Window::Stall(k));
        }
        let (a, b) = self.nodes[i].partitioned;
        if i != 0 && a <= t && t < b {
            self.window_fired(Window::Partition(i));
        }
    }

    /// The store stops answering node `k` at `t`: its next beat (within an
    /// interval) fails after an interval's bound and wakes its watch.
    fn beat_fails(&mut self, k: usize, t: u64) {
        let ka = self.cfg.keep_alive_ms;
        let when = t + self.rng.range(0, ka) + ka;
        self.at(when, Ev::Wake(k, None));
    }

    /// Wakes the watch of every member of round `r` (a node waiting, a member
    /// dead), or of every node (`None`: a verdict published, the store gone).
    fn wake(&mut self, r: Option<u64>) {
        for k in 0..self.nodes.len() {
            let member = r.is_none_or(|r| self.nodes[k].round.is_some_and(|(rk, _, _)| rk == r));
            if self.alive(k) && member {
                let t = self.now + self.nodes[k].latency;
                self.at(t, Ev::Wake(k, r));
            }
        }
    }

    fn instant(&self) -> Instant {
        self.base + Duration::from_millis(self.now)
    }

    /// Whether node `i` reaches the run store (on node 0) now.
    fn reaches(&self, i: usize) -> bool {
        let host = &self.nodes[0];
        if matches!(host.life, Life::Killed) || host.exited_at.is_some() {
            return false;
        }
        !self.cut_off(i)
    }

    /// Whether node `i` is cut off from the run store by a fault now: the
    /// store stalled, or `i` partitioned from it (never the host, node 0,
    /// from its own store).
    fn cut_off(&self, i: usize) -> bool {
        let t = self.now;
        if self.s.stalls.iter().any(|&(a, b)| a <= t && t < b) {
            return true;
        }
        let (a, b) = self.nodes[i].partitioned;
        i != 0 && a <= t && t < b
    }

    /// [`Self::reaches`] as it stood before node `ending` took its stores
    /// with it: the checks of invariant 3 at a host's end ask whether a node
    /// was cut off by a fault, and the run store's host (node 0) counts as
    /// ended from its own end on, which would exempt everyone. A node found
    /// dead in its workers' round is exempt too, cut off now or not: it was
    /// silent to the host for a keep-alive expiry, and the host waits for no
    /// dead member (seeds 8412 and 9150: a partition that healed after the
    /// node was found dead).
    fn reached_before_end(&self, k: usize, ending: usize) -> bool {
        let round = self.nodes[k].workers.as_ref().map(|w| w.round);
        let found_dead = self.s.static_dead.contains(&k)
            || round.is_some_and(|r| self.s.dead.get(&r).is_some_and(|d| d.contains(&k)));
        if found_dead {
            false
        } else if ending == 0 {
            !self.cut_off(k)
        } else {
            self.reaches(k)
        }
    }

    /// The verdict `v` as node `i` reads it: as stored, but with a root cause
    /// of `i`'s own under [`Sabotage::OwnRootCause`].
    fn as_read(&self, i: usize, v: Closed) -> Closed {
        match v {
            Closed::Failed(_) if self.sabotage == Some(Sabotage::OwnRootCause) => {
                let (round, rank) = self.nodes[i].round.map_or((0, 0), |r| (r.0, r.1));
                Closed::Failed(Some(record(self.now, i, rank, round)))
            }
            v => v,
        }
    }

    fn alive(&self, i: usize) -> bool {
        self.nodes[i].life == Life::Alive
    }

    /// Feeds `event` to node `i`'s policy and queues what it answers.
    fn deliver(&mut self, i: usize, event: Event) {
        if !self.alive(i) {
            return;
        }
        self.note(|| format!("node {i} <- {event:?}"));
        if matches!(
            event,
            Event::Published(_) | Event::VerdictRead(Some(_)) | Event::Lingered(Some(_))
        ) {
            self.nodes[i].read_at = Some(self.steps);
        }
        let before = self.nodes[i].policy.phase().name();
        let now = self.instant();
        let actions = self.nodes[i].policy.on(event, now);
        if self.nodes[i].policy.phase().name() != before {
            self.nodes[i].gen += 1;
        }
        let empty = self.nodes[i].queue.is_empty();
        self.nodes[i].queue.extend(actions);
        if empty && !self.nodes[i].queue.is_empty() {
            let t = self.now;
            self.at(t, Ev::Act(i));
        }
    }

    /// Answers `event` to node `i` after its latency, unless its phase moved on.
    fn reply(&mut self, i: usize, delay: u64, event: Event) {
        let t = self.now + delay;
        self.at(t, Ev::Deliver(i, event));
    }

    fn observe(&self, i: usize) -> Observation {
        if !self.reaches(i) {
            return Observation::Unreachable("store unreachable".into());
        }
        if let Some(v) = &self.s.verdict {
            return Observation::Closed(self.as_read(i, v.clone()));
        }
        let Some((round, _, _)) = self.nodes[i].round else {
            return Observation::Healthy;
        };
        let (waiting, dead) = match self.cfg.backend {
            Backend::Static => (0, self.s.static_dead.len()),
            Backend::C10d => (
                self.s.waiting.get(&round).copied().unwrap_or(0),
                self.s.dead.get(&round).map_or(0, BTreeSet::len),
            ),
        };
        if waiting == 0 && dead == 0 {
            return Observation::Healthy;
        }
        Observation::Changed {
            waiting,
            dead,
            finishing: waiting > 0 && self.s.finishing.contains(&round),
            lost: Vec::new(),
        }
    }

    /// Performs node `i`'s next action.
    fn act(&mut self, i: usize) {
        if !self.alive(i) {
            return;
        }
        let Some(action) = self.nodes[i].queue.pop_front() else {
            return;
        };
        self.note(|| format!("node {i} -> {action:?}"));
        let lat = self.nodes[i].latency;
        let reach = self.reaches(i);
        // The next queued action runs once this one has answered (or at once
        // for the notes, which answer nothing).
        let mut next_now = false;
        match action {
            Action::Join => self.join(i),
            Action::Start { round } => self.start(i, round),
            Action::Stop { .. } => self.stop(i),
            Action::Kill => next_now = true,
            Action::RecordFailure { round } => {
                if reach {
                    let rank = self.nodes[i].round.map_or(0, |r| r.1);
                    let failure = self.nodes[i]
                        .workers
                        .as_ref()
                        .and_then(|w| w.failure.clone())
                        .unwrap_or_else(|| record(self.now, i, rank, round));
                    if self.s.root.as_ref().is_none_or(|r| failure.time < r.time) {
                        self.s.root = Some(failure);
                    }
                    if self.s.failed_round.insert(round) {
                        self.s.failed_rounds += 1;
                    }
                    let n = self.s.failed_rounds;
                    let finishing = self.s.finishing.contains(&round);
                    self.reply(
                        i,
                        lat,
                        Event::FailureRecorded {
                            failed_rounds: n,
                            finishing,
                        },
                    );
                } else {
                    self.reply(i, CHECK_MS, Event::FailureNotRecorded("unreachable".into()));
                }
            }
            Action::EnterBarrier { round } => self.barrier(i, round),
            Action::Publish(p) => {
                if reach {
                    self.nodes[i].decided_at = Some(self.steps);
                    let closed = self.publish(&p);
                    let closed = self.as_read(i, closed);
                    self.reply(i, lat, Event::Published(closed));
                } else {
                    self.reply(i, CHECK_MS, Event::NotPublished("unreachable".into()));
                }
            }
            Action::ReadVerdict => {
                // The handler's run store: readable before any round.
                if reach {
                    self.nodes[i].decided_at = Some(self.steps);
                    let v = self.s.verdict.clone().map(|v| self.as_read(i, v));
                    self.reply(i, lat, Event::VerdictRead(v));
                } else {
                    self.reply(i, CHECK_MS, Event::NotPublished("unreachable".into()));
                }
            }
            Action::CloseRendezvous => {
                if reach {
                    self.close();
                }
                self.reply(
                    i,
                    if reach { lat } else { CHECK_MS },
                    Event::RendezvousClosed,
                );
            }
            Action::MarkFinished { .. } => {
                self.leave(i);
                self.reply(i, if reach { lat } else { CHECK_MS }, Event::MarkedFinished);
            }
            Action::Linger {
                bound,
                after_barrier,
                serves,
                ..
            } => {
                self.nodes[i].linger_serves = serves;
                let until = bound.map(|b| self.now + b.as_millis() as u64);
                let gen = self.nodes[i].gen;
                let t = self.now;
                if after_barrier {
                    self.nodes[i].lingering_after_barrier = Some(t);
                }
                self.at(
                    t,
                    Ev::LingerPoll(Linger {
                        node: i,
                        gen,
                        until,
                        unreachable_since: None,
                        quiet_since: None,
                        out_since: None,
                        zero_since: None,
                        after_barrier,
                    }),
                );
            }
            Action::NoteClosedAfterSuccess { .. }
            | Action::NoteUnreachable { .. }
            | Action::NoteReform { .. }
            | Action::NoteRestart { .. }
            | Action::NoteRecordRetry { .. } => next_now = true,
            Action::Finish(v) => self.finish(i, v),
        }
        if next_now && !self.nodes[i].queue.is_empty() {
            let t = self.now;
            self.at(t, Ev::Act(i));
        }
    }

    fn publish(&mut self, p: &Publish) -> Closed {
        match (&self.s.verdict, p) {
            (Some(c @ Closed::Failed(_)), _) => c.clone(),
            (Some(Closed::Succeeded), Publish::Succeeded) => Closed::Succeeded,
            (None, Publish::Succeeded) => {
                self.s.verdict = Some(Closed::Succeeded);
                self.wake(None);
                Closed::Succeeded
            }
            (_, Publish::Failed { local }) => {
                let root = match (self.s.root.clone(), local.clone()) {
                    (Some(a), Some(b)) => Some(if b.time < a.time { b } else { a }),
                    (a, b) => a.or(b),
                };
                self.s.verdict = Some(Closed::Failed(root.clone()));
                self.s.failed_at = Some(self.now);
                self.s.failed_step = Some(self.steps);
                self.s.root_at_publish = root.clone();
                self.wake(None);
                Closed::Failed(root)
            }
        }
    }

    /// Closes the rendezvous: every node waiting in a join learns it.
    fn close(&mut self) {
        self.s.closed = true;
        for j in std::mem::take(&mut self.s.joiners) {
            self.nodes[j].joining = false;
            let lat = self.nodes[j].latency;
            self.reply(j, lat, Event::JoinClosed);
        }
    }

    fn join(&mut self, i: usize) {
        let lat = self.nodes[i].latency;
        // The previous round ends: workers gone (the stop already happened);
        // the job store stays up until this join ends.
        if !self.reaches(i) {
            // The driver's probes give up after `lost_grace`, plus one probe.
            self.reply(
                i,
                self.cfg.lost_grace_ms + JOIN_PROBE_MS,
                Event::JoinFailed("store unreachable".into()),
            );
            return;
        }
        if self.s.closed {
            self.reply(i, lat, Event::JoinClosed);
            return;
        }
        match self.cfg.backend {
            Backend::Static => {
                let round = self.nodes[i].local_round;
                self.nodes[i].local_round += 1;
                let n = self.cfg.nodes;
                self.end_job_store(i);
                self.nodes[i].round = Some((round, i, n));
                self.count_in(i);
                self.reply(i, lat, Event::Joined { round, nodes: n });
            }
            Backend::C10d => {
                // A node arriving while the latest round still has members
                // (or a member coming back) waits for the next one: the
                // members see it as waiting.
                if let Some((&r, _)) = self.s.members.iter().next_back() {
                    *self.s.waiting.entry(r).or_default() += 1;
                    self.wake(Some(r));
                }
                // Leaving its round for the next: said, so it is not counted
                // dead there.
                if let Some((r, rank, _)) = self.nodes[i].round {
                    self.s.left.entry(r).or_default().insert(rank);
                }
                self.nodes[i].joining = true;
                self.nodes[i].joins += 1;
                let t = self.now + JOIN_TIMEOUT_MS;
                self.at(t, Ev::JoinTimeout(i, self.nodes[i].joins));
                let t = self.now + JOIN_PROBE_MS;
                self.at(t, Ev::JoinProbe(i, self.nodes[i].joins, None));
                self.s.joiners.push(i);
                self.try_form(false);
            }
        }
    }

    /// Forms the next c10d round if it can: with every live node that could
    /// join, at once; with `min` after the last call.
    fn try_form(&mut self, last_call: bool) {
        // A round forms only once the last one has no member still in it (as
        // the real state machine: late nodes wait for the members to re-join).
        if self.round_active() {
            return;
        }
        // At `max` at once; at `min` or more after the last call.
        let joiners = self.s.joiners.len();
        let max = self.cfg.nodes + self.cfg.late;
        if joiners < self.cfg.min_nodes.max(1) {
            return;
        }
        if !(joiners >= max || last_call) {
            if !self.s.last_call_armed {
                self.s.last_call_armed = true;
                let round = self.s.next_round;
                let t = self.now + self.cfg.last_call_ms;
                self.at(t, Ev::LastCall(round));
            }
            return;
        }
        let round = self.s.next_round;
        self.s.next_round += 1;
        self.s.last_call_armed = false;
        let mut members = std::mem::take(&mut self.s.joiners);
        // Ranks follow the nodes' ids (their natural order in the real
        // rendezvous), which have nothing to do with who hosts the store: so
        // the rendezvous host is rank 0, and hosts the job store, only
        // sometimes. Drawn from the seed without touching the schedule's
        // generator.
        let seed = self.cfg.seed;
        members.sort_by_key(|&j| {
            (
                Rng::new(seed ^ (j as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)).next_u64(),
                j,
            )
        });
        let n = members.len();
        self.s.members.insert(round, members.clone());
        for (rank, &j) in members.iter().enumerate() {
            self.nodes[j].joining = false;
            // A node found dead in its last round (partitioned for an
            // expiry) counts itself in again; its claim keeps any later
            // watcher of that round from counting it dead.
            if self.nodes[j].counted_in {
                self.reconcile(j);
            }
            self.nodes[j].reconciled = false;
            self.end_job_store(j);
            self.nodes[j].round = Some((round, rank, n));
            self.count_in(j);
            let lat = self.nodes[j].latency;
            self.reply(j, lat, Event::Joined { round, nodes: n });
        }
    }

    /// Whether a member of the latest round is still in it (alive, not
    /// joining again, not ended).
    fn round_active(&self) -> bool {
        let Some((&r, members)) = self.s.members.iter().next_back() else {
            return false;
        };
        members.iter().any(|&k| {
            self.alive(k)
                && !self.nodes[k].joining
                && self.nodes[k].round.is_some_and(|(rk, _, _)| rk == r)
        })
    }

    /// Node `j`'s job store of an earlier round goes (after its next join).
    fn end_job_store(&mut self, j: usize) {
        if let Some(r) = self.nodes[j].job_store.take() {
            self.job_store_gone(j, r, true);
        }
    }

    /// The job store of round `r` on node `j` goes away; `voluntary` when its
    /// agent shut it (invariant 3), not a crash.
    fn job_store_gone(&mut self, j: usize, r: u64, voluntary: bool) {
        self.note(|| format!("job store of round {r} on node {j} goes"));
        for k in 0..self.nodes.len() {
            if k == j || !self.alive(k) {
                continue;
            }
            let Some(w) = &self.nodes[k].workers else {
                continue;
            };
            if w.round == r && w.running && !w.told {
                // A node cut off from the store (partitioned) has been silent
                // to the host for a keep-alive expiry, as a dead one would be:
                // its workers cannot reach the job store anyway, and its agent
                // stops them at its own `lost_grace`.
                if voluntary && self.reached_before_end(k, j) {
                    self.violation(format!(
                        "invariant 3: node {j} shut the job store of round {r} while node {k}'s workers of that round run"
                    ));
                }
                // Either way the workers lose their store: they fail.
                let t = self.now + self.rng.range(1, 500);
                self.at(t, Ev::WorkersEnd(k, r, End::Broken));
            }
        }
    }

    /// The watch of node `i` looks at the run, if its phase watches it; while
    /// the store does not answer it looks again every monitor interval.
    fn look(&mut self, i: usize) {
        let watched = matches!(
            self.nodes[i].policy.phase(),
            Phase::Starting { .. } | Phase::Running { .. } | Phase::ExitBarrier { .. }
        );
        if !self.alive(i) || !watched {
            return;
        }
        // The driver reads the watch only between its actions (the watch
        // keeps the latest look until then): a node with an action still to
        // perform (a `Start` queued after `Joined`) looks once it is performed.
        if !self.nodes[i].queue.is_empty() {
            let t = self.now + 1;
            self.at(t, Ev::Wake(i, None));
            return;
        }
        let o = self.observe(i);
        if matches!(o, Observation::Unreachable(_)) && !self.nodes[i].polling {
            self.nodes[i].polling = true;
            let t = self.now + self.cfg.monitor_ms.clamp(100, 1000);
            self.at(t, Ev::Poll(i));
        }
        self.deliver(i, Event::Checked(o));
    }

    fn start(&mut self, i: usize, round: u64) {
        let Some((_, rank, n)) = self.nodes[i].round else {
            return;
        };
        // The round's watch, armed 0.1 s (or one monitor interval) later: a
        // look then (what the arming finds if anything changed before), then
        // only when woken.
        let t = self.now + self.cfg.monitor_ms.min(100);
        self.at(t, Ev::Wake(i, Some(round)));
        if !self.reaches(i) {
            self.reply(
                i,
                STORE_TIMEOUT_MS,
                Event::StartFailed(StartError::Store("unreachable".into())),
            );
            return;
        }
        let arrived = self.s.started.entry(round).or_default();
        arrived.insert(i);
        if arrived.len() < n {
            let t = self.now + STORE_TIMEOUT_MS;
            let gen = self.nodes[i].gen;
            self.at(t, Ev::StartTimeout(i, gen, round));
            return;
        }
        // The last to arrive releases everyone.
        let everyone: Vec<usize> = arrived.iter().copied().collect();
        let _ = rank;
        for j in everyone {
            // Each finishes its setup (the job store's address) after its
            // latency, then spawns.
            let t = self.now + self.nodes[j].latency;
            self.at(t, Ev::Spawn(j, round));
        }
    }

    fn spawn_workers(&mut self, j: usize, round: u64) {
        let rank = self.nodes[j].round.map_or(0, |r| r.1);
        let hosts = rank == 0 && self.cfg.backend == Backend::C10d;
        if hosts {
            self.nodes[j].job_store = Some(round);
        }
        self.nodes[j].workers = Some(Workers {
            round,
            running: true,
            told: false,
            failure: None,
        });
        let fails = self.rng.chance(0.15);
        let d = self.rng.range(500, 60_000);
        // A fault only if it fails while it runs (see `Ev::WorkersEnd`).
        let end = if fails { End::Fails } else { End::Succeeds };
        let t = self.now + d;
        self.at(t, Ev::WorkersEnd(j, round, end));
        // As the driver: spawned, then `Started` at once (no signal between).
        self.deliver(
            j,
            Event::Started {
                hosts_job_store: hosts,
            },
        );
    }

    fn stop(&mut self, i: usize) {
        let shutdown = self.cfg.shutdown_ms;
        let lat = self.nodes[i].latency;
        let (round, failure) = match &mut self.nodes[i].workers {
            Some(w) => {
                w.told = true;
                (Some(w.round), w.failure.clone())
            }
            None => (None, None),
        };
        if let Some(w) = &self.nodes[i].workers {
            if w.running && self.fired.total() == 0 {
                self.violation(format!(
                    "invariant 2: node {i} stops healthy workers in a run without any fault"
                ));
            }
        }
        let was_running = self.nodes[i].workers.as_ref().is_some_and(|w| w.running);
        if let Some(w) = &mut self.nodes[i].workers {
            w.running = false;
        }
        if let (Some(r), true) = (round, was_running) {
            self.coupled_failure(i, r);
        }
        let d = self.rng.range(0, shutdown);
        self.reply(i, lat + d, Event::Stopped { failure });
    }

    /// A group of round `r` went down: the others' collectives break.
    fn coupled_failure(&mut self, from: usize, r: u64) {
        if self.cfg.independent_workers {
            return;
        }
        for k in 0..self.nodes.len() {
            if k == from || !self.alive(k) {
                continue;
            }
            if self.nodes[k]
                .workers
                .as_ref()
                .is_some_and(|w| w.round == r && w.running)
            {
                let t = self.now + self.rng.range(10, 2_000);
                self.at(t, Ev::WorkersEnd(k, r, End::Broken));
            }
        }
    }

    fn barrier(&mut self, i: usize, round: u64) {
        if self.reaches(i) {
            self.s.finishing.insert(round);
        }
        let n = self.nodes[i].round.map_or(1, |r| r.2);
        let arrived = self.s.barrier.entry(round).or_default();
        arrived.insert(i);
        if arrived.len() >= n {
            let everyone: Vec<usize> = arrived.iter().copied().collect();
            for j in everyone {
                if self.alive(j)
                    && matches!(self.nodes[j].policy.phase(), Phase::ExitBarrier { round: r, .. } if *r == round)
                {
                    let lat = self.nodes[j].latency;
                    self.reply(j, lat, Event::BarrierPassed);
                }
            }
            return;
        }
        let t = self.now + self.cfg.exit_barrier_ms;
        let gen = self.nodes[i].gen;
        self.at(t, Ev::BarrierTimeout(i, gen, round));
    }

    fn finish(&mut self, i: usize, v: Verdict) {
        self.note(|| format!("node {i} FINISHES {v:?}"));
        // Invariant 1.
        if matches!(v, Verdict::Succeeded { .. } | Verdict::NotNeeded) {
            let decided = self.nodes[i].decided_at.unwrap_or(self.steps);
            if self.s.failed_step.is_some_and(|f| f <= decided) {
                self.violation(format!(
                    "invariant 1: node {i} exits 0 ({}) though it read the run's failure",
                    v.name()
                ));
            }
        }
        // Invariant 5: a node that read the published failure reports its
        // root cause (one that could not reach the store reports its own).
        let read_it = self.nodes[i]
            .read_at
            .zip(self.s.failed_step)
            .is_some_and(|(d, f)| d >= f);
        if let (Verdict::Failed { root, .. }, true) = (&v, read_it) {
            if let Some(Closed::Failed(published)) = &self.s.verdict {
                if root != published {
                    self.violation(format!(
                        "invariant 5: node {i} reports root cause {root:?}, the run published {published:?}"
                    ));
                }
            }
        }
        if let Some(w) = &self.nodes[i].workers {
            if w.running {
                self.violation(format!("node {i} finished with its workers running"));
            }
        }
        // A user stopping a node (a signal, in any phase) takes its stores
        // with it: invariant 3 is about the agent's own decisions.
        let voluntary = !self.nodes[i].signalled;
        self.nodes[i].life = Life::Exited(v);
        self.nodes[i].exited_at = Some(self.now);
        if i == 0 {
            // The store goes with its host: every waiting watch reads EOF.
            self.wake(None);
        }
        // The driver leaves on every way out; a leave that cannot reach the
        // store leaves a node its watcher will find dead.
        if !self.leave(i) {
            self.watch_for_death(i);
        }
        if let Some(r) = self.nodes[i].job_store.take() {
            self.job_store_gone(i, r, voluntary);
        }
        if i == 0 {
            self.host_gone(voluntary);
        }
        self.s.joiners.retain(|&j| j != i);
        // The last member of a round gone: the nodes waiting may form the next.
        if self.cfg.backend == Backend::C10d && !self.s.closed {
            self.try_form(false);
        }
    }

    /// The rendezvous host (node 0) is gone: the run store with it.
    fn host_gone(&mut self, voluntary: bool) {
        for k in 1..self.nodes.len() {
            if !self.alive(k) {
                continue;
            }
            if voluntary
                && self.nodes[k]
                    .workers
                    .as_ref()
                    .is_some_and(|w| w.running && !w.told)
                // Cut off from the store, it was silent to the host (see
                // invariant 3).
                && self.reached_before_end(k, 0)
            {
                let r = self.nodes[k].workers.as_ref().map_or(0, |w| w.round);
                if self.cfg.backend == Backend::Static {
                    // Static: the run store is the workers' store too.
                    self.violation(format!(
                        "invariant 3: the static host left while node {k}'s workers of round {r} run"
                    ));
                } else {
                    // c10d: the node loses its rendezvous, and fails a run
                    // that may succeed.
                    self.violation(format!(
                        "invariant 3: the rendezvous host left while node {k}'s workers of round {r} run"
                    ));
                }
            }
        }
    }

    fn kill(&mut self, i: usize) {
        if !self.alive(i) {
            return;
        }
        self.fired.kills += 1;
        self.note(|| format!("node {i} KILLED"));
        self.nodes[i].life = Life::Killed;
        self.nodes[i].killed_at = Some(self.now);
        if i == 0 {
            // The store goes with its host: every waiting watch reads EOF.
            self.wake(None);
        }
        let round = self.nodes[i].round;
        let was_running = self.nodes[i].workers.as_ref().is_some_and(|w| w.running);
        if let Some(w) = &mut self.nodes[i].workers {
            w.running = false;
        }
        if let Some(r) = self.nodes[i].job_store.take() {
            self.job_store_gone(i, r, false);
        }
        self.s.joiners.retain(|&j| j != i);
        if let (Some((r, _, _)), true) = (round, was_running) {
            self.coupled_failure(i, r);
        }
        self.watch_for_death(i);
        // A join waiting for everyone may now complete with the live nodes.
        if self.cfg.backend == Backend::C10d {
            self.try_form(false);
        }
    }

    /// Node `i` stopped keeping alive: its watcher looks after the expiry.
    fn watch_for_death(&mut self, i: usize) {
        let t = self.now + self.cfg.keep_alive_ms * self.cfg.misses + self.cfg.keep_alive_ms / 4;
        self.watch_for_death_at(i, t);
    }

    /// Node `i`'s beats are stale now: its watcher looks.
    fn watch_for_death_now(&mut self, i: usize) {
        self.watch_for_death_at(i, self.now);
    }

    fn watch_for_death_at(&mut self, i: usize, t: u64) {
        match (self.cfg.backend, self.nodes[i].round) {
            (Backend::C10d, Some((r, _, _))) => self.at(t, Ev::DeadCheck(i, r, false)),
            (Backend::Static, Some(_)) => self.at(t, Ev::StaticDeadCheck(i, false)),
            _ => {}
        }
    }

    /// The census counts node `i` in at its first round.
    fn count_in(&mut self, i: usize) {
        if !self.nodes[i].counted_in {
            self.nodes[i].counted_in = true;
            self.s.census_joined += 1;
        }
    }

    /// `RendezvousHandler::leave`, once: says it left (its watcher skips it)
    /// and counts it out. False if the store could not be reached.
    fn leave(&mut self, i: usize) -> bool {
        if self.nodes[i].left {
            return true;
        }
        if !self.reaches(i) {
            return false;
        }
        match (self.cfg.backend, self.nodes[i].round) {
            (Backend::C10d, Some((r, rank, _))) => {
                self.s.left.entry(r).or_default().insert(rank);
            }
            (Backend::Static, Some(_)) => {
                self.s.static_left.insert(i);
            }
            _ => {}
        }
        // Counted in (again, if a watcher found it dead while it was
        // partitioned), then out.
        if self.nodes[i].counted_in {
            self.reconcile(i);
            self.s.census_gone += 1;
        }
        self.nodes[i].left = true;
        true
    }

    /// Whether node `i`'s job store has clients: another node's workers of
    /// its round, running, or killed less than the server's TCP keep-alive
    /// ago (a dead host's connections stay open until then). A partition
    /// cuts a node off from the run store only: connections between nodes
    /// stay up.
    fn job_store_in_use(&self, i: usize) -> bool {
        let Some(r) = self.nodes[i].job_store else {
            return false;
        };
        (0..self.nodes.len()).filter(|&k| k != i).any(|k| {
            let n = &self.nodes[k];
            let Some(w) = n.workers.as_ref().filter(|w| w.round == r) else {
                return false;
            };
            match n.killed_at {
                Some(t) => self.now - t < KEEPALIVE_DROP_MS,
                None => self.alive(k) && w.running,
            }
        })
    }

    /// Node `i` claims its census key in its current round, if not yet, and
    /// counts itself in again if a watcher had counted it dead.
    fn reconcile(&mut self, i: usize) {
        let key = match (self.cfg.backend, self.nodes[i].round) {
            (Backend::C10d, Some((r, _, _))) => (r, i),
            (Backend::Static, Some(_)) => (STATIC_ROUND, i),
            _ => return,
        };
        if std::mem::replace(&mut self.nodes[i].reconciled, true) {
            return;
        }
        if !self.s.census_keys.insert(key) {
            self.s.census_joined += 1;
        }
    }

    /// Checks only `invariants` (by number).
    pub fn enforcing(mut self, invariants: &[u8]) -> Sim {
        self.enforced = invariants.to_vec();
        self
    }

    /// This run with `rule` broken (see [`Sabotage`]).
    pub fn sabotaged(mut self, rule: Sabotage) -> Sim {
        self.sabotage = Some(rule);
        self
    }

    fn violation(&mut self, what: String) {
        let n = invariant_of(&what);
        if n.is_some_and(|n| !self.enforced.contains(&n)) {
            return;
        }
        self.note(|| format!("VIOLATION {what}"));
        if self.broken.is_none() {
            self.broken = Some(what);
        }
    }

    /// Runs to the end; the first broken invariant, if any.
    pub fn run(mut self) -> Result<Sim, Violation> {
        while let Some(Reverse((t, _, idx))) = self.queue.pop() {
            if t > HORIZON_MS {
                break;
            }
            self.now = t;
            self.steps += 1;
            let ev = self.events[idx].take().expect("each event runs once");
            self.step(ev);
            self.check_bounds();
            if let Some(what) = self.broken.take() {
                return Err(Violation {
                    seed: self.cfg.seed,
                    what,
                    trace: std::mem::take(&mut self.trace),
                    sabotage: self.sabotage,
                });
            }
        }
        // Invariant 4: nobody hangs.
        for i in 0..self.nodes.len() {
            if self.nodes[i].life == Life::Alive && self.enforced.contains(&4) {
                let phase = format!("{:?}", self.nodes[i].policy.phase());
                return Err(Violation {
                    seed: self.cfg.seed,
                    what: format!(
                        "invariant 4: node {i} still runs at the horizon ({} s), in {phase}",
                        HORIZON_MS / 1000
                    ),
                    trace: std::mem::take(&mut self.trace),
                    sabotage: self.sabotage,
                });
            }
        }
        Ok(self)
    }

    /// Invariant 4 after a published failure, and after the exit barrier.
    fn check_bounds(&mut self) {
        let host = &self.nodes[0];
        if let Some(ended) = host.exited_at.or(host.killed_at) {
            let late = (1..self.nodes.len()).find(|&i| {
                let n = &self.nodes[i];
                self.alive(i)
                    && n.lingering_after_barrier
                        .is_some_and(|t| self.now > t.max(ended) + 1_000)
            });
            if let Some(i) = late {
                self.violation(format!(
                    "invariant 4: node {i} still lingers {} ms after its rendezvous host ended, the exit barrier passed",
                    self.now - ended
                ));
            }
        }
        let Some(at) = self.s.failed_at else { return };
        let c = &self.cfg;
        let bound = at
            + 2 * c.monitor_ms
            + c.shutdown_ms
            + c.lost_grace_ms
            + STORE_TIMEOUT_MS
            + 4 * CHECK_MS
            + c.exit_barrier_ms.min(STORE_TIMEOUT_MS)
            + 1_000;
        if self.now > bound {
            if let Some(i) = (0..self.nodes.len()).find(|&i| self.alive(i)) {
                let phase = format!("{:?}", self.nodes[i].policy.phase());
                self.violation(format!(
                    "invariant 4: node {i} still runs {} ms after the failure was published, in {phase}",
                    self.now - at
                ));
            }
        }
    }

    fn step(&mut self, ev: Ev) {
        match ev {
            Ev::Boot(i) => {
                if self.nodes[i].life == Life::NotStarted {
                    self.nodes[i].life = Life::Alive;
                    if i >= self.cfg.nodes {
                        self.fired.late_nodes += 1;
                    }
                    self.windows_at_boot(i);
                    self.act(i);
                }
            }
            Ev::StallBegins(k) => {
                if (0..self.nodes.len()).any(|j| self.alive(j)) {
                    self.window_fired(Window::Stall(k));
                }
            }
            // Not if a later draw replaced this partition of the node.
            Ev::PartitionBegins(i, t) => {
                if i != 0 && self.alive(i) && self.nodes[i].partitioned.0 == t {
                    self.window_fired(Window::Partition(i));
                }
            }
            Ev::Act(i) => self.act(i),
            // A reply is never stale for the action it answers (the policy
            // ignores what no longer concerns its phase); the generation only
            // filters the timers of a phase left.
            Ev::Deliver(i, e) => self.deliver(i, e),
            Ev::Wake(i, round) => {
                let member =
                    round.is_none_or(|r| self.nodes[i].round.is_some_and(|(rk, _, _)| rk == r));
                if member {
                    self.look(i);
                }
            }
            Ev::Poll(i) => {
                self.nodes[i].polling = false;
                self.look(i);
            }
            Ev::WorkersEnd(i, round, end) => {
                if !self.alive(i) {
                    return;
                }
                let Some(w) = &mut self.nodes[i].workers else {
                    return;
                };
                if w.round != round || !w.running {
                    return;
                }
                w.running = false;
                // A group's own failure is a fault once it happens (it was
                // still running); under the sabotage, not counted.
                if end == End::Fails && self.sabotage != Some(Sabotage::UncountedWorkerFailure) {
                    self.fired.worker_failures += 1;
                }
                let ok = end == End::Succeeds;
                if !ok {
                    let rank = self.nodes[i].round.map_or(0, |r| r.1);
                    let rec = record(self.now, i, rank, round);
                    if let Some(w) = &mut self.nodes[i].workers {
                        w.failure = Some(rec);
                    }
                    self.coupled_failure(i, round);
                }
                self.deliver(
                    i,
                    if ok {
                        Event::WorkersSucceeded
                    } else {
                        Event::WorkerFailed
                    },
                );
            }
            Ev::Kill(i) => self.kill(i),
            Ev::Signal(i, s) => {
                if self.alive(i) {
                    self.fired.signals += 1;
                    self.nodes[i].signalled = true;
                    self.deliver(i, Event::Signal(s));
                }
            }
            Ev::LastCall(round) => {
                if self.s.next_round == round && self.s.last_call_armed && !self.s.closed {
                    self.try_form(true);
                }
            }
            Ev::BeatBack(i) => {
                let n = &self.nodes[i];
                if self.alive(i) && !n.left && n.counted_in && self.reaches(i) {
                    self.reconcile(i);
                }
            }
            Ev::SilentCheck(i) => {
                if self.alive(i) && !self.reaches(i) {
                    self.note(|| format!("node {i} silent for a keep-alive expiry"));
                    self.watch_for_death_now(i);
                }
            }
            Ev::DeadCheck(i, r, slow) => {
                // A partitioned node that reaches the store again beats.
                if self.alive(i) && self.reaches(i) {
                    return;
                }
                // Unless it left, a watcher marks `i` dead: one of the first
                // ranks at once, any other member after the ring's slow read.
                let left = self.nodes[i].round.is_some_and(|(rr, rank, _)| {
                    rr == r && self.s.left.get(&r).is_some_and(|l| l.contains(&rank))
                });
                // A watcher is a live member still in round r (a member
                // re-joining stopped its watch of r; one that left goes on).
                let in_r = |k: usize| {
                    self.alive(k)
                        && !self.nodes[k].joining
                        && self.nodes[k].round.is_some_and(|(rk, _, _)| rk == r)
                };
                let rank = |k: usize| self.nodes[k].round.map_or(usize::MAX, |(_, rk, _)| rk);
                let can = |k: usize| k != i && in_r(k) && self.reaches(k);
                let members = self.s.members.get(&r);
                let fast = members.is_some_and(|m| m.iter().any(|&k| can(k) && rank(k) < WATCHERS));
                let ring = members.is_some_and(|m| m.iter().any(|&k| can(k)));
                if !left && !fast && ring && !slow {
                    let t = self.now + self.cfg.keep_alive_ms * u64::from(RING_INTERVALS);
                    self.at(t, Ev::DeadCheck(i, r, true));
                } else if !left && (fast || ring) {
                    if self.s.dead.entry(r).or_default().insert(i) {
                        if self.s.census_keys.insert((r, i)) {
                            self.s.census_dead += 1;
                        }
                        self.wake(Some(r));
                        self.note(|| format!("node {i} found dead in round {r}"));
                    }
                } else if !left {
                    // Nobody could watch now: try again later.
                    let t = self.now + self.cfg.keep_alive_ms;
                    if self
                        .s
                        .members
                        .get(&r)
                        .is_some_and(|m| m.iter().any(|&k| k != i && self.alive(k)))
                    {
                        self.at(t, Ev::DeadCheck(i, r, slow));
                    }
                }
            }
            Ev::Spawn(j, round) => {
                if self.alive(j)
                    && matches!(self.nodes[j].policy.phase(), Phase::Starting { round: r, .. } if *r == round)
                {
                    self.spawn_workers(j, round);
                }
            }
            Ev::JoinProbe(i, n, since) => {
                let node = &self.nodes[i];
                if !self.alive(i) || !node.joining || node.joins != n {
                    return;
                }
                let since = if self.reaches(i) {
                    None
                } else {
                    Some(since.unwrap_or(self.now))
                };
                if since.is_some_and(|s| self.now - s >= self.cfg.lost_grace_ms) {
                    self.nodes[i].joining = false;
                    self.s.joiners.retain(|&j| j != i);
                    self.deliver(i, Event::JoinFailed("store unreachable".into()));
                } else {
                    let t = self.now + JOIN_PROBE_MS;
                    self.at(t, Ev::JoinProbe(i, n, since));
                }
            }
            Ev::JoinTimeout(i, n) => {
                let node = &self.nodes[i];
                if !self.alive(i) || !node.joining || node.joins != n {
                    return;
                }
                self.nodes[i].joining = false;
                self.s.joiners.retain(|&j| j != i);
                self.deliver(i, Event::JoinFailed("join timed out".into()));
            }
            Ev::StaticDeadCheck(i, slow) => {
                // Unless it left, a watcher (a live node that reaches the
                // store) marks it dead: nodes 0 and 1 at once, the others after
                // the ring's slow read; with none now, look again later.
                if self.s.static_left.contains(&i) || (self.alive(i) && self.reaches(i)) {
                    return;
                }
                let others = (0..self.nodes.len()).filter(|&k| k != i && self.alive(k));
                let fast = others.clone().any(|k| self.reaches(k) && k < WATCHERS);
                let ring = others.clone().any(|k| self.reaches(k));
                if !fast && ring && !slow {
                    let t = self.now + self.cfg.keep_alive_ms * u64::from(RING_INTERVALS);
                    self.at(t, Ev::StaticDeadCheck(i, true));
                } else if ring {
                    if self.s.static_dead.insert(i) {
                        if self.s.census_keys.insert((STATIC_ROUND, i)) {
                            self.s.census_dead += 1;
                        }
                        self.wake(None);
                        self.note(|| format!("node {i} found dead"));
                    }
                } else if others.count() > 0 {
                    let t = self.now + self.cfg.keep_alive_ms;
                    self.at(t, Ev::StaticDeadCheck(i, slow));
                }
            }
            Ev::BarrierTimeout(i, gen, round) => {
                if !self.alive(i) || gen != self.nodes[i].gen {
                    return;
                }
                if !matches!(self.nodes[i].policy.phase(), Phase::ExitBarrier { round: r, .. } if *r == round)
                {
                    return;
                }
                let seen = self.observe(i);
                self.deliver(
                    i,
                    Event::BarrierFailed {
                        error: "timed out".into(),
                        timed_out: true,
                        seen,
                    },
                );
            }
            Ev::StartTimeout(i, gen, round) => {
                if !self.alive(i) || gen != self.nodes[i].gen {
                    return;
                }
                if !matches!(self.nodes[i].policy.phase(), Phase::Starting { round: r, .. } if *r == round)
                {
                    return;
                }
                if let Some(a) = self.s.started.get_mut(&round) {
                    a.remove(&i);
                }
                self.deliver(
                    i,
                    Event::StartFailed(StartError::Store("rank assignment timed out".into())),
                );
            }
            Ev::LingerPoll(l) => {
                let Linger {
                    node: i,
                    gen,
                    until,
                    unreachable_since,
                    quiet_since,
                    out_since,
                    zero_since,
                    after_barrier,
                    ..
                } = l;
                if !self.alive(i) || gen != self.nodes[i].gen {
                    return;
                }
                // Sabotage: the linger's answer is lost, the node lingers on.
                if self.sabotage == Some(Sabotage::EndlessLinger) {
                    return;
                }
                // An unreachable store may be stalled: keep lingering.
                // A lingering node counts itself out when it can (ending.rs).
                self.leave(i);
                let census_zero = {
                    let me = i64::from(self.nodes[i].counted_in && !self.nodes[i].left);
                    let s = &self.s;
                    s.census_joined - s.census_gone - s.census_dead - me <= 0
                };
                // A 0 with nodes counted dead is believed once it held for two
                // keep-alive intervals (`census::Zero`).
                // Held from an answered read on: an unreachable one resets it.
                let zero_since = (census_zero && self.s.census_dead > 0 && self.reaches(i))
                    .then(|| zero_since.unwrap_or(self.now));
                let census_zero = census_zero
                    && zero_since.is_none_or(|t| self.now - t >= 2 * self.cfg.keep_alive_ms);
                // The pulse: a member of this node's round, or of the newest
                // one, still beats (alive, in that round, not left or joining,
                // and reaching the store: a cut-off node's counter stands
                // still, as the driver's `Pulse` sees it).
                let own = self.nodes[i].round.map(|r| r.0);
                let latest = self.s.members.keys().next_back().copied();
                // Static nodes keep one heartbeat for the whole run.
                let fixed = self.cfg.backend == Backend::Static;
                let beating = (0..self.nodes.len()).any(|k| {
                    let n = &self.nodes[k];
                    let in_watched_round = !n.joining
                        && n.round
                            .is_some_and(|(r, _, _)| Some(r) == own || Some(r) == latest);
                    k != i
                        && self.alive(k)
                        && !n.left
                        && self.reaches(k)
                        && (fixed || in_watched_round)
                });
                let quiet_since = if beating {
                    None
                } else {
                    Some(quiet_since.unwrap_or(self.now))
                };
                let expiry = self.cfg.keep_alive_ms * (self.cfg.misses + 1);
                let quiet = quiet_since.is_some_and(|t| self.now - t >= expiry);
                // Everyone out: a job store's host still waits for its
                // clients, at most `lost_grace` (ending.rs).
                let out = self.reaches(i) && (census_zero || quiet);
                let out_since = out.then(|| out_since.unwrap_or(self.now));
                let done = out_since.is_some_and(|t| {
                    !self.job_store_in_use(i) || self.now - t >= self.cfg.lost_grace_ms
                });
                let unreachable_since = if self.reaches(i) {
                    None
                } else {
                    Some(unreachable_since.unwrap_or(self.now))
                };
                // Node 0 hosts the rendezvous store: it gives up on it only
                // once the others must have stopped their workers; so does a
                // job store's host (their workers use its store).
                let c = &self.cfg;
                let give_up = if i == 0 || self.nodes[i].linger_serves {
                    c.shutdown_ms + c.monitor_ms + 2 * CHECK_MS + c.lost_grace_ms
                } else {
                    c.lost_grace_ms
                };
                // A job store's host gives up only once no client is
                // connected to its store (`ServerHandle::stats().open`).
                let lost = unreachable_since.is_some_and(|t| self.now - t >= give_up)
                    && !self.job_store_in_use(i);
                // A host that ended refuses connections (`store_host_ended`).
                let host = &self.nodes[0];
                let host_ended = i != 0 && (host.killed_at.is_some() || host.exited_at.is_some());
                let lost = lost || (after_barrier && host_ended);
                // Sabotage: the node does not wait for anyone.
                let done = done || self.sabotage == Some(Sabotage::NoLinger);
                if done || lost || until.is_some_and(|u| self.now >= u) {
                    let s = &self.s;
                    let (j, g, d) = (s.census_joined, s.census_gone, s.census_dead);
                    self.note(|| format!("node {i} lingered: joined {j}, gone {g}, dead {d}"));
                    let seen = if self.reaches(i) {
                        self.nodes[i].decided_at = Some(self.steps);
                        match self.s.verdict.clone() {
                            // Sabotage: a stale read, that misses the failure.
                            Some(Closed::Failed(_))
                                if self.sabotage == Some(Sabotage::StaleLingerRead) =>
                            {
                                None
                            }
                            v => v.map(|v| self.as_read(i, v)),
                        }
                    } else {
                        None
                    };
                    self.deliver(i, Event::Lingered(seen));
                } else {
                    let t = self.now + 50;
                    self.at(
                        t,
                        Ev::LingerPoll(Linger {
                            unreachable_since,
                            quiet_since,
                            out_since,
                            zero_since,
                            ..l
                        }),
                    );
                }
            }
        }
    }
}

/// A failure record at `now` on node `i`.
fn record(now: u64, i: usize, rank: usize, round: u64) -> Box<FailureRecord> {
    Box::new(FailureRecord {
        time: now as f64 / 1000.0,
        host: format!("node{i}"),
        group_rank: rank,
        rank,
        local_rank: 0,
        round,
        pid: i as u32,
        exitcode: 1,
        exit: "exit code 1".into(),
        message: "simulated failure".into(),
        traceback: String::new(),
        error_file: "<N/A>".into(),
    })
}

#[cfg(test)]
mod tests;
