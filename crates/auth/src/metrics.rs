//! What a listener counts and logs when it refuses a connection.
//!
//! A listener owns one [`Refusals`] (atomic counters, shared by its connection tasks, read by
//! its metrics endpoint) and counts each [`Refusal`] its handshakes return; the refusal's
//! `Display` is the log line's text, naming the peer:
//!
//! ```text
//! refused a connection from 10.0.0.3:51234: it holds a different job secret (its key id 1a2b3c4d, ours 5e6f7a8b)
//! refused a connection from 10.0.0.3:51240: it does not speak the rallypoint job-secret handshake: its first bytes "GET / HTTP/1.1\r\n" are not the handshake's magic "RALLYAU1" (an HTTP request?)
//! refused a connection from 10.0.0.3:51236: it sent no complete job-secret handshake within 2 s (waiting for its HELLO: got 5 of at least 41 bytes)
//! ```

use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::failure::{Secs, TransportError};
use crate::handshake::Rejection;

/// A server refused a connection.
#[derive(Debug)]
pub struct Refusal {
    /// The peer's address.
    pub peer: SocketAddr,
    /// Why.
    pub reason: RefusalReason,
}

/// Why a server refused a connection.
#[derive(Debug)]
pub enum RefusalReason {
    /// The handshake ran, and the client failed it.
    Rejected(Rejection),
    /// The handshake did not finish.
    Transport(TransportError),
}

/// The counters' kinds of refusal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RefusalKind {
    /// A wrong proof: a client with another secret, or a replayed or forged proof.
    WrongProof,
    /// Bytes of another protocol: a client without the secret, a scanner.
    NotOurProtocol,
    /// Timed out, closed or broken before the handshake finished.
    Unfinished,
    /// A client of the secret that meant another service.
    WrongService,
}

impl RefusalKind {
    /// Every kind, in the order [`RefusalCounts::by_kind`] lists them.
    pub const ALL: [RefusalKind; 4] = [
        RefusalKind::WrongProof,
        RefusalKind::NotOurProtocol,
        RefusalKind::Unfinished,
        RefusalKind::WrongService,
    ];

    /// A name for a metric's label: `wrong_proof`, `not_our_protocol`, `unfinished`,
    /// `wrong_service`.
    pub fn name(self) -> &'static str {
        match self {
            RefusalKind::WrongProof => "wrong_proof",
            RefusalKind::NotOurProtocol => "not_our_protocol",
            RefusalKind::Unfinished => "unfinished",
            RefusalKind::WrongService => "wrong_service",
        }
    }
}

impl Refusal {
    /// Its kind, for the counters.
    pub fn kind(&self) -> RefusalKind {
        match &self.reason {
            RefusalReason::Rejected(Rejection::WrongProof { .. }) => RefusalKind::WrongProof,
            RefusalReason::Rejected(Rejection::NotOurProtocol(_)) => RefusalKind::NotOurProtocol,
            RefusalReason::Rejected(Rejection::WrongService { .. }) => RefusalKind::WrongService,
            RefusalReason::Transport(_) => RefusalKind::Unfinished,
        }
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "refused a connection from {}: ", self.peer)?;
        match &self.reason {
            RefusalReason::Rejected(r) => write!(f, "it {r}"),
            RefusalReason::Transport(TransportError::TimedOut { waiting, within }) => write!(
                f,
                "it sent no complete job-secret handshake within {} ({waiting})",
                Secs(*within)
            ),
            RefusalReason::Transport(TransportError::Closed { waiting }) => write!(
                f,
                "it closed the connection during the job-secret handshake ({waiting})"
            ),
            RefusalReason::Transport(TransportError::Io { waiting, source }) => write!(
                f,
                "the connection failed during the job-secret handshake ({waiting}): {source}"
            ),
            RefusalReason::Transport(TransportError::Nonce(e)) => e.fmt(f),
        }
    }
}

impl std::error::Error for Refusal {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.reason {
            RefusalReason::Rejected(r) => Some(r),
            RefusalReason::Transport(t) => Some(t),
        }
    }
}

/// A listener's counts of refused connections, by kind.
#[derive(Debug, Default)]
pub struct Refusals {
    wrong_proof: AtomicU64,
    not_our_protocol: AtomicU64,
    unfinished: AtomicU64,
    wrong_service: AtomicU64,
}

/// The counts at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RefusalCounts {
    /// [`RefusalKind::WrongProof`].
    pub wrong_proof: u64,
    /// [`RefusalKind::NotOurProtocol`].
    pub not_our_protocol: u64,
    /// [`RefusalKind::Unfinished`].
    pub unfinished: u64,
    /// [`RefusalKind::WrongService`].
    pub wrong_service: u64,
}

impl Refusals {
    /// All zero.
    pub const fn new() -> Refusals {
        Refusals {
            wrong_proof: AtomicU64::new(0),
            not_our_protocol: AtomicU64::new(0),
            unfinished: AtomicU64::new(0),
            wrong_service: AtomicU64::new(0),
        }
    }

    /// Counts `refusal`.
    pub fn count(&self, refusal: &Refusal) {
        self.add(refusal.kind());
    }

    /// Counts one refusal of `kind`.
    pub fn add(&self, kind: RefusalKind) {
        let counter = match kind {
            RefusalKind::WrongProof => &self.wrong_proof,
            RefusalKind::NotOurProtocol => &self.not_our_protocol,
            RefusalKind::Unfinished => &self.unfinished,
            RefusalKind::WrongService => &self.wrong_service,
        };
        // A count, not a synchronisation: nothing else is read in its order.
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// The counts now.
    pub fn snapshot(&self) -> RefusalCounts {
        RefusalCounts {
            wrong_proof: self.wrong_proof.load(Ordering::Relaxed),
            not_our_protocol: self.not_our_protocol.load(Ordering::Relaxed),
            unfinished: self.unfinished.load(Ordering::Relaxed),
            wrong_service: self.wrong_service.load(Ordering::Relaxed),
        }
    }
}

impl RefusalCounts {
    /// Every kind with its count, in [`RefusalKind::ALL`]'s order.
    pub fn by_kind(&self) -> [(RefusalKind, u64); 4] {
        RefusalKind::ALL.map(|kind| (kind, self.get(kind)))
    }

    /// The count of one kind.
    pub fn get(&self, kind: RefusalKind) -> u64 {
        match kind {
            RefusalKind::WrongProof => self.wrong_proof,
            RefusalKind::NotOurProtocol => self.not_our_protocol,
            RefusalKind::Unfinished => self.unfinished,
            RefusalKind::WrongService => self.wrong_service,
        }
    }

    /// All refusals.
    pub fn total(&self) -> u64 {
        self.by_kind().iter().map(|(_, n)| n).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::failure::Waiting;
    use crate::handshake::wire::DecodeError;
    use crate::handshake::{Message, Progress, Service};
    use crate::secret::KeyId;
    use std::time::Duration;

    fn peer() -> SocketAddr {
        "10.0.0.3:51234".parse().unwrap()
    }

    fn refusals() -> Vec<Refusal> {
        let rejected = |r| Refusal {
            peer: peer(),
            reason: RefusalReason::Rejected(r),
        };
        let waiting = Waiting::Receiving(Progress {
            message: Message::Hello,
            got: 5,
            need: 41,
            exact: true,
        });
        vec![
            rejected(Rejection::WrongProof {
                theirs: KeyId([1, 2, 3, 4]),
                ours: KeyId([5, 6, 7, 8]),
            }),
            rejected(Rejection::NotOurProtocol(DecodeError::BadMagic {
                got: b"GET / HTTP/1.1\r\n".to_vec(),
            })),
            Refusal {
                peer: peer(),
                reason: RefusalReason::Transport(TransportError::TimedOut {
                    waiting,
                    within: Duration::from_secs(2),
                }),
            },
            rejected(Rejection::WrongService {
                asked: "rpc".into(),
                ours: Service::STORE,
            }),
        ]
    }

    #[test]
    fn each_refusal_is_one_line_naming_the_peer_and_why() {
        let lines: Vec<String> = refusals().iter().map(ToString::to_string).collect();
        let expected = [
            "refused a connection from 10.0.0.3:51234: it holds a different job secret (its key \
             id 01020304, ours 05060708)",
            "refused a connection from 10.0.0.3:51234: it does not speak the rallypoint \
             job-secret handshake: its first bytes \"GET / HTTP/1.1\\r\\n\" are not the \
             handshake's magic \"RALLYAU1\" (an HTTP request?)",
            "refused a connection from 10.0.0.3:51234: it sent no complete job-secret handshake \
             within 2 s (waiting for its HELLO: got 5 of 41 bytes)",
            "refused a connection from 10.0.0.3:51234: it asked for the \"rpc\" service, but this \
             listener is the \"store\"",
        ];
        assert_eq!(lines, expected);
        assert!(lines.iter().all(|l| !l.contains('\n')));
    }

    #[test]
    fn counters_count_each_kind_apart() {
        let counters = Refusals::new();
        let all = refusals();
        for (i, refusal) in all.iter().enumerate() {
            for _ in 0..=i {
                counters.count(refusal);
            }
        }
        let counts = counters.snapshot();
        assert_eq!(
            counts.by_kind().map(|(k, n)| (k.name(), n)),
            [
                ("wrong_proof", 1),
                ("not_our_protocol", 2),
                ("unfinished", 3),
                ("wrong_service", 4)
            ]
        );
        assert_eq!(counts.total(), 10);
    }
}
