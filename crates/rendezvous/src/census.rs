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
//! A node found dead may only have been partitioned for a keep-alive expiry:
//! it is alive, its workers may still run, it may join a later round, and it
//! leaves some day. Counted dead *and* gone, `remaining` would reach 0 one
//! node early and a host could take its store down under a running node. So
//! each member's count-out has one owner per round, decided by one key
//! (`r<round>/census/<rank>`, bumped by whoever comes first): the watcher
//! that finds it dead counts it dead only if first; the member claims the
//! key itself ([`Standing::reconcile`]) when its beats reach the store
//! again after failing, as it joins a later round, and as it leaves, and if
//! a watcher was first it counts itself in again. So at any time a live
//! member that can reach the store is counted in exactly once, and every
//! member is counted out at most once per time it was counted in. (A member
//! that claimed its key is never counted dead in that round: if it dies
//! later, nobody counts it out, and the host waits for [`Pulse`], as for a
//! node that vanished unwatched: longer, never shorter.) A node that
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

/// The key that decides who counts member `rank` of `round` out when it is
/// found dead (see the module doc).
fn census_key(round: u64, rank: usize) -> String {
    format!("r{round}/census/{rank}")
}

/// Counts member `rank` of `round`, found dead by a watcher, out of the run:
/// unless another watcher, or the member itself, came first.
pub(crate) async fn found_dead(
    store: &dyn Store,
    round: u64,
    rank: usize,
) -> Result<(), StoreError> {
    if store.add(&census_key(round, rank), 1).await? == 1 {
        store.add(DEAD, 1).await?;
    }
    Ok(())
}

/// A member's standing in the census in one round (shared by its keep-alive
/// and its leave): whether it has claimed its count-out key, and whether a
/// watcher, first, had counted it dead.
#[derive(Debug)]
pub(crate) struct Standing {
    round: u64,
    rank: usize,
    claim: tokio::sync::Mutex<Claim>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Claim {
    /// Not claimed: a watcher may still count it dead.
    Open,
    /// Claimed after a watcher counted it dead; to count in again.
    CountedDead,
    /// Claimed; counted in.
    In,
}

impl Standing {
    pub(crate) fn new(round: u64, rank: usize) -> std::sync::Arc<Standing> {
        std::sync::Arc::new(Standing {
            round,
            rank,
            claim: tokio::sync::Mutex::new(Claim::Open),
        })
    }

    /// Claims the member's count-out key, if not yet, and counts it in again
    /// if a watcher had counted it dead. From then on no watcher counts it
    /// dead in this round. A call cut short is taken up where it stopped; one
    /// whose claim reached the store but whose answer was lost reads the key
    /// at 2 on its retry and counts the member in once more: too many in, so
    /// a host waits longer, never shorter.
    pub(crate) async fn reconcile(&self, store: &dyn Store) -> Result<(), StoreError> {
        let mut c = self.claim.lock().await;
        if *c == Claim::Open {
            let first = store.add(&census_key(self.round, self.rank), 1).await? == 1;
            *c = if first { Claim::In } else { Claim::CountedDead };
        }
        if *c == Claim::CountedDead {
            joined(store).await?;
            *c = Claim::In;
        }
        Ok(())
    }
}

/// What the census reads: nodes still running besides this one, and how many
/// nodes were ever counted dead.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Count {
    pub running: usize,
    pub dead: i64,
}

/// The census; `counted_in`: this node counted itself joined and not yet
/// gone.
pub(crate) async fn remaining(store: &dyn Store, counted_in: bool) -> Result<Count, StoreError> {
    // `joined` last: a node joining and leaving between the reads can only
    // make this too large (a longer wait), never too small.
    let gone = store.add(GONE, 0).await?;
    let dead = store.add(DEAD, 0).await?;
    let joined = store.add(JOINED, 0).await?;
    Ok(Count {
        running: (joined - gone - dead - i64::from(counted_in)).max(0) as usize,
        dead,
    })
}

/// A census of 0 while some node was counted dead is believed only once it
/// has held for two keep-alive intervals: a node found dead while only cut
/// off counts itself back in at its first beat back, within an interval of
/// the partition's end, and a host that left in between would leave it
/// without its store (found by the agent simulator, seed 51450).
#[derive(Debug, Default)]
pub(crate) struct Zero {
    since: Option<std::time::Instant>,
}

impl Zero {
    /// Nodes to wait for: the census's count, or 1 while its 0 is not yet
    /// believed.
    pub(crate) fn hold(&mut self, c: Count, interval: std::time::Duration) -> usize {
        if c.running > 0 || c.dead == 0 {
            self.since = None;
            return c.running;
        }
        let since = *self.since.get_or_insert_with(std::time::Instant::now);
        usize::from(since.elapsed() < 2 * interval)
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_zero_with_nodes_counted_dead_is_believed_only_once_it_held() {
        let hour = Duration::from_secs(3600);
        let mut z = Zero::default();
        let c = |running, dead| Count { running, dead };
        assert_eq!(
            z.hold(c(0, 0), hour),
            0,
            "nobody counted dead: believed at once"
        );
        assert_eq!(z.hold(c(2, 1), hour), 2);
        assert_eq!(z.hold(c(0, 1), hour), 1, "someone counted dead: not yet");
        assert_eq!(z.hold(c(0, 1), hour), 1);
        assert_eq!(z.hold(c(0, 1), Duration::ZERO), 0, "held for two intervals");
        // A count above 0 starts it over.
        assert_eq!(z.hold(c(1, 1), Duration::ZERO), 1);
        assert_eq!(z.hold(c(0, 1), hour), 1);
    }
}
