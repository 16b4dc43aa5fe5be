//! How many nodes of a run still run, for a node that serves a store the others
//! use and must not take it down under them.
//!
//! Three counters in the rendezvous store, each bumped once per node: a node
//! is counted *joined* when it first becomes a member of a round (a `static`
//! node counts itself; in a dynamic round, arrival 1 counts every member not
//! counted before, from the table of the run's nodes that it alone reads and
//! writes (the dynamic backend's `ranks` key), so a round costs one count, not
//! one per node; a table entry lost
//! to a crash only counts a node twice, which makes a host wait longer, never
//! shorter), and
//! *gone* when it leaves the run ([`RendezvousHandler::leave`], on every way
//! out: success, failure, signal); the keep-alive watcher of a node that
//! stopped without leaving counts it *dead*. What remains is
//! `joined - gone - dead`. Reading it costs three counter reads whatever the
//! number of nodes.
//!
//! A node marked dead that was only partitioned and later leaves is counted
//! twice, so `remaining` can reach 0 one node early; that node had already
//! been given up on by its round (which re-formed without it). A node that
//! vanished where nobody watched it (killed while joining, or in a round every
//! watcher of which had moved on) is never counted out: [`Pulse`] ends the
//! wait once no member the host could be waiting for beats any more.
//!
//! [`RendezvousHandler::leave`]: crate::RendezvousHandler::leave

use rallypoint_store::{Store, StoreError};

const JOINED: &str = "nodes/joined";
const GONE: &str = "nodes/gone";
const DEAD: &str = "nodes/dead";

/// Counts this node in (once, at its first round).
pub(crate) async fn joined(store: &dyn Store) -> Result<(), StoreError> {
    store.add(JOINED, 1).await.map(drop)
}

/// Counts `n` nodes in at once (arrival 1 of a dynamic round, for the members
/// its table of the run's nodes does not list yet).
pub(crate) async fn joined_many(store: &dyn Store, n: usize) -> Result<(), StoreError> {
    if n == 0 {
        return Ok(());
    }
    store.add(JOINED, n as i64).await.map(drop)
}

/// Counts this node out (once, as it leaves the run).
pub(crate) async fn gone(store: &dyn Store) -> Result<(), StoreError> {
    store.add(GONE, 1).await.map(drop)
}

/// Counts a node found dead by its watcher.
pub(crate) async fn dead(store: &dyn Store) -> Result<(), StoreError> {
    store.add(DEAD, 1).await.map(drop)
}

/// Nodes still running besides this one; `counted_in`: this node counted
/// itself joined and not yet gone.
pub(crate) async fn remaining(store: &dyn Store, counted_in: bool) -> Result<usize, StoreError> {
    // `joined` last: a node joining and leaving between the reads can only
    // make this too large (a longer wait), never too small.
    let gone = store.add(GONE, 0).await?;
    let dead = store.add(DEAD, 0).await?;
    let joined = store.add(JOINED, 0).await?;
    Ok((joined - gone - dead - i64::from(counted_in)).max(0) as usize)
}

/// Whether any of some heartbeat counters moved lately. The census cannot
/// count out a node that vanished where nobody watched it (killed while
/// joining, or in a round whose watchers had all moved on); a host waiting on
/// the census stops once no member it could be waiting for beats any more.
#[derive(Debug, Default)]
pub(crate) struct Pulse {
    seen: std::collections::BTreeMap<String, i64>,
    moved: Option<std::time::Instant>,
    read: Option<std::time::Instant>,
}

impl Pulse {
    /// Reads `keys` (at most once per `every`); true while one of them moved
    /// less than `expiry` ago (the first read counts as a move).
    pub(crate) async fn beating(
        &mut self,
        store: &dyn Store,
        keys: &[String],
        every: std::time::Duration,
        expiry: std::time::Duration,
    ) -> Result<bool, StoreError> {
        let now = std::time::Instant::now();
        if self.read.is_none_or(|t| now - t >= every) {
            self.read = Some(now);
            for k in keys {
                let v = store.add(k, 0).await?;
                if self.seen.insert(k.clone(), v) != Some(v) {
                    self.moved = Some(now);
                }
            }
        }
        Ok(self.moved.is_some_and(|t| now - t < expiry))
    }
}
