//! How many nodes of a run still run, for a node that serves a store the others
//! use and must not take it down under them.
//!
//! Three counters in the rendezvous store, each bumped once per node: a node
//! is counted *joined* when it first becomes a member of a round (a `static`
//! node counts itself; in a dynamic round, arrival 1 counts every member not
//! counted before, from a table of the run's node ids that it alone reads and
//! writes, so a round costs one count, not one per node; a table entry lost
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
/// The node ids counted joined so far (dynamic rounds), one per line.
const IDS: &str = "nodes/ids";

/// Counts this node in (once, at its first round).
pub(crate) async fn joined(store: &dyn Store) -> Result<(), StoreError> {
    store.add(JOINED, 1).await.map(drop)
}

/// Counts in those of `members` (node ids) not counted before; arrival 1 of
/// a round, before the round's ranks are published.
pub(crate) async fn joined_members(
    store: &dyn Store,
    members: &[String],
) -> Result<(), StoreError> {
    let table = store.get_now(IDS).await?;
    let known: std::collections::HashSet<&[u8]> = table.split(|&b| b == b'\n').collect();
    let mut new = Vec::new();
    for m in members.iter().filter(|m| !known.contains(m.as_bytes())) {
        new.extend_from_slice(m.as_bytes());
        new.push(b'\n');
    }
    let count = new.iter().filter(|&&b| b == b'\n').count();
    if count == 0 {
        return Ok(());
    }
    // Counted first: a crash between the two counts a node twice later (a
    // longer wait), never not at all.
    store.add(JOINED, count as i64).await?;
    store.append(IDS, &new).await
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
