//! A live server fed arbitrary bytes on one connection, split at arbitrary points:
//! it must never panic, and must still serve a well-behaved client afterwards.
#![no_main]

use std::io::{Read, Write};
use std::sync::OnceLock;
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use rallypoint_store::blocking;
use rallypoint_store::server::ServerHandle;

fn server() -> &'static ServerHandle {
    static SERVER: OnceLock<ServerHandle> = OnceLock::new();
    SERVER.get_or_init(|| blocking::serve("127.0.0.1:0".parse().unwrap(), Default::default()).unwrap())
}

fuzz_target!(|data: &[u8]| {
    let addr = server().local_addr();
    let mut bad = std::net::TcpStream::connect(addr).unwrap();
    bad.set_nodelay(true).unwrap();
    // Half the inputs get a valid handshake first, so the fuzzer reaches commands.
    if data.first().is_some_and(|b| b & 1 == 0) {
        bad.write_all(&[0x00, 0xce, 0xf7, 0x85, 0x3c]).unwrap();
    }
    for chunk in data.chunks(7) {
        if bad.write_all(chunk).is_err() {
            break; // the server closed it: bad input
        }
    }
    drop(bad);
    // A good client still gets its ping back.
    let mut good = std::net::TcpStream::connect(addr).unwrap();
    good.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    good.write_all(&[0x00, 0xce, 0xf7, 0x85, 0x3c, 0x0d, 1, 2, 3, 4]).unwrap();
    let mut echo = [0u8; 4];
    good.read_exact(&mut echo).unwrap();
    assert_eq!(echo, [1, 2, 3, 4]);
});
