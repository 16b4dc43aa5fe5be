//! A loopback proxy in front of a store that requires the job secret, for
//! clients that cannot prove it: PyTorch's own `TCPStore`.
//!
//! With a job secret on, the job's stores admit only connections that prove
//! they hold it ([`crate::secret`]). Unchanged PyTorch workers cannot, so the
//! agent of each node serves them this proxy on `127.0.0.1` and gives them
//! its port as `MASTER_PORT`: each connection a worker opens here is matched
//! by one the proxy opens to the real store, proves the secret on, and then
//! carries the bytes both ways untouched (PyTorch's protocol end to end; the
//! proxy reads none of it).
//!
//! What it costs: one more loopback hop per request (a copy in each
//! direction through this process), and one upstream connection and
//! handshake per worker connection. What it leaves open: any process on
//! this host can connect to the proxy, as any process of the host can read
//! a file the job's user can (see [`rallypoint_auth`]'s docs).
//!
//! A connection whose upstream cannot be reached or refuses the proof is
//! closed, the reason logged once per kind with the upstream's address; a
//! worker sees its store connection end, as it would if the store were
//! gone.

use std::collections::HashSet;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rallypoint_auth::{JobSecret, Service};
use rallypoint_sync::MutexExt;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::{Result, StoreError};

/// How long the proxy tries to reach and prove itself to the store for one
/// worker connection.
pub const UPSTREAM_DEADLINE: Duration = Duration::from_secs(30);

/// What the proxy has done.
#[derive(Debug, Default)]
struct Counts {
    accepted: AtomicU64,
    admitted: AtomicU64,
    failed: AtomicU64,
}

/// A snapshot of the proxy's counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProxyStats {
    /// Worker connections accepted.
    pub accepted: u64,
    /// Of those, carried to the store (the proof admitted).
    pub admitted: u64,
    /// Of those, closed because the store could not be reached or refused.
    pub failed: u64,
}

struct Shared {
    upstream: String,
    secret: JobSecret,
    counts: Counts,
    /// Failure kinds already logged (each is logged once).
    said: Mutex<HashSet<String>>,
}

/// A running proxy; dropping it closes its listener and every connection.
pub struct Proxy {
    local_addr: SocketAddr,
    shared: Arc<Shared>,
    cancel: CancellationToken,
    tracker: TaskTracker,
}

impl Proxy {
    /// Serves on `127.0.0.1` (a free port) the store at `upstream`
    /// (`host:port`), proving `secret` on every connection it opens there.
    pub async fn start(upstream: &str, secret: JobSecret) -> Result<Proxy> {
        Proxy::start_on(IpAddr::V4(Ipv4Addr::LOCALHOST), upstream, secret).await
    }

    /// [`Proxy::start`] on another local address (a loopback one, for what
    /// the module docs say to hold).
    pub async fn start_on(ip: IpAddr, upstream: &str, secret: JobSecret) -> Result<Proxy> {
        let bind = SocketAddr::new(ip, 0);
        let listener = TcpListener::bind(bind)
            .await
            .map_err(|source| StoreError::Listen {
                op: "bind the store proxy",
                addr: bind.to_string(),
                source,
            })?;
        let local_addr = listener.local_addr().map_err(|source| StoreError::Listen {
            op: "bind the store proxy",
            addr: bind.to_string(),
            source,
        })?;
        let shared = Arc::new(Shared {
            upstream: upstream.to_owned(),
            secret,
            counts: Counts::default(),
            said: Mutex::new(HashSet::new()),
        });
        let cancel = CancellationToken::new();
        let tracker = TaskTracker::new();
        tracker.spawn(accept_loop(
            listener,
            shared.clone(),
            cancel.clone(),
            tracker.clone(),
        ));
        tracing::debug!(%local_addr, upstream, "store proxy serving");
        Ok(Proxy {
            local_addr,
            shared,
            cancel,
            tracker,
        })
    }

    /// Where the workers connect.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// What it has done so far.
    pub fn stats(&self) -> ProxyStats {
        let c = &self.shared.counts;
        ProxyStats {
            accepted: c.accepted.load(Ordering::Relaxed),
            admitted: c.admitted.load(Ordering::Relaxed),
            failed: c.failed.load(Ordering::Relaxed),
        }
    }

    /// Closes the listener and every connection, and waits (up to a second)
    /// for their tasks.
    pub async fn shutdown(self) {
        self.cancel.cancel();
        self.tracker.close();
        let _ = tokio::time::timeout(Duration::from_secs(1), self.tracker.wait()).await;
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

async fn accept_loop(
    listener: TcpListener,
    shared: Arc<Shared>,
    cancel: CancellationToken,
    tracker: TaskTracker,
) {
    loop {
        let accepted = tokio::select! {
            biased;
            () = cancel.cancelled() => return,
            r = listener.accept() => r,
        };
        match accepted {
            Ok((down, _)) => {
                shared.counts.accepted.fetch_add(1, Ordering::Relaxed);
                let (shared, cancel) = (shared.clone(), cancel.clone());
                tracker.spawn(async move {
                    tokio::select! {
                        () = cancel.cancelled() => {}
                        () = carry(down, &shared) => {}
                    }
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "store proxy: accept failed; retrying in 50 ms");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// One worker connection: the store's, proven, then bytes both ways.
async fn carry(mut down: TcpStream, shared: &Shared) {
    let _ = down.set_nodelay(true);
    let deadline = Instant::now() + UPSTREAM_DEADLINE;
    let mut up = match upstream(shared, deadline).await {
        Ok(up) => up,
        Err(e) => {
            shared.counts.failed.fetch_add(1, Ordering::Relaxed);
            let said = shared.said.locked().insert(e.0.clone());
            if said {
                tracing::warn!("store proxy: {} (said once)", e.1);
            }
            return;
        }
    };
    shared.counts.admitted.fetch_add(1, Ordering::Relaxed);
    let _ = tokio::io::copy_bidirectional(&mut down, &mut up).await;
}

/// Connects to the store and proves the secret; on failure a kind (for
/// saying each once) and the message.
async fn upstream(
    shared: &Shared,
    deadline: Instant,
) -> std::result::Result<TcpStream, (String, String)> {
    let at = &shared.upstream;
    let connect = tokio::time::timeout_at(deadline.into(), TcpStream::connect(at.as_str()));
    let mut up = match connect.await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            return Err((
                "connect".into(),
                format!("cannot reach the store at {at}: {e}"),
            ))
        }
        Err(_) => {
            let waited = UPSTREAM_DEADLINE;
            return Err((
                "connect".into(),
                format!("cannot reach the store at {at} within {waited:?}"),
            ));
        }
    };
    let _ = up.set_nodelay(true);
    let server = up
        .peer_addr()
        .map_err(|e| ("connect".to_owned(), format!("the store at {at}: {e}")))?;
    let proof = rallypoint_auth::io::tokio::client_handshake(
        &mut up,
        server,
        &shared.secret,
        Service::STORE,
        deadline,
    );
    match proof.await {
        Ok(()) => Ok(up),
        Err(e) if e.is_wrong_secret() => Err(("secret".into(), e.to_string())),
        Err(e) => Err(("handshake".into(), e.to_string())),
    }
}
