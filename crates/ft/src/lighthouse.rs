//! The manager's client of the lighthouse (torchft's `LighthouseService`).
//!
//! One HTTP/2 (tonic) channel over **one TCP connection we make
//! ourselves**: its connector hands out that socket once, so the channel
//! never reconnects behind our back, and [`Lighthouse::drop_connection`]
//! shuts the socket down at once, which is how the lighthouse learns that
//! this group stopped (it drops the replica and pushes an abort to the
//! survivors). The lighthouse counts one session per connection, so
//! heartbeats and quorum calls share it.
//!
//! * **Connecting** ([`Lighthouse::connect`]) is wanted from the first
//!   hello on: a heartbeat task dials (retrying with a backoff from 20 ms
//!   up to 250 ms: a restarted lighthouse is back within a few hundred ms,
//!   and a dial that is refused costs nothing)
//!   and heartbeats every `heartbeat_interval`, reporting [`Link::Up`] and
//!   [`Link::Lost`] to the server. A heartbeat without an answer (a cut)
//!   keeps the connection: a cut shorter than the lighthouse's keep-alive
//!   must lose nothing, and closing would end our session there. HTTP/2
//!   keep-alive (a ping every second, 5 s to answer) ends a connection
//!   whose lighthouse is gone; a heartbeat that fails on a broken
//!   connection drops it and the task dials again (a restarted lighthouse
//!   is ridden out).
//! * **A quorum call** ([`Lighthouse::quorum`]) waits for a connection (up
//!   to the connect timeout: then an error naming the address), and is
//!   retried on a new connection when the connection fails, until the
//!   caller's deadline. A refusal (`ALREADY_EXISTS`: the replica id is held
//!   by another live group; a bad request) is returned at once.
//! * **The last quorum** this group was issued is remembered and sent with
//!   every quorum call (`last_quorum`, our extension of torchft's request),
//!   so that a restarted `rally lighthouse` can issue its first quorum as
//!   soon as that quorum's members are all back, instead of after its
//!   startup grace (see `rallypoint_lighthouse::machine`). It is forgotten
//!   when a memory could be stale: when the connection is dropped (the
//!   lighthouse drops this replica and the quorum goes on without it), and
//!   when a heartbeat has had no answer for two heartbeat intervals, at
//!   most 200 ms (a cut: the lighthouse may drop this replica for its
//!   silence, at its heartbeat timeout, while this side still holds the
//!   connection); an answer to a call sent before the last forget is not
//!   taken up. A lighthouse that died closes the connection, which fails
//!   the beat at once and keeps the memory; the heartbeat task then dials
//!   again within 50 ms, so that a restarted lighthouse hears every manager
//!   within its recall floor (350 ms).
//! * **Dropping** stops the heartbeats and fails the call in flight, which
//!   never dials again (its round is over, even if a new hello already
//!   asked for a new connection); the next [`Lighthouse::connect`] starts
//!   over.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use rallypoint_lighthouse::proto::{
    LastQuorum, LighthouseHeartbeatRequest, LighthouseQuorumRequest, LighthouseServiceClient,
    Quorum, QuorumMember,
};
use tokio::sync::{mpsc, Notify};
use tokio::time::Instant;
use tonic::transport::{Channel, Endpoint};
use tonic::Code;

/// The longest pause between two dials: a lighthouse back from a restart
/// is reached within this.
const MAX_BACKOFF: Duration = Duration::from_millis(250);

/// A change of the connection's health, for the manager's status.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Link {
    /// A heartbeat got through.
    Up,
    /// The connection failed (not dropped on purpose), or cannot be made.
    Lost(String),
    /// A quorum call was refused: another live process holds this
    /// replica id (the lighthouse's message). Sent at every such refusal.
    IdHeld(String),
}

/// What the client was made with.
#[derive(Clone, Debug)]
pub struct Options {
    /// `http://host:port` or `host:port`.
    pub lighthouse: String,
    pub replica_id: String,
    pub heartbeat_interval: Duration,
    pub connect_timeout: Duration,
    /// The job secret to prove on every connection (`rally lighthouse
    /// --job-secret-file`); a lighthouse with another is a final error.
    pub secret: Option<rallypoint_auth::JobSecret>,
}

/// The longest a heartbeat goes unanswered before the memory of the last
/// quorum is forgotten (two intervals, at most this): well inside any
/// lighthouse's heartbeat timeout (1 s by default).
const FORGET_AFTER_MAX: Duration = Duration::from_millis(200);

/// The pause after a heartbeat failed on a broken connection.
const BROKEN_PAUSE: Duration = Duration::from_millis(50);

/// Begins a dial error that no retry can cure (a different job secret).
const FINAL: &str = "final: ";

/// The lighthouse client of one manager.
pub struct Lighthouse {
    shared: Arc<Shared>,
    heartbeats: tokio::task::JoinHandle<()>,
}

struct Shared {
    /// `http://host:port`, for the channel and for errors.
    url: String,
    /// `host:port`, to dial.
    target: String,
    options: Options,
    state: Mutex<State>,
    /// Held while dialing (see `Shared::ensure`).
    dialing: tokio::sync::Mutex<()>,
    wake: Notify,
    link: mpsc::UnboundedSender<Link>,
}

#[derive(Default)]
struct State {
    /// Connecting is wanted (a hello came and no drop since).
    wanted: bool,
    /// Why it was last dropped, for the errors of calls after a drop.
    dropped: Option<String>,
    conn: Option<Conn>,
    /// Numbers connections, so a failure of an old one leaves a new one be.
    epoch: u64,
    /// The last heartbeat got through.
    up: bool,
    /// Counts drops: a quorum call made before a drop never dials again.
    drops: u64,
    /// The last quorum issued to this replica, while it cannot be stale
    /// (see the module docs).
    remembered: Option<LastQuorum>,
    /// Counts the times it was forgotten: an answer to a call sent before
    /// the last time is not remembered (held by a cut, it is stale).
    forgotten: u64,
}

impl State {
    fn forget(&mut self) {
        self.remembered = None;
        self.forgotten += 1;
    }
}

#[derive(Clone)]
struct Conn {
    rpc: LighthouseServiceClient<Channel>,
    socket: Arc<std::net::TcpStream>,
    epoch: u64,
}

impl Conn {
    fn close(&self) {
        let _ = self.socket.shutdown(std::net::Shutdown::Both);
    }
}

/// `host:port` of a lighthouse address (`http://host:port[/]` or
/// `host:port`); an error naming it otherwise.
pub fn target_of(lighthouse: &str) -> Result<String, String> {
    let rest = lighthouse.strip_prefix("http://").unwrap_or(lighthouse);
    let rest = rest.trim_end_matches('/');
    let bad = || format!("the lighthouse address {lighthouse:?} is not http://HOST:PORT");
    if rest.contains("://") || rest.contains('/') {
        return Err(bad());
    }
    let (host, port) = rest.rsplit_once(':').ok_or_else(bad)?;
    if host.is_empty() || port.parse::<u16>().is_err() {
        return Err(bad());
    }
    Ok(rest.to_owned())
}

impl Lighthouse {
    /// A client, not connected yet; link changes go to `link`. Must be
    /// called inside a tokio runtime (it spawns the heartbeat task).
    pub fn new(options: Options, link: mpsc::UnboundedSender<Link>) -> Result<Lighthouse, String> {
        let target = target_of(&options.lighthouse)?;
        let shared = Arc::new(Shared {
            url: format!("http://{target}"),
            target,
            options,
            state: Mutex::default(),
            dialing: tokio::sync::Mutex::new(()),
            wake: Notify::new(),
            link,
        });
        let heartbeats = tokio::spawn(shared.clone().heartbeats());
        Ok(Lighthouse { shared, heartbeats })
    }

    /// The lighthouse's `http://host:port`.
    pub fn url(&self) -> &str {
        &self.shared.url
    }

    /// Wants a connection: the heartbeat task dials and heartbeats.
    pub fn connect(&self) {
        let mut s = self.shared.state.lock().expect("lock");
        s.wanted = true;
        drop(s);
        self.shared.wake.notify_one();
    }

    /// Closes the connection at once and stops heartbeating until the next
    /// [`Lighthouse::connect`]; a call in flight fails with `reason`.
    pub fn drop_connection(&self, reason: &str) {
        let mut s = self.shared.state.lock().expect("lock");
        tracing::debug!(replica_id = %self.shared.options.replica_id, reason, "dropping the lighthouse connection");
        s.wanted = false;
        s.dropped = Some(reason.to_owned());
        s.up = false;
        s.drops += 1;
        s.forget();
        if let Some(c) = s.conn.take() {
            c.close();
        }
    }

    /// Asks for a quorum with `member`, until `deadline`.
    pub async fn quorum(&self, member: QuorumMember, deadline: Instant) -> Result<Quorum, String> {
        self.shared.quorum(member, deadline).await
    }
}

impl Drop for Lighthouse {
    fn drop(&mut self) {
        self.heartbeats.abort();
        self.drop_connection("the manager shut down");
    }
}

impl Shared {
    async fn heartbeats(self: Arc<Self>) {
        let interval = self.options.heartbeat_interval;
        let beat_limit = (interval * 5).max(Duration::from_secs(1));
        loop {
            let wanted = self.state.lock().expect("lock").wanted;
            if !wanted {
                self.wake.notified().await;
                continue;
            }
            let until = Instant::now() + self.options.connect_timeout;
            let conn = match self.ensure(until, None).await {
                Ok(c) => c,
                Err(e) => {
                    self.unreachable(e);
                    continue;
                }
            };
            let req = LighthouseHeartbeatRequest {
                replica_id: self.options.replica_id.clone(),
            };
            let mut rpc = conn.rpc.clone();
            let beat = rpc.heartbeat(req);
            tokio::pin!(beat);
            // Unanswered for two intervals: the lighthouse may be about to
            // drop this replica for its silence (at its heartbeat timeout,
            // 1 s by default), so the memory of the last quorum may go
            // stale: forgotten now, while the beat is still waited for.
            let forget_after = (interval * 2).min(FORGET_AFTER_MAX).min(beat_limit);
            let answered = match tokio::time::timeout(forget_after, &mut beat).await {
                Ok(r) => Ok(r),
                Err(_) => {
                    self.state.lock().expect("lock").forget();
                    tokio::time::timeout(beat_limit - forget_after, &mut beat).await
                }
            };
            let mut pause = interval;
            match answered {
                Ok(Ok(_)) => self.report(Link::Up, None),
                Ok(Err(status)) => {
                    let e = format!(
                        "a heartbeat to the lighthouse at {} failed: {status}",
                        self.url
                    );
                    // A broken connection is dialed again; a refusal from a
                    // live lighthouse (a standby) keeps it.
                    let broken = std::error::Error::source(&status).is_some();
                    self.report(Link::Lost(e), broken.then_some(conn.epoch));
                    if broken {
                        // Dial again soon (`ensure` backs off while it is
                        // down): a restarted lighthouse counts on hearing
                        // every manager within its recall floor, whatever
                        // the heartbeat interval. Not at once: a server
                        // that accepts and then fails would be a hot loop.
                        pause = interval.min(BROKEN_PAUSE);
                    }
                }
                Err(_) => {
                    // Silence: the connection stays, so a cut shorter than
                    // the lighthouse's keep-alive loses nothing; HTTP/2
                    // keep-alive ends it if the lighthouse is gone.
                    let e = format!(
                        "a heartbeat to the lighthouse at {} had no answer within {beat_limit:?}",
                        self.url
                    );
                    self.report(Link::Lost(e), None);
                }
            }
            tokio::time::sleep(pause).await;
        }
    }

    /// Notes a link change (reported when it changes); `Lost` with an
    /// epoch also drops that connection (if still current) so the next use
    /// dials again.
    fn report(&self, link: Link, broken: Option<u64>) {
        let mut s = self.state.lock().expect("lock");
        if let Some(epoch) = broken {
            if s.conn.as_ref().is_some_and(|c| c.epoch == epoch) {
                s.conn.take().expect("conn").close();
            }
        }
        let up = link == Link::Up;
        if s.wanted && s.up != up {
            s.up = up;
            let _ = self.link.send(link);
        }
    }

    /// No connection could be made within the connect timeout: reported
    /// every time (the error names the address).
    fn unreachable(&self, error: String) {
        let mut s = self.state.lock().expect("lock");
        if s.wanted {
            s.up = false;
            let _ = self.link.send(Link::Lost(error));
        }
    }

    /// The current connection, dialing until `until` if there is none (one
    /// dial at a time: a concurrent caller waits for it and takes its
    /// connection, so no extra session is opened); with `since`, an error
    /// if the connection was dropped since that count of drops (a call of
    /// an earlier round must not dial).
    async fn ensure(&self, until: Instant, since: Option<u64>) -> Result<Conn, String> {
        let mut backoff = Duration::from_millis(20);
        let unreachable = |err: &str| {
            format!(
                "could not reach the lighthouse at {} within {:?}: {err}",
                self.url, self.options.connect_timeout
            )
        };
        loop {
            let left = until.saturating_duration_since(Instant::now());
            let Ok(dialing) = tokio::time::timeout(left, self.dialing.lock()).await else {
                return Err(unreachable("another dial was still under way"));
            };
            {
                let s = self.state.lock().expect("lock");
                if !s.wanted || since.is_some_and(|d| d != s.drops) {
                    let why = s.dropped.as_deref().unwrap_or("not connected yet");
                    return Err(format!("the lighthouse connection was dropped: {why}"));
                }
                if let Some(c) = &s.conn {
                    return Ok(c.clone());
                }
            }
            let left = until.saturating_duration_since(Instant::now());
            let err = match tokio::time::timeout(left, self.dial()).await {
                Ok(Err(e)) if e.starts_with(FINAL) => return Err(e[FINAL.len()..].to_owned()),
                Ok(Ok((rpc, socket))) => {
                    let mut s = self.state.lock().expect("lock");
                    if s.wanted && s.conn.is_none() {
                        tracing::debug!(replica_id = %self.options.replica_id, "connected to the lighthouse");
                        s.epoch += 1;
                        let socket = Arc::new(socket);
                        let epoch = s.epoch;
                        s.conn = Some(Conn { rpc, socket, epoch });
                    } else {
                        let _ = socket.shutdown(std::net::Shutdown::Both);
                    }
                    continue;
                }
                Ok(Err(e)) => e,
                Err(_) => "no answer".to_owned(),
            };
            drop(dialing);
            if Instant::now() + backoff >= until {
                return Err(unreachable(&err));
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    /// Remembers `q`, the answer to a call sent when the memory had been
    /// forgotten `forgotten` times: not if it was forgotten since (a drop,
    /// a silence), since the answer may then be stale.
    fn remember(&self, q: &Quorum, forgotten: u64) {
        let mut s = self.state.lock().expect("lock");
        if s.forgotten == forgotten {
            s.remembered = Some(LastQuorum {
                quorum_id: q.quorum_id,
                replica_ids: q
                    .participants
                    .iter()
                    .map(|m| m.replica_id.clone())
                    .collect(),
            });
        }
    }

    /// One connection: TCP, then the HTTP/2 handshake over it.
    async fn dial(
        &self,
    ) -> Result<(LighthouseServiceClient<Channel>, std::net::TcpStream), String> {
        let mut tcp = tokio::net::TcpStream::connect(&self.target)
            .await
            .map_err(|e| e.to_string())?;
        let _ = tcp.set_nodelay(true);
        if let Some(secret) = &self.options.secret {
            let server = tcp.peer_addr().map_err(|e| e.to_string())?;
            let deadline = std::time::Instant::now() + rallypoint_auth::io::CLIENT_DEADLINE;
            let service = rallypoint_auth::Service::LIGHTHOUSE;
            let proof = rallypoint_auth::io::tokio::client_handshake(
                &mut tcp, server, secret, service, deadline,
            );
            match proof.await {
                Ok(()) => {}
                Err(e) if e.is_wrong_secret() => return Err(format!("{FINAL}{e}")),
                Err(e) => return Err(e.to_string()),
            }
        }
        let std = tcp.into_std().map_err(|e| e.to_string())?;
        let kept = std.try_clone().map_err(|e| e.to_string())?;
        let once = Arc::new(Mutex::new(Some(std)));
        let connector = tower::service_fn(move |_uri| {
            let sock = once.lock().expect("lock").take();
            async move {
                let sock = sock.ok_or_else(|| {
                    std::io::Error::new(
                        std::io::ErrorKind::NotConnected,
                        "this lighthouse connection was closed",
                    )
                })?;
                let tcp = tokio::net::TcpStream::from_std(sock)?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tcp))
            }
        });
        let channel = Endpoint::from_shared(self.url.clone())
            .map_err(|e| e.to_string())?
            .http2_keep_alive_interval(Duration::from_secs(1))
            .keep_alive_timeout(Duration::from_secs(5))
            .keep_alive_while_idle(true)
            .connect_with_connector(connector)
            .await
            .map_err(|e| format!("{e}: {}", source_chain(&e)))?;
        Ok((LighthouseServiceClient::new(channel), kept))
    }

    async fn quorum(&self, member: QuorumMember, deadline: Instant) -> Result<Quorum, String> {
        let drops = self.state.lock().expect("lock").drops;
        loop {
            let until = deadline.min(Instant::now() + self.options.connect_timeout);
            let conn = self.ensure(until, Some(drops)).await?;
            // Read as the call is sent (a forget while dialing counts).
            let (last_quorum, forgotten) = {
                let s = self.state.lock().expect("lock");
                (s.remembered.clone(), s.forgotten)
            };
            let left = deadline.saturating_duration_since(Instant::now());
            let timed_out = || {
                format!(
                    "the lighthouse at {} issued no quorum before the caller's deadline",
                    self.url
                )
            };
            let mut req = tonic::Request::new(LighthouseQuorumRequest {
                requester: Some(member.clone()),
                last_quorum,
            });
            req.set_timeout(left);
            let mut rpc = conn.rpc.clone();
            let status = match tokio::time::timeout(left, rpc.quorum(req)).await {
                Err(_) => return Err(timed_out()),
                Ok(Ok(r)) => {
                    let q = r.into_inner().quorum.ok_or_else(|| {
                        format!("the lighthouse at {} answered without a quorum", self.url)
                    })?;
                    self.remember(&q, forgotten);
                    return Ok(q);
                }
                Ok(Err(status)) => status,
            };
            if status.code() == Code::AlreadyExists {
                let _ = self.link.send(Link::IdHeld(status.message().to_owned()));
            }
            match status.code() {
                Code::AlreadyExists
                | Code::InvalidArgument
                | Code::FailedPrecondition
                | Code::PermissionDenied => {
                    return Err(format!(
                        "the lighthouse at {} refused the quorum request: {}",
                        self.url,
                        status.message()
                    ));
                }
                Code::DeadlineExceeded => return Err(timed_out()),
                _ => {}
            }
            if std::error::Error::source(&status).is_some() {
                // The connection failed: dial again.
                let e = format!("the lighthouse at {} was lost: {status}", self.url);
                self.report(Link::Lost(e), Some(conn.epoch));
            }
            let pause = Duration::from_millis(100);
            if Instant::now() + pause >= deadline {
                return Err(format!(
                    "the lighthouse at {} issued no quorum before the caller's deadline (last error: {status})",
                    self.url
                ));
            }
            tokio::time::sleep(pause).await;
        }
    }
}

fn source_chain(e: &dyn std::error::Error) -> String {
    let mut out = Vec::new();
    let mut cur = e.source();
    while let Some(s) = cur {
        out.push(s.to_string());
        cur = s.source();
    }
    out.join(": ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_call_of_a_dropped_round_never_dials_again() {
        // Nothing listens there: the call waits in its dial loop.
        let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = free.local_addr().unwrap();
        drop(free);
        let (tx, _rx) = mpsc::unbounded_channel();
        let options = Options {
            lighthouse: format!("http://{addr}"),
            replica_id: "g".into(),
            heartbeat_interval: Duration::from_millis(100),
            connect_timeout: Duration::from_secs(60),
            secret: None,
        };
        let lh = Lighthouse::new(options, tx).unwrap();
        lh.connect();
        let deadline = Instant::now() + Duration::from_secs(60);
        let call = lh.quorum(QuorumMember::default(), deadline);
        tokio::pin!(call);
        // Polled once: the call has started.
        assert!(tokio::time::timeout(Duration::ZERO, &mut call)
            .await
            .is_err());
        lh.drop_connection("the workers stopped");
        lh.connect(); // a new round's hello
        let e = tokio::time::timeout(Duration::from_secs(30), call)
            .await
            .expect("the call ends at its next dial")
            .unwrap_err();
        assert!(e.contains("dropped: the workers stopped"), "{e}");
    }

    #[test]
    fn addresses_are_parsed_or_refused_naming_them() {
        assert_eq!(target_of("http://h:1").unwrap(), "h:1");
        assert_eq!(target_of("http://h:1/").unwrap(), "h:1");
        assert_eq!(target_of("10.0.0.1:29510").unwrap(), "10.0.0.1:29510");
        for bad in ["https://h:1", "h", "http://h:x", ":1", "http://h:1/path"] {
            let e = target_of(bad).unwrap_err();
            assert!(e.contains(bad), "{e}");
        }
    }
}
