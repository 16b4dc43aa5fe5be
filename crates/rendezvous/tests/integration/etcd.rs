//! The etcd store and the `etcd` backend against a real etcd server, which each
//! test starts itself (Debian's `etcd-server`; `RALLY_ETCD` names another binary).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rallypoint_rendezvous::api::{RendezvousError, RendezvousHandler, RendezvousParameters};
use rallypoint_rendezvous::dynamic::state::is_permutation;
use rallypoint_rendezvous::etcd::testing::EtcdServer;
use rallypoint_rendezvous::etcd::EtcdStore;
use rallypoint_rendezvous::registry::Registry;
use rallypoint_store::conformance::{conformance, Queues};
use rallypoint_store::Store;

use crate::free_port;

/// An etcd server on loopback, killed on drop.
struct Etcd {
    server: EtcdServer,
    endpoint: String,
}

impl Etcd {
    async fn start() -> Etcd {
        let server = EtcdServer::start().await.unwrap();
        Etcd {
            endpoint: server.endpoint.clone(),
            server,
        }
    }

    async fn store(&self, root: &str) -> EtcdStore {
        self.server.store(root).await.unwrap()
    }

    fn params(
        &self,
        run_id: &str,
        min: usize,
        max: usize,
        conf: &[(&str, &str)],
    ) -> RendezvousParameters {
        let mut p = RendezvousParameters::new("etcd", &self.endpoint, run_id, min, max).unwrap();
        p.local_addr = Some("127.0.0.1".into());
        p.config = conf
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect::<BTreeMap<_, _>>();
        p
    }
}

const FAST: &[(&str, &str)] = &[
    ("last_call_timeout", "0.3"),
    ("join_timeout", "20"),
    ("keep_alive_interval", "1"),
    ("keep_alive_max_attempt", "2"),
];

async fn handlers(
    etcd: &Etcd,
    run: &str,
    n: usize,
    min: usize,
    max: usize,
) -> Vec<Arc<dyn RendezvousHandler>> {
    let registry = Registry::with_builtins();
    let mut out = Vec::new();
    for _ in 0..n {
        let h = registry
            .create_handler(etcd.params(run, min, max, FAST))
            .await
            .unwrap();
        out.push(Arc::from(h));
    }
    out
}

async fn join_all(
    nodes: &[Arc<dyn RendezvousHandler>],
) -> Vec<Result<rallypoint_rendezvous::RendezvousInfo, RendezvousError>> {
    let tasks: Vec<_> = nodes
        .iter()
        .map(|n| {
            let n = n.clone();
            tokio::spawn(async move { n.next_rendezvous().await })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

/// Issue 18: N nodes taking an arrival index at once used to cost O(N) retries
/// each (read, then compare-and-swap). Each of 128 clients counting at once now
/// gets a distinct value, and the requests stay O(1) per client.
#[tokio::test]
async fn concurrent_counting_on_etcd_is_distinct_and_needs_no_retry() {
    let etcd = Etcd::start().await;
    let mut stores = Vec::new();
    for _ in 0..128 {
        stores.push(etcd.store("/count/").await);
    }
    let before: u64 = stores.iter().map(EtcdStore::rpcs).sum();
    let (go, _) = tokio::sync::watch::channel(false);
    let tasks: Vec<_> = stores
        .iter()
        .map(|s| {
            let (s, mut go) = (s.clone(), go.subscribe());
            tokio::spawn(async move {
                go.wait_for(|g| *g).await.unwrap();
                s.add("r0/join", 1).await.unwrap()
            })
        })
        .collect();
    go.send_replace(true);
    let mut got = Vec::new();
    for t in tasks {
        got.push(t.await.unwrap());
    }
    got.sort_unstable();
    assert_eq!(got, (1..=128).collect::<Vec<i64>>());
    let rpcs: u64 = stores.iter().map(EtcdStore::rpcs).sum::<u64>() - before;
    // The first write makes the counter (a few clients race for it, and
    // those that lose read it and go the one-transaction way): at most 4 each.
    assert!(rpcs <= 4 * 128, "{rpcs} requests for 128 increments");
    // Read back as the TCP store would: a decimal number, at every reader.
    let s = &stores[0];
    assert_eq!(s.get_now("r0/join").await.unwrap(), b"128");
    assert_eq!(
        s.multi_get(&["r0/join"]).await.unwrap(),
        vec![b"128".to_vec()]
    );
    assert_eq!(s.add("r0/join", 0).await.unwrap(), 128);
    // A plain number set over a counter is counted on from.
    s.set("r0/join", b"7").await.unwrap();
    assert_eq!(s.add("r0/join", 1).await.unwrap(), 8);
    assert_eq!(s.add("r0/join", 1).await.unwrap(), 9);
    assert_eq!(s.add("r0/join", -4).await.unwrap(), 5);
    assert_eq!(s.get_now("r0/join").await.unwrap(), b"5");
}

#[tokio::test]
async fn the_etcd_store_passes_the_conformance_suite() {
    let etcd = Etcd::start().await;
    let store = etcd.store("/conformance/").await;
    conformance(Arc::new(store.clone()), Queues::Supported).await;
    // Another root sees none of it.
    let other = etcd.store("/other/").await;
    assert_eq!(other.num_keys().await.unwrap(), 0);
    // Concurrent adds from many tasks are not lost (optimistic transactions retry).
    let tasks: Vec<_> = (0..20)
        .map(|_| {
            let s = store.clone();
            tokio::spawn(async move {
                for _ in 0..10 {
                    s.add("racy", 1).await.unwrap();
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(store.add("racy", 0).await.unwrap(), 200);
    // A wait for many keys is one watch, released by the last set.
    let keys: Vec<String> = (0..300).map(|i| format!("many/{i}")).collect();
    let waiter = {
        let (s, keys) = (store.clone(), keys.clone());
        tokio::spawn(async move {
            let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            s.multi_get(&refs).await
        })
    };
    for k in &keys {
        store.set(k, k.as_bytes()).await.unwrap();
    }
    let values = waiter.await.unwrap().unwrap();
    assert_eq!(values[299], b"many/299");
}

#[tokio::test]
async fn an_unreachable_etcd_is_a_connection_error_naming_the_run() {
    let registry = Registry::with_builtins();
    let mut p =
        RendezvousParameters::new("etcd", &format!("127.0.0.1:{}", free_port()), "job", 1, 1)
            .unwrap();
    p.config.insert("read_timeout".into(), "1".into());
    let e = registry.create_handler(p).await.err().unwrap();
    assert!(matches!(e, RendezvousError::Connection { .. }), "{e}");
    assert!(e.to_string().contains("\"job\""), "{e}");
}

#[tokio::test]
async fn a_round_forms_on_etcd_and_rank_0_publishes_the_job_store() {
    let etcd = Etcd::start().await;
    let nodes = handlers(&etcd, "job", 3, 2, 4).await;
    assert_eq!(nodes[0].backend(), "etcd");
    assert!(!nodes[0].use_agent_store(), "workers host the job's store");
    let infos: Vec<_> = join_all(&nodes)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let ranks: Vec<usize> = infos.iter().map(|i| i.rank).collect();
    assert!(is_permutation(&ranks), "{ranks:?}");
    assert!(infos.iter().all(|i| i.world_size == 3));
    // Every node learns the same address for the job's store, chosen by rank 0.
    assert!(infos.windows(2).all(|w| w[0].bootstrap == w[1].bootstrap));
    assert_eq!(infos[0].bootstrap.master_addr, "127.0.0.1");
    assert_ne!(infos[0].bootstrap.master_port, 0);
    // The round's store is shared.
    infos[0].store.set("k", b"v").await.unwrap();
    assert_eq!(infos[2].store.get("k").await.unwrap(), b"v");

    // A late node waits; the members see it and re-form; the group grows to 4
    // and the old members keep their ranks.
    let registry = Registry::with_builtins();
    let late: Arc<dyn RendezvousHandler> = Arc::from(
        registry
            .create_handler(etcd.params("job", 2, 4, FAST))
            .await
            .unwrap(),
    );
    let late_join = {
        let late = late.clone();
        tokio::spawn(async move { late.next_rendezvous().await })
    };
    let t0 = Instant::now();
    while nodes[0].num_nodes_waiting().await.unwrap() == 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the late node was never seen"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let again: Vec<_> = join_all(&nodes)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let late_info = late_join.await.unwrap().unwrap();
    assert!(again.iter().all(|i| i.world_size == 4));
    for (before, after) in infos.iter().zip(&again) {
        assert_eq!(before.rank, after.rank, "members keep their ranks");
    }
    assert_eq!(late_info.rank, 3);

    // Closing ends every later join.
    nodes[1].set_closed().await.unwrap();
    assert!(nodes[0].is_closed().await.unwrap());
    let e = nodes[2].next_rendezvous().await.unwrap_err();
    assert!(matches!(e, RendezvousError::Closed { .. }), "{e}");
}

#[tokio::test]
async fn a_timeout_on_etcd_names_who_joined() {
    let etcd = Etcd::start().await;
    let registry = Registry::with_builtins();
    let conf = [("join_timeout", "1"), ("last_call_timeout", "0.2")];
    let h = registry
        .create_handler(etcd.params("lonely", 2, 2, &conf))
        .await
        .unwrap();
    let e = h.next_rendezvous().await.unwrap_err();
    assert!(matches!(e, RendezvousError::Timeout { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("1 joined") && msg.contains("127.0.0.1:") && msg.contains("2..=2"),
        "{msg}"
    );
}

/// Names the etcd a [`member`] role joins through.
pub(crate) const ROLE_ETCD: &str = "RALLY_TEST_ETCD";

/// The member role (see `role` in `main.rs`).
pub(crate) fn member() {
    tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(role_member());
}

/// Joins a 3-node round on the etcd at `RALLY_TEST_ETCD`, prints its rank,
/// then hangs until killed.
async fn role_member() {
    let endpoint = std::env::var(ROLE_ETCD).expect("RALLY_TEST_ETCD names the etcd");
    let mut p = RendezvousParameters::new("etcd", &endpoint, "dies", 2, 3).unwrap();
    p.local_addr = Some("127.0.0.1".into());
    p.config = FAST
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    let h = Registry::with_builtins().create_handler(p).await.unwrap();
    let info = h.next_rendezvous().await.unwrap();
    println!("RANK {}", info.rank);
    std::future::pending::<()>().await;
}

#[tokio::test]
async fn a_killed_member_is_noticed_through_its_lease_and_the_survivors_re_form() {
    let etcd = Etcd::start().await;
    let nodes = handlers(&etcd, "dies", 2, 2, 3).await;
    let mut child = Command::new(std::env::current_exe().unwrap())
        .env(ROLE_ETCD, &etcd.endpoint)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let first: Vec<_> = join_all(&nodes)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(first[0].world_size, 3);
    let mut line = String::new();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    while !line.starts_with("RANK") {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "the member role exited"
        );
    }
    // Let the round run (every member's lease is up), then SIGKILL: no revoke,
    // no goodbye; only the lease expiring tells.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    child.kill().unwrap();
    child.wait().unwrap();
    let died_at = Instant::now();
    // Noticed once the lease expires: keep-alive interval × allowed misses
    // (1 s × 2, the lease's TTL). The bound protects that the lease tells
    // (nothing else does: no revoke, no goodbye); 10 s of margin over the
    // TTL is for a loaded machine and a real etcd's expiry of leases.
    let bound = Duration::from_secs(2) + Duration::from_secs(10);
    let noticed = crate::noticed_within(&nodes, died_at, bound).await;
    let again: Vec<_> = join_all(&nodes)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert!(again.iter().all(|i| i.world_size == 2));
    eprintln!(
        "killed member noticed after {noticed:?}; re-formed after {:?}",
        died_at.elapsed()
    );
}

/// The run's census, read from etcd: nodes counted in, less those counted
/// out (gone or dead). (`remaining()` also asks the heartbeat counters, which
/// the etcd backend does not use.)
async fn census(store: &EtcdStore, run: &str) -> i64 {
    let mut n = 0;
    for k in store.list_keys().await.unwrap() {
        if !k.contains(run) {
            continue;
        }
        let sign = if k.ends_with("nodes/joined") {
            1
        } else if k.ends_with("nodes/gone") || k.ends_with("nodes/dead") {
            -1
        } else {
            continue;
        };
        n += sign * store.add(&k, 0).await.unwrap();
    }
    n
}

/// A member whose lease ends while it is alive (here revoked; for real, etcd
/// out of reach for a TTL) is found dead by its watcher, but runs on: once
/// etcd answers it counts itself back into the census, so a host lingering
/// on the census waits for it. Before, its keep-alive just ended, and it
/// stayed counted out while it ran (a run closed after success does not
/// re-form).
#[tokio::test]
async fn a_member_whose_lease_ended_while_alive_is_counted_back_in() {
    let etcd = Etcd::start().await;
    let nodes = handlers(&etcd, "revoked", 3, 3, 3).await;
    let infos: Vec<_> = join_all(&nodes)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let store = etcd.store("/rallypoint/").await;
    assert_eq!(census(&store, "revoked").await, 3);
    let mut client = etcd_client::Client::connect([etcd.endpoint.as_str()], None)
        .await
        .unwrap();
    // Revoke member 1's lease: its key goes, its watcher finds it dead.
    let rank = infos[1].rank;
    let keys = client
        .get("", Some(etcd_client::GetOptions::new().with_all_keys()))
        .await
        .unwrap();
    let kv = keys
        .kvs()
        .iter()
        .find(|kv| {
            let k = String::from_utf8_lossy(kv.key());
            k.contains("revoked") && k.ends_with(&format!("/alive/{rank}"))
        })
        .expect("member 1's alive key");
    client.lease_revoke(kv.lease()).await.unwrap();
    // Its watcher marks it dead (the round is to re-form) ...
    let t0 = Instant::now();
    while nodes[0].membership().await.unwrap().dead == 0 {
        assert!(t0.elapsed() < Duration::from_secs(15), "never found dead");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // ... and both it and its watcher claim its count-out (the key reads 2:
    // whichever came second found it taken). Without the member's claim it
    // stays at 1 until the leave.
    let t0 = Instant::now();
    loop {
        let key = store
            .list_keys()
            .await
            .unwrap()
            .into_iter()
            .find(|k| k.contains("revoked") && k.ends_with(&format!("/census/{rank}")));
        if let Some(k) = key {
            if store.add(&k, 0).await.unwrap() >= 2 {
                break;
            }
        }
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "member 1 never claimed its count-out"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // It, alive, is counted in: three nodes in the census again (once the
    // watcher's count, if it was first, has landed too).
    let t0 = Instant::now();
    loop {
        let n = census(&store, "revoked").await;
        if n == 3 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "{n} in the census, not 3"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    nodes[1].leave().await.unwrap();
    assert_eq!(census(&store, "revoked").await, 2, "counted out once");
}
