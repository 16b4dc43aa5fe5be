//! The job secret as the store's servers and clients take it.
//!
//! With a job secret on (issue 49, [`rallypoint_auth`]), a store server
//! admits a connection only after the client proved it holds the secret, in
//! the handshake that comes before PyTorch's own `VALIDATE`; a store client
//! proves it right after it connects. Off by default: every PyTorch client
//! then works as before.
//!
//! A process sets its secret once ([`set_process_secret`]: `rally` does so
//! from `--job-secret-file` or `RALLY_JOB_SECRET_FILE`), and every
//! [`ServerConfig`](crate::server::ServerConfig) and
//! [`TcpStoreBuilder`](crate::TcpStoreBuilder) made afterwards takes it as
//! its default; either can still say otherwise (`secret: None` for a store
//! that unchanged PyTorch clients must reach). The secret is never put in a
//! child's environment by this crate: workers that speak PyTorch's protocol
//! reach a protected store through a loopback [`proxy`](crate::proxy).
//!
//! A server that refuses a client which speaks PyTorch's protocol (no
//! secret) answers with the handshake's magic before it closes: a
//! rallypoint client without the secret reads it where it expected its
//! ping's echo and fails at once saying a secret is needed
//! ([`StoreError::SecretRequired`](crate::StoreError::SecretRequired)),
//! instead of retrying until its timeout.

pub use rallypoint_auth::{process_secret, set_process_secret, JobSecret, Service};

/// The ping echo a rallypoint client reads from a server that requires a
/// job secret it did not send: the first bytes of the handshake's magic.
pub(crate) const REFUSAL_ECHO: [u8; 8] = *b"RALLYAU1";
