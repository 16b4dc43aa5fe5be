//! Our RPC in real processes: the parameter-server example under `rally run`,
//! and a worker SIGKILLed in the middle of a call, reported by its caller with
//! an error naming it and the function (no hang).
//!
//! The workers are this test binary, re-executed with `RALLY_RPC_WORKER` set.

use rallypoint_rpc::{init_rpc, Rpc, RpcBackendOptions};

use super::*;

pub(crate) const WORKER: &str = "RALLY_RPC_WORKER";

pub(crate) fn worker_args() -> [&'static str; 4] {
    ["--exact", "rpc::worker", "--nocapture", "--test-threads=1"]
}

/// The worker side: does nothing unless started as a worker. Worker 0 calls
/// worker 1's `sleep_ms` for a minute; worker 1 is killed meanwhile. Worker 0
/// prints `ERROR <error>` and exits 3 when its call fails.
#[test]
fn worker() {
    if std::env::var(WORKER).is_err() {
        return;
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    if std::env::var(WORKER).as_deref() == Ok("hosts") {
        rt.block_on(across_hosts());
        return;
    }
    rt.block_on(async {
        let rank: u32 = std::env::var("RANK").unwrap().parse().unwrap();
        let opts = RpcBackendOptions::default();
        opts.functions
            .register_async("sleep_ms", |_rpc: Rpc, ms: u64| async move {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                Ok::<u64, String>(ms)
            })
            .unwrap();
        let rpc = init_rpc(&format!("w{rank}"), None, None, Some(3), Some(opts))
            .await
            .expect("init_rpc");
        println!("READY");
        if rank == 0 {
            match rpc.rpc_sync::<_, u64>("w1", "sleep_ms", &60_000u64).await {
                Ok(_) => println!("the call returned"),
                Err(e) => {
                    eprintln!("ERROR {e}");
                    std::process::exit(3);
                }
            }
        } else {
            tokio::time::sleep(Duration::from_secs(60)).await;
        }
    });
}

/// The heartbeat deadline of the `hosts` scenario.
pub(crate) const HEARTBEAT: Duration = Duration::from_secs(3);

/// Scenario `hosts`: three workers, w2 the callee. w0 and w1 each hold an
/// RRef that w2 owns (checked once), print `READY`, then call w2's
/// `sleep_ms` (200 ms, no call timeout: only the heartbeat can end a call
/// to a silent worker) in a loop, printing `CALL <n>` after each. When a call
/// fails they print `ERROR <unix time> <error>`, then `RREF <error>` for
/// the RRef's next use, and exit 3. w2 serves until killed.
async fn across_hosts() {
    let rank: u32 = std::env::var("RANK").unwrap().parse().unwrap();
    let opts = RpcBackendOptions {
        heartbeat: HEARTBEAT,
        ..RpcBackendOptions::default()
    };
    opts.functions
        .register_async("sleep_ms", |_rpc: Rpc, ms: u64| async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            Ok::<u64, String>(ms)
        })
        .unwrap();
    opts.functions
        .register_async("answer", |_rpc: Rpc, (): ()| async move {
            Ok::<i64, String>(42)
        })
        .unwrap();
    let rpc = init_rpc(&format!("w{rank}"), None, None, Some(3), Some(opts))
        .await
        .expect("init_rpc");
    if rank == 2 {
        println!("READY");
        tokio::time::sleep(Duration::from_secs(600)).await;
        return;
    }
    let rref = rpc.remote::<_, i64>("w2", "answer", &()).unwrap();
    assert_eq!(rref.to_here().await.unwrap(), 42);
    println!("READY");
    for n in 1.. {
        let call = rpc.rpc_sync_timeout::<_, u64>("w2", "sleep_ms", &200u64, Some(Duration::ZERO));
        if let Err(e) = call.await {
            let at = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs_f64();
            println!("ERROR {at:.3} {e}");
            match rref.to_here().await {
                Ok(v) => println!("RREF returned {v}"),
                Err(e) => println!("RREF {e}"),
            }
            std::process::exit(3);
        }
        println!("CALL {n}");
    }
}

#[test]
fn a_worker_killed_mid_call_is_named_by_its_caller() {
    let (_store, mut children) = ready_workers(&worker_args(), (WORKER, "1"), 3);
    // Let the call reach worker 1, then kill it.
    std::thread::sleep(Duration::from_millis(300));
    // SAFETY: signalling our own child.
    unsafe { libc::kill(children[1].id() as i32, libc::SIGKILL) };
    let mut err = String::new();
    let mut e = children[0].stderr.take().unwrap();
    let status = wait_or_kill(&mut children[0], Duration::from_secs(30), String::new);
    std::io::Read::read_to_string(&mut e, &mut err).unwrap();
    for c in &mut children[1..] {
        let _ = c.kill();
        let _ = c.wait();
    }
    assert_eq!(
        status.code(),
        Some(3),
        "the caller must fail, not hang: {err}"
    );
    let line = err.lines().find(|l| l.starts_with("ERROR ")).expect(&err);
    assert!(
        line.contains("worker w1 is unreachable") && line.contains("sleep_ms"),
        "{line}"
    );
}

#[test]
fn the_parameter_server_example_trains_under_rally_run() {
    let dir = tempfile::tempdir().unwrap();
    let ex = built_example("param_server");
    let mut job = Job::spawn(
        rally(&["--standalone", "--nproc-per-node", "3", "--no-python", &ex]),
        dir.path(),
        "ps",
    );
    let status = job.wait(Duration::from_secs(120));
    let out = job.output();
    assert!(status.success(), "{out}");
    assert!(out.contains("ps: 400 updates from 2 trainers"), "{out}");
}
