//! The conformance suite (`rallypoint_store::conformance`) against our backends.

use std::sync::Arc;
use std::time::Duration;

use rallypoint_store::conformance::{conformance, Queues};
use rallypoint_store::{FileStore, MemoryStore, PrefixStore, Store};

use crate::support;

#[tokio::test]
async fn memory_store() {
    conformance(Arc::new(MemoryStore::new()), Queues::Supported).await;
}

#[tokio::test]
async fn tcp_store() {
    let server = support::server().await;
    conformance(Arc::new(support::client(&server).await), Queues::Supported).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_store() {
    let dir = tempfile::tempdir().unwrap();
    let store = FileStore::open(dir.path().join("store"), -1).await.unwrap();
    conformance(Arc::new(store), Queues::Unsupported).await;
}

#[tokio::test]
async fn prefix_store_over_tcp() {
    let server = support::server().await;
    let tcp: Arc<dyn Store> = Arc::new(support::client(&server).await);
    tcp.set("outside", b"x").await.unwrap();
    let prefixed = PrefixStore::new("job", tcp.clone());
    conformance(Arc::new(prefixed), Queues::Supported).await;
    // The keys really live under the prefix, in PyTorch's format.
    assert_eq!(tcp.get("job/ap").await.unwrap(), b"abcd");
    // A nested prefix ending in '/' doubles the slash, as PyTorch's does.
    let nested = PrefixStore::new("0/", Arc::new(PrefixStore::new("default_pg", tcp.clone())));
    nested.set("cpu", b"addr").await.unwrap();
    assert!(tcp.check(&["default_pg/0//cpu"]).await.unwrap());
}

#[tokio::test]
async fn memory_store_concurrent_waiters_all_wake() {
    let store = MemoryStore::new();
    let mut tasks = Vec::new();
    for _ in 0..200 {
        let s = store.clone();
        tasks.push(tokio::spawn(async move { s.wait(&["go"]).await }));
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    store.set("go", b"1").await.unwrap();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
}
