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
                while let Some(q) = shared.to_save() {
                    match etcd.save(lease, &q).await {
                        Ok(true) => shared.saved(q.id),
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
async fn campaign(etcd: &Etcd, shared: &Shared, me: &str) -> i64 {
    let mut told: Option<String> = None;
    loop {
        match etcd.campaign(me).await {
            Ok(Campaign::Won { lease }) => return lease,
            Ok(Campaign::Held { by, revision }) => {
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
