//! The two machines against each other in memory, and against a recorder, a replayer, a
//! tamperer and strangers.

use std::collections::VecDeque;

use proptest::prelude::*;

use super::wire::{self, Nonce};
use super::*;
use crate::failure::{ClientError, ClientFailure};
use crate::metrics::{Refusal, RefusalReason};
use crate::secret::JobSecret;

fn secret(tag: u8) -> JobSecret {
    JobSecret::from_bytes(vec![tag; 32]).unwrap()
}

/// What an exchange came to, with every message each side wrote.
#[derive(Default)]
struct Exchange {
    client: Option<Result<(), ServerMismatch>>,
    server: Option<Result<(), Rejection>>,
    to_server: Vec<Vec<u8>>,
    to_client: Vec<Vec<u8>>,
}

/// One side as the exchange drives it.
trait Side {
    type Error;
    fn step(&mut self) -> Result<Step, Self::Error>;
    fn receive(&mut self, bytes: &[u8]);
}

impl Side for ClientHandshake {
    type Error = ServerMismatch;
    fn step(&mut self) -> Result<Step, ServerMismatch> {
        ClientHandshake::step(self)
    }
    fn receive(&mut self, bytes: &[u8]) {
        ClientHandshake::receive(self, bytes)
    }
}

impl Side for ServerHandshake {
    type Error = Rejection;
    fn step(&mut self) -> Result<Step, Rejection> {
        ServerHandshake::step(self)
    }
    fn receive(&mut self, bytes: &[u8]) {
        ServerHandshake::receive(self, bytes)
    }
}

/// One turn of a side: take one chunk of its inbox, then step once. Whether anything moved.
fn turn<S: Side>(
    side: &mut S,
    inbox: &mut VecDeque<Vec<u8>>,
    outcome: &mut Option<Result<(), S::Error>>,
    wrote: &mut Vec<Vec<u8>>,
) -> bool {
    let mut moved = false;
    if let Some(chunk) = inbox.pop_front() {
        side.receive(&chunk);
        moved = true;
    }
    if outcome.is_none() {
        match side.step() {
            Ok(Step::Write { bytes, .. }) => {
                wrote.push(bytes);
                return true;
            }
            Ok(Step::Read(_)) => {}
            Ok(Step::Done) => *outcome = Some(Ok(())),
            Err(e) => *outcome = Some(Err(e)),
        }
        moved |= outcome.is_some();
    }
    moved
}

/// Runs both machines until neither can go on. `tamper` may change each message to the
/// server; every message is delivered in chunks cut at `cuts` (modulo its length).
fn exchange_chunked(
    c: &mut ClientHandshake,
    s: &mut ServerHandshake,
    tamper: impl Fn(&mut Vec<u8>),
    cuts: &[usize],
) -> Exchange {
    let mut x = Exchange::default();
    let (mut to_c, mut to_s) = (VecDeque::new(), VecDeque::new());
    loop {
        let before = (x.to_server.len(), x.to_client.len());
        let mut moved = turn(c, &mut to_c, &mut x.client, &mut x.to_server);
        moved |= turn(s, &mut to_s, &mut x.server, &mut x.to_client);
        if x.to_server.len() > before.0 {
            let msg = x.to_server.last_mut().unwrap();
            tamper(msg);
            to_s.extend(chunks(msg, cuts));
        }
        if x.to_client.len() > before.1 {
            to_c.extend(chunks(x.to_client.last().unwrap(), cuts));
        }
        if !moved {
            return x;
        }
    }
}

fn exchange_with(
    c: &mut ClientHandshake,
    s: &mut ServerHandshake,
    tamper: impl Fn(&mut Vec<u8>),
) -> Exchange {
    exchange_chunked(c, s, tamper, &[])
}

fn exchange(c: &mut ClientHandshake, s: &mut ServerHandshake) -> Exchange {
    exchange_with(c, s, |_| {})
}

fn pair(cs: &JobSecret, ss: &JobSecret) -> (ClientHandshake, ServerHandshake) {
    (
        ClientHandshake::new(cs, Service::STORE).unwrap(),
        ServerHandshake::new(ss, Service::STORE).unwrap(),
    )
}

#[test]
fn the_same_secret_admits_in_four_messages() {
    let k = secret(1);
    let (mut c, mut s) = pair(&k, &k);
    let x = exchange(&mut c, &mut s);
    assert_eq!(x.client, Some(Ok(())));
    assert_eq!(x.server, Some(Ok(())));
    let lens = |m: &Vec<Vec<u8>>| m.iter().map(Vec::len).collect::<Vec<_>>();
    assert_eq!(lens(&x.to_server), [8 + 1 + 5 + 32, wire::PROOF_MSG_LEN]);
    assert_eq!(lens(&x.to_client), [wire::CHALLENGE_LEN, 1]);
    assert_eq!(x.to_client[1], [wire::ADMITTED]);
    assert!(c.leftover().is_empty() && s.leftover().is_empty());
    // Done stays done.
    assert_eq!(c.step(), Ok(Step::Done));
    assert_eq!(s.step(), Ok(Step::Done));
}

#[test]
fn a_different_secret_fails_on_both_sides_naming_both_key_ids() {
    let (ck, sk) = (secret(1), secret(2));
    let (mut c, mut s) = pair(&ck, &sk);
    let x = exchange(&mut c, &mut s);
    let (ours, theirs) = (ck.key_id(), sk.key_id());
    assert_eq!(
        x.client,
        Some(Err(ServerMismatch::DifferentSecret { theirs, ours }))
    );
    // The client sent its proof anyway, so the server logs a wrong secret, not a hang-up,
    // and did not wait for the verdict.
    assert_eq!(
        x.server,
        Some(Err(Rejection::WrongProof {
            theirs: ours,
            ours: theirs
        }))
    );
    assert_eq!(x.to_client.last().unwrap(), &[wire::REFUSED]);
    let client_err = ClientError {
        server: "10.0.0.1:29500".parse().unwrap(),
        reason: ClientFailure::Mismatch(x.client.unwrap().unwrap_err()),
    };
    assert!(client_err.is_wrong_secret());
    assert_eq!(
        client_err.to_string(),
        format!("the server at 10.0.0.1:29500 holds a different job secret (its key id {theirs}, ours {ours})")
    );
    let refusal = Refusal {
        peer: "10.0.0.3:51234".parse().unwrap(),
        reason: RefusalReason::Rejected(x.server.unwrap().unwrap_err()),
    };
    assert_eq!(
        refusal.to_string(),
        format!("refused a connection from 10.0.0.3:51234: it holds a different job secret (its key id {ours}, ours {theirs})")
    );
}

#[test]
fn a_proof_changed_on_the_way_is_refused_and_the_client_told_at_once() {
    let k = secret(1);
    let (mut c, mut s) = pair(&k, &k);
    let flip_proof = |m: &mut Vec<u8>| {
        if m.len() == wire::PROOF_MSG_LEN {
            m[0] ^= 1;
        }
    };
    let x = exchange_with(&mut c, &mut s, flip_proof);
    assert_eq!(x.client, Some(Err(ServerMismatch::Refused)));
    let id = k.key_id();
    let rejection = Rejection::WrongProof {
        theirs: id,
        ours: id,
    };
    assert_eq!(x.server, Some(Err(rejection.clone())));
    assert!(rejection.to_string().contains("a replayed or forged proof"));
}

#[test]
fn a_recorded_proof_replayed_against_a_new_challenge_is_refused() {
    let k = secret(1);
    let nc: Nonce = [7; 32];
    let mut c = ClientHandshake::with_nonce(&k, Service::STORE, nc);
    let mut s = ServerHandshake::new(&k, Service::STORE).unwrap();
    let recorded = exchange(&mut c, &mut s);
    assert_eq!(recorded.server, Some(Ok(())));
    // An eavesdropper replays the client's HELLO and PROOF, byte for byte, to a new server.
    let mut s2 = ServerHandshake::new(&k, Service::STORE).unwrap();
    s2.receive(&recorded.to_server[0]);
    let Ok(Step::Write {
        bytes: challenge, ..
    }) = s2.step()
    else {
        panic!("no challenge")
    };
    assert_ne!(challenge, recorded.to_client[0], "a fresh Ns");
    s2.receive(&recorded.to_server[1]);
    assert!(matches!(s2.step(), Ok(Step::Write { bytes, .. }) if bytes == [wire::REFUSED]));
    let id = k.key_id();
    assert_eq!(
        s2.step(),
        Err(Rejection::WrongProof {
            theirs: id,
            ours: id
        })
    );
    // And a recorded CHALLENGE replayed to a new client (a fresh Nc) fails there.
    let mut c2 = ClientHandshake::new(&k, Service::STORE).unwrap();
    assert!(matches!(c2.step(), Ok(Step::Write { .. })));
    c2.receive(&recorded.to_client[0]);
    assert!(matches!(c2.step(), Ok(Step::Write { .. })));
    let err = c2.step().unwrap_err();
    assert_eq!(
        err,
        ServerMismatch::DifferentSecret {
            theirs: id,
            ours: id
        }
    );
    assert!(err.to_string().contains("replaying"), "{err}");
}

#[test]
fn a_client_that_meant_another_service_is_told_which_this_is() {
    let k = secret(1);
    let mut c = ClientHandshake::new(&k, Service::RENDEZVOUS).unwrap();
    let mut s = ServerHandshake::new(&k, Service::STORE).unwrap();
    let x = exchange(&mut c, &mut s);
    let client = x.client.unwrap().unwrap_err();
    assert_eq!(
        client,
        ServerMismatch::WrongService {
            asked: Service::RENDEZVOUS,
            theirs: "store".into()
        }
    );
    assert_eq!(
        client.to_string(),
        "is the \"store\" service, not the \"rendezvous\" asked for"
    );
    let server = x.server.unwrap().unwrap_err();
    assert_eq!(
        server.to_string(),
        "asked for the \"rendezvous\" service, but this listener is the \"store\""
    );
    // No challenge, so no proof was given or asked for.
    assert_eq!(x.to_server.len(), 1);
}

/// Feeds `msg` one prefix at a time to a fresh machine made by `make` after `before`; every
/// proper prefix asks to read, with the right progress.
fn check_truncations<M>(
    msg: &[u8],
    message: Message,
    make: impl Fn() -> M,
    next: impl Fn(&mut M) -> Option<Step>,
    receive: impl Fn(&mut M, &[u8]),
) {
    for k in 0..msg.len() {
        let mut m = make();
        receive(&mut m, &msg[..k]);
        match next(&mut m) {
            Some(Step::Read(p)) => {
                assert_eq!((p.message, p.got), (message, k), "{message} prefix {k}");
                assert!(p.missing() > 0 && p.need <= msg.len());
            }
            other => panic!("{message} prefix {k}: {other:?}"),
        }
    }
}

#[test]
fn every_truncation_of_every_message_is_incomplete_not_invalid() {
    let k = secret(1);
    let mut c = ClientHandshake::new(&k, Service::STORE).unwrap();
    let mut s = ServerHandshake::new(&k, Service::STORE).unwrap();
    let x = exchange(&mut c, &mut s);
    let (hello, proof) = (&x.to_server[0], &x.to_server[1]);
    let (challenge, verdict) = (&x.to_client[0], &x.to_client[1]);
    let ns = || ServerHandshake::new(&k, Service::STORE).unwrap();
    let server_next = |m: &mut ServerHandshake| loop {
        match m.step() {
            Ok(Step::Write { .. }) => continue,
            other => return other.ok(),
        }
    };
    check_truncations(hello, Message::Hello, ns, server_next, |m, b| m.receive(b));
    let after_hello = || {
        let mut m = ns();
        m.receive(hello);
        m
    };
    check_truncations(proof, Message::Proof, after_hello, server_next, |m, b| {
        m.receive(b)
    });
    // The client's side: a CHALLENGE cut short; then the verdict (after a real challenge).
    let client_next = |m: &mut ClientHandshake| loop {
        match m.step() {
            Ok(Step::Write { .. }) => continue,
            other => return other.ok(),
        }
    };
    let nc = || ClientHandshake::new(&k, Service::STORE).unwrap();
    check_truncations(challenge, Message::Challenge, nc, client_next, |m, b| {
        m.receive(b)
    });
    assert_eq!(verdict, &[wire::ADMITTED]);
    let mut c = ClientHandshake::new(&k, Service::STORE).unwrap();
    let mut s = ServerHandshake::new(&k, Service::STORE).unwrap();
    let Ok(Step::Write { bytes: hello, .. }) = c.step() else {
        panic!()
    };
    s.receive(&hello);
    let Ok(Step::Write {
        bytes: challenge, ..
    }) = s.step()
    else {
        panic!()
    };
    c.receive(&challenge);
    assert!(matches!(
        c.step(),
        Ok(Step::Write {
            message: Message::Proof,
            ..
        })
    ));
    assert!(
        matches!(c.step(), Ok(Step::Read(p)) if p.message == Message::Verdict && p.missing() == 1)
    );
}

#[test]
fn pytorch_tcpstore_and_http_clients_are_refused_at_once_with_nothing_sent_back() {
    let k = secret(1);
    let tcpstore: &[u8] = &[0x00, 0xce, 0xf7, 0x85, 0x3c];
    let http: &[u8] = b"GET / HTTP/1.1\r\n";
    for first in [tcpstore, http] {
        // Even their first byte alone is enough.
        for bytes in [&first[..1], first] {
            let mut s = ServerHandshake::new(&k, Service::STORE).unwrap();
            s.receive(bytes);
            match s.step() {
                Err(Rejection::NotOurProtocol(wire::DecodeError::BadMagic { got })) => {
                    assert_eq!(got, bytes)
                }
                other => panic!("{other:?}"),
            }
        }
    }
    // And a client that reaches a plain PyTorch TCPStore server gets no reply it could take for
    // a challenge: the server's answers begin with a 0 or 1 byte.
    let mut c = ClientHandshake::new(&k, Service::STORE).unwrap();
    let _hello = c.step();
    c.receive(&[1, 0, 0, 0, 0, 0, 0, 0]);
    assert!(matches!(c.step(), Err(ServerMismatch::NotOurProtocol(_))));
}

/// Messages cut into chunks at the given points.
fn chunks(bytes: &[u8], cuts: &[usize]) -> Vec<Vec<u8>> {
    let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
    cuts.sort_unstable();
    let mut out = Vec::new();
    let mut at = 0;
    for cut in cuts.into_iter().chain([bytes.len()]) {
        out.push(bytes[at..cut].to_vec());
        at = cut;
    }
    out
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_get_a_client_admitted(
        bytes in proptest::collection::vec(any::<u8>(), 0..200),
        valid_hello in any::<bool>(),
    ) {
        let k = secret(1);
        let mut s = ServerHandshake::new(&k, Service::STORE).unwrap();
        if valid_hello {
            let mut c = ClientHandshake::new(&k, Service::STORE).unwrap();
            let Ok(Step::Write { bytes: hello, .. }) = c.step() else { panic!() };
            s.receive(&hello);
        }
        s.receive(&bytes);
        for _ in 0..4 {
            match s.step() {
                Ok(Step::Done) => prop_assert!(false, "admitted {bytes:?}"),
                Ok(Step::Write { .. }) => continue,
                Ok(Step::Read(_)) | Err(_) => break,
            }
        }
    }

    #[test]
    fn arbitrary_bytes_never_pass_for_a_server(
        bytes in proptest::collection::vec(any::<u8>(), 0..200),
        magic in any::<bool>(),
    ) {
        let k = secret(1);
        let mut c = ClientHandshake::new(&k, Service::STORE).unwrap();
        if magic {
            c.receive(b"RALLYAU1\x00");
        }
        c.receive(&bytes);
        for _ in 0..4 {
            match c.step() {
                Ok(Step::Done) => prop_assert!(false, "admitted by {bytes:?}"),
                Ok(Step::Write { .. }) => continue,
                Ok(Step::Read(_)) | Err(_) => break,
            }
        }
    }

    #[test]
    fn a_good_exchange_in_any_chunks_admits(cuts in proptest::collection::vec(any::<usize>(), 0..6)) {
        let k = secret(1);
        let (mut c, mut s) = pair(&k, &k);
        let x = exchange_chunked(&mut c, &mut s, |_| {}, &cuts);
        prop_assert_eq!(x.client, Some(Ok(())));
        prop_assert_eq!(x.server, Some(Ok(())));
    }
}
