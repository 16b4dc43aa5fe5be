//! The elastic store utilities: barrier with rank tracing, synchronize, get_all,
//! scoped timeouts.

use std::sync::Arc;
use std::time::Duration;

use rallypoint_store::util::{self, RankTracing};
use rallypoint_store::{MemoryStore, Store, StoreError};

use crate::support;

#[tokio::test]
async fn barrier_releases_everyone() {
    let server = support::server().await;
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let store = support::client(&server).await;
        tasks.push(tokio::spawn(async move {
            util::barrier(&store, 8, "b1", Duration::from_secs(5), None).await
        }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
}

#[tokio::test]
async fn barrier_timeout_names_the_missing_ranks() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let decoder = |r: usize| format!("host-{r}");
    // World of 6; ranks 2 and 4 never come.
    let mut tasks = Vec::new();
    for rank in [0usize, 1, 3, 5] {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            let tracing = RankTracing {
                rank,
                decoder: &decoder,
                trace_timeout: Duration::from_millis(100),
            };
            let err = util::barrier(&*store, 6, "b2", Duration::from_millis(200), Some(tracing))
                .await
                .unwrap_err();
            (rank, err)
        }));
    }
    for t in tasks {
        let (rank, err) = t.await.unwrap();
        let msg = err.to_string();
        match &err {
            StoreError::BarrierTimeout {
                arrived,
                world_size,
                missing,
                ..
            } => {
                assert_eq!((*arrived, *world_size), (4, 6), "{msg}");
                if rank == 0 {
                    assert_eq!(missing, &["host-2", "host-4"], "{msg}");
                } else {
                    assert!(missing.is_empty());
                    assert!(msg.contains("check rank 0 (host-0)"), "{msg}");
                }
            }
            other => panic!("rank {rank}: {other}"),
        }
    }
}

#[tokio::test]
async fn barrier_timeout_caps_the_missing_list_at_16() {
    let store = MemoryStore::new();
    let decoder = |r: usize| r.to_string();
    let tracing = RankTracing {
        rank: 0,
        decoder: &decoder,
        trace_timeout: Duration::from_millis(20),
    };
    let err = util::barrier(&store, 100, "b3", Duration::from_millis(20), Some(tracing))
        .await
        .unwrap_err();
    let StoreError::BarrierTimeout { missing, .. } = err else {
        panic!()
    };
    assert_eq!(missing.len(), 16);
    assert_eq!(missing[0], "1");
}

#[tokio::test]
async fn synchronize_returns_every_ranks_data_in_order() {
    let server = support::server().await;
    let mut tasks = Vec::new();
    for rank in 0..5usize {
        let store = support::client(&server).await;
        tasks.push(tokio::spawn(async move {
            let data = format!("data-{rank}");
            let all = util::synchronize(
                &store,
                data.as_bytes(),
                rank,
                5,
                "sync/",
                Duration::from_secs(5),
            )
            .await
            .unwrap();
            // The scoped timeout was restored.
            assert_eq!(store.timeout(), Duration::from_secs(5));
            all
        }));
    }
    let want: Vec<Vec<u8>> = (0..5).map(|r| format!("data-{r}").into_bytes()).collect();
    for t in tasks {
        assert_eq!(t.await.unwrap(), want);
    }
}

#[tokio::test]
async fn get_all_makes_rank_zero_leave_last() {
    let store = MemoryStore::new();
    for i in 0..3 {
        store
            .set(&format!("p{i}"), format!("{i}").as_bytes())
            .await
            .unwrap();
    }
    // Rank 0 alone blocks until the other two have read.
    let s0 = store.clone();
    let r0 = tokio::spawn(async move { util::get_all(&s0, 0, "p", 3).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!r0.is_finished());
    util::get_all(&store, 1, "p", 3).await.unwrap();
    util::get_all(&store, 2, "p", 3).await.unwrap();
    assert_eq!(r0.await.unwrap().unwrap()[2], b"2");
}

#[tokio::test]
async fn store_timeout_is_scoped() {
    let store = MemoryStore::new();
    store.set_timeout(Duration::from_secs(7));
    {
        let _g = util::store_timeout(&store, Duration::from_millis(10));
        assert_eq!(store.timeout(), Duration::from_millis(10));
        assert!(store.get("missing").await.unwrap_err().is_timeout());
    }
    assert_eq!(store.timeout(), Duration::from_secs(7));
}
