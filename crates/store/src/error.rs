//! Store errors. Every timeout says what it waited for and what never came.

use std::fmt;
use std::time::Duration;

use crate::protocol::DecodeError;

/// Result alias for store operations.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A wait (or a blocking get, multi_get or queue_pop) ran out of time.
    #[error("{op} timed out after {waited:?}: {}", Missing(.keys, .missing))]
    Timeout {
        op: &'static str,
        /// Every key the operation waited for.
        keys: Vec<String>,
        /// The keys that were still missing when it gave up (empty when unknown).
        missing: Vec<String>,
        waited: Duration,
    },
    /// The server never answered a command within the store timeout.
    #[error("{op} got no reply from the store at {addr} within {waited:?}")]
    NoReply {
        op: &'static str,
        addr: String,
        waited: Duration,
    },
    /// No connection could be made before the timeout.
    #[error("could not connect to the store at {addr} within {waited:?}")]
    Connect {
        addr: String,
        waited: Duration,
        #[source]
        source: std::io::Error,
    },
    /// An established connection failed.
    #[error("connection to the store at {addr} failed during {op}")]
    Disconnected {
        op: &'static str,
        addr: String,
        #[source]
        source: std::io::Error,
    },
    /// The server's reply could not be decoded.
    #[error("the store at {addr} sent an invalid reply to {op}")]
    Protocol {
        op: &'static str,
        addr: String,
        #[source]
        source: DecodeError,
    },
    /// The server answered with a reply this command cannot get.
    #[error("the store at {addr} answered {op} with {reply}")]
    UnexpectedReply {
        op: &'static str,
        addr: String,
        reply: String,
    },
    /// The PING after the handshake came back with the wrong nonce.
    #[error("the store at {addr} echoed ping nonce {got:#x}, expected {sent:#x}")]
    PingMismatch { addr: String, sent: u32, got: u32 },
    /// A non-blocking queue pop found nothing.
    #[error("queue {key:?} is empty")]
    QueueEmpty { key: String },
    /// A counter operation hit a value that is not a decimal integer, or overflowed.
    #[error("counter {key:?} cannot be updated")]
    Counter {
        key: String,
        #[source]
        source: crate::keyspace::CounterError,
    },
    /// A key, value or count is over a limit.
    #[error("{what} is {len} bytes, over the limit of {max}")]
    TooLarge { what: String, len: u64, max: u64 },
    /// The backend does not implement this operation.
    #[error("{op} is not supported by the {backend} store")]
    Unsupported {
        op: &'static str,
        backend: &'static str,
    },
    /// Not enough workers added themselves to `init/` in time.
    #[error("timed out after {waited:?} waiting for clients: {joined}/{expected} clients joined")]
    WorkersTimeout {
        joined: i64,
        expected: i64,
        waited: Duration,
    },
    /// A store barrier timed out. `missing` names (through the rank decoder) up to 16
    /// ranks that never arrived, when the caller gave its rank.
    #[error("barrier {prefix:?} timed out after {waited:?}: {arrived}/{world_size} arrived{}", MissingRanks(.missing, .tracing_note))]
    BarrierTimeout {
        prefix: String,
        waited: Duration,
        arrived: i64,
        world_size: usize,
        missing: Vec<String>,
        tracing_note: Option<String>,
    },
    /// The server could not listen on `addr`.
    #[error("could not {op} on {addr}")]
    Listen {
        op: &'static str,
        addr: String,
        #[source]
        source: std::io::Error,
    },
    /// File-store I/O on `path` failed.
    #[error("file store {path}: {op} failed")]
    File {
        op: &'static str,
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// A file-store log record is corrupt.
    #[error("file store {path} is corrupt at byte {offset}: {reason}")]
    Corrupt {
        path: String,
        offset: u64,
        reason: String,
    },
    /// A store backend outside this crate (etcd, ...) failed.
    #[error("{op} on the {backend} store at {addr} failed")]
    Backend {
        op: &'static str,
        backend: &'static str,
        addr: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The store (or its server) was shut down.
    #[error("the store is shut down")]
    Shutdown,

    /// The server holds a different job secret (or refused our proof, or
    /// is another rallypoint service): final, never retried.
    #[error("the store at {addr}: {detail}")]
    WrongSecret { addr: String, detail: String },

    /// The server requires a job secret and this client has none: final.
    #[error("the store at {addr} requires the job's secret, and this process has none (rally: --job-secret-file PATH, or RALLY_JOB_SECRET_FILE)")]
    SecretRequired { addr: String },
}

impl StoreError {
    /// Whether this is any kind of timeout.
    pub fn is_timeout(&self) -> bool {
        matches!(
            self,
            StoreError::Timeout { .. }
                | StoreError::NoReply { .. }
                | StoreError::WorkersTimeout { .. }
                | StoreError::BarrierTimeout { .. }
        )
    }
}

struct Missing<'a>(&'a [String], &'a [String]);

impl fmt::Display for Missing<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (keys, missing) = (self.0, self.1);
        write!(f, "keys {keys:?}")?;
        if !missing.is_empty() {
            write!(f, " (never set: {missing:?})")?;
        }
        Ok(())
    }
}

struct MissingRanks<'a>(&'a [String], &'a Option<String>);

impl fmt::Display for MissingRanks<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.0.is_empty() {
            write!(f, "; missing ranks: {}", self.0.join(", "))?;
        }
        if let Some(note) = self.1 {
            write!(f, "; {note}")?;
        }
        Ok(())
    }
}
