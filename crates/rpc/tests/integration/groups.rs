//! The registry, names, dynamic groups.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use rallypoint_rpc::{
    backend_registered, backends, construct_rpc_backend_options, init_rpc_with_store,
    register_backend, BackendType, Error, RpcBackendOptions,
};
use rallypoint_store::{MemoryStore, Store};

use crate::harness::*;

static SENT: std::sync::OnceLock<Arc<AtomicUsize>> = std::sync::OnceLock::new();

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_third_party_backend_registers_and_works() {
    let sent = SENT.get_or_init(Default::default).clone();
    let counter = sent.clone();
    let ty = register_tap(
        "COUNTING",
        Arc::new(move |_, _| {
            counter.fetch_add(1, Ordering::SeqCst);
            true
        }),
    )
    .unwrap();
    assert!(backend_registered("COUNTING"));
    assert!(backends().contains(&ty));
    assert!(
        backends().contains(&BackendType::tcp())
            && backends().contains(&BackendType::process_group())
    );
    let e = register_backend(
        "COUNTING",
        Arc::new(|_| unreachable!()),
        Arc::new(|_| unreachable!()),
    )
    .unwrap_err();
    assert_eq!(e.to_string(), "RPC backend COUNTING: already registered");
    let o = construct_rpc_backend_options(
        &ty,
        std::time::Duration::from_secs(5),
        "env://",
        Default::default(),
    )
    .unwrap();
    assert_eq!(o.rpc_timeout, std::time::Duration::from_secs(5));

    let ws = group(2, ty).await;
    let before = sent.load(Ordering::SeqCst);
    let v: i64 = ws[0].rpc_sync("w1", "add", &(1i64, 1i64)).await.unwrap();
    assert_eq!(v, 2);
    assert!(
        sent.load(Ordering::SeqCst) >= before + 2,
        "the request and its answer went through it"
    );
    shutdown_all(ws).await;
}

#[tokio::test]
async fn unknown_backends_and_options_are_named() {
    let e = construct_rpc_backend_options(
        &"NOPE".into(),
        Default::default(),
        "env://",
        Default::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("no RPC backend named \"NOPE\"") && e.contains("TCP"),
        "{e}"
    );
    let extra = [("num_stream".to_owned(), "2".to_owned())].into();
    let e = construct_rpc_backend_options(&BackendType::tcp(), Default::default(), "env://", extra)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("unknown TCP backend option \"num_stream\""),
        "{e}"
    );
    let extra = [("num_streams".to_owned(), "8".to_owned())].into();
    let o = construct_rpc_backend_options(&BackendType::tcp(), Default::default(), "env://", extra)
        .unwrap();
    assert_eq!(o.tcp.streams, 8);
    // PROCESS_GROUP takes the seed's num_send_recv_threads, and only that.
    let pg = BackendType::process_group();
    let extra = [("num_send_recv_threads".to_owned(), "2".to_owned())].into();
    let o = construct_rpc_backend_options(&pg, Default::default(), "env://", extra).unwrap();
    assert_eq!(o.pg_send_recv_threads, 2);
    for (k, v) in [("num_send_recv_threads", "0"), ("num_streams", "2")] {
        let extra = [(k.to_owned(), v.to_owned())].into();
        let e = construct_rpc_backend_options(&pg, Default::default(), "env://", extra)
            .unwrap_err()
            .to_string();
        assert!(e.contains(k), "{e}");
    }
}

/// PyTorch's default backend's name works, as the default backend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tensorpipe_is_the_default_backend_by_another_name() {
    let ws = group(2, BackendType::from("TENSORPIPE")).await;
    let v: i64 = ws[0].rpc_sync("w1", "add", &(2i64, 3i64)).await.unwrap();
    assert_eq!(v, 5);
    assert!(!ws[1].address().is_empty(), "it listens, as TCP does");
    shutdown_all(ws).await;
}

/// num_send_recv_threads = 1 on PROCESS_GROUP: sends one at a time, all
/// delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_group_sends_within_num_send_recv_threads() {
    let ws: Vec<_> = group_with(2, BackendType::process_group(), |_, o| {
        o.pg_send_recv_threads = 1
    })
    .await
    .into_iter()
    .map(|r| r.unwrap())
    .collect();
    let calls: Vec<_> = (0..32i64)
        .map(|i| ws[0].rpc_async::<_, i64>("w1", "add", &(i, 1i64)))
        .collect();
    for (i, c) in calls.into_iter().enumerate() {
        assert_eq!(c.await.unwrap(), i as i64 + 1);
    }
    shutdown_all(ws).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_follow_pytorch_rules_and_must_be_unique() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    for bad in ["", "a b", "x/y", &"n".repeat(128)] {
        let e = init_rpc_with_store(
            store.clone(),
            bad,
            BackendType::tcp(),
            0,
            Some(1),
            options(),
        )
        .await
        .err()
        .unwrap();
        assert!(matches!(e, Error::Invalid(_)), "{bad:?}: {e}");
    }
    // Two workers named alike: both fail, naming both ranks.
    let tasks: Vec<_> = (0..2u32)
        .map(|r| {
            let store = store.clone();
            tokio::spawn(async move {
                init_rpc_with_store(
                    store,
                    "same:name-1",
                    BackendType::tcp(),
                    r,
                    Some(2),
                    options(),
                )
                .await
            })
        })
        .collect();
    for t in tasks {
        let e = t
            .await
            .unwrap()
            .err()
            .expect("duplicate names fail")
            .to_string();
        assert!(
            e.contains("\"same:name-1\" is not unique: ranks 0 and 1"),
            "{e}"
        );
    }
}

/// Worker `name` joins the dynamic group kept in `store`.
fn join_dynamic(
    store: &Arc<dyn Store>,
    name: &'static str,
    rank: u32,
    options: RpcBackendOptions,
) -> impl std::future::Future<Output = rallypoint_rpc::Result<rallypoint_rpc::Rpc>> {
    init_rpc_with_store(store.clone(), name, BackendType::tcp(), rank, None, options)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamic_workers_join_and_leave() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let join = |name: &'static str, rank: u32| join_dynamic(&store, name, rank, options());
    let a = join("a", 0).await.unwrap();
    let b = join("b", 1).await.unwrap();
    assert_eq!(a.workers().len(), 2, "a learned of b");
    let v: i64 = a.rpc_sync("b", "add", &(1i64, 2i64)).await.unwrap();
    assert_eq!(v, 3);
    let v: i64 = b.rpc_sync("a", "add", &(3i64, 4i64)).await.unwrap();
    assert_eq!(v, 7);
    // A name already in the group is refused, naming both ranks.
    let e = join("a", 5).await.err().unwrap().to_string();
    assert!(e.contains("\"a\" is not unique: ranks 0 and 5"), "{e}");
    // A static member cannot join a dynamic group.
    let e = init_rpc_with_store(
        store.clone(),
        "s",
        BackendType::tcp(),
        0,
        Some(3),
        options(),
    )
    .await
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("cannot mix static and dynamic members"), "{e}");
    b.shutdown(true, None).await.unwrap();
    assert_eq!(a.workers().len(), 1, "b's leave reached a");
    let c = join("c", 2).await.unwrap();
    let v: i64 = c.rpc_sync("a", "add", &(1i64, 1i64)).await.unwrap();
    assert_eq!(v, 2);
    c.shutdown(true, None).await.unwrap();
    a.shutdown(true, None).await.unwrap();
}

/// A worker that died holding the dynamic group's membership token (here: a
/// token written as a dead worker's would be) no longer blocks joins once
/// its lease has ended; a live lease is waited for, and a timeout names its
/// holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_membership_token_held_by_a_dead_worker_is_taken_over_when_its_lease_ends() {
    let ms =
        |t: std::time::SystemTime| t.duration_since(std::time::UNIX_EPOCH).unwrap().as_millis();
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let join = |name: &'static str, rank: u32, timeout_ms: u64| {
        let mut o = options();
        o.rpc_timeout = std::time::Duration::from_millis(timeout_ms);
        join_dynamic(&store, name, rank, o)
    };
    // A lease that ends in an hour: a join with a 300 ms timeout gives up,
    // naming the holder.
    let later = std::time::SystemTime::now() + std::time::Duration::from_secs(3600);
    store
        .set("token", format!("ghost\n{}", ms(later)).as_bytes())
        .await
        .unwrap();
    let e = join("a", 0, 300).await.err().unwrap().to_string();
    assert!(
        e.contains("still held by worker \"ghost\", whose lease ends in"),
        "{e}"
    );
    // The lease has ended: the next join takes the token over.
    let past = std::time::SystemTime::now() - std::time::Duration::from_secs(1);
    store
        .set("token", format!("ghost\n{}", ms(past)).as_bytes())
        .await
        .unwrap();
    let a = join("a", 0, 30_000).await.unwrap();
    let b = join("b", 1, 30_000).await.unwrap();
    let v: i64 = b.rpc_sync("a", "add", &(1i64, 2i64)).await.unwrap();
    assert_eq!(v, 3);
    assert_eq!(store.get("token").await.unwrap(), b"", "given back");
    b.shutdown(true, None).await.unwrap();
    a.shutdown(true, None).await.unwrap();
}

/// A member that died without leaving is pruned by the next join, which
/// used to fail on it (and so did every join after).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_died_without_leaving_is_pruned_by_the_next_join() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let join = |name: &'static str, rank: u32| join_dynamic(&store, name, rank, options());
    let a = join("a", 0).await.unwrap();
    let b = join("b", 1).await.unwrap();
    // b goes without leaving (a non-graceful shutdown does not leave).
    b.shutdown(false, None).await.unwrap();
    let c = join("c", 2).await.unwrap();
    let mut names: Vec<String> = c.workers().into_iter().map(|w| w.name).collect();
    names.sort();
    assert_eq!(names, ["a", "c"], "b was pruned");
    let v: i64 = c.rpc_sync("a", "add", &(2i64, 2i64)).await.unwrap();
    assert_eq!(v, 4);
    let d = join("d", 3).await.unwrap();
    assert_eq!(d.workers().len(), 3);
    for w in [d, c, a] {
        w.shutdown(false, None).await.unwrap();
    }
}
