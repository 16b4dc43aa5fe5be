//! Any store, for plain blocking code.
//!
//! [`BlockingStore`] runs each call to completion on a small shared runtime (one
//! I/O thread, started on first use), so blocking programs use the same async
//! backends without a runtime of their own. Do not call it from inside an async
//! context: use the [`Store`] directly there.
//!
//! ```
//! use rallypoint_store::blocking::{self, BlockingStore};
//! use rallypoint_store::MemoryStore;
//!
//! let store = BlockingStore::new(MemoryStore::new());
//! store.set("k", b"v").unwrap();
//! assert_eq!(store.get("k").unwrap(), b"v");
//!
//! // A TCP server and a client, with no async code in sight.
//! let server = blocking::serve("127.0.0.1:0".parse().unwrap(), Default::default()).unwrap();
//! let client = blocking::connect(rallypoint_store::TcpStore::builder("127.0.0.1", server.local_addr().port())).unwrap();
//! assert_eq!(client.add("n", 2).unwrap(), 2);
//! ```

use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use crate::server::{Server, ServerConfig, ServerHandle};
use crate::{Result, Store, TcpStore, TcpStoreBuilder};

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("rally-store-io")
            .enable_all()
            .build()
            .expect("could not start the store I/O runtime")
    })
}

/// Runs a future to completion on the shared store runtime.
pub fn block_on<F: Future>(f: F) -> F::Output {
    runtime().handle().block_on(f)
}

/// Connects a [`TcpStore`] (and, for a master, starts its server) from blocking code.
pub fn connect(builder: TcpStoreBuilder) -> Result<BlockingStore<TcpStore>> {
    block_on(builder.connect()).map(BlockingStore::new)
}

/// Starts a store server in the background from blocking code. It stops when the
/// handle is dropped.
pub fn serve(addr: SocketAddr, config: ServerConfig) -> Result<ServerHandle> {
    block_on(async move { Server::bind(addr, config).await.map(Server::spawn) })
}

/// A blocking view of a store.
pub struct BlockingStore<S: Store + ?Sized> {
    inner: Arc<S>,
}

impl<S: Store + ?Sized> Clone for BlockingStore<S> {
    fn clone(&self) -> Self {
        BlockingStore {
            inner: self.inner.clone(),
        }
    }
}

impl<S: Store> BlockingStore<S> {
    pub fn new(store: S) -> Self {
        BlockingStore {
            inner: Arc::new(store),
        }
    }
}

impl<S: Store + ?Sized> BlockingStore<S> {
    /// Wraps a shared store.
    pub fn from_arc(store: Arc<S>) -> Self {
        BlockingStore { inner: store }
    }

    /// The async store underneath.
    pub fn inner(&self) -> &Arc<S> {
        &self.inner
    }

    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        block_on(self.inner.set(key, value))
    }
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        block_on(self.inner.get(key))
    }
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        block_on(self.inner.add(key, delta))
    }
    pub fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        block_on(self.inner.compare_set(key, expected, desired))
    }
    pub fn wait(&self, keys: &[&str]) -> Result<()> {
        block_on(self.inner.wait(keys))
    }
    pub fn wait_timeout(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        block_on(self.inner.wait_timeout(keys, timeout))
    }
    pub fn check(&self, keys: &[&str]) -> Result<bool> {
        block_on(self.inner.check(keys))
    }
    pub fn delete_key(&self, key: &str) -> Result<bool> {
        block_on(self.inner.delete_key(key))
    }
    pub fn num_keys(&self) -> Result<i64> {
        block_on(self.inner.num_keys())
    }
    pub fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>> {
        block_on(self.inner.multi_get(keys))
    }
    pub fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<()> {
        block_on(self.inner.multi_set(pairs))
    }
    pub fn append(&self, key: &str, value: &[u8]) -> Result<()> {
        block_on(self.inner.append(key, value))
    }
    pub fn list_keys(&self) -> Result<Vec<String>> {
        block_on(self.inner.list_keys())
    }
    pub fn queue_push(&self, key: &str, value: &[u8]) -> Result<()> {
        block_on(self.inner.queue_push(key, value))
    }
    pub fn queue_pop(&self, key: &str, block: bool) -> Result<Vec<u8>> {
        block_on(self.inner.queue_pop(key, block))
    }
    pub fn queue_len(&self, key: &str) -> Result<i64> {
        block_on(self.inner.queue_len(key))
    }
    pub fn timeout(&self) -> Duration {
        self.inner.timeout()
    }
    pub fn set_timeout(&self, timeout: Duration) {
        self.inner.set_timeout(timeout)
    }
}
