//! RRef lifecycles: create, fetch, methods, forks to a third worker and to the
//! owner, deletion in every order, the owner told.

use std::time::Duration;

use rallypoint_rpc::{BackendType, RRef, Rpc};

use crate::harness::*;

/// Every worker's RRef bookkeeping is empty.
async fn all_clear(ws: &[Rpc]) {
    eventually("every RRef deleted everywhere", || {
        ws.iter().all(|w| w.rref_counts() == (0, 0, 0))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_fetch_call_and_delete() {
    let ws = group(2, BackendType::tcp()).await;
    let r: RRef<i64> = ws[0].remote("w1", "counter", &10i64).unwrap();
    assert!(!r.is_owner());
    assert_eq!(r.owner(), 1);
    assert_eq!(r.owner_name().unwrap(), "w1");
    assert_eq!(r.to_here().await.unwrap(), 10);
    assert!(r.confirmed_by_owner());
    assert_eq!(r.call::<_, i64>("incr", &5i64).await.unwrap(), 15);
    assert_eq!(r.to_here().await.unwrap(), 15);
    assert_eq!(ws[1].rref_counts().0, 1, "the owner holds the value");
    let e = r.with_local_value(|v| *v).await.unwrap_err().to_string();
    assert!(e.contains("only available on its owner"), "{e}");
    drop(r);
    all_clear(&ws).await;
    shutdown_all(ws).await;
}

/// RRefs dropped before their owner confirmed them: the creations are held
/// at the owner (the function waits at a gate), so none can be confirmed
/// when it is dropped. Each is then provably created (the owner holds 50
/// values, the creator 50 users) and deleted once the gate opens and the
/// confirmations arrive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_before_confirmation_is_deleted_when_confirmed() {
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    use std::sync::Arc;
    /// Creations started on the owner, and the gate they wait at (no
    /// permits until the test opens it).
    struct Gate {
        started: AtomicUsize,
        open: tokio::sync::Semaphore,
    }
    const N: usize = 50;
    let gate = Arc::new(Gate {
        started: AtomicUsize::new(0),
        open: tokio::sync::Semaphore::new(0),
    });
    let g = gate.clone();
    let ws: Vec<Rpc> = group_with(2, BackendType::tcp(), move |_, o| {
        let g = g.clone();
        o.functions
            .register_async("gated_counter", move |_rpc: Rpc, start: i64| {
                let g = g.clone();
                async move {
                    g.started.fetch_add(1, SeqCst);
                    // Taken and given back: one permit lets all through.
                    let turn = g.open.acquire().await;
                    drop(turn);
                    Ok::<i64, String>(start)
                }
            })
            .unwrap();
    })
    .await
    .into_iter()
    .map(|r| r.expect("init_rpc"))
    .collect();
    assert_eq!(ws[0].rref_counts(), (0, 0, 0));
    assert_eq!(ws[1].rref_counts(), (0, 0, 0));
    let rs: Vec<RRef<i64>> = (0..N as i64)
        .map(|i| ws[0].remote("w1", "gated_counter", &i).unwrap())
        .collect();
    eventually("every creation started on the owner", || {
        gate.started.load(SeqCst) == N
    })
    .await;
    // The owner answers a creation only once its function returns: none has.
    assert!(
        rs.iter().all(|r| !r.confirmed_by_owner()),
        "a user was confirmed while its creation was held"
    );
    assert_eq!(ws[1].rref_counts().0, N, "the owner records every value");
    assert_eq!(ws[0].rref_counts().1, N, "the creator holds every user");
    drop(rs);
    // Dropped unconfirmed: each user is kept until its confirmation comes.
    assert_eq!(
        ws[0].rref_counts().1,
        N,
        "users dropped before confirmation"
    );
    assert_eq!(
        ws[1].rref_counts().0,
        N,
        "values deleted before confirmation"
    );
    gate.open.add_permits(1);
    all_clear(&ws).await;
    shutdown_all(ws).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fork_to_a_third_worker_then_delete_in_either_order() {
    let ws = group(3, BackendType::tcp()).await;
    // Creator drops its handle while the child still uses it (G2 keeps the
    // value alive until the child is accepted and then done).
    let r: RRef<i64> = ws[0].remote("w1", "counter", &7i64).unwrap();
    let call = ws[0].rpc_async::<_, i64>("w2", "hold_then_fetch", &(r.clone(), 300u64));
    drop(r);
    assert_eq!(call.await.unwrap(), 7);
    all_clear(&ws).await;

    // Child done first, creator last.
    let r: RRef<i64> = ws[0].remote("w1", "counter", &8i64).unwrap();
    let v: i64 = ws[0].rpc_sync("w2", "fetch", &r).await.unwrap();
    assert_eq!(v, 8);
    assert_eq!(r.to_here().await.unwrap(), 8);
    drop(r);
    all_clear(&ws).await;

    // Before the creation is even confirmed.
    for i in 0..20i64 {
        let r: RRef<i64> = ws[0].remote("w1", "counter", &i).unwrap();
        let v: i64 = ws[0].rpc_sync("w2", "fetch", &r).await.unwrap();
        assert_eq!(v, i);
    }
    all_clear(&ws).await;
    shutdown_all(ws).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owner_forks_and_forks_back_to_the_owner() {
    let ws = group(3, BackendType::tcp()).await;
    // A value owned by w0, shared with w2.
    let r: RRef<i64> = ws[0].rref(41);
    assert!(r.is_owner());
    assert_eq!(
        r.with_local_value(|v| {
            *v += 1;
            *v
        })
        .await
        .unwrap(),
        42
    );
    let v: i64 = ws[0].rpc_sync("w2", "fetch", &r).await.unwrap();
    assert_eq!(v, 42);
    // A user on w0 of a value on w1, sent to w1 (its owner).
    let u: RRef<i64> = ws[0].remote("w1", "counter", &3i64).unwrap();
    let v: i64 = ws[0].rpc_sync("w1", "fetch", &u).await.unwrap();
    assert_eq!(v, 3);
    drop(u);
    drop(r);
    all_clear(&ws).await;
    shutdown_all(ws).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_to_self_and_failures_are_reported_on_use() {
    let ws = group(2, BackendType::tcp()).await;
    let r: RRef<i64> = ws[0].remote("w0", "counter", &5i64).unwrap();
    assert!(r.is_owner());
    assert_eq!(r.to_here().await.unwrap(), 5);
    drop(r);
    let bad: RRef<()> = ws[0].remote("w1", "fail", &"boom".to_owned()).unwrap();
    let e = bad.to_here().await.unwrap_err().to_string();
    assert!(e.contains("boom") && e.contains("w1"), "{e}");
    drop(bad);
    let slow: RRef<u64> = ws[0]
        .remote_timeout("w1", "sleep_ms", &1000u64, Some(Duration::from_millis(50)))
        .unwrap();
    let e = slow.to_here().await.unwrap_err().to_string();
    assert!(
        e.contains("RRef creation via rpc.remote()") && e.contains("50 ms"),
        "{e}"
    );
    drop(slow);
    all_clear(&ws).await;
    shutdown_all(ws).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rrefs_over_the_process_group_backend() {
    let ws = group(3, BackendType::process_group()).await;
    let r: RRef<i64> = ws[0].remote("w1", "counter", &7i64).unwrap();
    let v: i64 = ws[0].rpc_sync("w2", "fetch", &r).await.unwrap();
    assert_eq!(v, 7);
    drop(r);
    all_clear(&ws).await;
    shutdown_all(ws).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_value_holding_an_rref_is_deleted_without_deadlock() {
    let ws = group(2, BackendType::tcp()).await;
    let inner: RRef<i64> = ws[0].remote("w1", "counter", &4i64).unwrap();
    assert_eq!(inner.to_here().await.unwrap(), 4);
    // The outer value owns the only handle of `inner`: deleting it drops that
    // handle, which reports back to the same bookkeeping.
    let outer: RRef<Vec<RRef<i64>>> = ws[0].rref(vec![inner]);
    drop(outer);
    all_clear(&ws).await;
    shutdown_all(ws).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forks_in_messages_never_decoded_are_released() {
    let ws = group(3, BackendType::tcp()).await;
    let r: RRef<i64> = ws[0].remote("w1", "counter", &9i64).unwrap();
    // An unknown function never decodes its arguments; a wrong type fails
    // half-way. Either way the fork sent to w2 must be released.
    let e = ws[0]
        .rpc_sync::<_, ()>("w2", "typo", &r)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("no function named \"typo\""), "{e}");
    let e = ws[0]
        .rpc_sync::<_, String>("w2", "echo", &r)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("w2"), "{e}");
    drop(r);
    all_clear(&ws).await;
    shutdown_all(ws).await;
}
