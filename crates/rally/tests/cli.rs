//! The `rally` binary end to end.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rallypoint_store::{blocking, TcpStore};

#[test]
fn store_serve_prints_its_address_serves_and_stops_on_sigterm() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_rally"))
        .args(["store", "serve", "--host", "127.0.0.1", "--port", "0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr: std::net::SocketAddr = line
        .trim()
        .strip_prefix("rally store listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .parse()
        .unwrap();
    assert_ne!(addr.port(), 0, "port 0 must be replaced by the bound port");

    let store = blocking::connect(
        TcpStore::builder("127.0.0.1", addr.port()).timeout(Duration::from_secs(5)),
    )
    .unwrap();
    store.set("k", b"v").unwrap();
    assert_eq!(store.get("k").unwrap(), b"v");

    // SIGTERM: a clean shutdown with exit status 0, promptly.
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "rally did not stop on SIGTERM");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(status.success(), "{status}");
    // The client sees the connection go.
    assert!(store.add("n", 1).is_err());
}

#[test]
fn bad_arguments_get_a_message_not_a_trace() {
    let out = Command::new(env!("CARGO_BIN_EXE_rally"))
        .args(["store", "serve", "--port", "not-a-port"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("invalid value 'not-a-port'"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}
