//! The job secret on the store (issue 49): a server with a secret admits only
//! clients that prove it; a wrong secret, none, a half-finished handshake and
//! a flood are refused quickly, counted, and harm no admitted client; the
//! loopback proxy carries PyTorch's own client (real torch) to such a
//! server.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use rallypoint_store::proxy::Proxy;
use rallypoint_store::secret::JobSecret;
use rallypoint_store::server::{ServerConfig, ServerHandle};
use rallypoint_store::{Store, StoreError, TcpStore};

use crate::support::{raw_unvalidated, server_with};

/// Every wait of these tests; far above what any step needs.
const LIMIT: Duration = Duration::from_secs(20);

fn secret(fill: u8) -> JobSecret {
    JobSecret::from_bytes(vec![fill; 32]).unwrap()
}

async fn protected(secret: JobSecret, handshake: Duration) -> ServerHandle {
    server_with(ServerConfig {
        secret: Some(secret),
        handshake_deadline: handshake,
        ..ServerConfig::default()
    })
    .await
}

fn client(server: &ServerHandle, secret: Option<JobSecret>) -> rallypoint_store::TcpStoreBuilder {
    TcpStore::builder("127.0.0.1", server.local_addr().port())
        .timeout(LIMIT)
        .secret(secret)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_client_with_the_secret_gets_in_and_the_others_fail_at_once() {
    let server = protected(secret(1), Duration::from_secs(2)).await;
    let good = client(&server, Some(secret(1))).connect().await.unwrap();
    good.set("k", b"v").await.unwrap();
    assert_eq!(good.get("k").await.unwrap(), b"v");

    // A different secret: final at once, naming both key ids.
    let t0 = Instant::now();
    let wrong = client(&server, Some(secret(2)))
        .connect()
        .await
        .unwrap_err();
    assert!(matches!(wrong, StoreError::WrongSecret { .. }), "{wrong}");
    let text = wrong.to_string();
    assert!(text.contains("different job secret"), "{text}");
    assert!(text.contains(&secret(1).key_id().to_string()), "{text}");
    assert!(text.contains(&secret(2).key_id().to_string()), "{text}");
    // No secret: final at once, saying a secret is needed.
    let none = client(&server, None).connect().await.unwrap_err();
    assert!(matches!(none, StoreError::SecretRequired { .. }), "{none}");
    assert!(
        t0.elapsed() < LIMIT / 2,
        "refused by the handshake, not by a timeout: {:?}",
        t0.elapsed()
    );
    let refused = server.stats().refused;
    assert_eq!(
        (refused.wrong_proof, refused.not_our_protocol),
        (1, 1),
        "{refused:?}"
    );
    // The admitted client never noticed.
    assert_eq!(good.get("k").await.unwrap(), b"v");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_finished_handshakes_and_a_flood_are_dropped_and_harm_no_one() {
    let deadline = Duration::from_millis(300);
    let server = protected(secret(1), deadline).await;
    let good = client(&server, Some(secret(1))).connect().await.unwrap();
    let addr = server.local_addr();
    // 100 connections that send half a HELLO and stall, and 100 of junk.
    let mut stalled = Vec::new();
    for i in 0..200 {
        let mut s = raw_unvalidated(addr);
        let bytes: &[u8] = if i % 2 == 0 {
            b"RALLYAU1\x05st"
        } else {
            b"GET / HTTP/1.1\r\n\r\n"
        };
        s.write_all(bytes).unwrap();
        stalled.push(s);
    }
    // The admitted client is served meanwhile.
    for i in 0..50 {
        good.set(&format!("k{i}"), b"v").await.unwrap();
    }
    // Every stalled one is closed at the deadline (a wide margin), the junk
    // at once.
    let t0 = Instant::now();
    for mut s in stalled {
        s.set_read_timeout(Some(LIMIT)).unwrap();
        let mut buf = [0u8; 64];
        loop {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
    }
    assert!(t0.elapsed() < deadline + LIMIT / 2, "{:?}", t0.elapsed());
    let refused = server.stats().refused;
    assert_eq!(refused.unfinished, 100, "{refused:?}");
    assert_eq!(refused.not_our_protocol, 100, "{refused:?}");
    assert_eq!(good.num_keys().await.unwrap(), 50);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_with_a_secret_against_a_server_without_one_is_told() {
    let server = server_with(ServerConfig {
        secret: None,
        ..ServerConfig::default()
    })
    .await;
    let err = client(&server, Some(secret(1)))
        .timeout(Duration::from_secs(2))
        .connect()
        .await
        .unwrap_err();
    let text = format!(
        "{err}: {}",
        std::error::Error::source(&err)
            .map(|s| s.to_string())
            .unwrap_or_default()
    );
    assert!(text.contains("without a job secret"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_carries_a_client_without_the_secret_to_the_store() {
    let server = protected(secret(1), Duration::from_secs(2)).await;
    let upstream = server.local_addr().to_string();
    let proxy = Proxy::start(&upstream, secret(1)).await.unwrap();
    let at = proxy.local_addr();
    assert!(at.ip().is_loopback());
    let plain = TcpStore::builder("127.0.0.1", at.port())
        .timeout(LIMIT)
        .secret(None)
        .connect()
        .await
        .unwrap();
    plain.set("through", b"proxy").await.unwrap();
    let direct = client(&server, Some(secret(1))).connect().await.unwrap();
    assert_eq!(direct.get("through").await.unwrap(), b"proxy");
    // A wait through the proxy is woken by a set made directly.
    let waiting = tokio::spawn(async move { plain.get("later").await });
    direct.set("later", b"x").await.unwrap();
    assert_eq!(waiting.await.unwrap().unwrap(), b"x");
    assert_eq!(server.stats().refused.total(), 0);

    // A proxy with the wrong secret admits nobody: its connections close.
    let bad = Proxy::start(&upstream, secret(2)).await.unwrap();
    let err = TcpStore::builder("127.0.0.1", bad.local_addr().port())
        .timeout(Duration::from_secs(2))
        .secret(None)
        .connect()
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Connect { .. }), "{err}");
    assert!(bad.stats().failed >= 1, "{:?}", bad.stats());
    proxy.shutdown().await;
}
