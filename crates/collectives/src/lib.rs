//! Collectives for Rust programs: a process group over TCP (over shared memory
//! when every rank is on one host), bootstrapped from a PyTorch-compatible store,
//! that never hangs on a dead peer.
//!
//! A program started by `rally run` (or anything that sets `MASTER_ADDR`,
//! `MASTER_PORT`, `RANK` and `WORLD_SIZE`) gets a group in one call:
//!
//! ```no_run
//! # async fn f() -> rallypoint_collectives::Result<()> {
//! use rallypoint_collectives::{Options, ProcessGroup, ReduceOp};
//!
//! let pg = ProcessGroup::from_env(Options::default()).await?;
//! let mut grad = vec![1.0f32; 1 << 20];
//! pg.all_reduce(&mut grad, ReduceOp::Avg).await?;
//! pg.barrier().await?;
//! # Ok(()) }
//! ```
//!
//! [`ProcessGroup::new`] takes any [`rallypoint_store::Store`] instead, and
//! [`ProcessGroup::from_url`] PyTorch's `tcp://` and `file://` URLs too. The ops are
//! the ones PyTorch users know: `barrier`, `broadcast`, `all_reduce`, `reduce`,
//! `all_gather` (equal and varying sizes), `gather`, `scatter`,
//! `reduce_scatter`, `all_to_all`, `send`/`recv` with tags, the object variants
//! and `new_group`; on `u8`–`u64`, `i8`–`i64`, `f16`, `bf16`, `f32` and `f64`
//! ([`Element`]), with [`ReduceOp`]'s eight operators. The `*_async` variants
//! return a [`Work`] handle; [`blocking::BlockingGroup`] serves code without a
//! runtime.
//!
//! # How it works
//!
//! Set-up writes two keys: rank 0 publishes the group's generation (a random
//! nonce) and every rank publishes the address it listens on. Nothing else
//! happens until an operation needs a peer: [`transport`](crate) connections open
//! lazily, so a 1,024-rank barrier opens about a thousand connections, not a
//! million, and each starts with a handshake naming the group, its generation and
//! both ranks, so a connection from another job or an earlier round is refused.
//!
//! Each frame carries the sender's description of its operation (kind, type,
//! count, operator, root, algorithm) and is addressed by group, sequence number
//! and step. A reader task per connection hands frames to the operation waiting
//! for them (or, for the `*_async` forms and [`blocking::BlockingGroup`],
//! reads large payloads straight into the op's buffer: posted receives, see
//! `algorithms/posted.rs`), so reduction of one segment overlaps receipt of the next, and
//! compares them with the local operation as they arrive: ranks that called
//! different collectives are told so, with both sides named, instead of hanging
//! or corrupting memory as PyTorch does outside its debug mode.
//!
//! Algorithms are chosen by size (see [`algorithms`](crate)): recursive doubling
//! and binomial trees for small buffers, a segmented, pipelined ring for large
//! all-reduces, a pipelined chain for large broadcasts, a dissemination barrier.
//!
//! When every rank of a group (up to 64) is on one host, its collectives run
//! over shared memory instead (see [`shm`](crate)): an anonymous memory file
//! each rank maps, with a half-slot per rank, stages on futex words, and every
//! call compared by every rank at each op's first stage. The choice is made
//! at the group's first collective, the same on every member, and reported
//! by [`ProcessGroup::shared_memory`]; [`Options::shared_memory`] turns it off.
//!
//! A group whose members are on several hosts, some sharing one, runs
//! all_reduce, broadcast and barrier in two levels (see `two_level`): shared
//! memory within each host, TCP among each host's first member.
//!
//! A rank that falls behind files at most [`Options::receive_window`] bytes
//! from each peer for ops it has not reached: past that the peer's sends wait
//! for credit, and this rank asks for each op's frames as it reaches the op
//! (see `transport/flow.rs`).
//!
//! # Failure
//!
//! Every operation has a deadline (the group's timeout, or
//! [`ProcessGroup::with_timeout`]); expiring names the rank it was waiting for,
//! or says that rank never published its address (it never joined). A peer
//! whose connection ends fails, at once, every operation waiting on it; a
//! receive that has waited [`Options::probe_after`] asks the peer for its part,
//! which opens a connection if there is none (a dead peer refuses it) and has
//! the peer compare the two calls. A peer that accepts but does not answer the
//! handshake within [`Options::handshake_timeout`] is stopped or hung, and
//! named gone; TCP keepalive and `TCP_USER_TIMEOUT` fail connections to a host
//! that stopped answering within about [`Options::peer_timeout`].
//!
//! A failing operation aborts its group from itself on: later operations fail
//! at once with the first error's text, earlier ones (all of whose frames this
//! rank sent) may still finish. The rank where the failure happened first
//! records it in the store (`abort/<group>`, first record wins) and the
//! record's writer tells every member; other ranks tell the members they have
//! connections with, and an aborted group answers every frame and connection
//! from a member with the abort. An operation that finds a member gone reads
//! the record first, so a rank that exited on being told is not blamed for the
//! failure. A failing operation returns only after the record is written and
//! the telling is done (bounded), so a rank may exit on its error. A new group
//! can be formed on the same store under a new prefix ([`Options::prefix`]).
//!
//! # The job secret
//!
//! With a job secret ([`Options::secret`]: by default the process's, else
//! the file `RALLY_JOB_SECRET_FILE` names, which `rally run
//! --job-secret-file` gives its workers), every TCP connection between
//! ranks starts with the job-secret handshake of `rallypoint-auth`
//! (service `collectives`), before the hello: the dialling rank proves the
//! secret right after it connects, the accepting one before it reads a
//! byte of the collectives' own protocol, and each checks the other's
//! proof. That covers every connection the transport opens or accepts:
//! a group's, its subgroups' (they share its connections), each
//! generation's of [`ProcessGroup::next_generation`] (a newcomer's
//! transport listens on the spare listener its round bound), probes and
//! aborts. A connection that fails it is closed, logged (one warning
//! naming the peer) and counted ([`ProcessGroup::secret_refusals`]), and
//! harms nothing: each accepted connection runs its handshake in its own
//! task, so a peer that stalls holds only its own connection, 2 s at most.
//! A rank that holds another secret, or none, fails at once and says so:
//! [`ProcessGroup::new`] compares its key id with the one rank 0 publishes
//! beside the generation (a public fingerprint), and an op's connection
//! with such a peer fails with [`Error::JobSecret`], never retried.
//!
//! It costs each connection two round trips and four HMAC-SHA256s when it
//! opens (tens of microseconds on loopback), and nothing per op: frames go
//! as before. Without a secret nothing changes, byte for byte. Shared
//! memory needs nothing: it uses no socket, and a rank opens another's
//! memory file through `/proc/<pid>/fd`, which the OS allows the same user
//! only (whom a secret in a file that user reads could not keep out
//! anyway).
//!
//! # Layers
//!
//! The first row is the lowest layer; each module imports only from its own
//! row (never in a circle) and the rows above it (`.ci/module-cycles` checks
//! both):
//!
//! | layer | modules |
//! |---|---|
//! | the wire and the elements | `frame`, `hash`, `element`, `error`, `options`, `nosigpipe` (socket writes that never raise `SIGPIPE`) |
//! | TCP between ranks | `transport` (and its pure `router`); shared memory hears its aborts through a trait |
//! | one operation in flight | `op` (`OpCtx`, `Comm`, `Turn`) |
//! | how one flat group moves bytes over TCP | `algorithms` |
//! | ... or over one host's memory | `shm` (it borrows the algorithms' chunk bounds) |
//! | one flat group's ops | `flat` |
//! | groups across hosts | `two_level`, over flat groups inside |
//! | the choice | `plan` (which hosts, which transport), `dispatch` (two levels or flat) |
//! | the public API | `group` ([`ProcessGroup`], [`Work`]), `blocking` |
//!
//! What a mismatch promises is in the guide (`docs/collectives.md`,
//! "Mismatched calls are errors, on every rank"); `tests/integration/sim.rs`
//! checks it, and the failure promises, on
//! thousands of seeded schedules of mismatches and deaths.

mod algorithms;
pub mod blocking;
mod dispatch;
mod element;
mod error;
mod flat;
mod frame;
mod group;
mod hash;
pub mod nosigpipe;
mod op;
mod options;
mod plan;
mod shm;
mod transport;
mod two_level;

pub use element::{DType, Element, ReduceOp};
pub use error::{Error, Result, DIVERGED_GRACE};
pub use group::{route_ip, ProcessGroup, Work};
pub use half::{bf16, f16};
pub use options::{AllReduceAlgorithm, BroadcastAlgorithm, Options, DEFAULT_TIMEOUT};
pub use rallypoint_auth::{JobSecret, RefusalCounts};
pub use shm::ops::{split_round_bytes, SHARED_CORE_ROUND};

/// The wire format, public for fuzzing and for tools that inspect traffic.
pub mod wire {
    pub use crate::frame::{
        Algo, BadFrame, Desc, Header, Hello, OpKind, ACCEPTED, HEADER_LEN, HELLO_LEN, MAX_PAYLOAD,
        MAX_REASON, NOT_HERE, REFUSED,
    };
}
