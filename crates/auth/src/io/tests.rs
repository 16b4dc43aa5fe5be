//! The adapters over in-memory streams (Unix socket pairs, tokio duplexes): a peer that stops
//! after every byte offset of its message times out naming how far it got; one that closes is
//! told apart; a good pair is admitted, and the stream's timeouts are put back.

use std::io::Write;
use std::net::SocketAddr;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use ::tokio::io::AsyncWriteExt;

use super::{blocking, tokio as tokio_io};
use crate::failure::TransportError;
use crate::failure::Waiting;
use crate::handshake::Step;
use crate::handshake::{Message, Service};
use crate::metrics::RefusalReason;
use crate::metrics::{Refusal, RefusalKind};
use crate::secret::JobSecret;

const SHORT: Duration = Duration::from_millis(30);

fn secret() -> JobSecret {
    JobSecret::from_bytes(vec![5; 32]).unwrap()
}

fn peer() -> SocketAddr {
    "10.0.0.3:51234".parse().unwrap()
}

/// A good exchange's HELLO and PROOF, and its CHALLENGE, recorded over a socket pair.
fn recorded() -> (Vec<u8>, Vec<u8>) {
    let k = secret();
    let mut c = crate::handshake::ClientHandshake::new(&k, Service::STORE).unwrap();
    let Ok(Step::Write { bytes: hello, .. }) = c.step() else {
        panic!()
    };
    let mut s = crate::handshake::ServerHandshake::new(&k, Service::STORE).unwrap();
    s.receive(&hello);
    let Ok(Step::Write {
        bytes: challenge, ..
    }) = s.step()
    else {
        panic!()
    };
    (hello, challenge)
}

fn receiving(r: &Refusal) -> (Message, usize) {
    match &r.reason {
        RefusalReason::Transport(TransportError::TimedOut {
            waiting: Waiting::Receiving(p),
            ..
        })
        | RefusalReason::Transport(TransportError::Closed {
            waiting: Waiting::Receiving(p),
        }) => (p.message, p.got),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_client_that_stops_at_any_byte_of_its_hello_times_out_saying_how_far_it_got() {
    let (hello, _) = recorded();
    for k in 0..hello.len() {
        let (mut client, mut server) = UnixStream::pair().unwrap();
        client.write_all(&hello[..k]).unwrap();
        let start = Instant::now();
        let deadline = start + SHORT;
        let r =
            blocking::server_handshake(&mut server, peer(), &secret(), Service::STORE, deadline)
                .unwrap_err();
        assert!(Instant::now() >= deadline, "gave up early at {k}");
        assert_eq!(receiving(&r), (Message::Hello, k));
        assert_eq!(r.kind(), RefusalKind::Unfinished);
        assert!(matches!(
            r.reason,
            RefusalReason::Transport(TransportError::TimedOut { .. })
        ));
        let line = r.to_string();
        assert!(line.contains("10.0.0.3:51234"), "{line}");
        assert!(line.contains(&format!("got {k} of")), "{line}");
        assert!(line.contains(" ms (waiting for its HELLO: got "), "{line}");
        // The socket's own timeouts are back.
        assert_eq!(server.read_timeout().unwrap(), None);
        assert_eq!(server.write_timeout().unwrap(), None);
    }
}

#[test]
fn a_client_that_closes_mid_hello_is_told_apart_from_one_that_stalls() {
    let (hello, _) = recorded();
    let (mut client, mut server) = UnixStream::pair().unwrap();
    client.write_all(&hello[..20]).unwrap();
    drop(client);
    let deadline = Instant::now() + Duration::from_secs(60);
    let r = blocking::server_handshake(&mut server, peer(), &secret(), Service::STORE, deadline)
        .unwrap_err();
    assert!(matches!(
        r.reason,
        RefusalReason::Transport(TransportError::Closed { .. })
    ));
    assert_eq!(receiving(&r), (Message::Hello, 20));
    assert!(r.to_string().contains("closed the connection"), "{r}");
}

#[test]
fn a_server_that_stops_at_any_byte_of_its_challenge_times_out_the_client() {
    let (_, challenge) = recorded();
    let server_addr: SocketAddr = "10.0.0.1:29500".parse().unwrap();
    for k in 0..challenge.len() {
        let (mut client, mut server) = UnixStream::pair().unwrap();
        server.write_all(&challenge[..k]).unwrap();
        let deadline = Instant::now() + SHORT;
        let e = blocking::client_handshake(
            &mut client,
            server_addr,
            &secret(),
            Service::STORE,
            deadline,
        )
        .unwrap_err();
        assert!(Instant::now() >= deadline);
        let text = e.to_string();
        assert!(
            text.starts_with(
                "the server at 10.0.0.1:29500 did not finish the job-secret handshake within "
            ),
            "{text}"
        );
        assert!(
            text.contains(&format!(" ms (waiting for its CHALLENGE: got {k} of")),
            "{text}"
        );
    }
}

#[test]
fn a_server_that_closes_at_once_reads_as_one_without_a_secret() {
    let (mut client, server) = UnixStream::pair().unwrap();
    drop(server);
    let deadline = Instant::now() + Duration::from_secs(60);
    let e = blocking::client_handshake(&mut client, peer(), &secret(), Service::STORE, deadline)
        .unwrap_err();
    let text = e.to_string();
    assert!(text.contains("without a job secret"), "{text}");
}

#[test]
fn a_blocking_pair_is_admitted_and_keeps_its_timeouts() {
    let (mut client, mut server) = UnixStream::pair().unwrap();
    server
        .set_read_timeout(Some(Duration::from_secs(77)))
        .unwrap();
    let k = secret();
    let k2 = k.clone();
    let deadline = Instant::now() + Duration::from_secs(60);
    let t = std::thread::spawn(move || {
        blocking::client_handshake(&mut client, peer(), &k2, Service::STORE, deadline)
    });
    blocking::server_handshake(&mut server, peer(), &k, Service::STORE, deadline).unwrap();
    t.join().unwrap().unwrap();
    assert_eq!(
        server.read_timeout().unwrap(),
        Some(Duration::from_secs(77))
    );
}

#[::tokio::test]
async fn tokio_a_client_that_stops_at_any_byte_of_its_hello_times_out() {
    let (hello, _) = recorded();
    for k in 0..hello.len() {
        let (mut client, mut server) = ::tokio::io::duplex(256);
        client.write_all(&hello[..k]).await.unwrap();
        let deadline = Instant::now() + SHORT;
        let r =
            tokio_io::server_handshake(&mut server, peer(), &secret(), Service::STORE, deadline)
                .await
                .unwrap_err();
        assert!(Instant::now() >= deadline - Duration::from_millis(1));
        assert_eq!(receiving(&r), (Message::Hello, k));
        assert!(
            r.to_string().contains(" ms (waiting for its HELLO: got "),
            "{r}"
        );
        drop(client);
    }
}

#[::tokio::test]
async fn tokio_a_pair_is_admitted_and_a_wrong_secret_refused_on_both_sides() {
    let (mut client, mut server) = ::tokio::io::duplex(256);
    let k = secret();
    let deadline = Instant::now() + Duration::from_secs(60);
    let (c, s) = ::tokio::join!(
        tokio_io::client_handshake(&mut client, peer(), &k, Service::STORE, deadline),
        tokio_io::server_handshake(&mut server, peer(), &k, Service::STORE, deadline),
    );
    c.unwrap();
    s.unwrap();
    // Both streams now carry the service's bytes, with nothing of the handshake left over.
    client.write_all(b"app").await.unwrap();
    let mut got = [0; 3];
    ::tokio::io::AsyncReadExt::read_exact(&mut server, &mut got)
        .await
        .unwrap();
    assert_eq!(&got, b"app");

    let (mut client, mut server) = ::tokio::io::duplex(256);
    let other = JobSecret::from_bytes(vec![6; 32]).unwrap();
    let (c, s) = ::tokio::join!(
        tokio_io::client_handshake(&mut client, peer(), &other, Service::STORE, deadline),
        tokio_io::server_handshake(&mut server, peer(), &k, Service::STORE, deadline),
    );
    assert!(c.unwrap_err().is_wrong_secret());
    assert_eq!(s.unwrap_err().kind(), RefusalKind::WrongProof);
}
