//! Our RPC in real processes: the parameter-server example under `rally run`,
//! and a worker SIGKILLed in the middle of a call, reported by its caller with
//! an error naming it and the function (no hang).
//!
//! The workers are this test binary, re-executed with `RALLY_RPC_WORKER` or
//! `RALLY_RPC_MID_CALL` set: it runs the role before the test harness starts
//! (see `role` in `run.rs`).

use rallypoint_rpc::{init_rpc, Rpc, RpcBackendOptions};

use super::*;

pub(crate) const WORKER: &str = "RALLY_RPC_WORKER";

/// The `hosts` role (see `role` in `run.rs`): [`across_hosts`].
pub(crate) fn worker() {
    assert_eq!(
        std::env::var(WORKER).as_deref(),
        Ok("hosts"),
        "RALLY_RPC_WORKER names the scenario: hosts"
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(across_hosts());
}

/// The heartbeat deadline of the `hosts` scenario, unless [`HEARTBEAT_MS`]
/// says otherwise.
pub(crate) const HEARTBEAT: Duration = Duration::from_secs(3);

/// Sets the `hosts` scenario's heartbeat deadline, in milliseconds.
pub(crate) const HEARTBEAT_MS: &str = "RALLY_RPC_HEARTBEAT_MS";

/// Scenario `hosts`: three workers, w2 the callee. w0 and w1 each hold an
/// RRef that w2 owns (checked once), print `READY`, then call w2's
/// `sleep_ms` (200 ms, no call timeout: only the heartbeat can end a call
/// to a silent worker) in a loop, printing `CALL <n>` after each. When a call
/// fails they print `ERROR <unix time> <error>`, then `RREF <error>` for
/// the RRef's next use, and exit 3. w2 serves until killed.
async fn across_hosts() {
    let rank: u32 = std::env::var("RANK").unwrap().parse().unwrap();
    let heartbeat = match std::env::var(HEARTBEAT_MS) {
        Ok(ms) => Duration::from_millis(ms.parse().expect("RALLY_RPC_HEARTBEAT_MS: milliseconds")),
        Err(_) => HEARTBEAT,
    };
    let opts = RpcBackendOptions {
        heartbeat,
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

/// Names the directory where the `mid-call` scenario's callee marks the
/// call it runs.
pub(crate) const MID_CALL: &str = "RALLY_RPC_MID_CALL";

/// The `mid-call` role: worker 0 calls worker 1's `sleep_ms` for a minute,
/// and prints `ERROR <error>` and exits 3 when its call fails; worker 1
/// creates the file `started` in the directory `RALLY_RPC_MID_CALL` names when
/// the call begins, so the test kills it provably in the middle of the call.
pub(crate) fn mid_call_worker() {
    let dir = std::env::var(MID_CALL).expect("RALLY_RPC_MID_CALL names a directory");
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let rank: u32 = std::env::var("RANK").unwrap().parse().unwrap();
        let opts = RpcBackendOptions::default();
        let started = std::path::PathBuf::from(dir).join("started");
        opts.functions
            .register_async("sleep_ms", move |_rpc: Rpc, ms: u64| {
                std::fs::write(&started, b"").expect("mark the call started");
                async move {
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    Ok::<u64, String>(ms)
                }
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

#[test]
fn a_worker_killed_mid_call_is_named_by_its_caller() {
    let dir = tempfile::tempdir().unwrap();
    let (_store, mut children) = ready_workers(&[], (MID_CALL, dir.path().to_str().unwrap()), 3);
    // Kill worker 1 once it runs the call (it says so).
    wait_for(&dir.path().join("started"), LIMIT);
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
