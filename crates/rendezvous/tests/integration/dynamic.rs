//! The dynamic (c10d) backend over real stores: joins at min, max and beyond,
//! late joiners, spares, closing, dead nodes, timeouts, stable natural ranks, and
//! a simulation of hundreds of nodes each with its own TCP connection.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rallypoint_rendezvous::api::{
    BootstrapStoreInfo, RendezvousError, RendezvousHandler, RendezvousInfo,
};
use rallypoint_rendezvous::dynamic::state::{is_permutation, Bounds};
use rallypoint_rendezvous::dynamic::{DynamicRendezvous, Timing};
use rallypoint_store::{MemoryStore, Store, TcpStore};

fn timing() -> Timing {
    Timing {
        join: Duration::from_secs(10),
        last_call: Duration::from_millis(300),
        keep_alive: Duration::from_millis(100),
        max_misses: 3,
    }
}

fn node(
    store: &MemoryStore,
    id: &str,
    min: usize,
    max: usize,
    t: Timing,
) -> Arc<DynamicRendezvous> {
    Arc::new(DynamicRendezvous::new(
        Arc::new(store.clone()),
        "run",
        id.to_owned(),
        Bounds { min, max },
        t,
        BootstrapStoreInfo {
            master_addr: "127.0.0.1".into(),
            master_port: 1,
        },
    ))
}

async fn join_all(
    nodes: &[Arc<DynamicRendezvous>],
) -> Vec<Result<RendezvousInfo, RendezvousError>> {
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

/// Every node joins the next round, and every join must succeed.
async fn join_ok(nodes: &[Arc<DynamicRendezvous>]) -> Vec<RendezvousInfo> {
    join_all(nodes)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect()
}

fn ranks(infos: &[RendezvousInfo]) -> Vec<usize> {
    infos.iter().map(|i| i.rank).collect()
}

#[tokio::test]
async fn a_full_round_completes_at_max_at_once_with_natural_ranks() {
    let store = MemoryStore::new();
    let t = Timing {
        last_call: Duration::from_secs(30),
        ..timing()
    };
    let nodes: Vec<_> = ["node10", "node2", "node1"]
        .iter()
        .map(|id| node(&store, id, 2, 3, t))
        .collect();
    let started = Instant::now();
    let infos: Vec<RendezvousInfo> = join_ok(&nodes).await;
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "reaching max must not wait out the last call"
    );
    assert!(infos.iter().all(|i| i.world_size == 3));
    assert_eq!(ranks(&infos), [2, 1, 0], "node1 < node2 < node10");
    // The round's job store is shared.
    infos[0].store.set("k", b"v").await.unwrap();
    assert_eq!(infos[2].store.get("k").await.unwrap(), b"v");
}

#[tokio::test]
async fn a_round_at_min_completes_after_the_last_call() {
    let store = MemoryStore::new();
    let nodes: Vec<_> = ["a", "b"]
        .iter()
        .map(|id| node(&store, id, 2, 4, timing()))
        .collect();
    let started = Instant::now();
    let infos: Vec<RendezvousInfo> = join_ok(&nodes).await;
    assert!(
        started.elapsed() >= Duration::from_millis(250),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(infos[0].world_size, 2);
    assert!(is_permutation(&ranks(&infos)));
}

#[tokio::test]
async fn a_late_joiner_is_waiting_and_the_group_grows_keeping_ranks() {
    let store = MemoryStore::new();
    let members: Vec<_> = ["n1", "n3"]
        .iter()
        .map(|id| node(&store, id, 2, 4, timing()))
        .collect();
    let first: Vec<RendezvousInfo> = join_ok(&members).await;
    assert_eq!(ranks(&first), [0, 1]);
    assert_eq!(members[0].num_nodes_waiting().await.unwrap(), 0);
    // n2 arrives after the round completed.
    let late = node(&store, "n2", 2, 4, timing());
    let l = late.clone();
    let late_join = tokio::spawn(async move { l.next_rendezvous().await });
    let t0 = Instant::now();
    while members[0].num_nodes_waiting().await.unwrap() == 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the late joiner was never counted"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The members re-form; the group grows to 3 and old ranks are kept.
    let again = join_all(&members).await;
    let late_info = late_join.await.unwrap().unwrap();
    let again: Vec<RendezvousInfo> = again.into_iter().map(Result::unwrap).collect();
    assert_eq!(late_info.world_size, 3);
    assert_eq!(ranks(&again), [0, 1], "n1 and n3 keep their ranks");
    assert_eq!(late_info.rank, 2);
    assert_eq!(
        members[0].num_nodes_waiting().await.unwrap(),
        0,
        "a fresh round has no waiters"
    );
}

#[tokio::test]
async fn spares_beyond_max_wait_without_forcing_a_restart_and_exit_on_close() {
    let store = MemoryStore::new();
    let nodes: Vec<_> = ["a", "b", "c"]
        .iter()
        .map(|id| node(&store, id, 1, 2, timing()))
        .collect();
    let mut joins: Vec<_> = nodes
        .iter()
        .map(|n| {
            let n = n.clone();
            tokio::spawn(async move { n.next_rendezvous().await })
        })
        .collect();
    // Two complete (max = 2); the third keeps waiting as a spare.
    let mut done = Vec::new();
    let t0 = Instant::now();
    while done.len() < 2 {
        assert!(t0.elapsed() < Duration::from_secs(5));
        let mut i = 0;
        while i < joins.len() {
            if joins[i].is_finished() {
                done.push((i, joins.remove(i).await.unwrap().unwrap()));
            } else {
                i += 1;
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let member = &nodes[done[0].0];
    assert_eq!(
        member.num_nodes_waiting().await.unwrap(),
        0,
        "a spare does not count as waiting"
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!joins[0].is_finished(), "the spare is still waiting");
    member.set_closed().await.unwrap();
    let spare = joins.remove(0).await.unwrap();
    assert!(
        matches!(spare, Err(RendezvousError::GracefulExit { .. })),
        "a spare that was never needed exits gracefully: {spare:?}"
    );
    assert!(member.is_closed().await.unwrap());
    let e = nodes[done[1].0].next_rendezvous().await.unwrap_err();
    assert!(matches!(e, RendezvousError::Closed { .. }), "{e}");
}

#[tokio::test]
async fn a_timeout_names_who_joined_and_what_was_expected() {
    let store = MemoryStore::new();
    let t = Timing {
        join: Duration::from_millis(300),
        ..timing()
    };
    let nodes: Vec<_> = ["host-a", "host-b"]
        .iter()
        .map(|id| node(&store, id, 3, 3, t))
        .collect();
    for r in join_all(&nodes).await {
        let e = r.unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, RendezvousError::Timeout { .. }), "{msg}");
        assert!(
            msg.contains("host-a") && msg.contains("host-b") && msg.contains("2 joined"),
            "{msg}"
        );
        assert!(msg.contains("3..=3 nodes"), "{msg}");
    }
}

#[tokio::test]
async fn a_silently_dead_member_is_noticed_and_the_survivors_re_form() {
    let store = MemoryStore::new();
    let t = timing();
    let nodes: Vec<_> = ["a", "b", "c"]
        .iter()
        .map(|id| node(&store, id, 2, 3, t))
        .collect();
    let first: Vec<RendezvousInfo> = join_ok(&nodes).await;
    assert_eq!(first[0].world_size, 3);
    // "b" dies silently: its heartbeat stops, nobody is told.
    let mut nodes = nodes;
    let dead = nodes.remove(1);
    let died_at = Instant::now();
    drop(dead);
    // Survivors notice through the rendezvous once the keep-alive deadline,
    // interval * misses (0.3 s), has passed. The bound protects that they
    // notice at all (nobody tells them); 10 s of margin over the deadline
    // is for a loaded machine.
    let bound = t.keep_alive * t.max_misses + Duration::from_secs(10);
    let noticed = crate::noticed_within(&nodes, died_at, bound).await;
    let again: Vec<RendezvousInfo> = join_ok(&nodes).await;
    assert!(again.iter().all(|i| i.world_size == 2));
    assert!(is_permutation(&ranks(&again)));
    eprintln!(
        "dead member noticed after {noticed:?}; re-formed after {:?}",
        died_at.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundreds_of_nodes_each_with_its_own_connection() {
    const N: usize = 300;
    let server = rallypoint_store::server::Server::from_listener(
        std::net::TcpListener::bind("127.0.0.1:0").unwrap(),
        Default::default(),
    )
    .unwrap()
    .spawn();
    let port = server.local_addr().port();
    let mut nodes = Vec::new();
    for i in 0..N {
        let store = TcpStore::builder("127.0.0.1", port)
            .timeout(Duration::from_secs(30))
            .connect()
            .await
            .unwrap();
        nodes.push(Arc::new(DynamicRendezvous::new(
            Arc::new(store),
            "sim",
            format!("node{i}"),
            Bounds { min: N, max: N },
            Timing {
                keep_alive: Duration::from_secs(5),
                ..timing()
            },
            BootstrapStoreInfo {
                master_addr: "127.0.0.1".into(),
                master_port: port,
            },
        )));
    }
    let started = Instant::now();
    let infos: Vec<RendezvousInfo> = join_ok(&nodes).await;
    let took = started.elapsed();
    assert!(infos.iter().all(|i| i.world_size == N));
    let r = ranks(&infos);
    assert!(is_permutation(&r));
    // Natural order: node0..node299 in order of their numbers.
    assert_eq!(r, (0..N).collect::<Vec<_>>());
    eprintln!("{N} nodes through one round in {took:?}");
}

/// A c10d client tells a host that ended (nothing listens: refused) from one
/// that is up, so a node lingering after the exit barrier stops when the
/// host has gone instead of waiting out `lost_grace` (a two-node `rally run`
/// took 66 s when the host left first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_c10d_client_tells_a_host_that_ended_from_one_that_is_up() {
    use rallypoint_rendezvous::api::RendezvousParameters;
    use rallypoint_rendezvous::registry::Registry;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let registry = Arc::new(Registry::with_builtins());
    let make = |registry: Arc<Registry>| async move {
        let mut p =
            RendezvousParameters::new("c10d", &format!("127.0.0.1:{port}"), "ended", 2, 2).unwrap();
        p.config = RendezvousParameters::parse_conf("last_call_timeout=1,join_timeout=10").unwrap();
        registry.create_handler(p).await.unwrap()
    };
    // The first hosts the store (the port is free), the second is a client.
    let host = make(registry.clone()).await;
    let client = make(registry.clone()).await;
    assert!(host.hosts_store() && !client.hosts_store());
    assert!(
        !host.store_host_ended().await,
        "a host never says so of itself"
    );
    assert!(!client.store_host_ended().await, "the host is up");
    drop(host);
    let t0 = Instant::now();
    while !client.store_host_ended().await {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the ended host was never seen"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_c10d_backend_from_the_registry_hosts_its_store() {
    use rallypoint_rendezvous::api::RendezvousParameters;
    use rallypoint_rendezvous::registry::Registry;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let registry = Arc::new(Registry::with_builtins());
    let mut tasks = Vec::new();
    for _ in 0..2 {
        let registry = registry.clone();
        tasks.push(tokio::spawn(async move {
            let mut p =
                RendezvousParameters::new("c10d", &format!("127.0.0.1:{port}"), "job", 2, 2)
                    .unwrap();
            p.config =
                RendezvousParameters::parse_conf("last_call_timeout=1,join_timeout=10").unwrap();
            let h = registry.create_handler(p).await.unwrap();
            let info = h.next_rendezvous().await.unwrap();
            (h, info)
        }));
    }
    let mut got = Vec::new();
    for t in tasks {
        got.push(t.await.unwrap());
    }
    assert_eq!(got[0].0.backend(), "c10d");
    let mut r: Vec<usize> = got.iter().map(|(_, i)| i.rank).collect();
    r.sort();
    assert_eq!(r, [0, 1]);
    // The rendezvous state is on a real TCP store at the endpoint.
    let raw = TcpStore::builder("127.0.0.1", port)
        .connect()
        .await
        .unwrap();
    assert!(raw
        .check(&["rally.rendezvous.job/r0/complete"])
        .await
        .unwrap());
    assert!(got[0].0.shutdown().await.unwrap());
    assert!(got[1].0.is_closed().await.unwrap());
}

#[tokio::test]
async fn the_c10d_backend_runs_on_a_file_store_with_store_type_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rdzv");
    let registry = rallypoint_rendezvous::registry::Registry::with_builtins();
    let mut nodes = Vec::new();
    for _ in 0..2 {
        let mut p = rallypoint_rendezvous::RendezvousParameters::new(
            "c10d",
            path.to_str().unwrap(),
            "filejob",
            2,
            2,
        )
        .unwrap();
        p.local_addr = Some("127.0.0.1".into());
        p.config.insert("store_type".into(), "file".into());
        let h: Arc<dyn RendezvousHandler> = Arc::from(registry.create_handler(p).await.unwrap());
        nodes.push(h);
    }
    assert!(!nodes[0].use_agent_store());
    let tasks: Vec<_> = nodes
        .iter()
        .map(|n| {
            let n = n.clone();
            tokio::spawn(async move { n.next_rendezvous().await.unwrap() })
        })
        .collect();
    let mut infos = Vec::new();
    for t in tasks {
        infos.push(t.await.unwrap());
    }
    assert!(is_permutation(&ranks(&infos)));
    assert_eq!(infos[0].bootstrap, infos[1].bootstrap);
    assert_ne!(infos[0].bootstrap.master_port, 0);
    let mut bad = rallypoint_rendezvous::RendezvousParameters::new("c10d", "x", "j", 1, 1).unwrap();
    bad.config.insert("store_type".into(), "s3".into());
    let e = registry.create_handler(bad).await.err().unwrap();
    assert!(e.to_string().contains("store_type"), "{e}");
    // Stop the keep-alives before the directory (and the file) goes.
    for n in &nodes {
        assert!(n.shutdown().await.unwrap());
    }
}

/// What a node leaves behind when it stops between two steps of its join (a
/// signal, a crash), written straight into the store: it never goes further.
/// Whatever step it stopped at, the others form a round without it.
#[tokio::test]
async fn a_node_stopped_at_any_step_of_its_join_is_never_waited_for() {
    use rallypoint_store::PrefixStore;
    // (what it did before stopping, as (key, value) writes; "+" means ADD 1)
    let steps: Vec<(&str, Vec<(&str, &str)>)> = vec![
        ("took arrival 1, no id", vec![("r0/join", "+")]),
        (
            "arrival 1 with its id, never assigned ranks",
            vec![("r0/join", "+"), ("r0/node/1", "ghost")],
        ),
        (
            "took arrival 2 (the min-th), no id",
            vec![("r0/join", "+"), ("r0/join", "+")],
        ),
        (
            "arrival 2 (the min-th) with its id, never announced",
            vec![("r0/join", "+"), ("r0/join", "+"), ("r0/node/2", "ghost")],
        ),
    ];
    for (what, writes) in steps {
        let store = MemoryStore::new();
        let raw = PrefixStore::new("rally.rendezvous.run", Arc::new(store.clone()));
        raw.compare_set("round", b"", b"0").await.unwrap();
        // In the "arrival 2" cases arrival 1 is a node that left for good too.
        for (k, v) in writes {
            match v {
                "+" => {
                    raw.add(k, 1).await.unwrap();
                }
                v => raw.set(k, v.as_bytes()).await.unwrap(),
            }
        }
        let nodes = [
            node(&store, "a", 2, 3, timing()),
            node(&store, "b", 2, 3, timing()),
        ];
        let t0 = Instant::now();
        // Join until both are in one round of two: at most a re-form or two.
        loop {
            let infos = join_ok(&nodes).await;
            if infos.iter().all(|i| i.world_size == 2) {
                assert_eq!(infos[0].round, infos[1].round, "{what}");
                let mut r = ranks(&infos);
                r.sort_unstable();
                assert_eq!(r, [0, 1], "{what}");
                break;
            }
            // Formed with the phantom as a member: its missing heartbeats
            // make the others re-form.
            while nodes[0].num_nodes_waiting().await.unwrap() == 0 {
                assert!(
                    t0.elapsed() < Duration::from_secs(8),
                    "{what}: never noticed"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert!(t0.elapsed() < Duration::from_secs(8), "{what}");
        }
        // Far below the join timeout (10 s) that a phantom used to cost.
        assert!(
            t0.elapsed() < Duration::from_secs(8),
            "{what}: {:?}",
            t0.elapsed()
        );
    }
}

#[tokio::test]
async fn a_waiting_node_gives_up_at_the_join_timeout_naming_the_run() {
    let store = MemoryStore::new();
    let t = Timing {
        join: Duration::from_millis(1500),
        ..timing()
    };
    let first = node(&store, "a", 1, 3, t);
    join_ok(std::slice::from_ref(&first)).await;
    // a runs alone and never re-forms (its agent does not react); c, late, waits
    // for the group to grow, and gives up at its join timeout.
    let late = node(&store, "c", 1, 3, t);
    let t0 = Instant::now();
    let err = late.next_rendezvous().await.unwrap_err();
    assert!(matches!(err, RendezvousError::Timeout { .. }), "{err}");
    assert!(err.to_string().contains("\"run\""), "{err}");
    assert!(
        t0.elapsed() >= Duration::from_millis(1400),
        "{:?}",
        t0.elapsed()
    );
    drop(first);
}

/// Issue 18: a member blocks in `changed` (one store wait, no polling) and is
/// woken when a node arrives; arrival 1 counts each node into the census once,
/// however many rounds it is a member of.
#[tokio::test]
async fn a_member_is_woken_by_an_arrival_and_the_census_counts_each_node_once() {
    let store = MemoryStore::new();
    let members: Vec<_> = ["n1", "n2"]
        .iter()
        .map(|id| node(&store, id, 2, 3, timing()))
        .collect();
    join_ok(&members).await;
    assert_eq!(members[0].remaining().await.unwrap(), 1);
    let m = members[0].clone();
    let woken = tokio::spawn(async move { m.changed(0, Duration::from_secs(3600)).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!woken.is_finished(), "nothing happened: no wake");
    let late = node(&store, "n3", 2, 3, timing());
    let l = late.clone();
    let late_join = tokio::spawn(async move { l.next_rendezvous().await });
    let mark = tokio::time::timeout(Duration::from_secs(5), woken)
        .await
        .expect("the arrival woke the member")
        .unwrap()
        .unwrap();
    assert_eq!(mark, 1);
    assert_eq!(members[0].membership().await.unwrap().waiting, 1);
    let again = join_ok(&members).await;
    late_join.await.unwrap().unwrap();
    assert_eq!(again[0].world_size, 3);
    // n1, n2 counted at round 0, n3 at round 1: three nodes, not five.
    assert_eq!(members[0].remaining().await.unwrap(), 2);
    members[1].leave().await.unwrap();
    assert_eq!(members[0].remaining().await.unwrap(), 1);
}

/// A store a test can cut a node off from (every call fails) and reconnect.
struct Cuttable {
    inner: MemoryStore,
    cut: std::sync::atomic::AtomicBool,
}

impl Cuttable {
    fn check(&self) -> rallypoint_store::Result<()> {
        if self.cut.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(rallypoint_store::StoreError::Disconnected {
                op: "any",
                addr: "cut off (test)".into(),
                source: std::io::ErrorKind::ConnectionReset.into(),
            });
        }
        Ok(())
    }
}

#[async_trait::async_trait]
impl Store for Cuttable {
    async fn set(&self, key: &str, value: &[u8]) -> rallypoint_store::Result<()> {
        self.check()?;
        self.inner.set(key, value).await
    }
    async fn get_now(&self, key: &str) -> rallypoint_store::Result<Vec<u8>> {
        self.check()?;
        self.inner.get_now(key).await
    }
    async fn add(&self, key: &str, delta: i64) -> rallypoint_store::Result<i64> {
        self.check()?;
        self.inner.add(key, delta).await
    }
    async fn compare_set(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> rallypoint_store::Result<Vec<u8>> {
        self.check()?;
        self.inner.compare_set(key, expected, desired).await
    }
    async fn wait_timeout(&self, keys: &[&str], timeout: Duration) -> rallypoint_store::Result<()> {
        self.check()?;
        self.inner.wait_timeout(keys, timeout).await
    }
    async fn check(&self, keys: &[&str]) -> rallypoint_store::Result<bool> {
        self.check()?;
        self.inner.check(keys).await
    }
    async fn delete_key(&self, key: &str) -> rallypoint_store::Result<bool> {
        self.check()?;
        self.inner.delete_key(key).await
    }
    async fn num_keys(&self) -> rallypoint_store::Result<i64> {
        self.check()?;
        self.inner.num_keys().await
    }
    async fn multi_get(&self, keys: &[&str]) -> rallypoint_store::Result<Vec<Vec<u8>>> {
        self.check()?;
        self.inner.multi_get(keys).await
    }
    async fn multi_set(&self, pairs: &[(&str, &[u8])]) -> rallypoint_store::Result<()> {
        self.check()?;
        self.inner.multi_set(pairs).await
    }
    async fn append(&self, key: &str, value: &[u8]) -> rallypoint_store::Result<()> {
        self.check()?;
        self.inner.append(key, value).await
    }
    async fn list_keys(&self) -> rallypoint_store::Result<Vec<String>> {
        self.check()?;
        self.inner.list_keys().await
    }
    async fn queue_push(&self, key: &str, value: &[u8]) -> rallypoint_store::Result<()> {
        self.check()?;
        self.inner.queue_push(key, value).await
    }
    async fn queue_pop(&self, key: &str, block: bool) -> rallypoint_store::Result<Vec<u8>> {
        self.check()?;
        self.inner.queue_pop(key, block).await
    }
    async fn queue_len(&self, key: &str) -> rallypoint_store::Result<i64> {
        self.check()?;
        self.inner.queue_len(key).await
    }
    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }
    fn set_timeout(&self, timeout: Duration) {
        self.inner.set_timeout(timeout)
    }
}

/// Polls `a.remaining()` until it is `want` (within 10 s, far above the
/// keep-alive expiry of 0.4 s); panics with `what` otherwise.
async fn remaining_becomes(a: &DynamicRendezvous, want: usize, what: &str) {
    let t0 = Instant::now();
    loop {
        let n = a.remaining().await.unwrap();
        if n == want {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{what}: {n} remaining, not {want}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A node cut off from the store for a keep-alive expiry is found dead and
/// counted out; when its beats reach the store again it counts itself back
/// in, and as it leaves it is counted out once. Before, it stayed counted
/// out while it ran on, and its leave counted it out a second time: a host
/// lingering on the census could take its store down under a running node
/// (found by the agent simulator once partitions looked like deaths to the
/// watchers, as they do here).
#[tokio::test]
async fn a_node_found_dead_while_cut_off_is_counted_back_in_and_out_once() {
    let store = MemoryStore::new();
    let cuttable = Arc::new(Cuttable {
        inner: store.clone(),
        cut: Default::default(),
    });
    let a = node(&store, "a", 3, 3, timing());
    let c = node(&store, "c", 3, 3, timing());
    let b = Arc::new(DynamicRendezvous::new(
        cuttable.clone(),
        "run",
        "b".to_owned(),
        Bounds { min: 3, max: 3 },
        timing(),
        BootstrapStoreInfo {
            master_addr: "127.0.0.1".into(),
            master_port: 1,
        },
    ));
    join_ok(&[a.clone(), b.clone(), c.clone()]).await;
    // From a's view: b and c run (c keeps a's count above 0, which it
    // never goes below, so that a count too low shows).
    remaining_becomes(&a, 2, "all in").await;
    cuttable
        .cut
        .store(true, std::sync::atomic::Ordering::Relaxed);
    remaining_becomes(&a, 1, "b found dead while cut off").await;
    cuttable
        .cut
        .store(false, std::sync::atomic::Ordering::Relaxed);
    remaining_becomes(&a, 2, "b back: counted in again").await;
    b.leave().await.unwrap();
    assert_eq!(a.remaining().await.unwrap(), 1, "b counted out once");
    // A second leave changes nothing.
    b.leave().await.unwrap();
    assert_eq!(a.remaining().await.unwrap(), 1, "b counted out once");
}
