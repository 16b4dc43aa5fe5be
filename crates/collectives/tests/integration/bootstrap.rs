//! Bootstrapping from a real TCPStore server and through the URL init.

use std::sync::Arc;

use rallypoint_collectives::blocking::BlockingGroup;
use rallypoint_collectives::{Options, ProcessGroup, ReduceOp};
use rallypoint_store::server::Server;
use rallypoint_store::{Store, TcpStore};

use crate::harness::{each, opts};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn from_a_tcp_store_server() {
    let server = Server::bind("127.0.0.1:0".parse().unwrap(), Default::default())
        .await
        .unwrap();
    let port = server.local_addr().port();
    let _h = server.spawn();
    let n = 4;
    let tasks: Vec<_> = (0..n)
        .map(|r| {
            tokio::spawn(async move {
                let store: Arc<dyn Store> = Arc::new(
                    TcpStore::builder("127.0.0.1", port)
                        .connect()
                        .await
                        .unwrap(),
                );
                ProcessGroup::new(store, r, n, opts()).await.unwrap()
            })
        })
        .collect();
    let mut pgs = Vec::new();
    for t in tasks {
        pgs.push(t.await.unwrap());
    }
    let got = each(&pgs, |pg| async move {
        let mut x = vec![pg.rank() as f64; 100_000];
        pg.all_reduce(&mut x, ReduceOp::Avg).await.map(|()| x[0])
    })
    .await;
    for g in got {
        assert_eq!(g.unwrap(), 1.5);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_tcp_and_file_urls() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let tasks: Vec<_> = (0..3)
        .map(|r| {
            tokio::spawn(async move {
                let url = format!("tcp://127.0.0.1:{port}?rank={r}&world_size=3");
                ProcessGroup::from_url(&url, Options::default()).await
            })
        })
        .collect();
    let mut pgs = Vec::new();
    for t in tasks {
        pgs.push(t.await.unwrap().unwrap());
    }
    let got = each(
        &pgs,
        |pg| async move { pg.all_gather_object(&pg.rank()).await },
    )
    .await;
    for g in got {
        assert_eq!(g.unwrap(), vec![0, 1, 2]);
    }

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let tasks: Vec<_> = (0..2)
        .map(|r| {
            let url = format!("file://{}?rank={r}&world_size=2", path.display());
            tokio::spawn(async move { ProcessGroup::from_url(&url, opts()).await })
        })
        .collect();
    let mut pgs = Vec::new();
    for t in tasks {
        pgs.push(t.await.unwrap().unwrap());
    }
    let got = each(&pgs, |pg| async move {
        let mut x = [pg.rank() as i8 + 1];
        pg.all_reduce(&mut x, ReduceOp::Product).await.map(|()| x)
    })
    .await;
    for g in got {
        assert_eq!(g.unwrap(), [2]);
    }
}

#[test]
fn blocking_groups_in_plain_threads() {
    let store: Arc<dyn Store> = Arc::new(rallypoint_store::MemoryStore::new());
    let threads: Vec<_> = (0..3)
        .map(|r| {
            let store = store.clone();
            std::thread::spawn(move || {
                let g = BlockingGroup::new(store, r, 3, opts()).unwrap();
                let mut x = [r as u16; 5];
                g.all_reduce(&mut x, ReduceOp::Max).unwrap();
                g.barrier().unwrap();
                let mut y = [0u8; 3];
                g.run(|pg| {
                    pg.scatter(
                        (r == 1).then_some(&[1u8, 2, 3, 4, 5, 6, 7, 8, 9][..]),
                        &mut y,
                        1,
                    )
                })
                .unwrap();
                (x, y)
            })
        })
        .collect();
    for (r, t) in threads.into_iter().enumerate() {
        let (x, y) = t.join().unwrap();
        assert_eq!(x, [2; 5]);
        assert_eq!(y, [1 + 3 * r as u8, 2 + 3 * r as u8, 3 + 3 * r as u8]);
    }
}

/// Over TCP the blocking group's all_reduce, broadcast and all_gather post
/// their receives: large payloads land in the caller's buffer, with the
/// results of the async forms.
#[test]
fn blocking_groups_receive_large_payloads_in_place() {
    let store: Arc<dyn Store> = Arc::new(rallypoint_store::MemoryStore::new());
    const LEN: usize = (1 << 20) + 3; // 4 MiB of f32: ring and chain, 12 segments
    let len = LEN;
    fn mine(r: usize) -> Vec<f32> {
        (0..LEN).map(|i| ((i * 7 + r) % 13) as f32).collect()
    }
    let threads: Vec<_> = (0..3)
        .map(|r| {
            let store = store.clone();
            std::thread::spawn(move || {
                let o = Options {
                    shared_memory: false,
                    ..opts()
                };
                let g = BlockingGroup::new(store, r, 3, o).unwrap();
                let mut sum = mine(r);
                g.all_reduce(&mut sum, ReduceOp::Sum).unwrap();
                let mut cast = mine(r);
                g.broadcast(&mut cast, 2).unwrap();
                let mut all = vec![0.0f32; 3 * len];
                g.all_gather(&mine(r), &mut all).unwrap();
                (sum, cast, all, g.group().received_in_place_bytes())
            })
        })
        .collect();
    let want_sum: Vec<f32> = (0..len)
        .map(|i| (0..3).map(|r| ((i * 7 + r) % 13) as f32).sum())
        .collect();
    let mut landed = 0;
    for (r, t) in threads.into_iter().enumerate() {
        let (sum, cast, all, in_place) = t.join().unwrap();
        assert!(sum == want_sum, "all_reduce on rank {r}");
        assert!(cast == mine(2), "broadcast on rank {r}");
        assert!(
            all == [mine(0), mine(1), mine(2)].concat(),
            "all_gather on rank {r}"
        );
        landed += in_place;
    }
    // How much lands depends on timing (a frame that arrives before its
    // receive is posted is copied); none at all would mean posting is broken.
    assert!(landed > 0, "nothing landed in place");
}

/// `from_env`/`from_url` against an address a store already serves (`rally
/// store serve`, a launcher's store): rank 0 connects to it as a client
/// instead of failing with "rendezvous store failed" (before: the port was
/// taken, and the other ranks waited for a generation that never came).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_url_whose_store_is_already_served_is_used_as_a_client() {
    let server = Server::bind("127.0.0.1:0".parse().unwrap(), Default::default())
        .await
        .unwrap();
    let port = server.local_addr().port();
    let _h = server.spawn();
    let tasks: Vec<_> = (0..2)
        .map(|r| {
            tokio::spawn(async move {
                let url = format!("tcp://127.0.0.1:{port}?rank={r}&world_size=2");
                let pg = ProcessGroup::from_url(&url, opts()).await?;
                let mut x = [pg.rank() as u32 + 1];
                pg.all_reduce(&mut x, ReduceOp::Sum).await.map(|()| x[0])
            })
        })
        .collect();
    for t in tasks {
        assert_eq!(t.await.unwrap().unwrap(), 3);
    }

    // A port taken by something that is not a store: rank 0 says so.
    let squatter = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = squatter.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = squatter.accept().await {
            use tokio::io::AsyncWriteExt;
            let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n").await;
        }
    });
    let url = format!("tcp://127.0.0.1:{port}?rank=0&world_size=2");
    let o = rallypoint_collectives::Options {
        timeout: std::time::Duration::from_secs(3),
        ..opts()
    };
    let e = ProcessGroup::from_url(&url, o.clone())
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains(&format!("127.0.0.1:{port} is in use")) && e.contains("not a store"),
        "{e}"
    );

    // One that accepts and never speaks (it once hung a test for the whole
    // store timeout, when another process took a port between its pick and
    // its bind): refused after a few seconds, not the timeout.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let url = format!("tcp://127.0.0.1:{port}?rank=0&world_size=2");
    let e = ProcessGroup::from_url(&url, o)
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains(&format!("127.0.0.1:{port} is in use")) && e.contains("not a store"),
        "{e}"
    );
    drop(silent);
}
