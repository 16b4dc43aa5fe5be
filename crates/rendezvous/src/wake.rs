//! Waking the members of a round when it changes, so that nobody polls.
//!
//! Whoever changes a round in a way its members must act on (a node waiting
//! to join, a member found dead, a member coming back) writes the change, then
//! counts a wake: `ADD <r>/wakes 1` gives it the number `n`, and it sets
//! `<r>/wake/<n>`. A member that has acted on every wake up to `seen` blocks in
//! one store `WAIT` on `<r>/wake/<seen+1>`; woken, it reads the count and acts
//! once for every wake so far. The change is written before the count and the
//! count before the key, so a member that reads the count after a wake also
//! reads the change. At steady state a member costs no store operation: its
//! `WAIT` sits on the server until something happens.
//!
//! A store that stops answering wakes nobody. The keep-alive notices it (a
//! beat fails or takes longer than an interval) and reports it through
//! [`Health`], which ends the wait with that error.

use std::sync::Arc;
use std::time::Duration;

use rallypoint_store::{Store, StoreError};

/// How long a member waits in one `WAIT`: as long as the run lasts (a store
/// that stops answering is noticed by [`Health`], not by this timeout).
const FOREVER: Duration = Duration::from_secs(365 * 24 * 3600);

fn count_key(round: &str) -> String {
    format!("{round}/wakes")
}

fn wake_key(round: &str, n: u64) -> String {
    format!("{round}/wake/{n}")
}

/// Wakes every member of round `round` (`r<round>`) waiting in [`wait`].
pub(crate) async fn wake(store: &dyn Store, round: &str) -> Result<(), StoreError> {
    let n = store.add(&count_key(round), 1).await?;
    store.set(&wake_key(round, n.max(0) as u64), b"1").await
}

/// Waits until round `round` was woken after wake `seen` (0 at first), and
/// returns the wakes so far; fails when the store does not answer, or when
/// `health` reports a failed beat meanwhile.
pub(crate) async fn wait(
    store: &dyn Store,
    round: &str,
    seen: u64,
    health: &Health,
) -> Result<u64, String> {
    let mut beats = health.0.subscribe();
    beats.mark_unchanged();
    let now = store
        .add(&count_key(round), 0)
        .await
        .map_err(|e| e.to_string())?
        .max(0) as u64;
    if now > seen {
        return Ok(now);
    }
    let key = wake_key(round, seen + 1);
    let keys = [key.as_str()];
    tokio::select! {
        woken = store.wait_timeout(&keys, FOREVER) => match woken {
            Ok(()) => Ok(seen + 1),
            Err(e) => Err(e.to_string()),
        },
        failed = beat_failed(&mut beats) => Err(failed),
    }
}

/// The next failed beat reported after the subscription.
async fn beat_failed(beats: &mut tokio::sync::watch::Receiver<Option<String>>) -> String {
    loop {
        if beats.changed().await.is_err() {
            // The keep-alive is gone (the round ended): nothing to report.
            return std::future::pending().await;
        }
        if let Some(e) = beats.borrow_and_update().clone() {
            return e;
        }
    }
}

/// Whether this node's beats reach the store: the last beat's outcome.
#[derive(Clone)]
pub struct Health(Arc<tokio::sync::watch::Sender<Option<String>>>);

impl Default for Health {
    fn default() -> Self {
        Health(Arc::new(tokio::sync::watch::Sender::new(None)))
    }
}

impl Health {
    /// Records a beat: `Ok`, or why it failed.
    pub fn report(&self, beat: Result<(), String>) {
        let now = beat.err();
        self.0.send_if_modified(|v| {
            // Every failure is news (a waiter wakes on each); a success only
            // after a failure.
            let news = now.is_some() || v.is_some();
            *v = now;
            news
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rallypoint_store::MemoryStore;

    #[tokio::test]
    async fn a_wake_ends_the_wait_and_counts_once_for_all_wakes_so_far() {
        let store = MemoryStore::new();
        let health = Health::default();
        wake(&store, "r0").await.unwrap();
        wake(&store, "r0").await.unwrap();
        assert_eq!(wait(&store, "r0", 0, &health).await, Ok(2));
        let waiting = wait(&store, "r0", 2, &health);
        tokio::pin!(waiting);
        assert!(
            tokio::time::timeout(Duration::from_millis(50), &mut waiting)
                .await
                .is_err(),
            "no wake, no return"
        );
        wake(&store, "r0").await.unwrap();
        assert_eq!(waiting.await, Ok(3));
    }

    #[tokio::test]
    async fn a_failed_beat_ends_the_wait_with_its_error() {
        let store = MemoryStore::new();
        let health = Health::default();
        health.report(Err("old".into()));
        let waiting = wait(&store, "r0", 0, &health);
        tokio::pin!(waiting);
        // A failure reported before the wait began is not news.
        assert!(
            tokio::time::timeout(Duration::from_millis(50), &mut waiting)
                .await
                .is_err()
        );
        health.report(Ok(()));
        health.report(Err("no answer within 5s".into()));
        assert_eq!(waiting.await, Err("no answer within 5s".into()));
    }
}
