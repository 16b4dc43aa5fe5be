//! The opt-in job secret: only the job's own processes get into its listeners.
//!
//! Off by default, so every PyTorch compatibility stays as it is. With it on, every node of a
//! job reads the same secret from a file (`--job-secret-file PATH`, or `RALLY_JOB_SECRET_FILE`;
//! never the secret itself on a command line, where `ps` shows it, and never in a log), and
//! every listener (the store server, the rendezvous, the collectives' and RPC's listeners, the
//! quorum service) runs a mutual challenge and response before it serves a connection:
//!
//! - [`secret`]: [`JobSecret`], read from a file only its owner may read, at least 16 bytes;
//!   its [`KeyId`] is a public fingerprint for logs.
//! - [`handshake`]: the protocol (HMAC-SHA256 over fresh nonces from both sides, so nothing
//!   recorded can be replayed) as machines with no I/O, and its wire format.
//! - [`io`]: those machines over a blocking or a tokio stream, with a deadline.
//! - [`metrics`]: what a listener counts and logs when it refuses a connection.
//!
//! # What the secret protects, and what it cannot
//!
//! It keeps out whoever cannot read the file: a stray job on the same ports, another user's
//! process, a host on the network. Such a peer gets the server's challenge and nothing else: no
//! byte of the store, no place in the rendezvous, no collectives or RPC connection. A node
//! started with a different secret fails at once with an error that says so (both sides log
//! both key ids).
//!
//! It cannot keep out a process on a host of the job running as the job's user (or root): it
//! can read the file. It does not encrypt or authenticate the traffic after the handshake: an
//! attacker who can read or change packets on the path can read the store's values, or take
//! over a connection once it is admitted, and one that can redirect a node's connections can
//! relay a handshake between the node and the real server. For those, run the job on a
//! private network or through a tunnel (WireGuard, ssh). TLS could later wrap the same
//! listeners, with this handshake inside it or replaced by it. The secret should be random
//! bytes (`head -c 32 /dev/urandom > PATH`): a peer can get a keyed hash of known bytes from
//! any listener, and try a guessable secret offline.
//!
//! Rotation is out of scope: a job keeps its secret from start to end; a new secret means a
//! new job.
//!
//! # Example
//!
//! ```
//! use std::net::{TcpListener, TcpStream};
//! use std::time::Instant;
//! use rallypoint_auth::{io::blocking, io::SERVER_DEADLINE, JobSecret, Service};
//!
//! let secret = JobSecret::from_bytes(b"0123456789abcdef0123456789abcdef".to_vec())?;
//! let listener = TcpListener::bind("127.0.0.1:0")?;
//! let addr = listener.local_addr()?;
//! let server_secret = secret.clone();
//! let server = std::thread::spawn(move || {
//!     let (mut conn, peer) = listener.accept().unwrap();
//!     let deadline = Instant::now() + SERVER_DEADLINE;
//!     blocking::server_handshake(&mut conn, peer, &server_secret, Service::STORE, deadline)
//! });
//! let mut conn = TcpStream::connect(addr)?;
//! let deadline = Instant::now() + rallypoint_auth::io::CLIENT_DEADLINE;
//! blocking::client_handshake(&mut conn, addr, &secret, Service::STORE, deadline)?;
//! server.join().unwrap()?;
//! // Both sides now speak the store's own protocol over `conn`.
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod failure;
pub mod handshake;
pub mod io;
pub mod metrics;
pub mod secret;

pub use failure::{ClientError, ClientFailure, TransportError, Waiting};
pub use handshake::{ClientHandshake, Rejection, ServerHandshake, ServerMismatch, Service};
pub use metrics::{Refusal, RefusalCounts, RefusalKind, RefusalReason, Refusals};
pub use secret::{job_secret, process_secret, set_process_secret, JobSecret, KeyId, SecretError};
