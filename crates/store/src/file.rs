//! A store in a shared file, byte-compatible with PyTorch's `FileStore`.
//!
//! The file is an append-only log of records, each `u32` key length, key, `u32` value
//! length, value (little-endian). User keys are stored as `"/" + key`; a deletion
//! appends a tombstone record `"-" + "/" + key` with an empty value; the lifecycle
//! counters `refcount/` and `cleanup/` have no slash. Counters are decimal ASCII.
//!
//! Every operation opens the file afresh and takes a whole-file `flock(2)`: shared to
//! read, exclusive to append. Each store keeps a cache of the map and the offset it
//! has parsed up to, and reads only the records appended since. Opening a file that
//! does not exist yet is retried every 10 ms until the timeout, for readers that start
//! before the writer.
//!
//! Lifecycle, as PyTorch: a new store adds 1 to `refcount/`; dropping it adds 1 to
//! `cleanup/` and -1 to `refcount/`, and the last one out removes the file once
//! `cleanup/` has reached the number of workers (`-1`: never remove).
//!
//! Where we differ from PyTorch, deliberately: `delete_key` reports whether the key
//! existed (PyTorch always says yes); `list_keys` returns user keys intact (PyTorch
//! cuts the first character of every key, giving `efcount/`); a zero timeout means
//! "do not wait" as on every other store (PyTorch's FileStore waits forever). Waits
//! poll every 10 ms, as PyTorch's do: a file gives no way to be woken. Queues are not
//! supported, as in PyTorch.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rallypoint_sync::MutexExt;

use crate::keyspace::parse_counter;
use crate::{owned, Result, Store, StoreError, TimeoutCell};

const REFCOUNT_KEY: &[u8] = b"refcount/";
const CLEANUP_KEY: &[u8] = b"cleanup/";
const DELETE_PREFIX: u8 = b'-';
const POLL: Duration = Duration::from_millis(10);

/// A store backed by a file that PyTorch's `FileStore` can share.
pub struct FileStore {
    inner: Arc<Inner>,
}

struct Inner {
    path: PathBuf,
    num_workers: i64,
    cache: Mutex<Cache>,
    timeout: TimeoutCell,
}

#[derive(Default)]
struct Cache {
    map: HashMap<Vec<u8>, Vec<u8>>,
    /// Bytes of the file parsed so far.
    pos: u64,
}

#[derive(Clone, Copy)]
enum Lock {
    Shared,
    Exclusive,
}

#[derive(Clone, Copy)]
enum Open {
    /// `O_RDONLY`
    Read,
    /// `O_RDWR | O_CREAT`, mode 0644
    Create,
    /// `O_RDWR`
    Write,
}

fn user_key(key: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(key.len() + 1);
    k.push(b'/');
    k.extend_from_slice(key.as_bytes());
    k
}

fn encode_record(out: &mut Vec<u8>, key: &[u8], value: &[u8]) {
    out.extend_from_slice(&(key.len() as u32).to_le_bytes());
    out.extend_from_slice(key);
    out.extend_from_slice(&(value.len() as u32).to_le_bytes());
    out.extend_from_slice(value);
}

/// Decodes the records in `buf`, calling `apply(key, value)` for each. Returns the
/// number of bytes of whole records, or the offset and reason of the first bad one.
/// A record cut short at the end is reported as corrupt: writers append whole
/// records under an exclusive lock, so a reader holding the lock never sees one.
pub fn decode_records(
    buf: &[u8],
    mut apply: impl FnMut(&[u8], &[u8]),
) -> std::result::Result<usize, (usize, String)> {
    let mut at = 0;
    let field = |at: usize, what: &str| -> std::result::Result<(usize, usize), (usize, String)> {
        let len = buf
            .get(at..at + 4)
            .ok_or_else(|| (at, format!("{what} length is cut short")))?;
        let len = u32::from_le_bytes(len.try_into().expect("4 bytes")) as usize;
        let end = at + 4 + len;
        if end > buf.len() {
            return Err((
                at,
                format!("{what} of {len} bytes runs past the end of the file"),
            ));
        }
        Ok((at + 4, end))
    };
    while at < buf.len() {
        let (ks, ke) = field(at, "key")?;
        let (vs, ve) = field(ke, "value")?;
        apply(&buf[ks..ke], &buf[vs..ve]);
        at = ve;
    }
    Ok(at)
}

impl Inner {
    fn io(&self, op: &'static str) -> impl Fn(std::io::Error) -> StoreError + '_ {
        move |source| StoreError::File {
            op,
            path: self.path.display().to_string(),
            source,
        }
    }

    /// Opens and locks the file, retrying while it does not exist until `deadline`.
    fn open(&self, how: Open, lock: Lock, deadline: Instant) -> Result<File> {
        let mut opts = OpenOptions::new();
        match how {
            Open::Read => opts.read(true),
            Open::Create => opts.read(true).write(true).create(true).mode(0o644),
            Open::Write => opts.read(true).write(true),
        };
        let file = loop {
            match opts.open(&self.path) {
                Ok(f) => break f,
                // Waiting for another process to create the file; creating
                // it ourselves fails with NotFound only when its directory is
                // gone, which waiting does not mend.
                Err(e)
                    if e.kind() == std::io::ErrorKind::NotFound
                        && !matches!(how, Open::Create)
                        && Instant::now() < deadline =>
                {
                    std::thread::sleep(POLL)
                }
                Err(e) => return Err(self.io("open")(e)),
            }
        };
        let op = match lock {
            Lock::Shared => libc::LOCK_SH,
            Lock::Exclusive => libc::LOCK_EX,
        };
        loop {
            // SAFETY: flock on a descriptor we own; the lock is released when `file`
            // is closed.
            if unsafe { libc::flock(file.as_raw_fd(), op) } == 0 {
                return Ok(file);
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(self.io("lock")(e));
            }
        }
    }

    fn deadline(&self) -> Instant {
        Instant::now() + self.timeout.get()
    }

    /// Reads the records appended since the last refresh into the cache.
    fn refresh(&self, file: &mut File, cache: &mut Cache) -> Result<()> {
        let size = file.metadata().map_err(self.io("stat"))?.len();
        if size <= cache.pos {
            return Ok(());
        }
        file.seek(SeekFrom::Start(cache.pos))
            .map_err(self.io("seek"))?;
        let mut buf = Vec::with_capacity((size - cache.pos) as usize);
        file.read_to_end(&mut buf).map_err(self.io("read"))?;
        let map = &mut cache.map;
        let used = decode_records(&buf, |k, v| {
            if k.first() == Some(&DELETE_PREFIX) {
                map.remove(&k[1..]);
            } else {
                map.insert(k.to_vec(), v.to_vec());
            }
        })
        .map_err(|(at, reason)| StoreError::Corrupt {
            path: self.path.display().to_string(),
            offset: cache.pos + at as u64,
            reason,
        })?;
        cache.pos += used as u64;
        Ok(())
    }

    fn append(&self, file: &mut File, records: &[u8]) -> Result<()> {
        file.seek(SeekFrom::End(0)).map_err(self.io("seek"))?;
        file.write_all(records).map_err(self.io("write"))
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, Cache> {
        self.cache.locked()
    }

    /// Runs `f` on a freshly refreshed cache under the given lock.
    fn with_cache<T>(
        &self,
        how: Open,
        lock: Lock,
        f: impl FnOnce(&Self, &mut File, &mut Cache) -> Result<T>,
    ) -> Result<T> {
        let mut cache = self.cache();
        let mut file = self.open(how, lock, self.deadline())?;
        self.refresh(&mut file, &mut cache)?;
        f(self, &mut file, &mut cache)
    }

    fn set(&self, key: Vec<u8>, value: &[u8]) -> Result<()> {
        let _cache = self.cache();
        let mut file = self.open(Open::Create, Lock::Exclusive, self.deadline())?;
        let mut rec = Vec::with_capacity(key.len() + value.len() + 8);
        encode_record(&mut rec, &key, value);
        self.append(&mut file, &rec)
    }

    fn add(&self, key: &[u8], delta: i64) -> Result<i64> {
        self.with_cache(Open::Create, Lock::Exclusive, |this, file, cache| {
            let old = match cache.map.get(key) {
                Some(v) if !v.is_empty() => {
                    parse_counter(v).map_err(|source| StoreError::Counter {
                        key: String::from_utf8_lossy(key).into_owned(),
                        source,
                    })?
                }
                _ => 0,
            };
            let new = old.checked_add(delta).ok_or_else(|| StoreError::Counter {
                key: String::from_utf8_lossy(key).into_owned(),
                source: crate::keyspace::CounterError::Overflow,
            })?;
            let mut rec = Vec::new();
            encode_record(&mut rec, key, new.to_string().as_bytes());
            this.append(file, &rec)?;
            Ok(new)
        })
    }

    fn compare_set(&self, key: &[u8], expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        self.with_cache(Open::Create, Lock::Exclusive, |this, file, cache| {
            let write = match cache.map.get(key) {
                None => expected.is_empty(),
                Some(cur) => cur == expected,
            };
            if !write {
                return Ok(cache
                    .map
                    .get(key)
                    .cloned()
                    .unwrap_or_else(|| expected.to_vec()));
            }
            let mut rec = Vec::new();
            encode_record(&mut rec, key, desired);
            this.append(file, &rec)?;
            Ok(desired.to_vec())
        })
    }

    fn read<T>(&self, f: impl FnOnce(&Cache) -> T) -> Result<T> {
        self.with_cache(Open::Read, Lock::Shared, |_, _, cache| Ok(f(cache)))
    }

    fn delete(&self, key: &[u8]) -> Result<bool> {
        self.with_cache(Open::Write, Lock::Exclusive, |this, file, cache| {
            let existed = cache.map.contains_key(key);
            let mut tomb = Vec::with_capacity(key.len() + 1);
            tomb.push(DELETE_PREFIX);
            tomb.extend_from_slice(key);
            let mut rec = Vec::new();
            encode_record(&mut rec, &tomb, b"");
            this.append(file, &rec)?;
            Ok(existed)
        })
    }

    fn multi_set(&self, pairs: &[(Vec<u8>, Vec<u8>)]) -> Result<()> {
        let _cache = self.cache();
        let mut file = self.open(Open::Create, Lock::Exclusive, self.deadline())?;
        let mut rec = Vec::new();
        for (k, v) in pairs {
            encode_record(&mut rec, k, v);
        }
        self.append(&mut file, &rec)
    }

    fn append_value(&self, key: &[u8], value: &[u8]) -> Result<()> {
        self.with_cache(Open::Create, Lock::Exclusive, |this, file, cache| {
            let mut v = cache.map.get(key).cloned().unwrap_or_default();
            v.extend_from_slice(value);
            let mut rec = Vec::new();
            encode_record(&mut rec, key, &v);
            this.append(file, &rec)
        })
    }

    fn missing(&self, keys: &[Vec<u8>]) -> Result<Vec<usize>> {
        self.read(|c| {
            keys.iter()
                .enumerate()
                .filter(|(_, k)| !c.map.contains_key(k.as_slice()))
                .map(|(i, _)| i)
                .collect()
        })
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if !self.path.exists() {
            return;
        }
        let finished = self.add(CLEANUP_KEY, 1);
        let refs = self.add(REFCOUNT_KEY, -1);
        if let (Ok(finished), Ok(0)) = (finished, refs) {
            if self.num_workers >= 0 && finished >= self.num_workers {
                let _ = std::fs::remove_file(&self.path);
            }
        }
    }
}

impl FileStore {
    /// Opens (creating if needed) the store at `path` for a job of `num_workers`
    /// stores; `-1` never removes the file.
    pub async fn open(path: impl AsRef<Path>, num_workers: i64) -> Result<FileStore> {
        let path = path.as_ref().to_owned();
        tokio::task::spawn_blocking(move || FileStore::open_blocking(path, num_workers))
            .await
            .expect("file store task panicked")
    }

    /// [`FileStore::open`] for blocking code.
    pub fn open_blocking(path: impl AsRef<Path>, num_workers: i64) -> Result<FileStore> {
        let inner = Inner {
            path: path.as_ref().to_owned(),
            num_workers,
            cache: Mutex::new(Cache::default()),
            timeout: TimeoutCell::default(),
        };
        inner.add(REFCOUNT_KEY, 1)?;
        Ok(FileStore {
            inner: Arc::new(inner),
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Inner) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let inner = self.inner.clone();
        tokio::task::spawn_blocking(move || f(&inner))
            .await
            .expect("file store task panicked")
    }
}

impl std::fmt::Debug for FileStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileStore")
            .field("path", &self.inner.path)
            .finish()
    }
}

#[async_trait::async_trait]
impl Store for FileStore {
    async fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let (k, v) = (user_key(key), value.to_vec());
        self.run(move |s| s.set(k, &v)).await
    }

    async fn get_now(&self, key: &str) -> Result<Vec<u8>> {
        let k = user_key(key);
        self.run(move |s| s.read(|c| c.map.get(&k).cloned().unwrap_or_default()))
            .await
    }

    async fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let k = user_key(key);
        self.run(move |s| s.add(&k, delta)).await
    }

    async fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        let (k, e, d) = (user_key(key), expected.to_vec(), desired.to_vec());
        self.run(move |s| s.compare_set(&k, &e, &d)).await
    }

    async fn wait_timeout(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let started = Instant::now();
        let wire: Vec<Vec<u8>> = keys.iter().map(|k| user_key(k)).collect();
        loop {
            let w = wire.clone();
            let missing = self.run(move |s| s.missing(&w)).await?;
            if missing.is_empty() {
                return Ok(());
            }
            if started.elapsed() >= timeout {
                return Err(StoreError::Timeout {
                    op: "wait",
                    keys: owned(keys),
                    missing: missing.iter().map(|&i| keys[i].to_owned()).collect(),
                    waited: started.elapsed(),
                });
            }
            tokio::time::sleep(POLL.min(timeout.saturating_sub(started.elapsed()))).await;
        }
    }

    async fn check(&self, keys: &[&str]) -> Result<bool> {
        let wire: Vec<Vec<u8>> = keys.iter().map(|k| user_key(k)).collect();
        Ok(self.run(move |s| s.missing(&wire)).await?.is_empty())
    }

    async fn delete_key(&self, key: &str) -> Result<bool> {
        let k = user_key(key);
        self.run(move |s| s.delete(&k)).await
    }

    async fn num_keys(&self) -> Result<i64> {
        self.run(|s| s.read(|c| c.map.len() as i64)).await
    }

    async fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>> {
        self.wait(keys).await?;
        let wire: Vec<Vec<u8>> = keys.iter().map(|k| user_key(k)).collect();
        self.run(move |s| {
            s.read(|c| {
                wire.iter()
                    .map(|k| c.map.get(k).cloned().unwrap_or_default())
                    .collect()
            })
        })
        .await
    }

    async fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<()> {
        let pairs: Vec<(Vec<u8>, Vec<u8>)> = pairs
            .iter()
            .map(|(k, v)| (user_key(k), v.to_vec()))
            .collect();
        self.run(move |s| s.multi_set(&pairs)).await
    }

    async fn append(&self, key: &str, value: &[u8]) -> Result<()> {
        let (k, v) = (user_key(key), value.to_vec());
        self.run(move |s| s.append_value(&k, &v)).await
    }

    async fn list_keys(&self) -> Result<Vec<String>> {
        self.run(|s| {
            s.read(|c| {
                c.map
                    .keys()
                    .filter_map(|k| k.strip_prefix(b"/"))
                    .map(|k| String::from_utf8_lossy(k).into_owned())
                    .collect()
            })
        })
        .await
    }

    async fn queue_push(&self, _key: &str, _value: &[u8]) -> Result<()> {
        Err(StoreError::Unsupported {
            op: "queue_push",
            backend: "file",
        })
    }

    async fn queue_pop(&self, _key: &str, _block: bool) -> Result<Vec<u8>> {
        Err(StoreError::Unsupported {
            op: "queue_pop",
            backend: "file",
        })
    }

    async fn queue_len(&self, _key: &str) -> Result<i64> {
        Err(StoreError::Unsupported {
            op: "queue_len",
            backend: "file",
        })
    }

    fn timeout(&self) -> Duration {
        self.inner.timeout.get()
    }

    fn set_timeout(&self, timeout: Duration) {
        self.inner.timeout.set(timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A write to a store whose directory is gone fails at once. It waited
    /// for the whole store timeout (30 min by default) for the file to
    /// appear; the store's drop does such a write (its reference count), and
    /// a drop that raced the directory's removal stalled the async task that
    /// dropped it, and a test's runtime with it.
    #[test]
    fn a_write_where_the_directory_is_gone_fails_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileStore::open_blocking(dir.path().join("s"), 2).unwrap();
        store.set_timeout(Duration::from_secs(600));
        drop(dir);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let r = store.inner.add(&user_key("k"), 1);
            let _ = tx.send(r.is_err());
        });
        // A hang detector, not a timing figure: the write takes microseconds.
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(60)),
            Ok(true),
            "the write waited for a file in a directory that is gone"
        );
    }

    #[test]
    fn records_match_pytorch_layout() {
        let mut b = Vec::new();
        encode_record(&mut b, b"refcount/", b"1");
        encode_record(&mut b, b"-/a", b"");
        let mut want = Vec::new();
        want.extend_from_slice(&9u32.to_le_bytes());
        want.extend_from_slice(b"refcount/");
        want.extend_from_slice(&1u32.to_le_bytes());
        want.extend_from_slice(b"1");
        want.extend_from_slice(&3u32.to_le_bytes());
        want.extend_from_slice(b"-/a");
        want.extend_from_slice(&0u32.to_le_bytes());
        assert_eq!(b, want);
    }

    proptest! {
        #[test]
        fn record_decoder_round_trips_and_never_panics(
            recs in proptest::collection::vec((proptest::collection::vec(any::<u8>(), 0..16),
                                               proptest::collection::vec(any::<u8>(), 0..16)), 0..8),
            junk in proptest::collection::vec(any::<u8>(), 0..40),
        ) {
            let mut b = Vec::new();
            for (k, v) in &recs { encode_record(&mut b, k, v); }
            let mut got = Vec::new();
            prop_assert_eq!(decode_records(&b, |k, v| got.push((k.to_vec(), v.to_vec()))), Ok(b.len()));
            prop_assert_eq!(got, recs);
            // Arbitrary bytes: either whole records or an error with an offset inside.
            match decode_records(&junk, |_, _| {}) {
                Ok(n) => prop_assert_eq!(n, junk.len()),
                Err((at, _)) => prop_assert!(at < junk.len()),
            }
        }
    }
}
