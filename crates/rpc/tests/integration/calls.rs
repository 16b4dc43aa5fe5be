//! Calls, errors, timeouts, both backends, large payloads, garbage on the port.

use std::time::Duration;

use rallypoint_rpc::{BackendType, Error, Payload};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::harness::*;

async fn calls_work_on(backend: BackendType) {
    let ws = group(3, backend).await;
    let three: i64 = ws[0].rpc_sync("w1", "add", &(1i64, 2i64)).await.unwrap();
    assert_eq!(three, 3);
    let s: String = ws[2]
        .rpc_sync(&ws[0].me().clone(), "echo", &"hi".to_owned())
        .await
        .unwrap();
    assert_eq!(s, "hi");
    // Many at once, to every worker.
    let futs: Vec<_> = (0..200i64)
        .map(|i| {
            ws[i as usize % 3].rpc_async::<_, i64>(format!("w{}", (i + 1) % 3), "add", &(i, 1i64))
        })
        .collect();
    for (i, f) in futs.into_iter().enumerate() {
        assert_eq!(f.await.unwrap(), i as i64 + 1);
    }
    // A call that makes a call.
    let v: i64 = ws[0]
        .rpc_sync("w1", "relay_add", &("w2".to_owned(), 5i64, 6i64))
        .await
        .unwrap();
    assert_eq!(v, 11);
    // An error names the worker and the function.
    let e = ws[0]
        .rpc_sync::<_, ()>("w2", "fail", &"x".to_owned())
        .await
        .unwrap_err();
    let m = e.to_string();
    assert!(matches!(e, Error::Remote { .. }), "{e:?}");
    assert!(
        m.contains("w2") && m.contains("\"fail\"") && m.contains("asked to fail: x"),
        "{m}"
    );
    let e = ws[0]
        .rpc_sync::<_, ()>("w1", "nope", &())
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no function named \"nope\" is registered on worker w1"),
        "{e}"
    );
    let e = ws[0]
        .rpc_sync::<_, ()>("w9", "add", &())
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("no worker named \"w9\""), "{e}");
    // Wrong argument types are an error, not a panic.
    let e = ws[0]
        .rpc_sync::<_, i64>("w1", "add", &())
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("w1") && e.contains("add"), "{e}");
    shutdown_all(ws).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_over_tcp() {
    calls_work_on(BackendType::tcp()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_over_the_process_group() {
    calls_work_on(BackendType::process_group()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_to_self() {
    let ws = group(2, BackendType::tcp()).await;
    let v: i64 = ws[0].rpc_sync("w0", "add", &(2i64, 2i64)).await.unwrap();
    assert_eq!(v, 4);
    shutdown_all(ws).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeouts_expire_and_zero_never_does() {
    let ws = group(2, BackendType::tcp()).await;
    let e = ws[0]
        .rpc_sync_timeout::<_, u64>("w1", "sleep_ms", &2000u64, Some(Duration::from_millis(100)))
        .await
        .unwrap_err();
    let m = e.to_string();
    assert!(matches!(e, Error::Timeout { .. }), "{e:?}");
    assert!(
        m.contains("RPC ran for more than set timeout (100 ms)")
            && m.contains("sleep_ms")
            && m.contains("w1"),
        "{m}"
    );
    // Zero: no timeout at all, even beyond a short default.
    let v: u64 = ws[0]
        .rpc_sync_timeout("w1", "sleep_ms", &300u64, Some(Duration::ZERO))
        .await
        .unwrap();
    assert_eq!(v, 300);
    // The expired call left nothing pending behind once the callee answers.
    eventually("no call in flight", || {
        ws.iter().all(|w| w.active_calls() == 0)
    })
    .await;
    shutdown_all(ws).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_timeout_comes_from_the_options() {
    let ws: Vec<_> = group_with(2, BackendType::tcp(), |_, o| {
        o.rpc_timeout = Duration::from_millis(150)
    })
    .await
    .into_iter()
    .map(|r| r.unwrap())
    .collect();
    let e = ws[0]
        .rpc_sync::<_, u64>("w1", "sleep_ms", &1500u64)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("(150 ms)"), "{e}");
    shutdown_all(ws).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_payloads_over_several_streams() {
    for streams in [1usize, 4] {
        let ws: Vec<_> = group_with(2, BackendType::tcp(), |_, o| {
            o.tcp.streams = streams;
            o.tcp.split_bytes = 1 << 20;
        })
        .await
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
        let data: Vec<u8> = (0..(9 << 20) + 7)
            .map(|i: u32| (i * 31 % 251) as u8)
            .collect();
        let sum = checksum(&data);
        let (dev, len, got): (String, u64, u64) = ws[0]
            .rpc_sync("w1", "payload_info", &Payload::cpu(data.clone()))
            .await
            .unwrap();
        assert_eq!(
            (dev.as_str(), len, got),
            ("cpu", data.len() as u64, sum),
            "{streams} streams"
        );
        let back: Payload = ws[0]
            .rpc_sync("w1", "payload_back", &Payload::cpu(data.clone()))
            .await
            .unwrap();
        assert_eq!(back.data, data, "{streams} streams, echoed");
        shutdown_all(ws).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_on_the_port_is_refused_and_the_group_goes_on() {
    let ws = group(2, BackendType::tcp()).await;
    let addr = ws[1].address();
    // Garbage, a wrong generation, a silent connection, half a hello.
    let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
    s.write_all(&[0xde; 64]).await.unwrap();
    let mut b = [0u8; 128];
    let n = s.read(&mut b).await.unwrap();
    assert!(n > 3 && b[0] == 1, "refused with a reason");
    assert!(String::from_utf8_lossy(&b[3..n]).contains("bad magic"));
    let hello = rallypoint_rpc::wire::Hello {
        generation: 1,
        from: 0,
        to: 1,
        stream: 0,
    };
    let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
    s.write_all(&hello.encode()).await.unwrap();
    let n = s.read(&mut b).await.unwrap();
    assert!(String::from_utf8_lossy(&b[3..n]).contains("another job or an earlier init_rpc"));
    let _silent = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let mut half = tokio::net::TcpStream::connect(&addr).await.unwrap();
    half.write_all(&hello.encode()[..10]).await.unwrap();
    let v: i64 = ws[0].rpc_sync("w1", "add", &(40i64, 2i64)).await.unwrap();
    assert_eq!(v, 42);
    let v: i64 = ws[1].rpc_sync("w0", "add", &(40i64, 2i64)).await.unwrap();
    assert_eq!(v, 42);
    shutdown_all(ws).await;
}

/// The callee goes while it runs the call (it says when it has started):
/// the call fails naming it, and is not left to the call timeout (30 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_gone_mid_call_fails_the_call_naming_it() {
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    use std::sync::Arc;
    for backend in [BackendType::tcp(), BackendType::process_group()] {
        let started = Arc::new(AtomicUsize::new(0));
        let s = started.clone();
        let mut ws: Vec<rallypoint_rpc::Rpc> = group_with(3, backend.clone(), move |_, o| {
            let s = s.clone();
            o.functions
                .register_async(
                    "sleep_ms_marked",
                    move |_rpc: rallypoint_rpc::Rpc, ms: u64| {
                        s.fetch_add(1, SeqCst);
                        async move {
                            tokio::time::sleep(Duration::from_millis(ms)).await;
                            Ok::<u64, String>(ms)
                        }
                    },
                )
                .unwrap();
        })
        .await
        .into_iter()
        .map(|r| r.expect("init_rpc"))
        .collect();
        // Longer than the test: only the callee's going can end the call.
        let call = ws[0].rpc_async::<_, u64>("w1", "sleep_ms_marked", &600_000u64);
        eventually("w1 runs the call", || started.load(SeqCst) == 1).await;
        let w1 = ws.remove(1);
        let t0 = std::time::Instant::now();
        w1.shutdown(false, None).await.unwrap();
        let e = call.await.unwrap_err();
        // Noticed at once (expected in milliseconds): the bound, half the
        // 30 s call timeout, tells that from the timeout.
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "{backend}: noticed in {:?}",
            t0.elapsed()
        );
        let m = e.to_string();
        assert!(m.contains("w1") && m.contains("sleep_ms"), "{backend}: {m}");
        for w in ws {
            w.shutdown(false, None).await.unwrap();
        }
    }
}
