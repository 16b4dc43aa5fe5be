//! A store view that puts every key under a prefix, with PyTorch's key format:
//! `prefix + "/" + key`. Prefixes nest, and a prefix ending in `/` gives a doubled
//! slash, exactly as PyTorch's `PrefixStore` does, so both see the same keys.
//! `num_keys` counts the whole underlying store (as PyTorch's does);
//! `list_keys` keeps only keys under the prefix, with the prefix stripped.

use std::sync::Arc;
use std::time::Duration;

use crate::{Result, Store, StoreError};

/// A prefixed view of another store.
#[derive(Clone)]
pub struct PrefixStore {
    prefix: String,
    inner: Arc<dyn Store>,
}

impl std::fmt::Debug for PrefixStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixStore")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl PrefixStore {
    pub fn new(prefix: impl Into<String>, inner: Arc<dyn Store>) -> Self {
        PrefixStore {
            prefix: prefix.into(),
            inner,
        }
    }

    /// The prefix, without the joining `/`.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The store underneath.
    pub fn inner(&self) -> &Arc<dyn Store> {
        &self.inner
    }

    /// The underlying key for `key`.
    pub fn join(&self, key: &str) -> String {
        let mut k = String::with_capacity(self.prefix.len() + 1 + key.len());
        k.push_str(&self.prefix);
        k.push('/');
        k.push_str(key);
        k
    }

    /// Rewrites a timeout's keys back into this view's names.
    fn local<T>(&self, r: Result<T>) -> Result<T> {
        r.map_err(|mut e| {
            if let StoreError::Timeout { keys, missing, .. } = &mut e {
                for k in keys.iter_mut().chain(missing.iter_mut()) {
                    if let Some(local) = k
                        .strip_prefix(self.prefix.as_str())
                        .and_then(|r| r.get(1..))
                    {
                        *k = local.to_owned();
                    }
                }
            }
            e
        })
    }

    fn join_all(&self, keys: &[&str]) -> Vec<String> {
        keys.iter().map(|k| self.join(k)).collect()
    }
}

fn refs(keys: &[String]) -> Vec<&str> {
    keys.iter().map(String::as_str).collect()
}

#[async_trait::async_trait]
impl Store for PrefixStore {
    async fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.set(&self.join(key), value).await
    }

    async fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.local(self.inner.get(&self.join(key)).await)
    }

    async fn get_now(&self, key: &str) -> Result<Vec<u8>> {
        self.inner.get_now(&self.join(key)).await
    }

    async fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.inner.add(&self.join(key), delta).await
    }

    async fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        self.inner
            .compare_set(&self.join(key), expected, desired)
            .await
    }

    async fn wait_timeout(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let joined = self.join_all(keys);
        self.local(self.inner.wait_timeout(&refs(&joined), timeout).await)
    }

    async fn check(&self, keys: &[&str]) -> Result<bool> {
        let joined = self.join_all(keys);
        self.inner.check(&refs(&joined)).await
    }

    async fn delete_key(&self, key: &str) -> Result<bool> {
        self.inner.delete_key(&self.join(key)).await
    }

    async fn num_keys(&self) -> Result<i64> {
        self.inner.num_keys().await
    }

    async fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>> {
        let joined = self.join_all(keys);
        self.local(self.inner.multi_get(&refs(&joined)).await)
    }

    async fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<()> {
        let joined: Vec<String> = pairs.iter().map(|(k, _)| self.join(k)).collect();
        let pairs: Vec<(&str, &[u8])> = joined
            .iter()
            .zip(pairs)
            .map(|(k, (_, v))| (k.as_str(), *v))
            .collect();
        self.inner.multi_set(&pairs).await
    }

    async fn append(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.append(&self.join(key), value).await
    }

    async fn list_keys(&self) -> Result<Vec<String>> {
        // PyTorch drops the prefix and the one character after it.
        Ok(self
            .inner
            .list_keys()
            .await?
            .iter()
            .filter_map(|k| k.strip_prefix(self.prefix.as_str())?.get(1..))
            .map(str::to_owned)
            .collect())
    }

    async fn queue_push(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.queue_push(&self.join(key), value).await
    }

    async fn queue_pop(&self, key: &str, block: bool) -> Result<Vec<u8>> {
        self.local(self.inner.queue_pop(&self.join(key), block).await)
    }

    async fn queue_len(&self, key: &str) -> Result<i64> {
        self.inner.queue_len(&self.join(key)).await
    }

    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }

    fn set_timeout(&self, timeout: Duration) {
        self.inner.set_timeout(timeout)
    }
}
