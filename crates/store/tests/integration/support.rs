//! Helpers shared by the integration tests.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::Duration;

use rallypoint_store::server::{Server, ServerConfig, ServerHandle};
use rallypoint_store::TcpStore;

/// A server on a free loopback port, on the current runtime.
pub async fn server() -> ServerHandle {
    server_with(ServerConfig::default()).await
}

pub async fn server_with(config: ServerConfig) -> ServerHandle {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    Server::from_listener(listener, config).unwrap().spawn()
}

/// A client of `server` with a short timeout.
pub async fn client(server: &ServerHandle) -> TcpStore {
    TcpStore::builder("127.0.0.1", server.local_addr().port())
        .timeout(Duration::from_secs(5))
        .connect()
        .await
        .unwrap()
}

/// A raw, blocking socket that has done the VALIDATE handshake.
pub fn raw(addr: SocketAddr) -> TcpStream {
    let mut s = raw_unvalidated(addr);
    s.write_all(&[0x00, 0xce, 0xf7, 0x85, 0x3c]).unwrap();
    s
}

pub fn raw_unvalidated(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.set_nodelay(true).unwrap();
    s
}

/// Reads exactly `n` bytes.
pub fn read_n(s: &mut TcpStream, n: usize) -> Vec<u8> {
    let mut b = vec![0; n];
    s.read_exact(&mut b).unwrap();
    b
}

/// Whether the peer closed the connection (EOF or reset) within the read timeout.
pub fn closed_by_peer(s: &mut TcpStream) -> bool {
    let mut b = [0u8; 1];
    match s.read(&mut b) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => matches!(
            e.kind(),
            std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::ConnectionAborted
        ),
    }
}

/// No bytes arrive within `d`.
pub fn silent_for(s: &mut TcpStream, d: Duration) -> bool {
    s.set_read_timeout(Some(d)).unwrap();
    let mut b = [0u8; 1];
    let r = s.read(&mut b);
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    matches!(r, Err(ref e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut))
}

/// A string field: u64 LE length then bytes.
pub fn s(bytes: &[u8]) -> Vec<u8> {
    let mut v = (bytes.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(bytes);
    v
}

/// Concatenates byte pieces.
pub fn cat(parts: &[&[u8]]) -> Vec<u8> {
    parts.concat()
}

/// Polls `f` until it holds or 5 s pass.
pub async fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !f() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The Python with PyTorch: `RALLY_PYTHON`, else the repo's `.venv`.
pub fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("RALLY_PYTHON") {
        return p.into();
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    root.join(".venv/bin/python")
}

/// Path of a Python helper script in `tests/py`.
pub fn script(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/py")
        .join(name)
}
