//! TCP client behaviour beyond the shared conformance suite.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use rallypoint_store::{Store, StoreError, TcpStore};

use crate::support;

#[tokio::test]
async fn connect_retries_until_the_server_appears() {
    // Reserve a port, free it, and start the server there a little later.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let late = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let l = std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
        rallypoint_store::server::Server::from_listener(l, Default::default())
            .unwrap()
            .spawn()
    });
    let store = TcpStore::builder("127.0.0.1", port)
        .timeout(Duration::from_secs(10))
        .connect()
        .await
        .unwrap();
    store.set("k", b"v").await.unwrap();
    let _server = late.await.unwrap();
}

#[tokio::test]
async fn connect_gives_up_with_the_address_after_the_timeout() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let t0 = Instant::now();
    let err = TcpStore::builder("127.0.0.1", port)
        .timeout(Duration::from_millis(300))
        .connect()
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Connect { .. }), "{err}");
    assert!(
        err.to_string().contains(&format!("127.0.0.1:{port}")),
        "{err}"
    );
    assert!(t0.elapsed() < Duration::from_secs(3));
}

#[tokio::test]
async fn master_waits_for_workers_and_counts_init() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let master = tokio::spawn(
        TcpStore::builder("127.0.0.1", port)
            .is_master(true)
            .world_size(3)
            .timeout(Duration::from_secs(10))
            .connect(),
    );
    let mut workers = Vec::new();
    for _ in 0..2 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!master.is_finished(), "the master must wait for all 3");
        workers.push(
            TcpStore::builder("127.0.0.1", port)
                .world_size(3)
                .timeout(Duration::from_secs(10))
                .connect()
                .await
                .unwrap(),
        );
    }
    let master = master.await.unwrap().unwrap();
    assert_eq!(master.worker_count().await.unwrap(), 3);
    assert!(master.server().is_some());
    // init/ has no leading slash: it counts as a key but is not a user key.
    assert_eq!(master.num_keys().await.unwrap(), 1);
    assert!(master.list_keys().await.unwrap().is_empty());
}

#[tokio::test]
async fn master_timeout_says_how_many_joined() {
    let err = TcpStore::builder("127.0.0.1", 0)
        .is_master(true)
        .world_size(4)
        .timeout(Duration::from_millis(200))
        .connect()
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::WorkersTimeout {
                joined: 1,
                expected: 4,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("1/4 clients joined"), "{err}");
}

#[tokio::test]
async fn a_dropped_call_does_not_desynchronise_the_connection() {
    let server = support::server().await;
    let store = support::client(&server).await;
    // Abandon a get half-way (its WAIT is pending on the server).
    let r = tokio::time::timeout(Duration::from_millis(50), store.get("never")).await;
    assert!(r.is_err());
    // The next calls get their own replies, not the stale ones.
    store.set("k", b"v").await.unwrap();
    assert_eq!(store.get("k").await.unwrap(), b"v");
    assert_eq!(store.add("n", 2).await.unwrap(), 2);
    support::eventually("the abandoned wait is dropped", || {
        server.pending_waits() == 0
    })
    .await;
}

#[tokio::test]
async fn a_server_that_never_answers_is_a_timeout_not_a_hang() {
    // A fake server: answers the handshake's PING, then nothing.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut hello = [0u8; 10];
        s.read_exact(&mut hello).unwrap();
        s.write_all(&hello[6..10]).unwrap();
        std::thread::sleep(Duration::from_secs(3));
    });
    let store = TcpStore::builder("127.0.0.1", port)
        .timeout(Duration::from_millis(300))
        .connect()
        .await
        .unwrap();
    let err = store.add("x", 1).await.unwrap_err();
    assert!(
        matches!(err, StoreError::NoReply { op: "add", .. }),
        "{err}"
    );
}

#[tokio::test]
async fn clone_ping_and_barrier_command() {
    let server = support::server().await;
    let a = support::client(&server).await;
    let b = a.clone_store().await.unwrap();
    a.ping().await.unwrap();
    b.set("shared", b"1").await.unwrap();
    assert_eq!(a.get("shared").await.unwrap(), b"1");
    let (a2, b2) = (std::sync::Arc::new(a), std::sync::Arc::new(b));
    let t = {
        let a2 = a2.clone();
        tokio::spawn(async move { a2.barrier("bar", 2).await })
    };
    tokio::time::sleep(Duration::from_millis(20)).await;
    b2.barrier("bar", 2).await.unwrap();
    t.await.unwrap().unwrap();
    // A barrier nobody else reaches times out and says so.
    b2.set_timeout(Duration::from_millis(100));
    let err = b2.barrier("lonely", 2).await.unwrap_err();
    assert!(
        err.is_timeout() && err.to_string().contains("lonely"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_carry_pytorchs_leading_slash() {
    let server = support::server().await;
    let store = support::client(&server).await;
    store.set("user", b"1").await.unwrap();
    // SET has no reply; a reply on the same connection orders it before our check.
    store.ping().await.unwrap();
    let mut c = support::raw(server.local_addr());
    c.write_all(&support::cat(&[
        &[5],
        &1u64.to_le_bytes(),
        &support::s(b"/user"),
    ]))
    .unwrap();
    assert_eq!(support::read_n(&mut c, 1), [0]);
}

#[tokio::test]
async fn a_taken_port_is_a_clear_listen_error() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let err = rallypoint_store::server::Server::bind(addr, Default::default())
        .await
        .err()
        .expect("the port is taken");
    assert!(
        matches!(err, StoreError::Listen { op: "bind", .. }),
        "{err}"
    );
    assert!(err.to_string().contains(&addr.to_string()), "{err}");
}
