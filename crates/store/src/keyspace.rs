//! The keyspace: keys, queues and the waiters blocked on them.
//!
//! This is the state both the TCP server and [`MemoryStore`](crate::MemoryStore)
//! hold behind one mutex. It does no I/O: an operation mutates the maps and, when a
//! key appears, fires the waiters registered on it by bumping their [`Signal`]. The
//! owner of a signal (a server connection, or a task blocked in a memory-store wait)
//! then reports the completion itself.
//!
//! Waiting follows PyTorch's servers: a `WAIT` counts the keys missing *at
//! registration* (duplicates count twice) and completes when each has been written
//! once after that — a key deleted meanwhile still needs a write. Unlike PyTorch's
//! libuv server, a failed `compare_set` never wakes anyone, and unlike its legacy
//! server, a `compare_set` that creates or changes a key always does.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::Notify;

/// How a waiter learns that one of its waits completed. `fired` counts completions
/// not yet reported; the owner swaps it to zero and reports that many.
#[derive(Debug, Default)]
pub struct Signal {
    fired: AtomicU32,
    notify: Notify,
}

impl Signal {
    pub fn new() -> Arc<Self> {
        Arc::new(Signal::default())
    }

    /// Takes the completions fired since the last call.
    pub fn take(&self) -> u32 {
        self.fired.swap(0, Ordering::AcqRel)
    }

    /// Resolves once a completion has been fired (or immediately, if one was fired
    /// since the last wake-up was consumed).
    pub async fn notified(&self) {
        self.notify.notified().await
    }

    fn fire(&self) {
        self.fired.fetch_add(1, Ordering::AcqRel);
        self.notify.notify_one();
    }
}

/// Identifies one registered wait.
pub type WaiterId = u64;

/// A registered wait.
struct Waiter {
    /// Registrations still outstanding (missing keys, counting duplicates).
    remaining: u32,
    /// The keys it is registered on, so a cancel can find it.
    keys: Vec<Vec<u8>>,
    signal: Arc<Signal>,
}

/// The outcome of starting a wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitStart {
    /// Every key already exists; nothing was registered.
    Ready,
    /// Registered; the signal fires when it completes.
    Pending(WaiterId),
}

/// Why an `ADD` or `BARRIER` could not update a counter.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CounterError {
    #[error("value is not a decimal integer: {0:?}")]
    NotANumber(String),
    #[error("counter overflows a 64-bit integer")]
    Overflow,
}

/// A value grew past the configured limit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("value would grow to {len} bytes, over the limit of {max}")]
pub struct ValueTooLarge {
    pub len: u64,
    pub max: u64,
}

/// Keys, queues and waiters. Not synchronised: the owner wraps it in a mutex.
#[derive(Default)]
pub struct Keyspace {
    data: HashMap<Vec<u8>, Bytes>,
    queues: HashMap<Vec<u8>, VecDeque<Bytes>>,
    /// Key → waiters registered on it, in registration order, with multiplicity.
    waiting: HashMap<Vec<u8>, BTreeMap<WaiterId, u32>>,
    waiters: HashMap<WaiterId, Waiter>,
    next_waiter: WaiterId,
}

/// Parses a counter the way C's `stoll` does, which is what PyTorch's servers use:
/// leading white space skipped, an optional sign, then digits; anything after the
/// digits is ignored. No digits, or a value outside `i64`, is an error.
pub fn parse_counter(v: &[u8]) -> Result<i64, CounterError> {
    let not_a_number = || CounterError::NotANumber(String::from_utf8_lossy(v).into_owned());
    let mut i = 0;
    while i < v.len() && matches!(v[i], b' ' | b'\t' | b'\n' | b'\x0b' | b'\x0c' | b'\r') {
        i += 1;
    }
    let negative = match v.get(i) {
        Some(b'-') => {
            i += 1;
            true
        }
        Some(b'+') => {
            i += 1;
            false
        }
        _ => false,
    };
    let start = i;
    let mut n: i64 = 0;
    while let Some(d) = v.get(i).filter(|d| d.is_ascii_digit()) {
        let d = i64::from(d - b'0');
        n = n
            .checked_mul(10)
            .and_then(|n| {
                if negative {
                    n.checked_sub(d)
                } else {
                    n.checked_add(d)
                }
            })
            .ok_or(CounterError::Overflow)?;
        i += 1;
    }
    if i == start {
        return Err(not_a_number());
    }
    Ok(n)
}

impl Keyspace {
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether `key` counts as present for CHECK and WAIT: a value, or a non-empty
    /// queue (so a blocking `queue_pop` can wait on the queue's name).
    fn exists(&self, key: &[u8]) -> bool {
        self.data.contains_key(key) || self.queues.get(key).is_some_and(|q| !q.is_empty())
    }

    pub fn set(&mut self, key: &[u8], value: Bytes) {
        self.data.insert(key.to_vec(), value);
        self.wake_all(key);
    }

    pub fn get(&self, key: &[u8]) -> Option<Bytes> {
        self.data.get(key).cloned()
    }

    pub fn add(&mut self, key: &[u8], delta: i64) -> Result<i64, CounterError> {
        let old = match self.data.get(key) {
            Some(v) => parse_counter(v)?,
            None => 0,
        };
        let new = old.checked_add(delta).ok_or(CounterError::Overflow)?;
        self.data
            .insert(key.to_vec(), Bytes::from(new.to_string().into_bytes()));
        self.wake_all(key);
        Ok(new)
    }

    /// PyTorch's compare-and-set, including its reply for a missing key with a
    /// non-empty `expected` (it returns `expected` and stores nothing).
    pub fn compare_set(&mut self, key: &[u8], expected: &[u8], desired: &[u8]) -> Bytes {
        match self.data.get(key) {
            None if expected.is_empty() => {
                let v = Bytes::copy_from_slice(desired);
                self.set(key, v.clone());
                v
            }
            None => Bytes::copy_from_slice(expected),
            Some(cur) if cur.as_ref() == expected => {
                let v = Bytes::copy_from_slice(desired);
                self.set(key, v.clone());
                v
            }
            Some(cur) => cur.clone(),
        }
    }

    pub fn check(&self, keys: &[&[u8]]) -> bool {
        keys.iter().all(|k| self.exists(k))
    }

    pub fn num_keys(&self) -> i64 {
        self.data.len() as i64
    }

    pub fn delete(&mut self, key: &[u8]) -> bool {
        self.data.remove(key).is_some()
    }

    pub fn append(&mut self, key: &[u8], value: &[u8], max: u64) -> Result<(), ValueTooLarge> {
        let cur = self.data.remove(key).unwrap_or_default();
        let len = (cur.len() + value.len()) as u64;
        if len > max {
            self.data.insert(key.to_vec(), cur);
            return Err(ValueTooLarge { len, max });
        }
        // Extend in place when nobody else holds the bytes, so repeated appends
        // are amortised O(1) per byte rather than a copy of the whole value.
        let mut buf = cur.try_into_mut().unwrap_or_else(|b| b.as_ref().into());
        buf.extend_from_slice(value);
        self.data.insert(key.to_vec(), buf.freeze());
        self.wake_all(key);
        Ok(())
    }

    pub fn multi_get(&self, keys: &[&[u8]]) -> Vec<Option<Bytes>> {
        keys.iter().map(|k| self.get(k)).collect()
    }

    pub fn list_keys(&self) -> Vec<Vec<u8>> {
        self.data.keys().cloned().collect()
    }

    pub fn queue_push(&mut self, key: &[u8], value: Bytes) {
        self.queues
            .entry(key.to_vec())
            .or_default()
            .push_back(value);
        self.wake_one(key);
    }

    /// Pops the front of a queue: the length before the pop and the item.
    pub fn queue_pop(&mut self, key: &[u8]) -> (i64, Option<Bytes>) {
        let Some(q) = self.queues.get_mut(key) else {
            return (0, None);
        };
        let len = q.len() as i64;
        let item = q.pop_front();
        if q.is_empty() {
            self.queues.remove(key);
        }
        (len, item)
    }

    pub fn queue_len(&self, key: &[u8]) -> i64 {
        self.queues.get(key).map_or(0, |q| q.len() as i64)
    }

    /// Starts a wait for `keys`: ready at once if all exist, else registered on the
    /// missing ones with `signal` to fire on completion.
    pub fn wait(&mut self, keys: &[&[u8]], signal: &Arc<Signal>) -> WaitStart {
        let missing: Vec<&[u8]> = keys.iter().copied().filter(|k| !self.exists(k)).collect();
        if missing.is_empty() {
            return WaitStart::Ready;
        }
        WaitStart::Pending(self.register(&missing, signal))
    }

    fn register(&mut self, missing: &[&[u8]], signal: &Arc<Signal>) -> WaiterId {
        let id = self.next_waiter;
        self.next_waiter += 1;
        let mut keys: Vec<Vec<u8>> = Vec::with_capacity(missing.len());
        for k in missing {
            *self
                .waiting
                .entry(k.to_vec())
                .or_default()
                .entry(id)
                .or_insert(0) += 1;
            if !keys.iter().any(|have| have == k) {
                keys.push(k.to_vec());
            }
        }
        self.waiters.insert(
            id,
            Waiter {
                remaining: missing.len() as u32,
                keys,
                signal: signal.clone(),
            },
        );
        id
    }

    /// Removes registered waits that have not completed. Ids that already completed
    /// (or never existed) are ignored, so a caller may pass every id it started.
    pub fn cancel(&mut self, ids: &[WaiterId]) {
        for id in ids {
            let Some(w) = self.waiters.remove(id) else {
                continue;
            };
            for k in &w.keys {
                if let Some(list) = self.waiting.get_mut(k.as_slice()) {
                    list.remove(id);
                    if list.is_empty() {
                        self.waiting.remove(k.as_slice());
                    }
                }
            }
        }
    }

    /// Whether a wait is still registered (it has neither completed nor been cancelled).
    pub fn is_pending(&self, id: WaiterId) -> bool {
        self.waiters.contains_key(&id)
    }

    /// PyTorch's BARRIER command: count one arrival at `key`; when the count reaches
    /// `world_size` every waiter on the key is released, else this caller waits.
    pub fn barrier(
        &mut self,
        key: &[u8],
        world_size: i64,
        signal: &Arc<Signal>,
    ) -> Result<WaitStart, CounterError> {
        // Count without waking: only the arrival that fills the barrier releases.
        let old = match self.data.get(key) {
            Some(v) => parse_counter(v)?,
            None => 0,
        };
        let count = old.checked_add(1).ok_or(CounterError::Overflow)?;
        self.data
            .insert(key.to_vec(), Bytes::from(count.to_string().into_bytes()));
        if count >= world_size {
            self.wake_all(key);
            return Ok(WaitStart::Ready);
        }
        Ok(WaitStart::Pending(self.register(&[key], signal)))
    }

    /// A key was written: every waiter on it has one (or more) fewer keys to see.
    fn wake_all(&mut self, key: &[u8]) {
        let Some(list) = self.waiting.remove(key) else {
            return;
        };
        for (id, times) in list {
            self.settle(id, key, times);
        }
    }

    /// A queue item arrived: release the first waiter for which this was the last
    /// missing key. Waiters that still miss other keys see this one as present.
    fn wake_one(&mut self, key: &[u8]) {
        let Some(list) = self.waiting.get_mut(key) else {
            return;
        };
        let mut taken = Vec::new();
        for (&id, &times) in list.iter() {
            let last = self.waiters.get(&id).is_some_and(|w| w.remaining <= times);
            taken.push((id, times));
            if last {
                break;
            }
        }
        for (id, _) in &taken {
            list.remove(id);
        }
        if list.is_empty() {
            self.waiting.remove(key);
        }
        for (id, times) in taken {
            self.settle(id, key, times);
        }
    }

    /// Counts `times` registrations of waiter `id` on `key` as seen; fires the waiter
    /// if that was its last.
    fn settle(&mut self, id: WaiterId, key: &[u8], times: u32) {
        let Some(w) = self.waiters.get_mut(&id) else {
            return;
        };
        w.remaining = w.remaining.saturating_sub(times);
        w.keys.retain(|k| k.as_slice() != key);
        if w.remaining == 0 {
            if let Some(w) = self.waiters.remove(&id) {
                w.signal.fire();
            }
        }
    }

    /// Number of registered waits, for tests and stats.
    pub fn pending_waits(&self) -> usize {
        self.waiters.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(s: &str) -> Bytes {
        Bytes::copy_from_slice(s.as_bytes())
    }

    #[test]
    fn counters_parse_like_stoll() {
        assert_eq!(parse_counter(b" 12xyz"), Ok(12));
        assert_eq!(parse_counter(b"\t-3"), Ok(-3));
        assert_eq!(parse_counter(b"+7"), Ok(7));
        assert_eq!(parse_counter(b"-9223372036854775808"), Ok(i64::MIN));
        assert_eq!(
            parse_counter(b"9223372036854775808"),
            Err(CounterError::Overflow)
        );
        assert!(matches!(
            parse_counter(b""),
            Err(CounterError::NotANumber(_))
        ));
        assert!(matches!(
            parse_counter(b"abc"),
            Err(CounterError::NotANumber(_))
        ));
        assert!(matches!(
            parse_counter(b"-"),
            Err(CounterError::NotANumber(_))
        ));
    }

    #[test]
    fn add_stores_decimal_and_keeps_junk_semantics() {
        let mut ks = Keyspace::new();
        ks.set(b"/c", b(" 12xyz"));
        assert_eq!(ks.add(b"/c", 1), Ok(13));
        assert_eq!(ks.get(b"/c"), Some(b("13")));
        assert_eq!(ks.add(b"/new", -2), Ok(-2));
        ks.set(b"/x", b("nope"));
        assert!(ks.add(b"/x", 1).is_err());
        assert_eq!(
            ks.get(b"/x"),
            Some(b("nope")),
            "a failed add leaves the value"
        );
        ks.set(b"/max", b(&i64::MAX.to_string()));
        assert_eq!(ks.add(b"/max", 1), Err(CounterError::Overflow));
    }

    #[test]
    fn compare_set_follows_pytorch() {
        let mut ks = Keyspace::new();
        // Missing key, non-empty expected: replies expected, stores nothing.
        assert_eq!(ks.compare_set(b"/k", b"x", b"y"), b("x"));
        assert!(ks.get(b"/k").is_none());
        // Missing key, empty expected: creates.
        assert_eq!(ks.compare_set(b"/k", b"", b"v1"), b("v1"));
        // Match: replaces. Mismatch: replies current.
        assert_eq!(ks.compare_set(b"/k", b"v1", b"v2"), b("v2"));
        assert_eq!(ks.compare_set(b"/k", b"zz", b"v3"), b("v2"));
        assert_eq!(ks.get(b"/k"), Some(b("v2")));
    }

    #[test]
    fn waits_count_missing_keys_and_fire_once() {
        let mut ks = Keyspace::new();
        let s = Signal::new();
        ks.set(b"/a", b("1"));
        assert_eq!(ks.wait(&[b"/a"], &s), WaitStart::Ready);
        assert_eq!(ks.wait(&[], &s), WaitStart::Ready);
        let WaitStart::Pending(id) = ks.wait(&[b"/a", b"/b", b"/c"], &s) else {
            panic!()
        };
        ks.set(b"/b", b("1"));
        assert_eq!(s.take(), 0);
        // A failed compare_set on a missing key must not wake anyone.
        ks.compare_set(b"/c", b"x", b"y");
        assert_eq!(s.take(), 0);
        ks.compare_set(b"/c", b"", b"y");
        assert_eq!(s.take(), 1);
        assert!(!ks.is_pending(id));
        assert_eq!(ks.pending_waits(), 0);
        assert!(ks.waiting.is_empty());
    }

    #[test]
    fn duplicate_keys_count_twice_and_a_write_settles_both() {
        let mut ks = Keyspace::new();
        let s = Signal::new();
        assert!(matches!(
            ks.wait(&[b"/d", b"/d"], &s),
            WaitStart::Pending(_)
        ));
        ks.append(b"/d", b"x", 100).unwrap();
        assert_eq!(s.take(), 1);
    }

    #[test]
    fn cancel_unregisters_everywhere() {
        let mut ks = Keyspace::new();
        let s = Signal::new();
        let WaitStart::Pending(id) = ks.wait(&[b"/a", b"/b"], &s) else {
            panic!()
        };
        ks.cancel(&[id, 999]);
        ks.set(b"/a", b("1"));
        ks.set(b"/b", b("1"));
        assert_eq!(s.take(), 0);
        assert!(ks.waiting.is_empty() && ks.waiters.is_empty());
    }

    #[test]
    fn queue_push_wakes_one_waiter_in_order() {
        let mut ks = Keyspace::new();
        let (s1, s2) = (Signal::new(), Signal::new());
        ks.wait(&[b"/q"], &s1);
        ks.wait(&[b"/q"], &s2);
        ks.queue_push(b"/q", b("item1"));
        assert_eq!((s1.take(), s2.take()), (1, 0));
        assert!(ks.check(&[b"/q"]), "a non-empty queue counts as present");
        assert_eq!(ks.queue_pop(b"/q"), (1, Some(b("item1"))));
        assert!(!ks.check(&[b"/q"]));
        ks.queue_push(b"/q", b("item2"));
        assert_eq!((s1.take(), s2.take()), (0, 1));
        assert_eq!(ks.queue_pop(b"/none"), (0, None));
        assert_eq!(ks.num_keys(), 0, "queues are not keys");
    }

    #[test]
    fn barrier_releases_everyone_at_world_size() {
        let mut ks = Keyspace::new();
        let (s1, s2) = (Signal::new(), Signal::new());
        assert!(matches!(
            ks.barrier(b"/bar", 3, &s1),
            Ok(WaitStart::Pending(_))
        ));
        assert!(matches!(
            ks.barrier(b"/bar", 3, &s2),
            Ok(WaitStart::Pending(_))
        ));
        assert_eq!(ks.barrier(b"/bar", 3, &Signal::new()), Ok(WaitStart::Ready));
        assert_eq!((s1.take(), s2.take()), (1, 1));
        assert_eq!(ks.get(b"/bar"), Some(b("3")));
    }

    #[test]
    fn append_respects_the_value_limit() {
        let mut ks = Keyspace::new();
        ks.append(b"/a", b"12345", 8).unwrap();
        assert_eq!(
            ks.append(b"/a", b"6789", 8),
            Err(ValueTooLarge { len: 9, max: 8 })
        );
        assert_eq!(ks.get(b"/a"), Some(b("12345")));
    }
}
