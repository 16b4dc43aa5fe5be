//! The job secret across test hosts (issue 49): a two-node job (node1,
//! node2) with `--job-secret-file`, and an outsider on node3. While the job
//! trains, the outsider tries every TCP listener the job has on node1's
//! address (the rendezvous store, the job store, the workers' collectives:
//! the `rally` backend) with no secret and with a wrong one, reads and
//! writes the stores, and tries to join the rendezvous with `rally run`;
//! each is refused, quickly, and the job finishes with the right result.
//!
//! The same for an RPC job (our `rallypoint-rpc`, the workers this test
//! binary with [`RPC_WORKER`] set): its listeners refuse the outsider and
//! its calls go on.
//!
//! The outsider is this test binary on node3 with [`OUTSIDER`] set (see
//! `role` in `run.rs`); it prints one line per attempt, `refused ...` or
//! `ADMITTED ...`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use rallypoint_testhosts::{cluster, Host};

use super::*;

/// The outsider role: the listeners to try, comma-separated `ip:port`.
pub(crate) const OUTSIDER: &str = "RALLY_SECRET_OUTSIDER";
/// The outsider's wrong secret file.
const WRONG: &str = "RALLY_SECRET_OUTSIDER_WRONG";

/// Every service label a rallypoint listener may expect.
const LABELS: [&str; 5] = ["store", "rendezvous", "collectives", "rpc", "lighthouse"];

/// How long a refusal may take: the listeners' 2 s handshake deadline, and
/// a wide margin.
const REFUSED_WITHIN: Duration = Duration::from_secs(10);

/// The RPC worker role: names the progress directory.
pub(crate) const RPC_WORKER: &str = "RALLY_SECRET_RPC";

/// The RPC worker role: w0 calls w1's `answer` (42) until the file `stop`
/// appears in [`RPC_WORKER`]'s directory, writing its count of calls to
/// `calls` after each; both then shut down together.
pub(crate) fn rpc_worker() {
    use rallypoint_rpc::{init_rpc, Rpc, RpcBackendOptions};
    let dir = std::path::PathBuf::from(std::env::var(RPC_WORKER).unwrap());
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let rank: u32 = std::env::var("RANK").unwrap().parse().unwrap();
        let opts = RpcBackendOptions::default();
        opts.functions
            .register_async("answer", |_rpc: Rpc, (): ()| async move {
                Ok::<i64, String>(42)
            })
            .unwrap();
        let rpc = init_rpc(&format!("w{rank}"), None, None, Some(2), Some(opts))
            .await
            .expect("init_rpc");
        if rank == 0 {
            let mut n = 0u64;
            while !dir.join("stop").exists() {
                let v: i64 = rpc.rpc_sync("w1", "answer", &()).await.expect("a call");
                assert_eq!(v, 42);
                n += 1;
                std::fs::write(dir.join("calls"), n.to_string()).unwrap();
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        rpc.shutdown(true, Some(LIMIT)).await.expect("shutdown");
    });
}

/// The outsider role (see the module docs).
pub(crate) fn outsider() {
    let targets: Vec<SocketAddr> = std::env::var(OUTSIDER)
        .unwrap()
        .split(',')
        .map(|t| t.parse().unwrap())
        .collect();
    let wrong = rallypoint_auth::JobSecret::from_file(std::env::var(WRONG).unwrap()).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    for t in targets {
        // PyTorch's TCPStore first bytes (VALIDATE, PING): the listener
        // closes the connection (after a line saying why, at most); one
        // that served it would keep it open for the next request.
        let t0 = Instant::now();
        let mut s = TcpStream::connect_timeout(&t, REFUSED_WITHIN).unwrap();
        s.set_read_timeout(Some(REFUSED_WITHIN)).unwrap();
        let _ = s.write_all(&[0x00, 0xce, 0xf7, 0x85, 0x3c, 0x0e, 0x2a, 0, 0, 0]);
        let mut got = Vec::new();
        let closed = match s.read_to_end(&mut got) {
            Ok(_) => true,
            Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
        };
        let verdict = if closed { "refused" } else { "ADMITTED" };
        println!(
            "{verdict} plain {t} in {:?} (read {:?})",
            t0.elapsed(),
            String::from_utf8_lossy(&got)
        );
        // A wrong secret, under every label.
        for label in LABELS {
            let t0 = Instant::now();
            let r = rt.block_on(async {
                let mut s = tokio::net::TcpStream::connect(t).await?;
                let deadline = std::time::Instant::now() + REFUSED_WITHIN;
                let service = rallypoint_auth::Service::new(label);
                rallypoint_auth::io::tokio::client_handshake(&mut s, t, &wrong, service, deadline)
                    .await
                    .map_err(std::io::Error::other)
            });
            let verdict = if r.is_err() { "refused" } else { "ADMITTED" };
            println!(
                "{verdict} wrong-secret {label} {t} in {:?}: {r:?}",
                t0.elapsed()
            );
        }
        // Our store client: a write, without a secret and with the wrong one.
        for secret in [None, Some(wrong.clone())] {
            let r = rt.block_on(async {
                let store = rallypoint_store::TcpStore::builder(t.ip().to_string(), t.port())
                    .timeout(REFUSED_WITHIN)
                    .secret(secret.clone())
                    .connect()
                    .await?;
                rallypoint_store::Store::set(&store, "intruder", b"x").await
            });
            let verdict = if r.is_err() { "refused" } else { "ADMITTED" };
            let how = if secret.is_some() { "wrong" } else { "none" };
            println!("{verdict} store-write secret={how} {t}: {r:?}");
        }
    }
}

/// The TCP listeners of node1 on its own address (or every address), by
/// `ss` in its namespace: the job's, reachable from other hosts.
fn listeners(host: &Host) -> Vec<SocketAddr> {
    let out = host.command("ss").args(["-Htln"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .filter_map(|l| l.split_whitespace().nth(3))
        .filter_map(|local| {
            let (ip, port) = local.rsplit_once(':')?;
            let port: u16 = port.parse().ok()?;
            let ip = ip.trim_start_matches('[').trim_end_matches(']');
            let reachable =
                ip == "*" || ip == "0.0.0.0" || ip == "::" || ip == host.addr.to_string();
            reachable.then(|| SocketAddr::from((host.addr, port)))
        })
        .collect()
}

fn secret_file(dir: &Path, name: &str, fill: u8) -> String {
    super::secret::secret_file(dir, name, fill)
        .display()
        .to_string()
}

#[test]
fn an_outsider_on_another_host_is_refused_by_every_listener_and_the_job_finishes() {
    let c = cluster(3);
    let (dir, out) = with_results();
    let site = super::torch_backend::package(dir.path());
    let progress = dir.path().join("progress");
    std::fs::create_dir(&progress).unwrap();
    let good = secret_file(dir.path(), "secret", 1);
    let wrong = secret_file(dir.path(), "wrong", 2);
    let endpoint = format!("{}:29400", c.host(0).addr);
    let job_args = |extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = [
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            &endpoint,
            "--rdzv-id",
            "secret",
        ]
        .map(str::to_owned)
        .to_vec();
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let mut jobs: Vec<Job> = c.hosts()[..2]
        .iter()
        .map(|h| {
            let args = job_args(&["--job-secret-file", &good]);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let mut cmd = super::hosts::rally_on(h, &args);
            cmd.arg(script("ddp_train.py"))
                .env("RESULT_DIR", &out)
                .env("PROGRESS_DIR", &progress)
                .env("BACKEND", "rally")
                .env("PYTHONPATH", &site)
                .env("STEPS", "400")
                .env("STEP_SLEEP", "0.05");
            Job::spawn(cmd, dir.path(), &h.name)
        })
        .collect();
    super::hosts::wait_for_step(&progress, 2, 3, &mut jobs);

    // Every listener of node1 (the rendezvous store, the job store, rank
    // 0's collectives), from node3.
    let targets = listeners(c.host(0));
    assert!(targets.len() >= 3, "{targets:?}");
    let said = outsider_refused(c.host(2), &targets, &wrong);
    for service in ["store", "collectives"] {
        assert!(
            proved_to(&said, service),
            "no {service} listener among {targets:?}:\n{said}"
        );
    }

    // A rally run on node3 joining the rendezvous: without a secret, and
    // with the wrong one, refused at once.
    for (extra, why) in [
        (vec![], "requires the job's secret"),
        (
            vec!["--job-secret-file", wrong.as_str()],
            "different job secret",
        ),
    ] {
        let args = job_args(&extra);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut cmd = super::hosts::rally_on(c.host(2), &args);
        cmd.arg(script("exit_cleanly.py"));
        let t0 = Instant::now();
        let mut j = Job::spawn(cmd, dir.path(), "intruder");
        let s = j.wait(LIMIT);
        assert!(!s.success() && j.output().contains(why), "{}", j.output());
        assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
    }

    for (h, j) in c.hosts().iter().zip(&mut jobs) {
        let s = j.wait(LIMIT * 2);
        assert!(s.success(), "{}: {s}\n{}", h.name, j.output());
    }
    let r = results(&out);
    assert_eq!(r.len(), 2, "{r:?}");
    assert!(
        r.values()
            .all(|v| v["world_size"] == 2 && v["attempt"] == 0),
        "{r:?}"
    );
    // The workers reached the job store through their agent's loopback proxy.
    assert!(r.values().all(|v| v["master_addr"] == "127.0.0.1"), "{r:?}");
}

/// Whether some listener the outsider tried was a `service` one (it told a
/// wrong secret apart from a wrong service).
fn proved_to(said: &str, service: &str) -> bool {
    said.lines().any(|l| {
        l.starts_with(&format!("refused wrong-secret {service} ")) && l.contains("DifferentSecret")
    })
}

/// Runs the outsider on `from` against `targets`; asserts every attempt was
/// refused and returns what it said.
fn outsider_refused(from: &Host, targets: &[SocketAddr], wrong: &str) -> String {
    let list: Vec<String> = targets.iter().map(ToString::to_string).collect();
    let o = from
        .command(std::env::current_exe().unwrap())
        .env(OUTSIDER, list.join(","))
        .env(WRONG, wrong)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "{said}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(!said.contains("ADMITTED"), "{said}");
    let attempts = said.lines().filter(|l| l.starts_with("refused")).count();
    assert_eq!(attempts, targets.len() * (1 + LABELS.len() + 2), "{said}");
    said
}

#[test]
fn an_rpc_job_refuses_an_outsider_on_another_host_and_its_calls_go_on() {
    let c = cluster(3);
    let dir = tempfile::tempdir().unwrap();
    let good = secret_file(dir.path(), "secret", 1);
    let wrong = secret_file(dir.path(), "wrong", 2);
    let endpoint = format!("{}:29400", c.host(0).addr);
    let mut jobs: Vec<Job> = c.hosts()[..2]
        .iter()
        .map(|h| {
            let args = [
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                &endpoint,
                "--rdzv-id",
                "rpc",
                "--no-python",
                "--job-secret-file",
                &good,
            ];
            let mut cmd = super::hosts::rally_on(h, &args);
            cmd.arg(std::env::current_exe().unwrap())
                .env(RPC_WORKER, dir.path());
            Job::spawn(cmd, dir.path(), &h.name)
        })
        .collect();
    let calls = || -> u64 {
        std::fs::read_to_string(dir.path().join("calls"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    };
    let t0 = Instant::now();
    while calls() < 5 {
        let out: Vec<String> = jobs.iter().map(Job::output).collect();
        assert!(t0.elapsed() < LIMIT, "no calls: {out:#?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let targets = listeners(c.host(0));
    assert!(targets.len() >= 3, "{targets:?}");
    let said = outsider_refused(c.host(2), &targets, &wrong);
    assert!(
        proved_to(&said, "rpc"),
        "no RPC listener among {targets:?}:\n{said}"
    );
    // The calls went on meanwhile, and go on.
    let after = calls();
    let t0 = Instant::now();
    while calls() < after + 5 {
        assert!(t0.elapsed() < LIMIT, "the calls stopped at {after}");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::fs::write(dir.path().join("stop"), b"").unwrap();
    for (h, j) in c.hosts().iter().zip(&mut jobs) {
        let s = j.wait(LIMIT);
        assert!(s.success(), "{}: {s}\n{}", h.name, j.output());
    }
}
