//! The job secret on RPC's connections (opt-in: `RpcBackendOptions::secret`).
//!
//! With a secret, a worker's listener runs the server's side of the
//! job-secret handshake ([`rallypoint_auth`], service [`Service::RPC`]) on
//! every connection it accepts, before it reads a byte of RPC's own
//! protocol (the [`Hello`](crate::wire::Hello), then frames); a worker
//! dialling a peer runs the client's side right after `connect`, before it
//! writes its hello. Without a secret nothing here runs, and the bytes on
//! the wire are those of a group without this module.
//!
//! # What it covers
//!
//! Every TCP backend connection, stream 0 and the bulk streams alike: a
//! process that cannot prove the secret gets the handshake's challenge and
//! nothing else (no hello is read from it, no frame, so no call of it is
//! ever run, and it learns nothing of the group). The `PROCESS_GROUP`
//! backend's connections, and those of the process group a static group
//! forms for its set-up and shutdown, are the collectives': they are given
//! the same secret, and run the collectives' own handshake
//! (`rallypoint_collectives::Options::secret`). The handshake does not
//! authenticate or encrypt the traffic after it (see [`rallypoint_auth`]'s
//! docs).
//!
//! # What it costs
//!
//! One round trip and two HMAC-SHA256s per connection, when the connection
//! is opened (connections are long-lived: one per peer and stream, opened on
//! first use); nothing per message or call. A worker joining a dynamic
//! group opens its stream 0 to each member before it tells them (the
//! connection its request opens anyway), so that one started with another
//! secret fails `init_rpc` at once, saying so, and tells nobody. (A static
//! group's worker with another secret fails forming its process group.)
//!
//! # A connection that fails it
//!
//! Is closed, counted by reason ([`Tcp::refusals`](super::Tcp::refusals)),
//! and logged as one warning naming the peer. Each accepted connection's
//! handshake runs in its own task, under `TcpOptions::secret_deadline`
//! ([`SERVER_DEADLINE`](rallypoint_auth::io::SERVER_DEADLINE), 2 s, by default): a stalled
//! peer holds only its own connection, and the accept loop goes on. A
//! client that spoke RPC's hello without the handshake (a worker started
//! without the secret) is answered with an RPC refusal saying why
//! ([`SECRET_REQUIRED`]), so it reports that instead of a closed
//! connection, and a joining worker fails `init_rpc` with it instead of
//! taking the members for gone.

use std::net::SocketAddr;
use std::time::Instant;

use rallypoint_auth::io::{tokio as auth_io, CLIENT_DEADLINE};
use rallypoint_auth::{ClientFailure, JobSecret, RefusalKind, Service, TransportError};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use super::{ConnectFailed, Shared};

/// The verdict on a hello that came without the job-secret handshake: a
/// refusal (any verdict but `0` is one), which a dialler of this version
/// tells from the others (`1`) to fail `init_rpc` with it rather than take
/// the peer for gone.
pub(super) const SECRET_REQUIRED: u8 = 2;

/// What a worker without the secret reads with [`SECRET_REQUIRED`].
const REFUSAL_WHY: &str = "this worker admits only the job's processes, which prove the job \
                           secret first (RALLY_JOB_SECRET_FILE); this connection did not";

/// RPC's refusal of a hello, as the dialler reads it: `verdict` (not 0),
/// the length of `why` (u16, little-endian), `why`.
pub(super) fn refusal_bytes(verdict: u8, why: &str) -> Vec<u8> {
    let why = &why.as_bytes()[..why.len().min(u16::MAX as usize)];
    let mut m = Vec::with_capacity(3 + why.len());
    m.push(verdict);
    m.extend_from_slice(&(why.len() as u16).to_le_bytes());
    m.extend_from_slice(why);
    m
}

/// Runs the server's side of the handshake on an accepted connection, when
/// this worker has a secret. `false`: refused (counted, logged, answered
/// if it spoke RPC's hello); the caller drops the connection.
pub(super) async fn admit(sh: &Shared, s: &mut TcpStream, peer: SocketAddr) -> bool {
    let Some(secret) = &sh.secret else {
        return true;
    };
    let deadline = Instant::now() + sh.opts.secret_deadline;
    let Err(refusal) = auth_io::server_handshake(s, peer, secret, Service::RPC, deadline).await
    else {
        return true;
    };
    sh.refusals.count(&refusal);
    tracing::warn!("RPC worker {}: {refusal}", sh.me);
    if refusal.kind() == RefusalKind::NotOurProtocol {
        // Bounded by the same deadline: a peer that reads nothing costs
        // this task nothing past it.
        let answer = refusal_bytes(SECRET_REQUIRED, REFUSAL_WHY);
        let _ = tokio::time::timeout_at(deadline.into(), s.write_all(&answer)).await;
    }
    false
}

/// Runs the client's side of the handshake right after connecting to
/// `addr`, when this worker has a secret.
///
/// A server that answers otherwise than with the secret's proof (another
/// secret, a listener without one, not RPC) refused us: `refused` (the peer
/// we meant is not there) and `secret` (`init_rpc` fails on it, saying
/// so). A server that closed the connection during the handshake is
/// `secret` but not `refused` (a listener without the secret may reset the
/// connection before its answer is read; or the peer died, which the next
/// connect finds). A timeout or an I/O error is neither.
pub(super) async fn prove(
    secret: Option<&JobSecret>,
    s: &mut TcpStream,
    addr: SocketAddr,
) -> Result<(), ConnectFailed> {
    let Some(secret) = secret else {
        return Ok(());
    };
    let deadline = Instant::now() + CLIENT_DEADLINE;
    let Err(e) = auth_io::client_handshake(s, addr, secret, Service::RPC, deadline).await else {
        return Ok(());
    };
    let (refused, secret) = match &e.reason {
        ClientFailure::Mismatch(_) => (true, true),
        ClientFailure::Transport(TransportError::Closed { .. }) => (false, true),
        ClientFailure::Transport(_) => (false, false),
    };
    Err(ConnectFailed {
        refused,
        secret,
        why: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_reads_as_rpcs_verdict_with_its_reason() {
        let b = refusal_bytes(SECRET_REQUIRED, REFUSAL_WHY);
        assert_eq!(b[0], SECRET_REQUIRED);
        let len = u16::from_le_bytes([b[1], b[2]]) as usize;
        assert_eq!(len, b.len() - 3);
        assert_eq!(&b[3..], REFUSAL_WHY.as_bytes());
        let long = "x".repeat(70_000);
        assert_eq!(refusal_bytes(1, &long).len(), 3 + u16::MAX as usize);
    }
}
