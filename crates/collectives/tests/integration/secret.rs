//! The job secret (`Options::secret`): ranks that hold it form a group and
//! run collectives as ever; an outsider at a rank's listener (no secret,
//! another secret, half a handshake then a stall, junk) is refused, counted,
//! and harms nothing; a rank with another secret, or none, fails at once
//! saying so, never at a timeout.

use std::sync::Arc;
use std::time::Duration;

use rallypoint_auth::io::tokio::client_handshake;
use rallypoint_auth::io::{CLIENT_DEADLINE, SERVER_DEADLINE};
use rallypoint_auth::Service;
use rallypoint_collectives::wire::{Hello, REFUSED};
use rallypoint_collectives::{Error, JobSecret, Options, ProcessGroup, ReduceOp, RefusalCounts};
use rallypoint_store::{MemoryStore, Store};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::timeout;

use crate::fake_peer::PREFIX;
use crate::harness::{data, each, group_on, opts};

/// A wide margin for what happens at once or at the server's 2 s
/// deadline: a bound for a hang, not a speed.
const MARGIN: Duration = Duration::from_secs(30);

fn secret(byte: u8) -> JobSecret {
    JobSecret::from_bytes(vec![byte; 32]).unwrap()
}

/// Over TCP (ranks in one process would share memory), with `secret`.
fn with(secret: Option<JobSecret>) -> Options {
    Options {
        secret: Ok(secret),
        shared_memory: false,
        timeout: Duration::from_secs(120),
        ..opts()
    }
}

/// Sums `data` over the group, checked on every rank against the sum
/// computed here.
async fn check_all_reduce(pgs: &[ProcessGroup], seed: u64) {
    let (n, len) = (pgs.len(), 4099);
    let want: Vec<f32> = (0..len)
        .map(|i| (0..n).map(|r| data::<f32>(seed, r, len)[i]).sum())
        .collect();
    let got = each(pgs, move |pg| async move {
        let mut v = data::<f32>(seed, pg.rank(), len);
        pg.all_reduce(&mut v, ReduceOp::Sum).await.map(|()| v)
    })
    .await;
    for (r, v) in got.into_iter().enumerate() {
        let v = v.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert_eq!(v, want, "rank {r}");
    }
}

/// Where rank `r` listens, as the bootstrap published it in the store.
async fn published(store: &Arc<dyn Store>, r: usize) -> std::net::SocketAddr {
    let raw = store.get(&format!("{PREFIX}addr/{r}")).await.unwrap();
    String::from_utf8(raw).unwrap().parse().unwrap()
}

/// Reads until the listener closes the connection (EOF, or a reset of
/// bytes it left unread); what it sent before.
async fn until_closed(s: &mut TcpStream, what: &str) -> Vec<u8> {
    let mut got = Vec::new();
    let read = timeout(MARGIN, async {
        let mut buf = [0u8; 256];
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    });
    read.await
        .unwrap_or_else(|_| panic!("{what}: still open after {MARGIN:?}"));
    got
}

/// The answer a collectives hello gets: its status and reason.
fn hello_answer(bytes: &[u8]) -> (u8, String) {
    assert!(bytes.len() >= 3, "a hello's answer, got {bytes:?}");
    let n = usize::from(u16::from_le_bytes([bytes[1], bytes[2]]));
    (
        bytes[0],
        String::from_utf8_lossy(&bytes[3..3 + n]).into_owned(),
    )
}

/// A rank's hello, as a member without the secret would send it.
fn plain_hello(dst: u32) -> Vec<u8> {
    Hello {
        nonce: 1,
        layout: 0,
        world: 3,
        src: (dst + 1) % 3,
        dst,
        name: "default_pg".into(),
    }
    .encode()
}

fn counts(pgs: &[ProcessGroup]) -> Vec<RefusalCounts> {
    pgs.iter().map(ProcessGroup::secret_refusals).collect()
}

#[tokio::test]
async fn ranks_with_the_secret_all_reduce_while_outsiders_are_refused_and_counted() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let pgs = group_on(store.clone(), 3, with(Some(secret(1)))).await;
    let addrs = [
        published(&store, 0).await,
        published(&store, 1).await,
        published(&store, 2).await,
    ];
    // Stalled outsiders first, several at each rank, each half a HELLO:
    // held open while the ranks connect to each other for the first time.
    let mut stalled = Vec::new();
    for addr in addrs {
        for _ in 0..4 {
            let mut s = TcpStream::connect(addr).await.unwrap();
            s.write_all(b"RALLYAU1\x0bcoll").await.unwrap();
            stalled.push(s);
        }
    }
    check_all_reduce(&pgs, 1).await;
    assert!(pgs.iter().all(|pg| pg.handshakes() >= 1), "ranks connected");

    for (r, addr) in addrs.into_iter().enumerate() {
        // No secret: a member's plain hello is told why.
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(&plain_hello(r as u32)).await.unwrap();
        let (status, why) = hello_answer(&until_closed(&mut s, "a plain hello").await);
        assert_eq!(status, REFUSED);
        assert!(why.contains("prove the job secret"), "{why}");

        // Another secret: refused by the handshake, saying so.
        let mut s = TcpStream::connect(addr).await.unwrap();
        let deadline = std::time::Instant::now() + CLIENT_DEADLINE;
        let e = client_handshake(&mut s, addr, &secret(2), Service::COLLECTIVES, deadline)
            .await
            .unwrap_err();
        assert!(e.is_wrong_secret(), "{e}");
        assert!(
            e.to_string().contains("holds a different job secret"),
            "{e}"
        );
        // Closed once the listener has counted it.
        until_closed(&mut s, "another secret").await;

        // Junk: dropped.
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        until_closed(&mut s, "junk").await;
    }
    // Each stalled outsider is dropped at the server's deadline.
    for s in &mut stalled {
        until_closed(s, "a stalled handshake").await;
    }
    for (r, c) in counts(&pgs).into_iter().enumerate() {
        let want = RefusalCounts {
            wrong_proof: 1,
            not_our_protocol: 2,
            unfinished: 4,
            wrong_service: 0,
        };
        assert_eq!(c, want, "rank {r}");
        assert_eq!(pgs[r].refused_connections(), 7, "rank {r}");
    }
    // Nothing of it touched the group.
    check_all_reduce(&pgs, 2).await;
    assert!(pgs.iter().all(|pg| pg.aborted().is_none()));
    assert!(SERVER_DEADLINE < MARGIN);
}

#[tokio::test]
async fn a_rank_with_another_secret_or_none_fails_forming_the_group_at_once() {
    for (odd, want) in [
        (Some(secret(2)), "rank 0 holds a different job secret"),
        (None, "rank 0 holds a job secret"),
    ] {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let good = with(Some(secret(1)));
        let first = tokio::spawn(ProcessGroup::new(store.clone(), 0, 3, good.clone()));
        let second = tokio::spawn(ProcessGroup::new(store.clone(), 1, 3, good));
        let third = ProcessGroup::new(store.clone(), 2, 3, with(odd));
        let e = timeout(MARGIN, third)
            .await
            .expect("fails at once, not at the timeout")
            .err()
            .expect("a rank with another secret is refused");
        assert!(matches!(e, Error::Setup { .. }), "{e}");
        assert!(e.to_string().contains(want), "{e}");
        first.await.unwrap().unwrap();
        second.await.unwrap().unwrap();
    }
    // Rank 0 without one, the others with: they say so.
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    ProcessGroup::new(store.clone(), 0, 2, with(None))
        .await
        .unwrap();
    let e = ProcessGroup::new(store, 1, 2, with(Some(secret(1))))
        .await
        .err()
        .expect("refused");
    assert!(e.to_string().contains("and rank 0 none"), "{e}");
}

#[tokio::test]
async fn a_bad_secret_file_fails_forming_the_group_with_its_reason() {
    let o = Options {
        secret: Err("RALLY_JOB_SECRET_FILE: /x is readable by others".into()),
        ..with(None)
    };
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let e = ProcessGroup::new(store, 0, 2, o)
        .await
        .err()
        .expect("refused");
    assert_eq!(
        e.to_string(),
        "setting up group \"default_pg\": reading the job secret: RALLY_JOB_SECRET_FILE: /x is readable by others"
    );
}

/// Members of a generation (no rank 0 record to compare) with `secrets`.
async fn generation(secrets: [Option<JobSecret>; 2]) -> Vec<ProcessGroup> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let tasks: Vec<_> = secrets
        .into_iter()
        .enumerate()
        .map(|(g, s)| {
            let o = Options {
                prefix: "gen0".into(),
                ..with(s)
            };
            tokio::spawn(ProcessGroup::next_generation(None, store.clone(), g, 2, o))
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap().expect("the generation forms"));
    }
    out
}

#[tokio::test]
async fn a_member_with_another_secret_or_none_fails_its_first_op_at_once_saying_so() {
    for (secrets, wants) in [
        (
            [Some(secret(1)), Some(secret(2))],
            ["holds a different job secret"; 2],
        ),
        (
            [Some(secret(1)), None],
            [
                "does that rank run without the job secret?",
                "prove the job secret",
            ],
        ),
    ] {
        let pgs = generation(secrets).await;
        let got = timeout(
            MARGIN,
            each(&pgs, |pg| async move {
                let mut v = vec![1.0f32; 16];
                pg.all_reduce(&mut v, ReduceOp::Sum).await
            }),
        )
        .await
        .expect("fails at once, not at the timeout");
        for (g, (r, want)) in got.into_iter().zip(wants).enumerate() {
            let e = r.err().unwrap_or_else(|| panic!("member {g} is refused"));
            assert!(!matches!(e, Error::Timeout { .. }), "member {g}: {e}");
            assert!(e.to_string().contains(want), "member {g}: {e}");
        }
    }
}
