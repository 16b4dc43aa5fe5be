//! An in-process store (PyTorch's `HashStore`).
//!
//! Clones share one [`Keyspace`], so threads and tasks of one process can use it as
//! they would a server. Waits register a [`Signal`] with the keyspace and sleep on
//! it; nothing polls.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use rallypoint_sync::MutexExt;

use crate::keyspace::{Keyspace, Signal, WaitStart};
use crate::{owned, Result, Store, StoreError, TimeoutCell};

/// An in-memory store. Cloning gives another handle on the same keys.
#[derive(Clone, Default)]
pub struct MemoryStore {
    keyspace: Arc<Mutex<Keyspace>>,
    timeout: Arc<TimeoutCell>,
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore").finish_non_exhaustive()
    }
}

impl MemoryStore {
    /// An empty store with the default timeout.
    pub fn new() -> Self {
        Self::default()
    }

    fn ks(&self) -> MutexGuard<'_, Keyspace> {
        self.keyspace.locked()
    }

    fn counter_error(key: &str, source: crate::keyspace::CounterError) -> StoreError {
        StoreError::Counter {
            key: key.to_owned(),
            source,
        }
    }
}

#[async_trait::async_trait]
impl Store for MemoryStore {
    async fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.ks().set(key.as_bytes(), Bytes::copy_from_slice(value));
        Ok(())
    }

    async fn get_now(&self, key: &str) -> Result<Vec<u8>> {
        Ok(self
            .ks()
            .get(key.as_bytes())
            .map(|v| v.to_vec())
            .unwrap_or_default())
    }

    async fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.ks()
            .add(key.as_bytes(), delta)
            .map_err(|e| Self::counter_error(key, e))
    }

    async fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        Ok(self
            .ks()
            .compare_set(key.as_bytes(), expected, desired)
            .to_vec())
    }

    async fn wait_timeout(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let raw: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
        let signal = Signal::new();
        let id = match self.ks().wait(&raw, &signal) {
            WaitStart::Ready => return Ok(()),
            WaitStart::Pending(id) => id,
        };
        let started = tokio::time::Instant::now();
        if tokio::time::timeout(timeout, signal.notified())
            .await
            .is_ok()
        {
            return Ok(());
        }
        let mut ks = self.ks();
        if !ks.is_pending(id) {
            // Completed between the timer firing and taking the lock.
            return Ok(());
        }
        ks.cancel(&[id]);
        let missing = keys
            .iter()
            .filter(|k| !ks.check(&[k.as_bytes()]))
            .map(|k| (*k).to_owned())
            .collect();
        Err(StoreError::Timeout {
            op: "wait",
            keys: owned(keys),
            missing,
            waited: started.elapsed(),
        })
    }

    async fn check(&self, keys: &[&str]) -> Result<bool> {
        let raw: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
        Ok(self.ks().check(&raw))
    }

    async fn delete_key(&self, key: &str) -> Result<bool> {
        Ok(self.ks().delete(key.as_bytes()))
    }

    async fn num_keys(&self) -> Result<i64> {
        Ok(self.ks().num_keys())
    }

    async fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>> {
        self.wait(keys).await?;
        let raw: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
        Ok(self
            .ks()
            .multi_get(&raw)
            .into_iter()
            .map(|v| v.map(|v| v.to_vec()).unwrap_or_default())
            .collect())
    }

    async fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<()> {
        let mut ks = self.ks();
        for (k, v) in pairs {
            ks.set(k.as_bytes(), Bytes::copy_from_slice(v));
        }
        Ok(())
    }

    async fn append(&self, key: &str, value: &[u8]) -> Result<()> {
        self.ks()
            .append(key.as_bytes(), value, u64::MAX)
            .map_err(|e| StoreError::TooLarge {
                what: format!("value of {key:?}"),
                len: e.len,
                max: e.max,
            })
    }

    async fn list_keys(&self) -> Result<Vec<String>> {
        Ok(self
            .ks()
            .list_keys()
            .into_iter()
            .map(|k| String::from_utf8_lossy(&k).into_owned())
            .collect())
    }

    async fn queue_push(&self, key: &str, value: &[u8]) -> Result<()> {
        self.ks()
            .queue_push(key.as_bytes(), Bytes::copy_from_slice(value));
        Ok(())
    }

    async fn queue_pop(&self, key: &str, block: bool) -> Result<Vec<u8>> {
        let deadline = tokio::time::Instant::now() + self.timeout();
        loop {
            if let (_, Some(item)) = self.ks().queue_pop(key.as_bytes()) {
                return Ok(item.to_vec());
            }
            if !block {
                return Err(StoreError::QueueEmpty {
                    key: key.to_owned(),
                });
            }
            // Another popper may win the item we were woken for: wait again with
            // what is left of the timeout.
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            self.wait_timeout(&[key], left).await?;
        }
    }

    async fn queue_len(&self, key: &str) -> Result<i64> {
        Ok(self.ks().queue_len(key.as_bytes()))
    }

    fn timeout(&self) -> Duration {
        self.timeout.get()
    }

    fn set_timeout(&self, timeout: Duration) {
        self.timeout.set(timeout)
    }
}
