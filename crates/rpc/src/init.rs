//! `init_rpc`: rendezvous, names, the group, device maps, the transport.
//!
//! Static groups (`world_size` given) follow PyTorch's sequence: the URL
//! rendezvous; a store prefix per `init_rpc` call in this process
//! (`rpc_prefix_N`); a check that the group is not mixing static and dynamic
//! members (`rpcIsStaticGroup`); a process group on the store, through which
//! every worker's name, address and device information is all-gathered;
//! name and device-map validation; then a barrier. The process group stays for
//! shutdown's barrier and its count of calls in flight.
//!
//! Dynamic groups (`world_size: None`) serialise joins and leaves through a
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

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rallypoint_store::{PrefixStore, Store};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::agent::{AgentInner, Membership};
use crate::device::{self, DeviceInfo};
use crate::registry::init_timeout;
use crate::registry::{self, BackendContext, BackendType, RpcBackendOptions};
use crate::transport::{Deliver, Event};
use crate::wire::Request;
use crate::{Error, Result, Rpc, WorkerInfo};

static INIT_CALLS: AtomicUsize = AtomicUsize::new(0);

/// PyTorch's rule: letters, digits, `_`, `:` and `-`, shorter than 128 characters.
pub fn check_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() < 128
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_:-".contains(c));
    if ok {
        Ok(())
    } else {
        Err(Error::Invalid(format!(
            "worker name {name:?} must be 1 to 127 characters of letters, digits, '_', ':' and '-'"
        )))
    }
}

/// Starts this worker's RPC agent, rendezvousing through
/// `options.init_method` (`env://` by default: under `rally run` nothing else
/// is needed). `backend: None` is TCP; `rank: None` takes it from the
/// rendezvous (`RANK`); `world_size: None` makes a dynamic group.
pub async fn init_rpc(
    name: &str,
    backend: Option<BackendType>,
    rank: Option<u32>,
    world_size: Option<u32>,
    options: Option<RpcBackendOptions>,
) -> Result<Rpc> {
    check_name(name)?;
    let backend = backend.unwrap_or_else(BackendType::tcp);
    let options = match options {
        Some(o) => o,
        None => registry::construct_rpc_backend_options(
            &backend,
            registry::DEFAULT_RPC_TIMEOUT,
            registry::DEFAULT_INIT_METHOD,
            BTreeMap::new(),
        )?,
    };
    let err = |m: String| Error::Init {
        worker: name.to_owned(),
        message: m,
    };
    let args = rallypoint_rendezvous::init::InitArgs {
        rank: rank.map(|r| r as usize),
        world_size: world_size.map(|w| w as usize),
        timeout: init_timeout(options.rpc_timeout).min(Duration::from_secs(24 * 3600)),
        env: None,
    };
    let mut rdzv = rallypoint_rendezvous::init::rendezvous(&options.init_method, args)
        .map_err(|e| err(format!("rendezvous: {e}")))?;
    let r = rdzv
        .next()
        .await
        .map_err(|e| err(format!("rendezvous: {e}")))?;
    let world = world_size.map(|_| r.world_size as u32);
    let n = INIT_CALLS.fetch_add(1, Ordering::SeqCst);
    let store: Arc<dyn Store> = Arc::new(PrefixStore::new(format!("rpc_prefix_{n}"), r.store));
    init_rpc_with_store(store, name, backend, r.rank as u32, world, options).await
}

/// [`init_rpc`] on a store the caller already has, used as is: one group per
/// store (wrap it in a [`PrefixStore`] for another). [`init_rpc`] adds
/// PyTorch's prefix per call (`rpc_prefix_N`, N counting `init_rpc` calls in
/// the process) before calling this.
pub async fn init_rpc_with_store(
    store: Arc<dyn Store>,
    name: &str,
    backend: BackendType,
    rank: u32,
    world_size: Option<u32>,
    options: RpcBackendOptions,
) -> Result<Rpc> {
    check_name(name)?;
    let err = |m: String| Error::Init {
        worker: name.to_owned(),
        message: m,
    };
    if let Some(w) = world_size {
        if rank >= w {
            return Err(err(format!("rank {rank} is not in a group of {w}")));
        }
    }
    let serr = |what: &str, e: rallypoint_store::StoreError| err(format!("{what}: {e}"));

    let want: &[u8] = if world_size.is_some() { b"1" } else { b"0" };
    let now = store
        .compare_set("rpcIsStaticGroup", b"", want)
        .await
        .map_err(|e| serr("checking the group kind", e))?;
    if now != want {
        return Err(err(format!(
            "this worker is {} but the group was started {}: a group cannot mix static and dynamic members",
            if world_size.is_some() { "static (world_size given)" } else { "dynamic (no world_size)" },
            if now == b"1" { "static" } else { "dynamic" },
        )));
    }
    let mine = format!("{:016x}", fastrand::u64(1..));
    let gen = store
        .compare_set("generation", b"", mine.as_bytes())
        .await
        .map_err(|e| serr("publishing the generation", e))?;
    let generation = u64::from_str_radix(&String::from_utf8_lossy(&gen), 16).map_err(|_| {
        err(format!(
            "bad generation {:?} in the store",
            String::from_utf8_lossy(&gen)
        ))
    })?;

    let info = DeviceInfo {
        cuda_count: options.inventory.cuda_count(),
        maps: options.device_maps.clone(),
        devices: options.devices.clone(),
    };
    let me = WorkerInfo {
        name: name.to_owned(),
        id: rank,
    };
    let agent = AgentInner::new(
        me.clone(),
        options.functions.clone(),
        options.rpc_timeout,
        info.clone(),
        options.num_worker_threads,
        options.heartbeat,
        options.max_requests,
    );
    let weak: Weak<AgentInner> = Arc::downgrade(&agent);
    let deliver: Deliver = Arc::new(move |ev: Event| weak.upgrade().and_then(|a| a.deliver(ev)));
    let timeout = init_timeout(options.rpc_timeout);
    let backend_name = backend.0.clone();
    let transport = registry::init_backend(
        &backend,
        BackendContext {
            store: store.clone(),
            name: name.to_owned(),
            rank,
            world_size,
            generation,
            options,
            deliver,
        },
    )
    .await?;
    let addr = transport.address();
    let _ = agent.transport.set(transport.clone());
    let result = match world_size {
        Some(world) => init_static(&agent, store, world, &addr, &info, timeout).await,
        None => init_dynamic(&agent, store, &addr, &info, timeout).await,
    };
    if let Err(e) = result {
        // Nothing half-started outlives a failed init.
        let _ = agent.shutdown(false, None).await;
        return Err(match e {
            Error::Init { .. } | Error::DeviceMap(_) => e,
            e => err(e.to_string()),
        });
    }
    agent.start_heartbeat();
    tracing::debug!(worker = name, backend = backend_name, "RPC agent started");
    Ok(Rpc(agent))
}

#[derive(Serialize, Deserialize, Clone)]
struct Member {
    info: WorkerInfo,
    addr: String,
    devices: DeviceInfo,
}

fn set_devices(agent: &AgentInner, all: &[(String, DeviceInfo)]) {
    let reverse = device::reverse_maps(&agent.me.name, all);
    let devices = device::device_list(&agent.device_info.devices, &agent.maps, &reverse);
    *agent.reverse.write().unwrap_or_else(|e| e.into_inner()) = reverse;
    *agent.devices.write().unwrap_or_else(|e| e.into_inner()) = devices;
}

async fn init_static(
    agent: &Arc<AgentInner>,
    store: Arc<dyn Store>,
    world: u32,
    addr: &str,
    info: &DeviceInfo,
    timeout: Duration,
) -> Result<()> {
    let name = &agent.me.name;
    let err = |m: String| Error::Init {
        worker: name.clone(),
        message: m,
    };
    let opts = rallypoint_collectives::Options {
        prefix: "rpc_group".into(),
        timeout,
        ..Default::default()
    };
    let pg = rallypoint_collectives::ProcessGroup::new(
        store,
        agent.me.id as usize,
        world as usize,
        opts,
    )
    .await
    .map_err(|e| err(format!("forming the group: {e}")))?;
    let all: Vec<(String, String, DeviceInfo)> = pg
        .all_gather_object(&(name.clone(), addr.to_owned(), info.clone()))
        .await
        .map_err(|e| err(format!("exchanging names and device maps: {e}")))?;
    let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
    for (r, (n, _, _)) in all.iter().enumerate() {
        if let Some(first) = seen.insert(n, r) {
            return Err(err(format!(
                "RPC worker name {n:?} is not unique: ranks {first} and {r} both use it"
            )));
        }
    }
    let infos: Vec<(String, DeviceInfo)> =
        all.iter().map(|(n, _, i)| (n.clone(), i.clone())).collect();
    device::validate(&infos, true)?;
    set_devices(agent, &infos);
    let t = agent.transport.get().expect("set").clone();
    for (r, (n, a, _)) in all.iter().enumerate() {
        agent.add_worker(WorkerInfo {
            name: n.clone(),
            id: r as u32,
        });
        t.add_peer(r as u32, a);
    }
    pg.barrier()
        .await
        .map_err(|e| err(format!("the closing barrier: {e}")))?;
    let _ = agent.membership.set(Membership::Static(pg));
    Ok(())
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

async fn init_dynamic(
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
        set_devices(agent, &infos);
        let t = agent.transport.get().expect("set").clone();
        agent.add_worker(me.clone());
        t.add_peer(me.id, addr);
        for m in &members {
            agent.join_peer(m.info.clone(), &m.addr, &m.devices);
        }
        // Tell each member. One found gone (it died without leaving) is
        // pruned from the list; any other failure undoes the join at those
        // already told, so none keeps a member that never joined.
        let mut told = Vec::new();
        let mut dead = Vec::new();
        for m in &members {
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
    let _ = agent.membership.set(Membership::Dynamic(d));
    Ok(())
}
