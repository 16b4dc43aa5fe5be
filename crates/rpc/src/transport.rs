//! What a backend provides: moving messages between workers.
//!
//! Everything else (calls, remote references, shutdown, device maps) is the
//! agent's, shared by every backend, so a third-party backend implements only
//! [`Transport`] and gets the rest.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Stands for "no deadline" where a duration is required (the process
/// group's operations take one).
pub(crate) const FOREVER: std::time::Duration = std::time::Duration::from_secs(365 * 24 * 3600);

/// A message to send: the encoded envelope and its out-of-band bulk.
#[derive(Debug, Clone, Default)]
pub struct Outgoing {
    pub env: Vec<u8>,
    pub bulk: Vec<Bytes>,
}

impl Outgoing {
    pub fn bulk_len(&self) -> u64 {
        self.bulk.iter().map(|b| b.len() as u64).sum()
    }
}

/// What a transport hands to the agent.
#[derive(Debug)]
pub enum Event {
    /// A whole message from worker `from`.
    Message {
        from: u32,
        env: Vec<u8>,
        bulk: Bytes,
    },
    /// Worker `peer` can no longer be reached (its connection closed or
    /// failed); calls waiting on it fail with `reason`.
    Gone { peer: u32, reason: String },
}

/// The agent's entry point for events; transports call it from their tasks.
pub type Deliver = Arc<dyn Fn(Event) + Send + Sync>;

/// Why [`Transport::connect_now`] could not connect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConnectError {
    /// The job-secret handshake failed: the peer holds another secret, or
    /// one of the two holds none. The job is misconfigured; trying again
    /// cannot help.
    Secret(String),
    /// Anything else (nothing listens there, no answer in time), as a
    /// message to the peer would have failed.
    Unreachable(String),
}

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConnectError::Secret(why) | ConnectError::Unreachable(why) => f.write_str(why),
        }
    }
}

/// Moves messages between workers.
pub trait Transport: Send + Sync + 'static {
    /// Where peers reach this worker (published at init; may be empty for
    /// transports that need no address).
    fn address(&self) -> String;
    /// Worker `id` listens at `addr` (static groups at init, dynamic ones on join).
    fn add_peer(&self, id: u32, addr: &str);
    /// Worker `id` left: drop its connections.
    fn remove_peer(&self, id: u32);
    /// Sends one message; returns once it is handed to the network or failed.
    fn send(&self, to: u32, msg: Outgoing) -> BoxFuture<'_, Result<(), String>>;
    /// Closes everything. Called once, at the end of shutdown.
    fn shutdown(&self, graceful: bool) -> BoxFuture<'_, ()>;
    /// When `peer` last showed it is alive below the message level (bytes of
    /// a long message arriving, or the peer taking bytes we send), if the
    /// transport can tell. The agent's heartbeat counts whole messages
    /// itself; this keeps a peer busy with one long transfer alive.
    fn heard_from(&self, _peer: u32) -> Option<std::time::Instant> {
        None
    }
    /// Opens the connection to `peer` now, unless it is open: a worker
    /// joining a dynamic group does so before it tells a member (its request
    /// would open it anyway), to fail at once, telling nobody, if the
    /// job-secret handshake fails. Default, for a transport that opens
    /// nothing ahead and proves nothing itself: `Ok` at once.
    fn connect_now(&self, _peer: u32) -> BoxFuture<'_, Result<(), ConnectError>> {
        Box::pin(async { Ok(()) })
    }
    /// Connections refused by the job-secret handshake so far, by reason, if
    /// the transport runs it.
    fn refusals(&self) -> Option<rallypoint_auth::RefusalCounts> {
        None
    }
}
