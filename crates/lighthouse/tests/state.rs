//! `--state etcd://`: the lighthouse's state in a real etcd (Debian's
//! `etcd-server`, started by each test; `RALLY_ETCD` names another binary).
//!
//! * A lighthouse restarted on the same prefix goes on from the saved
//!   quorum: when its members return it is re-issued under its id, without
//!   the startup grace, and later ids rise above it.
//! * A second lighthouse on the prefix stands by, refusing every call, and
//!   takes over when the leader dies without giving its lease up (its task
//!   dropped as a SIGKILL would: no revoke, the lease expires a TTL later):
//!   bounded by the TTL (2 s) plus a margin of 8 s.
//! * A leader whose lease is revoked behind its back stops serving (and a
//!   standby takes over), so two lighthouses never both issue.
//! * An etcd that is not there is a clear error naming its address, within
//!   the connect timeout plus a margin.
//!
//! The process-level version (two `rally lighthouse` processes, the leader
//! SIGKILLed) is in `crates/rally/tests/run/lighthouse.rs`.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use rallypoint_lighthouse::proto::{self, LighthouseServiceClient};
use rallypoint_lighthouse::quorum::Knobs;
use rallypoint_lighthouse::service::etcd::{Etcd, StateUrl};
use rallypoint_lighthouse::service::{Config, Server};
use rallypoint_rendezvous::etcd::testing::EtcdServer;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::transport::Channel;
use tonic::{Code, Request};

/// Every wait of these tests; far above what any step needs.
const LIMIT: Duration = Duration::from_secs(20);
/// The leases' TTL.
const TTL: Duration = Duration::from_secs(2);

fn knobs() -> Knobs {
    Knobs {
        min_replicas: 1,
        join_timeout: Duration::from_secs(60),
        quorum_tick: Duration::from_millis(50),
        heartbeat_timeout: Duration::from_secs(60),
    }
}

/// A lighthouse on `prefix` of `etcd`: its address, a sender that stops it
/// cleanly, and its task (abort it to kill it).
struct Running {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<std::io::Result<()>>,
}

async fn start(etcd: &EtcdServer, prefix: &str) -> Running {
    start_at(etcd, prefix, "127.0.0.1:0".parse().unwrap(), TTL).await
}

/// [`start`] on `bind` (retried until the port is free again: a killed
/// lighthouse's listener closes as its task is dropped), with lease `ttl`.
async fn start_at(etcd: &EtcdServer, prefix: &str, bind: SocketAddr, ttl: Duration) -> Running {
    let url: StateUrl = format!("etcd://{}{prefix}", etcd.endpoint).parse().unwrap();
    let state = Etcd::connect(url, ttl, Duration::from_secs(5))
        .await
        .unwrap();
    let config = Config {
        state: Some(state),
        ..Config::new(knobs())
    };
    let deadline = Instant::now() + LIMIT;
    let server = loop {
        match Server::bind(bind, config.clone()).await {
            Ok(s) => break s,
            Err(e) if Instant::now() < deadline => {
                eprintln!("binding {bind}: {e}; again");
                tokio::task::yield_now().await;
            }
            Err(e) => panic!("binding {bind}: {e}"),
        }
    };
    let addr = server.local_addr().unwrap();
    let (tx, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(server.run(async move {
        let _ = rx.await;
    }));
    Running {
        addr,
        stop: Some(tx),
        task,
    }
}

impl Running {
    /// Stops it as Ctrl-C does (it gives its lease up).
    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        tokio::time::timeout(LIMIT, &mut self.task)
            .await
            .expect("stopped within the limit")
            .unwrap()
            .unwrap();
    }

    /// Ends it as SIGKILL would: nothing runs after, its lease is not given
    /// up.
    fn kill(self) {
        self.task.abort();
    }
}

async fn client(addr: SocketAddr) -> LighthouseServiceClient<Channel> {
    let ch = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    LighthouseServiceClient::new(ch)
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

async fn quorum(
    c: &mut LighthouseServiceClient<Channel>,
    id: &str,
) -> Result<proto::Quorum, tonic::Status> {
    let mut r = Request::new(proto::LighthouseQuorumRequest {
        requester: Some(member(id)),
        last_quorum: None,
    });
    r.set_timeout(LIMIT);
    Ok(c.quorum(r).await?.into_inner().quorum.unwrap())
}

/// Both members join at once; their (common) quorum.
async fn round(
    a: &mut LighthouseServiceClient<Channel>,
    b: &mut LighthouseServiceClient<Channel>,
) -> proto::Quorum {
    let (qa, qb) = tokio::join!(quorum(a, "a"), quorum(b, "b"));
    let (qa, qb) = (qa.unwrap(), qb.unwrap());
    assert_eq!(qa, qb);
    qa
}

async fn status(addr: SocketAddr) -> Value {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /status HTTP/1.1\r\nHost: lh\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut out = String::new();
    tokio::time::timeout(LIMIT, s.read_to_string(&mut out))
        .await
        .unwrap()
        .unwrap();
    serde_json::from_str(out.split_once("\r\n\r\n").unwrap().1).unwrap()
}

/// Polls `/status` until `ok` holds, within `limit`; how long it took.
async fn until(addr: SocketAddr, limit: Duration, ok: impl Fn(&Value) -> bool) -> Duration {
    let t0 = Instant::now();
    loop {
        let s = status(addr).await;
        if ok(&s) {
            return t0.elapsed();
        }
        assert!(t0.elapsed() < limit, "status never got there: {s}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn leads(s: &Value) -> bool {
    s["role"] == "leader"
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_lighthouse_reissues_the_saved_quorum_at_once_and_ids_go_on_above() {
    let etcd = EtcdServer::start().await.unwrap();
    let first = start(&etcd, "/restart").await;
    until(first.addr, LIMIT, leads).await;
    let (mut a, mut b) = (client(first.addr).await, client(first.addr).await);
    let q = round(&mut a, &mut b).await;
    first.stop().await;

    let second = start(&etcd, "/restart").await;
    until(second.addr, LIMIT, leads).await;
    let (mut a, mut b) = (client(second.addr).await, client(second.addr).await);
    // a alone waits: the saved quorum waits for all its members.
    let a_call = tokio::spawn(async move { (quorum(&mut a, "a").await, a) });
    until(second.addr, LIMIT, |s| {
        s["waiting"] == serde_json::json!(["a"])
    })
    .await;
    let t0 = Instant::now();
    let qb = quorum(&mut b, "b").await.unwrap();
    let took = t0.elapsed();
    let (qa, mut a) = a_call.await.unwrap();
    assert_eq!(qa.unwrap(), qb);
    assert_eq!(qb.quorum_id, q.quorum_id, "the saved quorum under its id");
    // The grace of a start is a second (min(heartbeat timeout, 1 s)); the
    // re-issue takes a quorum round (a few ms): a margin of 100 times.
    assert!(
        took < rallypoint_lighthouse::machine::STARTUP_GRACE_MAX,
        "re-issued {took:?} after the last member came back: not at once"
    );
    // A commit failure: the next id, above the saved one.
    let failed = proto::QuorumMember {
        commit_failures: 1,
        ..member("a")
    };
    let mut r = Request::new(proto::LighthouseQuorumRequest {
        requester: Some(failed),
        last_quorum: None,
    });
    r.set_timeout(LIMIT);
    let (qa, qb) = tokio::join!(a.quorum(r), quorum(&mut b, "b"));
    let next = qa.unwrap().into_inner().quorum.unwrap();
    assert_eq!(next, qb.unwrap());
    assert_eq!(next.quorum_id, q.quorum_id + 1);
    second.stop().await;

    // And it was saved before it was answered: a third goes on from it.
    let third = start(&etcd, "/restart").await;
    until(third.addr, LIMIT, leads).await;
    let s = status(third.addr).await;
    assert_eq!(s["quorum_id"], next.quorum_id, "{s}");
    third.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_refuses_every_call_until_the_killed_leaders_lease_expires() {
    let etcd = EtcdServer::start().await.unwrap();
    let leader = start(&etcd, "/takeover").await;
    until(leader.addr, LIMIT, leads).await;
    let standby = start(&etcd, "/takeover").await;
    // It names the leader once its campaign found it.
    let named = leader.addr.to_string();
    until(standby.addr, LIMIT, |s| {
        s["role"] == "standby" && s["leader"].as_str().unwrap().contains(&named)
    })
    .await;

    let (mut a, mut b) = (client(leader.addr).await, client(leader.addr).await);
    let q = round(&mut a, &mut b).await;
    // The standby issues nothing: every call refused, naming the leader.
    let mut sa = client(standby.addr).await;
    let e = quorum(&mut sa, "a").await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(e.message().contains("stands by"), "{e:?}");
    assert!(e.message().contains(&leader.addr.to_string()), "{e:?}");
    let hb = proto::LighthouseHeartbeatRequest {
        replica_id: "a".into(),
    };
    let e = sa.heartbeat(hb).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert_eq!(status(standby.addr).await["counters"]["joins"], 0);

    // Killed: no revoke; the lease expires a TTL after its last keep-alive.
    let killed = Instant::now();
    leader.kill();
    let took = until(standby.addr, TTL + Duration::from_secs(8), leads).await;
    let took = took.max(killed.elapsed());
    eprintln!("the standby led {took:?} after the leader was killed (TTL {TTL:?})");
    // The members come back to it: the saved quorum, at once.
    let (mut a, mut b) = (client(standby.addr).await, client(standby.addr).await);
    let again = round(&mut a, &mut b).await;
    assert_eq!(again.quorum_id, q.quorum_id);
    standby.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_lease_is_revoked_stops_issuing_and_the_standby_takes_over() {
    let etcd = EtcdServer::start().await.unwrap();
    let leader = start(&etcd, "/deposed").await;
    until(leader.addr, LIMIT, leads).await;
    let standby = start(&etcd, "/deposed").await;
    let named = leader.addr.to_string();
    until(standby.addr, LIMIT, |s| {
        s["role"] == "standby" && s["leader"].as_str().unwrap().contains(&named)
    })
    .await;
    let mut a = client(leader.addr).await;
    let q = quorum(&mut a, "a").await.unwrap();

    // Revoke the leader's lease behind its back (as etcd does when the
    // leader's keep-alives stop reaching it: a paused process, a cut link).
    let mut c = etcd_client::Client::connect([format!("http://{}", etcd.endpoint)], None)
        .await
        .unwrap();
    let kv = c.get("/deposed/leader", None).await.unwrap();
    let lease = kv.kvs()[0].lease();
    c.lease_revoke(lease).await.unwrap();

    // It notices within three quarters of the TTL (a keep-alive refused,
    // or none acknowledged), refuses everything, and its service ends
    // with the reason (a supervisor restarts it as a standby).
    let ended = tokio::time::timeout(TTL + Duration::from_secs(8), leader.task)
        .await
        .expect("the deposed leader's service ends within the TTL and a margin")
        .unwrap();
    let e = ended.unwrap_err().to_string();
    assert!(e.contains("lease"), "{e}");
    assert!(quorum(&mut a, "a").await.is_err(), "it issues nothing more");

    until(standby.addr, TTL + Duration::from_secs(8), leads).await;
    let mut a = client(standby.addr).await;
    let again = quorum(&mut a, "a").await.unwrap();
    assert_eq!(again.quorum_id, q.quorum_id, "the saved quorum, re-issued");
    standby.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_etcd_that_is_not_there_is_an_error_naming_it_within_the_timeout() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url: StateUrl = format!("etcd://127.0.0.1:{port}/x").parse().unwrap();
    let timeout = Duration::from_secs(2);
    let t0 = Instant::now();
    let e = Etcd::connect(url, TTL, timeout).await.unwrap_err();
    let took = t0.elapsed();
    assert!(e.contains(&format!("etcd at 127.0.0.1:{port}")), "{e}");
    // Bounded by the timeout (2 s), with a margin of 3 s.
    assert!(took < timeout + Duration::from_secs(3), "{took:?}: {e}");
}

/// A lighthouse killed and started again at its own address takes over at
/// once, not a lease later: the address being free proves its predecessor
/// gone. (A lease of 30 s: a takeover by expiry could not come within the
/// bound.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lighthouse_restarted_at_its_own_address_leads_at_once() {
    let etcd = EtcdServer::start().await.unwrap();
    let ttl = Duration::from_secs(30);
    let first = start_at(&etcd, "/same", "127.0.0.1:0".parse().unwrap(), ttl).await;
    until(first.addr, LIMIT, leads).await;
    let (mut a, mut b) = (client(first.addr).await, client(first.addr).await);
    let q = round(&mut a, &mut b).await;
    let at = first.addr;
    first.kill();
    let killed = Instant::now();
    let second = start_at(&etcd, "/same", at, ttl).await;
    until(second.addr, LIMIT, leads).await;
    let took = killed.elapsed();
    assert!(
        took < ttl / 2,
        "led {took:?} after the kill: the lease ran out instead"
    );
    eprintln!("restarted at its own address: led {took:?} after the kill (lease {ttl:?})");
    let (mut a, mut b) = (client(second.addr).await, client(second.addr).await);
    assert_eq!(
        round(&mut a, &mut b).await.quorum_id,
        q.quorum_id,
        "the saved quorum"
    );
    second.stop().await;
}

/// An abort is saved before its watchers hear of it: a lighthouse that
/// takes over right after gives the aborted quorum's members a new id, never
/// the aborted one (the simulator found a takeover re-issuing it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abort_is_saved_and_a_takeover_never_reissues_the_aborted_id() {
    let etcd = EtcdServer::start().await.unwrap();
    let ttl = Duration::from_secs(30);
    let first = start_at(&etcd, "/abort", "127.0.0.1:0".parse().unwrap(), ttl).await;
    until(first.addr, LIMIT, leads).await;
    let (mut a, mut b) = (client(first.addr).await, client(first.addr).await);
    let q = round(&mut a, &mut b).await;
    // a's process ends: its connection closes, it is dropped, q is aborted.
    drop(a);
    let url: StateUrl = format!("etcd://{}/abort", etcd.endpoint).parse().unwrap();
    let state = Etcd::connect(url, ttl, Duration::from_secs(5))
        .await
        .unwrap();
    let t0 = Instant::now();
    loop {
        let saved = state.saved().await.unwrap().expect("a saved state");
        if saved.aborted {
            assert_eq!(saved.last_id, q.quorum_id, "the aborted quorum, marked");
            break;
        }
        assert!(t0.elapsed() < LIMIT, "the abort was never saved: {saved:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let at = first.addr;
    first.kill();
    drop(b);
    let second = start_at(&etcd, "/abort", at, ttl).await;
    until(second.addr, LIMIT, leads).await;
    let (mut a, mut b) = (client(second.addr).await, client(second.addr).await);
    let again = round(&mut a, &mut b).await;
    assert_eq!(
        again.quorum_id,
        q.quorum_id + 1,
        "the same members, back: a new id, not the aborted {}",
        q.quorum_id
    );
    second.stop().await;
}
