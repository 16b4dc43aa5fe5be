//! Connections: opening them (lazily, by whichever side first needs to
//! send; connecting is the transport's own task, never cut short by the op
//! that asked), accepting them (the hello and its checks), the liveness
//! settings on each, and probing a peer that may be gone.
//!
//! With a job secret ([`Config::secret`]) a connection proves it both ways
//! before its hello: [`Shared::open`] runs the client's side of the
//! handshake right after connecting (within the handshake timeout, like
//! the hello's answer), and each accepted connection's task runs the
//! server's side before it reads the hello (within `SERVER_DEADLINE`, 2 s).
//! Every dial and accept between ranks passes here, so nothing else needs
//! to know. The dialler's failures map to [`Fail`]s: another secret, or a
//! listener that answered our HELLO with its hello's refusal (it has no
//! secret), is [`Fail::Secret`], final; a listener that does not answer
//! is unanswered, as for the hello; a closed connection is a peer gone. A
//! listener refuses a connection that fails with one warning naming the
//! peer, counts it, and answers a peer that sent a hello instead (a rank
//! without the secret) with the hello's refusal ([`NO_PROOF`]), so that
//! rank fails saying why.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use rallypoint_auth::io::tokio::{client_handshake, server_handshake};
use rallypoint_auth::io::SERVER_DEADLINE;
use rallypoint_auth::{
    ClientFailure, JobSecret, RefusalKind, ServerMismatch, Service, TransportError,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{sleep, timeout, timeout_at, Instant};

use super::reader::read_loop;
use super::router::Fail;
use super::{lock, Config, Conn, Shared, ABORT_DEADLINE, HANDSHAKE_TIMEOUT, SETTLE_MAX};
use crate::error::Error;
use crate::frame::{Hello, ACCEPTED, HELLO_LEN, NOT_HERE, REFUSED};

impl Shared {
    pub(super) fn pick_conn(&self, dst: usize, pick: usize) -> Option<Arc<Conn>> {
        let peers = lock(&self.peers);
        let p = peers.get(&dst)?;
        (!p.conns.is_empty()).then(|| p.conns[pick % p.conns.len()].clone())
    }

    /// A connection to `dst`, opened if there is none.
    pub(super) async fn conn(
        self: &Arc<Self>,
        dst: usize,
        pick: usize,
        deadline: Instant,
    ) -> Result<Arc<Conn>, Fail> {
        if let Some(c) = self.pick_conn(dst, pick) {
            return Ok(c);
        }
        if self.is_dead() {
            return Err(Fail::Aborted(Error::Invalid(
                "this rank was killed (fault injection)".into(),
            )));
        }
        // A connection that ended as soon as it opened (or the one found
        // open, ending meanwhile: a connection broken under a live peer)
        // proves nothing: open again, and a dead peer refuses (named gone
        // there); a few times at most. It was taken for proof of death: a
        // seeded break (seed 1313, 1 replay in about 90 under load) had the
        // rank that broke its connection name the live peer gone.
        for _ in 0..3 {
            // Connecting belongs to the transport, not to the op that asked:
            // an op cancelled or aborted mid-handshake must not drop a
            // connection the peer has already registered (the peer would
            // read a reset).
            let me = self.clone();
            let opening = self
                .rt
                .spawn(async move { me.open_streams(dst, deadline).await });
            match timeout_at(deadline, opening).await {
                Err(_) => return Err(Fail::Timeout),
                Ok(Err(_)) => {
                    return Err(Fail::Gone {
                        rank: dst,
                        reason: "the transport shut down".into(),
                    })
                }
                Ok(Ok(r)) => r?,
            }
            if let Some(c) = self.pick_conn(dst, pick) {
                return Ok(c);
            }
        }
        Err(Fail::Gone {
            rank: dst,
            reason: "its connections closed as they opened, three times".into(),
        })
    }

    /// Opens the connections to `dst` (one per stream), unless another task
    /// has meanwhile.
    pub(super) async fn open_streams(
        self: Arc<Self>,
        dst: usize,
        deadline: Instant,
    ) -> Result<(), Fail> {
        let gate = lock(&self.connecting).entry(dst).or_default().clone();
        let _g = timeout_at(deadline, gate.lock())
            .await
            .map_err(|_| Fail::Timeout)?;
        if self.connected(dst) {
            return Ok(());
        }
        if let Some(reason) = lock(&self.router).gone(dst) {
            return Err(Fail::Gone {
                rank: dst,
                reason: reason.clone(),
            });
        }
        for _ in 0..self.cfg.streams.max(1) {
            match self.open(dst, deadline).await {
                Ok(stream) => self.register(dst, stream),
                Err(f) => {
                    if let Fail::Gone { reason, .. } = &f {
                        // The peer may have connected to us meanwhile (both
                        // sides connect at once): what it sent on its own
                        // connection is still to be read, and its reader
                        // names it gone when that ends (as `read_loop` does).
                        // An exiting peer's listener closes under our connect
                        // before its connections have been read.
                        self.handshakes_settled().await;
                        if self.connected(dst) {
                            return Ok(());
                        }
                        self.mark_gone(dst, reason);
                    }
                    return Err(f);
                }
            }
        }
        Ok(())
    }

    /// Where `peer` listens, if this rank has looked it up (a rank only ever
    /// reached over shared memory has not).
    pub(crate) fn known_addr(&self, peer: usize) -> Option<SocketAddr> {
        lock(&self.addrs).get(&peer).copied()
    }

    /// Whether `peer`'s address is known or in the store, without waiting.
    pub(super) async fn published(&self, peer: usize) -> bool {
        if lock(&self.addrs).contains_key(&peer) {
            return true;
        }
        let key = format!("addr/{peer}");
        timeout(ABORT_DEADLINE, self.store().check(&[&key]))
            .await
            .is_ok_and(|r| r.unwrap_or(true))
    }

    /// Where `peer` listens, from the cache or the store.
    pub(super) async fn addr(&self, peer: usize, deadline: Instant) -> Result<SocketAddr, Fail> {
        if let Some(a) = lock(&self.addrs).get(&peer) {
            return Ok(*a);
        }
        let key = format!("addr/{peer}");
        let left = deadline.saturating_duration_since(Instant::now());
        let fetched = async {
            self.store().wait_timeout(&[&key], left).await?;
            self.store().get_now(&key).await
        };
        // Until it is found (not merely until this wait ends: a timeout may
        // drop the wait, and its message reads this).
        lock(&self.unpublished).insert(peer);
        let raw = match fetched.await {
            Ok(v) => {
                lock(&self.unpublished).remove(&peer);
                v
            }
            Err(rallypoint_store::StoreError::Timeout { .. }) => return Err(Fail::Timeout),
            Err(e) => {
                return Err(Fail::Refused {
                    rank: peer,
                    reason: format!("reading its address from the store failed: {e}"),
                })
            }
        };
        let text = String::from_utf8_lossy(&raw);
        let addr: SocketAddr = text.parse().map_err(|_| Fail::Refused {
            rank: peer,
            reason: format!("its published address {text:?} is not host:port"),
        })?;
        lock(&self.addrs).insert(peer, addr);
        Ok(addr)
    }

    /// Connects to `dst` and says hello.
    pub(super) async fn open(&self, dst: usize, deadline: Instant) -> Result<TcpStream, Fail> {
        let addr = self.addr(dst, deadline).await?;
        let gone = |e: std::io::Error| Fail::Gone {
            rank: dst,
            reason: format!("connecting to {addr} failed: {e}"),
        };
        let mut s = timeout_at(deadline, TcpStream::connect(addr))
            .await
            .map_err(|_| Fail::Timeout)?
            .map_err(gone)?;
        s.set_nodelay(true).map_err(gone)?;
        watch_liveness(&s, self.cfg.peer_timeout);
        let answer_by = deadline.min(Instant::now() + self.cfg.handshake_timeout);
        if let Some(secret) = &self.cfg.secret {
            match prove(&mut s, dst, addr, secret, answer_by, deadline).await {
                // A peer that proved the secret before (it has an entry
                // since its first connection) and now does not: the
                // process at its address is another, as `NOT_HERE` says
                // below without a secret.
                Err(Fail::Secret { reason, .. }) if lock(&self.peers).contains_key(&dst) => {
                    return Err(Fail::Gone {
                        rank: dst,
                        reason: format!(
                            "it no longer listens at {addr}, a process without our job secret does ({reason}): it exited"
                        ),
                    });
                }
                r => r?,
            }
        }
        let hello = Hello {
            nonce: self.cfg.nonce,
            layout: self.cfg.layout,
            world: self.cfg.world as u32,
            src: self.cfg.rank as u32,
            dst: dst as u32,
            name: self.cfg.name.clone(),
        };
        let shake = async {
            s.write_all(&hello.encode()).await?;
            let status = s.read_u8().await?;
            if status == ACCEPTED {
                return Ok(None);
            }
            let n = s.read_u16_le().await?;
            let mut why = vec![0; usize::from(n)];
            s.read_exact(&mut why).await?;
            let why = String::from_utf8_lossy(&why).into_owned();
            Ok::<_, std::io::Error>(Some((status, why)))
        };
        match timeout_at(answer_by, shake).await {
            Err(_) if answer_by < deadline => Err(Fail::Unanswered {
                rank: dst,
                reason: format!(
                    "{addr} accepted a connection but did not answer its handshake within {:?}: the process is stopped or hung",
                    self.cfg.handshake_timeout
                ),
            }),
            Err(_) => Err(Fail::Timeout),
            Ok(Err(e)) => Err(gone(e)),
            // The address it published answers for another group or
            // instance: its listener closed (the process exited) and the port
            // went to another process.
            Ok(Ok(Some((NOT_HERE, why)))) => Err(Fail::Gone {
                rank: dst,
                reason: format!(
                    "it no longer listens at {addr}, another group's process does (it refused us: {why}): it exited, or the address is wrong"
                ),
            }),
            // A rank with the job secret, and this one has none.
            Ok(Ok(Some((REFUSED, why)))) if why == NO_PROOF => Err(Fail::Secret {
                rank: dst,
                reason: format!("{addr} refused the connection: {why}"),
            }),
            Ok(Ok(Some((_, why)))) => Err(Fail::Refused {
                rank: dst,
                reason: format!("it refused the connection: {why}"),
            }),
            Ok(Ok(None)) => Ok(s),
        }
    }

    /// Adds an established connection with `peer` and starts its reader.
    pub(super) fn register(self: &Arc<Self>, peer: usize, stream: TcpStream) {
        if self.is_dead() {
            return;
        }
        lock(&self.unpublished).remove(&peer);
        let (rd, wr) = stream.into_split();
        let id = self.next_conn.fetch_add(1, Ordering::Relaxed);
        let conn = Arc::new(Conn {
            id,
            writer: Arc::new(tokio::sync::Mutex::new(wr)),
        });
        lock(&self.peers).entry(peer).or_default().conns.push(conn);
        self.handshakes.fetch_add(1, Ordering::Relaxed);
        self.rt.spawn(read_loop(self.clone(), peer, id, rd));
        self.tell_aborts_to(peer, None);
    }

    /// Removes a closed connection; returns whether it was the peer's last.
    pub(super) fn remove_conn(&self, peer: usize, id: u64) -> bool {
        let mut peers = lock(&self.peers);
        let p = peers.entry(peer).or_default();
        p.conns.retain(|c| c.id != id);
        p.conns.is_empty()
    }

    /// Waits until no accepted connection is mid-handshake: one may be the
    /// peer's other connection, carrying frames. Bounded by [`SETTLE_MAX`], so a
    /// stranger idling on the port delays noticing a death by that at most.
    pub(super) async fn handshakes_settled(&self) {
        let deadline = Instant::now() + SETTLE_MAX;
        loop {
            let done = self.handshakes_done.notified();
            if self.handshaking.load(Ordering::Acquire) == 0 || Instant::now() >= deadline {
                return;
            }
            let _ = timeout_at(deadline, done).await;
        }
    }

    /// Checks that `peer` is alive by connecting to it, in the background,
    /// unless a connection exists: a refused connect, or another group's
    /// process answering at its address, marks it gone (see
    /// [`Shared::gone_reason`]), unless the peer's own connection with us
    /// came up meanwhile.
    pub fn probe(self: &Arc<Self>, peer: usize, deadline: Instant) {
        if self.connected(peer) || self.gone_reason(peer).is_some() {
            return;
        }
        let me = self.clone();
        self.rt.spawn(async move {
            let _ = me.conn(peer, 0, deadline).await;
        });
    }
}

/// Makes the kernel fail a connection whose peer's host stops answering
/// within about `within`: keepalive probes while idle (answered by the peer's
/// kernel, so an idle stopped process is not taken for a dead host), and, on
/// Linux, `TCP_USER_TIMEOUT` for data left unacknowledged, which since Linux
/// 5.11 also covers a peer that takes nothing (its window stays shut): a
/// process stopped that long while we have data for it is taken for gone.
pub(super) fn watch_liveness(s: &TcpStream, within: Duration) {
    if within.is_zero() {
        return;
    }
    let step = (within / 5).max(Duration::from_secs(1));
    let ka = socket2::TcpKeepalive::new()
        .with_time(step)
        .with_interval(step)
        .with_retries(4);
    let sock = socket2::SockRef::from(s);
    let set = sock.set_tcp_keepalive(&ka);
    #[cfg(any(target_os = "linux", target_os = "android"))]
    let set = set.and_then(|()| sock.set_tcp_user_timeout(Some(within)));
    if let Err(e) = set {
        tracing::debug!("setting keepalive on a connection failed: {e}");
    }
}

pub(super) async fn accept_loop(shared: Arc<Shared>, listener: TcpListener) {
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = shared.cancel.cancelled() => return,
        };
        match accepted {
            Ok((s, from)) => {
                let shared = shared.clone();
                shared.rt.clone().spawn(async move {
                    let cancel = shared.cancel.clone();
                    tokio::select! {
                        _ = accept_one(shared, s, from) => {}
                        _ = cancel.cancelled() => {}
                    }
                });
            }
            Err(e) => {
                // Out of descriptors and the like: back off rather than spin.
                tracing::warn!("accept failed: {e}");
                sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

pub(super) async fn accept_one(shared: Arc<Shared>, mut s: TcpStream, from: SocketAddr) {
    let _ = s.set_nodelay(true);
    watch_liveness(&s, shared.cfg.peer_timeout);
    // Counted until settled, or until dropped (the transport shut down
    // mid-handshake), so that nobody waits on it in vain.
    struct Handshaking<'a>(&'a Shared, bool);
    impl Handshaking<'_> {
        fn settle(&mut self) {
            if std::mem::take(&mut self.1) && self.0.handshaking.fetch_sub(1, Ordering::AcqRel) == 1
            {
                self.0.handshakes_done.notify_waiters();
            }
        }
    }
    impl Drop for Handshaking<'_> {
        fn drop(&mut self) {
            self.settle();
        }
    }
    shared.handshaking.fetch_add(1, Ordering::AcqRel);
    let mut shaking = Handshaking(&shared, true);
    // Counted from its accept, its job-secret handshake too: the peer's
    // other connection may be in it (a stranger delays `handshakes_settled`
    // by `SETTLE_MAX` at most, as ever).
    if let Some(secret) = &shared.cfg.secret {
        if let Err(kind) = admit(&shared, &mut s, from, secret).await {
            shaking.settle();
            if kind == RefusalKind::NotOurProtocol {
                // A rank without the secret sent its hello: told why, so
                // that it fails saying so.
                let _ = timeout(
                    Duration::from_secs(1),
                    linger_refusal(&mut s, REFUSED, NO_PROOF),
                )
                .await;
            }
            return;
        }
    }
    let verdict = match timeout(HANDSHAKE_TIMEOUT, read_hello(&mut s)).await {
        Err(_) => Err((REFUSED, format!("no hello within {HANDSHAKE_TIMEOUT:?}"))),
        Ok(Err(e)) => Err((REFUSED, e)),
        Ok(Ok(h)) => check_hello(&shared.cfg, &h).map(|()| h.src as usize),
    };
    match verdict {
        Ok(src) => {
            if s.write_all(&[ACCEPTED]).await.is_ok() {
                shared.register(src, s);
            }
            shaking.settle();
        }
        Err((status, why)) => {
            shaking.settle();
            shared.refused.fetch_add(1, Ordering::Relaxed);
            if status == NOT_HERE {
                // Whoever had this port before us exited; its group's
                // survivors find it gone here. Not a fault of ours.
                tracing::debug!(%from, "refused a connection: {why}");
            } else {
                tracing::warn!(%from, "refused a connection: {why}");
            }
            let _ = timeout(Duration::from_secs(1), s.write_all(&refusal(status, &why))).await;
        }
    }
}

/// The dialling side of the job-secret handshake with `dst` at `addr`, on
/// a connection just opened, before its hello; the peer must answer by
/// `answer_by` (the handshake timeout), within the op's `deadline`.
async fn prove(
    s: &mut TcpStream,
    dst: usize,
    addr: SocketAddr,
    secret: &JobSecret,
    answer_by: Instant,
    deadline: Instant,
) -> Result<(), Fail> {
    let proof = client_handshake(s, addr, secret, Service::COLLECTIVES, answer_by.into_std());
    let Err(e) = proof.await else {
        return Ok(());
    };
    match &e.reason {
        // Another secret, or a listener without one (it answered our HELLO
        // with its hello's refusal): final, and said at once.
        ClientFailure::Mismatch(m) => {
            let hint = match m {
                ServerMismatch::NotOurProtocol(_) => ": does that rank run without the job secret?",
                _ => "",
            };
            Err(Fail::Secret {
                rank: dst,
                reason: format!("{e}{hint}"),
            })
        }
        ClientFailure::Transport(TransportError::TimedOut { .. }) if answer_by < deadline => {
            Err(Fail::Unanswered {
                rank: dst,
                reason: format!("{e}: the process is stopped or hung"),
            })
        }
        ClientFailure::Transport(TransportError::TimedOut { .. }) => Err(Fail::Timeout),
        ClientFailure::Transport(_) => Err(Fail::Gone {
            rank: dst,
            reason: format!("connecting to {addr} failed: {e}"),
        }),
    }
}

/// The accepting side of the job-secret handshake, before anything of the
/// collectives' protocol is read: `Ok` if the peer proved the secret, else
/// the refusal's kind, logged (naming the peer) and counted. Runs in the
/// connection's own task: a stalled peer holds only its own connection,
/// until [`SERVER_DEADLINE`].
async fn admit(
    shared: &Shared,
    s: &mut TcpStream,
    from: SocketAddr,
    secret: &JobSecret,
) -> Result<(), RefusalKind> {
    let deadline = std::time::Instant::now() + SERVER_DEADLINE;
    let proof = server_handshake(s, from, secret, Service::COLLECTIVES, deadline);
    proof.await.map_err(|refusal| {
        shared.refusals.count(&refusal);
        tracing::warn!("collectives: {refusal}");
        refusal.kind()
    })
}

/// What a rank with the job secret answers a hello that proved none.
const NO_PROOF: &str = "its listener admits only connections that prove the job secret, \
                        and this one proved none (is RALLY_JOB_SECRET_FILE set for every rank?)";

/// Answers a hello with `status` and `why`, then reads (and drops) what the
/// peer still sends until it closes, so that our close does not reset the
/// connection under the answer before the peer has read it. The caller
/// bounds it.
async fn linger_refusal(s: &mut TcpStream, status: u8, why: &str) {
    if s.write_all(&refusal(status, why)).await.is_err() || s.shutdown().await.is_err() {
        return;
    }
    let mut sink = [0u8; 1024];
    while matches!(s.read(&mut sink).await, Ok(n) if n > 0) {}
}

/// A refused hello's answer: its status, the reason's length (`u16` LE,
/// at most 4096) and the reason.
fn refusal(status: u8, why: &str) -> Vec<u8> {
    let why = &why.as_bytes()[..why.len().min(4096)];
    let mut reply = vec![status];
    reply.extend_from_slice(&(why.len() as u16).to_le_bytes());
    reply.extend_from_slice(why);
    reply
}

pub(super) async fn read_hello(s: &mut TcpStream) -> Result<Hello, String> {
    let mut fixed = [0u8; HELLO_LEN];
    s.read_exact(&mut fixed)
        .await
        .map_err(|e| format!("reading the hello: {e}"))?;
    let (mut h, n) = Hello::decode_fixed(&fixed).map_err(|e| e.0)?;
    let mut name = vec![0; n];
    s.read_exact(&mut name)
        .await
        .map_err(|e| format!("reading the hello: {e}"))?;
    h.name = String::from_utf8(name).map_err(|_| "the group name is not UTF-8".to_owned())?;
    Ok(h)
}

/// The status a refused hello is answered with, and why.
pub(super) fn check_hello(cfg: &Config, h: &Hello) -> Result<(), (u8, String)> {
    // Another group's or instance's member dialled an address that is ours
    // now: the one it wanted is not here.
    if h.name != cfg.name {
        return Err((
            NOT_HERE,
            format!("it is for group {:?}; this is group {:?}", h.name, cfg.name),
        ));
    }
    if h.nonce != cfg.nonce {
        return Err((NOT_HERE, format!(
            "it is from another instance of group {:?} (generation {:016x}, ours {:016x}): an earlier round or another job",
            cfg.name, h.nonce, cfg.nonce
        )));
    }
    check_member(cfg, h).map_err(|why| (REFUSED, why))
}

/// A hello of this group instance that this member still cannot accept.
pub(super) fn check_member(cfg: &Config, h: &Hello) -> Result<(), String> {
    if h.world as usize != cfg.world {
        return Err(format!(
            "it has world size {}, ours is {}",
            h.world, cfg.world
        ));
    }
    if h.dst as usize != cfg.rank {
        return Err(format!(
            "it is addressed to rank {}; this is rank {}",
            h.dst, cfg.rank
        ));
    }
    if h.src as usize >= cfg.world || h.src as usize == cfg.rank {
        return Err(format!("it claims to be rank {}", h.src));
    }
    if h.layout != cfg.layout {
        return Err(
            "its options differ (segment size or algorithm thresholds); every rank must use the same"
                .into(),
        );
    }
    Ok(())
}
