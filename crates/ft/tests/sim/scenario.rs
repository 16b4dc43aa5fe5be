//! What a seed plays: the job's shape, its knobs and its faults, drawn
//! from the seed by a small deterministic generator.

use std::time::Duration;

use rallypoint_lighthouse::quorum::Knobs;

/// A small deterministic generator (splitmix64).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// In `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
    pub fn pick<T: Copy>(&mut self, of: &[T]) -> T {
        of[self.next() as usize % of.len()]
    }
}

/// The kinds of fault, in the tally's order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// One worker dies (its connection to the manager ends); the agent
    /// stops the group's other workers and restarts all W at step 0.
    Kill,
    /// The agent stops the group's workers (`workers_stopped`), then
    /// restarts them at step 0.
    Stop,
    /// One worker freezes past its calls' deadlines, then resumes.
    Stall,
    /// The lighthouse's next answer to a group comes late.
    Delay,
    /// The lighthouse's next answer to a group is lost: the call fails.
    Lose,
    /// The lighthouse restarts: every session ends, ids go on above.
    Restart,
    /// A group's manager is cut from the lighthouse (silent both ways,
    /// the connection kept), then the cut heals.
    Cut,
}

impl Fault {
    pub const ALL: [Fault; 7] = [
        Fault::Kill,
        Fault::Stop,
        Fault::Stall,
        Fault::Delay,
        Fault::Lose,
        Fault::Restart,
        Fault::Cut,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Fault::Kill => "kill",
            Fault::Stop => "stop",
            Fault::Stall => "stall",
            Fault::Delay => "delay",
            Fault::Lose => "lose",
            Fault::Restart => "restart",
            Fault::Cut => "cut",
        }
    }

    /// Its place in [`Fault::ALL`] (and in the tally).
    pub fn index(self) -> usize {
        Fault::ALL.iter().position(|k| *k == self).unwrap_or(0)
    }
}

/// One fault of the schedule.
#[derive(Clone, Copy, Debug)]
pub struct Planned {
    pub at: u64,
    pub kind: Fault,
    pub group: usize,
    pub rank: usize,
    /// How long it lasts (a stall, a delay, a cut, the lighthouse's
    /// pause), ms.
    pub ms: u64,
}

/// Workers' and agent's timings (ms).
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    /// A step's compute takes between these.
    pub step: (u64, u64),
    /// Reading a checkpoint from the healing source.
    pub heal: u64,
    /// The workers' `timeout_ms` for quorum and should_commit (and the
    /// heal's deadline).
    pub call: u64,
    /// The cross-replica allreduce's timeout (the process group's).
    pub allreduce: u64,
    /// The agent restarts a stopped group's workers after this.
    pub restart: u64,
}

/// What a seed plays.
#[derive(Clone, Debug)]
pub struct Scenario {
    /// N replica groups of W ranks.
    pub groups: usize,
    pub ranks: usize,
    pub knobs: Knobs,
    pub timing: Timing,
    pub faults: Vec<Planned>,
}

/// Heartbeats every 100 ms (the manager's default).
pub const BEAT_MS: u64 = 100;

/// How long a heartbeat of the manager's client goes unanswered before it
/// forgets its last quorum (two beats).
pub const FORGET_MS: u64 = 2 * BEAT_MS;
/// The lighthouse client's longest pause between dials.
pub const BACKOFF_MS: u64 = 250;
/// The longest startup grace of a (re)started lighthouse.
pub const GRACE_MAX_MS: u64 = 1000;

impl Scenario {
    pub fn draw(seed: u64) -> Scenario {
        let mut rng = Rng(seed.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ 0xf7);
        let groups = rng.range(2, 5) as usize;
        let ranks = rng.range(1, 3) as usize;
        let knobs = Knobs {
            min_replicas: rng.range(1, 2),
            join_timeout: Duration::from_millis(rng.pick(&[0, 100, 500])),
            quorum_tick: Duration::from_millis(100),
            heartbeat_timeout: Duration::from_millis(rng.pick(&[300, 500, 1000])),
        };
        let max_step = rng.pick(&[20, 60, 200]);
        let timing = Timing {
            step: (max_step / 4 + 1, max_step),
            heal: rng.range(5, 100),
            call: rng.pick(&[1000, 2000, 4000]),
            allreduce: rng.pick(&[500, 1500]),
            restart: rng.range(100, 800),
        };
        let phase = rng.range(2_000, 8_000);
        let hb = knobs.heartbeat_timeout.as_millis() as u64;
        let mut faults = Vec::new();
        for _ in 0..rng.range(0, 5) {
            let kind = rng.pick(&Fault::ALL);
            let ms = match kind {
                Fault::Stall => rng.range(timing.call / 2, timing.call * 2),
                Fault::Delay => rng.range(50, timing.call * 3 / 2),
                Fault::Restart => rng.range(100, 1500),
                Fault::Cut => rng.range(hb / 2, hb * 3),
                Fault::Kill | Fault::Stop | Fault::Lose => 0,
            };
            faults.push(Planned {
                at: rng.range(300, phase),
                kind,
                group: rng.range(0, groups as u64 - 1) as usize,
                rank: rng.range(0, ranks as u64 - 1) as usize,
                ms,
            });
        }
        faults.sort_by_key(|f| f.at);
        Scenario {
            groups,
            ranks,
            knobs,
            timing,
            faults,
        }
    }

    pub fn hb_ms(&self) -> u64 {
        self.knobs.heartbeat_timeout.as_millis() as u64
    }

    /// How long after the last fault settled every live group must have
    /// committed again (invariant 6), from the knobs: a worker frozen in
    /// a call or an allreduce sees it time out (a call, an allreduce and a
    /// vote: each up to its timeout, twice, since a round that started
    /// just before the fault settled may fail on its leftovers); the
    /// manager redials (the backoff), a restarted lighthouse waits its
    /// grace, a cut replica is dropped after the heartbeat timeout, a
    /// quorum that is not fast waits the join timeout; then a heal and
    /// two steps, and a few lighthouse ticks.
    pub fn bound(&self) -> u64 {
        let t = &self.timing;
        let join = self.knobs.join_timeout.as_millis() as u64;
        let round = t.call + t.allreduce + t.call;
        2 * round
            + BACKOFF_MS
            + GRACE_MAX_MS.min(self.hb_ms())
            + self.hb_ms()
            + join
            + t.heal
            + 2 * t.step.1
            + 4 * 100
    }
}
