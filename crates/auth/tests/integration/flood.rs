//! 200 junk connections held open at once do not keep a good client out: each connection's
//! handshake runs on its own thread or task.

use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

use rallypoint_auth::RefusalKind;

use crate::server::{secret, std_client, Event, TestServer, KINDS};

const JUNK: usize = 200;

#[test]
fn two_hundred_junk_connections_do_not_keep_a_good_client_out() {
    for kind in KINDS {
        // The junk would hold the listener far longer than the good client's own deadline
        // (30 s) if a stalled handshake could block another's.
        let server = TestServer::start(kind, secret(1), Duration::from_secs(120));
        let mut junk = Vec::new();
        for i in 0..JUNK {
            let mut conn = TcpStream::connect(server.addr).unwrap();
            match i % 4 {
                0 => {}                                                  // silent
                1 => conn.write_all(b"RALLYAU1\x05sto").unwrap(),        // half a HELLO
                2 => conn.write_all(b"RALLYAU1\x05store").unwrap(),      // no nonce
                _ => conn.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap(), // a stranger
            }
            junk.push(conn);
        }
        // The strangers are refused at once, with the others still open.
        for _ in 0..JUNK / 4 {
            server.refusal(RefusalKind::NotOurProtocol, Duration::from_secs(60));
        }
        std_client(server.addr, &secret(1)).unwrap();
        assert!(
            matches!(server.event(Duration::from_secs(60)), Event::Admitted),
            "{kind:?}"
        );
        // The stalled ones end when their clients close.
        drop(junk);
        for _ in 0..JUNK * 3 / 4 {
            server.refusal(RefusalKind::Unfinished, Duration::from_secs(60));
        }
        let counts = server.refusals.snapshot();
        assert_eq!(counts.not_our_protocol, (JUNK / 4) as u64);
        assert_eq!(counts.unfinished, (JUNK * 3 / 4) as u64);
        assert_eq!(counts.total(), JUNK as u64);
    }
}
