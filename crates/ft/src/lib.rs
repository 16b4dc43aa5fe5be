//! The replica group's manager of per-step fault tolerance (torchft's
//! `ManagerServer`, ours): one per replica group, run by `rally run --ft`
//! in the agent or by group rank 0's Python process
//! (`rallypoint._native.FtManager`).
//!
//! It serves the group's W worker processes over JSON lines ([`wire`]):
//! when all W ranks call `quorum`, it makes one `Quorum` call to the
//! lighthouse (torchft's `LighthouseService`) for the group, and gives
//! each rank its own result of the issued quorum ([`results`]: torchft's
//! `compute_quorum_results`); `should_commit` is a barrier of the W ranks
//! whose decision is the AND of their votes. It hosts the store of the
//! cross-replica process groups (the `store_address` in its
//! `QuorumMember`).
//!
//! Liveness, beyond torchft: when a worker's connection ends (it died or
//! exited) or the agent calls [`Manager::workers_stopped`], the manager
//! fails every waiting call and drops its lighthouse connection at once,
//! so the lighthouse drops the group from the quorum and tells the
//! survivors, well before any heartbeat timeout; the next hello
//! reconnects. The replica id is sent as given, so a second live group
//! with the same id is refused by the lighthouse, with an error naming it.
//!
//! The contract with the Python side and `rally run --ft` is issue 48's
//! (the workers' protocol, the status and the environment).
//!
//! # Layers
//!
//! The first row is the lowest layer; each module imports only from its
//! own row and the rows above it:
//!
//! | layer | modules |
//! |---|---|
//! | one group rank's view of an issued quorum, pure; the workers' JSON lines | `results`, `wire` |
//! | the group's round: events in, actions out, pure; the status books | `round`, `status` |
//! | the lighthouse client: one HTTP/2 connection of our own, heartbeats | `lighthouse` |
//! | the manager: workers' endpoint, store, core task | `server` |

pub mod lighthouse;
pub mod results;
pub mod round;
pub mod server;
pub mod status;
pub mod wire;

pub use server::{Config, Error, Manager};
pub use status::{FtEvent, Status};
