//! Rendezvous: how the processes of a job find each other and agree on a store,
//! a rank each, and the world size.
//!
//! Two layers, as in PyTorch:
//!
//! - [`init`]: URL-based init (`torch/distributed/rendezvous.py`). A URL such as
//!   `tcp://10.0.0.1:29500?rank=3&world_size=8`, `file:///tmp/job?rank=0&world_size=2`
//!   or `env://` names a scheme; the scheme's handler returns the store, this
//!   process's rank and the world size, once. Schemes are registrable.
//! - [`api`]: the elastic rendezvous interface the agent uses between restarts
//!   (`torch/distributed/elastic/rendezvous/api.py`): a [`api::RendezvousHandler`]
//!   per backend, created from [`api::RendezvousParameters`] through a
//!   [`registry::Registry`]. [`static_tcp`] is the fixed-size backend,
//!   [`dynamic`] the elastic one over any rallypoint store (`c10d`), and `etcd`
//!   (cargo feature `etcd`) the same protocol on an etcd v3 server.

pub mod api;
mod census;
pub mod dynamic;
#[cfg(feature = "etcd")]
pub mod etcd;
pub mod init;
pub mod registry;
pub mod static_tcp;
pub mod url;
mod wake;

pub use wake::Health;

pub use api::{
    MembershipChange, RendezvousError, RendezvousHandler, RendezvousInfo, RendezvousParameters,
};
