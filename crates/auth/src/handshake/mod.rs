//! The job-secret handshake: a mutual challenge and response with HMAC-SHA256, sans I/O.
//!
//! Both sides hold the job secret K. Each proves it to the other without sending it, over
//! nonces that each draws fresh from the OS random source for this handshake alone:
//!
//! ```text
//!   client                                                     server (listener of `label`)
//!     |  HELLO      "RALLYAU1" | len | label | Nc                  |
//!     | -------------------------------------------------------->  |  wrong label: WRONG SERVICE
//!     |                                                            |  reply, then close
//!     |  CHALLENGE  "RALLYAU1" | 0 | Ns | Ps | key id(K)           |  Ps = HMAC(K, "rally server"
//!     | <--------------------------------------------------------  |         | label | Nc | Ns)
//!  check Ps (constant time); wrong: "the server at ADDR holds a different job secret (its key
//!  id X, ours Y)", after sending PROOF so the server logs it too
//!     |  PROOF      Pc | key id(K)                                 |  Pc = HMAC(K, "rally client"
//!     | -------------------------------------------------------->  |         | label | Ns | Nc)
//!     |                                                            |  check Pc (constant time)
//!     |  VERDICT    0 admitted | 1 refused                         |
//!     | <--------------------------------------------------------  |
//!   the service's own protocol starts at the next byte, both ways
//! ```
//!
//! The bytes of each message are in [`wire`]; the hashes in `proof`. A peer that sends
//! anything else (PyTorch's TCPStore client, an HTTP request, a TLS hello) fails the magic at
//! its first byte and is dropped at once; this crate sends it nothing (a listener may still
//! tell it why in its own protocol, as the store and the collectives do). A replayed PROOF fails: it
//! covers the Ns of the exchange it was recorded from, and every CHALLENGE carries a new one.
//! A replayed CHALLENGE fails the same way on the client's side, against its new Nc.
//!
//! [`ServerHandshake`] and [`ClientHandshake`] are machines: `receive` the bytes read, ask
//! `step` for a [`Step`] (write these bytes, read at most this many, or done), until done or an
//! error. They never see a socket or a clock; `crate::io` runs them over a stream with a
//! deadline.

mod client;
mod proof;
mod server;
mod service;
mod step;
pub mod wire;

pub use client::{ClientHandshake, ServerMismatch};
pub use proof::NonceError;
pub use server::{Rejection, ServerHandshake};
pub use service::Service;
pub use step::{Message, Progress, Step};
pub use wire::DecodeError;

#[cfg(test)]
mod tests;
