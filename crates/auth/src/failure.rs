//! How a handshake failed on the wire, and how a client's failed handshake reads.
//!
//! A transport failure names what was awaited and how much of it came ([`Waiting`]), and a
//! timeout how long was waited, so a log line reads like "no complete job-secret handshake
//! within 2 s (waiting for its HELLO: got 5 of at least 41 bytes)". A server's failures are
//! [`crate::metrics::Refusal`]s; a client's are [`ClientError`]s, which name the server.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use crate::handshake::{Message, NonceError, Progress, ServerMismatch};

/// What a side was doing when its transport failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waiting {
    /// Reading the peer's next message.
    Receiving(Progress),
    /// Writing its own message (a peer that reads nothing, with full buffers).
    Sending {
        /// The message.
        message: Message,
        /// Its bytes written so far.
        sent: usize,
        /// Its length.
        total: usize,
    },
    /// Setting or restoring the socket's timeouts, before or after the messages.
    SocketSetup,
}

impl fmt::Display for Waiting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Waiting::Receiving(progress) => progress.fmt(f),
            Waiting::Sending {
                message,
                sent,
                total,
            } => write!(f, "sending our {message}: sent {sent} of {total} bytes"),
            Waiting::SocketSetup => f.write_str("setting the socket's timeouts"),
        }
    }
}

/// A handshake's transport failed, or could not start.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// The deadline passed.
    #[error("no complete job-secret handshake within {} ({waiting})", Secs(*.within))]
    TimedOut {
        /// What was awaited.
        waiting: Waiting,
        /// From the handshake's start to its deadline.
        within: Duration,
    },
    /// The peer closed the connection (or reset it, as a listener does that closes with our
    /// bytes unread).
    #[error("the connection was closed during the job-secret handshake ({waiting})")]
    Closed {
        /// What was awaited.
        waiting: Waiting,
    },
    /// Reading or writing failed.
    #[error("the connection failed during the job-secret handshake ({waiting}): {source}")]
    Io {
        /// What was awaited.
        waiting: Waiting,
        /// What the OS said.
        #[source]
        source: io::Error,
    },
    /// No nonce could be drawn.
    #[error(transparent)]
    Nonce(#[from] NonceError),
}

/// A client's handshake with a server failed.
#[derive(Debug)]
pub struct ClientError {
    /// The server's address, as the caller named it.
    pub server: SocketAddr,
    /// What went wrong.
    pub reason: ClientFailure,
}

/// What went wrong in a client's handshake.
#[derive(Debug)]
pub enum ClientFailure {
    /// The server is not what the client wanted, or refused it.
    Mismatch(ServerMismatch),
    /// The connection failed.
    Transport(TransportError),
}

impl ClientError {
    /// Whether the server holds a different secret (its proof was wrong, or it refused ours):
    /// a node started with the wrong secret, which should stop, not retry.
    pub fn is_wrong_secret(&self) -> bool {
        matches!(
            self.reason,
            ClientFailure::Mismatch(
                ServerMismatch::DifferentSecret { .. } | ServerMismatch::Refused
            )
        )
    }
}

impl fmt::Display for ClientError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let server = self.server;
        match &self.reason {
            ClientFailure::Mismatch(m) => write!(f, "the server at {server} {m}"),
            ClientFailure::Transport(TransportError::TimedOut { waiting, within }) => write!(
                f,
                "the server at {server} did not finish the job-secret handshake within {} \
                 ({waiting})",
                Secs(*within)
            ),
            ClientFailure::Transport(TransportError::Closed { waiting }) => write!(
                f,
                "the server at {server} closed the connection during the job-secret handshake \
                 ({waiting}): does it run without a job secret, or is it not a rallypoint \
                 service?"
            ),
            ClientFailure::Transport(TransportError::Io { waiting, source }) => write!(
                f,
                "the connection to the server at {server} failed during the job-secret \
                 handshake ({waiting}): {source}"
            ),
            ClientFailure::Transport(TransportError::Nonce(e)) => {
                write!(
                    f,
                    "no job-secret handshake with the server at {server}: {e}"
                )
            }
        }
    }
}

impl std::error::Error for ClientError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.reason {
            ClientFailure::Mismatch(m) => Some(m),
            ClientFailure::Transport(t) => Some(t),
        }
    }
}

/// A duration for a log line: "2 s", "1.5 s", "250 ms".
pub(crate) struct Secs(pub Duration);

impl fmt::Display for Secs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Rounded to the nearest unit shown: a deadline set a moment before it was measured
        // still reads as the round figure it was set to.
        let ms = (self.0.as_micros() + 500) / 1000;
        if ms < 1000 {
            return write!(f, "{ms} ms");
        }
        let tenths = (ms + 50) / 100;
        match tenths % 10 {
            0 => write!(f, "{} s", tenths / 10),
            t => write!(f, "{}.{t} s", tenths / 10),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_seconds_or_milliseconds() {
        assert_eq!(Secs(Duration::from_secs(2)).to_string(), "2 s");
        assert_eq!(Secs(Duration::from_millis(1500)).to_string(), "1.5 s");
        assert_eq!(Secs(Duration::from_millis(250)).to_string(), "250 ms");
        assert_eq!(Secs(Duration::from_micros(29_990)).to_string(), "30 ms");
        assert_eq!(Secs(Duration::from_micros(1_999_990)).to_string(), "2 s");
        assert_eq!(Secs(Duration::from_millis(1_449)).to_string(), "1.4 s");
    }

    #[test]
    fn a_client_timeout_names_the_server_what_it_awaited_and_how_long() {
        let err = ClientError {
            server: "10.0.0.3:29500".parse().unwrap(),
            reason: ClientFailure::Transport(TransportError::TimedOut {
                waiting: Waiting::Receiving(Progress {
                    message: Message::Challenge,
                    got: 0,
                    need: 9,
                    exact: false,
                }),
                within: Duration::from_secs(10),
            }),
        };
        assert_eq!(
            err.to_string(),
            "the server at 10.0.0.3:29500 did not finish the job-secret handshake within 10 s \
             (waiting for its CHALLENGE: got 0 of at least 9 bytes)"
        );
        assert!(!err.is_wrong_secret());
    }
}
