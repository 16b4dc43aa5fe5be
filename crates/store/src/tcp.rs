//! A TCPStore-protocol client, compatible with PyTorch's servers and ours.
//!
//! Like PyTorch's client it prefixes user keys with `/`, sends one request at a time
//! on its connection, implements a blocking `get` as `WAIT` then `GET`, and on a wait
//! timeout sends `CANCEL_WAIT` and reads up to the `WAIT_CANCELED` byte. Unlike
//! PyTorch's client, every command is bounded by the store timeout (PyTorch's blocks
//! forever on a server that never answers an `ADD`), a timeout reports which keys
//! were still missing, and one store can be shared by many tasks: each call borrows
//! a connection from a small pool (opening another when all are busy), so a task
//! blocked in `get` does not stall the others. A call that fails or is dropped
//! half-way takes its connection with it, so no stale reply is ever read by the next
//! call. With one caller at a time, a store uses exactly one connection, as PyTorch's.
//!
//! With [`TcpStoreBuilder::is_master`] the store also hosts a [`Server`] on the
//! current runtime, as `TCPStore(is_master=True)` does.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use rallypoint_sync::MutexExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::protocol::{
    decode_reply, Decoded, Reply, ReplyKind, Request, CHECK_READY, STOP_WAITING, VALIDATE_MAGIC,
    WAIT_CANCELED, WORKER_COUNT_KEY,
};
use rallypoint_auth::{JobSecret, Service};

use crate::secret::REFUSAL_ECHO;
use crate::server::{Server, ServerConfig, ServerHandle};
use crate::{owned, Result, Store, StoreError, TimeoutCell};

/// How long a `CANCEL_WAIT` may take to be acknowledged before the connection is
/// considered broken.
const CANCEL_GRACE: Duration = Duration::from_secs(10);
/// Idle connections kept for reuse.
const MAX_IDLE: usize = 4;
/// Most missing keys a timeout error looks up and names.
const MAX_NAMED_MISSING: usize = 16;

/// Settings for a [`TcpStore`]; see [`TcpStore::builder`].
#[derive(Debug, Clone)]
pub struct TcpStoreBuilder {
    host: String,
    port: u16,
    timeout: Duration,
    world_size: Option<usize>,
    wait_for_workers: bool,
    is_master: bool,
    server_config: ServerConfig,
    max_reply_len: u64,
    secret: Option<JobSecret>,
}

impl TcpStoreBuilder {
    /// The job secret to prove on every connection ([`crate::secret`]);
    /// `None` for a server without one. Defaults to the process's. A master
    /// hosts its server with the same.
    pub fn secret(mut self, secret: Option<JobSecret>) -> Self {
        self.server_config.secret = secret.clone();
        self.secret = secret;
        self
    }

    /// Store timeout: bounds connecting, waits, and every reply (default 300 s).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Number of stores in the job. Each store then counts itself on `init/`, and a
    /// master waits for all of them (unless [`Self::wait_for_workers`] is off).
    pub fn world_size(mut self, n: usize) -> Self {
        self.world_size = Some(n);
        self
    }

    /// Whether to count into `init/` and (master) wait for `world_size` stores.
    pub fn wait_for_workers(mut self, yes: bool) -> Self {
        self.wait_for_workers = yes;
        self
    }

    /// Also host the server, bound dual-stack on all interfaces at `port`.
    pub fn is_master(mut self, yes: bool) -> Self {
        self.is_master = yes;
        self
    }

    /// Settings of the hosted server, for a master.
    pub fn server_config(mut self, config: ServerConfig) -> Self {
        self.server_config = config;
        self
    }

    /// Connects (retrying with backoff until the timeout), validates, pings, counts
    /// itself into `init/` if a world size was given, and — as master — waits for
    /// the other stores.
    pub async fn connect(self) -> Result<TcpStore> {
        let started = Instant::now();
        let mut port = self.port;
        let server = if self.is_master {
            let server = Server::bind_any(port, self.server_config.clone()).await?;
            port = server.local_addr().port();
            Some(server.spawn())
        } else {
            None
        };
        let store = TcpStore {
            addr: format!("{}:{}", self.host, port),
            host: self.host.clone(),
            port,
            pool: Mutex::new(Vec::new()),
            timeout: TimeoutCell::new(self.timeout),
            max_reply_len: self.max_reply_len,
            server,
            secret: self.secret.clone(),
        };
        store.reconnect(started + self.timeout).await?;
        if let (Some(n), true) = (self.world_size, self.wait_for_workers) {
            store.add_raw(WORKER_COUNT_KEY.as_bytes(), 1).await?;
            if self.is_master {
                store.wait_for_workers(n as i64, started).await?;
            }
        }
        Ok(store)
    }
}

impl TcpStoreBuilder {
    /// Hosts the server at the port if it is free, else joins the store that
    /// listens there (a c10d rendezvous endpoint on this host: whoever binds
    /// first hosts). The store's timeout bounds the whole set-up.
    ///
    /// Two callers racing for one port end with exactly one host. Linux marks
    /// a socket listening before it checks the port for other listeners, so two
    /// listens that overlap can both fail, each seeing the other: neither
    /// hosts, and both clients would be refused until their timeout. So a
    /// caller whose bind found the port in use joins only once something
    /// answers there, and tries to host again while nothing does. A bind that
    /// fails otherwise (a privileged port, say) joins as before.
    pub async fn host_or_join(self) -> Result<TcpStore> {
        let deadline = Instant::now() + self.timeout;
        let mut tries = 0u32;
        loop {
            match self.clone().is_master(true).connect().await {
                Ok(store) => return Ok(store),
                Err(StoreError::Listen { source, .. })
                    if source.kind() == std::io::ErrorKind::AddrInUse =>
                {
                    tries += 1;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "not hosting the store at {}:{}", self.host, self.port);
                    return self.is_master(false).connect().await;
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let probe = tokio::time::timeout(
                left.min(Duration::from_secs(1)),
                TcpStream::connect((self.host.as_str(), self.port)),
            )
            .await;
            let refused =
                matches!(&probe, Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused);
            if !refused || left.is_zero() {
                drop(probe);
                let timeout = left.max(Duration::from_millis(1));
                return self.timeout(timeout).is_master(false).connect().await;
            }
            // Nobody listens: the other binder failed too, or is between its
            // bind and its listen. Try again after a short, jittered pause.
            tracing::debug!(
                tries,
                "the store's port {} is bound but nobody listens; hosting again",
                self.port
            );
            let pause = Duration::from_millis(5 * u64::from(tries.min(10))).mul_f64(jitter());
            tokio::time::sleep(pause.min(left)).await;
        }
    }
}

/// A validated connection with its buffers.
struct Conn {
    stream: TcpStream,
    rbuf: Vec<u8>,
    wbuf: Vec<u8>,
}

/// A client of a TCPStore-protocol server.
pub struct TcpStore {
    addr: String,
    host: String,
    port: u16,
    /// Idle connections. A call takes one (or opens one) and gives it back only if
    /// it completed cleanly.
    pool: Mutex<Vec<Conn>>,
    timeout: TimeoutCell,
    max_reply_len: u64,
    server: Option<ServerHandle>,
    secret: Option<JobSecret>,
}

impl std::fmt::Debug for TcpStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpStore")
            .field("addr", &self.addr)
            .field("is_master", &self.server.is_some())
            .finish()
    }
}

fn wire_key(key: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(key.len() + 1);
    k.push(b'/');
    k.extend_from_slice(key.as_bytes());
    k
}

fn nonce() -> u32 {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    std::process::id() ^ COUNTER.fetch_add(0x9E37_79B9, Ordering::Relaxed)
}

/// A pseudo-random factor in [0.5, 1.5) for backoff jitter.
fn jitter() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    0.5 + (h.finish() % 1_000_000) as f64 / 1_000_000.0
}

impl TcpStore {
    /// Settings for a client of the server at `host:port`.
    pub fn builder(host: impl Into<String>, port: u16) -> TcpStoreBuilder {
        TcpStoreBuilder {
            host: host.into(),
            port,
            timeout: crate::DEFAULT_TIMEOUT,
            world_size: None,
            wait_for_workers: true,
            is_master: false,
            server_config: ServerConfig::default(),
            max_reply_len: 1 << 32,
            secret: crate::secret::process_secret(),
        }
    }

    /// The server's host as given.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The server's port (the bound one, for a master started on port 0).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The hosted server, for a master.
    pub fn server(&self) -> Option<&ServerHandle> {
        self.server.as_ref()
    }

    /// A second client of the same server on its own connection (PyTorch's
    /// `TCPStore.clone()`): it does not count into `init/` and hosts nothing.
    pub async fn clone_store(&self) -> Result<TcpStore> {
        let store = TcpStore {
            addr: self.addr.clone(),
            host: self.host.clone(),
            port: self.port,
            pool: Mutex::new(Vec::new()),
            timeout: TimeoutCell::new(self.timeout.get()),
            max_reply_len: self.max_reply_len,
            server: None,
            secret: self.secret.clone(),
        };
        store
            .reconnect(Instant::now() + store.timeout.get())
            .await?;
        Ok(store)
    }

    /// Round-trips a PING.
    pub async fn ping(&self) -> Result<()> {
        let sent = nonce();
        match self
            .call("ping", &Request::Ping { nonce: sent }, ReplyKind::Nonce)
            .await?
        {
            Reply::Nonce(got) if got == sent => Ok(()),
            Reply::Nonce(got) => Err(StoreError::PingMismatch {
                addr: self.addr.clone(),
                sent,
                got,
            }),
            other => Err(self.unexpected("ping", other)),
        }
    }

    /// PyTorch's `BARRIER` command (torch 2.11+ servers and ours): counts one arrival
    /// at `key` and waits up to the store timeout until `world_size` have arrived.
    pub async fn barrier(&self, key: &str, world_size: i64) -> Result<()> {
        let k = wire_key(key);
        let req = Request::Barrier {
            key: &k,
            world_size,
        };
        self.wait_request("barrier", &req, &[key], self.timeout.get())
            .await
    }

    /// The `init/` worker count: how many stores built with a world size have joined.
    pub async fn worker_count(&self) -> Result<i64> {
        self.add_raw(WORKER_COUNT_KEY.as_bytes(), 0).await
    }

    async fn wait_for_workers(&self, expected: i64, started: Instant) -> Result<()> {
        let timeout = self.timeout.get();
        let mut pause = Duration::from_millis(1);
        loop {
            let joined = self.add_raw(WORKER_COUNT_KEY.as_bytes(), 0).await?;
            if joined >= expected {
                return Ok(());
            }
            if started.elapsed() >= timeout {
                return Err(StoreError::WorkersTimeout {
                    joined,
                    expected,
                    waited: started.elapsed(),
                });
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(20));
        }
    }

    async fn add_raw(&self, key: &[u8], delta: i64) -> Result<i64> {
        match self
            .call("add", &Request::Add { key, delta }, ReplyKind::Int)
            .await?
        {
            Reply::Int(v) => Ok(v),
            other => Err(self.unexpected("add", other)),
        }
    }

    /// A well-formed reply that is not one this command can get (e.g. a WAIT answered
    /// with a byte other than STOP_WAITING).
    fn unexpected(&self, op: &'static str, reply: Reply) -> StoreError {
        StoreError::UnexpectedReply {
            op,
            addr: self.addr.clone(),
            reply: format!("{reply:?}"),
        }
    }

    /// Opens a connection into the pool, retrying until `deadline`.
    async fn reconnect(&self, deadline: Instant) -> Result<()> {
        let conn = self.open(deadline).await?;
        self.put(conn);
        Ok(())
    }

    fn idle(&self) -> std::sync::MutexGuard<'_, Vec<Conn>> {
        self.pool.locked()
    }

    /// Takes an idle connection, or opens one.
    async fn take(&self, deadline: Instant) -> Result<Conn> {
        let idle = self.idle().pop();
        match idle {
            Some(conn) => Ok(conn),
            None => self.open(deadline).await,
        }
    }

    /// Returns a connection whose last exchange completed.
    fn put(&self, conn: Conn) {
        let mut idle = self.idle();
        if idle.len() < MAX_IDLE {
            idle.push(conn);
        }
    }

    async fn open(&self, deadline: Instant) -> Result<Conn> {
        let started = Instant::now();
        let mut backoff = Duration::from_millis(10);
        loop {
            let err = match self.try_open(deadline).await {
                Ok(conn) => return Ok(conn),
                Err(OpenError::Store(
                    e @ (StoreError::WrongSecret { .. } | StoreError::SecretRequired { .. }),
                )) => return Err(e),
                Err(e) => e,
            };
            let now = Instant::now();
            let pause = backoff.mul_f64(jitter());
            if now + pause >= deadline {
                return Err(match err {
                    OpenError::Io(source) => StoreError::Connect {
                        addr: self.addr.clone(),
                        waited: started.elapsed(),
                        source,
                    },
                    OpenError::Store(e) => e,
                });
            }
            tracing::debug!(addr = %self.addr, ?pause, "store not reachable yet; retrying");
            tokio::time::sleep(pause).await;
            backoff = (backoff * 2).min(Duration::from_secs(1));
        }
    }

    async fn try_open(&self, deadline: Instant) -> Result<Conn, OpenError> {
        let addrs = tokio::time::timeout_at(
            deadline,
            tokio::net::lookup_host((self.host.as_str(), self.port)),
        )
        .await
        .map_err(|_| OpenError::Io(std::io::ErrorKind::TimedOut.into()))?
        .map_err(OpenError::Io)?;
        let mut last =
            std::io::Error::new(std::io::ErrorKind::NotFound, "host resolved to no address");
        for addr in addrs {
            match tokio::time::timeout_at(deadline, TcpStream::connect(addr)).await {
                Ok(Ok(mut stream)) => {
                    let _ = stream.set_nodelay(true);
                    if let Some(secret) = &self.secret {
                        self.prove(&mut stream, addr, secret, deadline).await?;
                    }
                    let mut conn = Conn {
                        stream,
                        rbuf: Vec::new(),
                        wbuf: Vec::new(),
                    };
                    return self.handshake(&mut conn, deadline).await.map(|_| conn);
                }
                Ok(Err(e)) => last = e,
                Err(_) => last = std::io::ErrorKind::TimedOut.into(),
            }
        }
        Err(OpenError::Io(last))
    }

    /// The job-secret handshake, before PyTorch's: a wrong secret is final.
    async fn prove(
        &self,
        stream: &mut TcpStream,
        addr: std::net::SocketAddr,
        secret: &JobSecret,
        deadline: Instant,
    ) -> Result<(), OpenError> {
        let deadline = deadline.into_std();
        let proof = rallypoint_auth::io::tokio::client_handshake(
            stream,
            addr,
            secret,
            Service::STORE,
            deadline,
        );
        match proof.await {
            Ok(()) => Ok(()),
            // Another secret, or not a store at all: final either way.
            Err(e) if matches!(e.reason, rallypoint_auth::ClientFailure::Mismatch(_)) => {
                Err(OpenError::Store(StoreError::WrongSecret {
                    addr: self.addr.clone(),
                    detail: e.to_string(),
                }))
            }
            Err(e) => Err(OpenError::Io(std::io::Error::other(e.to_string()))),
        }
    }

    async fn handshake(&self, conn: &mut Conn, deadline: Instant) -> Result<(), OpenError> {
        let sent = nonce();
        conn.wbuf.clear();
        Request::Validate {
            magic: VALIDATE_MAGIC,
        }
        .encode(&mut conn.wbuf);
        Request::Ping { nonce: sent }.encode(&mut conn.wbuf);
        let reply = self
            .exchange(conn, "handshake", Some(ReplyKind::Nonce), deadline)
            .await
            .map_err(|e| match e {
                StoreError::Disconnected { source, .. } => OpenError::Io(source),
                other => OpenError::Store(other),
            })?;
        match reply {
            Some(Reply::Nonce(got)) if got == sent => Ok(()),
            Some(Reply::Nonce(got)) if got.to_le_bytes() == REFUSAL_ECHO[..4] => {
                Err(OpenError::Store(StoreError::SecretRequired {
                    addr: self.addr.clone(),
                }))
            }
            Some(Reply::Nonce(got)) => Err(OpenError::Store(StoreError::PingMismatch {
                addr: self.addr.clone(),
                sent,
                got,
            })),
            _ => Err(OpenError::Store(
                self.unexpected("handshake", Reply::Byte(0xff)),
            )),
        }
    }

    /// Writes `conn.wbuf` and, if `kind` is given, reads one reply by `deadline`.
    async fn exchange(
        &self,
        conn: &mut Conn,
        op: &'static str,
        kind: Option<ReplyKind>,
        deadline: Instant,
    ) -> Result<Option<Reply>> {
        let lost = |source| StoreError::Disconnected {
            op,
            addr: self.addr.clone(),
            source,
        };
        conn.stream.write_all(&conn.wbuf).await.map_err(lost)?;
        let Some(kind) = kind else {
            return Ok(None);
        };
        self.read_reply(conn, op, kind, deadline).await.map(Some)
    }

    async fn read_reply(
        &self,
        conn: &mut Conn,
        op: &'static str,
        kind: ReplyKind,
        deadline: Instant,
    ) -> Result<Reply> {
        loop {
            match decode_reply(kind, &conn.rbuf, self.max_reply_len) {
                Ok(Decoded::Complete(reply, used)) => {
                    conn.rbuf.drain(..used);
                    return Ok(reply);
                }
                Ok(Decoded::Incomplete { needed }) => {
                    let want = needed - conn.rbuf.len();
                    conn.rbuf.reserve(want.min(1 << 20));
                }
                Err(source) => {
                    return Err(StoreError::Protocol {
                        op,
                        addr: self.addr.clone(),
                        source,
                    })
                }
            }
            let read = tokio::time::timeout_at(deadline, conn.stream.read_buf(&mut conn.rbuf));
            match read.await {
                Err(_) => {
                    return Err(StoreError::NoReply {
                        op,
                        addr: self.addr.clone(),
                        waited: self.timeout.get(),
                    })
                }
                Ok(Ok(0)) => {
                    return Err(StoreError::Disconnected {
                        op,
                        addr: self.addr.clone(),
                        source: std::io::ErrorKind::UnexpectedEof.into(),
                    })
                }
                Ok(Ok(_)) => {}
                Ok(Err(source)) => {
                    return Err(StoreError::Disconnected {
                        op,
                        addr: self.addr.clone(),
                        source,
                    })
                }
            }
        }
    }

    /// Sends one request and reads its reply (if it has one). A connection that
    /// failed is dropped, not returned to the pool.
    async fn send(
        &self,
        op: &'static str,
        req: &Request<'_>,
        kind: Option<ReplyKind>,
    ) -> Result<Option<Reply>> {
        let deadline = Instant::now() + self.timeout.get();
        let mut conn = self.take(deadline).await?;
        conn.wbuf.clear();
        req.encode(&mut conn.wbuf);
        let reply = self.exchange(&mut conn, op, kind, deadline).await?;
        self.put(conn);
        Ok(reply)
    }

    async fn call(&self, op: &'static str, req: &Request<'_>, kind: ReplyKind) -> Result<Reply> {
        Ok(self
            .send(op, req, Some(kind))
            .await?
            .expect("a reply was asked for"))
    }

    /// Sends a WAIT-like request (WAIT or BARRIER) and waits for STOP_WAITING. On
    /// timeout: CANCEL_WAIT, read through WAIT_CANCELED, and name the missing keys.
    async fn wait_request(
        &self,
        op: &'static str,
        req: &Request<'_>,
        keys: &[&str],
        timeout: Duration,
    ) -> Result<()> {
        let started = Instant::now();
        let deadline = started + timeout;
        let mut conn = self.take(started + self.timeout.get().max(timeout)).await?;
        conn.wbuf.clear();
        req.encode(&mut conn.wbuf);
        let completed = match self
            .exchange(&mut conn, op, Some(ReplyKind::Byte), deadline)
            .await
        {
            Ok(Some(Reply::Byte(STOP_WAITING))) => true,
            Ok(Some(other)) => return Err(self.unexpected(op, other)),
            Ok(None) => unreachable!("a reply was asked for"),
            Err(StoreError::NoReply { .. }) => self.cancel_wait(&mut conn, op).await?,
            Err(e) => return Err(e),
        };
        self.put(conn);
        if completed {
            return Ok(());
        }
        let missing = self.missing(keys).await;
        Err(StoreError::Timeout {
            op,
            keys: owned(keys),
            missing,
            waited: started.elapsed(),
        })
    }

    /// Cancels the pending wait; returns whether it had completed after all.
    async fn cancel_wait(&self, conn: &mut Conn, op: &'static str) -> Result<bool> {
        conn.wbuf.clear();
        Request::CancelWait.encode(&mut conn.wbuf);
        let deadline = Instant::now() + CANCEL_GRACE;
        let mut completed = false;
        let mut next = self
            .exchange(conn, op, Some(ReplyKind::Byte), deadline)
            .await?;
        loop {
            match next {
                Some(Reply::Byte(WAIT_CANCELED)) => return Ok(completed),
                // The wait completed just before the cancel reached the server.
                Some(Reply::Byte(STOP_WAITING)) => completed = true,
                Some(other) => return Err(self.unexpected(op, other)),
                None => unreachable!("a reply was asked for"),
            }
            next = Some(self.read_reply(conn, op, ReplyKind::Byte, deadline).await?);
        }
    }

    /// The first few of `keys` that do not exist, for a timeout message.
    async fn missing(&self, keys: &[&str]) -> Vec<String> {
        let mut missing = Vec::new();
        for key in keys.iter().take(MAX_NAMED_MISSING) {
            if let Ok(false) = self.check(&[key]).await {
                missing.push((*key).to_owned());
            }
        }
        missing
    }
}

enum OpenError {
    /// Worth retrying.
    Io(std::io::Error),
    /// The peer answered, wrongly.
    Store(StoreError),
}

#[async_trait::async_trait]
impl Store for TcpStore {
    async fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let k = wire_key(key);
        self.send("set", &Request::Set { key: &k, value }, None)
            .await
            .map(drop)
    }

    async fn get_now(&self, key: &str) -> Result<Vec<u8>> {
        let k = wire_key(key);
        match self
            .call("get", &Request::Get { key: &k }, ReplyKind::Str)
            .await?
        {
            Reply::Str(v) => Ok(v),
            other => Err(self.unexpected("get", other)),
        }
    }

    async fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.add_raw(&wire_key(key), delta).await
    }

    async fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        let k = wire_key(key);
        let req = Request::CompareSet {
            key: &k,
            expected,
            desired,
        };
        match self.call("compare_set", &req, ReplyKind::Str).await? {
            Reply::Str(v) => Ok(v),
            other => Err(self.unexpected("compare_set", other)),
        }
    }

    async fn wait_timeout(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let wire: Vec<Vec<u8>> = keys.iter().map(|k| wire_key(k)).collect();
        let req = Request::Wait {
            keys: wire.iter().map(Vec::as_slice).collect(),
        };
        self.wait_request("wait", &req, keys, timeout).await
    }

    async fn check(&self, keys: &[&str]) -> Result<bool> {
        let wire: Vec<Vec<u8>> = keys.iter().map(|k| wire_key(k)).collect();
        let req = Request::Check {
            keys: wire.iter().map(Vec::as_slice).collect(),
        };
        match self.call("check", &req, ReplyKind::Byte).await? {
            Reply::Byte(b) => Ok(b == CHECK_READY),
            other => Err(self.unexpected("check", other)),
        }
    }

    async fn delete_key(&self, key: &str) -> Result<bool> {
        let k = wire_key(key);
        match self
            .call(
                "delete_key",
                &Request::DeleteKey { key: &k },
                ReplyKind::Int,
            )
            .await?
        {
            Reply::Int(n) => Ok(n == 1),
            other => Err(self.unexpected("delete_key", other)),
        }
    }

    async fn num_keys(&self) -> Result<i64> {
        match self
            .call("num_keys", &Request::GetNumKeys, ReplyKind::Int)
            .await?
        {
            Reply::Int(n) => Ok(n),
            other => Err(self.unexpected("num_keys", other)),
        }
    }

    async fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>> {
        self.wait(keys).await?;
        let wire: Vec<Vec<u8>> = keys.iter().map(|k| wire_key(k)).collect();
        let req = Request::MultiGet {
            keys: wire.iter().map(Vec::as_slice).collect(),
        };
        match self
            .call("multi_get", &req, ReplyKind::Strs(keys.len()))
            .await?
        {
            Reply::Strs(v) => Ok(v),
            other => Err(self.unexpected("multi_get", other)),
        }
    }

    async fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<()> {
        let wire: Vec<Vec<u8>> = pairs.iter().map(|(k, _)| wire_key(k)).collect();
        let req = Request::MultiSet {
            pairs: wire
                .iter()
                .zip(pairs)
                .map(|(k, (_, v))| (k.as_slice(), *v))
                .collect(),
        };
        self.send("multi_set", &req, None).await.map(drop)
    }

    async fn append(&self, key: &str, value: &[u8]) -> Result<()> {
        let k = wire_key(key);
        self.send("append", &Request::Append { key: &k, value }, None)
            .await
            .map(drop)
    }

    async fn list_keys(&self) -> Result<Vec<String>> {
        match self
            .call("list_keys", &Request::ListKeys, ReplyKind::Keys)
            .await?
        {
            Reply::Keys(keys) => Ok(keys
                .into_iter()
                .filter_map(|k| {
                    k.strip_prefix(b"/")
                        .map(|k| String::from_utf8_lossy(k).into_owned())
                })
                .collect()),
            other => Err(self.unexpected("list_keys", other)),
        }
    }

    async fn queue_push(&self, key: &str, value: &[u8]) -> Result<()> {
        let k = wire_key(key);
        self.send("queue_push", &Request::QueuePush { key: &k, value }, None)
            .await
            .map(drop)
    }

    async fn queue_pop(&self, key: &str, block: bool) -> Result<Vec<u8>> {
        if block {
            self.wait(&[key]).await?;
        }
        let k = wire_key(key);
        match self
            .call(
                "queue_pop",
                &Request::QueuePop { key: &k },
                ReplyKind::Popped,
            )
            .await?
        {
            Reply::Popped(Some(v)) => Ok(v),
            Reply::Popped(None) => Err(StoreError::QueueEmpty {
                key: key.to_owned(),
            }),
            other => Err(self.unexpected("queue_pop", other)),
        }
    }

    async fn queue_len(&self, key: &str) -> Result<i64> {
        let k = wire_key(key);
        match self
            .call("queue_len", &Request::QueueLen { key: &k }, ReplyKind::Int)
            .await?
        {
            Reply::Int(n) => Ok(n),
            other => Err(self.unexpected("queue_len", other)),
        }
    }

    fn timeout(&self) -> Duration {
        self.timeout.get()
    }

    fn set_timeout(&self, timeout: Duration) {
        self.timeout.set(timeout)
    }
}
