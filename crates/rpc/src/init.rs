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
//! Dynamic groups (`world_size: None`) join through `membership.rs`.
//!
//! With a job secret (`RpcBackendOptions::secret`), a static group's process
//! group is given it too (its connections are the collectives', which prove
//! it), so a worker started with another secret, or none among workers
//! with one, fails forming that group, at once, saying so, rather than at
//! its first call; the others wait for it as for any rank that never came,
//! until the set-up timeout. A worker joining a dynamic group opens its
//! connection to each member before it tells any (`membership.rs`), and
//! fails there the same way.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use rallypoint_store::{PrefixStore, Store};

use crate::agent::AgentInner;
use crate::device::{self, DeviceInfo};
use crate::error::{Error, Result};
use crate::registry::init_timeout;
use crate::registry::{self, BackendContext, BackendType, RpcBackendOptions};
use crate::transport::{Deliver, Event};
use crate::worker_info::WorkerInfo;
use crate::Rpc;

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
    if options.secret.is_none() {
        // The default is the process's secret; a file named but unreadable
        // (or unsafe) must not quietly leave the listener open.
        rallypoint_auth::job_secret().map_err(|e| err(format!("the job secret: {e}")))?;
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
    let deliver: Deliver = Arc::new(move |ev: Event| {
        if let Some(a) = weak.upgrade() {
            a.deliver(ev)
        }
    });
    let timeout = init_timeout(options.rpc_timeout);
    let backend_name = backend.0.clone();
    let secret = options.secret.clone();
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
        Some(world) => init_static(&agent, store, world, &addr, &info, timeout, secret).await,
        None => crate::membership::init_dynamic(&agent, store, &addr, &info, timeout).await,
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

async fn init_static(
    agent: &Arc<AgentInner>,
    store: Arc<dyn Store>,
    world: u32,
    addr: &str,
    info: &DeviceInfo,
    timeout: Duration,
    secret: Option<rallypoint_auth::JobSecret>,
) -> Result<()> {
    let name = &agent.me.name;
    let err = |m: String| Error::Init {
        worker: name.clone(),
        message: m,
    };
    // The group's own connections prove the same secret as RPC's.
    let opts = rallypoint_collectives::Options {
        prefix: "rpc_group".into(),
        timeout,
        secret: Ok(secret),
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
    agent.set_devices(&infos);
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
    let _ = agent
        .membership
        .set(Box::new(crate::shutdown::StaticGroup(pg)));
    Ok(())
}
