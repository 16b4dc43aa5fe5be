//! Per-step fault tolerance across test hosts (issue 47 §4): one replica
//! group of one process per host, torchft 0.2.0's own `Manager`,
//! `DistributedDataParallel` and `Optimizer` on a small MLP
//! (`crates/bench/py/ft_worker.py`), with our parts: `ProcessGroupRally`,
//! `RallyTransport` and `rally lighthouse` (on node1, beside replica 0).
//!
//! Every test checks, besides its own bound:
//! - no survivor was restarted: each survivor's records carry one pid, the
//!   pid of the process the test started, which is still the one that ends;
//! - every step committed by several replicas has one digest (parameters and
//!   optimizer state, SHA-256) on all of them, so a healed replica's state
//!   equals its peers' bitwise;
//! - every survivor ends normally.
//!
//! Bounds are a configured deadline plus a margin (`MARGIN`), never a speed:
//! the group's own timeout is set far above them (`PG_TIMEOUT`), so meeting
//! one proves the path that was meant (the connection's end, the
//! lighthouse's keep-alive and its push), not the group's timeout.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use rallypoint_testhosts::{cluster, Cluster, Host};
use serde_json::Value;

use super::{python, Job, LIMIT};

/// The group's timeout in these tests: far above every bound below.
const PG_TIMEOUT: &str = "30";
/// The margin on a bound (the project's rule for tests across hosts).
pub(super) const MARGIN: Duration = Duration::from_secs(5);
/// Where the lighthouse listens on node1.
const LH_PORT: u16 = 29710;

pub(super) fn worker() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../bench/py/ft_worker.py")
}

/// `rally lighthouse` on `host`, its keep-alive `heartbeat_ms`.
pub(super) fn lighthouse_on(host: &Host, dir: &Path, heartbeat_ms: u64) -> Job {
    let mut cmd = host.command(env!("CARGO_BIN_EXE_rally"));
    cmd.args(["lighthouse", "--min_replicas", "1", "--bind"])
        .arg(format!("{}:{LH_PORT}", host.addr))
        .args(["--heartbeat_timeout_ms", &heartbeat_ms.to_string()]);
    let j = Job::spawn(cmd, dir, &format!("lighthouse-{}", unix_ms()));
    let t0 = Instant::now();
    while !j.output().contains("listening on") {
        assert!(t0.elapsed() < LIMIT, "no lighthouse: {}", j.output());
        std::thread::sleep(Duration::from_millis(20));
    }
    j
}

pub(super) fn unix_ms() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis()
}

/// How each replica group is launched.
#[derive(Clone, Copy, PartialEq)]
pub(super) enum Launch {
    /// One Python process per group, torchft's loop over our parts
    /// (issue 47).
    Torchft,
    /// `rally run --ft --standalone` per group, `rallypoint.ft`'s loop
    /// (issue 48): the group's manager and store in the agent, a failed
    /// worker restarted by its own agent.
    RallyRunFt,
}

/// The replicas' records, one file per process started (under `rally run`,
/// one per group: a restarted worker appends to its predecessor's).
pub(super) struct Replica {
    pub(super) job: Job,
    out: PathBuf,
    /// `out` with `{rank}` for the group rank.
    pattern: PathBuf,
    /// The worker's pid when the test started it itself.
    pid: Option<u32>,
}

impl Replica {
    /// Group rank `r`'s records.
    pub(super) fn rank(&self, r: usize) -> Vec<Value> {
        let p = self
            .pattern
            .to_str()
            .unwrap()
            .replace("{rank}", &r.to_string());
        std::fs::read_to_string(p)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    pub(super) fn records(&self) -> Vec<Value> {
        std::fs::read_to_string(&self.out)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// The time (unix seconds) of the first record matching `f`.
    pub(super) fn first(&self, f: impl Fn(&Value) -> bool) -> Option<f64> {
        self.records()
            .into_iter()
            .find(|r| f(r))
            .and_then(|r| r["t"].as_f64())
    }

    pub(super) fn committed(&self) -> BTreeMap<u64, String> {
        self.records()
            .into_iter()
            .filter(|r| r["committed"] == true)
            .map(|r| {
                let step = r["step"].as_u64().unwrap();
                (step, r["digest"].as_str().unwrap_or("").to_owned())
            })
            .collect()
    }
}

pub(super) struct FtJob {
    pub(super) c: Cluster,
    pub(super) dir: tempfile::TempDir,
    site: PathBuf,
    pub(super) lighthouse: Option<Job>,
    pub(super) replicas: Vec<Replica>,
    launch: Launch,
    /// Processes per group (`rally run --ft` only).
    nproc: usize,
}

impl FtJob {
    fn start(n: usize, heartbeat_ms: u64) -> FtJob {
        FtJob::start_with(n, heartbeat_ms, Launch::Torchft)
    }

    /// `n` hosts, `rally lighthouse` on the first (its keep-alive
    /// `heartbeat_ms`), no replica yet.
    pub(super) fn start_with(n: usize, heartbeat_ms: u64, launch: Launch) -> FtJob {
        let c = cluster(n);
        let dir = tempfile::tempdir().unwrap();
        let site = super::torch_backend::package(dir.path());
        let lighthouse = Some(lighthouse_on(c.host(0), dir.path(), heartbeat_ms));
        FtJob {
            c,
            dir,
            site,
            lighthouse,
            replicas: Vec::new(),
            launch,
            nproc: 1,
        }
    }

    /// Groups of `n` processes from now on (`rally run --ft` only): group
    /// rank `r` writes its own records (`Replica::rank`); `records` and the
    /// checks read group rank 0's.
    pub(super) fn with_nproc(mut self, n: usize) -> FtJob {
        assert!(self.launch == Launch::RallyRunFt);
        self.nproc = n;
        self
    }

    /// The lighthouse's `host:port`.
    pub(super) fn lighthouse_addr(&self) -> String {
        format!("{}:{LH_PORT}", self.c.host(0).addr)
    }

    /// Starts replica group `i` on host `i`, with `env` on top of the common
    /// one (and, under `rally run`, `args` before the script).
    pub(super) fn replica(&mut self, i: usize, env: &[(&str, &str)]) -> usize {
        self.replica_with(i, env, &[])
    }

    pub(super) fn replica_with(&mut self, i: usize, env: &[(&str, &str)], args: &[&str]) -> usize {
        let host = self.c.host(i);
        let k = self.replicas.len();
        let (out, pattern) = if self.nproc > 1 {
            let p = self
                .dir
                .path()
                .join(format!("replica{i}.{k}.rank{{rank}}.jsonl"));
            let rank0 = PathBuf::from(p.to_str().unwrap().replace("{rank}", "0"));
            (rank0, p)
        } else {
            let p = self.dir.path().join(format!("replica{i}.{k}.jsonl"));
            (p.clone(), p)
        };
        let nproc = self.nproc.to_string();
        let mut cmd: Command = match self.launch {
            Launch::Torchft => {
                let mut cmd = host.command(python());
                cmd.arg(worker())
                    .env("REPLICA_GROUP_ID", i.to_string())
                    .env("MASTER_ADDR", host.addr.to_string())
                    .env("MASTER_PORT", "29720")
                    .env(
                        "TORCHFT_LIGHTHOUSE",
                        format!("http://{}", self.lighthouse_addr()),
                    )
                    // torchft's manager sleeps quorum_timeout / (retries + 1)
                    // between tries of a failed quorum call: 60 s / 121, ~0.5 s.
                    .env("TORCHFT_QUORUM_RETRIES", "120")
                    .env("FT_SIDE", "rally");
                cmd
            }
            Launch::RallyRunFt => {
                let mut cmd = host.command(env!("CARGO_BIN_EXE_rally"));
                cmd.args(["run", "--ft", "--standalone", "--nproc-per-node", &nproc])
                    .args(["--ft-replica-group", &i.to_string()])
                    .args(["--ft-lighthouse", &self.lighthouse_addr()])
                    .args(["--max-restarts", "3"])
                    .args(args)
                    .arg(python())
                    .arg(worker())
                    .env("FT_SIDE", "ft");
                cmd
            }
        };
        cmd.env("PYTHONPATH", &self.site)
            .env("NUM_REPLICA_GROUPS", self.c.hosts().len().to_string())
            .env("FT_MODEL", "small")
            .env("FT_DIGEST", "1")
            .env("FT_PG_TIMEOUT", PG_TIMEOUT)
            .env("FT_OUT", &pattern)
            .env("FT_STEPS", "100000")
            .env("FT_STOP_FILE", self.stop_file())
            .env_remove("HOSTNAME");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let job = Job::spawn(cmd, self.dir.path(), &format!("replica{i}.{k}"));
        let pid = (self.launch == Launch::Torchft).then(|| job.child.id());
        self.replicas.push(Replica {
            job,
            out,
            pattern,
            pid,
        });
        k
    }

    /// Once this file exists every replica ends after its current step.
    fn stop_file(&self) -> PathBuf {
        self.dir.path().join("stop")
    }

    /// Every replica ends normally after its current step.
    pub(super) fn stop(&self) {
        std::fs::write(self.stop_file(), b"").unwrap();
    }

    pub(super) fn wait_for(&self, what: &str, limit: Duration, mut f: impl FnMut(&FtJob) -> bool) {
        let t0 = Instant::now();
        while !f(self) {
            assert!(
                t0.elapsed() < limit,
                "waited {limit:?} for {what}\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until every replica committed one same step at or past
    /// `from`, and returns the first such step. (A replica that joined
    /// late heals to its peers' step, past `from` maybe, and never commits
    /// the steps before it.)
    pub(super) fn all_in(&self, from: u64) -> u64 {
        let first = |j: &FtJob| {
            let mut sets = j.replicas.iter().map(|r| r.committed());
            let head = sets.next()?;
            let rest: Vec<_> = sets.collect();
            head.keys()
                .copied()
                .filter(|s| *s >= from)
                .find(|s| rest.iter().all(|c| c.contains_key(s)))
        };
        self.wait_for(
            &format!("a step at or past {from} committed by every replica"),
            LIMIT,
            |j| first(j).is_some(),
        );
        first(self).unwrap()
    }

    pub(super) fn logs(&self) -> String {
        let mut s = String::new();
        for j in self
            .lighthouse
            .iter()
            .chain(self.replicas.iter().map(|r| &r.job))
        {
            let o = j.output();
            let tail = &o[o.len().saturating_sub(3000)..];
            s.push_str(&format!("--- {}\n{tail}\n", j.log.display()));
        }
        s
    }

    /// The survivors (`ks`) each commit a step past `step`, within `bound`
    /// of `t0` (unix seconds); returns the slowest's gap. A record's step is
    /// the Manager's after the commit, so for a fault inside step `AT` the
    /// survivors' commit of that step reads `AT + 1` (the victim may have
    /// sent its part before it died); the first step begun after the fault
    /// reads `AT + 2`, past `AT + 1`.
    /// SIGKILLs the lighthouse, starts it again on its address 0.5 s
    /// later, and waits for groups 0 to 2 to commit again within a second
    /// of its return (+ margin); the new lighthouse's log.
    pub(super) fn restart_the_lighthouse(&mut self) -> String {
        drop(self.lighthouse.take());
        std::thread::sleep(Duration::from_millis(500));
        let dir = self.dir.path().to_owned();
        self.lighthouse = Some(lighthouse_on(self.c.host(0), &dir, 1000));
        let t0 = unix_ms() as f64 / 1000.0;
        let step = self
            .replicas
            .iter()
            .map(|r| r.committed().keys().max().copied().unwrap_or(0))
            .max()
            .unwrap();
        self.survivors_commit_past(&[0, 1, 2], step, t0, Duration::from_secs(1));
        self.lighthouse
            .as_ref()
            .map(|l| l.output())
            .unwrap_or_default()
    }

    pub(super) fn survivors_commit_past(
        &self,
        ks: &[usize],
        step: u64,
        t0: f64,
        bound: Duration,
    ) -> f64 {
        self.wait_for("the survivors' next commit", bound + MARGIN + LIMIT, |j| {
            ks.iter()
                .all(|&k| j.replicas[k].committed().keys().any(|s| *s > step))
        });
        let gap = ks
            .iter()
            .map(|&k| {
                self.replicas[k]
                    .first(|r| r["committed"] == true && r["step"].as_u64() > Some(step))
                    .unwrap()
                    - t0
            })
            .fold(0.0, f64::max);
        eprintln!("survivors committed past step {step} {gap:.3} s after the fault (bound {bound:?} + {MARGIN:?})");
        assert!(
            gap < (bound + MARGIN).as_secs_f64(),
            "the survivors' next commit came {gap:.3} s after the fault, past {bound:?} + {MARGIN:?}\n{}",
            self.logs()
        );
        gap
    }

    /// Every survivor `ks` ends normally, kept its one pid, and every step
    /// committed by several replicas has one digest.
    pub(super) fn finish(&mut self, ks: &[usize]) {
        self.finish_but(ks, None);
    }

    /// [`FtJob::finish`], but for the last commit of `gone`, a replica cut
    /// off or powered off for good: an all_reduce can complete on one
    /// member before the others have read its last bytes (docs/ft-loop.md,
    /// "End the groups together"), so one gone in its all_reduce may have
    /// committed a step that the survivors then failed and made again
    /// without it. Its line ends there; every earlier commit of it must
    /// agree (found in a full run: the cut for good of `ft_hosts`, replica
    /// 2 committed step 11, the survivors made it again).
    pub(super) fn finish_but(&mut self, ks: &[usize], gone: Option<usize>) {
        self.stop();
        for &k in ks {
            let r = &mut self.replicas[k];
            let s = r.job.wait(LIMIT);
            assert!(s.success(), "replica {k}: {s}\n{}", self.logs());
            let r = &self.replicas[k];
            let pids: std::collections::BTreeSet<u64> = r
                .records()
                .iter()
                .filter_map(|x| x["pid"].as_u64())
                .collect();
            assert_eq!(pids.len(), 1, "replica {k} was restarted: pids {pids:?}");
            if let Some(pid) = r.pid {
                assert!(
                    pids.contains(&u64::from(pid)),
                    "replica {k}: {pids:?} is not {pid}"
                );
            }
        }
        let mut by_step: BTreeMap<u64, Vec<(usize, String)>> = BTreeMap::new();
        for (k, r) in self.replicas.iter().enumerate() {
            let mut committed = r.committed();
            if gone == Some(k) {
                committed.pop_last();
            }
            for (s, d) in committed {
                by_step.entry(s).or_default().push((k, d));
            }
        }
        for (s, ds) in &by_step {
            assert!(
                ds.windows(2).all(|w| w[0].1 == w[1].1),
                "step {s} was committed with different states: {ds:?}"
            );
        }
    }

    pub(super) fn fault_time(&self, k: usize) -> f64 {
        self.replicas[k]
            .first(|r| r["event"] == "fault")
            .expect("the fault's moment")
    }
}

/// The step a fault comes at.
pub(super) const AT: u64 = 15;

/// A replica SIGKILLed inside its gradient all_reduce: its connections reset,
/// so the survivors' op fails at once and the lighthouse drops it at once
/// (its keep-alive here is 20 s: meeting the bound proves the connection's
/// end, not the keep-alive). Then it is launched again and heals to its
/// peers' state.
#[test]
fn a_replica_killed_inside_the_all_reduce_is_dropped_at_once_and_heals_on_return() {
    let mut j = FtJob::start(3, 20_000);
    let at = AT.to_string();
    for i in 0..2 {
        j.replica(i, &[]);
    }
    let victim = j.replica(2, &[("FT_FAULT", "kill-allreduce"), ("FT_FAULT_STEP", &at)]);
    j.wait_for("the victim's fault", LIMIT, |j| {
        j.replicas[victim]
            .first(|r| r["event"] == "fault")
            .is_some()
    });
    let t0 = j.fault_time(victim);
    j.survivors_commit_past(&[0, 1], AT + 1, t0, Duration::from_millis(250));
    let _ = j.replicas[victim].job.wait(LIMIT);
    let back = j.replica(2, &[]);
    j.wait_for("the returned replica's commits", LIMIT, |j| {
        j.replicas[back].committed().len() >= 3
    });
    j.finish(&[0, 1, back]);
}

/// A replica SIGSTOPped inside the all_reduce, past the keep-alive (1 s):
/// the lighthouse drops it and pushes an abort into the survivors' group, so
/// they go on without waiting out the group's 30 s timeout. Resumed, it
/// heals and takes part again.
#[test]
fn a_replica_stopped_past_the_keep_alive_is_dropped_and_rejoins_when_resumed() {
    let mut j = FtJob::start(3, 1000);
    let at = AT.to_string();
    for i in 0..2 {
        j.replica(i, &[]);
    }
    let victim = j.replica(2, &[("FT_FAULT", "stop-allreduce"), ("FT_FAULT_STEP", &at)]);
    j.wait_for("the victim's fault", LIMIT, |j| {
        j.replicas[victim]
            .first(|r| r["event"] == "fault")
            .is_some()
    });
    let t0 = j.fault_time(victim);
    j.survivors_commit_past(&[0, 1], AT + 1, t0, Duration::from_millis(1250));
    j.replicas[victim].job.signal(libc::SIGCONT);
    let before = j.replicas[victim].committed().len();
    j.wait_for("the resumed replica's commits", LIMIT, |j| {
        j.replicas[victim].committed().len() >= before + 3
    });
    j.finish(&[0, 1, victim]);
}

/// A host cut off for good (no reset reaches anyone): dropped at the
/// lighthouse's keep-alive (1 s), the survivors' group aborted by its push.
#[test]
fn a_host_cut_off_for_good_is_dropped_at_the_keep_alive() {
    let mut j = FtJob::start(3, 1000);
    for i in 0..3 {
        j.replica(i, &[]);
    }
    j.all_in(10);
    let t0 = unix_ms() as f64 / 1000.0;
    j.c.host(2).cut();
    let step = j.replicas[0].committed().keys().max().copied().unwrap() + 1;
    j.survivors_commit_past(&[0, 1], step, t0, Duration::from_millis(1250));
    j.finish_but(&[0, 1], Some(2));
    j.c.hosts_mut()[2].power_off();
}

/// A host cut off for less than the keep-alive (20 s here): its replica
/// stays in every quorum, the step it was in waits and goes on, and it
/// commits every step the others commit.
#[test]
fn a_host_cut_off_for_less_than_the_keep_alive_is_ridden_out() {
    let mut j = FtJob::start(3, 20_000);
    for i in 0..3 {
        j.replica(i, &[]);
    }
    let first = j.all_in(10);
    j.c.host(2).cut();
    std::thread::sleep(Duration::from_millis(1500));
    j.c.host(2).heal();
    let cut_at = j
        .replicas
        .iter()
        .map(|r| r.committed().keys().max().copied().unwrap())
        .max()
        .unwrap();
    let until = cut_at + 5;
    j.wait_for("five steps past the cut everywhere", LIMIT, |j| {
        j.replicas
            .iter()
            .all(|r| r.committed().contains_key(&until))
    });
    j.finish(&[0, 1, 2]);
    // From the first step all took part in (before the cut) to five steps
    // past it, every replica committed every step: none was dropped.
    for (k, r) in j.replicas.iter().enumerate() {
        let c = r.committed();
        let missed: Vec<u64> = (first..=until).filter(|s| !c.contains_key(s)).collect();
        assert!(
            missed.is_empty(),
            "replica {k} missed steps {missed:?} around the cut\n{}",
            j.logs()
        );
    }
}

/// The lighthouse SIGKILLed and started again on its address: no replica
/// crashes (torchft's managers retry, `TORCHFT_QUORUM_RETRIES`), and the
/// replicas commit again soon after it is back. torchft's managers do not
/// say which quorum they were last issued, so the new lighthouse waits its
/// startup grace.
#[test]
fn the_lighthouse_killed_and_restarted_stops_no_replica() {
    let mut j = FtJob::start(3, 1000);
    for i in 0..3 {
        j.replica(i, &[]);
    }
    j.all_in(10);
    let log = j.restart_the_lighthouse();
    assert!(
        !log.contains("without the startup grace"),
        "torchft's managers remember no quorum:\n{log}"
    );
    j.finish(&[0, 1, 2]);
}
