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
//!
//! A job of one found through a URL, as `init_process_group(init_method=...)`
//! does: the store it hands back is shared by every rank of the job.
//!
//! ```
//! use rallypoint_rendezvous::init::{rendezvous, InitArgs};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = tempfile::tempdir()?;
//! let url = format!("file://{}/job?rank=0&world_size=1", dir.path().display());
//! let found = rendezvous(&url, InitArgs::default())?.next().await?;
//! assert_eq!((found.rank, found.world_size), (0, 1));
//! found.store.set("hello", b"world").await?;
//! assert_eq!(found.store.get("hello").await?, b"world");
//! # Ok(())
//! # }
//! ```
//!
//! # Layers
//!
//! The first row is the lowest layer. A module imports only from its own row
//! (never in a circle) and the rows above it; `.ci/module-cycles` checks both.
//!
//! | layer | modules |
//! |---|---|
//! | pieces | `url`, `census` (who still runs), `wake` |
//! | the two interfaces | `api` (elastic handlers), `init` (URL init) |
//! | the elastic protocol | `dynamic` |
//! | backends on its parts | `static_tcp`, `etcd` |
//! | backends by name | `registry` |

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
