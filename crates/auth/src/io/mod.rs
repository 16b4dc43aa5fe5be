//! The handshake over a stream, with a deadline: blocking ([`blocking`]) and tokio
//! ([`tokio`]).
//!
//! Both adapters drive a handshake machine the same way: write what it asks written, read at
//! most the bytes it still needs (so no byte of the service's own protocol is read here), and
//! stop at the deadline, at the peer's close, or at the machine's verdict. A server gives up
//! on a client after [`SERVER_DEADLINE`] unless the listener passes another deadline; a
//! client's own default is the longer [`CLIENT_DEADLINE`], since a busy server may be slow to
//! answer. Servers should run each connection's handshake on its own thread or task, so that
//! a slow or stalled peer holds only its own connection.

pub mod blocking;
pub mod tokio;

use std::time::Duration;

use crate::failure::{ClientError, ClientFailure, TransportError};
use crate::handshake::{ClientHandshake, Rejection, ServerHandshake, ServerMismatch, Step};
use crate::metrics::{Refusal, RefusalReason};

/// How long a server waits for a client to finish the handshake, unless told otherwise.
pub const SERVER_DEADLINE: Duration = Duration::from_secs(2);

/// How long a client waits for a server to finish the handshake, unless told otherwise.
pub const CLIENT_DEADLINE: Duration = Duration::from_secs(10);

/// A side of the handshake, as the adapters drive it.
trait Machine {
    type Error;
    fn step(&mut self) -> Result<Step, Self::Error>;
    fn receive(&mut self, bytes: &[u8]);
}

impl Machine for ServerHandshake {
    type Error = Rejection;
    fn step(&mut self) -> Result<Step, Rejection> {
        ServerHandshake::step(self)
    }
    fn receive(&mut self, bytes: &[u8]) {
        ServerHandshake::receive(self, bytes)
    }
}

impl Machine for ClientHandshake {
    type Error = ServerMismatch;
    fn step(&mut self) -> Result<Step, ServerMismatch> {
        ClientHandshake::step(self)
    }
    fn receive(&mut self, bytes: &[u8]) {
        ClientHandshake::receive(self, bytes)
    }
}

/// Why a driven handshake ended without success.
enum DriveError<E> {
    Machine(E),
    Transport(TransportError),
}

impl<E> From<TransportError> for DriveError<E> {
    fn from(e: TransportError) -> Self {
        DriveError::Transport(e)
    }
}

fn refusal(peer: std::net::SocketAddr, e: DriveError<Rejection>) -> Refusal {
    let reason = match e {
        DriveError::Machine(r) => RefusalReason::Rejected(r),
        DriveError::Transport(t) => RefusalReason::Transport(t),
    };
    Refusal { peer, reason }
}

fn client_error(server: std::net::SocketAddr, e: DriveError<ServerMismatch>) -> ClientError {
    let reason = match e {
        DriveError::Machine(m) => ClientFailure::Mismatch(m),
        DriveError::Transport(t) => ClientFailure::Transport(t),
    };
    ClientError { server, reason }
}

/// A read or write failed: a peer that reset the connection (as a listener does that closes
/// with our bytes unread) or is gone reads as closed; anything else as an I/O error.
fn failed(waiting: crate::failure::Waiting, source: std::io::Error) -> TransportError {
    use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset, UnexpectedEof};
    match source.kind() {
        BrokenPipe | ConnectionAborted | ConnectionReset | UnexpectedEof => {
            TransportError::Closed { waiting }
        }
        _ => TransportError::Io { waiting, source },
    }
}

/// The largest message (a HELLO with a 32-byte label): the adapters' read buffer.
const READ_BUF: usize = 8 + 1 + 32 + 32;

#[cfg(test)]
mod tests;
