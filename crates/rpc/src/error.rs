//! Errors: each says what was asked, of whom, and what happened.

/// An RPC error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// Bad arguments or options, caught before anything was sent.
    #[error("{0}")]
    Invalid(String),
    /// A device-map rule was broken (PyTorch's messages, naming the worker).
    #[error("{0}")]
    DeviceMap(String),
    /// `register_backend` with a name already taken.
    #[error("RPC backend {0}: already registered")]
    DuplicateBackend(String),
    /// A backend name nobody registered.
    #[error("no RPC backend named {name:?}; registered: {known}")]
    UnknownBackend { name: String, known: String },
    /// `init_rpc` failed (rendezvous, names, the group, the transport).
    #[error("init_rpc failed for worker {worker:?}: {message}")]
    Init { worker: String, message: String },
    /// The callee ran the request and it failed there.
    #[error("{what} on worker {worker} failed: {message}")]
    Remote {
        worker: String,
        what: String,
        message: String,
    },
    /// No answer within the call's timeout.
    #[error(
        "RPC ran for more than set timeout ({ms} ms) and will now be marked with an error: {what} on worker {worker}"
    )]
    Timeout {
        worker: String,
        what: String,
        ms: u128,
    },
    /// The callee's connection closed (or could not be made) before it answered.
    #[error("worker {worker} is unreachable ({reason}); {what} did not complete")]
    WorkerGone {
        worker: String,
        what: String,
        reason: String,
    },
    /// A value or argument did not (de)serialise.
    #[error("{0}")]
    Codec(String),
    /// The agent has shut down (or is shutting down).
    #[error("the RPC agent of worker {0} is shut down")]
    Shutdown(String),
    /// Graceful shutdown could not finish in time; teardown still ran.
    #[error("graceful shutdown of worker {worker} did not finish: {message}")]
    ShutdownIncomplete { worker: String, message: String },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
