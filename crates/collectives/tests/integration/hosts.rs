//! Worlds that span hosts: several "hosts" in this process, told apart by
//! `Options::host_id`.

use std::sync::Arc;

use rallypoint_collectives::{Options, ProcessGroup, ReduceOp};
use rallypoint_store::{MemoryStore, Store};

use crate::harness::opts;

/// A world whose rank `r` is on host `hosts[r]`.
pub async fn world_on_hosts(hosts: &[&str], o: Options) -> Vec<ProcessGroup> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let n = hosts.len();
    let tasks: Vec<_> = hosts
        .iter()
        .enumerate()
        .map(|(r, h)| {
            let o = Options {
                host_id: Some((*h).to_owned()),
                ..o.clone()
            };
            tokio::spawn(ProcessGroup::new(store.clone(), r, n, o))
        })
        .collect();
    let mut pgs = Vec::new();
    for t in tasks {
        pgs.push(t.await.unwrap().unwrap());
    }
    pgs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_within_one_host_shares_memory_in_a_world_that_spans_hosts() {
    let pgs = world_on_hosts(&["a", "a", "b", "b", "b"], opts()).await;
    // (members, all on one host)
    let groups: &[(&[usize], bool)] = &[
        (&[0, 1, 2, 3, 4], false),
        (&[0, 1], true),
        (&[2, 3, 4], true),
        (&[3, 4], true),
        (&[1, 2], false),
        (&[0, 1, 4], false),
    ];
    let tasks: Vec<_> = pgs
        .into_iter()
        .map(|world| {
            tokio::spawn(async move {
                let r = world.rank();
                let subs: Vec<_> = groups
                    .iter()
                    .map(|(m, _)| world.new_group(m).unwrap())
                    .collect();
                for ((members, local), sub) in groups.iter().zip(subs) {
                    let Some(sub) = sub else { continue };
                    let mut x = vec![r as i64 + 1; 300];
                    sub.all_reduce(&mut x, ReduceOp::Sum).await.unwrap();
                    let want: i64 = members.iter().map(|&m| m as i64 + 1).sum();
                    assert!(x.iter().all(|&v| v == want), "rank {r} in {members:?}");
                    assert_eq!(sub.shared_memory(), Some(*local), "rank {r} in {members:?}");
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
}

/// Two-level all_reduce, broadcast and barrier on several layouts, between
/// flat ops, blocking and started together; against the flat reference.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_across_hosts_runs_in_two_levels_with_the_right_results() {
    let layouts: &[&[&str]] = &[
        &["a", "a", "b", "b"],
        &["a", "a", "a", "b"],
        &["a", "b", "a", "b", "c"],
        &["a", "b", "b", "c", "c", "c"],
    ];
    for hosts in layouts {
        let o = Options {
            // Small halves and segments: buffers take several rounds.
            shm_slot_bytes: 256,
            segment_bytes: 256,
            small_bytes: 128,
            ..opts()
        };
        let pgs = world_on_hosts(hosts, o).await;
        let n = hosts.len();
        let tasks: Vec<_> = pgs
            .into_iter()
            .map(|pg| {
                tokio::spawn(async move {
                    let r = pg.rank();
                    let mine = |len: usize| -> Vec<f32> {
                        (0..len).map(|i| ((i * 7 + r * 3) % 11) as f32).collect()
                    };
                    for len in [0usize, 1, 37, 1000] {
                        let mut x = mine(len);
                        pg.all_reduce(&mut x, ReduceOp::Sum).await.unwrap();
                        let want: Vec<f32> = (0..len)
                            .map(|i| (0..n).map(|q| ((i * 7 + q * 3) % 11) as f32).sum())
                            .collect();
                        assert_eq!(x, want, "all_reduce sum, {len}, rank {r} of {n}");
                        let mut m = mine(len);
                        pg.all_reduce(&mut m, ReduceOp::Avg).await.unwrap();
                        let avg: Vec<f32> = want.iter().map(|s| s / n as f32).collect();
                        for (a, b) in m.iter().zip(&avg) {
                            assert!((a - b).abs() < 1e-4, "avg {a} vs {b}");
                        }
                        for root in 0..n {
                            let mut b = if r == root { mine(len) } else { vec![0.0; len] };
                            pg.broadcast(&mut b, root).await.unwrap();
                            let want: Vec<f32> =
                                (0..len).map(|i| ((i * 7 + root * 3) % 11) as f32).collect();
                            assert_eq!(b, want, "broadcast from {root}, {len}, rank {r}");
                        }
                        pg.barrier().await.unwrap();
                        // A flat op between two-level ones.
                        let mut all = vec![0.0f32; len * n];
                        pg.all_gather(&mine(len), &mut all).await.unwrap();
                        // Started together: their steps keep the group's order.
                        let w1 = pg.all_reduce_async(mine(len), ReduceOp::Max);
                        let w2 = pg.broadcast_async(mine(len), n - 1);
                        let w3 = pg.barrier_async();
                        w3.wait().await.unwrap();
                        let b = w2.wait().await.unwrap();
                        let mx = w1.wait().await.unwrap();
                        for i in 0..len {
                            let want = (0..n)
                                .map(|q| ((i * 7 + q * 3) % 11) as f32)
                                .fold(0.0, f32::max);
                            assert_eq!(mx[i], want);
                            assert_eq!(b[i], ((i * 7 + (n - 1) * 3) % 11) as f32);
                        }
                    }
                    pg.two_level()
                })
            })
            .collect();
        for t in tasks {
            assert_eq!(t.await.unwrap(), Some(true), "{hosts:?}");
        }
    }
    // One rank per host: nothing to share, so TCP.
    let pgs = world_on_hosts(&["a", "b", "c"], opts()).await;
    let tasks: Vec<_> = pgs
        .into_iter()
        .map(|pg| {
            tokio::spawn(async move {
                pg.barrier().await.unwrap();
                (pg.two_level(), pg.shared_memory())
            })
        })
        .collect();
    for t in tasks {
        assert_eq!(t.await.unwrap(), (Some(false), Some(false)));
    }
}

/// A mismatch on one host (a non-leader calls another size) fails every
/// rank on every host, naming the rank and the group's op.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mismatch_on_one_host_fails_every_rank_of_a_two_level_group() {
    let o = Options {
        timeout: std::time::Duration::from_secs(30),
        ..opts()
    };
    let pgs = world_on_hosts(&["a", "a", "b", "b", "b"], o).await;
    let tasks: Vec<_> = pgs
        .into_iter()
        .map(|pg| {
            tokio::spawn(async move {
                let r = pg.rank();
                let mut x = vec![1.0f32; 10];
                pg.all_reduce(&mut x, ReduceOp::Sum).await.unwrap();
                let mut y = vec![1.0f32; if r == 3 { 12 } else { 10 }];
                let e = pg.all_reduce(&mut y, ReduceOp::Sum).await.unwrap_err();
                e.to_string()
            })
        })
        .collect();
    for (r, t) in tasks.into_iter().enumerate() {
        let e = t.await.unwrap();
        assert!(
            e.contains("mismatched collectives")
                && e.contains("at op #1")
                && e.contains("rank 3 called"),
            "rank {r}: {e}"
        );
    }
}

/// One rank calls a flat op where the others call a two-level one, or the
/// other way round: the internal groups' steps of the two ops must never
/// meet as if they were one op's. Every rank names op #1 and the deviant's
/// call, not op #2 (found by sim seeds 112400, 113077 and 118414, where the
/// deviant's step met the others' next op's step in shared memory). Wants
/// are held back (`probe_after`) so the shared memory is the first to see it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flat_op_against_a_two_level_one_is_named_at_its_op_on_every_rank() {
    for deviant_two_level in [true, false] {
        let o = Options {
            timeout: std::time::Duration::from_secs(30),
            probe_after: std::time::Duration::from_secs(20),
            ..opts()
        };
        let pgs = world_on_hosts(&["a", "a", "b", "b"], o).await;
        let tasks: Vec<_> = pgs
            .into_iter()
            .map(|pg| {
                tokio::spawn(async move {
                    let r = pg.rank();
                    let mut x = vec![1i32; 10];
                    pg.all_reduce(&mut x, ReduceOp::Sum).await.unwrap();
                    // Op #1: rank 1 deviates.
                    let two_level = two_level_on(r, deviant_two_level);
                    let first = if two_level {
                        pg.all_reduce(&mut x, ReduceOp::Sum).await
                    } else {
                        pg.gather(&x, 3).await.map(drop)
                    };
                    if let Err(e) = first {
                        return (1, e.to_string());
                    }
                    // Op #2.
                    let e = pg.all_reduce(&mut x, ReduceOp::Sum).await.unwrap_err();
                    (2, e.to_string())
                })
            })
            .collect();
        for (r, t) in tasks.into_iter().enumerate() {
            let (at, e) = t.await.unwrap();
            // Only a rank whose op #1 sent without waiting (a gather's
            // non-root) may finish it: a deviant's all_reduce must not
            // complete on another op's data.
            let may_finish = !two_level_on(r, deviant_two_level) && r != 3;
            assert!(
                at == 1 || may_finish,
                "deviant two-level {deviant_two_level}, rank {r} finished op #1: {e}"
            );
            assert!(
                e.contains("mismatched collectives")
                    && e.contains("at op #1:")
                    && e.contains("rank 1 called"),
                "deviant two-level {deviant_two_level}, rank {r}: {e}"
            );
        }
    }
}

/// Whether rank `r` calls the two-level op (all_reduce) at op #1, where rank
/// 1 deviates from the others.
fn two_level_on(r: usize, deviant_two_level: bool) -> bool {
    (r == 1) == deviant_two_level
}

/// A rank that never comes to a two-level all_reduce: every other rank
/// times out naming, in the group's ranks, whom it waited for (on its host,
/// the rank itself; elsewhere, its host's leader), never "the operation to
/// start" and never an internal rank.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_rank_in_a_two_level_op_is_named_at_the_timeout() {
    let o = Options {
        timeout: std::time::Duration::from_secs(2),
        ..opts()
    };
    let pgs = world_on_hosts(&["a", "a", "b", "b"], o).await;
    let tasks: Vec<_> = pgs
        .into_iter()
        .map(|pg| {
            tokio::spawn(async move {
                let r = pg.rank();
                let mut x = vec![1.0f32; 100];
                pg.all_reduce(&mut x, ReduceOp::Sum).await.unwrap();
                if r == 3 {
                    // Stalls: alive, its group held, never calling.
                    tokio::time::sleep(std::time::Duration::from_secs(4)).await;
                    return None;
                }
                Some(pg.all_reduce(&mut x, ReduceOp::Sum).await.unwrap_err())
            })
        })
        .collect();
    for (r, t) in tasks.into_iter().enumerate() {
        let Some(e) = t.await.unwrap() else { continue };
        let s = e.to_string();
        assert!(s.contains("timed out"), "rank {r}: {s}");
        assert!(
            !s.contains("to start") && !s.contains("dropped"),
            "rank {r}: {s}"
        );
        // Whom each waited for: rank 2, rank 3 (on its host); rank 0, host
        // b's leader, rank 2 (among hosts); rank 1, its leader, rank 0 (on
        // its host). Whoever times out first aborts the others with its
        // reason, so any of these may be the one reported; never an
        // internal rank, and never a rank not on that path.
        assert!(
            s.contains("rank 3 (in the step within this host, at stage")
                || s.contains("rank 2 (in the step among hosts, at step")
                || s.contains("rank 0 (in the step within this host, at stage"),
            "rank {r}: {s}"
        );
        if r == 2 && matches!(e, rallypoint_collectives::Error::Timeout { .. }) {
            assert!(s.contains("rank 3 ("), "{s}");
        }
    }
}
