//! What rallypoint's seeded simulators share: which seeds a run plays, the
//! command that replays one, and the tally of the faults that fired.
//!
//! Three simulators drive pure state machines (the agent's policy, RPC's
//! RRef protocol) or the real code (the collectives over loopback) through
//! random schedules of faults drawn from a seed. Each keeps its own
//! scenarios, invariants and loop; this crate holds the parts that must read
//! the same in all three, so that a variable means one thing everywhere and
//! a run that checks nothing cannot pass.
//!
//! **Which seeds** ([`mode`]), from the environment:
//!
//! * `RALLY_SIM_SEEDS=n` and `RALLY_SIM_FIRST=s`: seeds `s..s+n` (n > 0)
//!   instead of the simulator's default range from 0;
//! * `RALLY_SIM_SEED=s`: seed `s` alone, with its trace (the replay a
//!   failing seed names, [`replay_command`]);
//! * `RALLY_SIM_CENSUS=n`, for a simulator that takes a census: seeds
//!   `s..s+n`, and if some fail, the failures counted by kind.
//!
//! A value that is not a whole number fails the run, as do a count of 0
//! and a combination that would ignore a variable: none may pass by
//! running the default or nothing.
//!
//! **Faults that fired** ([`Tally`]): each seed reports how many times each
//! kind of fault fired (not how many were drawn: a kill drawn for a moment
//! after the run ended never happened). The tally counts, per kind, the
//! seeds it fired in and the times, and [`Tally::assert_floors`] fails the
//! run if a kind fired in fewer than one seed in so many: a generator that
//! stopped drawing a fault, or a fault that stopped reaching the code, shows
//! as a failure rather than as a run that passes on easy schedules.

use std::fmt::Write as _;

/// The seeds a run plays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Seeds `first..first + n`; with `census`, failures counted by kind.
    Seeds { first: u64, n: u64, census: bool },
    /// One seed, with its trace.
    Replay(u64),
}

/// The variables [`mode`] reads.
pub const VARS: [&str; 4] = [
    "RALLY_SIM_SEEDS",
    "RALLY_SIM_FIRST",
    "RALLY_SIM_SEED",
    "RALLY_SIM_CENSUS",
];

/// The seeds this run plays, from the environment (see the crate's docs):
/// `default_seeds` from 0 when nothing is set; `takes_census` says whether
/// `RALLY_SIM_CENSUS` means anything to this simulator.
///
/// # Panics
///
/// On a value that is not a whole number, a count of 0, a range past the
/// last seed, or variables that contradict each other: the run fails with
/// what was wrong.
pub fn mode(default_seeds: u64, takes_census: bool) -> Mode {
    parse(default_seeds, takes_census, env).unwrap_or_else(|e| panic!("{e}"))
}

/// `name`'s value; `None` if unset.
///
/// # Panics
///
/// If the value is not Unicode: the run fails rather than ignore it.
pub fn env(name: &str) -> Option<String> {
    match std::env::var(name) {
        Err(std::env::VarError::NotPresent) => None,
        Err(e) => panic!("{name}: {e}"),
        Ok(v) => Some(v),
    }
}

/// [`mode`] over any source of variables (the environment, or a table in
/// tests).
pub fn parse(
    default_seeds: u64,
    takes_census: bool,
    var: impl Fn(&str) -> Option<String>,
) -> Result<Mode, String> {
    let number = |name: &str| -> Result<Option<u64>, String> {
        match var(name) {
            None => Ok(None),
            Some(v) => v
                .trim()
                .parse()
                .map(Some)
                .map_err(|e| format!("{name}={v:?} must be a whole number: {e}")),
        }
    };
    let seeds = number("RALLY_SIM_SEEDS")?;
    let first = number("RALLY_SIM_FIRST")?;
    let census = number("RALLY_SIM_CENSUS")?;
    if census.is_some() && !takes_census {
        return Err("RALLY_SIM_CENSUS: this simulator takes no census; use RALLY_SIM_SEEDS".into());
    }
    if let Some(seed) = number("RALLY_SIM_SEED")? {
        if seeds.is_some() || first.is_some() || census.is_some() {
            return Err(format!(
                "RALLY_SIM_SEED={seed} replays one seed: unset RALLY_SIM_SEEDS, RALLY_SIM_FIRST and RALLY_SIM_CENSUS"
            ));
        }
        return Ok(Mode::Replay(seed));
    }
    if seeds.is_some() && census.is_some() {
        return Err("RALLY_SIM_CENSUS=n is the number of seeds: unset RALLY_SIM_SEEDS".into());
    }
    let name = if census.is_some() {
        "RALLY_SIM_CENSUS"
    } else {
        "RALLY_SIM_SEEDS"
    };
    let n = census.or(seeds).unwrap_or(default_seeds);
    if n == 0 {
        return Err(format!(
            "{name}=0 runs no seed, and would pass without checking anything"
        ));
    }
    let first = first.unwrap_or(0);
    if first.checked_add(n).is_none() {
        return Err(format!(
            "RALLY_SIM_FIRST={first} + {name}={n} is past the last seed"
        ));
    }
    Ok(Mode::Seeds {
        first,
        n,
        census: census.is_some(),
    })
}

/// The one command that replays `seed` of the simulator run by `test` in
/// `package` (`args`: what else selects its build, e.g. `--lib` or
/// `--features faults`).
pub fn replay_command(package: &str, args: &str, test: &str, seed: u64) -> String {
    format!("RALLY_SIM_SEED={seed} cargo nextest run -p {package} {args} {test} --no-capture")
}

/// The faults that fired over many seeds, by kind (see the crate's docs).
#[derive(Debug, Default)]
pub struct Tally {
    kinds: Vec<Kind>,
    seeds: u64,
    /// Seeds in which no fault fired.
    quiet: u64,
}

#[derive(Debug)]
struct Kind {
    name: &'static str,
    /// Seeds it fired in.
    seeds: u64,
    /// Times it fired, over all seeds.
    times: u64,
    /// Seeds that drew it where it never fired (reported where a
    /// simulator can tell).
    never: u64,
}

impl Tally {
    /// One seed's faults: each kind with the times it fired (0 included, so
    /// that a kind that never fires is still listed and held to its floor).
    /// Every seed lists the same kinds in the same order.
    pub fn add(&mut self, fired: impl IntoIterator<Item = (&'static str, u64)>) {
        self.seeds += 1;
        let mut any = false;
        for (i, (name, times)) in fired.into_iter().enumerate() {
            if self.kinds.len() == i {
                self.kinds.push(Kind {
                    name,
                    seeds: 0,
                    times: 0,
                    never: 0,
                });
            }
            let k = &mut self.kinds[i];
            assert_eq!(k.name, name, "every seed lists the same kinds, in order");
            k.seeds += u64::from(times > 0);
            k.times += times;
            any |= times > 0;
        }
        self.quiet += u64::from(!any);
    }

    /// Notes that the seed just added drew a fault of kind `name` that
    /// never fired (its moment never came).
    pub fn never_fired(&mut self, name: &str) {
        if let Some(k) = self.kinds.iter_mut().find(|k| k.name == name) {
            k.never += 1;
        }
    }

    /// Seeds in which kind `name` fired.
    pub fn seeds_of(&self, name: &str) -> u64 {
        self.kinds
            .iter()
            .find(|k| k.name == name)
            .map_or(0, |k| k.seeds)
    }

    /// One line: each kind's seeds and times, and the seeds without a fault.
    pub fn summary(&self) -> String {
        let mut s = format!("faults that fired, in seeds (times) of {}:", self.seeds);
        for (i, k) in self.kinds.iter().enumerate() {
            let sep = if i == 0 { " " } else { ", " };
            let _ = write!(s, "{sep}{} {} ({}x)", k.name, k.seeds, k.times);
            if k.never > 0 {
                let _ = write!(s, " (drawn, never fired: {})", k.never);
            }
        }
        let _ = write!(s, "; no fault in {}", self.quiet);
        s
    }

    /// Panics if a kind fired in fewer than one seed in `one_in` of the
    /// seeds added. Fewer than `one_in` seeds make the floor 0: a handful
    /// of seeds cannot be expected to draw every kind.
    pub fn assert_floors(&self, one_in: u64) {
        let min = floor(self.seeds, one_in);
        for k in &self.kinds {
            assert!(
                k.seeds >= min,
                "{} fired in {} of {} seeds, below the floor of {min} (one in {one_in}): the schedules no longer exercise it",
                k.name,
                k.seeds,
                self.seeds
            );
        }
    }
}

/// The fewest seeds, of `n`, in which each kind must fire: one in `one_in`.
pub fn floor(n: u64, one_in: u64) -> u64 {
    n / one_in.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Variables set in one case of a table.
    type Set<'a> = &'a [(&'a str, &'a str)];

    fn vars<'a>(set: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| {
            set.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn the_environment_picks_the_seeds() {
        use Mode::*;
        let ok: &[(Set, bool, Mode)] = &[
            (
                &[],
                false,
                Seeds {
                    first: 0,
                    n: 100,
                    census: false,
                },
            ),
            (
                &[("RALLY_SIM_SEEDS", "7")],
                false,
                Seeds {
                    first: 0,
                    n: 7,
                    census: false,
                },
            ),
            (
                &[("RALLY_SIM_SEEDS", " 7 "), ("RALLY_SIM_FIRST", "40")],
                false,
                Seeds {
                    first: 40,
                    n: 7,
                    census: false,
                },
            ),
            (
                &[("RALLY_SIM_FIRST", "40")],
                false,
                Seeds {
                    first: 40,
                    n: 100,
                    census: false,
                },
            ),
            (&[("RALLY_SIM_SEED", "9")], false, Replay(9)),
            (
                &[("RALLY_SIM_CENSUS", "5")],
                true,
                Seeds {
                    first: 0,
                    n: 5,
                    census: true,
                },
            ),
            (
                &[("RALLY_SIM_CENSUS", "5"), ("RALLY_SIM_FIRST", "3")],
                true,
                Seeds {
                    first: 3,
                    n: 5,
                    census: true,
                },
            ),
        ];
        for (set, census, want) in ok {
            assert_eq!(parse(100, *census, vars(set)), Ok(*want), "{set:?}");
        }
    }

    #[test]
    fn a_run_that_would_check_nothing_or_ignore_a_variable_is_refused() {
        let bad: &[(Set, bool, &str)] = &[
            (
                &[("RALLY_SIM_SEEDS", "0")],
                false,
                "RALLY_SIM_SEEDS=0 runs no seed",
            ),
            (
                &[("RALLY_SIM_SEEDS", "ten")],
                false,
                "must be a whole number",
            ),
            (
                &[("RALLY_SIM_FIRST", "-1")],
                false,
                "must be a whole number",
            ),
            (&[("RALLY_SIM_SEED", "")], false, "must be a whole number"),
            (
                &[("RALLY_SIM_SEED", "3"), ("RALLY_SIM_SEEDS", "3")],
                false,
                "replays one seed",
            ),
            (
                &[("RALLY_SIM_SEED", "3"), ("RALLY_SIM_FIRST", "3")],
                false,
                "replays one seed",
            ),
            (&[("RALLY_SIM_CENSUS", "3")], false, "takes no census"),
            (
                &[("RALLY_SIM_CENSUS", "3"), ("RALLY_SIM_SEEDS", "3")],
                true,
                "unset RALLY_SIM_SEEDS",
            ),
            (
                &[("RALLY_SIM_CENSUS", "0")],
                true,
                "RALLY_SIM_CENSUS=0 runs no seed",
            ),
            (
                &[("RALLY_SIM_FIRST", "18446744073709551615")],
                false,
                "past the last seed",
            ),
        ];
        for (set, census, want) in bad {
            let e = parse(100, *census, vars(set)).expect_err(&format!("{set:?}"));
            assert!(e.contains(want), "{set:?}: {e}");
        }
    }

    #[test]
    fn the_tally_counts_seeds_and_times_and_holds_each_kind_to_its_floor() {
        let mut t = Tally::default();
        t.add([("kills", 2), ("stalls", 0)]);
        t.add([("kills", 0), ("stalls", 0)]);
        t.never_fired("stalls");
        t.add([("kills", 1), ("stalls", 3)]);
        assert_eq!(t.seeds_of("kills"), 2);
        assert_eq!(
            t.summary(),
            "faults that fired, in seeds (times) of 3: kills 2 (3x), stalls 1 (3x) (drawn, never fired: 1); no fault in 1"
        );
        t.assert_floors(3); // floor 1: both kinds fired
        let kinds_below = std::panic::catch_unwind(|| {
            let mut t = Tally::default();
            t.add([("kills", 1), ("stalls", 0)]);
            t.add([("kills", 1), ("stalls", 0)]);
            t.assert_floors(2);
        });
        let e = kinds_below.expect_err("stalls never fired");
        let msg = e.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(
            msg.starts_with("stalls fired in 0 of 2 seeds, below the floor of 1"),
            "{msg}"
        );
    }

    #[test]
    fn fewer_seeds_than_the_floors_ratio_make_no_floor() {
        assert_eq!(floor(19, 20), 0);
        assert_eq!(floor(10_000, 50), 200);
        let mut t = Tally::default();
        t.add([("kills", 0)]);
        t.assert_floors(20);
    }

    #[test]
    fn the_replay_command_names_the_seed_and_the_test() {
        assert_eq!(
            replay_command("rallypoint-rpc", "--lib", "rref::sim::tests::x", 5),
            "RALLY_SIM_SEED=5 cargo nextest run -p rallypoint-rpc --lib rref::sim::tests::x --no-capture"
        );
    }
}
