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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_before_confirmation_is_deleted_when_confirmed() {
    let ws = group(2, BackendType::tcp()).await;
    for _ in 0..50 {
        let r: RRef<i64> = ws[0].remote("w1", "counter", &1i64).unwrap();
        drop(r);
    }
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
