//! Store utilities of the elastic agent (PyTorch's
//! `torch/distributed/elastic/utils/store.py`), over any [`Store`].
//!
//! Key layout, identical to PyTorch's so mixed jobs interoperate:
//!
//! | key | written by | meaning |
//! |---|---|---|
//! | `{prefix}/num_members` | every rank, `add 1` | arrivals at the barrier |
//! | `{prefix}/last_member` | the `world_size`-th arrival | the barrier is full |
//! | `{prefix}{rank}/TRACE` | every rank, after a timeout | "I was here" |
//! | `{prefix}/TRACING_GATE` | rank 0, after probing | missing ranks are known |
//! | `{prefix}{rank}` | `synchronize`, each rank | that rank's data |
//! | `{prefix}/finished/...` | `get_all` | the barrier rank 0 leaves last through |
//!
//! Keys are never deleted, so each prefix is good for one barrier. Unlike PyTorch,
//! the barrier bounds its own waits instead of changing the store's timeout, so other
//! users of the same store object are unaffected.

use std::time::{Duration, Instant};

use crate::{Result, Store, StoreError};

const NUM_MEMBERS: &str = "/num_members";
const LAST_MEMBER: &str = "/last_member";
const TRACE: &str = "/TRACE";
const TRACING_GATE: &str = "/TRACING_GATE";
/// Most missing ranks a barrier timeout names.
pub const MAX_TRACE_MISSING_RANKS: usize = 16;

/// Restores a store's previous timeout when dropped; see [`store_timeout`].
#[must_use = "the timeout is restored when the guard is dropped"]
pub struct TimeoutGuard<'a, S: Store + ?Sized> {
    store: &'a S,
    previous: Duration,
}

impl<S: Store + ?Sized> Drop for TimeoutGuard<'_, S> {
    fn drop(&mut self) {
        self.store.set_timeout(self.previous);
    }
}

/// Sets `store`'s timeout until the returned guard is dropped (PyTorch's
/// `store_timeout` context manager). The change is visible to everyone sharing the
/// store object; pass explicit timeouts (e.g. [`Store::wait_timeout`]) to avoid that.
pub fn store_timeout<S: Store + ?Sized>(store: &S, timeout: Duration) -> TimeoutGuard<'_, S> {
    let previous = store.timeout();
    store.set_timeout(timeout);
    TimeoutGuard { store, previous }
}

/// Who is arriving at a barrier, so a timeout can name the ranks that never came.
pub struct RankTracing<'a> {
    pub rank: usize,
    /// Turns a rank into something meaningful (a host name, say).
    pub decoder: &'a (dyn Fn(usize) -> String + Sync),
    /// How long rank 0 waits for the first missing rank's trace.
    pub trace_timeout: Duration,
}

/// Counts this caller in; the `world_size`-th arrival sets the last-member key.
/// Returns the key to wait on.
async fn barrier_nonblocking<S: Store + ?Sized>(
    store: &S,
    world_size: usize,
    prefix: &str,
) -> Result<String> {
    let last = format!("{prefix}{LAST_MEMBER}");
    let arrived = store.add(&format!("{prefix}{NUM_MEMBERS}"), 1).await?;
    if arrived == world_size as i64 {
        store.set(&last, b"<val_ignored>").await?;
    }
    Ok(last)
}

/// Blocks until `world_size` callers have reached the barrier at `prefix`, or
/// `timeout` passes. With `tracing`, a timeout names up to
/// [`MAX_TRACE_MISSING_RANKS`] missing ranks: every rank leaves a trace, rank 0
/// probes for the others' traces and opens a gate, and the other ranks report that
/// rank 0 has the list. Single-use per prefix.
pub async fn barrier<S: Store + ?Sized>(
    store: &S,
    world_size: usize,
    prefix: &str,
    timeout: Duration,
    tracing: Option<RankTracing<'_>>,
) -> Result<()> {
    let started = Instant::now();
    let last = barrier_nonblocking(store, world_size, prefix).await?;
    match store.wait_timeout(&[&last], timeout).await {
        Ok(()) => return Ok(()),
        Err(e) if e.is_timeout() => {}
        Err(e) => return Err(e),
    }
    let Some(tracing) = tracing else {
        return Err(barrier_timeout(store, world_size, prefix, started, Vec::new(), None).await);
    };
    store
        .set(
            &format!("{prefix}{}{TRACE}", tracing.rank),
            b"<val_ignored>",
        )
        .await?;
    if tracing.rank == 0 {
        let mut missing = Vec::new();
        for i in 1..world_size {
            if missing.len() >= MAX_TRACE_MISSING_RANKS {
                break;
            }
            // After the first absentee, probe briefly: the rest have had their time.
            let probe = if missing.is_empty() {
                tracing.trace_timeout
            } else {
                Duration::from_millis(1)
            };
            let trace = format!("{prefix}{i}{TRACE}");
            if store.wait_timeout(&[&trace], probe).await.is_err() {
                missing.push((tracing.decoder)(i));
            }
        }
        store
            .set(&format!("{prefix}{TRACING_GATE}"), b"<val_ignored>")
            .await?;
        Err(barrier_timeout(store, world_size, prefix, started, missing, None).await)
    } else {
        let gate = format!("{prefix}{TRACING_GATE}");
        let wait = tracing.trace_timeout * (MAX_TRACE_MISSING_RANKS as u32 + 1);
        if store.wait_timeout(&[&gate], wait).await.is_err() {
            // Rank 0 itself may be what is missing: report the plain timeout.
            return Err(barrier_timeout(
                store,
                world_size,
                prefix,
                started,
                Vec::new(),
                Some(format!(
                    "rank 0 ({}) did not report missing ranks",
                    (tracing.decoder)(0)
                )),
            )
            .await);
        }
        let note = format!(
            "check rank 0 ({}) for missing rank info",
            (tracing.decoder)(0)
        );
        Err(barrier_timeout(store, world_size, prefix, started, Vec::new(), Some(note)).await)
    }
}

async fn barrier_timeout<S: Store + ?Sized>(
    store: &S,
    world_size: usize,
    prefix: &str,
    started: Instant,
    missing: Vec<String>,
    tracing_note: Option<String>,
) -> StoreError {
    let arrived = store
        .add(&format!("{prefix}{NUM_MEMBERS}"), 0)
        .await
        .unwrap_or(-1);
    StoreError::BarrierTimeout {
        prefix: prefix.to_owned(),
        waited: started.elapsed(),
        arrived,
        world_size,
        missing,
        tracing_note,
    }
}

/// Reads `{prefix}0 .. {prefix}{world_size-1}` in one `multi_get`, then passes a
/// barrier under `{prefix}/finished` that only rank 0 waits for, so rank 0 (which
/// usually hosts the store) leaves last.
pub async fn get_all<S: Store + ?Sized>(
    store: &S,
    rank: usize,
    prefix: &str,
    world_size: usize,
) -> Result<Vec<Vec<u8>>> {
    let keys: Vec<String> = (0..world_size).map(|i| format!("{prefix}{i}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let data = store.multi_get(&refs).await?;
    let last = barrier_nonblocking(store, world_size, &format!("{prefix}/finished")).await?;
    if rank == 0 {
        store.wait(&[&last]).await?;
    }
    Ok(data)
}

/// Publishes `data` as this rank's and returns every rank's, in rank order, waiting
/// up to `timeout` for the others.
pub async fn synchronize<S: Store + ?Sized>(
    store: &S,
    data: &[u8],
    rank: usize,
    world_size: usize,
    prefix: &str,
    timeout: Duration,
) -> Result<Vec<Vec<u8>>> {
    let _timeout = store_timeout(store, timeout);
    store.set(&format!("{prefix}{rank}"), data).await?;
    get_all(store, rank, prefix, world_size).await
}
