//! Dynamic groups (`world_size: None`): joining and leaving. They serialise joins and leaves through a
//! token in the store: a joining worker takes the token, reads the members,
//! checks its name and maps against theirs, tells each of them (a `Join`
//! request), adds itself and gives the token back. Leaving is the same with
//! `Leave`. The token holds its holder's name and a lease: the end of the
//! holder's own timeout (60 s when it has none). A worker that dies holding
//! it blocks the others only until its lease ends, then the token is taken
//! over; a token still leased when a join or leave gives up is reported
//! with its holder and when its lease ends. A member that died without
//! leaving is pruned by the next join that cannot reach it; a join that
//! fails otherwise is undone (`Leave`) at the members already told.
//!
//! At graceful shutdown a dynamic member releases what it holds while the
//! others can still answer, waits for its own calls, then leaves; the others
//! go on, so values they still hold here are reported.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rallypoint_store::Store;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::agent::{AgentInner, Group};
use crate::device::{self, DeviceInfo};
use crate::error::{Error, Result};
use crate::transport::{BoxFuture, ConnectError};
use crate::wire::Request;
use crate::worker_info::WorkerInfo;

#[derive(Serialize, Deserialize, Clone)]
struct Member {
    info: WorkerInfo,
    addr: String,
    devices: DeviceInfo,
}

/// A dynamic group's membership, kept in the store under a token.
pub(crate) struct Dynamic {
    store: Arc<dyn Store>,
    timeout: Duration,
}

/// The membership token's value: who holds it, and until when (Unix
/// milliseconds): the holder's own deadline, past which it has given up or
/// died, and the token may be taken over.
fn token_value(me: &str, until: SystemTime) -> Vec<u8> {
    let ms = until
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    format!("{me}\n{ms}").into_bytes()
}

/// (holder, lease end) of a token value; a value without a lease end (an
/// older writer) never expires.
fn token_holder(v: &[u8]) -> (String, Option<SystemTime>) {
    let s = String::from_utf8_lossy(v);
    match s.rsplit_once('\n') {
        Some((who, ms)) => match ms.parse::<u64>() {
            Ok(ms) => (who.to_owned(), Some(UNIX_EPOCH + Duration::from_millis(ms))),
            Err(_) => (s.into_owned(), None),
        },
        None => (s.into_owned(), None),
    }
}

impl Dynamic {
    /// Takes the membership token until `deadline` (the lease: with no
    /// timeout, [`UNBOUNDED_LEASE`]); a token whose holder's lease has
    /// ended (it died holding it) is taken over. Returns the value written,
    /// to give it back.
    async fn lock(&self, me: &str, deadline: Instant) -> Result<Vec<u8>> {
        let lease = deadline.saturating_duration_since(Instant::now());
        let mine = token_value(me, SystemTime::now() + lease);
        let mut expected: Vec<u8> = Vec::new();
        let mut holder = Vec::new();
        while Instant::now() < deadline {
            holder = self
                .store
                .compare_set("token", &expected, &mine)
                .await
                .map_err(|e| Error::Invalid(format!("taking the membership token: {e}")))?;
            if holder == mine {
                return Ok(mine);
            }
            let (who, until) = token_holder(&holder);
            if holder.is_empty() || until.is_some_and(|t| t <= SystemTime::now()) {
                if !holder.is_empty() {
                    tracing::warn!(worker = me, "taking over the membership token from {who:?}, whose lease ended (it died holding it?)");
                }
                // Take it from what is there now (or from nobody).
                expected = holder.clone();
                continue;
            }
            expected.clear();
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let (who, until) = token_holder(&holder);
        let lease = match until {
            Some(t) => format!(
                ", whose lease ends in {:.1} s",
                t.duration_since(SystemTime::now())
                    .unwrap_or_default()
                    .as_secs_f64()
            ),
            None => " (no lease)".to_owned(),
        };
        Err(Error::Invalid(format!(
            "the membership token is still held by worker {who:?}{lease}"
        )))
    }

    async fn unlock(&self, mine: &[u8]) {
        let _ = self.store.compare_set("token", mine, b"").await;
    }

    async fn members(&self) -> Result<Vec<Member>> {
        let b = self
            .store
            .compare_set("members", b"", b"")
            .await
            .map_err(|e| Error::Invalid(format!("reading the members: {e}")))?;
        if b.is_empty() {
            return Ok(Vec::new());
        }
        crate::wire::decode(&b).map_err(|e| Error::Codec(format!("the members key: {e}")))
    }

    async fn set_members(&self, m: &[Member]) -> Result<()> {
        let b = crate::wire::encode(&m.to_vec()).map_err(Error::Codec)?;
        self.store
            .set("members", &b)
            .await
            .map_err(|e| Error::Invalid(format!("writing the members: {e}")))
    }

    /// Leaves the group: remove this worker and tell the others.
    pub(crate) async fn leave(
        &self,
        agent: &Arc<AgentInner>,
        deadline: Option<Instant>,
    ) -> Result<()> {
        let me = &agent.me;
        let deadline = deadline.unwrap_or_else(|| Instant::now() + lease_of(self.timeout));
        let token = self.lock(&me.name, deadline).await?;
        let r = async {
            let mut members = self.members().await?;
            members.retain(|m| m.info.id != me.id);
            self.set_members(&members).await?;
            for m in &members {
                if let Err(e) = agent
                    .request_raw(m.info.id, Request::Leave { id: me.id }, None)
                    .await
                {
                    tracing::warn!(worker = %me.name, "telling {} that we leave: {e}", m.info.name);
                }
            }
            Ok(())
        }
        .await;
        self.unlock(&token).await;
        r
    }
}

/// The lease of a membership change with no timeout.
const UNBOUNDED_LEASE: Duration = Duration::from_secs(60);

/// How long a membership change may hold the token: its timeout, or
/// [`UNBOUNDED_LEASE`] when it has none.
fn lease_of(timeout: Duration) -> Duration {
    if timeout.is_zero() {
        UNBOUNDED_LEASE
    } else {
        timeout
    }
}

pub(crate) async fn init_dynamic(
    agent: &Arc<AgentInner>,
    store: Arc<dyn Store>,
    addr: &str,
    info: &DeviceInfo,
    timeout: Duration,
) -> Result<()> {
    let d = Dynamic { store, timeout };
    let me = agent.me.clone();
    let token = d.lock(&me.name, Instant::now() + lease_of(timeout)).await?;
    let r = async {
        let mut members = d.members().await?;
        if let Some(m) = members.iter().find(|m| m.info.name == me.name) {
            return Err(Error::Invalid(format!(
                "RPC worker name {:?} is not unique: ranks {} and {} both use it",
                me.name, m.info.id, me.id
            )));
        }
        if let Some(m) = members.iter().find(|m| m.info.id == me.id) {
            return Err(Error::Invalid(format!(
                "rank {} is already taken by worker {:?}",
                me.id, m.info.name
            )));
        }
        let mut infos: Vec<(String, DeviceInfo)> = members
            .iter()
            .map(|m| (m.info.name.clone(), m.devices.clone()))
            .collect();
        infos.push((me.name.clone(), info.clone()));
        device::validate(&infos, false)?;
        agent.set_devices(&infos);
        let t = agent.transport.get().expect("set").clone();
        agent.add_worker(me.clone());
        t.add_peer(me.id, addr);
        for m in &members {
            agent.join_peer(m.info.clone(), &m.addr, &m.devices);
        }
        // The connections the requests below open, opened first: a worker
        // of another secret (or none, or the members none) is told so
        // before any member is told of it, and prunes none. One that cannot
        // be reached otherwise is found gone, as its request would find it.
        let mut dead = Vec::new();
        for m in &members {
            match t.connect_now(m.info.id).await {
                Ok(()) => {}
                Err(ConnectError::Secret(e)) => {
                    return Err(Error::Invalid(format!(
                        "connecting to member {:?} (rank {}): {e}",
                        m.info.name, m.info.id
                    )))
                }
                Err(ConnectError::Unreachable(e)) => {
                    tracing::warn!(worker = %me.name, "pruning member {:?} from the group: it is unreachable: {e}", m.info.name);
                    dead.push(m.info.id);
                }
            }
        }
        // Tell each member. One found gone (it died without leaving) is
        // pruned from the list; any other failure undoes the join at those
        // already told, so none keeps a member that never joined.
        let mut told = Vec::new();
        let unreached = dead.clone();
        for m in members.iter().filter(|m| !unreached.contains(&m.info.id)) {
            let join = Request::Join {
                info: me.clone(),
                addr: addr.to_owned(),
                devices: info.clone(),
            };
            match agent.request_raw(m.info.id, join, None).await {
                Ok(()) => told.push(m.info.id),
                Err(e @ Error::WorkerGone { .. }) => {
                    tracing::warn!(worker = %me.name, "pruning member {:?} from the group: {e}", m.info.name);
                    dead.push(m.info.id);
                }
                Err(e) => {
                    for id in told {
                        let _ = agent
                            .request_raw(id, Request::Leave { id: me.id }, None)
                            .await;
                    }
                    return Err(e);
                }
            }
        }
        for &id in &dead {
            agent.remove_worker(id);
            t.remove_peer(id);
        }
        members.retain(|m| !dead.contains(&m.info.id));
        members.push(Member {
            info: me.clone(),
            addr: addr.to_owned(),
            devices: info.clone(),
        });
        d.set_members(&members).await
    }
    .await;
    d.unlock(&token).await;
    r?;
    let _ = agent.membership.set(Box::new(d));
    Ok(())
}

impl Group for Dynamic {
    fn graceful<'a>(
        &'a self,
        agent: &'a Arc<AgentInner>,
        deadline: Option<Instant>,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            agent.release_and_drain(deadline, false).await;
            agent.wait_idle(deadline).await;
            self.leave(agent, deadline)
                .await
                .map_err(|e| Error::ShutdownIncomplete {
                    worker: agent.me.name.clone(),
                    message: e.to_string(),
                })
        })
    }
}
