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
//! # How it is put together
//!
//! * [`registry`]: backends by name, each an options constructor and an
//!   initialiser returning a [`transport::Transport`]. Built in: `TCP` (the
//!   default; [`tcp`]) and `PROCESS_GROUP` ([`pg`], over
//!   `rallypoint-collectives`' send and receive). A third-party backend
//!   registers the same way and gets everything below for free.
//! * [`init`]: `init_rpc` over the URL rendezvous, with PyTorch's sequence and
//!   name rules, for static and dynamic groups.
//! * The agent (`agent.rs`): calls with per-call timeouts (zero: none), errors
//!   naming the worker and the function, a worker's death failing the calls
//!   waiting on it at once, and graceful shutdown.
//! * [`RRef`]s (`rref.rs`): PyTorch's fork/confirm protocol with its two
//!   guarantees; deletion on drop rather than by a garbage collector; leaks
//!   reported by name at shutdown.
//! * [`device`]: device maps and PyTorch's validation; [`Payload`]s are bytes
//!   tagged with a device, mapped on the way and sent out of band.
//! * [`wire`]: a postcard envelope, raw bulk bytes, and the TCP framing; every
//!   decoder is property-tested.
//!
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
mod payload;
pub mod pg;
pub mod registry;
mod rref;
pub mod tcp;
pub mod transport;
pub mod types;
pub mod wire;

pub use agent::rrefs::RRef;
pub use agent::{Functions, Rpc, RpcFuture, ShutdownReport, ToWorker, Value};
pub use device::{Device, DeviceMap, Inventory};
pub use error::{Error, Mismatch, Result};
pub use init::{init_rpc, init_rpc_with_store};
pub use payload::Payload;
pub use registry::{
    backend_registered, backends, construct_rpc_backend_options, init_backend, register_backend,
    BackendContext, BackendType, RpcBackendOptions,
};
pub use rref::{Gid, Leak};

use serde::{Deserialize, Serialize};

/// A worker: its unique name and its id (rank).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WorkerInfo {
    pub name: String,
    pub id: u32,
}
