//! `rally run` end to end, with real PyTorch (CPU, gloo) workers: standalone DDP,
//! the worker environment against torchrun's, worker and agent failures, growing
//! and shrinking jobs over the dynamic (c10d) and etcd backends, and signals.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

use serde_json::Value;

/// The Python with PyTorch: `RALLY_PYTHON`, else the repo's `.venv`.
fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("RALLY_PYTHON") {
        return p.into();
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python")
}

fn script(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/py")
        .join(name)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A `rally run` (or torchrun) process whose stderr goes to a file.
struct Job {
    child: Child,
    log: PathBuf,
}

impl Job {
    fn spawn(mut cmd: Command, dir: &Path, name: &str) -> Job {
        let log = dir.join(format!("{name}.log"));
        let f = std::fs::File::create(&log).unwrap();
        let child = cmd
            .stdout(f.try_clone().unwrap())
            .stderr(f)
            .spawn()
            .unwrap();
        Job { child, log }
    }

    fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits up to `limit`; a job still running then is killed and the test fails.
    fn wait(&mut self, limit: Duration) -> ExitStatus {
        let log = self.log.clone();
        wait_or_kill(&mut self.child, limit, || {
            std::fs::read_to_string(&log).unwrap_or_default()
        })
    }

    /// The exit status if the job has ended.
    fn try_wait(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().unwrap()
    }

    fn signal(&self, sig: i32) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, sig) };
    }
}

/// Waits up to `limit` for `child`; one still running then is killed and the
/// test fails, showing `output()`.
fn wait_or_kill(child: &mut Child, limit: Duration, output: impl Fn() -> String) -> ExitStatus {
    let t0 = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("still running after {limit:?}:\n{}", output());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `rally lighthouse ARGS` on a port it picks itself (a port picked for
/// it could be taken before it binds: `free_port` races), once it listens:
/// its job and `127.0.0.1:PORT`. A lighthouse that ends before listening
/// fails the test at once, with its output.
fn rally_lighthouse(dir: &Path, args: &[&str]) -> (Job, String) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_rally"));
    c.arg("lighthouse")
        .args(args)
        .args(["--bind", "127.0.0.1:0"]);
    let mut j = Job::spawn(c, dir, "lighthouse");
    let t0 = Instant::now();
    loop {
        let out = j.output();
        let addr = out
            .lines()
            .find_map(|l| l.strip_prefix("rally lighthouse: listening on "));
        if let Some(addr) = addr {
            return (j, addr.trim().to_owned());
        }
        if let Some(s) = j.try_wait() {
            panic!("rally lighthouse ended ({s}) before listening:\n{out}");
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "rally lighthouse not listening within 60 s:\n{out}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn rally(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_rally"));
    c.arg("run")
        .args(args)
        .env("PYTHON_EXEC", python())
        .env("RALLY_LOG", "warn");
    c
}

/// The JSON each rank of `ddp_train.py` wrote, by rank.
fn results(dir: &Path) -> BTreeMap<u64, Value> {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| {
            let p = e.unwrap().path();
            (p.extension()? == "json").then_some(p)
        })
        .map(|p| {
            let v: Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
            (v["rank"].as_u64().unwrap(), v)
        })
        .collect()
}

fn ddp_job(
    dir: &Path,
    results: &Path,
    args: &[&str],
    extra_env: &[(&str, &str)],
    name: &str,
) -> Job {
    let mut c = rally(args);
    c.arg(script("ddp_train.py")).env("RESULT_DIR", results);
    for (k, v) in extra_env {
        c.env(k, v);
    }
    Job::spawn(c, dir, name)
}

const LIMIT: Duration = Duration::from_secs(120);

#[test]
fn ddp_training_runs_under_rally_run_standalone() {
    let (dir, out) = with_results();
    let mut job = ddp_job(
        dir.path(),
        &out,
        &["--standalone", "--nproc-per-node", "2"],
        &[],
        "job",
    );
    let status = job.wait(LIMIT);
    assert!(status.success(), "{status}\n{}", job.output());
    let r = results(&out);
    assert_eq!(r.len(), 2, "{}", job.output());
    assert!(r
        .values()
        .all(|v| v["world_size"] == 2 && v["attempt"] == 0));
    let log = job.output();
    assert!(
        log.contains("rally run: run ") && log.contains("job succeeded"),
        "{log}"
    );
}

/// What each worker sees under a launcher, minus what the test process had.
fn worker_envs(
    launcher: Command,
    dir: &Path,
    name: &str,
) -> BTreeMap<String, BTreeMap<String, String>> {
    let dump = dir.join(name);
    std::fs::create_dir(&dump).unwrap();
    let parent: Vec<String> = std::env::vars().map(|(k, _)| k).collect();
    let mut c = launcher;
    c.env("DUMP_DIR", &dump)
        .env("DUMP_PARENT_KEYS", serde_json::to_string(&parent).unwrap());
    let mut job = Job::spawn(c, dir, name);
    let status = job.wait(LIMIT);
    assert!(status.success(), "{name}: {status}\n{}", job.output());
    let mut all = BTreeMap::new();
    for rank in ["0", "1"] {
        let v: BTreeMap<String, String> = serde_json::from_str(
            &std::fs::read_to_string(dump.join(format!("{rank}.json"))).unwrap(),
        )
        .unwrap();
        all.insert(rank.to_owned(), v);
    }
    all
}

#[test]
fn workers_see_the_same_environment_as_under_torchrun() {
    let dir = tempfile::tempdir().unwrap();
    let args = ["--standalone", "--nproc-per-node", "2"];
    let mut torchrun = Command::new(python());
    torchrun
        .args(["-m", "torch.distributed.run"])
        .args(args)
        .arg(script("dump_env.py"));
    let theirs = worker_envs(torchrun, dir.path(), "torchrun");
    let mut ours = rally(&args);
    ours.arg(script("dump_env.py")).env_remove("PYTHON_EXEC");
    // PYTHON_EXEC is how we find the venv's Python; torchrun uses its own.
    ours.env("PYTHON_EXEC", python());
    let ours = worker_envs(ours, dir.path(), "rally");
    // Per-run values differ by nature; everything else must be identical.
    let varies = [
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_ERROR_FILE",
        "PYTHON_EXEC",
        "DUMP_DIR",
        "DUMP_PARENT_KEYS",
        "RALLY_LOG",
        "_",
        // rallypoint's own: the mark by which nothing outlives the agent.
        "RALLY_AGENT_MARK",
    ];
    for rank in ["0", "1"] {
        let strip = |m: &BTreeMap<String, String>| -> BTreeMap<String, String> {
            m.iter()
                .filter(|(k, _)| !varies.contains(&k.as_str()))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        };
        assert_eq!(strip(&ours[rank]), strip(&theirs[rank]), "rank {rank}");
        for k in [
            "MASTER_PORT",
            "TORCHELASTIC_RUN_ID",
            "TORCHELASTIC_ERROR_FILE",
        ] {
            assert!(
                ours[rank].contains_key(k) && theirs[rank].contains_key(k),
                "{k}"
            );
        }
        assert!(ours[rank]["TORCHELASTIC_ERROR_FILE"]
            .ends_with(&format!("attempt_0/{rank}/error.json")));
    }
}

#[test]
fn a_killed_worker_is_restarted_and_the_job_completes() {
    let (dir, out) = with_results();
    let mut job = ddp_job(
        dir.path(),
        &out,
        &[
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
        ],
        &[("KILL_RANK", "1")],
        "job",
    );
    let status = job.wait(LIMIT);
    let log = job.output();
    assert!(status.success(), "{status}\n{log}");
    let r = results(&out);
    assert_eq!(r.len(), 2, "{log}");
    assert!(
        r.values().all(|v| v["attempt"] == 1),
        "restarted once: {r:?}"
    );
    assert!(
        log.contains("restarting the group (restart 1 of 1)"),
        "{log}"
    );
}

#[test]
fn out_of_restarts_the_job_fails_naming_the_root_cause() {
    let (dir, out) = with_results();
    let events = dir.path().join("events.jsonl");
    let mut job = ddp_job(
        dir.path(),
        &out,
        &[
            "--standalone",
            "--nproc-per-node",
            "2",
            "--events",
            events.to_str().unwrap(),
        ],
        &[("KILL_RANK", "1")],
        "job",
    );
    let status = job.wait(LIMIT);
    let log = job.output();
    assert_eq!(status.code(), Some(1), "{log}");
    // torchrun's summary layout: a SIGKILL is exit code -9, a missing error
    // file is <N/A>, and the signal stands in for the traceback.
    assert!(log.contains("ddp_train.py FAILED"), "{log}");
    assert!(log.contains("Root Cause (first observed failure"), "{log}");
    assert!(
        log.contains("rank      : 1 (local_rank: 1, node: 0)"),
        "{log}"
    );
    assert!(log.contains("exitcode  : -9 (pid: "), "{log}");
    assert!(log.contains("(SIGKILL)"), "{log}");
    assert!(log.contains("error_file: <N/A>"), "{log}");
    assert!(
        log.contains("traceback : Signal 9 (SIGKILL) received by PID"),
        "{log}"
    );
    let events = std::fs::read_to_string(&events).unwrap();
    let names: Vec<String> = events
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["event"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    for e in [
        "rendezvous.completed",
        "workers.started",
        "worker.failed",
        "agent.finished",
    ] {
        assert!(names.iter().any(|n| n == e), "no {e} in {names:?}");
    }
    let last: Value = serde_json::from_str(events.lines().last().unwrap()).unwrap();
    assert_eq!(last["event"], "agent.finished", "{events}");
    assert_eq!(last["state"], "failed", "{events}");
    assert_eq!(last["exit_code"], 1, "{events}");
}

/// Two agents on loopback, `--nnodes` and a rendezvous given by `rdzv`.
fn two_nodes(
    dir: &Path,
    out: &Path,
    rdzv: &[&str],
    env: &[(&str, &str)],
    second_after: Duration,
) -> (Job, Job) {
    let mut args = vec!["--nproc-per-node", "1"];
    args.extend_from_slice(rdzv);
    let a = ddp_job(dir, out, &args, env, "a");
    std::thread::sleep(second_after);
    let b = ddp_job(dir, out, &args, env, "b");
    (a, b)
}

/// [`two_nodes`], both run to success; returns the ranks' results and the first
/// agent's output.
fn two_nodes_ok(
    dir: &Path,
    out: &Path,
    rdzv: &[&str],
    env: &[(&str, &str)],
    second_after: Duration,
) -> (BTreeMap<u64, Value>, String) {
    let (mut a, mut b) = two_nodes(dir, out, rdzv, env, second_after);
    let (sa, sb) = (a.wait(LIMIT), b.wait(LIMIT));
    assert!(
        sa.success() && sb.success(),
        "{}\n---\n{}",
        a.output(),
        b.output()
    );
    (results(out), a.output())
}

/// A temporary directory with an empty `results/` in it.
fn with_results() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("results");
    std::fs::create_dir(&out).unwrap();
    (dir, out)
}

#[test]
fn two_agents_form_a_two_node_job_over_the_c10d_backend() {
    let (dir, out) = with_results();
    let endpoint = format!("127.0.0.1:{}", free_port());
    let rdzv = [
        "--nnodes",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        &endpoint,
        "--rdzv-id",
        "two",
    ];
    let (r, _) = two_nodes_ok(dir.path(), &out, &rdzv, &[], Duration::ZERO);
    assert_eq!(r.len(), 2);
    assert!(r
        .values()
        .all(|v| v["world_size"] == 2 && v["group_world_size"] == 2));
}

#[test]
fn a_killed_agent_is_noticed_through_the_rendezvous_and_the_survivor_re_forms() {
    // Workers that never talk to each other: only the rendezvous can tell the
    // survivor that its peer node is gone.
    let dir = tempfile::tempdir().unwrap();
    let endpoint = format!("127.0.0.1:{}", free_port());
    let agent = |name: &str| {
        let mut c = rally(&[
            "--nnodes",
            "1:2",
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            &endpoint,
            "--rdzv-id",
            "shrink",
            "--rdzv-conf",
            "last_call_timeout=3,keep_alive_interval=0.5,keep_alive_max_attempt=2",
        ]);
        c.arg(script("sleeper.py")).env("MARKER_DIR", dir.path());
        Job::spawn(c, dir.path(), name)
    };
    // The first agent hosts the rendezvous store; the second joins its last call.
    let mut a = agent("a");
    std::thread::sleep(Duration::from_secs(1));
    let b = agent("b");
    for r in 0..2 {
        wait_for(&dir.path().join(format!("0-{r}.json")), LIMIT);
    }
    let killed = Instant::now();
    b.signal(libc::SIGKILL);
    let sa = a.wait(LIMIT);
    let log = a.output();
    assert!(sa.success(), "{sa}\n{log}");
    assert!(log.contains("membership changed"), "{log}");
    // The survivor ran attempt 1 alone, as rank 0 of 1.
    let after: Value =
        serde_json::from_str(&wait_for(&dir.path().join("1-0.json"), LIMIT)).unwrap();
    assert_eq!(after["WORLD_SIZE"], "1");
    assert_eq!(after["GROUP_WORLD_SIZE"], "1");
    eprintln!(
        "re-formed and finished {:?} after the kill",
        killed.elapsed()
    );
}

#[test]
fn a_worker_failure_on_one_node_restarts_both_nodes() {
    let (dir, out) = with_results();
    let endpoint = format!("127.0.0.1:{}", free_port());
    let rdzv = [
        "--nnodes",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        &endpoint,
        "--rdzv-id",
        "restart2",
        "--max-restarts",
        "1",
    ];
    let (r, _) = two_nodes_ok(
        dir.path(),
        &out,
        &rdzv,
        &[("KILL_RANK", "1")],
        Duration::ZERO,
    );
    assert_eq!(r.len(), 2);
    // Both nodes agree on the attempt number.
    assert!(
        r.values()
            .all(|v| v["world_size"] == 2 && v["attempt"] == 1),
        "{r:?}"
    );
}

#[test]
fn a_late_node_joins_and_the_group_grows() {
    let (dir, out) = with_results();
    let endpoint = format!("127.0.0.1:{}", free_port());
    let rdzv = [
        "--nnodes",
        "1:2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        &endpoint,
        "--rdzv-id",
        "grow",
        "--rdzv-conf",
        "last_call_timeout=1",
    ];
    let env = [("STEPS", "60"), ("STEP_SLEEP", "0.1")];
    // The second node starts once the first runs alone.
    let (r, log) = two_nodes_ok(dir.path(), &out, &rdzv, &env, Duration::from_secs(8));
    assert!(log.contains("membership changed"), "{log}");
    assert_eq!(r.len(), 2, "{r:?}");
    assert!(r
        .values()
        .all(|v| v["world_size"] == 2 && v["attempt"].as_u64().unwrap() >= 1));
}

fn wait_for(path: &Path, limit: Duration) -> String {
    let t0 = Instant::now();
    while !path.exists() {
        assert!(t0.elapsed() < limit, "{} never appeared", path.display());
        std::thread::sleep(Duration::from_millis(20));
    }
    std::fs::read_to_string(path).unwrap()
}

fn alive(pid: i32) -> bool {
    // Reaped or not, a zombie is not running; read its state.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => !s
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

#[test]
fn sigterm_reaches_the_workers_and_sigkill_follows_the_grace_period() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = rally(&[
        "--standalone",
        "--nproc-per-node",
        "2",
        "--shutdown-timeout",
        "2",
    ]);
    c.arg(script("stubborn.py")).env("MARKER_DIR", dir.path());
    let mut job = Job::spawn(c, dir.path(), "job");
    let pids: Vec<i32> = (0..2)
        .map(|r| {
            wait_for(&dir.path().join(format!("{r}.pid")), LIMIT)
                .parse()
                .unwrap()
        })
        .collect();
    let t0 = Instant::now();
    job.signal(libc::SIGTERM);
    let status = job.wait(LIMIT);
    let took = t0.elapsed();
    assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{}", job.output());
    for r in 0..2 {
        assert!(
            dir.path().join(format!("{r}.term")).exists(),
            "rank {r} never got SIGTERM"
        );
    }
    assert!(
        took >= Duration::from_secs(2),
        "SIGKILL came before the grace period: {took:?}"
    );
    assert!(pids.iter().all(|p| !alive(*p)), "a worker survived");
}

#[test]
fn sigkill_to_the_agent_leaves_no_worker_alive() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = rally(&["--standalone", "--nproc-per-node", "2"]);
    c.arg(script("stubborn.py")).env("MARKER_DIR", dir.path());
    let mut job = Job::spawn(c, dir.path(), "job");
    let pids: Vec<i32> = (0..2)
        .map(|r| {
            wait_for(&dir.path().join(format!("{r}.pid")), LIMIT)
                .parse()
                .unwrap()
        })
        .collect();
    job.signal(libc::SIGKILL);
    job.wait(LIMIT);
    let t0 = Instant::now();
    while pids.iter().any(|p| alive(*p)) {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "workers outlived a SIGKILLed agent"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn bad_flags_get_a_clear_message_and_exit_code_2() {
    for (args, expect) in [
        (vec!["--nnodes", "3:2", "x"], "MIN <= MAX"),
        (vec!["--nproc-per-node", "many", "x"], "--nproc-per-node"),
        (vec!["--redirects", "7", "x"], "--redirects"),
        (vec!["-m", "--no-python", "x"], "cannot be used together"),
        (
            vec!["--signals-to-handle", "SIGNOPE", "x"],
            "--signals-to-handle",
        ),
        (vec!["--rdzv-conf", "a=", "x"], "rendezvous option"),
    ] {
        let o = rally(&args).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(expect), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    // An unknown flag is clap's usage error, also code 2.
    let o = rally(&["--no-such-flag", "x"]).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
}

#[cfg(feature = "etcd")]
#[test]
fn two_agents_form_a_two_node_job_over_etcd() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let etcd = rt
        .block_on(rallypoint_rendezvous::etcd::testing::EtcdServer::start())
        .unwrap();
    let (dir, out) = with_results();
    let rdzv = [
        "--nnodes",
        "2",
        "--rdzv-backend",
        "etcd",
        "--rdzv-endpoint",
        &etcd.endpoint,
        "--rdzv-id",
        "etcdjob",
        "--local-addr",
        "127.0.0.1",
    ];
    let (r, _) = two_nodes_ok(dir.path(), &out, &rdzv, &[], Duration::ZERO);
    assert_eq!(r.len(), 2);
    assert!(r.values().all(|v| v["world_size"] == 2));
}

fn http_get(port: u16, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut c = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    c.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
        .ok()?;
    let mut out = String::new();
    c.read_to_string(&mut out).ok()?;
    Some(out)
}

#[test]
fn the_status_endpoint_reports_round_workers_and_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut job = Job::spawn(
        rally(&[
            "--standalone",
            "--nproc-per-node",
            "2",
            "--status-port",
            &port.to_string(),
            "--no-python",
            "sleep",
            "3",
        ]),
        dir.path(),
        "job",
    );
    let t0 = Instant::now();
    let status = loop {
        if let Some(r) = http_get(port, "/status") {
            if r.contains("\"running\"") && r.contains("\"pid\"") {
                break r;
            }
        }
        assert!(t0.elapsed() < LIMIT, "no running status: {}", job.output());
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.starts_with("HTTP/1.1 200"), "{status}");
    let body: Value = serde_json::from_str(status.split("\r\n\r\n").nth(1).unwrap()).unwrap();
    assert_eq!(body["nodes"], 1);
    assert_eq!(body["world_size"], 2);
    assert_eq!(body["workers"].as_array().unwrap().len(), 2);
    assert_eq!(body["restarts"], 0);
    let metrics = http_get(port, "/metrics").unwrap();
    assert!(metrics.contains("rally_workers_running{"), "{metrics}");
    assert!(
        metrics.contains("rally_world_size{") && metrics.contains("} 2\n"),
        "{metrics}"
    );
    assert!(job.wait(LIMIT).success(), "{}", job.output());
}

/// Workers of a real-process scenario: `n` copies of this test binary (with
/// `args` and `var=value` set: the role, see [`role`]), on a fresh store server
/// they reach through env:// as clients, each past the `READY` line it
/// prints. Keep the returned store (runtime and server) while they run.
fn ready_workers(
    args: &[&str],
    (var, value): (&str, &str),
    n: usize,
) -> (
    (
        tokio::runtime::Runtime,
        rallypoint_store::server::ServerHandle,
    ),
    Vec<Child>,
) {
    use std::io::{BufRead, BufReader};
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let server = rt
        .block_on(rallypoint_store::server::Server::bind(
            "127.0.0.1:0".parse().unwrap(),
            Default::default(),
        ))
        .unwrap();
    let port = server.local_addr().port();
    let handle = rt.block_on(async { server.spawn() });
    let mut children: Vec<Child> = (0..n)
        .map(|r| {
            Command::new(std::env::current_exe().unwrap())
                .args(args)
                .env(var, value)
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("TORCHELASTIC_USE_AGENT_STORE", "True")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for c in &mut children {
        let mut out = BufReader::new(c.stdout.take().unwrap());
        let mut line = String::new();
        while !line.contains("READY") {
            line.clear();
            assert!(
                out.read_line(&mut line).unwrap() > 0,
                "a worker ended before it was ready"
            );
        }
    }
    ((rt, handle), children)
}

/// An example of this workspace, built by cargo beside this test binary's deps/.
fn built_example(name: &str) -> String {
    let exe = std::env::current_exe().unwrap();
    let example = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join(name);
    assert!(
        example.exists(),
        "build the example first: cargo build --example {name} ({})",
        example.display()
    );
    example.display().to_string()
}

/// Roles: tests start copies of this binary as worker processes, with an
/// environment variable naming the role ([`collectives::WORKER`],
/// [`rpc::WORKER`], [`rpc::MID_CALL`]). Such a process runs its role here,
/// before the test harness starts, and exits: no role is a test, so none is
/// ever counted as one. A role that panics exits 101, as a failed test does.
/// A role runs before Rust's runtime starts, so `SIGPIPE` keeps its default
/// action, as in a C host program: our libraries must never raise it (see
/// `rallypoint_collectives::nosigpipe`).
#[ctor::ctor(unsafe)]
fn role() {
    let role: fn() = if std::env::var_os(collectives::WORKER).is_some() {
        collectives::worker
    } else if std::env::var_os(rpc::WORKER).is_some() {
        rpc::worker
    } else if std::env::var_os(rpc::MID_CALL).is_some() {
        rpc::mid_call_worker
    } else if std::env::var_os(secret_hosts::OUTSIDER).is_some() {
        secret_hosts::outsider
    } else if std::env::var_os(secret_hosts::RPC_WORKER).is_some() {
        secret_hosts::rpc_worker
    } else {
        return;
    };
    let code = match std::panic::catch_unwind(role) {
        Ok(()) => 0,
        Err(_) => 101,
    };
    std::process::exit(code);
}

#[path = "run/agent_failures.rs"]
mod agent_failures;
#[path = "run/collectives.rs"]
mod collectives;
#[path = "run/dropin.rs"]
mod dropin;
#[path = "run/ft_api.rs"]
mod ft_api;
#[path = "run/ft_hosts.rs"]
mod ft_hosts;
#[path = "run/ft_process_group.rs"]
mod ft_process_group;
#[path = "run/ft_run.rs"]
mod ft_run;
#[path = "run/ft_run_hosts.rs"]
mod ft_run_hosts;
#[path = "run/ft_transport.rs"]
mod ft_transport;
#[path = "run/hosts.rs"]
mod hosts;
#[path = "run/lighthouse.rs"]
mod lighthouse;
#[path = "run/numa.rs"]
mod numa;
#[path = "run/rendezvous_failures.rs"]
mod rendezvous_failures;
#[path = "run/rpc.rs"]
mod rpc;
#[path = "run/secret.rs"]
mod secret;
#[path = "run/secret_hosts.rs"]
mod secret_hosts;
#[path = "run/stacks.rs"]
mod stacks;
#[path = "run/torch_backend.rs"]
mod torch_backend;
#[path = "run/torch_exit.rs"]
mod torch_exit;
