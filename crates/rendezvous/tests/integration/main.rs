//! Integration tests of rendezvous: URL init and the static backend, over real
//! stores.

mod dynamic;
#[cfg(feature = "etcd")]
mod etcd;

/// Roles: a test starts copies of this binary as child processes, with an
/// environment variable naming the role; such a process runs it here, before
/// the test harness starts, and exits (no role is a test, so none is ever
/// counted as one). A role that panics exits 101, as a failed test does.
#[cfg(feature = "etcd")]
#[ctor::ctor(unsafe)]
fn role() {
    if std::env::var_os(etcd::ROLE_ETCD).is_none() {
        return;
    }
    let code = match std::panic::catch_unwind(etcd::member) {
        Ok(()) => 0,
        Err(_) => 101,
    };
    std::process::exit(code);
}

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use rallypoint_rendezvous::api::{RendezvousError, RendezvousHandler, RendezvousParameters};
use rallypoint_rendezvous::init::{
    rendezvous, InitArgs, InitError, Rendezvoused, SchemeFuture, Schemes,
};
use rallypoint_rendezvous::registry::{Created, Registry};
use rallypoint_store::{MemoryStore, Store};

/// Polls `nodes` until one reports nodes waiting (the group should re-form);
/// fails if that takes `bound` from `since`. Returns the time it took.
async fn noticed_within<H: RendezvousHandler + ?Sized>(
    nodes: &[Arc<H>],
    since: std::time::Instant,
    bound: Duration,
) -> Duration {
    loop {
        for n in nodes {
            if n.num_nodes_waiting().await.unwrap() > 0 {
                return since.elapsed();
            }
        }
        assert!(
            since.elapsed() < bound,
            "the dead member was not noticed within {bound:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn args() -> InitArgs {
    InitArgs {
        timeout: Duration::from_secs(10),
        ..InitArgs::default()
    }
}

/// Starts rank `rank`'s rendezvous.
fn start_rank(
    rank: usize,
    url: &impl Fn(usize) -> (String, InitArgs),
) -> tokio::task::JoinHandle<Result<Rendezvoused, InitError>> {
    let (u, a) = url(rank);
    tokio::spawn(async move { rendezvous(&u, a).unwrap().next().await })
}

/// Runs `n` ranks' rendezvous concurrently and checks they share one store.
async fn all_ranks(n: usize, url: impl Fn(usize) -> (String, InitArgs)) -> Vec<Rendezvoused> {
    let tasks = (0..n).map(|rank| start_rank(rank, &url)).collect();
    shared(n, tasks).await
}

/// Runs rank 0's rendezvous alone until something listens at `port`, then
/// the other ranks': rank 0 is then, provably, the one that hosts the store
/// (nothing else that could listen there is running). Rank 0 cannot finish
/// alone: as the store's master it waits for the other `n - 1`.
async fn rank_zero_hosts(
    n: usize,
    port: u16,
    url: impl Fn(usize) -> (String, InitArgs),
) -> Vec<Rendezvoused> {
    let zero = start_rank(0, &url);
    let t0 = std::time::Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(!zero.is_finished(), "rank 0 ended alone, never listening");
        // Expected within milliseconds; 10 s is the rendezvous timeout.
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "rank 0, alone, never listened at port {port}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(
        !zero.is_finished(),
        "rank 0 finished before the others came"
    );
    let mut tasks = vec![zero];
    tasks.extend((1..n).map(|rank| start_rank(rank, &url)));
    shared(n, tasks).await
}

/// The ranks' results, checked to share one store, sorted by rank.
async fn shared(
    n: usize,
    tasks: Vec<tokio::task::JoinHandle<Result<Rendezvoused, InitError>>>,
) -> Vec<Rendezvoused> {
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap().unwrap());
    }
    for r in &out {
        r.store
            .set(&format!("hello/{}", r.rank), b"hi")
            .await
            .unwrap();
    }
    for r in &out {
        assert_eq!(r.world_size, n);
        for other in 0..n {
            assert_eq!(r.store.get(&format!("hello/{other}")).await.unwrap(), b"hi");
        }
    }
    out.sort_by_key(|r| r.rank);
    assert_eq!(
        out.iter().map(|r| r.rank).collect::<Vec<_>>(),
        (0..n).collect::<Vec<_>>()
    );
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_urls_share_one_file_store() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    all_ranks(3, |rank| {
        (
            format!("file://{}?rank={rank}&world_size=3", path.display()),
            args(),
        )
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_urls_have_rank_zero_host_the_store() {
    let port = free_port();
    let out = rank_zero_hosts(3, port, |rank| {
        (
            format!("tcp://127.0.0.1:{port}?rank={rank}&world_size=3"),
            args(),
        )
    })
    .await;
    // Rank and size may come from the arguments instead of the query.
    drop(out);
    let port = free_port();
    rank_zero_hosts(2, port, |rank| {
        let a = InitArgs {
            rank: Some(rank),
            world_size: Some(2),
            ..args()
        };
        (format!("tcp://127.0.0.1:{port}"), a)
    })
    .await;
}

fn env_of(rank: usize, port: u16, agent_store: bool) -> InitArgs {
    let mut env: BTreeMap<String, String> = [
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", "2".to_string()),
        ("MASTER_ADDR", "127.0.0.1".to_string()),
        ("MASTER_PORT", port.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    if agent_store {
        env.insert("TORCHELASTIC_USE_AGENT_STORE".into(), "True".into());
    }
    InitArgs {
        env: Some(env),
        ..args()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn env_urls_read_the_torchrun_variables() {
    // Rank 0 hosts.
    let port = free_port();
    all_ranks(2, |rank| ("env://".into(), env_of(rank, port, false))).await;
    // Agent-store mode: every rank is a client of a store somebody else hosts.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = rallypoint_store::server::Server::from_listener(listener, Default::default())
        .unwrap()
        .spawn();
    all_ranks(2, |rank| ("env://".into(), env_of(rank, port, true))).await;
    assert_eq!(
        server.stats().accepted,
        2,
        "no rank started a server of its own"
    );
}

/// The error a URL rendezvous ends with.
async fn init_error(url: &str, args: InitArgs) -> String {
    match rendezvous(url, args) {
        Err(e) => e.to_string(),
        Ok(mut r) => r
            .next()
            .await
            .err()
            .expect("the rendezvous should fail")
            .to_string(),
    }
}

#[tokio::test]
async fn url_errors_name_what_is_wrong() {
    let mut a = args();
    let e = init_error("tcp://127.0.0.1:1?world_size=2", a.clone()).await;
    assert!(e.contains("rank parameter"), "{e}");
    let e = init_error("file:///tmp/x?rank=0", a.clone()).await;
    assert!(e.contains("world_size parameter"), "{e}");
    let e = init_error("tcp://127.0.0.1?rank=0&world_size=1", a.clone()).await;
    assert!(e.contains("port"), "{e}");
    let e = init_error("tcp://127.0.0.1:70000?rank=0&world_size=1", a.clone()).await;
    assert!(e.contains("70000"), "{e}");
    let e = init_error("tcp://127.0.0.1:1?rank=5&world_size=2", a.clone()).await;
    assert!(e.contains("rank") && e.contains("0..2"), "{e}");
    a.rank = Some(1);
    let e = init_error("tcp://127.0.0.1:1?rank=0&world_size=2", a.clone()).await;
    assert!(e.contains("rank is given both"), "{e}");
    let mut env = env_of(0, 1, false);
    env.env.as_mut().unwrap().remove("MASTER_ADDR");
    let e = init_error("env://", env).await;
    assert!(e.contains("environment variable MASTER_ADDR"), "{e}");
    let e = init_error("nccl://x", args()).await;
    assert!(e.contains("nccl://") && e.contains("tcp://"), "{e}");
}

fn memory_scheme(_url: rallypoint_rendezvous::init::Url, args: InitArgs) -> SchemeFuture {
    Box::pin(async move {
        Ok(Rendezvoused {
            store: Arc::new(MemoryStore::new()),
            rank: args.rank.unwrap_or(0),
            world_size: args.world_size.unwrap_or(1),
        })
    })
}

#[tokio::test]
async fn schemes_are_registrable_once_and_one_shot() {
    let schemes = Schemes::default();
    schemes.register("mem", memory_scheme).unwrap();
    let e = schemes.register("mem", memory_scheme).unwrap_err();
    assert!(e.to_string().contains("already registered"), "{e}");
    assert!(
        schemes.register("tcp", memory_scheme).is_err(),
        "built-ins cannot be replaced"
    );
    let mut r = schemes.rendezvous("mem://anything", args()).unwrap();
    let got = r.next().await.unwrap();
    assert_eq!((got.rank, got.world_size), (0, 1));
    let e = r.next().await.err().unwrap();
    assert!(matches!(e, InitError::Exhausted(_)));
    assert!(e.to_string().contains("cannot re-rendezvous"), "{e}");
}

fn static_params(port: u16, rank: usize, nodes: usize) -> RendezvousParameters {
    let mut p = RendezvousParameters::new(
        "static",
        &format!("127.0.0.1:{port}"),
        "job-1",
        nodes,
        nodes,
    )
    .unwrap();
    p.config.insert("rank".into(), rank.to_string());
    p.config.insert("timeout".into(), "10".into());
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn static_backend_forms_a_fixed_group_with_rank_zero_hosting() {
    let registry = Arc::new(Registry::with_builtins());
    let port = free_port();
    let start = |rank: usize| {
        let registry = registry.clone();
        tokio::spawn(async move {
            let h = registry
                .create_handler(static_params(port, rank, 3))
                .await
                .unwrap();
            let info = h.next_rendezvous().await.unwrap();
            (h, info)
        })
    };
    // Rank 0 alone until the store's port listens: rank 0 is then provably
    // the one that hosts it (it cannot finish alone: the group is 3 nodes).
    let zero = start(0);
    let t0 = std::time::Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(!zero.is_finished(), "rank 0 ended alone, never listening");
        // Expected within milliseconds; 10 s is the rendezvous timeout.
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "rank 0, alone, never listened at port {port}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut tasks = vec![zero];
    tasks.extend((1..3).map(start));
    let mut nodes = Vec::new();
    for t in tasks {
        nodes.push(t.await.unwrap());
    }
    for (h, info) in &nodes {
        assert_eq!(info.world_size, 3);
        assert_eq!(h.backend(), "static");
        assert_eq!(h.run_id(), "job-1");
        assert_eq!(info.bootstrap.master_port, port);
        assert!(!h.is_closed().await.unwrap());
        assert_eq!(h.num_nodes_waiting().await.unwrap(), 0);
        info.store
            .set(&format!("n{}", info.rank), b"x")
            .await
            .unwrap();
    }
    let mut ranks: Vec<usize> = nodes.iter().map(|(_, i)| i.rank).collect();
    ranks.sort();
    assert_eq!(ranks, [0, 1, 2]);
    // SETs have no reply: a read on each node's own connection orders them first.
    for (_, info) in &nodes {
        info.store.get(&format!("n{}", info.rank)).await.unwrap();
    }
    // The keys live under the run id, PyTorch's layout, on one shared store.
    let raw = rallypoint_store::TcpStore::builder("127.0.0.1", port)
        .connect()
        .await
        .unwrap();
    assert!(raw
        .check(&["job-1/n0", "job-1/n1", "job-1/n2"])
        .await
        .unwrap());
    // A second round returns the same group.
    let again = nodes[1].0.next_rendezvous().await.unwrap();
    assert_eq!(again.rank, nodes[1].1.rank);
}

#[tokio::test]
async fn static_backend_rejects_bad_parameters_by_name() {
    let registry = Registry::with_builtins();
    let mut p = static_params(1, 0, 2);
    p.config.remove("rank");
    let e = registry.create_handler(p).await.err().unwrap().to_string();
    assert!(e.contains("\"rank\""), "{e}");
    let mut p = static_params(1, 0, 2);
    p.endpoint = "127.0.0.1".into();
    let e = registry.create_handler(p).await.err().unwrap().to_string();
    assert!(e.contains("needs a port"), "{e}");
    let e = registry
        .create_handler(static_params(1, 2, 2))
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("0..2"), "{e}");
}

#[tokio::test]
async fn a_lone_static_host_times_out_saying_how_many_came() {
    let registry = Registry::with_builtins();
    let mut p = static_params(free_port(), 0, 3);
    p.config.insert("timeout".into(), "0.3".into());
    let h = registry.create_handler(p).await.unwrap();
    let e = h.next_rendezvous().await.unwrap_err();
    assert!(matches!(e, RendezvousError::Timeout { .. }), "{e}");
    assert!(
        e.to_string().contains("1 node(s)") && e.to_string().contains("3 nodes"),
        "{e}"
    );
}

fn fake(_: RendezvousParameters) -> Created {
    Box::pin(async { rallypoint_rendezvous::static_tcp::create(static_params(1, 0, 1)).await })
}

#[tokio::test]
async fn the_registry_rejects_duplicates_and_mismatches() {
    let r = Registry::with_builtins();
    r.register("static", rallypoint_rendezvous::static_tcp::create)
        .unwrap();
    let e = r.register("static", fake).unwrap_err();
    assert!(e.to_string().contains("different creator"), "{e}");
    r.register("liar", fake).unwrap();
    let mut p = static_params(1, 0, 1);
    p.backend = "liar".into();
    let e = r.create_handler(p).await.err().unwrap().to_string();
    assert!(e.contains("\"liar\"") && e.contains("\"static\""), "{e}");
    let mut p = static_params(1, 0, 1);
    p.backend = "nope".into();
    let e = r.create_handler(p).await.err().unwrap().to_string();
    assert!(e.contains("no rendezvous backend named \"nope\""), "{e}");
}
