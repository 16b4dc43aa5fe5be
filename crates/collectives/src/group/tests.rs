use std::sync::Arc;
use std::time::Duration;

use rallypoint_store::Store;

use super::*;
use crate::options::Options;
use crate::transport::Origin;
use crate::{Error, ReduceOp};

/// Ranks `0..hosts.len()` of one world in this process, rank `k` on
/// host `hosts[k]` (as far as shared memory is concerned).
async fn world(hosts: &[&str]) -> Vec<ProcessGroup> {
    let store: Arc<dyn Store> = Arc::new(rallypoint_store::MemoryStore::new());
    let n = hosts.len();
    let joins: Vec<_> = hosts
        .iter()
        .enumerate()
        .map(|(r, h)| {
            let o = Options {
                advertise: Some(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)),
                host_id: Some((*h).to_owned()),
                timeout: Duration::from_secs(30),
                ..Options::default()
            };
            tokio::spawn(ProcessGroup::new(store.clone(), r, n, o))
        })
        .collect();
    let mut pgs = Vec::new();
    for j in joins {
        pgs.push(j.await.unwrap().unwrap());
    }
    pgs
}

/// On every rank: a subgroup of all, one all_reduce and one broadcast
/// on it, then dropped.
async fn a_group_used_and_dropped(pgs: &[ProcessGroup]) {
    let all: Vec<usize> = (0..pgs.len()).collect();
    let runs: Vec<_> = pgs
        .iter()
        .map(|pg| {
            let sub = pg.new_group(&all).unwrap().unwrap();
            tokio::spawn(async move {
                let mut v = [1.0f32; 64];
                sub.all_reduce(&mut v, ReduceOp::Sum).await.unwrap();
                sub.broadcast(&mut v, 0).await.unwrap();
                sub.shared_memory().unwrap() || sub.two_level().unwrap()
            })
        })
        .collect();
    for r in runs {
        assert!(r.await.unwrap(), "the subgroup ran over shared memory");
    }
}

/// What this process's descriptors name (regions are memfds, peers'
/// processes pidfds), but sockets: the world's connections are opened
/// on demand (a probe of a late peer, say) and kept for every group.
fn open_fds() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .map(|p| p.display().to_string())
        .filter(|p| !p.starts_with("socket:"))
        .collect();
    v.sort();
    v
}

/// `new_group` in a loop: every group's state here (its members, its
/// router entries, abort signals, regions and internal groups) goes
/// with its last handle, so nothing grows.
async fn dropped_groups_leave_nothing_behind(hosts: &[&str]) {
    let pgs = world(hosts).await;
    let tables = || -> Vec<_> { pgs.iter().map(|pg| pg.comm.sh().group_tables()).collect() };
    let before = tables();
    let fds = open_fds();
    for _ in 0..20 {
        a_group_used_and_dropped(&pgs).await;
    }
    // Retired a grace (a second here) after the drop.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while tables() != before && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(tables(), before, "per-group tables grew");
    assert_eq!(open_fds(), fds, "descriptors were left open");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_groups_over_shared_memory_leave_nothing_behind() {
    dropped_groups_leave_nothing_behind(&["a", "a"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_groups_in_two_levels_leave_nothing_behind() {
    dropped_groups_leave_nothing_behind(&["a", "a", "b", "b"]).await;
}

/// An op whose own part is done when its group is aborted (a peer's
/// frame for it that did not match came while it ran: simulator seed
/// 973) returns the abort only once it is recorded in the store, as any
/// failing op does: its rank may exit at once, and a rank that then
/// finds it gone reads the record to name the cause (it named the
/// bystander). On a current-thread runtime the recording task runs only
/// when the op yields, so an op that returns without waiting shows.
#[tokio::test(flavor = "current_thread")]
async fn an_op_done_when_its_group_is_aborted_returns_once_the_abort_is_recorded() {
    let store: Arc<dyn Store> = Arc::new(rallypoint_store::MemoryStore::new());
    let o = Options {
        advertise: Some(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)),
        shared_memory: false,
        ..Options::default()
    };
    let pg = ProcessGroup::new(store.clone(), 0, 1, o).await.unwrap();
    let cx = pg.begin_barrier().unwrap();
    let found = Error::Invalid("a peer's frame for the op did not match".into());
    pg.comm
        .sh()
        .abort(pg.comm.id, found, Origin::Here, cx.seq());
    assert!(cx.finish(Ok(Ok(()))).await.is_err());
    let keys = store.list_keys().await.unwrap();
    assert!(
        keys.iter().any(|k| k.contains("/abort/")),
        "the op returned before its abort was recorded: {keys:?}"
    );
}
