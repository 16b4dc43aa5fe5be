//! A group whose members change (`ProcessGroup::next_generation`):
//! survivors keep their connections, newcomers connect once to each, and
//! each generation's ops are whole.

use std::sync::Arc;
use std::time::Duration;

use rallypoint_collectives::{Options, ProcessGroup, ReduceOp};
use rallypoint_store::{MemoryStore, Store};

use crate::harness::{each, opts};

/// TCP only: connections are what these tests count.
fn tcp(prefix: &str) -> Options {
    Options {
        prefix: prefix.into(),
        shared_memory: false,
        ..opts()
    }
}

/// Forms a generation under `o.prefix`: member `g` from `prev[g]` (its last
/// generation's group, or none).
async fn generation(
    store: &Arc<dyn Store>,
    prev: Vec<Option<ProcessGroup>>,
    o: &Options,
) -> Vec<ProcessGroup> {
    let n = prev.len();
    let tasks: Vec<_> = prev
        .into_iter()
        .enumerate()
        .map(|(g, p)| {
            let (s, o) = (store.clone(), o.clone());
            tokio::spawn(async move { ProcessGroup::next_generation(p.as_ref(), s, g, n, o).await })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap().expect("the generation forms"));
    }
    out
}

/// Rank `from` sends to each of `to`, which receive; only the sender opens
/// a connection, so none is opened twice.
async fn send_to(pgs: &[ProcessGroup], from: usize, to: &[usize]) {
    let s = pgs[from].clone();
    let to_ = to.to_vec();
    let sender = tokio::spawn(async move {
        for &t in &to_ {
            s.send(&[from as u32 + 100], t, 7).await.unwrap();
        }
    });
    for &t in to {
        let mut got = [0u32];
        pgs[t].recv(&mut got, from, 7).await.unwrap();
        assert_eq!(got[0], from as u32 + 100);
    }
    sender.await.unwrap();
}

/// Sums every member's rank + 1 over the generation, checked on each.
async fn check_all_reduce(pgs: &[ProcessGroup], len: usize) {
    let n = pgs.len();
    let want = (n * (n + 1) / 2) as f32;
    let got = each(pgs, move |pg| async move {
        let mut v = vec![(pg.rank() + 1) as f32; len];
        pg.all_reduce(&mut v, ReduceOp::Sum).await.map(|_| v)
    })
    .await;
    for (g, r) in got.into_iter().enumerate() {
        let v = r.unwrap_or_else(|e| panic!("rank {g}: {e}"));
        assert!(v.iter().all(|&x| x == want), "rank {g}");
    }
}

fn handshakes(pgs: &[ProcessGroup]) -> Vec<u64> {
    pgs.iter().map(ProcessGroup::handshakes).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survivors_keep_their_connections_and_a_newcomer_connects_once_to_each() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let g1 = generation(&store, vec![None, None, None], &tcp("q1")).await;
    send_to(&g1, 0, &[1, 2]).await;
    send_to(&g1, 1, &[2]).await;
    assert_eq!(handshakes(&g1), vec![2, 2, 2], "one connection a pair");
    check_all_reduce(&g1, 1 << 16).await;

    // 3 -> 2: member 2 exits.
    let mut g1 = g1.into_iter().map(Some).collect::<Vec<_>>();
    drop(g1.pop());
    let g2 = generation(&store, g1, &tcp("q2")).await;
    assert_eq!((g2[0].rank(), g2[1].rank(), g2[0].size()), (0, 1, 2));
    check_all_reduce(&g2, 1 << 16).await;
    send_to(&g2, 1, &[0]).await;
    assert_eq!(
        handshakes(&g2),
        vec![2, 2],
        "no new connection between survivors"
    );

    // 2 -> 3: a newcomer, at group rank 1.
    let g3 = generation(
        &store,
        vec![Some(g2[0].clone()), None, Some(g2[1].clone())],
        &tcp("q3"),
    )
    .await;
    drop(g2);
    send_to(&g3, 0, &[1]).await;
    send_to(&g3, 2, &[1]).await;
    assert_eq!(
        handshakes(&g3),
        vec![3, 2, 3],
        "one connection from each survivor to the newcomer"
    );
    check_all_reduce(&g3, 1 << 16).await;
    send_to(&g3, 1, &[0, 2]).await;
    assert_eq!(handshakes(&g3), vec![3, 2, 3], "and no other");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_generation_aborted_mid_all_reduce_leaves_the_next_whole() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let g1 = generation(&store, vec![None, None, None], &tcp("a1")).await;
    // Ranks 0 and 1 start a large all_reduce that rank 2 never joins (a
    // member lost), and rank 0 aborts the generation, as torchft's Manager
    // does on a failure: frames in flight, credit taken.
    let running: Vec<_> = g1[..2]
        .iter()
        .cloned()
        .map(|pg| {
            tokio::spawn(async move {
                let mut v = vec![1f32; 4 << 20];
                pg.all_reduce(&mut v, ReduceOp::Sum).await
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(50)).await; // not a sync: either order aborts it
    g1[0].abort("the quorum moved on");
    for r in running {
        let e = r
            .await
            .unwrap()
            .expect_err("the aborted generation's op fails");
        assert!(e.to_string().contains("the quorum moved on"), "{e}");
    }
    let g2 = generation(&store, g1.into_iter().map(Some).collect(), &tcp("a2")).await;
    for _ in 0..3 {
        check_all_reduce(&g2, 4 << 20).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_of_another_lineage_joins_the_majoritys() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let pair = generation(&store, vec![None, None], &tcp("x1")).await;
    let lone = generation(&store, vec![None], &tcp("y1")).await;
    check_all_reduce(&pair, 8).await;
    let before = lone[0].handshakes();
    let g = generation(
        &store,
        vec![
            Some(pair[0].clone()),
            Some(lone[0].clone()),
            Some(pair[1].clone()),
        ],
        &tcp("z"),
    )
    .await;
    check_all_reduce(&g, 1 << 12).await;
    assert_eq!(before, 0);
    assert!(
        g[1].local_addr() != lone[0].local_addr(),
        "a new transport on its spare listener"
    );
    assert_eq!(
        g[0].local_addr(),
        pair[0].local_addr(),
        "the majority's members keep theirs"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_memory_is_laid_out_per_generation() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let o = |p: &str| Options {
        prefix: p.into(),
        ..opts()
    };
    let g1 = generation(&store, vec![None, None, None], &o("s1")).await;
    check_all_reduce(&g1, 1 << 12).await;
    assert_eq!(g1[0].shared_memory(), Some(true));
    let mut g1: Vec<_> = g1.into_iter().map(Some).collect();
    drop(g1.remove(1));
    let g2 = generation(&store, g1, &o("s2")).await;
    check_all_reduce(&g2, 1 << 12).await;
    assert_eq!(g2[0].shared_memory(), Some(true));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_never_comes_is_named_and_a_prefix_reused_refused() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let o = Options {
        timeout: Duration::from_millis(300),
        ..tcp("m1")
    };
    let tasks: Vec<_> = (0..2)
        .map(|g| {
            let (s, o) = (store.clone(), o.clone());
            tokio::spawn(async move { ProcessGroup::next_generation(None, s, g, 3, o).await })
        })
        .collect();
    for t in tasks {
        let e = t
            .await
            .unwrap()
            .err()
            .expect("no generation without rank 2");
        assert!(
            e.to_string()
                .contains("group rank(s) 2 of 3 never published their entry"),
            "{e}"
        );
    }
    let again = ProcessGroup::next_generation(None, store.clone(), 0, 3, o.clone())
        .await
        .err()
        .expect("the prefix is used");
    assert!(
        again
            .to_string()
            .contains("already taken under this prefix"),
        "{again}"
    );
    let bad = ProcessGroup::next_generation(None, store, 3, 3, o)
        .await
        .err()
        .expect("rank 3 of 3");
    assert!(
        bad.to_string().contains("rank 3 is not in a group of 3"),
        "{bad}"
    );
}

/// How long rank 1's send to a frozen rank 2 takes to fail after rank 1
/// aborts the group, with `tell` as the group's `tell_before_failing`.
async fn failing_beside_a_frozen_member(tell: bool) -> Duration {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let o = Options {
        tell_before_failing: tell,
        ..tcp("frozen")
    };
    // Rank 2 on its own runtime of one thread, which a blocking task then
    // holds: its sockets go unread, as a stopped process's or a cut-off
    // host's (the kernel takes what fits in its buffers, then nothing).
    let frozen = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (s2, o2) = (store.clone(), o.clone());
    let third =
        frozen.spawn(async move { ProcessGroup::next_generation(None, s2, 2, 3, o2).await });
    let tasks: Vec<_> = (0..2)
        .map(|g| {
            let (s, o) = (store.clone(), o.clone());
            tokio::spawn(async move { ProcessGroup::next_generation(None, s, g, 3, o).await })
        })
        .collect();
    let mut pgs = Vec::new();
    for t in tasks {
        pgs.push(t.await.unwrap().unwrap());
    }
    let _victim = third.await.unwrap().unwrap();
    let (thaw, thawed) = std::sync::mpsc::channel::<()>();
    frozen.spawn(async move {
        let _ = thawed.recv_timeout(Duration::from_secs(30));
    });
    // 64 MiB: far more than the socket buffers, so the send's writer stops
    // mid-frame, holding the connection.
    let sender = pgs[1].clone();
    let mut send = tokio::spawn(async move {
        let data = vec![1f32; 16 << 20];
        sender.send(&data, 2, 1).await
    });
    assert!(
        tokio::time::timeout(Duration::from_millis(300), &mut send)
            .await
            .is_err(),
        "a send to a frozen member cannot finish"
    );
    // Rank 1 itself aborts (as a survivor whose lighthouse watch fired
    // does): it tells every member, the frozen one too.
    let t0 = std::time::Instant::now();
    pgs[1].abort("a member was dropped");
    let e = tokio::time::timeout(Duration::from_secs(10), send)
        .await
        .expect("the send fails within the abort's bounds")
        .unwrap()
        .expect_err("aborted");
    let took = t0.elapsed();
    assert!(e.to_string().contains("a member was dropped"), "{e}");
    let _ = thaw.send(());
    frozen.shutdown_background();
    took
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_cannot_be_told_costs_a_living_group_nothing() {
    // Telling the frozen member waits behind the stalled send's writer (up
    // to 2 s, the telling's bound); a generation's op does not wait for it.
    let took = failing_beside_a_frozen_member(false).await;
    assert!(took < Duration::from_millis(1000), "took {took:?}");
    eprintln!("aborted beside a frozen member: the op failed {took:?} after the abort");
}
