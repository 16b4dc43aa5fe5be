//! The simulator in CI: a fixed range of seeds (every run of CI tries the same
//! schedules, so a failure is never a fluke of the draw), and a replay of one
//! seed with its whole trace.
//!
//! `RALLY_SIM_SEEDS=n` and `RALLY_SIM_FIRST=s` try other seeds (`s..s+n`).

use super::*;

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok()?.parse().ok()
}

/// Runs seeds `first..first + n` enforcing `invariants`; panics with the first
/// failing seed's trace and its replay command.
fn seeds(invariants: &[u8], default_n: u64) {
    let n = env_u64("RALLY_SIM_SEEDS").unwrap_or(default_n);
    let first = env_u64("RALLY_SIM_FIRST").unwrap_or(0);
    let started = std::time::Instant::now();
    let mut failed = Vec::new();
    for seed in first..first + n {
        if let Err(v) = Sim::new(seed, false).enforcing(invariants).run() {
            failed.push(v);
        }
    }
    if let Some(first_bad) = failed.first() {
        // Replay the first with its trace, for the report.
        let v = Sim::new(first_bad.seed, true)
            .enforcing(invariants)
            .run()
            .err()
            .unwrap_or_else(|| panic!("seed {} failed once and passed on replay", first_bad.seed));
        let seeds: Vec<u64> = failed.iter().map(|v| v.seed).take(20).collect();
        panic!(
            "{} of {n} seeds broke an invariant (first: {seeds:?})\n{v}",
            failed.len()
        );
    }
    eprintln!("{n} seeds in {:?}", started.elapsed());
}

/// Every invariant, over 10,000 seeds (CI).
#[test]
fn ten_thousand_seeds_keep_every_invariant() {
    seeds(&[1, 2, 3, 4, 5], 10_000);
}

#[test]
fn replay() {
    let Some(seed) = env_u64("RALLY_SIM_SEED") else {
        return;
    };
    let only: Vec<u8> = std::env::var("RALLY_SIM_INVARIANTS")
        .ok()
        .map(|v| v.split(',').filter_map(|n| n.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![1, 2, 3, 4, 5]);
    let sim = Sim::new(seed, true).enforcing(&only);
    eprintln!("{:?}", sim.cfg);
    match sim.run() {
        Ok(sim) => {
            for l in &sim.trace {
                eprintln!("{l}");
            }
            eprintln!("seed {seed}: every invariant held");
        }
        Err(v) => {
            for l in &v.trace {
                eprintln!("{l}");
            }
            panic!("{v}");
        }
    }
}

#[test]
fn the_same_seed_runs_the_same_schedule() {
    for seed in [1, 77, 4242] {
        let a = Sim::new(seed, true).run().map(|s| s.trace);
        let b = Sim::new(seed, true).run().map(|s| s.trace);
        match (a, b) {
            (Ok(a), Ok(b)) => assert_eq!(a, b),
            (Err(a), Err(b)) => assert_eq!(a.trace, b.trace),
            _ => panic!("seed {seed} ran differently twice"),
        }
    }
}

#[test]
fn census() {
    let Some(n) = env_u64("RALLY_SIM_CENSUS") else {
        return;
    };
    let mut kinds: std::collections::BTreeMap<String, (usize, u64)> = Default::default();
    for seed in 0..n {
        if let Err(v) = Sim::new(seed, false).run() {
            let cfg = Config::from_seed(seed);
            let k = format!("{:?} {}", cfg.backend, &v.what[..v.what.len().min(60)]);
            let e = kinds.entry(k).or_insert((0, seed));
            e.0 += 1;
        }
    }
    for (k, (c, s)) in kinds {
        eprintln!("{c:5} first {s:5} {k}");
    }
}
