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
    /// The callee's function (or method) takes or returns other types than
    /// the caller's call: both sides, by type shape (module paths dropped).
    #[error("{0}")]
    TypeMismatch(Box<Mismatch>),
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

/// Both sides of a call whose types disagree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch {
    /// The callee, and what was called there.
    pub worker: String,
    pub what: String,
    /// What the callee's function takes and returns.
    pub their_args: String,
    pub their_ret: String,
    /// The caller, and what its call passed and expected.
    pub caller: String,
    pub our_args: String,
    pub our_ret: String,
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} on worker {} takes {} and returns {}, but worker {} called it with {}, expecting {}",
            self.what,
            self.worker,
            self.their_args,
            self.their_ret,
            self.caller,
            self.our_args,
            self.our_ret
        )
    }
}
