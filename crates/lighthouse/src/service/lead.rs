//! The lead task of a lighthouse with `--state etcd://` (the keys and the
//! rules: [`super::etcd`]): campaign, stand by while another leads, take
//! over when its lease expires, then keep the lease and save every quorum
//! with a new id before it is answered.
//!
//! It returns (why, in words) only when this lighthouse stops serving for
//! good: its lease lost, a save refused or unconfirmed. The service then
//! stops; a supervisor restarts it, as a standby if another took over.

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;

use super::etcd::{Campaign, Etcd};
use super::state::Shared;

/// The pause before campaigning again after etcd failed to answer.
const RETRY: Duration = Duration::from_millis(500);

/// Campaigns until it leads, then serves as the leader until it cannot.
/// `me` names this lighthouse in the leader key (its address and pid).
pub async fn lead(etcd: Etcd, shared: Arc<Shared>, me: String) -> String {
    let lease = campaign(&etcd, &shared, &me).await;
    let saved = match etcd.saved().await {
        Ok(s) => s,
        Err(e) => {
            etcd.resign(lease).await;
            shared.lost(&e);
            return e;
        }
    };
    let restored = saved.as_ref().map(|s| {
        let members: Vec<&str> = s
            .quorum
            .iter()
            .flat_map(|q| &q.participants)
            .map(|m| m.replica_id.as_str())
            .collect();
        format!("quorum {} of {members:?}", s.last_id)
    });
    let last_id = shared.lead(lease, saved);
    tracing::warn!(
        state = %etcd.url,
        lease = format!("{lease:x}"),
        restored = restored.as_deref().unwrap_or("nothing (a fresh prefix)"),
        last_id,
        "this lighthouse leads now"
    );
    let mut keeping = JoinSet::new();
    let keeper = etcd.clone();
    keeping.spawn(async move { keeper.keep(lease).await });
    loop {
        tokio::select! {
            why = keeping.join_next() => {
                let why = match why {
                    Some(Ok(why)) => why,
                    _ => "the lease's keep-alive task ended".to_owned(),
                };
                return stop(&shared, why);
            }
            () = shared.save_wanted() => {
                while let Some((n, q, aborted)) = shared.to_save() {
                    match etcd.save(lease, &q, aborted).await {
                        Ok(true) => shared.saved(n),
                        Ok(false) => {
                            let why = format!("deposed: lease {lease:x} no longer owns {}leader", etcd.url.prefix);
                            return stop(&shared, why);
                        }
                        Err(e) => return stop(&shared, format!("quorum {} could not be saved: {e}", q.id)),
                    }
                }
            }
        }
    }
}

fn stop(shared: &Shared, why: String) -> String {
    tracing::error!(why, "this lighthouse stops issuing quorums");
    shared.lost(&why);
    why
}

/// Campaigns until this lighthouse leads; its lease.
/// Whether the leader named `by` served at this lighthouse's own address on
/// this host (`me` and `by` read "ADDR on HOST (pid N)", whatever the pid: a
/// campaign this lighthouse wins returns, so a key held under its own name
/// is a predecessor's, which had the same pid in another pid namespace, or
/// is this process's in a test).
fn predecessor(by: &str, me: &str) -> bool {
    let place = |s: &str| s.rsplit_once(" (pid ").map(|(p, _)| p.to_owned());
    match (place(by), place(me)) {
        (Some(a), Some(b)) => a == b,
        _ => false,
    }
}

async fn campaign(etcd: &Etcd, shared: &Shared, me: &str) -> i64 {
    let mut told: Option<String> = None;
    loop {
        match etcd.campaign(me).await {
            Ok(Campaign::Won { lease }) => return lease,
            Ok(Campaign::Held { by, lease, .. }) if predecessor(&by, me) => {
                // Its address is ours now: it is gone (a listener holds its
                // port for as long as its process lives), so its lease need
                // not run out before this lighthouse leads.
                match etcd.revoke(lease).await {
                    Ok(()) => tracing::warn!(
                        predecessor = by,
                        "taking over at once from the lighthouse that served at this address before (its port is ours, so it is gone)"
                    ),
                    Err(e) => {
                        tracing::warn!("{e}; trying again in {RETRY:?}");
                        tokio::time::sleep(RETRY).await;
                    }
                }
            }
            Ok(Campaign::Held { by, revision, .. }) => {
                if told.as_deref() != Some(by.as_str()) {
                    tracing::warn!(
                        leader = by,
                        state = %etcd.url,
                        ttl = ?etcd.ttl,
                        "standing by: another lighthouse leads; taking over when its lease expires"
                    );
                    told = Some(by.clone());
                }
                shared.stand_by(by);
                // A watch bounded by one TTL: then campaign again anyway.
                if let Err(e) = etcd.vacated(revision, etcd.ttl).await {
                    tracing::warn!("standing by: {e}; trying again in {RETRY:?}");
                    tokio::time::sleep(RETRY).await;
                }
            }
            Err(e) => {
                tracing::warn!("campaign failed: {e}; trying again in {RETRY:?}");
                tokio::time::sleep(RETRY).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::predecessor;

    #[test]
    fn a_predecessor_is_the_same_address_and_host_under_another_pid() {
        let me = "10.0.0.1:29510 on node1 (pid 7)";
        assert!(predecessor("10.0.0.1:29510 on node1 (pid 6)", me));
        assert!(predecessor(me, me), "the same pid (another pid namespace)");
        assert!(
            !predecessor("10.0.0.1:29511 on node1 (pid 6)", me),
            "another port"
        );
        assert!(
            !predecessor("10.0.0.1:29510 on node2 (pid 6)", me),
            "another host"
        );
        assert!(!predecessor("(gone meanwhile)", me));
    }
}
