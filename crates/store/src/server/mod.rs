//! A TCPStore-protocol server, standalone (`rally store serve`) or embedded.
//!
//! One task per connection decodes requests from the socket, applies them to the
//! shared [`Keyspace`] under one short mutex hold per batch of pipelined requests,
//! and writes the replies back. A `WAIT` that cannot complete at once registers the
//! connection's [`Signal`](crate::keyspace::Signal); the task wakes on it and sends
//! `STOP_WAITING`. Nothing else is shared between connections, so a client that
//! sends garbage, stops reading, or disconnects affects only its own task: bad input
//! closes that connection with a logged reason, and a disconnect drops its waits.
//!
//! Built for many connections: the listen backlog is the system maximum, the
//! process's file-descriptor limit is raised to its hard limit, a wildcard IPv6 bind
//! is dual-stack, and an idle connection holds no read or write buffer.
//!
//! ```no_run
//! # async fn demo() -> rallypoint_store::Result<()> {
//! use rallypoint_store::server::{Server, ServerConfig};
//! let server = Server::bind("[::]:29500".parse().unwrap(), ServerConfig::default()).await?;
//! println!("listening on {}", server.local_addr());
//! let handle = server.spawn();
//! // ... later
//! handle.shutdown().await;
//! # Ok(()) }
//! ```

mod connection;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rallypoint_sync::MutexExt;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use rallypoint_auth::{JobSecret, RefusalCounts, Refusals};

use crate::keyspace::Keyspace;
use crate::protocol::Limits;
use crate::{Result, StoreError};

/// Server settings.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Size limits on keys, values and key counts; a request over them closes its
    /// connection.
    pub limits: Limits,
    /// How long [`ServerHandle::shutdown`] waits for connection tasks to finish.
    pub shutdown_grace: Duration,
    /// TCP keep-alive on every accepted connection: the first probe after
    /// this long idle, then every third of it, three probes; and unanswered
    /// data (a reply, or the probes) given up after twice this
    /// (`TCP_USER_TIMEOUT`). So a client whose host died or was cut off is
    /// closed within about twice this, idle or not, and
    /// [`StatsSnapshot::open`] counts only clients that can still reach the
    /// server (an agent keeps its job store up while it has any). `None`:
    /// the system's default (usually none: such a connection stays open).
    pub keepalive: Option<Duration>,
    /// The job secret every connection must prove it holds before its first
    /// request ([`crate::secret`]); `None` serves PyTorch's clients as they
    /// are. Defaults to the process's ([`crate::secret::process_secret`]).
    pub secret: Option<JobSecret>,
    /// How long a connection has to finish that proof.
    pub handshake_deadline: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            limits: Limits::default(),
            shutdown_grace: Duration::from_secs(5),
            keepalive: Some(Duration::from_secs(30)),
            secret: crate::secret::process_secret(),
            handshake_deadline: rallypoint_auth::io::SERVER_DEADLINE,
        }
    }
}

/// Counters describing what the server has done.
#[derive(Debug, Default)]
pub struct Stats {
    accepted: AtomicU64,
    closed: AtomicU64,
    protocol_errors: AtomicU64,
    requests: AtomicU64,
}

/// A snapshot of [`Stats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatsSnapshot {
    pub accepted: u64,
    pub open: u64,
    /// Connections closed because of bad input.
    pub protocol_errors: u64,
    /// Requests handled (after the handshake), over all connections.
    pub requests: u64,
    /// Connections refused by the job-secret handshake, by reason.
    pub refused: RefusalCounts,
}

impl Stats {
    fn snapshot(&self, refusals: &Refusals) -> StatsSnapshot {
        let accepted = self.accepted.load(Ordering::Relaxed);
        let closed = self.closed.load(Ordering::Relaxed);
        StatsSnapshot {
            accepted,
            open: accepted.saturating_sub(closed),
            protocol_errors: self.protocol_errors.load(Ordering::Relaxed),
            requests: self.requests.load(Ordering::Relaxed),
            refused: refusals.snapshot(),
        }
    }
}

/// State shared by the accept loop and every connection.
pub(crate) struct Shared {
    keyspace: Mutex<Keyspace>,
    limits: Limits,
    stats: Stats,
    secret: Option<JobSecret>,
    handshake_deadline: Duration,
    refusals: Refusals,
}

impl Shared {
    fn keyspace(&self) -> MutexGuard<'_, Keyspace> {
        // A panic while holding the lock cannot leave the maps half-updated in a
        // way later requests could not handle, so keep serving.
        self.keyspace.locked()
    }
}

/// A bound, not yet running server.
pub struct Server {
    listener: TcpListener,
    local_addr: SocketAddr,
    config: ServerConfig,
}

impl Server {
    /// Binds `addr` with the settings a store server wants: `SO_REUSEADDR`, the
    /// maximum listen backlog, and dual-stack when `addr` is the IPv6 wildcard. Port 0
    /// picks a free port. Also raises the file-descriptor limit to its hard limit.
    pub async fn bind(addr: SocketAddr, config: ServerConfig) -> Result<Server> {
        let io = |source| StoreError::Listen {
            op: "bind",
            addr: addr.to_string(),
            source,
        };
        raise_fd_limit();
        let domain = socket2::Domain::for_address(addr);
        let socket = socket2::Socket::new(domain, socket2::Type::STREAM, None).map_err(io)?;
        if addr.is_ipv6() && addr.ip().is_unspecified() {
            socket.set_only_v6(false).map_err(io)?;
        }
        socket.set_reuse_address(true).map_err(io)?;
        socket.set_nonblocking(true).map_err(io)?;
        socket.bind(&addr.into()).map_err(io)?;
        // The kernel caps the backlog at net.core.somaxconn.
        socket.listen(i32::MAX).map_err(io)?;
        Server::from_listener(socket.into(), config)
    }

    /// Binds `port` on every address: dual-stack `[::]`, or IPv4 only where the
    /// host has IPv6 disabled.
    pub async fn bind_any(port: u16, config: ServerConfig) -> Result<Server> {
        let any6 = SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, port));
        match Server::bind(any6, config.clone()).await {
            Ok(s) => Ok(s),
            // A port in use is in use for IPv4 too: say so, rather than
            // retrying into the same answer.
            Err(e @ StoreError::Listen { .. }) if matches!(&e, StoreError::Listen { source, .. } if source.kind() == std::io::ErrorKind::AddrInUse) => {
                Err(e)
            }
            Err(_) => Server::bind(SocketAddr::from(([0, 0, 0, 0], port)), config).await,
        }
    }

    /// Wraps an already bound and listening socket (tests bind port 0 themselves).
    pub fn from_listener(listener: std::net::TcpListener, config: ServerConfig) -> Result<Server> {
        let addr = listener
            .local_addr()
            .map_or_else(|_| "listener".to_owned(), |a| a.to_string());
        let io = |source| StoreError::Listen {
            op: "listen",
            addr: addr.clone(),
            source,
        };
        listener.set_nonblocking(true).map_err(io)?;
        let local_addr = listener.local_addr().map_err(io)?;
        let listener = TcpListener::from_std(listener).map_err(io)?;
        Ok(Server {
            listener,
            local_addr,
            config,
        })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Starts serving on the current tokio runtime.
    pub fn spawn(self) -> ServerHandle {
        let shared = Arc::new(Shared {
            keyspace: Mutex::new(Keyspace::new()),
            limits: self.config.limits,
            stats: Stats::default(),
            secret: self.config.secret.clone(),
            handshake_deadline: self.config.handshake_deadline,
            refusals: Refusals::new(),
        });
        let cancel = CancellationToken::new();
        let tracker = TaskTracker::new();
        let accept = tokio::spawn(accept_loop(
            self.listener,
            shared.clone(),
            cancel.clone(),
            tracker.clone(),
            self.config.keepalive,
        ));
        ServerHandle {
            local_addr: self.local_addr,
            shared,
            cancel,
            tracker,
            accept: Some(accept),
            grace: self.config.shutdown_grace,
        }
    }
}

/// A running server. Dropping the handle stops it (as PyTorch's server lives exactly
/// as long as the store object that owns it); [`ServerHandle::shutdown`] stops it and
/// waits for its connections to close.
pub struct ServerHandle {
    local_addr: SocketAddr,
    shared: Arc<Shared>,
    cancel: CancellationToken,
    tracker: TaskTracker,
    accept: Option<tokio::task::JoinHandle<()>>,
    grace: Duration,
}

impl ServerHandle {
    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// What the server has done so far.
    pub fn stats(&self) -> StatsSnapshot {
        self.shared.stats.snapshot(&self.shared.refusals)
    }

    /// Number of waits registered and not yet completed, over all connections.
    pub fn pending_waits(&self) -> usize {
        self.shared.keyspace().pending_waits()
    }

    /// A token that stops the server when cancelled.
    pub fn cancellation_token(&self) -> CancellationToken {
        self.cancel.clone()
    }

    /// Stops accepting, closes every connection, and waits (up to the configured
    /// grace period) for their tasks to end.
    pub async fn shutdown(mut self) {
        self.cancel.cancel();
        if let Some(accept) = self.accept.take() {
            let _ = accept.await;
        }
        self.tracker.close();
        if tokio::time::timeout(self.grace, self.tracker.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                open = self.tracker.len(),
                "store server shutdown: connections still closing after the grace period"
            );
        }
    }

    /// Runs until `signal` resolves, then shuts down.
    pub async fn run_until(self, signal: impl std::future::Future<Output = ()>) {
        tokio::select! {
            _ = signal => {}
            _ = self.cancel.cancelled() => {}
        }
        self.shutdown().await
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

async fn accept_loop(
    listener: TcpListener,
    shared: Arc<Shared>,
    cancel: CancellationToken,
    tracker: TaskTracker,
    keepalive: Option<Duration>,
) {
    // TCP_USER_TIMEOUT as well: keep-alive probes are not sent while a reply
    // is unacknowledged (say, a WAIT answered to a host that died), and
    // retransmissions would otherwise go on for about 15 minutes.
    let keepalive = keepalive.map(|idle| {
        let k = socket2::TcpKeepalive::new()
            .with_time(idle)
            .with_interval((idle / 3).max(Duration::from_secs(1)))
            .with_retries(3);
        (k, idle * 2)
    });
    loop {
        let accepted = tokio::select! {
            biased;
            _ = cancel.cancelled() => return,
            r = listener.accept() => r,
        };
        match accepted {
            Ok((stream, peer)) => {
                if let Err(e) = stream.set_nodelay(true) {
                    tracing::debug!(%peer, error = %e, "could not set TCP_NODELAY");
                }
                if let Some((k, user_timeout)) = &keepalive {
                    let sock = socket2::SockRef::from(&stream);
                    if let Err(e) = sock
                        .set_tcp_keepalive(k)
                        .and_then(|()| sock.set_tcp_user_timeout(Some(*user_timeout)))
                    {
                        tracing::debug!(%peer, error = %e, "could not set TCP keep-alive");
                    }
                }
                // Counted once set up: an open connection is one that keeps alive.
                shared.stats.accepted.fetch_add(1, Ordering::Relaxed);
                tracker.spawn(connection::serve(
                    stream,
                    peer,
                    shared.clone(),
                    cancel.clone(),
                ));
            }
            Err(e) => {
                // Out of descriptors or memory: back off instead of spinning; the
                // pending connection stays in the backlog until we can take it.
                let resource = matches!(
                    e.raw_os_error(),
                    Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
                );
                if resource {
                    tracing::warn!(error = %e, "accept failed; retrying in 50ms");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                } else {
                    tracing::debug!(error = %e, "accept failed");
                }
            }
        }
    }
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit, so one server process can hold
/// tens of thousands of connections. Returns the new soft limit.
pub fn raise_fd_limit() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read and write the struct we pass.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return 0;
        }
        if lim.rlim_cur < lim.rlim_max {
            let want = libc::rlimit {
                rlim_cur: lim.rlim_max,
                rlim_max: lim.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &want) == 0 {
                return want.rlim_cur;
            }
        }
    }
    lim.rlim_cur
}
