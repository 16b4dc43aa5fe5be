//! PyTorch's RPC framework (`torch.distributed.rpc`) in Rust: a backend
//! registry, remote calls, remote references with owner-based reference
//! counting, a graceful shutdown that waits for every worker, and device maps
//! validated with PyTorch's rules.
//!
//! ```no_run
//! # async fn f() -> rallypoint_rpc::Result<()> {
//! use rallypoint_rpc::{init_rpc, RpcBackendOptions};
//!
//! let opts = RpcBackendOptions::default();
//! opts.functions.register("add", |(a, b): (i64, i64)| a + b)?;
//! // Under `rally run`, env:// finds the job's store: nothing else to pass.
//! let rpc = init_rpc("worker0", None, None, Some(2), Some(opts)).await?;
//! let three: i64 = rpc.rpc_sync("worker1", "add", &(1i64, 2i64)).await?;
//! rpc.shutdown(true, None).await?;
//! # Ok(()) }
//! ```
//!
//! # Layers
//!
//! Each module imports only from its own layer (never in a circle) and the ones
//! below it; `.ci/module-cycles` checks both.
//!
//! 1. **Transport and framing**: [`transport`] (what a backend provides,
//!    moving messages), [`tcp`] (the default: stream 0 for small messages,
//!    bulk streams on threads of their own) and [`pg`] (`PROCESS_GROUP`,
//!    over `rallypoint-collectives`' send and receive); [`wire`] (the
//!    envelope, ids, the TCP frame and hello; every decoder
//!    property-tested); [`types`] (type fingerprints); `worker_info`
//!    ([`WorkerInfo`], a worker's name and rank); [`device`]; `error`;
//!    `payload` (bulk bytes, and the thread-local context the agent sets
//!    while it encodes a message, where they go out of band).
//! 2. **The RRef protocol** (`rref.rs`, `rref/table.rs`): PyTorch's
//!    fork/confirm protocol as a pure machine, driven by a seeded simulation
//!    in the tests.
//! 3. **The agent** (`agent.rs` and `agent/`): calls and their deadlines
//!    (`calls.rs`), serving (`serve.rs`), the function table
//!    (`functions.rs`), encoding (`codec.rs`), the RRef handles and the
//!    context applying the protocol's effects (`rrefs.rs`), the heartbeat
//!    (`heartbeat.rs`), the count of work in flight and shutdown's gate
//!    (`gate.rs`), and the program's [`Rpc`] handle (`api.rs`).
//!    With a job secret (opt-in, [`RpcBackendOptions::secret`]), the TCP
//!    backend's connections prove it before anything else, both ways:
//!    `tcp/admission.rs` says what that covers and costs.
//! 4. **Lifecycle**: [`registry`] (backends by name: options and an
//!    initialiser; a third-party backend registers the same way and gets
//!    everything above the transport for free), [`init`] (`init_rpc` with
//!    PyTorch's sequence and name rules), `membership.rs` (dynamic groups
//!    joining and leaving) and `shutdown.rs` (a static group's graceful
//!    shutdown). The agent calls the last two through a trait, not by name.

//! # Where we do better than PyTorch
//!
//! * Shutdown does not time out in large worlds or when no call was ever made
//!   (#63247, #59795): its barrier and its count of calls in flight are one
//!   barrier and one all-reduce on the process group, with no fixed timeout.
//! * An idle agent is never killed by a process-group timeout (#38531): the
//!   group's timeout applies to operations in progress only.
//! * A call's timeout leaves nothing behind (#50522), and a dropped `RRef` is
//!   deleted at once, not when a garbage collector runs (#30105).

mod agent;
pub mod device;
mod error;
pub mod init;
mod membership;
mod payload;
pub mod pg;
pub mod registry;
mod rref;
mod shutdown;
pub mod tcp;
pub mod transport;
pub mod types;
pub mod wire;
mod worker_info;

pub use agent::rrefs::RRef;
pub use agent::{Functions, Rpc, RpcFuture, ShutdownReport, ToWorker, Value};
pub use device::{Device, DeviceMap, Inventory};
pub use error::{Error, Mismatch, Result};
pub use init::{init_rpc, init_rpc_with_store};
pub use payload::Payload;
pub use rallypoint_auth::{JobSecret, RefusalCounts};
pub use registry::{
    backend_registered, backends, construct_rpc_backend_options, init_backend, register_backend,
    BackendContext, BackendType, RpcBackendOptions,
};
pub use rref::{Gid, Leak};
pub use worker_info::WorkerInfo;
