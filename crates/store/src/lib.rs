//! The rallypoint store: PyTorch's c10d key-value store, in Rust.
//!
//! Distributed jobs rendezvous through a small shared key-value store with blocking
//! reads. This crate provides the [`Store`] trait with PyTorch's semantics and four
//! backends:
//!
//! - [`TcpStore`], a client for PyTorch's TCPStore wire protocol, and
//!   [`server::Server`], a server for it. Either side interoperates with PyTorch:
//!   `torch.distributed.TCPStore` clients work against our server, and our client
//!   works against PyTorch's servers.
//! - [`FileStore`], which shares PyTorch's FileStore log file format, locking and
//!   last-user cleanup, so a PyTorch process and a rallypoint process can share one file.
//! - [`MemoryStore`], in-process (PyTorch's HashStore).
//! - [`PrefixStore`], which namespaces another store with PyTorch's key format.
//!
//! [`util`] holds the elastic store utilities (a barrier that names missing ranks,
//! `synchronize`, `get_all`, a scoped timeout), and [`blocking`] wraps any store for
//! plain blocking code.
//!
//! # How it works
//!
//! The store is async at its core. [`keyspace::Keyspace`] holds keys, queues and
//! waiters with no I/O; the server and the memory store keep one behind a mutex. A
//! blocking `get` is a `wait` followed by a read, exactly as PyTorch's client does it,
//! and every wait is bounded by the store's timeout. On timeout the error names the
//! keys that never appeared.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> rallypoint_store::Result<()> {
//! use rallypoint_store::{server::Server, Store, TcpStore};
//!
//! let server = Server::bind("127.0.0.1:0".parse().unwrap(), Default::default()).await?;
//! let addr = server.local_addr();
//! let handle = server.spawn();
//!
//! let store = TcpStore::builder("127.0.0.1", addr.port()).connect().await?;
//! store.set("greeting", b"hello").await?;
//! assert_eq!(store.get("greeting").await?, b"hello");
//! assert_eq!(store.add("counter", 5).await?, 5);
//! handle.shutdown().await;
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
//! | wire format, keys, errors, the job secret | `protocol`, `keyspace`, `timeout`, `host`, `error`, `secret` |
//! | the server and the in-process stores | `server`, `file`, `memory`, `prefix` |
//! | the TCP client, the loopback proxy | `tcp`, `proxy` |
//! | over any store | `util`, `blocking`, `conformance` |

pub mod blocking;
#[cfg(feature = "conformance")]
pub mod conformance;
mod error;
pub mod file;
pub mod host;
pub mod keyspace;
pub mod memory;
pub mod prefix;
pub mod protocol;
pub mod proxy;
pub mod secret;
pub mod server;
pub mod tcp;
mod timeout;
pub mod util;

use std::time::Duration;

pub use error::{Result, StoreError};
pub use file::FileStore;
pub use memory::MemoryStore;
pub use prefix::PrefixStore;
pub use tcp::{TcpStore, TcpStoreBuilder};
pub use timeout::TimeoutCell;

/// PyTorch's default store timeout.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// The c10d store API.
///
/// Keys are strings; values are bytes. Counters (`add`) are stored as decimal ASCII,
/// so `get` on a counter returns e.g. `b"5"`. Operations that wait — `get`, `wait`,
/// `multi_get`, blocking `queue_pop` — are bounded by [`Store::timeout`] unless given
/// one, and fail with [`StoreError::Timeout`] naming the keys that never appeared.
/// Unlike PyTorch, a zero timeout means "do not wait" everywhere, the file store
/// included.
#[async_trait::async_trait]
pub trait Store: Send + Sync {
    /// Sets `key` to `value`, waking everyone waiting for it.
    async fn set(&self, key: &str, value: &[u8]) -> Result<()>;

    /// Waits up to the store timeout for `key` to exist, then returns its value.
    async fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.wait(&[key]).await?;
        self.get_now(key).await
    }

    /// Reads `key` without waiting. A missing key reads as empty, as on PyTorch's
    /// libuv server (the key may be deleted between a wait and the read).
    async fn get_now(&self, key: &str) -> Result<Vec<u8>>;

    /// Adds `delta` to the decimal counter at `key` (missing = 0) and returns the
    /// new value.
    async fn add(&self, key: &str, delta: i64) -> Result<i64>;

    /// PyTorch's compare-and-set: if `key` holds `expected` (or is missing and
    /// `expected` is empty) it becomes `desired`. Returns the value after the call —
    /// except that a missing key with a non-empty `expected` returns `expected`
    /// unchanged, as PyTorch does.
    async fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>>;

    /// Waits up to the store timeout until every key exists.
    async fn wait(&self, keys: &[&str]) -> Result<()> {
        self.wait_timeout(keys, self.timeout()).await
    }

    /// Waits up to `timeout` until every key exists.
    async fn wait_timeout(&self, keys: &[&str], timeout: Duration) -> Result<()>;

    /// Whether every key exists now.
    async fn check(&self, keys: &[&str]) -> Result<bool>;

    /// Deletes `key`; returns whether it existed.
    async fn delete_key(&self, key: &str) -> Result<bool>;

    /// Number of keys in the whole store (for TCP stores this includes `init/`).
    async fn num_keys(&self) -> Result<i64>;

    /// Waits for every key, then reads them all in one round trip.
    async fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>>;

    /// Sets every pair, in order.
    async fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<()>;

    /// Appends `value` to `key`, creating it if missing.
    async fn append(&self, key: &str, value: &[u8]) -> Result<()>;

    /// Every user key in the store.
    async fn list_keys(&self) -> Result<Vec<String>>;

    /// Pushes `value` onto the queue named `key`.
    async fn queue_push(&self, key: &str, value: &[u8]) -> Result<()>;

    /// Pops the front of the queue `key`. With `block`, waits up to the store
    /// timeout for an item; without, an empty queue is [`StoreError::QueueEmpty`].
    async fn queue_pop(&self, key: &str, block: bool) -> Result<Vec<u8>>;

    /// Length of the queue `key` (0 if it does not exist).
    async fn queue_len(&self, key: &str) -> Result<i64>;

    /// The default timeout of waiting operations.
    fn timeout(&self) -> Duration;

    /// Changes the default timeout. [`util::store_timeout`] does it for a scope.
    fn set_timeout(&self, timeout: Duration);
}

/// Owned keys for error messages.
pub(crate) fn owned(keys: &[&str]) -> Vec<String> {
    keys.iter().map(|k| (*k).to_owned()).collect()
}
