//! The job secret on the TCP backend: a group with it works as one without;
//! outsiders (no secret, another secret, half a handshake, junk, a forged
//! RPC call) are refused, counted, and harm nothing; a worker with another
//! secret fails `init_rpc` at once, saying so; a bad secret file fails it.

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rallypoint_auth::handshake::Step;
use rallypoint_auth::{ClientHandshake, JobSecret, RefusalCounts, Service};
use rallypoint_rpc::wire::{self, Envelope, FrameHead, Hello, Request};
use rallypoint_rpc::{BackendType, Payload, RRef, Rpc, RpcBackendOptions};
use rallypoint_store::{MemoryStore, Store};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::harness::*;

fn secret(fill: u8) -> JobSecret {
    JobSecret::from_bytes(vec![fill; 32]).unwrap()
}

/// How long any outsider's refusal may take here: a bound for a hung test,
/// far beyond the 2 s handshake deadline.
const BOUND: Duration = Duration::from_secs(20);

/// `n` workers of a static group, all with `secret`.
async fn group_with_secret(n: usize, s: &JobSecret) -> Vec<Rpc> {
    group_with(n, BackendType::tcp(), |_, o| o.secret = Some(s.clone()))
        .await
        .into_iter()
        .map(|r| r.expect("init_rpc with the secret"))
        .collect()
}

/// Calls and RRef operations between every pair of workers, checked.
async fn calls_are_correct(ws: &[Rpc]) {
    let n = ws.len();
    for (i, w) in ws.iter().enumerate() {
        let to = format!("w{}", (i + 1) % n);
        let v: i64 = w
            .rpc_sync(to.as_str(), "add", &(i as i64, 40i64))
            .await
            .unwrap();
        assert_eq!(v, i as i64 + 40, "worker {i} calling {to}");
        let r: RRef<i64> = w.remote(to.as_str(), "counter", &(i as i64)).unwrap();
        assert_eq!(r.call::<_, i64>("incr", &2i64).await.unwrap(), i as i64 + 2);
        assert_eq!(r.to_here().await.unwrap(), i as i64 + 2);
    }
}

/// Reads until the peer closes (EOF or reset); what came before.
async fn read_to_close(s: &mut TcpStream) -> Vec<u8> {
    let mut got = Vec::new();
    let mut b = [0u8; 256];
    loop {
        match tokio::time::timeout(BOUND, s.read(&mut b)).await {
            Err(_) => panic!("not closed within {BOUND:?}; got {got:?}"),
            Ok(Ok(0)) | Ok(Err(_)) => return got,
            Ok(Ok(n)) => got.extend_from_slice(&b[..n]),
        }
    }
}

/// Waits until `w`'s refusals read `want`.
async fn refusals_reach(w: &Rpc, want: RefusalCounts) {
    let t0 = Instant::now();
    while w.refusals() != want {
        assert!(
            t0.elapsed() < BOUND,
            "refusals {:?}, expected {want:?}",
            w.refusals()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The bytes of a real client HELLO for RPC (with some secret).
fn client_hello() -> Vec<u8> {
    let mut c = ClientHandshake::new(&secret(9), Service::RPC).unwrap();
    match c.step().unwrap() {
        Step::Write { bytes, .. } => bytes,
        _ => unreachable!("a client speaks first"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_with_the_secret_call_share_rrefs_and_move_payloads() {
    let s = secret(7);
    let ws = group_with_secret(3, &s).await;
    calls_are_correct(&ws).await;
    // A call that makes a call, and an RRef forked to a third worker.
    let v: i64 = ws[0]
        .rpc_sync("w1", "relay_add", &("w2".to_owned(), 5i64, 6i64))
        .await
        .unwrap();
    assert_eq!(v, 11);
    let r: RRef<i64> = ws[0].remote("w1", "counter", &33i64).unwrap();
    let got: i64 = ws[0].rpc_sync("w2", "fetch", &r).await.unwrap();
    assert_eq!(got, 33);
    drop(r);
    // Bulk streams (their own connections, each proven): a split payload.
    let data: Vec<u8> = (0..(40u32 << 20)).map(|i| (i % 251) as u8).collect();
    let p = Payload::cpu(data.clone());
    let (dev, len, sum): (String, u64, u64) =
        ws[2].rpc_sync("w0", "payload_info", &p).await.unwrap();
    assert_eq!(
        (dev.as_str(), len, sum),
        ("cpu", data.len() as u64, checksum(&data))
    );
    for w in &ws {
        assert_eq!(w.refusals(), RefusalCounts::default(), "nothing refused");
    }
    shutdown_all(ws).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outsiders_are_refused_counted_and_the_group_goes_on() {
    let s = secret(7);
    let ws = group_with_secret(2, &s).await;
    let addr = ws[1].address();
    let mut want = RefusalCounts::default();

    // Without a secret: RPC's hello, answered with RPC's refusal saying why.
    let hello = Hello {
        generation: 1,
        from: 0,
        to: 1,
        stream: 0,
    };
    let mut c = TcpStream::connect(&addr).await.unwrap();
    c.write_all(&hello.encode()).await.unwrap();
    let got = read_to_close(&mut c).await;
    assert_eq!(
        got.first(),
        Some(&2),
        "RPC's refusal, of a hello without the secret: {got:?}"
    );
    assert!(
        String::from_utf8_lossy(&got).contains("job secret"),
        "{got:?}"
    );
    want.not_our_protocol += 1;
    refusals_reach(&ws[1], want).await;
    calls_are_correct(&ws).await;

    // Another secret: the client hears so, naming the server.
    let mut c = TcpStream::connect(&addr).await.unwrap();
    let server = c.peer_addr().unwrap();
    let deadline = Instant::now() + BOUND;
    let e = rallypoint_auth::io::tokio::client_handshake(
        &mut c,
        server,
        &secret(8),
        Service::RPC,
        deadline,
    )
    .await
    .unwrap_err();
    assert!(e.is_wrong_secret(), "{e}");
    assert!(e.to_string().contains("different job secret"), "{e}");
    want.wrong_proof += 1;
    refusals_reach(&ws[1], want).await;
    calls_are_correct(&ws).await;

    // Junk, and an HTTP request.
    for junk in [&[0xde; 64][..], b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"] {
        let mut c = TcpStream::connect(&addr).await.unwrap();
        c.write_all(junk).await.unwrap();
        read_to_close(&mut c).await;
        want.not_our_protocol += 1;
        refusals_reach(&ws[1], want).await;
    }
    calls_are_correct(&ws).await;

    // Half a handshake, then nothing: dropped at the 2 s deadline.
    let mut c = TcpStream::connect(&addr).await.unwrap();
    c.write_all(&client_hello()[..20]).await.unwrap();
    let got = read_to_close(&mut c).await;
    assert!(got.is_empty(), "nothing but the close: {got:?}");
    want.unfinished += 1;
    refusals_reach(&ws[1], want).await;
    calls_are_correct(&ws).await;
    assert_eq!(ws[0].refusals(), RefusalCounts::default());
    shutdown_all(ws).await;
}

/// Stalled handshakes do not hold the listener: while they wait (under a
/// deadline long enough that none expires during the test), a junk client
/// is refused and the workers' new connections (their bulk streams, opened
/// now) are admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_handshakes_hold_only_their_own_connections() {
    let s = secret(7);
    let ws: Vec<Rpc> = group_with(2, BackendType::tcp(), |_, o| {
        o.secret = Some(s.clone());
        o.tcp.secret_deadline = Duration::from_secs(120);
    })
    .await
    .into_iter()
    .map(|r| r.expect("init_rpc"))
    .collect();
    let addr = ws[1].address();
    let mut stalled = Vec::new();
    for i in 0..20 {
        let mut c = TcpStream::connect(&addr).await.unwrap();
        if i % 2 == 0 {
            c.write_all(&client_hello()[..20]).await.unwrap();
        }
        stalled.push(c);
    }
    let mut c = TcpStream::connect(&addr).await.unwrap();
    c.write_all(&[0xde; 64]).await.unwrap();
    read_to_close(&mut c).await;
    // A payload large enough for the bulk streams, which w0 opens now.
    let data = vec![3u8; 1 << 20];
    let (_, len, sum): (String, u64, u64) = ws[0]
        .rpc_sync("w1", "payload_info", &Payload::cpu(data.clone()))
        .await
        .unwrap();
    assert_eq!((len, sum), (data.len() as u64, checksum(&data)));
    calls_are_correct(&ws).await;
    // The stalled ones are still held, and none was counted.
    for c in &stalled {
        let mut b = [0u8; 1];
        match c.try_read(&mut b) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            other => panic!("a stalled connection was answered or closed: {other:?}"),
        }
    }
    let counts = ws[1].refusals();
    assert_eq!((counts.not_our_protocol, counts.unfinished), (1, 0));
    drop(stalled);
    refusals_reach(
        &ws[1],
        RefusalCounts {
            not_our_protocol: 1,
            unfinished: 20,
            ..Default::default()
        },
    )
    .await;
    shutdown_all(ws).await;
}

/// The bytes of an RPC call of `func` from worker 1 to worker 0 of
/// `generation`, as a worker without the secret would send them: hello, frame.
fn forged_call(generation: u64, func: &str) -> Vec<u8> {
    let hello = Hello {
        generation,
        from: 1,
        to: 0,
        stream: 0,
    };
    let env = wire::encode(&Envelope::Request {
        id: 1,
        req: Request::Call {
            func: func.to_owned(),
            sig: Default::default(),
        },
        args: wire::encode(&()).unwrap(),
        forks: Vec::new(),
    })
    .unwrap();
    let head = FrameHead {
        part: 0,
        parts: 1,
        env_len: env.len() as u32,
        msg: 1,
        bulk_total: 0,
        off: 0,
        len: 0,
    };
    let mut b = hello.encode().to_vec();
    b.extend_from_slice(&head.encode());
    b.extend_from_slice(&env);
    b
}

/// A group whose workers count calls of "mark" in `marks`.
async fn marked_group(
    store: Arc<dyn Store>,
    s: Option<JobSecret>,
    marks: &Arc<AtomicUsize>,
) -> Vec<Rpc> {
    let adjust = |_: usize, o: &mut RpcBackendOptions| {
        o.secret = s.clone();
        let m = marks.clone();
        o.functions
            .register("mark", move |(): ()| {
                m.fetch_add(1, SeqCst);
            })
            .unwrap();
    };
    group_on(store, 2, BackendType::tcp(), adjust)
        .await
        .into_iter()
        .map(|r| r.expect("init_rpc"))
        .collect()
}

async fn generation(store: &Arc<dyn Store>) -> u64 {
    let g = store.get("generation").await.unwrap();
    u64::from_str_radix(std::str::from_utf8(&g).unwrap(), 16).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_rpc_call_without_the_handshake_runs_nothing() {
    // Without a secret, the forged bytes are a call that runs (they are
    // well-formed: the check below could fail).
    let marks = Arc::new(AtomicUsize::new(0));
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let ws = marked_group(store.clone(), None, &marks).await;
    let mut c = TcpStream::connect(ws[0].address()).await.unwrap();
    c.write_all(&forged_call(generation(&store).await, "mark"))
        .await
        .unwrap();
    eventually("the forged call ran on a group without a secret", || {
        marks.load(SeqCst) == 1
    })
    .await;
    drop(c);
    shutdown_all(ws).await;

    // With one, the listener reads none of it: refused, nothing runs.
    let marks = Arc::new(AtomicUsize::new(0));
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let ws = marked_group(store.clone(), Some(secret(7)), &marks).await;
    let mut c = TcpStream::connect(ws[0].address()).await.unwrap();
    c.write_all(&forged_call(generation(&store).await, "mark"))
        .await
        .unwrap();
    read_to_close(&mut c).await;
    refusals_reach(
        &ws[0],
        RefusalCounts {
            not_our_protocol: 1,
            ..Default::default()
        },
    )
    .await;
    // The workers' own call runs, the forged one never did.
    let () = ws[1].rpc_sync("w0", "mark", &()).await.unwrap();
    assert_eq!(marks.load(SeqCst), 1, "only the workers' own call ran");
    calls_are_correct(&ws).await;
    shutdown_all(ws).await;
}

/// Every worker's init error, as text (panics if one started).
fn all_failed(rs: Vec<rallypoint_rpc::Result<Rpc>>) -> Vec<String> {
    rs.into_iter()
        .enumerate()
        .map(|(i, r)| match r {
            Err(e) => e.to_string(),
            Ok(_) => panic!("worker {i} started in a group it cannot reach"),
        })
        .collect()
}

/// A static group where w2 holds `odd` (another secret, or none): w2 fails
/// `init_rpc` at once, saying so (forming the group's process group, whose
/// connections prove RPC's secret), while the others wait for it as for
/// any rank that never came: until their set-up timeout, short here, and
/// w2's long, so that the whole finishing well before w2's proves w2 did
/// not wait for one.
async fn static_worker_fails_at_once(odd: Option<JobSecret>, says: &str) {
    let ours = secret(7);
    let t0 = Instant::now();
    let rs = group_with(3, BackendType::tcp(), |r, o| {
        if r == 2 {
            o.rpc_timeout = Duration::from_secs(600);
            o.secret = odd.clone();
        } else {
            o.rpc_timeout = Duration::from_secs(3);
            o.secret = Some(ours.clone());
        }
    })
    .await;
    let es = all_failed(rs);
    assert!(
        t0.elapsed() < Duration::from_secs(300),
        "w2 did not wait: {es:?}"
    );
    assert!(es[2].contains("\"w2\"") && es[2].contains(says), "{es:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_static_worker_with_another_secret_or_none_fails_init_at_once() {
    let theirs = secret(8);
    let ids = format!(
        "holds a different job secret (its key id {}, ours {})",
        secret(7).key_id(),
        theirs.key_id()
    );
    static_worker_fails_at_once(Some(theirs), &ids).await;
    static_worker_fails_at_once(None, "job secret").await;
}

/// A worker joining a dynamic group with another secret (or none) fails at
/// once, naming the secret; the member it tried is unharmed, counts it,
/// and was never told of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joining_worker_with_another_secret_or_none_fails_at_once() {
    let (ours, theirs) = (secret(7), secret(8));
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let opts = |s: Option<&JobSecret>| {
        let mut o = options();
        o.secret = s.cloned();
        o.rpc_timeout = Duration::from_secs(600);
        o
    };
    let join = |name: &'static str, rank: u32, o| {
        rallypoint_rpc::init_rpc_with_store(store.clone(), name, BackendType::tcp(), rank, None, o)
    };
    let a = join("a", 0, opts(Some(&ours))).await.unwrap();
    let t0 = Instant::now();
    let e = join("b", 1, opts(Some(&theirs)))
        .await
        .err()
        .expect("b started")
        .to_string();
    assert!(
        t0.elapsed() < Duration::from_secs(300),
        "not at a timeout: {e}"
    );
    let ids = format!(
        "holds a different job secret (its key id {}, ours {})",
        ours.key_id(),
        theirs.key_id()
    );
    assert!(
        e.contains("\"b\"") && e.contains("member \"a\"") && e.contains(&ids),
        "{e}"
    );
    // Without a secret: refused by RPC's answer, which says why.
    let e = join("c", 2, opts(None))
        .await
        .err()
        .expect("c started")
        .to_string();
    assert!(e.contains("job secret"), "{e}");
    refusals_reach(
        &a,
        RefusalCounts {
            wrong_proof: 1,
            not_our_protocol: 1,
            ..Default::default()
        },
    )
    .await;
    assert_eq!(a.workers().len(), 1, "a was told of nobody");
    let d = join("d", 3, opts(Some(&ours))).await.unwrap();
    let v: i64 = d.rpc_sync("a", "add", &(1i64, 2i64)).await.unwrap();
    assert_eq!(v, 3);
    let v: i64 = a.rpc_sync("d", "add", &(3i64, 4i64)).await.unwrap();
    assert_eq!(v, 7);
    for w in [d, a] {
        w.shutdown(true, Some(Duration::from_secs(20)))
            .await
            .unwrap();
    }
}

/// The variable the child below is run with.
const CHILD: &str = "RALLY_RPC_TEST_BAD_SECRET_CHILD";

/// `RALLY_JOB_SECRET_FILE` naming a file others may read fails `init_rpc`
/// with the file's error. In a child process: the variable is read once
/// per process, and would fail every other test of this binary.
#[test]
fn a_bad_secret_file_fails_init_saying_why() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("secret");
    std::fs::write(&path, [5u8; 32]).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "secret::bad_secret_file_child",
            "--ignored",
            "--nocapture",
        ])
        .env("RALLY_JOB_SECRET_FILE", &path)
        .env(CHILD, "1")
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("1 passed"), "the child ran: {text}");
}

/// Run by the test above only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run by a_bad_secret_file_fails_init_saying_why, with the variable set"]
async fn bad_secret_file_child() {
    assert_eq!(
        std::env::var(CHILD).as_deref(),
        Ok("1"),
        "run by its parent only"
    );
    let o = options();
    assert!(o.secret.is_none(), "a bad file is no secret");
    let rs = group_with(1, BackendType::tcp(), |_, _| {}).await;
    let e = all_failed(rs).remove(0);
    println!("init_rpc: {e}");
    assert!(
        e.contains("the job secret: RALLY_JOB_SECRET_FILE") && e.contains("mode 0644"),
        "{e}"
    );
}
