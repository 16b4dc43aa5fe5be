//! The lighthouse's service over loopback, with tonic clients as torchft's
//! managers use: a quorum forms; a killed client's connection drops it at
//! once (also while its `Quorum` call waits) and its quorum's watchers are
//! told; a silent client is dropped at
//! the heartbeat timeout; the watch endpoint's four answers; bad input is
//! refused with a clear error while every other member goes on.
//!
//! Each client has its own TCP connection (its session). "Killing" one
//! shuts its socket down, which is what the kernel does to the sockets of a
//! killed process (the torchft test in `crates/rally/tests/run/lighthouse.rs`
//! SIGKILLs real managers).

use std::net::{Shutdown, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rallypoint_lighthouse::proto::{self, LighthouseServiceClient};
use rallypoint_lighthouse::quorum::Knobs;
use rallypoint_lighthouse::service::{Config, Server};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Request};

/// Every wait of these tests; far above what any step needs.
const LIMIT: Duration = Duration::from_secs(20);

fn knobs(min_replicas: u64, heartbeat_timeout: Duration) -> Knobs {
    Knobs {
        min_replicas,
        join_timeout: Duration::from_secs(60),
        quorum_tick: Duration::from_millis(50),
        heartbeat_timeout,
    }
}

async fn start(knobs: Knobs) -> (SocketAddr, i64) {
    start_with(Config::new(knobs)).await
}

async fn start_with(config: Config) -> (SocketAddr, i64) {
    let first_id = config.first_id;
    let server = Server::bind("127.0.0.1:0".parse().unwrap(), config)
        .await
        .unwrap();
    let addr = server.local_addr().unwrap();
    tokio::spawn(server.run(std::future::pending()));
    (addr, first_id)
}

/// A client on a connection of its own, which the test can cut.
struct Client {
    rpc: LighthouseServiceClient<Channel>,
    channel: Channel,
    socket: Arc<Mutex<Option<std::net::TcpStream>>>,
}

impl Client {
    async fn connect(addr: SocketAddr) -> Client {
        let socket = Arc::new(Mutex::new(None));
        let kept = socket.clone();
        let connector = tower::service_fn(move |_uri| {
            let kept = kept.clone();
            async move {
                let tcp = tokio::net::TcpStream::connect(addr).await?.into_std()?;
                *kept.lock().unwrap() = Some(tcp.try_clone()?);
                let tcp = tokio::net::TcpStream::from_std(tcp)?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tcp))
            }
        });
        let channel = Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect_with_connector(connector)
            .await
            .unwrap();
        Client {
            rpc: LighthouseServiceClient::new(channel.clone()),
            channel,
            socket,
        }
    }

    /// Ends the connection as the kernel does when the process dies.
    fn kill(&self) {
        let s = self.socket.lock().unwrap().take().expect("connected");
        s.shutdown(Shutdown::Both).unwrap();
    }

    async fn quorum(&mut self, m: proto::QuorumMember) -> Result<proto::Quorum, tonic::Status> {
        let mut r = Request::new(proto::LighthouseQuorumRequest {
            requester: Some(m),
            last_quorum: None,
        });
        r.set_timeout(LIMIT);
        let q = self.rpc.quorum(r).await?.into_inner().quorum;
        Ok(q.expect("a quorum in the answer"))
    }

    async fn heartbeat(&mut self, id: &str) -> Result<(), tonic::Status> {
        let r = proto::LighthouseHeartbeatRequest {
            replica_id: id.into(),
        };
        self.rpc.heartbeat(r).await.map(|_| ())
    }
}

fn member(id: &str) -> proto::QuorumMember {
    proto::QuorumMember {
        replica_id: id.into(),
        address: format!("http://{id}:1"),
        store_address: format!("{id}:2"),
        world_size: 1,
        ..Default::default()
    }
}

fn ids(q: &proto::Quorum) -> Vec<&str> {
    q.participants
        .iter()
        .map(|m| m.replica_id.as_str())
        .collect()
}

/// A plain HTTP/1.1 GET (or another method); the status and the body.
async fn http(addr: SocketAddr, method: &str, path: &str) -> (u16, String) {
    http_with(addr, method, path, None).await
}

/// An HTTP/1.1 request with an optional body; the status and the body.
async fn http_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
) -> (u16, String) {
    http_proven(addr, method, path, body, None).await
}

/// [`http_with`], proving a job secret first if given.
async fn http_proven(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
    secret: Option<&rallypoint_auth::JobSecret>,
) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    if let Some(secret) = secret {
        let deadline = Instant::now() + LIMIT;
        let service = rallypoint_auth::Service::LIGHTHOUSE;
        rallypoint_auth::io::tokio::client_handshake(&mut s, addr, secret, service, deadline)
            .await
            .unwrap();
    }
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: lh\r\nConnection: close\r\n");
    if let Some(b) = body {
        req.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            b.len()
        ));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    if let Some(b) = body {
        // The service may answer (413) and close before reading it all.
        let _ = s.write_all(b).await;
    }
    let mut out = String::new();
    tokio::time::timeout(LIMIT, s.read_to_string(&mut out))
        .await
        .expect("an HTTP answer within the limit")
        .unwrap();
    let status = out[9..12].parse().unwrap();
    let body = out.split_once("\r\n\r\n").map_or("", |p| p.1).to_owned();
    (status, body)
}

async fn watch(addr: SocketAddr, quorum_id: i64, timeout_ms: u64) -> (u16, Value) {
    let path = format!("/v1/watch?quorum_id={quorum_id}&timeout_ms={timeout_ms}");
    let (status, body) = http(addr, "GET", &path).await;
    let v = if body.is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&body).unwrap()
    };
    (status, v)
}

/// Two clients heartbeat, then both join: one quorum of both (the first
/// joiner waits for the other, which is healthy but has not joined yet).
async fn quorum_of(a: &mut Client, b: &mut Client) -> proto::Quorum {
    a.heartbeat("a").await.unwrap();
    b.heartbeat("b").await.unwrap();
    let (qa, qb) = tokio::join!(a.quorum(member("a")), b.quorum(member("b")));
    let (qa, qb) = (qa.unwrap(), qb.unwrap());
    assert_eq!(qa, qb, "both members get the same quorum");
    qa
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quorum_of_two_forms_and_shows_in_status_and_metrics() {
    let (addr, first_id) = start(knobs(2, Duration::from_secs(5))).await;
    let (mut a, mut b) = (Client::connect(addr).await, Client::connect(addr).await);
    let (qa, qb) = tokio::join!(a.quorum(member("b2")), b.quorum(member("a2")));
    let (qa, qb) = (qa.unwrap(), qb.unwrap());
    assert_eq!(qa, qb);
    assert_eq!(ids(&qa), ["a2", "b2"], "participants sorted by replica id");
    assert!(qa.quorum_id > first_id, "ids start above the start time");
    assert_eq!(qa.participants[0].store_address, "a2:2");
    assert!(qa.created.is_some());

    let (code, body) = http(addr, "GET", "/status").await;
    assert_eq!(code, 200);
    let s: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(s["quorum_id"], qa.quorum_id);
    assert_eq!(s["participants"].as_array().unwrap().len(), 2);
    assert_eq!(s["counters"]["quorums_issued"], 1);
    let (code, metrics) = http(addr, "GET", "/metrics").await;
    assert_eq!(code, 200);
    for line in [
        format!("rally_lighthouse_quorum_id {}", qa.quorum_id),
        "rally_lighthouse_participants 2".into(),
        "rally_lighthouse_joins_total 2".into(),
        "rally_lighthouse_quorums_issued_total 1".into(),
        "rally_lighthouse_drops_total 0".into(),
        "rally_lighthouse_refused_requests_total 0".into(),
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line:?} in\n{metrics}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_clients_connection_drops_it_at_once_and_pushes_the_abort() {
    // A heartbeat timeout of a minute: only the connection can explain a
    // drop within the test's limit.
    let heartbeat_timeout = Duration::from_secs(60);
    let (addr, _) = start(knobs(1, heartbeat_timeout)).await;
    let (mut a, mut b) = (Client::connect(addr).await, Client::connect(addr).await);
    let q = quorum_of(&mut a, &mut b).await;
    assert_eq!(ids(&q), ["a", "b"]);
    assert_eq!(
        watch(addr, q.quorum_id, 50).await.0,
        204,
        "whole: nothing to say"
    );

    let watcher = tokio::spawn(watch(addr, q.quorum_id, LIMIT.as_millis() as u64));
    let killed = Instant::now();
    a.kill();
    let (code, v) = watcher.await.unwrap();
    let took = killed.elapsed();
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["event"], "dropped", "{v}");
    assert_eq!(v["quorum_id"], q.quorum_id);
    assert_eq!(v["replica_id"], "a");
    assert!(
        took < heartbeat_timeout,
        "dropped by its connection, {took:?}"
    );

    // The survivor's next quorum is issued without waiting for anything.
    let next = b.quorum(member("b")).await.unwrap();
    assert_eq!(ids(&next), ["b"]);
    assert!(next.quorum_id > q.quorum_id);
    let (_, metrics) = http(addr, "GET", "/metrics").await;
    assert!(
        metrics.contains("rally_lighthouse_drops_total 1\n"),
        "{metrics}"
    );
    assert!(
        metrics.contains("rally_lighthouse_aborts_pushed_total 1\n"),
        "{metrics}"
    );
}

/// torchft's manager, after a failed call, connects anew and then drops
/// its old client: the old connection ends before the new one has carried
/// a request. Its replica is kept, and the quorum goes on under its id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_replaces_its_connection_keeps_its_replica_and_quorum() {
    let (addr, _) = start(knobs(1, Duration::from_secs(60))).await;
    let (mut a, mut b) = (Client::connect(addr).await, Client::connect(addr).await);
    let q = quorum_of(&mut a, &mut b).await;
    let mut a2 = Client::connect(addr).await;
    a.kill();
    drop(a);
    a2.heartbeat("a").await.unwrap();
    let next = quorum_of(&mut a2, &mut b).await;
    assert_eq!(ids(&next), ["a", "b"]);
    assert_eq!(next.quorum_id, q.quorum_id, "nobody was dropped");
    let (_, metrics) = http(addr, "GET", "/metrics").await;
    assert!(
        metrics.contains("rally_lighthouse_drops_total 0\n"),
        "{metrics}"
    );
    // Its new connection's end drops it at once.
    let watcher = tokio::spawn(watch(addr, q.quorum_id, LIMIT.as_millis() as u64));
    a2.kill();
    let (code, v) = watcher.await.unwrap();
    assert_eq!((code, &v["replica_id"]), (200, &Value::from("a")), "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_killed_while_its_quorum_call_waits_is_dropped_at_once() {
    // min_replicas 2 and one member: its call waits; a heartbeat timeout of
    // a minute, so only the connection can drop it within the test's limit.
    let (addr, _) = start(knobs(2, Duration::from_secs(60))).await;
    let mut a = Client::connect(addr).await;
    let socket = a.socket.clone();
    let call = tokio::spawn(async move { a.quorum(member("a")).await });
    wait_status(addr, |s| s["waiting"] == serde_json::json!(["a"])).await;
    socket
        .lock()
        .unwrap()
        .take()
        .unwrap()
        .shutdown(Shutdown::Both)
        .unwrap();
    wait_status(addr, |s| {
        s["counters"]["drops"] == 1 && s["healthy"] == serde_json::json!([])
    })
    .await;
    assert!(
        call.await.unwrap().is_err(),
        "its call ends with its connection"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_client_is_dropped_at_the_heartbeat_timeout() {
    // One member, so that no other's heartbeat timing can drop first.
    let heartbeat_timeout = Duration::from_millis(400);
    let (addr, _) = start(knobs(1, heartbeat_timeout)).await;
    let mut a = Client::connect(addr).await;
    // a beats (over a second connection of its process, as torchft's
    // manager may) until its quorum comes, past the service's startup
    // grace; then its beats stop and its connection stays open, silent.
    let mut beats = Client::connect(addr).await;
    let call = tokio::spawn(async move {
        let q = a.quorum(member("a")).await.unwrap();
        (a, q)
    });
    let mut a_last_word = Instant::now();
    while !call.is_finished() {
        // Taken before the beat is sent: the service hears it later (but
        // before its answer comes back), so its timeout runs from after
        // this instant. Taken after the answer, the test failed once
        // beside two CPU hogs: "not before its timeout: 397 ms".
        a_last_word = Instant::now();
        beats.heartbeat("a").await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (a, q) = call.await.unwrap();
    drop(beats);
    let (code, v) = watch(addr, q.quorum_id, LIMIT.as_millis() as u64).await;
    let silent = a_last_word.elapsed();
    assert_eq!(
        (code, &v["event"], &v["replica_id"]),
        (200, &"dropped".into(), &"a".into()),
        "{v}"
    );
    assert!(
        silent >= heartbeat_timeout,
        "not before its timeout: {silent:?}"
    );
    let (_, s) = http(addr, "GET", "/status").await;
    let s: Value = serde_json::from_str(&s).unwrap();
    assert_eq!(s["healthy"], serde_json::json!([]), "{s}");
    let open = s["counters"]["sessions_open"].as_u64().unwrap();
    assert!(open >= 2, "a's connection and this request's are open: {s}");
    drop(a);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watch_endpoint_gives_its_four_answers() {
    let (addr, _) = start(knobs(1, Duration::from_secs(60))).await;
    let (code, v) = watch(addr, 5, 10_000).await;
    assert_eq!(
        (code, &v["event"]),
        (200, &"unknown".into()),
        "nothing issued yet: {v}"
    );

    let mut a = Client::connect(addr).await;
    let q1 = a.quorum(member("a")).await.unwrap();
    let (code, v) = watch(addr, q1.quorum_id, 100).await;
    assert_eq!((code, v), (204, Value::Null), "current and whole");
    let (code, v) = watch(addr, q1.quorum_id + 1, 10_000).await;
    assert_eq!(
        (code, &v["event"]),
        (200, &"unknown".into()),
        "from the future: {v}"
    );

    // A commit failure reported raises the id (torchft's rule).
    let q2 = a
        .quorum(proto::QuorumMember {
            commit_failures: 1,
            ..member("a")
        })
        .await
        .unwrap();
    assert!(q2.quorum_id > q1.quorum_id);
    let (code, v) = watch(addr, q1.quorum_id, 10_000).await;
    assert_eq!(
        (code, &v["event"], &v["current"]),
        (200, &"superseded".into(), &q2.quorum_id.into()),
        "{v}"
    );

    a.kill();
    let (code, v) = watch(addr, q2.quorum_id, 10_000).await;
    assert_eq!(
        (code, &v["event"], &v["replica_id"]),
        (200, &"dropped".into(), &"a".into()),
        "{v}"
    );
    assert!(v["reason"].as_str().is_some_and(|r| !r.is_empty()), "{v}");

    // Bad queries say what is wrong.
    let (code, body) = http(addr, "GET", "/v1/watch?timeout_ms=5").await;
    assert_eq!(code, 400);
    assert!(body.contains("quorum_id"), "{body}");
    assert_eq!(
        http(addr, "GET", "/v1/watch?quorum_id=x&timeout_ms=5")
            .await
            .0,
        400
    );
    assert_eq!(http(addr, "GET", "/nowhere").await.0, 404);
    assert_eq!(http(addr, "POST", "/status").await.0, 405);
}

/// A `last_quorum` (our extension) with an invalid member is a hint
/// ignored, not a refusal: the call is answered as if it said nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_last_quorum_is_ignored() {
    let (addr, _) = start(knobs(1, Duration::from_secs(60))).await;
    let mut a = Client::connect(addr).await;
    let mut r = Request::new(proto::LighthouseQuorumRequest {
        requester: Some(member("a")),
        last_quorum: Some(proto::LastQuorum {
            quorum_id: 7,
            replica_ids: vec!["a".into(), String::new()],
        }),
    });
    r.set_timeout(LIMIT);
    let q = a.rpc.quorum(r).await.unwrap().into_inner().quorum.unwrap();
    assert_eq!(ids(&q), ["a"]);
    let s: Value = serde_json::from_str(&http(addr, "GET", "/status").await.1).unwrap();
    assert_eq!(s["counters"]["refused_requests"], 0, "{s}");
}

/// A heartbeat whose replica id is not UTF-8: a protobuf string field that
/// does not decode.
#[derive(Clone, PartialEq, prost::Message)]
struct MalformedHeartbeat {
    #[prost(bytes = "vec", tag = "1")]
    replica_id: Vec<u8>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_refused_clearly_and_harms_no_one() {
    let (addr, _) = start(knobs(1, Duration::from_secs(60))).await;
    let mut a = Client::connect(addr).await;
    let q = a.quorum(member("a")).await.unwrap();

    // The same replica id from a second live process (another manager
    // address, another connection).
    let mut impostor = Client::connect(addr).await;
    let e = impostor
        .quorum(proto::QuorumMember {
            address: "http://impostor:1".into(),
            ..member("a")
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "{e:?}");
    assert!(
        e.message().contains("is held by another live process"),
        "{e:?}"
    );

    // Requests it cannot place.
    let mut r = Request::new(proto::LighthouseQuorumRequest {
        requester: None,
        last_quorum: None,
    });
    r.set_timeout(LIMIT);
    let e = impostor.rpc.quorum(r).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("without a requester"), "{e:?}");
    let e = impostor.heartbeat("").await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");

    // A malformed message.
    let mut grpc = tonic::client::Grpc::new(impostor.channel.clone());
    grpc.ready().await.unwrap();
    let e = grpc
        .unary(
            Request::new(MalformedHeartbeat {
                replica_id: vec![0xff, 0xfe],
            }),
            tonic::codegen::http::uri::PathAndQuery::from_static(
                "/torchft.LighthouseService/Heartbeat",
            ),
            tonic_prost::ProstCodec::<MalformedHeartbeat, proto::LighthouseHeartbeatResponse>::default(),
        )
        .await
        .unwrap_err();
    assert!(e.message().contains("decode"), "{e:?}");

    // An oversized one (the cap is 1 MiB).
    let e = impostor
        .quorum(proto::QuorumMember {
            data: "x".repeat(2 << 20),
            ..member("big")
        })
        .await
        .unwrap_err();
    assert!(e.message().contains("too large"), "{e:?}");

    // Bytes that are not HTTP at all.
    let mut raw = tokio::net::TcpStream::connect(addr).await.unwrap();
    raw.write_all(b"\x00\x01 not a request\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(LIMIT, raw.read_to_end(&mut answer))
        .await
        .expect("the service answers or closes")
        .ok();

    // Every refusal counted (the last as its connection ends, which may
    // follow the answer); the member and a newcomer go on.
    wait_status(addr, |s| {
        let c = &s["counters"];
        c["refused_requests"].as_u64().unwrap() == 5 && c["bad_connections"] == 1
    })
    .await;
    let (_, metrics) = http(addr, "GET", "/metrics").await;
    assert!(
        metrics.contains("\nrally_lighthouse_refused_requests_total 6\n"),
        "{metrics}"
    );
    a.heartbeat("a").await.unwrap();
    let mut c = Client::connect(addr).await;
    // The newcomer waits (no majority of the healthy alone); the member's
    // join then makes a fast quorum with the newcomer in it.
    let newcomer = tokio::spawn(async move { c.quorum(member("c")).await });
    wait_status(addr, |s| s["waiting"] == serde_json::json!(["c"])).await;
    let next = a.quorum(member("a")).await;
    let status = http(addr, "GET", "/status").await.1;
    let next = next.unwrap_or_else(|e| panic!("{e:?}; status {status}"));
    assert_eq!(next, newcomer.await.unwrap().unwrap());
    assert_eq!(ids(&next), ["a", "c"]);
    assert!(next.quorum_id > q.quorum_id);
}

/// Polls `/status` until `ok` holds (within [`LIMIT`]).
async fn wait_status(addr: SocketAddr, ok: impl Fn(&Value) -> bool) {
    let t0 = Instant::now();
    loop {
        let s: Value = serde_json::from_str(&http(addr, "GET", "/status").await.1).unwrap();
        if ok(&s) {
            return;
        }
        assert!(t0.elapsed() < LIMIT, "status never got there: {s}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_call_whose_id_another_process_took_ends_with_the_refusal() {
    // min_replicas 2: calls wait. a goes silent past its timeout inside its
    // call (a stopped process), and another process takes its id.
    let (addr, _) = start(knobs(2, Duration::from_millis(300))).await;
    let mut a = Client::connect(addr).await;
    let stalled = tokio::spawn(async move { a.quorum(member("a")).await });
    wait_status(addr, |s| s["counters"]["drops"] == 1).await;
    let mut other = Client::connect(addr).await;
    let taker = tokio::spawn(async move {
        let m = proto::QuorumMember {
            address: "http://other:1".into(),
            ..member("a")
        };
        other.quorum(m).await
    });
    let e = tokio::time::timeout(LIMIT, stalled)
        .await
        .expect("the stalled call ends")
        .unwrap()
        .unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "{e:?}");
    assert!(e.message().contains("taken by another process"), "{e:?}");
    taker.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quorum_call_that_ends_unanswered_is_no_participant() {
    // min_replicas 2, a heartbeat timeout of a minute: a's calls wait, and
    // only their end can take a out of the participants.
    let (addr, _) = start(knobs(2, Duration::from_secs(60))).await;
    let mut a = Client::connect(addr).await;
    let mut b = Client::connect(addr).await;

    // 1. Its client cancels the call (the future dropped); the connection
    //    stays open (a still heartbeats).
    let mut rpc = a.rpc.clone();
    let call = tokio::spawn(async move {
        let r = Request::new(proto::LighthouseQuorumRequest {
            requester: Some(member("a")),
            last_quorum: None,
        });
        rpc.quorum(r).await
    });
    wait_status(addr, |s| s["waiting"] == serde_json::json!(["a"])).await;
    call.abort();
    wait_status(addr, |s| {
        s["waiting"] == serde_json::json!([]) && s["counters"]["left"] == 1
    })
    .await;

    // 2. The call's deadline passes. tonic's channel keeps the same
    //    deadline from the grpc-timeout header: whichever timer fires first
    //    (the service's: DEADLINE_EXCEEDED; the client's: CANCELLED, the
    //    stream reset), the service's call ends unanswered.
    let mut r = Request::new(proto::LighthouseQuorumRequest {
        requester: Some(member("a")),
        last_quorum: None,
    });
    r.set_timeout(Duration::from_millis(200));
    let e = a.rpc.quorum(r).await.unwrap_err();
    assert!(
        matches!(e.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{e:?}"
    );
    wait_status(addr, |s| {
        s["waiting"] == serde_json::json!([]) && s["counters"]["left"] == 2
    })
    .await;
    a.heartbeat("a").await.unwrap();

    // b alone is no quorum: a's ended calls are not issued along with it.
    let b_call = tokio::spawn(async move { b.quorum(member("b")).await });
    wait_status(addr, |s| s["waiting"] == serde_json::json!(["b"])).await;
    let (_, status) = http(addr, "GET", "/status").await;
    let status: Value = serde_json::from_str(&status).unwrap();
    assert_eq!(status["counters"]["quorums_issued"], 0, "{status}");
    // a joins again: the quorum names both, and both hear of it.
    let q = a.quorum(member("a")).await.unwrap();
    assert_eq!(ids(&q), ["a", "b"]);
    assert_eq!(q, b_call.await.unwrap().unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heal_reports_show_in_status_and_metrics_and_bad_ones_are_refused() {
    let (addr, _) = start(knobs(1, Duration::from_secs(60))).await;
    let mut a = Client::connect(addr).await;
    // torchft's Manager names its replica "heal_1:<uuid4>" at the
    // lighthouse; its process group knows "heal_1".
    let q = a.quorum(member("heal_1:0b4f")).await.unwrap();
    let report = |id: &str, bytes: u64, seconds: f64| {
        serde_json::json!({
            "replica_id": id, "step": 7, "bytes": bytes, "seconds": seconds,
            "sources": ["127.0.0.1:4100"], "quorum_id": q.quorum_id,
        })
        .to_string()
    };
    let post = |body: String| async move {
        http_with(addr, "POST", "/v1/heal", Some(body.as_bytes())).await
    };
    let (code, body) = post(report("heal_1", 28_480, 0.03)).await;
    assert_eq!(code, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        v["replica_id"], "heal_1:0b4f",
        "resolved from torchft's name"
    );
    assert_eq!(post(report("heal_1:0b4f", 1_000, 2.0)).await.0, 200);

    // Bad reports: each a clear 4xx, nothing recorded.
    let (code, body) = post("{not json".into()).await;
    assert_eq!(code, 400);
    assert!(body.contains("not JSON"), "{body}");
    let (code, body) = post(r#"{"replica_id":"heal_1","step":1,"seconds":1}"#.into()).await;
    assert_eq!(code, 400);
    assert!(body.contains("bytes"), "{body}");
    let (code, body) = post(report("nobody", 5, 0.1)).await;
    assert_eq!(code, 422);
    assert!(body.contains("unknown replica id \"nobody\""), "{body}");
    let huge = format!("{{\"replica_id\":\"{}\"}}", "x".repeat(100 << 10));
    let (code, body) = post(huge).await;
    assert_eq!(code, 413);
    assert!(body.contains("at most"), "{body}");
    assert_eq!(http(addr, "GET", "/v1/heal").await.0, 405);

    let (_, s) = http(addr, "GET", "/status").await;
    let s: Value = serde_json::from_str(&s).unwrap();
    let h = &s["heals"];
    assert_eq!(h["total"], 2, "{s}");
    assert_eq!(h["bytes_total"], 29_480, "{s}");
    assert_eq!(h["seconds_max"], 2.0, "{s}");
    assert_eq!(h["last"][0]["bytes"], 1_000, "newest first: {s}");
    assert_eq!(
        h["last"][1]["sources"],
        serde_json::json!(["127.0.0.1:4100"])
    );
    assert_eq!(h["by_replica"]["heal_1:0b4f"]["step"], 7, "{s}");
    assert_eq!(s["counters"]["refused_requests"], 5, "{s}");
    let (_, metrics) = http(addr, "GET", "/metrics").await;
    for line in [
        "rally_lighthouse_heals_total 2",
        "rally_lighthouse_heal_bytes_total 29480",
        "rally_lighthouse_heal_seconds_max 2",
        "rally_lighthouse_heal_seconds_bucket{le=\"0.05\"} 1",
        "rally_lighthouse_heal_seconds_bucket{le=\"+Inf\"} 2",
        "rally_lighthouse_heal_seconds_sum 2.03",
        "rally_lighthouse_heal_seconds_count 2",
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line:?} in\n{metrics}");
    }
    // The member goes on.
    let next = a.quorum(member("heal_1:0b4f")).await.unwrap();
    assert_eq!(next.quorum_id, q.quorum_id);
}

/// With a job secret (issue 49, `--job-secret-file`): a client that does not
/// prove it (torchft's manager, curl) gets nothing, not even `/status`; one
/// that does is served; refusals are counted in `/metrics`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_job_secret_only_connections_that_prove_it_are_served() {
    let secret = rallypoint_auth::JobSecret::from_bytes(vec![5; 32]).unwrap();
    let mut config = Config::new(knobs(1, Duration::from_secs(5)));
    config.secret = Some(secret.clone());
    let (addr, _) = start_with(config).await;
    let mut plain = Client::connect(addr).await;
    let t0 = Instant::now();
    assert!(plain.heartbeat("a").await.is_err());
    let mut raw = tokio::net::TcpStream::connect(addr).await.unwrap();
    raw.write_all(b"GET /status HTTP/1.1\r\nHost: lh\r\n\r\n")
        .await
        .unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(LIMIT, raw.read_to_end(&mut out))
        .await
        .unwrap();
    assert!(
        !out.windows(4).any(|w| w == b"HTTP"),
        "{}",
        String::from_utf8_lossy(&out)
    );
    assert!(
        t0.elapsed() < LIMIT / 2,
        "refused at once: {:?}",
        t0.elapsed()
    );
    let (code, status) = http_proven(addr, "GET", "/status", None, Some(&secret)).await;
    assert_eq!(code, 200, "{status}");
    let (_, metrics) = http_proven(addr, "GET", "/metrics", None, Some(&secret)).await;
    // The raw client, and the gRPC one (tonic may dial again after the
    // refusal).
    let refused: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("rally_lighthouse_secret_refusals_total "))
        .and_then(|n| n.parse().ok())
        .expect("the counter");
    assert!(refused >= 2, "{metrics}");
}
