//! The `etcd` backend: the dynamic rendezvous on an etcd v3 server, for jobs that
//! outgrow one coordinator process.
//!
//! The protocol is the dynamic backend's ([`crate::dynamic`]), run over an
//! [`EtcdStore`], so both backends make the same decisions from the same keys. Two
//! things change:
//!
//! - **Liveness by leases.** Each member of a round puts `r<n>/alive/<rank>` under
//!   an etcd lease of `keep_alive_interval × keep_alive_max_attempt` seconds
//!   (etcd's minimum is 2 s) and refreshes the lease every interval. When a member
//!   dies its lease expires and etcd deletes the key; its predecessor, which
//!   watches that key, sees the delete event at once. Nobody polls.
//! - **Waits by watches.** Every store wait is an etcd watch from the revision of
//!   the read that found the key missing.
//!
//! Workers cannot speak etcd, so the job's store is hosted by worker 0 of the node
//! with rank 0 on a free port it publishes in the round
//! (`TORCHELASTIC_USE_AGENT_STORE=False`), as PyTorch's etcd backend does.
//!
//! Endpoint: `host:port` (default port 2379), or several separated by commas.
//! Options (`--rdzv-conf`): the dynamic backend's timing options, plus
//! `key_prefix` (default `/rallypoint/`), the etcd key prefix of everything
//! rallypoint writes. PyTorch's `etcd` backend speaks etcd's v2 API, which etcd
//! 3.4+ disables by default; this one speaks v3.

mod store;
pub mod testing;

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{EventType, PutOptions, WatchOptions};
use tokio::task::JoinHandle;
use tokio::time::Instant;

pub use store::EtcdStore;

use crate::api::Created;
use crate::api::{RendezvousError, RendezvousHandler, RendezvousParameters};
use crate::dynamic::{Beat, DynamicRendezvous, Keepalive, Timing};

/// Default etcd client port.
pub const DEFAULT_PORT: u16 = 2379;

/// Keeps a member alive with an etcd lease and watches its successor's lease key.
pub struct LeaseKeepalive {
    store: EtcdStore,
}

impl LeaseKeepalive {
    pub fn new(store: EtcdStore) -> Self {
        LeaseKeepalive { store }
    }
}

/// Revokes the lease when the keep-alive task ends (or is aborted), so a member
/// that leaves a round cleanly is not mistaken for a dead one a TTL later.
struct Revoke {
    client: etcd_client::Client,
    id: i64,
}

impl Drop for Revoke {
    fn drop(&mut self) {
        let mut client = self.client.clone();
        let id = self.id;
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let _ = client.lease_revoke(id).await;
            });
        }
    }
}

/// The lease TTL for `timing`, in whole seconds.
pub fn lease_ttl(timing: &Timing) -> i64 {
    let secs = (timing.keep_alive * timing.max_misses).as_secs_f64().ceil() as i64;
    secs.max(2)
}

/// Leaving ([`Beat::beating`] cleared) does not end the lease here: the key
/// stays until the agent shuts the handler down, and its predecessor reads the
/// `left` mark when it goes.
impl Keepalive for LeaseKeepalive {
    fn spawn(&self, beat: Beat) -> JoinHandle<()> {
        let store = self.store.clone();
        tokio::spawn(async move {
            if let Err(e) = keep_alive(&store, &beat).await {
                beat.health
                    .report(Err(format!("etcd keep-alive failed: {e}")));
                // Without our lease our predecessor will count us dead, and the
                // round re-forms: the safe outcome.
                tracing::warn!(error = %e, round = beat.round, rank = beat.rank, "etcd keep-alive failed");
                // This member is alive, and may run on (a run closed after
                // success does not re-form): once etcd answers, it counts
                // itself back into the census (see `census::Standing`).
                while beat.beating.load(std::sync::atomic::Ordering::Acquire) {
                    let r = tokio::time::timeout(
                        beat.timing.keep_alive,
                        beat.standing.reconcile(&*beat.store),
                    );
                    if matches!(r.await, Ok(Ok(()))) {
                        break;
                    }
                    tokio::time::sleep(beat.timing.keep_alive).await;
                }
            }
        })
    }
}

async fn keep_alive(store: &EtcdStore, beat: &Beat) -> Result<(), etcd_client::Error> {
    let mut client = store.client().clone();
    let ttl = lease_ttl(&beat.timing);
    let alive =
        |rank: usize| store.etcd_key(&format!("{}r{}/alive/{rank}", beat.namespace, beat.round));
    let id = client.lease_grant(ttl, None).await?.id();
    let _revoke = Revoke {
        client: client.clone(),
        id,
    };
    client
        .put(
            alive(beat.rank),
            "1",
            Some(PutOptions::new().with_lease(id)),
        )
        .await?;
    let (mut keeper, mut acks) = client.lease_keep_alive(id).await?;

    // The successor's key: present now, or put later; either way its delete (or
    // its never appearing within one TTL) means it is dead.
    let mut watch = match beat.successor() {
        Some(s) => {
            let key = alive(s);
            let read = client.get(key.clone(), None).await?;
            let revision = read.header().map_or(0, |h| h.revision());
            let seen = !read.kvs().is_empty();
            let stream = client
                .watch(
                    key,
                    Some(WatchOptions::new().with_start_revision(revision + 1)),
                )
                .await?;
            Some((stream, seen))
        }
        None => None,
    };
    // A successor whose key never appears within one TTL (plus a little for its
    // first put) is as dead as one whose lease expired.
    let grace = Instant::now() + Duration::from_secs(ttl as u64) + Duration::from_millis(500);
    let mut tick = tokio::time::interval(beat.timing.keep_alive);
    let mut acked = Instant::now();
    loop {
        tokio::select! {
            _ = tick.tick() => {
                // A stalled etcd answers nothing: two intervals without an
                // acknowledgement say the store is not answering.
                let silent = acked.elapsed();
                if silent > 2 * beat.timing.keep_alive {
                    beat.health.report(Err(format!("etcd acknowledged no keep-alive for {silent:?}")));
                }
                keeper.keep_alive().await?
            }
            ack = acks.message() => {
                let ack = ack?;
                if ack.as_ref().is_some_and(|a| a.ttl() > 0) {
                    acked = Instant::now();
                    beat.health.report(Ok(()));
                }
                if ack.is_none_or(|a| a.ttl() <= 0) {
                    return Err(etcd_client::Error::LeaseKeepAliveError(format!(
                        "lease {id:x} of rank {} expired", beat.rank
                    )));
                }
            }
            dead = successor_died(&mut watch, grace) => {
                dead?;
                // Counted dead unless it left on purpose. The etcd keep-alive
                // then stops watching (it does not move on to the next member).
                if let Some(s) = beat.successor() {
                    beat.watched_stopped(s).await;
                }
                watch = None;
            }
        }
    }
}

/// Resolves when the watched successor is dead; never, when not watching.
async fn successor_died(
    watch: &mut Option<(etcd_client::WatchStream, bool)>,
    grace: Instant,
) -> Result<(), etcd_client::Error> {
    let Some((stream, seen)) = watch else {
        return std::future::pending().await;
    };
    loop {
        let msg = if *seen {
            stream.message().await?
        } else {
            match tokio::time::timeout_at(grace, stream.message()).await {
                Ok(m) => m?,
                // It never showed up.
                Err(_) => return Ok(()),
            }
        };
        let Some(resp) = msg else {
            return Err(etcd_client::Error::WatchError("watch stream ended".into()));
        };
        for ev in resp.events() {
            match ev.event_type() {
                EventType::Put => *seen = true,
                EventType::Delete => return Ok(()),
            }
        }
    }
}

/// The registry's creator for `etcd`.
pub fn create(p: RendezvousParameters) -> Created {
    Box::pin(async move {
        let timing = Timing::from_params(&p)?;
        let read_timeout = p.read_timeout()?;
        let root = p.get("key_prefix").unwrap_or("/rallypoint/").to_owned();
        let endpoints: Vec<String> = p
            .endpoint
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(|e| {
                let e = e.trim_start_matches("http://");
                let one = RendezvousParameters {
                    endpoint: e.to_owned(),
                    ..p.clone()
                };
                let (host, port) = one.endpoint_host_port()?;
                let host = if host.contains(':') {
                    format!("[{host}]")
                } else {
                    host
                };
                Ok(format!("http://{host}:{}", port.unwrap_or(DEFAULT_PORT)))
            })
            .collect::<Result<_, RendezvousError>>()?;
        if endpoints.is_empty() {
            return Err(crate::api::config_error(
                "endpoint",
                &p.endpoint,
                "etcd's host:port",
            ));
        }
        let store = EtcdStore::connect(&endpoints, &root, read_timeout)
            .await
            .map_err(|source| RendezvousError::Connection {
                run_id: p.run_id.clone(),
                source: Box::new(source),
            })?;
        let h = DynamicRendezvous::worker_hosted(Arc::new(store.clone()), &p, timing)
            .with_backend_name("etcd")
            .with_keepalive(Arc::new(LeaseKeepalive::new(store)));
        Ok(Box::new(h) as Box<dyn RendezvousHandler>)
    })
}
