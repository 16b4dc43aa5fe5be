//! One client at a time against each listener: good, wrong secret, wrong service, half a
//! HELLO, PyTorch's TCPStore client, an HTTP request, and a tokio client.

use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use rallypoint_auth::io::{blocking, tokio as tokio_io};
use rallypoint_auth::{ClientFailure, RefusalKind, ServerMismatch, Service};

use crate::server::{ping, secret, std_client, wait_closed, Event, TestServer, KINDS};

const LONG: Duration = Duration::from_secs(60);
const MARGIN: Duration = Duration::from_secs(20);

#[test]
fn a_client_with_the_secret_is_admitted_and_its_bytes_go_through() {
    for kind in KINDS {
        let server = TestServer::start(kind, secret(1), LONG);
        std_client(server.addr, &secret(1)).unwrap();
        assert!(matches!(server.event(MARGIN), Event::Admitted), "{kind:?}");
        assert_eq!(server.refusals.snapshot().total(), 0);
    }
}

#[test]
fn a_client_with_another_secret_is_refused_by_the_handshake_not_a_timeout() {
    for kind in KINDS {
        // Deadlines far longer than the test's waits: a refusal seen is the handshake's.
        let server = TestServer::start(kind, secret(1), LONG);
        let err = std_client(server.addr, &secret(2)).unwrap_err();
        assert!(err.is_wrong_secret(), "{kind:?}: {err}");
        let text = err.to_string();
        let (ours, theirs) = (secret(2).key_id(), secret(1).key_id());
        assert_eq!(
            text,
            format!(
                "the server at {} holds a different job secret (its key id {theirs}, ours {ours})",
                server.addr
            )
        );
        let line = server.refusal(RefusalKind::WrongProof, MARGIN);
        assert!(line.contains("it holds a different job secret"), "{line}");
        assert!(line.contains("127.0.0.1:"), "{line}");
        assert_eq!(server.refusals.snapshot().wrong_proof, 1);
    }
}

#[test]
fn a_client_of_another_service_is_told_which_service_this_is() {
    for kind in KINDS {
        let server = TestServer::start(kind, secret(1), LONG);
        let mut conn = TcpStream::connect(server.addr).unwrap();
        let deadline = Instant::now() + LONG;
        let err = blocking::client_handshake(
            &mut conn,
            server.addr,
            &secret(1),
            Service::RENDEZVOUS,
            deadline,
        )
        .unwrap_err();
        assert!(matches!(
            err.reason,
            ClientFailure::Mismatch(ServerMismatch::WrongService { .. })
        ));
        let line = server.refusal(RefusalKind::WrongService, MARGIN);
        assert!(line.contains("\"rendezvous\""), "{line}");
    }
}

#[test]
fn a_client_that_sends_half_its_hello_and_stalls_is_dropped_at_the_deadline() {
    let deadline = Duration::from_millis(500);
    for kind in KINDS {
        let server = TestServer::start(kind, secret(1), deadline);
        let mut conn = TcpStream::connect(server.addr).unwrap();
        let start = Instant::now();
        // "RALLYAU1", the length of "store" and 14 bytes of the nonce: 28 of 46.
        conn.write_all(b"RALLYAU1\x05store01234567890123").unwrap();
        let line = server.refusal(RefusalKind::Unfinished, deadline + MARGIN);
        assert!(start.elapsed() < deadline + MARGIN);
        assert!(
            line.contains("it sent no complete job-secret handshake within 500 ms (waiting for its HELLO: got 28 of 46 bytes)"),
            "{kind:?}: {line}"
        );
        wait_closed(&mut conn, MARGIN);
        assert_eq!(server.refusals.snapshot().unfinished, 1);
    }
}

#[test]
fn pytorch_tcpstore_and_http_clients_are_refused_at_once() {
    let tcpstore: &[u8] = &[0x00, 0xce, 0xf7, 0x85, 0x3c];
    let http: &[u8] = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
    for kind in KINDS {
        // A deadline far beyond the test's waits: the refusal is not a timeout.
        let server = TestServer::start(kind, secret(1), LONG);
        for (bytes, hint) in [(tcpstore, "TCPStore"), (http, "an HTTP request?")] {
            let mut conn = TcpStream::connect(server.addr).unwrap();
            conn.write_all(bytes).unwrap();
            let line = server.refusal(RefusalKind::NotOurProtocol, MARGIN);
            assert!(line.contains(hint), "{line}");
            wait_closed(&mut conn, MARGIN);
        }
        assert_eq!(server.refusals.snapshot().not_our_protocol, 2);
    }
}

#[test]
fn a_tokio_client_is_admitted_and_one_with_another_secret_refused() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    for kind in KINDS {
        let server = TestServer::start(kind, secret(1), LONG);
        let addr = server.addr;
        rt.block_on(async {
            let deadline = Instant::now() + LONG;
            let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
            tokio_io::client_handshake(&mut conn, addr, &secret(1), Service::STORE, deadline)
                .await
                .unwrap();
            let mut conn = conn.into_std().unwrap();
            conn.set_nonblocking(false).unwrap();
            ping(&mut conn);
            let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
            let err =
                tokio_io::client_handshake(&mut conn, addr, &secret(3), Service::STORE, deadline)
                    .await
                    .unwrap_err();
            assert!(err.is_wrong_secret(), "{err}");
        });
        assert!(matches!(server.event(MARGIN), Event::Admitted));
        server.refusal(RefusalKind::WrongProof, MARGIN);
    }
}
