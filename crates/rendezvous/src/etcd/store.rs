//! The c10d [`Store`] API on an etcd v3 server.
//!
//! Keys live under `<root>k/`, queue items under `<root>q/<queue>/`, so
//! `list_keys` and `num_keys` see only keys. Plain operations map onto etcd
//! directly; `append` is an optimistic transaction that retries when the key's
//! `mod_revision` moved under it, and `compare_set` is a single transaction.
//!
//! Counters need no retry. etcd counts the writes to a key (its `version`), so
//! a counter is stored as `\0rally-counter:<base>` and its value is
//! `base + version - 1`: `add(k, 1)` is one transaction that rewrites the key
//! with its own value (`ignore_value`, which bumps the version) and reads it
//! back, so N nodes counting at once cost N requests, not the O(N²) of
//! read-then-compare-and-swap. Reads (`get`, `multi_get`, `add(k, 0)`) answer
//! the decimal value, as the TCP store does. Only the first write of a counter,
//! a counter overwritten with a plain number by `set`, and deltas other than 0
//! and 1 take the compare-and-swap path (which writes the counter form).
//!
//! Waits never poll. A wait reads which keys exist in one transaction, noting the
//! store revision `R`, then opens one watch from `R + 1` over the range spanning the
//! missing keys: nothing set after the read can be missed, and a wait for K keys
//! costs one read and one watch, not K of each. Queue items are ordered by their
//! create revision; a pop deletes the oldest item in a transaction that fails if
//! another popper got there first, so each item is popped once.
//!
//! Every request is bounded by the timeout given at connect (a silent etcd gives
//! [`StoreError::NoReply`], naming the operation), and a wait that runs out names
//! the keys that never came.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, EventType, GetOptions, PutOptions, SortOrder, SortTarget, Txn,
    TxnOp, TxnOpResponse, WatchFilterType, WatchOptions,
};
use rallypoint_store::keyspace::{parse_counter, CounterError};
use rallypoint_store::{Result, Store, StoreError, TimeoutCell};
use tokio::time::Instant;

/// etcd's default `--max-txn-ops`.
const MAX_TXN_OPS: usize = 128;

/// How a counter's value starts (see the module doc): below every printable
/// value, so one comparison tells a counter from a plain value.
const COUNTER: &[u8] = b"\0rally-counter:";

/// The value of a counter stored as `value` at `version`; `None` if `value`
/// is not in the counter form.
fn counter_value(value: &[u8], version: i64) -> Option<i64> {
    let base: i64 = std::str::from_utf8(value.strip_prefix(COUNTER)?)
        .ok()?
        .parse()
        .ok()?;
    base.checked_add(version - 1)
}

/// What a reader sees of a stored value: a counter as its decimal value.
fn visible(value: &[u8], version: i64) -> Vec<u8> {
    match counter_value(value, version) {
        Some(n) => n.to_string().into_bytes(),
        None => value.to_vec(),
    }
}

/// A store on an etcd v3 server.
#[derive(Clone)]
pub struct EtcdStore {
    client: Client,
    addr: String,
    /// `<root>k/`.
    keys: String,
    /// `<root>q/`.
    queues: String,
    /// Bounds each request (waits are bounded by `timeout` instead).
    rpc_timeout: Duration,
    timeout: std::sync::Arc<TimeoutCell>,
    /// Requests sent so far (shared by clones).
    rpcs: std::sync::Arc<AtomicU64>,
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore")
            .field("addr", &self.addr)
            .field("keys", &self.keys)
            .finish_non_exhaustive()
    }
}

fn backend(
    op: &'static str,
    addr: &str,
    e: impl std::error::Error + Send + Sync + 'static,
) -> StoreError {
    StoreError::Backend {
        op,
        backend: "etcd",
        addr: addr.to_owned(),
        source: Box::new(e),
    }
}

/// The first key after every key starting with `prefix` (etcd's prefix range end).
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

impl EtcdStore {
    /// Connects to the etcd server(s) at `endpoints` (`http://host:port` or
    /// `host:port`) and uses the keys under `root`.
    pub async fn connect(endpoints: &[String], root: &str, timeout: Duration) -> Result<Self> {
        let addr = endpoints.join(",");
        let options = etcd_client::ConnectOptions::new()
            .with_connect_timeout(timeout)
            .with_keep_alive(Duration::from_secs(10), Duration::from_secs(10));
        let client = Client::connect(endpoints, Some(options))
            .await
            .map_err(|e| backend("connect", &addr, e))?;
        let store = Self::from_client(client, addr, root, timeout);
        // Fail now, not at first use, if the server is not there.
        let probe = GetOptions::new().with_count_only();
        store
            .call(
                "connect",
                store
                    .client
                    .kv_client()
                    .get(store.keys.as_bytes(), Some(probe)),
            )
            .await?;
        Ok(store)
    }

    /// A store over an existing client.
    pub fn from_client(client: Client, addr: String, root: &str, timeout: Duration) -> Self {
        EtcdStore {
            client,
            addr,
            keys: format!("{root}k/"),
            queues: format!("{root}q/"),
            rpc_timeout: timeout,
            timeout: std::sync::Arc::new(TimeoutCell::new(timeout)),
            rpcs: Default::default(),
        }
    }

    /// The etcd client, for leases and watches beyond the store API.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The etcd key holding store key `key`.
    pub fn etcd_key(&self, key: &str) -> Vec<u8> {
        let mut k = Vec::with_capacity(self.keys.len() + key.len());
        k.extend_from_slice(self.keys.as_bytes());
        k.extend_from_slice(key.as_bytes());
        k
    }

    /// Requests this store (and its clones) sent to etcd so far.
    pub fn rpcs(&self) -> u64 {
        self.rpcs.load(Ordering::Relaxed)
    }

    /// The server's address, for messages.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Runs one etcd call, bounded by the request timeout given at connect.
    async fn call<T>(
        &self,
        op: &'static str,
        fut: impl Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T> {
        let waited = self.rpc_timeout;
        self.rpcs.fetch_add(1, Ordering::Relaxed);
        match tokio::time::timeout(waited, fut).await {
            Ok(r) => r.map_err(|e| backend(op, &self.addr, e)),
            Err(_) => Err(StoreError::NoReply {
                op,
                addr: self.addr.clone(),
                waited,
            }),
        }
    }

    /// Adds 1 to the counter at `k` in one transaction; `None` if `k` is not
    /// (yet) in the counter form.
    async fn increment(&self, k: &[u8]) -> Result<Option<i64>> {
        let k = k.to_vec();
        let is_counter = vec![
            Compare::create_revision(k.clone(), CompareOp::Greater, 0),
            Compare::value(k.clone(), CompareOp::Greater, Vec::new()),
            Compare::value(k.clone(), CompareOp::Less, vec![1u8]),
        ];
        let txn = Txn::new().when(is_counter).and_then([
            TxnOp::put(
                k.clone(),
                Vec::new(),
                Some(PutOptions::new().with_ignore_value()),
            ),
            TxnOp::get(k.clone(), None),
        ]);
        let resp = self.call("add", self.client.kv_client().txn(txn)).await?;
        if resp.succeeded() {
            let kv = resp.op_responses().into_iter().find_map(|r| match r {
                TxnOpResponse::Get(g) => g.kvs().first().cloned(),
                _ => None,
            });
            if let Some(n) = kv.and_then(|kv| counter_value(kv.value(), kv.version())) {
                return Ok(Some(n));
            }
        }
        Ok(None)
    }

    /// Value and mod revision of `key` (revision 0: missing).
    async fn read(&self, op: &'static str, key: &[u8]) -> Result<(Option<Vec<u8>>, i64)> {
        let resp = self
            .call(op, self.client.kv_client().get(key, None))
            .await?;
        Ok(match resp.kvs().first() {
            Some(kv) => (Some(visible(kv.value(), kv.version())), kv.mod_revision()),
            None => (None, 0),
        })
    }

    /// Writes `value` if `key` is still at `revision`; false if it moved.
    async fn put_if_unchanged(
        &self,
        op: &'static str,
        key: &[u8],
        revision: i64,
        value: Vec<u8>,
    ) -> Result<bool> {
        let txn = Txn::new()
            .when([Compare::mod_revision(key, CompareOp::Equal, revision)])
            .and_then([TxnOp::put(key, value, None)]);
        let resp = self.call(op, self.client.kv_client().txn(txn)).await?;
        Ok(resp.succeeded())
    }

    /// Runs `ops` in transactions of at most [`MAX_TXN_OPS`]; returns every
    /// response and the lowest revision the reads saw.
    async fn batch(&self, op: &'static str, ops: Vec<TxnOp>) -> Result<(Vec<TxnOpResponse>, i64)> {
        let mut out = Vec::with_capacity(ops.len());
        let mut revision = i64::MAX;
        let mut ops = ops.into_iter().peekable();
        while ops.peek().is_some() {
            let chunk: Vec<TxnOp> = ops.by_ref().take(MAX_TXN_OPS).collect();
            let resp = self
                .call(op, self.client.kv_client().txn(Txn::new().and_then(chunk)))
                .await?;
            revision = revision.min(resp.header().map_or(0, |h| h.revision()));
            out.extend(resp.op_responses());
        }
        Ok((out, revision))
    }

    /// Values of `keys` (None: missing) and the revision they were read at.
    async fn read_many(
        &self,
        op: &'static str,
        keys: &[&str],
    ) -> Result<(Vec<Option<Vec<u8>>>, i64)> {
        let ops = keys
            .iter()
            .map(|k| TxnOp::get(self.etcd_key(k), None))
            .collect();
        let (resps, revision) = self.batch(op, ops).await?;
        let values = resps
            .into_iter()
            .map(|r| match r {
                TxnOpResponse::Get(g) => {
                    g.kvs().first().map(|kv| visible(kv.value(), kv.version()))
                }
                _ => None,
            })
            .collect();
        Ok((values, revision))
    }

    /// Waits, from `revision + 1`, until each of `missing` is put.
    async fn watch_until_put(
        &self,
        op: &'static str,
        all: &[&str],
        mut missing: Vec<&str>,
        revision: i64,
        deadline: Instant,
        started: Instant,
    ) -> Result<()> {
        missing.sort_unstable();
        missing.dedup();
        let timeout = |missing: &[&str]| StoreError::Timeout {
            op,
            keys: all.iter().map(|k| (*k).to_owned()).collect(),
            missing: missing.iter().map(|k| (*k).to_owned()).collect(),
            waited: started.elapsed(),
        };
        if missing.is_empty() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(timeout(&missing));
        }
        // One watch over the range from the least to the greatest missing key.
        let first = self.etcd_key(missing[0]);
        let mut last = self.etcd_key(missing[missing.len() - 1]);
        last.push(0);
        let options = WatchOptions::new()
            .with_range(last)
            .with_start_revision(revision + 1)
            .with_filters([WatchFilterType::NoDelete]);
        let mut watch_client = self.client.watch_client();
        let mut stream =
            match tokio::time::timeout_at(deadline, watch_client.watch(first, Some(options))).await
            {
                Ok(r) => r.map_err(|e| backend(op, &self.addr, e))?,
                Err(_) => return Err(timeout(&missing)),
            };
        let prefix_len = self.keys.len();
        while !missing.is_empty() {
            let msg = match tokio::time::timeout_at(deadline, stream.message()).await {
                Ok(m) => m.map_err(|e| backend(op, &self.addr, e))?,
                Err(_) => return Err(timeout(&missing)),
            };
            let Some(resp) = msg else {
                return Err(backend(
                    op,
                    &self.addr,
                    std::io::Error::other("watch stream ended"),
                ));
            };
            if resp.canceled() {
                return Err(backend(
                    op,
                    &self.addr,
                    std::io::Error::other(format!("watch canceled: {}", resp.cancel_reason())),
                ));
            }
            for ev in resp.events() {
                if ev.event_type() != EventType::Put {
                    continue;
                }
                if let Some(kv) = ev.kv() {
                    let key = &kv.key()[prefix_len.min(kv.key().len())..];
                    missing.retain(|m| m.as_bytes() != key);
                }
            }
        }
        Ok(())
    }

    /// A read of every key under `prefix`, as `options` asks.
    async fn under(
        &self,
        op: &'static str,
        prefix: &[u8],
        options: GetOptions,
    ) -> Result<etcd_client::GetResponse> {
        let options = options.with_prefix();
        self.call(op, self.client.kv_client().get(prefix, Some(options)))
            .await
    }

    fn queue_prefix(&self, key: &str) -> Vec<u8> {
        format!("{}{key}/", self.queues).into_bytes()
    }

    /// Pops the oldest item of a queue, if any; otherwise the revision it was read at.
    async fn try_pop(&self, key: &str) -> Result<std::result::Result<Vec<u8>, i64>> {
        let prefix = self.queue_prefix(key);
        loop {
            let oldest = GetOptions::new()
                .with_sort(SortTarget::Create, SortOrder::Ascend)
                .with_limit(1);
            let resp = self.under("queue_pop", &prefix, oldest).await?;
            let Some(item) = resp.kvs().first() else {
                return Ok(Err(resp.header().map_or(0, |h| h.revision())));
            };
            let txn = Txn::new()
                .when([Compare::mod_revision(
                    item.key(),
                    CompareOp::Equal,
                    item.mod_revision(),
                )])
                .and_then([TxnOp::delete(item.key(), None)]);
            if self
                .call("queue_pop", self.client.kv_client().txn(txn))
                .await?
                .succeeded()
            {
                return Ok(Ok(item.value().to_vec()));
            }
            // Another popper took it; try the next.
        }
    }
}

/// The keys whose value was not found.
fn missing<'k>(keys: &[&'k str], values: &[Option<Vec<u8>>]) -> Vec<&'k str> {
    keys.iter()
        .zip(values)
        .filter(|(_, v)| v.is_none())
        .map(|(k, _)| *k)
        .collect()
}

fn counter_error(key: &str, source: CounterError) -> StoreError {
    StoreError::Counter {
        key: key.to_owned(),
        source,
    }
}

#[async_trait::async_trait]
impl Store for EtcdStore {
    async fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.call(
            "set",
            self.client.kv_client().put(self.etcd_key(key), value, None),
        )
        .await
        .map(drop)
    }

    async fn get_now(&self, key: &str) -> Result<Vec<u8>> {
        Ok(self
            .read("get", &self.etcd_key(key))
            .await?
            .0
            .unwrap_or_default())
    }

    async fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let k = self.etcd_key(key);
        loop {
            if delta == 1 {
                if let Some(n) = self.increment(&k).await? {
                    return Ok(n);
                }
            }
            let resp = self
                .call("add", self.client.kv_client().get(k.clone(), None))
                .await?;
            let (current, version, revision) = match resp.kvs().first() {
                Some(kv) => match counter_value(kv.value(), kv.version()) {
                    // Made a counter meanwhile (another node's first write):
                    // the one-transaction path again.
                    Some(_) if delta == 1 => continue,
                    Some(n) => (n, kv.version(), kv.mod_revision()),
                    None => (
                        parse_counter(kv.value()).map_err(|e| counter_error(key, e))?,
                        kv.version(),
                        kv.mod_revision(),
                    ),
                },
                None => (0, 0, 0),
            };
            if delta == 0 && revision != 0 {
                return Ok(current);
            }
            let new = current
                .checked_add(delta)
                .ok_or_else(|| counter_error(key, CounterError::Overflow))?;
            // After this write the version is `version + 1`.
            let base = new - version;
            let mut v = COUNTER.to_vec();
            v.extend_from_slice(base.to_string().as_bytes());
            let cond = match revision {
                0 => Compare::create_revision(k.clone(), CompareOp::Equal, 0),
                r => Compare::mod_revision(k.clone(), CompareOp::Equal, r),
            };
            let txn = Txn::new()
                .when([cond])
                .and_then([TxnOp::put(k.clone(), v, None)]);
            if self
                .call("add", self.client.kv_client().txn(txn))
                .await?
                .succeeded()
            {
                return Ok(new);
            }
        }
    }

    async fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        let k = self.etcd_key(key);
        // A missing key matches an empty `expected`; so does an existing empty value.
        let conditions: Vec<Compare> = if expected.is_empty() {
            vec![Compare::create_revision(k.clone(), CompareOp::Equal, 0)]
        } else {
            vec![Compare::value(k.clone(), CompareOp::Equal, expected)]
        };
        loop {
            let txn = Txn::new()
                .when(conditions.clone())
                .and_then([TxnOp::put(k.clone(), desired, None)])
                .or_else([TxnOp::get(k.clone(), None)]);
            let resp = self
                .call("compare_set", self.client.kv_client().txn(txn))
                .await?;
            if resp.succeeded() {
                return Ok(desired.to_vec());
            }
            let current = resp.op_responses().into_iter().find_map(|r| match r {
                TxnOpResponse::Get(g) => g
                    .kvs()
                    .first()
                    .map(|kv| (kv.value().to_vec(), kv.mod_revision())),
                _ => None,
            });
            match current {
                // Present but empty, and `expected` is empty: set it if unchanged.
                Some((v, rev)) if v.is_empty() && expected.is_empty() => {
                    if self
                        .put_if_unchanged("compare_set", &k, rev, desired.to_vec())
                        .await?
                    {
                        return Ok(desired.to_vec());
                    }
                }
                Some((v, _)) => return Ok(v),
                None => return Ok(expected.to_vec()),
            }
        }
    }

    async fn wait_timeout(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let started = Instant::now();
        let (values, revision) = self.read_many("wait", keys).await?;
        let missing = missing(keys, &values);
        self.watch_until_put("wait", keys, missing, revision, started + timeout, started)
            .await
    }

    async fn check(&self, keys: &[&str]) -> Result<bool> {
        let (values, _) = self.read_many("check", keys).await?;
        Ok(values.iter().all(Option::is_some))
    }

    async fn delete_key(&self, key: &str) -> Result<bool> {
        let resp = self
            .call(
                "delete_key",
                self.client.kv_client().delete(self.etcd_key(key), None),
            )
            .await?;
        Ok(resp.deleted() > 0)
    }

    async fn num_keys(&self) -> Result<i64> {
        let options = GetOptions::new().with_count_only();
        let resp = self
            .under("num_keys", self.keys.as_bytes(), options)
            .await?;
        Ok(resp.count())
    }

    async fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>> {
        let started = Instant::now();
        let timeout = self.timeout.get();
        loop {
            let (values, revision) = self.read_many("multi_get", keys).await?;
            let missing = missing(keys, &values);
            if missing.is_empty() {
                return Ok(values.into_iter().map(Option::unwrap_or_default).collect());
            }
            self.watch_until_put(
                "multi_get",
                keys,
                missing,
                revision,
                started + timeout,
                started,
            )
            .await?;
        }
    }

    async fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<()> {
        // etcd refuses a key twice in one transaction; the last value wins anyway.
        let last: std::collections::HashMap<&str, usize> = pairs
            .iter()
            .enumerate()
            .map(|(i, (k, _))| (*k, i))
            .collect();
        let ops = pairs
            .iter()
            .enumerate()
            .filter(|(i, (k, _))| last[k] == *i)
            .map(|(_, (k, v))| TxnOp::put(self.etcd_key(k), *v, None))
            .collect();
        self.batch("multi_set", ops).await.map(drop)
    }

    async fn append(&self, key: &str, value: &[u8]) -> Result<()> {
        let k = self.etcd_key(key);
        loop {
            let (current, revision) = self.read("append", &k).await?;
            let mut new = current.unwrap_or_default();
            new.extend_from_slice(value);
            if self.put_if_unchanged("append", &k, revision, new).await? {
                return Ok(());
            }
        }
    }

    async fn list_keys(&self) -> Result<Vec<String>> {
        let options = GetOptions::new().with_keys_only();
        let resp = self
            .under("list_keys", self.keys.as_bytes(), options)
            .await?;
        Ok(resp
            .kvs()
            .iter()
            .map(|kv| String::from_utf8_lossy(&kv.key()[self.keys.len()..]).into_owned())
            .collect())
    }

    async fn queue_push(&self, key: &str, value: &[u8]) -> Result<()> {
        // Unique within the store; order comes from the create revision.
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let mut item = self.queue_prefix(key);
        item.extend_from_slice(
            format!(
                "{nanos:x}-{:x}-{:x}",
                std::process::id(),
                SEQ.fetch_add(1, Ordering::Relaxed)
            )
            .as_bytes(),
        );
        self.call("queue_push", self.client.kv_client().put(item, value, None))
            .await
            .map(drop)
    }

    async fn queue_pop(&self, key: &str, block: bool) -> Result<Vec<u8>> {
        let started = Instant::now();
        let deadline = started + self.timeout.get();
        loop {
            let revision = match self.try_pop(key).await? {
                Ok(v) => return Ok(v),
                Err(revision) => revision,
            };
            if !block {
                return Err(StoreError::QueueEmpty {
                    key: key.to_owned(),
                });
            }
            // Wait for the next push after the empty read, then race for it.
            let prefix = self.queue_prefix(key);
            let options = WatchOptions::new()
                .with_range(prefix_end(&prefix))
                .with_start_revision(revision + 1)
                .with_filters([WatchFilterType::NoDelete]);
            let timeout = || StoreError::Timeout {
                op: "queue_pop",
                keys: vec![key.to_owned()],
                missing: vec![key.to_owned()],
                waited: started.elapsed(),
            };
            let mut watch_client = self.client.watch_client();
            let mut stream =
                match tokio::time::timeout_at(deadline, watch_client.watch(prefix, Some(options)))
                    .await
                {
                    Ok(r) => r.map_err(|e| backend("queue_pop", &self.addr, e))?,
                    Err(_) => return Err(timeout()),
                };
            loop {
                match tokio::time::timeout_at(deadline, stream.message()).await {
                    Err(_) => return Err(timeout()),
                    Ok(Err(e)) => return Err(backend("queue_pop", &self.addr, e)),
                    Ok(Ok(None)) => {
                        return Err(backend(
                            "queue_pop",
                            &self.addr,
                            std::io::Error::other("watch stream ended"),
                        ))
                    }
                    Ok(Ok(Some(resp))) if !resp.events().is_empty() => break,
                    Ok(Ok(Some(_))) => {}
                }
            }
        }
    }

    async fn queue_len(&self, key: &str) -> Result<i64> {
        let options = GetOptions::new().with_count_only();
        let resp = self
            .under("queue_len", &self.queue_prefix(key), options)
            .await?;
        Ok(resp.count())
    }

    fn timeout(&self) -> Duration {
        self.timeout.get()
    }

    fn set_timeout(&self, timeout: Duration) {
        self.timeout.set(timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::prefix_end;

    #[test]
    fn prefix_end_increments_the_last_byte_below_0xff() {
        assert_eq!(prefix_end(b"a/"), b"a0");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
    }
}
