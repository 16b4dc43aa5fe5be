//! The manager against a real lighthouse (`rally lighthouse`'s service,
//! in-process on loopback), with workers speaking the JSON-lines protocol
//! over their own TCP connections: a healthy round of two groups; a group
//! whose worker connection ends is dropped from the next quorum at once and
//! its quorum's watchers are told; a replica id held by a live group is
//! refused naming it; a lighthouse that is not there, or restarted;
//! should_commit's AND and its timeout; healing fields.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use rallypoint_auth::JobSecret;
use rallypoint_ft::{Config, Manager};
use rallypoint_lighthouse::quorum::Knobs;
use rallypoint_lighthouse::service::{Config as LhConfig, Server};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::oneshot;

/// Every wait of these tests; far above what any step needs.
const LIMIT: Duration = Duration::from_secs(30);

struct Lh {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

/// The manager's and the lighthouse's logs in the test's output, filtered
/// by `RUST_LOG` (none without it); once per test binary.
fn logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

impl Lh {
    async fn start_at(addr: SocketAddr, min_replicas: u64, heartbeat_timeout: Duration) -> Lh {
        Lh::start_with(addr, min_replicas, heartbeat_timeout, None).await
    }

    async fn start_with(
        addr: SocketAddr,
        min_replicas: u64,
        heartbeat_timeout: Duration,
        secret: Option<JobSecret>,
    ) -> Lh {
        let knobs = Knobs {
            min_replicas,
            join_timeout: Duration::from_secs(60),
            quorum_tick: Duration::from_millis(50),
            heartbeat_timeout,
        };
        Lh::start_knobs(addr, knobs, secret).await
    }

    async fn start_knobs(addr: SocketAddr, knobs: Knobs, secret: Option<JobSecret>) -> Lh {
        logs();
        let mut config = LhConfig::new(knobs);
        config.secret = secret;
        let server = Server::bind(addr, config).await.unwrap();
        let addr = server.local_addr().unwrap();
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(server.run(async move {
            let _ = rx.await;
        }));
        Lh {
            addr,
            stop: Some(tx),
            task,
        }
    }

    async fn start(min_replicas: u64) -> Lh {
        let any = "127.0.0.1:0".parse().unwrap();
        Lh::start_at(any, min_replicas, Duration::from_secs(5)).await
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    async fn stop(mut self) {
        self.stop.take().unwrap().send(()).unwrap();
        self.task.await.unwrap().unwrap();
    }
}

async fn manager(id: &str, lh: &str, w: usize) -> Manager {
    let mut c = Config::new(id, lh, w);
    c.bind = "127.0.0.1:0".parse().unwrap();
    c.connect_timeout = Duration::from_secs(10);
    Manager::start(c).await.unwrap()
}

/// A worker process's connection.
struct Worker {
    rd: BufReader<tokio::net::tcp::OwnedReadHalf>,
    wr: tokio::net::tcp::OwnedWriteHalf,
}

impl Worker {
    async fn connect(m: &Manager) -> Worker {
        Worker::connect_with(m, None).await.unwrap()
    }

    /// Connects, proving `secret` first if given.
    async fn connect_with(
        m: &Manager,
        secret: Option<&JobSecret>,
    ) -> Result<Worker, rallypoint_auth::ClientError> {
        let mut s = TcpStream::connect(m.address()).await.unwrap();
        if let Some(secret) = secret {
            let server = s.peer_addr().unwrap();
            let deadline = Instant::now() + LIMIT;
            let service = rallypoint_ft::server::SERVICE;
            rallypoint_auth::io::tokio::client_handshake(&mut s, server, secret, service, deadline)
                .await?;
        }
        let (rd, wr) = s.into_split();
        Ok(Worker {
            rd: BufReader::new(rd),
            wr,
        })
    }

    /// Connects and says hello as `rank` of `w`.
    async fn hello(m: &Manager, rank: u64, w: u64) -> Worker {
        let mut c = Worker::connect(m).await;
        let a = c
            .call(json!({"op": "hello", "group_rank": rank, "group_world_size": w, "pid": 1}))
            .await;
        assert_eq!(a["ok"], true, "{a}");
        assert_eq!(a["store_address"], m.store_address());
        c
    }

    async fn send_raw(&mut self, bytes: &[u8]) {
        self.wr.write_all(bytes).await.unwrap();
    }

    async fn answer(&mut self) -> Value {
        let mut line = String::new();
        let n = tokio::time::timeout(LIMIT, self.rd.read_line(&mut line))
            .await
            .expect("an answer within the limit")
            .unwrap();
        assert!(n > 0, "the manager closed the connection without an answer");
        serde_json::from_str(&line).unwrap()
    }

    async fn call(&mut self, req: Value) -> Value {
        let mut line = req.to_string();
        line.push('\n');
        self.send_raw(line.as_bytes()).await;
        self.answer().await
    }

    async fn quorum(&mut self, step: i64, metadata: &str, timeout_ms: u64) -> Value {
        self.call(json!({"op": "quorum", "step": step, "metadata": metadata,
            "init_sync": true, "timeout_ms": timeout_ms}))
            .await
    }

    /// A quorum call from a state committed in quorum `line`.
    async fn quorum_in(&mut self, step: i64, metadata: &str, line: i64) -> Value {
        self.call(json!({"op": "quorum", "step": step, "metadata": metadata,
            "init_sync": true, "timeout_ms": LIMIT.as_millis() as u64, "line": line}))
            .await
    }

    async fn vote(&mut self, step: i64, vote: bool, timeout_ms: u64) -> Value {
        self.call(
            json!({"op": "should_commit", "step": step, "vote": vote, "timeout_ms": timeout_ms}),
        )
        .await
    }

    /// Waits for the manager to close the connection.
    async fn closed(&mut self) {
        let mut rest = Vec::new();
        tokio::time::timeout(LIMIT, self.rd.read_to_end(&mut rest))
            .await
            .expect("closed within the limit")
            .unwrap();
    }
}

/// Every worker of `groups` calls quorum at `steps[g]` at once; the answers
/// by group then rank.
async fn quorum_all(groups: &mut [Vec<Worker>], steps: &[i64]) -> Vec<Vec<Value>> {
    let sizes: Vec<usize> = groups.iter().map(Vec::len).collect();
    let mut calls = Vec::new();
    for (g, ws) in groups.iter_mut().enumerate() {
        let step = steps[g];
        for (r, w) in ws.iter_mut().enumerate() {
            calls.push(async move {
                w.quorum(step, &format!("g{g}r{r}:1"), LIMIT.as_millis() as u64)
                    .await
            });
        }
    }
    let mut flat = futures_join(calls).await.into_iter();
    sizes
        .iter()
        .map(|&n| flat.by_ref().take(n).collect())
        .collect()
}

/// Runs futures concurrently; their outputs in order.
async fn futures_join<F: std::future::Future<Output = Value>>(fs: Vec<F>) -> Vec<Value> {
    let mut pinned: Vec<_> = fs.into_iter().map(Box::pin).collect();
    let mut out: Vec<Option<Value>> = vec![None; pinned.len()];
    std::future::poll_fn(|cx| {
        let mut done = true;
        for (i, f) in pinned.iter_mut().enumerate() {
            if out[i].is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => out[i] = Some(v),
                    std::task::Poll::Pending => done = false,
                }
            }
        }
        if done {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
    out.into_iter().map(Option::unwrap).collect()
}

/// `quorum_all` with two groups of every worker: the answers, all ok.
async fn ok_quorums(groups: &mut [Vec<Worker>], steps: &[i64]) -> Vec<Vec<Value>> {
    let a = Box::pin(quorum_all(groups, steps)).await;
    for g in &a {
        for r in g {
            assert_eq!(r["ok"], true, "{r}");
        }
    }
    a
}

/// Polls the lighthouse's `/status` until `ok` holds (or the limit).
async fn wait_status(addr: SocketAddr, ok: impl Fn(&Value) -> bool) {
    let deadline = tokio::time::Instant::now() + LIMIT;
    loop {
        let (_, s) = http_get(addr, "/status".into()).await;
        if ok(&s) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the lighthouse's status never got there: {s}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn http_get(addr: SocketAddr, path: String) -> (u16, Value) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let req = format!("GET {path} HTTP/1.1\r\nHost: lh\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = String::new();
    tokio::time::timeout(LIMIT, s.read_to_string(&mut out))
        .await
        .expect("an HTTP answer within the limit")
        .unwrap();
    let status = out[9..12].parse().unwrap();
    let body = out.split_once("\r\n\r\n").map_or("", |p| p.1);
    let v = serde_json::from_str(body).unwrap_or(Value::Null);
    (status, v)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_healthy_round_of_two_groups_of_two() {
    let lh = Lh::start(2).await;
    let (m0, m1) = (
        manager("g0", &lh.url(), 2).await,
        manager("g1", &lh.url(), 2).await,
    );
    let mut groups = vec![
        vec![
            Worker::hello(&m0, 0, 2).await,
            Worker::hello(&m0, 1, 2).await,
        ],
        vec![
            Worker::hello(&m1, 0, 2).await,
            Worker::hello(&m1, 1, 2).await,
        ],
    ];
    let a = ok_quorums(&mut groups, &[0, 0]).await;
    let q = |g: usize, r: usize| &a[g][r]["quorum"];
    let id = q(0, 0)["quorum_id"].clone();
    for (g, r) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
        assert_eq!(q(g, r)["quorum_id"], id, "one quorum id");
        assert_eq!(q(g, r)["replica_ids"], json!(["g0", "g1"]));
        assert_eq!(q(g, r)["replica_rank"], g);
        assert_eq!(q(g, r)["replica_id"], format!("g{g}"));
        assert_eq!(q(g, r)["replica_world_size"], 2);
        assert_eq!(q(g, r)["max_step"], 0);
        // Group rank r's store: max_participants[r % 2]'s.
        let store = if r == 0 {
            m0.store_address()
        } else {
            m1.store_address()
        };
        assert_eq!(q(g, r)["store_address"], store);
    }
    // init_sync at step 0: group rank r's primary is group r % 2; the other
    // heals from it, reading the source's metadata for rank r.
    assert_eq!(q(0, 0)["heal"], false);
    assert_eq!(q(1, 0)["heal"], true);
    assert_eq!(q(1, 0)["recover_src_metadata"], "g0r0:1");
    assert_eq!(q(0, 0)["recover_dst_replica_ranks"], json!([1]));
    assert_eq!(q(0, 1)["heal"], true);
    assert_eq!(q(0, 1)["recover_src_metadata"], "g1r1:1");

    let mut votes = Vec::new();
    for ws in groups.iter_mut() {
        let [w0, w1] = &mut ws[..] else { panic!() };
        let (a, b) = tokio::join!(w0.vote(0, true, 10_000), w1.vote(0, true, 10_000));
        votes.extend([a, b]);
    }
    for v in votes {
        assert_eq!(v, json!({"ok": true, "commit": true}));
    }
    let s = m0.status().borrow().clone();
    assert_eq!(s.quorum_id, id.as_i64());
    assert_eq!(s.members, ["g0", "g1"]);
    assert_eq!(s.commits, 1);
    assert!(s.connected);
    m0.shutdown().await;
    m1.shutdown().await;
    lh.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_whose_worker_connection_ends_is_dropped_at_once() {
    // A heartbeat timeout of a minute: only the dropped connection can
    // explain a drop within the test's limit.
    let lh = Lh::start_at("127.0.0.1:0".parse().unwrap(), 1, Duration::from_secs(60)).await;
    let (m0, m1) = (
        manager("g0", &lh.url(), 2).await,
        manager("g1", &lh.url(), 2).await,
    );
    let mut events = m0.events();
    let mut groups = vec![
        vec![
            Worker::hello(&m0, 0, 2).await,
            Worker::hello(&m0, 1, 2).await,
        ],
        vec![
            Worker::hello(&m1, 0, 2).await,
            Worker::hello(&m1, 1, 2).await,
        ],
    ];
    let a = ok_quorums(&mut groups, &[1, 1]).await;
    let id = a[0][0]["quorum"]["quorum_id"].as_i64().unwrap();
    assert_eq!(a[0][0]["quorum"]["replica_ids"], json!(["g0", "g1"]));

    // Both of g1's ranks call: g1 waits at the lighthouse (g0 does not
    // call); then rank 1's connection ends.
    let path = format!("/v1/watch?quorum_id={id}&timeout_ms={}", LIMIT.as_millis());
    let watcher = tokio::spawn(http_get(lh.addr, path));
    let mut g1 = groups.pop().unwrap();
    let mut survivor = g1.remove(0);
    let waiting = tokio::spawn(async move { survivor.quorum(2, "g1r0:1", 20_000).await });
    let mut dying = g1.remove(0);
    dying
        .send_raw(b"{\"op\":\"quorum\",\"step\":2,\"metadata\":\"g1r1:1\"}\n")
        .await;
    wait_status(lh.addr, |s| s["waiting"] == json!(["g1"])).await;
    drop(dying);
    let (code, v) = watcher.await.unwrap();
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["event"], "dropped", "{v}");
    assert_eq!(v["replica_id"], "g1", "{v}");
    let failed = waiting.await.unwrap();
    assert_eq!(failed["ok"], false);
    let e = failed["error"].as_str().unwrap();
    assert!(
        e.contains("group rank 1's connection to the manager ended"),
        "{e}"
    );

    // g0's next quorum is g0 alone, within a deadline far under the
    // heartbeat timeout.
    let a = ok_quorums(&mut groups, &[2]).await;
    let next = &a[0][0]["quorum"];
    assert_eq!(next["replica_ids"], json!(["g0"]));
    assert!(next["quorum_id"].as_i64().unwrap() > id);
    let mut seen = Vec::new();
    while let Ok(e) = events.try_recv() {
        seen.push(e);
    }
    assert!(
        seen.contains(&rallypoint_ft::FtEvent::Dropped {
            replica: "g1".into()
        }),
        "{seen:?}"
    );
    assert_eq!(m0.status().borrow().drops, 1);
    m0.shutdown().await;
    m1.shutdown().await;
    lh.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_id_held_by_a_live_group_is_refused_naming_it() {
    let lh = Lh::start(1).await;
    let first = manager("same", &lh.url(), 1).await;
    let mut w = Worker::hello(&first, 0, 1).await;
    let a = w.quorum(0, "a:1", LIMIT.as_millis() as u64).await;
    assert_eq!(a["ok"], true, "{a}");

    let second = manager("same", &lh.url(), 1).await;
    let mut w2 = Worker::hello(&second, 0, 1).await;
    let a = w2.quorum(0, "b:1", LIMIT.as_millis() as u64).await;
    assert_eq!(a["ok"], false, "{a}");
    let e = a["error"].as_str().unwrap();
    assert!(e.contains("\"same\"") && e.contains("refused"), "{e}");
    assert!(e.contains(&lh.url()), "names the lighthouse: {e}");
    // The holder goes on.
    let a = w.quorum(1, "a:1", LIMIT.as_millis() as u64).await;
    assert_eq!(a["ok"], true, "{a}");
    first.shutdown().await;
    second.shutdown().await;
    lh.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lighthouse_that_is_not_there_is_named_after_the_connect_timeout() {
    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = free.local_addr().unwrap();
    drop(free);
    let mut c = Config::new("g0", &format!("http://{addr}"), 1);
    c.bind = "127.0.0.1:0".parse().unwrap();
    c.connect_timeout = Duration::from_secs(1);
    let m = Manager::start(c).await.unwrap();
    let mut status = m.status();
    let mut w = Worker::hello(&m, 0, 1).await;
    let a = w.quorum(0, "a:1", LIMIT.as_millis() as u64).await;
    assert_eq!(a["ok"], false, "{a}");
    let e = a["error"].as_str().unwrap();
    assert!(
        e.contains(&format!(
            "could not reach the lighthouse at http://{addr} within 1s"
        )),
        "{e}"
    );
    let s = tokio::time::timeout(LIMIT, status.wait_for(|s| s.last_error.is_some()))
        .await
        .unwrap()
        .unwrap()
        .clone();
    assert!(!s.connected);
    assert!(s.last_error.unwrap().contains(&addr.to_string()));
    m.shutdown().await;
}

/// The lighthouse's `/status`.
async fn lh_status(addr: SocketAddr) -> Value {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /status HTTP/1.1\r\nHost: lh\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut out = String::new();
    tokio::time::timeout(LIMIT, s.read_to_string(&mut out))
        .await
        .expect("an HTTP answer within the limit")
        .unwrap();
    let body = out.split_once("\r\n\r\n").map_or("", |p| p.1);
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {out}"))
}

/// The lighthouse restarts on its address: the manager dials it again, and
/// since it remembers its last quorum (of itself), the new lighthouse
/// issues its first quorum without its startup grace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_lighthouse_is_reconnected() {
    let lh = Lh::start(1).await;
    let addr = lh.addr;
    let m = manager("g0", &lh.url(), 1).await;
    let mut status = m.status();
    let mut w = Worker::hello(&m, 0, 1).await;
    let a = w.quorum(0, "a:1", LIMIT.as_millis() as u64).await;
    assert_eq!(a["ok"], true, "{a}");
    tokio::time::timeout(LIMIT, status.wait_for(|s| s.connected))
        .await
        .unwrap()
        .unwrap();
    lh.stop().await;
    tokio::time::timeout(LIMIT, status.wait_for(|s| !s.connected))
        .await
        .expect("the lost lighthouse is noticed")
        .unwrap();

    let lh = Lh::start_at(addr, 1, Duration::from_secs(5)).await;
    tokio::time::timeout(LIMIT, status.wait_for(|s| s.connected))
        .await
        .expect("reconnected")
        .unwrap();
    let a = w.quorum(1, "a:1", LIMIT.as_millis() as u64).await;
    assert_eq!(a["ok"], true, "{a}");
    assert_eq!(a["quorum"]["replica_ids"], json!(["g0"]));
    let s = lh_status(lh.addr).await;
    assert_eq!(s["counters"]["recalled"], 1, "{s}");
    m.shutdown().await;
    lh.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn should_commit_is_the_and_of_the_ranks_and_its_timeout_names_who_never_voted() {
    let lh = Lh::start(1).await;
    let m = manager("g0", &lh.url(), 3).await;
    let mut ws = Vec::new();
    for r in 0..3 {
        ws.push(Worker::hello(&m, r, 3).await);
    }
    let [a, b, c] = &mut ws[..] else { panic!() };
    let (x, y, z) = tokio::join!(
        a.vote(4, true, 10_000),
        b.vote(4, false, 10_000),
        c.vote(4, true, 10_000)
    );
    for v in [x, y, z] {
        assert_eq!(v, json!({"ok": true, "commit": false}));
    }
    let (x, y, z) = tokio::join!(
        a.vote(5, true, 10_000),
        b.vote(5, true, 10_000),
        c.vote(5, true, 10_000)
    );
    for v in [x, y, z] {
        assert_eq!(v, json!({"ok": true, "commit": true}));
    }
    let v = b.vote(6, true, 300).await;
    assert_eq!(v["ok"], false);
    let e = v["error"].as_str().unwrap();
    assert!(e.contains("group ranks [0, 2] never voted"), "{e}");
    assert_eq!(m.status().borrow().commits, 1);
    m.shutdown().await;
    lh.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_at_step_zero_heals_from_the_groups_at_step_five() {
    let lh = Lh::start(3).await;
    let mut ms = Vec::new();
    let mut groups = Vec::new();
    for g in 0..3 {
        let m = manager(&format!("g{g}"), &lh.url(), 2).await;
        groups.push(vec![
            Worker::hello(&m, 0, 2).await,
            Worker::hello(&m, 1, 2).await,
        ]);
        ms.push(m);
    }
    let a = ok_quorums(&mut groups, &[5, 5, 0]).await;
    let q = |g: usize, r: usize| &a[g][r]["quorum"];
    for r in 0..2 {
        assert_eq!(q(2, r)["heal"], true);
        assert_eq!(q(2, r)["max_step"], 5);
        assert_eq!(q(2, r)["max_replica_rank"], Value::Null);
        assert_eq!(q(2, r)["max_world_size"], 2);
        // Round robin over the up-to-date groups, offset by group rank.
        assert_eq!(q(2, r)["recover_src_replica_rank"], r);
        assert_eq!(q(2, r)["recover_src_metadata"], format!("g{r}r{r}:1"));
        assert_eq!(q(r, r)["recover_dst_replica_ranks"], json!([2]));
        assert_eq!(q(1 - r, r)["recover_dst_replica_ranks"], json!([]));
        for g in 0..2 {
            assert_eq!(q(g, r)["heal"], false);
            assert_eq!(q(g, r)["max_replica_rank"], g);
        }
    }
    // The healed rank reports; the manager counts it.
    let w = &mut groups[2][0];
    let a = w
        .call(
            json!({"op": "report", "kind": "heal", "step": 5, "bytes": 1000,
            "seconds": 0.25, "sources": ["g0r0:1"]}),
        )
        .await;
    assert_eq!(a, json!({"ok": true}));
    let s = ms[2].status().borrow().clone();
    assert_eq!((s.heals, s.heal_bytes, s.heal_seconds), (1, 1000, 0.25));
    for m in ms {
        m.shutdown().await;
    }
    lh.stop().await;
}

/// Two histories at one step (`tests/sim.rs`, kind (e)): under a join
/// timeout of 0, g1 and g2 make step 3 in a quorum without g0, which made
/// it first, alone. At step 4 the lines meet (each worker names the quorum
/// its state was committed in, as the `Manager` does): g0's is the
/// earlier, so g0 heals from g1 at the same step (torchft compares steps
/// only: none heals and two states are averaged as one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_one_step_the_group_of_the_earlier_line_heals() {
    let knobs = Knobs {
        join_timeout: Duration::ZERO,
        ..Knobs::ours(1)
    };
    let lh = Lh::start_knobs("127.0.0.1:0".parse().unwrap(), knobs, None).await;
    let m0 = manager("g0", &lh.url(), 1).await;
    let mut g0 = Worker::hello(&m0, 0, 1).await;
    // g0 alone makes step 3 (in quorum q0).
    let a = g0.quorum(3, "g0r0:1", LIMIT.as_millis() as u64).await;
    assert_eq!(a["quorum"]["replica_ids"], json!(["g0"]), "{a}");
    let q0 = a["quorum"]["quorum_id"].as_i64().unwrap();
    assert_eq!(g0.vote(3, true, 10_000).await["commit"], true);
    // g1 and g2 come at step 3 while g0 (heartbeating) is in its step:
    // one of them alone is no majority of three; both are, and with no
    // join wait they make step 3 again without g0 (in quorum q1).
    let (m1, m2) = (
        manager("g1", &lh.url(), 1).await,
        manager("g2", &lh.url(), 1).await,
    );
    let mut g1 = Worker::hello(&m1, 0, 1).await;
    let mut g2 = Worker::hello(&m2, 0, 1).await;
    let t = LIMIT.as_millis() as u64;
    let (a1, a2) = tokio::join!(g1.quorum(3, "g1r0:1", t), g2.quorum(3, "g2r0:1", t));
    for a in [&a1, &a2] {
        assert_eq!(a["quorum"]["replica_ids"], json!(["g1", "g2"]), "{a}");
        assert_eq!(a["quorum"]["heal"], false, "{a}");
    }
    let q1 = a1["quorum"]["quorum_id"].as_i64().unwrap();
    assert!(q1 > q0, "{q0} {q1}");
    let (v1, v2) = tokio::join!(g1.vote(3, true, 10_000), g2.vote(3, true, 10_000));
    assert_eq!(
        (v1["commit"].clone(), v2["commit"].clone()),
        (json!(true), json!(true))
    );
    // At step 4, g0 waits first (alone, no majority); g1 comes: a quorum
    // of g0 and g1 at once (no join wait), in which g0 heals from g1.
    let (a0, a1) = tokio::join!(g0.quorum_in(4, "g0r0:2", q0), async {
        wait_status(lh.addr, |s| s["waiting"] == json!(["g0"])).await;
        g1.quorum_in(4, "g1r0:2", q1).await
    });
    assert_eq!(a0["quorum"]["replica_ids"], json!(["g0", "g1"]), "{a0}");
    assert_eq!(a0["quorum"]["max_step"], 4);
    assert_eq!(a0["quorum"]["heal"], true, "{a0}");
    assert_eq!(a0["quorum"]["recover_src_replica_rank"], 1, "{a0}");
    assert_eq!(a0["quorum"]["recover_src_metadata"], "g1r0:2", "{a0}");
    assert_eq!(a1["quorum"]["heal"], false, "{a1}");
    assert_eq!(
        a1["quorum"]["recover_dst_replica_ranks"],
        json!([0]),
        "{a1}"
    );
    for m in [m0, m1, m2] {
        m.shutdown().await;
    }
    lh.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_answered_and_closes_only_that_connection() {
    let lh = Lh::start(1).await;
    let m = manager("g0", &lh.url(), 2).await;
    let mut good = Worker::hello(&m, 0, 2).await;
    for (bad, want) in [
        (&b"not json\n"[..], "not valid"),
        (&b"{\"op\":\"fly\"}\n"[..], "fly"),
        (
            &b"{\"op\":\"quorum\",\"step\":0,\"metadata\":\"x\"}\n"[..],
            "must be hello",
        ),
    ] {
        let mut w = Worker::connect(&m).await;
        w.send_raw(bad).await;
        let a = w.answer().await;
        assert_eq!(a["ok"], false);
        assert!(a["error"].as_str().unwrap().contains(want), "{a}");
        w.closed().await;
    }
    let mut w = Worker::connect(&m).await;
    w.send_raw(&vec![b'x'; (1 << 20) + 10]).await;
    let a = w.answer().await;
    assert!(a["error"].as_str().unwrap().contains("longer than"), "{a}");
    // Requests sent ahead are answered in order, up to a bound.
    let mut w = Worker::hello(&m, 1, 2).await;
    let report = json!({"op": "report", "kind": "not_committed", "step": 0, "reason": "r"});
    let ahead = format!("{report}\n").repeat(3);
    w.send_raw(ahead.as_bytes()).await;
    for _ in 0..3 {
        assert_eq!(w.answer().await, json!({"ok": true}));
    }
    // Group rank 1's reports: the group's steps count at rank 0's; the
    // reason is kept.
    assert_eq!(m.status().borrow().not_committed, 0);
    assert_eq!(
        m.status().borrow().last_not_committed_reason.as_deref(),
        Some("r")
    );
    let vote = json!({"op": "should_commit", "step": 0, "vote": true, "timeout_ms": 60_000});
    w.send_raw(format!("{vote}\n").repeat(70).as_bytes()).await;
    let a = w.answer().await;
    assert!(
        a["error"]
            .as_str()
            .unwrap()
            .contains("more than 64 requests"),
        "{a}"
    );
    w.closed().await;
    // A rank held, or a wrong world size: refused.
    let mut w = Worker::connect(&m).await;
    let a = w
        .call(json!({"op": "hello", "group_rank": 0, "group_world_size": 2}))
        .await;
    assert!(a["error"].as_str().unwrap().contains("already held"), "{a}");
    let mut w = Worker::connect(&m).await;
    let a = w
        .call(json!({"op": "hello", "group_rank": 1, "group_world_size": 3}))
        .await;
    assert!(a["error"].as_str().unwrap().contains("has 2 ranks"), "{a}");
    // The good connection goes on (its vote waits for rank 1, then times out).
    let v = good.vote(0, true, 200).await;
    assert!(
        v["error"].as_str().unwrap().contains("[1] never voted"),
        "{v}"
    );
    m.shutdown().await;
    lh.stop().await;
}

/// A TCP proxy to `to` that a test can pause (bytes wait, as on a cut
/// link); counts the connections it accepted.
struct Proxy {
    addr: SocketAddr,
    paused: tokio::sync::watch::Sender<bool>,
    accepted: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Proxy {
    async fn start(to: SocketAddr) -> Proxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (paused, _) = tokio::sync::watch::channel(false);
        let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (p, n) = (paused.clone(), accepted.clone());
        tokio::spawn(async move {
            loop {
                let (a, _) = listener.accept().await.unwrap();
                n.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let b = TcpStream::connect(to).await.unwrap();
                let (ar, aw) = a.into_split();
                let (br, bw) = b.into_split();
                tokio::spawn(pipe(ar, bw, p.subscribe()));
                tokio::spawn(pipe(br, aw, p.subscribe()));
            }
        });
        Proxy {
            addr,
            paused,
            accepted,
        }
    }
}

async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut paused: tokio::sync::watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if paused.wait_for(|p| !*p).await.is_err() {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_shorter_than_the_keep_alive_keeps_the_session() {
    // The lighthouse's keep-alive is a minute: only our closing the
    // connection could drop the group within the test.
    let lh = Lh::start_at("127.0.0.1:0".parse().unwrap(), 1, Duration::from_secs(60)).await;
    let proxy = Proxy::start(lh.addr).await;
    let m = manager("g0", &format!("http://{}", proxy.addr), 1).await;
    let mut status = m.status();
    let mut w = Worker::hello(&m, 0, 1).await;
    let a = w.quorum(0, "a:1", LIMIT.as_millis() as u64).await;
    assert_eq!(a["ok"], true, "{a}");
    let id = a["quorum"]["quorum_id"].clone();
    tokio::time::timeout(LIMIT, status.wait_for(|s| s.connected))
        .await
        .unwrap()
        .unwrap();

    // Cut: the heartbeats go unanswered and the status says so.
    proxy.paused.send_replace(true);
    let s = tokio::time::timeout(LIMIT, status.wait_for(|s| !s.connected))
        .await
        .expect("the silence is noticed")
        .unwrap()
        .clone();
    assert!(s.last_error.unwrap().contains("had no answer"));
    // Healed: the same connection answers again, the group was never
    // dropped, and its next quorum keeps the id.
    proxy.paused.send_replace(false);
    tokio::time::timeout(LIMIT, status.wait_for(|s| s.connected))
        .await
        .expect("heartbeats answered again")
        .unwrap();
    let a = w.quorum(1, "a:1", LIMIT.as_millis() as u64).await;
    assert_eq!(a["ok"], true, "{a}");
    assert_eq!(a["quorum"]["quorum_id"], id, "no drop, no new quorum");
    assert_eq!(proxy.accepted.load(std::sync::atomic::Ordering::SeqCst), 1);
    let (_, st) = http_get(lh.addr, "/status".into()).await;
    assert_eq!(st["counters"]["drops"], 0, "{st}");
    m.shutdown().await;
    lh.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_stopped_fails_the_waiting_calls_releases_the_ranks_and_the_next_round_reconnects()
{
    // min_replicas 2: g0's call waits at the lighthouse while g1 does not
    // call. A heartbeat timeout of a minute: only the dropped connection
    // can explain a drop within the test's limit.
    let lh = Lh::start_at("127.0.0.1:0".parse().unwrap(), 2, Duration::from_secs(60)).await;
    let (m0, m1) = (
        manager("g0", &lh.url(), 1).await,
        manager("g1", &lh.url(), 1).await,
    );
    let mut groups = vec![
        vec![Worker::hello(&m0, 0, 1).await],
        vec![Worker::hello(&m1, 0, 1).await],
    ];
    let a = ok_quorums(&mut groups, &[1, 1]).await;
    let id = a[0][0]["quorum"]["quorum_id"].as_i64().unwrap();

    let path = format!("/v1/watch?quorum_id={id}&timeout_ms={}", LIMIT.as_millis());
    let watcher = tokio::spawn(http_get(lh.addr, path));
    let mut w0 = groups[0].pop().unwrap();
    let waiting = tokio::spawn(async move {
        let a = w0.quorum(2, "g0r0:1", 20_000).await;
        (w0, a)
    });
    wait_status(lh.addr, |s| s["waiting"] == json!(["g0"])).await;
    m0.workers_stopped("rank 1 exited with code 1");
    let (code, v) = watcher.await.unwrap();
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["event"], "dropped", "{v}");
    assert_eq!(v["replica_id"], "g0", "{v}");
    let (w0, a) = waiting.await.unwrap();
    assert_eq!(
        a,
        json!({"ok": false, "error": "quorum stopped: rank 1 exited with code 1"})
    );
    assert!(!m0.status().borrow().connected);

    // The stop lasts: the stopped worker, still connected (its signal has
    // not landed), is refused, and the manager does not reconnect for it.
    let mut w0 = w0;
    let a = w0.quorum(2, "g0r0:1", 20_000).await;
    assert_eq!(
        a,
        json!({"ok": false, "error": "this connection no longer holds group rank 0: the group's workers were stopped"})
    );
    assert!(!m0.status().borrow().connected);
    // Its replacement's hello is welcome while the old connection is open,
    // and the next round reconnects: a new quorum of both, a new id.
    groups[0].push(Worker::hello(&m0, 0, 1).await);
    let a = ok_quorums(&mut groups, &[2, 2]).await;
    drop(w0);
    assert_eq!(a[0][0]["quorum"]["replica_ids"], json!(["g0", "g1"]));
    assert!(a[0][0]["quorum"]["quorum_id"].as_i64().unwrap() > id);
    m0.shutdown().await;
    m1.shutdown().await;
    lh.stop().await;
}

/// A worker that beat and then went silent (stopped, hung) is taken for
/// gone after the worker keep-alive: its connection is closed and its group
/// leaves the quorum, although the manager itself heartbeats on (the
/// lighthouse's heartbeat timeout is a minute here). A worker that never
/// beats is never closed for silence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_silent_past_the_keep_alive_after_beating_takes_its_group_out() {
    let lh = Lh::start_at("127.0.0.1:0".parse().unwrap(), 1, Duration::from_secs(60)).await;
    let keep_alive = Duration::from_millis(300);
    let start = |id: &'static str| {
        let url = lh.url();
        async move {
            let mut c = Config::new(id, &url, 1);
            c.bind = "127.0.0.1:0".parse().unwrap();
            c.worker_keep_alive = keep_alive;
            Manager::start(c).await.unwrap()
        }
    };
    let (m0, m1) = (start("g0").await, start("g1").await);
    let mut groups = vec![
        vec![Worker::hello(&m0, 0, 1).await],
        vec![Worker::hello(&m1, 0, 1).await],
    ];
    let a = ok_quorums(&mut groups, &[1, 1]).await;
    let id = a[0][0]["quorum"]["quorum_id"].as_i64().unwrap();
    assert_eq!(a[0][0]["quorum"]["replica_ids"], json!(["g0", "g1"]));

    // g0 never beats: silent for three keep-alives, still there.
    tokio::time::sleep(keep_alive * 3).await;
    // g1 beats, then goes silent inside its next quorum call.
    let path = format!("/v1/watch?quorum_id={id}&timeout_ms={}", LIMIT.as_millis());
    let watcher = tokio::spawn(http_get(lh.addr, path));
    let mut g1 = groups.pop().unwrap().remove(0);
    let t0 = tokio::time::Instant::now();
    g1.send_raw(b"{\"op\":\"beat\"}\n").await;
    g1.send_raw(b"{\"op\":\"quorum\",\"step\":2,\"metadata\":\"g1:1\",\"timeout_ms\":20000}\n")
        .await;
    let (code, v) = watcher.await.unwrap();
    let took = t0.elapsed();
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["event"], "dropped", "{v}");
    assert_eq!(v["replica_id"], "g1", "{v}");
    assert!(
        took >= keep_alive,
        "dropped after {took:?}, before the keep-alive"
    );
    g1.closed().await;
    // g0 goes on alone.
    let a = ok_quorums(&mut groups, &[2]).await;
    assert_eq!(a[0][0]["quorum"]["replica_ids"], json!(["g0"]));
    m0.shutdown().await;
    m1.shutdown().await;
    lh.stop().await;
}

/// With a job secret (issue 49): the manager proves it to the lighthouse and
/// asks it of every worker connection; a worker without it, or with another,
/// and a manager with another are refused at once, naming why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_job_secret_only_its_holders_get_in() {
    let secret = JobSecret::from_bytes(vec![3; 32]).unwrap();
    let other = JobSecret::from_bytes(vec![4; 32]).unwrap();
    let any = "127.0.0.1:0".parse().unwrap();
    let lh = Lh::start_with(any, 1, Duration::from_secs(5), Some(secret.clone())).await;
    let start = |id: &str, s: &JobSecret| {
        let mut c = Config::new(id, &lh.url(), 1);
        c.bind = "127.0.0.1:0".parse().unwrap();
        c.connect_timeout = Duration::from_secs(20);
        c.secret = Some(s.clone());
        Manager::start(c)
    };
    let m = start("g0", &secret).await.unwrap();
    let mut w = Worker::connect_with(&m, Some(&secret)).await.unwrap();
    let a = w
        .call(json!({"op": "hello", "group_rank": 0, "group_world_size": 1, "pid": 1}))
        .await;
    assert_eq!(a["ok"], true, "{a}");
    let a = w.quorum(1, "g0r0:1", 20_000).await;
    assert_eq!(a["ok"], true, "{a}");

    // A worker with no secret: its hello is never read.
    let mut plain = Worker::connect(&m).await;
    plain
        .send_raw(b"{\"op\": \"hello\", \"group_rank\": 0, \"group_world_size\": 1, \"pid\": 2}\n")
        .await;
    // Closed (a reset: its bytes were never read) without an answer.
    let mut rest = Vec::new();
    let read = tokio::time::timeout(LIMIT, plain.rd.read_to_end(&mut rest));
    let _ = read.await.expect("closed within the limit");
    assert!(rest.is_empty(), "{}", String::from_utf8_lossy(&rest));
    // Another secret: told at once.
    let err = Worker::connect_with(&m, Some(&other)).await.err().unwrap();
    assert!(err.is_wrong_secret(), "{err}");
    // The client knows the server's proof is wrong before the server has
    // read its own: the count comes when it does.
    let t0 = Instant::now();
    let refused = loop {
        let r = m.secret_refusals();
        if r.wrong_proof == 1 || t0.elapsed() > LIMIT {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!(
        (refused.not_our_protocol, refused.wrong_proof),
        (1, 1),
        "{refused:?}"
    );
    // The admitted worker goes on.
    let a = w.quorum(2, "g0r0:1", 20_000).await;
    assert_eq!(a["ok"], true, "{a}");

    // A manager with another secret: its first quorum fails at once (well
    // inside its 20 s connect timeout), naming the different secret.
    let m2 = start("g1", &other).await.unwrap();
    let mut w2 = Worker::connect_with(&m2, Some(&other)).await.unwrap();
    let a = w2
        .call(json!({"op": "hello", "group_rank": 0, "group_world_size": 1, "pid": 3}))
        .await;
    assert_eq!(a["ok"], true, "{a}");
    let t0 = Instant::now();
    let a = w2.quorum(1, "g1r0:1", 20_000).await;
    assert_eq!(a["ok"], false, "{a}");
    assert!(
        a["error"]
            .as_str()
            .unwrap()
            .contains("different job secret"),
        "{a}"
    );
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    m.shutdown().await;
    m2.shutdown().await;
    lh.stop().await;
}
