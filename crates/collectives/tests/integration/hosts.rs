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
