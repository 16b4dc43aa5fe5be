//! The job-secret handshake on arbitrary bytes: each decoder never panics, a complete message
//! re-encodes to exactly its bytes and every prefix of it reads as incomplete; and neither
//! side's machine ever admits a peer made of arbitrary bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rallypoint_auth::handshake::wire::{DecodeError, Frame, Hello, Proof, Reply, Verdict};
use rallypoint_auth::handshake::{ClientHandshake, ServerHandshake, Service, Step};
use rallypoint_auth::JobSecret;

fn check<T>(
    data: &[u8],
    decode: fn(&[u8]) -> Result<Frame<T>, DecodeError>,
    encode: fn(&T) -> Vec<u8>,
) {
    match decode(data) {
        Ok(Frame::Complete(msg, used)) => {
            assert!(used <= data.len());
            assert_eq!(encode(&msg), &data[..used], "re-encoding differs");
            for cut in 0..used {
                let partial = decode(&data[..cut]);
                assert!(
                    matches!(partial, Ok(Frame::Incomplete { need, .. }) if need > cut),
                    "a prefix of a valid message must be incomplete"
                );
            }
        }
        Ok(Frame::Incomplete { need, .. }) => assert!(need > data.len()),
        Err(_) => {}
    }
}

fuzz_target!(|data: &[u8]| {
    check(data, Hello::decode, Hello::encode);
    check(data, Reply::decode, Reply::encode);
    check(data, Proof::decode, Proof::encode);
    check(data, Verdict::decode, |v| v.encode());

    let secret = JobSecret::from_bytes(vec![1; 32]).unwrap();
    let mut server = ServerHandshake::new(&secret, Service::STORE).unwrap();
    server.receive(data);
    let mut client = ClientHandshake::new(&secret, Service::STORE).unwrap();
    client.receive(data);
    for _ in 0..4 {
        assert_ne!(
            server.step(),
            Ok(Step::Done),
            "the server admitted arbitrary bytes"
        );
        assert_ne!(
            client.step(),
            Ok(Step::Done),
            "the client accepted arbitrary bytes"
        );
    }
});
