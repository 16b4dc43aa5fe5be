//! Test listeners: each connection's handshake on its own thread (std) or task (tokio); an
//! admitted connection answers "ping" with "pong"; each refusal is counted and sent, as its
//! log line, to the test.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use rallypoint_auth::io::{blocking, tokio as tokio_io};
use rallypoint_auth::{JobSecret, Refusal, RefusalKind, Refusals, Service};

/// What a listener saw of one connection.
#[derive(Debug)]
pub enum Event {
    Admitted,
    Refused { kind: RefusalKind, line: String },
}

/// Which listener.
#[derive(Debug, Clone, Copy)]
pub enum Kind {
    Std,
    Tokio,
}

pub const KINDS: [Kind; 2] = [Kind::Std, Kind::Tokio];

pub struct TestServer {
    pub addr: SocketAddr,
    pub refusals: Arc<Refusals>,
    events: mpsc::Receiver<Event>,
    stop: Arc<AtomicBool>,
}

pub fn secret(tag: u8) -> JobSecret {
    JobSecret::from_bytes(vec![tag; 32]).unwrap()
}

impl TestServer {
    /// A listener for the store on loopback, giving each client `deadline` to finish.
    pub fn start(kind: Kind, secret: JobSecret, deadline: Duration) -> TestServer {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let refusals = Arc::new(Refusals::new());
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, events) = mpsc::channel();
        let shared = Shared {
            secret,
            deadline,
            refusals: refusals.clone(),
            tx,
            stop: stop.clone(),
        };
        match kind {
            Kind::Std => std::thread::spawn(move || serve_std(listener, shared)),
            Kind::Tokio => std::thread::spawn(move || serve_tokio(listener, shared)),
        };
        TestServer {
            addr,
            refusals,
            events,
            stop,
        }
    }

    /// The next connection's outcome, waiting at most `within`.
    pub fn event(&self, within: Duration) -> Event {
        self.events
            .recv_timeout(within)
            .unwrap_or_else(|e| panic!("no connection outcome within {within:?}: {e}"))
    }

    /// The next refusal, which must be of `kind`; its log line.
    pub fn refusal(&self, kind: RefusalKind, within: Duration) -> String {
        match self.event(within) {
            Event::Refused { kind: k, line } if k == kind => line,
            other => panic!("expected a {kind:?} refusal, got {other:?}"),
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the accept loop, which sees the flag.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
    }
}

#[derive(Clone)]
struct Shared {
    secret: JobSecret,
    deadline: Duration,
    refusals: Arc<Refusals>,
    tx: mpsc::Sender<Event>,
    stop: Arc<AtomicBool>,
}

impl Shared {
    fn refused(&self, refusal: Refusal) {
        self.refusals.count(&refusal);
        let _ = self.tx.send(Event::Refused {
            kind: refusal.kind(),
            line: refusal.to_string(),
        });
    }
}

fn serve_std(listener: TcpListener, shared: Shared) {
    for conn in listener.incoming() {
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(mut conn) = conn else { continue };
        let shared = shared.clone();
        std::thread::spawn(move || {
            let peer = conn.peer_addr().unwrap();
            let deadline = Instant::now() + shared.deadline;
            let svc = Service::STORE;
            match blocking::server_handshake(&mut conn, peer, &shared.secret, svc, deadline) {
                Ok(()) => {
                    let _ = shared.tx.send(Event::Admitted);
                    let mut ping = [0; 4];
                    if conn.read_exact(&mut ping).is_ok() && &ping == b"ping" {
                        let _ = conn.write_all(b"pong");
                    }
                }
                Err(refusal) => shared.refused(refusal),
            }
        });
    }
}

fn serve_tokio(listener: TcpListener, shared: Shared) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        listener.set_nonblocking(true).unwrap();
        let listener = tokio::net::TcpListener::from_std(listener).unwrap();
        loop {
            let Ok((mut conn, peer)) = listener.accept().await else {
                continue;
            };
            if shared.stop.load(Ordering::SeqCst) {
                return;
            }
            let shared = shared.clone();
            tokio::spawn(async move {
                let deadline = Instant::now() + shared.deadline;
                let svc = Service::STORE;
                let r = tokio_io::server_handshake(&mut conn, peer, &shared.secret, svc, deadline);
                match r.await {
                    Ok(()) => {
                        let _ = shared.tx.send(Event::Admitted);
                        let mut ping = [0; 4];
                        if conn.read_exact(&mut ping).await.is_ok() && &ping == b"ping" {
                            let _ = conn.write_all(b"pong").await;
                        }
                    }
                    Err(refusal) => shared.refused(refusal),
                }
            });
        }
    });
}

/// Connects a std client with `secret`, runs its handshake, and pings once admitted.
pub fn std_client(
    addr: SocketAddr,
    secret: &JobSecret,
) -> Result<(), rallypoint_auth::ClientError> {
    let mut conn = TcpStream::connect(addr).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    blocking::client_handshake(&mut conn, addr, secret, Service::STORE, deadline)?;
    ping(&mut conn);
    Ok(())
}

/// The service's own bytes go through once the handshake is done.
pub fn ping(conn: &mut TcpStream) {
    conn.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    conn.write_all(b"ping").unwrap();
    let mut pong = [0; 4];
    conn.read_exact(&mut pong).unwrap();
    assert_eq!(&pong, b"pong");
}

/// Reads until the server closes the connection (EOF or reset), at most `within`.
pub fn wait_closed(conn: &mut TcpStream, within: Duration) {
    conn.set_read_timeout(Some(within)).unwrap();
    let mut buf = [0; 128];
    loop {
        match conn.read(&mut buf) {
            Ok(0) => return,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return,
            Err(e) => panic!("the server did not close the connection within {within:?}: {e}"),
        }
    }
}
