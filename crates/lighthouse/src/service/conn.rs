//! The accept loop: one session per TCP connection, HTTP/2 (gRPC) or
//! HTTP/1.1 on each, and the connection's end as the machine's
//! `Event::Closed`.
//!
//! Sessions open and close in the accept loop only (`service.rs`): a
//! connection's end is handed back to it, and it takes every connection
//! waiting in the listen backlog ([`backlog`]) before it closes that
//! session, so a client's new connection, made before it dropped its old
//! one, is always known (and *fresh*, see [`crate::machine`]) when the old
//! one's end is handled.
//!
//! Every accepted connection gets the next [`Session`] number and is served
//! by hyper's auto builder (it tells an HTTP/2 preface from HTTP/1.1). Each
//! request carries its [`Conn`] in its extensions; one whose `content-type`
//! is `application/grpc*` goes to tonic's generated `LighthouseService`
//! server (`Quorum` to [`QuorumCall`], which writes the answer encoded once
//! per quorum: [`super::wire`]), any other to [`super::http`]. torchft's manager keeps one HTTP/2
//! channel to the lighthouse for its heartbeats and quorum calls, so when
//! its process dies the kernel resets that connection, hyper's connection
//! future ends, and the machine drops the replica at that moment. hyper
//! runs each request as a task of its own, which may be handled after that
//! end: the session is open from [`super::state::Shared::opened`] to
//! [`super::state::Shared::closed`], and a request of a closed session is
//! refused (it would speak for its dropped replica again).
//!
//! Every refusal is logged here, once, with the peer's address, and counted:
//! a gRPC error status (a bad request, a replica id held elsewhere, a
//! message over the size cap), an HTTP `4xx`, or a connection that does not
//! speak HTTP at all. A peer that merely goes away (reset, EOF) is not one.

use std::convert::Infallible;
use std::error::Error as StdError;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tonic::codegen::Service as _;

use super::grpc::{Conn, Grpc, QuorumCall};
use super::state::{Counters, Shared};
use super::wire::Encoded;
use crate::machine::Session;
use crate::proto::{LighthouseQuorumRequest, LighthouseServiceServer};

/// The path of torchft's `Quorum` call.
const QUORUM: &str = "/torchft.LighthouseService/Quorum";

/// Largest gRPC message accepted, in bytes (a `QuorumMember` is a few hundred).
pub const MAX_MESSAGE: usize = 1 << 20;

/// Largest HTTP/1.1 head or HTTP/2 header list accepted, in bytes.
const MAX_HEADERS: u32 = 64 << 10;

/// Hands a served connection's session to the accept loop when dropped.
struct CloseOnDrop {
    session: Session,
    closes: mpsc::UnboundedSender<Session>,
}

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        let _ = self.closes.send(self.session);
    }
}

/// Accepts every connection already waiting in `listener`'s backlog
/// without waiting (the socket is non-blocking): `(stream, peer)` each.
/// The accept loop calls it before it closes a session, because a client
/// that replaces its connection (torchft's manager) connects anew *before*
/// it drops the old one: the kernel has the new connection by the time the
/// old one's end reaches us, but the runtime may not have woken the accept
/// loop for it yet.
pub fn backlog(listener: &TcpListener) -> Vec<(TcpStream, SocketAddr)> {
    let mut out = Vec::new();
    let sock = socket2::SockRef::from(listener);
    loop {
        match sock.accept() {
            Ok((s, peer)) => {
                let Some(peer) = peer.as_socket() else {
                    continue;
                };
                let std: std::net::TcpStream = s.into();
                let stream = std
                    .set_nonblocking(true)
                    .and_then(|()| TcpStream::from_std(std));
                match stream {
                    Ok(stream) => out.push((stream, peer)),
                    Err(e) => tracing::warn!(%peer, "could not serve a connection: {e}"),
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            // WouldBlock (nothing waits), or an error the accept loop's own
            // accept will meet and report.
            Err(_) => return out,
        }
    }
}

/// What every connection of one server shares.
pub struct Conns {
    pub shared: Arc<Shared>,
    pub grpc: LighthouseServiceServer<Grpc>,
    /// `Quorum` with its answer encoded once per quorum.
    pub quorum: QuorumCall,
    pub max_message: usize,
    /// HTTP/2 pings on an idle connection this often, and drop it if one
    /// goes unanswered this long (a host cut off leaves no reset behind).
    pub keep_alive: Duration,
    /// With a job secret, a connection proves it before its first byte of
    /// HTTP ([`rallypoint_auth`]); refused ones are logged and counted.
    pub secret: Option<rallypoint_auth::JobSecret>,
}

impl Conns {
    pub fn new(shared: Arc<Shared>, max_message: usize, keep_alive: Duration) -> Conns {
        let grpc = LighthouseServiceServer::from_arc(Arc::new(Grpc {
            shared: shared.clone(),
        }))
        .max_decoding_message_size(max_message);
        Conns {
            quorum: QuorumCall {
                shared: shared.clone(),
            },
            shared,
            grpc,
            max_message,
            keep_alive,
            secret: None,
        }
    }

    /// Serves one connection (its session opened by the accept loop) to its
    /// end, then hands the session to `closes`: the accept loop closes it.
    pub async fn serve(
        self: Arc<Self>,
        session: Session,
        stream: TcpStream,
        peer: SocketAddr,
        closes: mpsc::UnboundedSender<Session>,
    ) {
        // Even if this task panics or is cancelled.
        let _close = CloseOnDrop { session, closes };
        let c = &self.shared.counters;
        Counters::add(&c.sessions);
        let mut stream = stream;
        let _ = stream.set_nodelay(true);
        if let Some(secret) = &self.secret {
            let deadline = std::time::Instant::now() + rallypoint_auth::io::SERVER_DEADLINE;
            let service = rallypoint_auth::Service::LIGHTHOUSE;
            let proof = rallypoint_auth::io::tokio::server_handshake(
                &mut stream,
                peer,
                secret,
                service,
                deadline,
            );
            if let Err(refusal) = proof.await {
                c.secret_refusals.count(&refusal);
                tracing::warn!(session, "lighthouse: {refusal}");
                return;
            }
        }
        c.open.fetch_add(1, Ordering::Relaxed);
        let conn = Conn { session, peer };
        let me = self.clone();
        let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
            let me = me.clone();
            async move { Ok::<_, Infallible>(me.request(conn, req).await) }
        });
        let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
        builder
            .http1()
            .timer(TokioTimer::new())
            .max_buf_size(MAX_HEADERS as usize);
        builder
            .http2()
            .timer(TokioTimer::new())
            .keep_alive_interval(self.keep_alive)
            .keep_alive_timeout(self.keep_alive)
            .max_header_list_size(MAX_HEADERS);
        if let Err(e) = builder.serve_connection(TokioIo::new(stream), svc).await {
            if !is_goodbye(e.as_ref()) {
                Counters::add(&c.bad_connections);
                tracing::warn!(%peer, session, "refused a connection that broke the protocol: {e}");
            }
        }
        c.open.fetch_sub(1, Ordering::Relaxed);
    }

    async fn request(&self, conn: Conn, mut req: Request<Incoming>) -> Response<tonic::body::Body> {
        req.extensions_mut().insert(conn);
        let path = req.uri().path().to_owned();
        let is_grpc = req
            .headers()
            .get(http::header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
        if !is_grpc {
            self.shared.spoke(conn.session);
            let resp = super::http::serve(self.shared.clone(), req).await;
            if resp.status().is_client_error() {
                self.refused(conn, &path, &format!("HTTP {}", resp.status()));
            }
            return resp;
        }
        let resp = if path == QUORUM {
            let codec = tonic_prost::ProstCodec::<Encoded, LighthouseQuorumRequest>::default();
            tonic::server::Grpc::new(codec)
                .apply_max_message_size_config(Some(self.max_message), None)
                .unary(self.quorum.clone(), req)
                .await
        } else {
            match self.grpc.clone().call(req).await {
                Ok(r) => r,
                Err(never) => match never {},
            }
        };
        // An error ends the call at once: its status is in the headers.
        if let Some(status) = tonic::Status::from_header_map(resp.headers()) {
            use tonic::Code;
            match status.code() {
                Code::Ok | Code::Unavailable => {}
                Code::DeadlineExceeded => {
                    tracing::warn!(peer = %conn.peer, session = conn.session, "{path}: {}", status.message());
                }
                code => self.refused(conn, &path, &format!("{code:?}: {}", status.message())),
            }
        }
        resp
    }

    fn refused(&self, conn: Conn, path: &str, why: &str) {
        Counters::add(&self.shared.counters.refused);
        tracing::warn!(peer = %conn.peer, session = conn.session, "refused {path}: {why}");
    }
}

/// Whether a connection's error is only the peer going away (reset, EOF
/// mid-request, a closed stream): not a refusal.
fn is_goodbye(e: &(dyn StdError + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(e) = cur {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            use std::io::ErrorKind::*;
            if matches!(
                io.kind(),
                ConnectionReset | BrokenPipe | UnexpectedEof | ConnectionAborted
            ) {
                return true;
            }
        }
        if let Some(h) = e.downcast_ref::<hyper::Error>() {
            if h.is_incomplete_message() || h.is_canceled() || h.is_closed() {
                return true;
            }
        }
        cur = e.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Connections the runtime has not accepted yet are in the backlog.
    #[tokio::test]
    async fn the_backlog_gives_every_waiting_connection_without_waiting() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        assert!(backlog(&listener).is_empty());
        let clients: Vec<std::net::TcpStream> = (0..3)
            .map(|_| std::net::TcpStream::connect(addr).unwrap())
            .collect();
        let mut peers: Vec<SocketAddr> = backlog(&listener).into_iter().map(|(_, p)| p).collect();
        let mut want: Vec<SocketAddr> = clients.iter().map(|c| c.local_addr().unwrap()).collect();
        peers.sort();
        want.sort();
        assert_eq!(peers, want);
        assert!(backlog(&listener).is_empty());
    }
}
