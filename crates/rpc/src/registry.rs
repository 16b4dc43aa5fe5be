//! The backend registry, as PyTorch's `backend_registry`: a backend is a name,
//! an options constructor and an initialiser.
//!
//! Two are built in: `TCP` (the default; `TENSORPIPE`, PyTorch's default's
//! name, is an alias of it) and `PROCESS_GROUP`. Anyone may register more; a backend's initialiser returns a [`Transport`], and the
//! agent (calls, RRefs, shutdown, device maps) is shared by all of them.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use rallypoint_auth::JobSecret;
use rallypoint_store::Store;
use rallypoint_sync::MutexExt;

use crate::agent::Functions;
use crate::device::{self, Device, DeviceMap, Inventory};
use crate::error::{Error, Result};
use crate::tcp::{Tcp, TcpOptions};
use crate::transport::{BoxFuture, Deliver, Transport};

/// A registered backend's name (PyTorch's `BackendType`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendType(pub String);

impl BackendType {
    pub fn tcp() -> BackendType {
        BackendType("TCP".into())
    }
    pub fn process_group() -> BackendType {
        BackendType("PROCESS_GROUP".into())
    }
}

impl fmt::Display for BackendType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BackendType.{}", self.0)
    }
}

impl From<&str> for BackendType {
    fn from(s: &str) -> Self {
        BackendType(s.to_owned())
    }
}

/// Default per-call timeout (PyTorch's `DEFAULT_RPC_TIMEOUT_SEC`).
pub const DEFAULT_RPC_TIMEOUT: Duration = Duration::from_secs(60);

/// Default heartbeat deadline ([`RpcBackendOptions::heartbeat`]).
pub const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(10);
/// Default init method.
pub const DEFAULT_INIT_METHOD: &str = "env://";

/// Options every backend gets; backend-specific ones live in `extra` (parsed
/// by the backend's constructor) or in their own field (`tcp`).
#[derive(Clone)]
pub struct RpcBackendOptions {
    /// Default timeout of a call; zero never expires.
    pub rpc_timeout: Duration,
    /// Where to rendezvous: `env://`, `tcp://host:port`, `file:///path`.
    pub init_method: String,
    /// The devices this worker uses (empty: derived from the maps).
    pub devices: Vec<Device>,
    /// Per destination worker, a map from this worker's devices to its.
    pub device_maps: BTreeMap<String, DeviceMap>,
    /// Where the local CUDA device count comes from.
    pub inventory: Inventory,
    /// The functions this worker serves.
    pub functions: Functions,
    /// The TCP backend's settings.
    pub tcp: TcpOptions,
    /// How many functions registered with `register_blocking` run at once
    /// (PyTorch's `num_worker_threads`, default 16).
    pub num_worker_threads: usize,
    /// PROCESS_GROUP: how many sends may be in flight at once (PyTorch's
    /// `num_send_recv_threads`, default 4).
    pub pg_send_recv_threads: usize,
    /// How long a worker that calls are waiting on may stay silent before
    /// it is declared dead (stopped, partitioned, its host down): a worker
    /// waiting on another probes it after a quarter of this and hears
    /// either an answer, any message, or bytes of a message still arriving.
    /// Zero switches the heartbeat off. Default 10 s.
    pub heartbeat: Duration,
    /// Requests (calls, `remote()`s, method calls, fetches) served at once,
    /// and in flight from this worker to any one other: beyond it a request
    /// waits its turn (its deadline still runs), at the callee or at the
    /// caller, so a worker flooding another is slowed down at its source.
    /// RRef control messages are not counted. Default 4096.
    pub max_requests: usize,
    /// Backend-specific options of third-party backends.
    pub extra: BTreeMap<String, String>,
    /// The job secret: with one, the TCP backend admits a connection only
    /// once it proved the secret, and proves it to every peer it dials
    /// (`tcp/admission.rs`); `None`: connections as PyTorch's. Defaults to
    /// the process's ([`rallypoint_auth::job_secret`]: the one `rally` set,
    /// else the file `RALLY_JOB_SECRET_FILE` names). A bad file fails
    /// `init_rpc` with its error (even with this set to `None` by hand:
    /// unset the variable to run without).
    pub secret: Option<JobSecret>,
}

impl Default for RpcBackendOptions {
    fn default() -> Self {
        RpcBackendOptions {
            rpc_timeout: DEFAULT_RPC_TIMEOUT,
            init_method: DEFAULT_INIT_METHOD.into(),
            devices: Vec::new(),
            device_maps: BTreeMap::new(),
            inventory: Inventory::default(),
            functions: Functions::default(),
            tcp: TcpOptions::default(),
            num_worker_threads: 16,
            pg_send_recv_threads: 4,
            heartbeat: DEFAULT_HEARTBEAT,
            max_requests: 4096,
            extra: BTreeMap::new(),
            // A bad file: `None` here, and `init_rpc` fails with its error.
            secret: rallypoint_auth::job_secret().ok().flatten(),
        }
    }
}

impl fmt::Debug for RpcBackendOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RpcBackendOptions")
            .field("rpc_timeout", &self.rpc_timeout)
            .field("init_method", &self.init_method)
            .field("devices", &self.devices)
            .field("device_maps", &self.device_maps)
            .field("inventory", &self.inventory)
            .field("tcp", &self.tcp)
            .field("num_worker_threads", &self.num_worker_threads)
            .field("pg_send_recv_threads", &self.pg_send_recv_threads)
            .field("extra", &self.extra)
            .field("secret", &self.secret.as_ref().map(JobSecret::key_id))
            .finish_non_exhaustive()
    }
}

impl RpcBackendOptions {
    /// Adds to the device map towards worker `to`; the map must stay
    /// one-to-one and agree with earlier entries.
    pub fn set_device_map(
        &mut self,
        to: &str,
        map: impl IntoIterator<Item = (Device, Device)>,
    ) -> Result<()> {
        let map: DeviceMap = map.into_iter().collect();
        device::add_map(&mut self.device_maps, to, &map)
    }

    /// Declares the devices this worker uses (CUDA devices only, as PyTorch).
    pub fn set_devices(&mut self, devices: Vec<Device>) -> Result<()> {
        if let Some(d) = devices.iter().find(|d| **d == Device::Cpu) {
            return Err(Error::Invalid(format!(
                "set_devices takes CUDA devices only, got {d}"
            )));
        }
        self.devices = devices;
        Ok(())
    }
}

/// What an options constructor gets: PyTorch's `(rpc_timeout, init_method, **kwargs)`.
pub struct OptionsArgs {
    pub rpc_timeout: Duration,
    pub init_method: String,
    pub extra: BTreeMap<String, String>,
}

/// What an initialiser gets.
pub struct BackendContext {
    /// The job's store, under this `init_rpc`'s prefix.
    pub store: Arc<dyn Store>,
    pub name: String,
    pub rank: u32,
    /// `None` for a dynamic group.
    pub world_size: Option<u32>,
    /// This group's generation, for handshakes.
    pub generation: u64,
    pub options: RpcBackendOptions,
    /// Where the transport hands what it receives.
    pub deliver: Deliver,
}

pub type ConstructOptions = Arc<dyn Fn(OptionsArgs) -> Result<RpcBackendOptions> + Send + Sync>;
pub type InitBackend =
    Arc<dyn Fn(BackendContext) -> BoxFuture<'static, Result<Arc<dyn Transport>>> + Send + Sync>;

#[derive(Clone)]
struct Entry {
    construct: ConstructOptions,
    init: InitBackend,
}

fn registry() -> &'static Mutex<BTreeMap<String, Entry>> {
    static R: OnceLock<Mutex<BTreeMap<String, Entry>>> = OnceLock::new();
    R.get_or_init(|| {
        let mut m = BTreeMap::new();
        m.insert(
            "TCP".to_owned(),
            Entry {
                construct: Arc::new(construct_tcp),
                init: Arc::new(|cx| Box::pin(init_tcp(cx))),
            },
        );
        // PyTorch's default backend's name: the same backend here.
        m.insert(
            "TENSORPIPE".to_owned(),
            Entry {
                construct: Arc::new(construct_tcp),
                init: Arc::new(|cx| Box::pin(init_tcp(cx))),
            },
        );
        m.insert(
            "PROCESS_GROUP".to_owned(),
            Entry {
                construct: Arc::new(construct_pg),
                init: Arc::new(|cx| Box::pin(init_pg(cx))),
            },
        );
        Mutex::new(m)
    })
}

fn lock() -> std::sync::MutexGuard<'static, BTreeMap<String, Entry>> {
    registry().locked()
}

/// Registers a backend; a name already taken is an error naming it.
pub fn register_backend(
    name: &str,
    construct: ConstructOptions,
    init: InitBackend,
) -> Result<BackendType> {
    let mut r = lock();
    if r.contains_key(name) {
        return Err(Error::DuplicateBackend(name.to_owned()));
    }
    r.insert(name.to_owned(), Entry { construct, init });
    Ok(BackendType(name.to_owned()))
}

/// Whether a backend of this name is registered.
pub fn backend_registered(name: &str) -> bool {
    lock().contains_key(name)
}

/// Every registered backend (PyTorch's `BackendType` members).
pub fn backends() -> Vec<BackendType> {
    lock().keys().map(|k| BackendType(k.clone())).collect()
}

fn entry(backend: &BackendType) -> Result<Entry> {
    let r = lock();
    r.get(&backend.0)
        .cloned()
        .ok_or_else(|| Error::UnknownBackend {
            name: backend.0.clone(),
            known: r.keys().cloned().collect::<Vec<_>>().join(", "),
        })
}

/// The backend's options from PyTorch's arguments.
pub fn construct_rpc_backend_options(
    backend: &BackendType,
    rpc_timeout: Duration,
    init_method: &str,
    extra: BTreeMap<String, String>,
) -> Result<RpcBackendOptions> {
    (entry(backend)?.construct)(OptionsArgs {
        rpc_timeout,
        init_method: init_method.to_owned(),
        extra,
    })
}

/// Runs the backend's initialiser.
pub async fn init_backend(backend: &BackendType, cx: BackendContext) -> Result<Arc<dyn Transport>> {
    let init = entry(backend)?.init;
    init(cx).await
}

fn construct_pg(a: OptionsArgs) -> Result<RpcBackendOptions> {
    let mut o = RpcBackendOptions {
        rpc_timeout: a.rpc_timeout,
        init_method: a.init_method,
        ..Default::default()
    };
    for (k, v) in &a.extra {
        match k.as_str() {
            "num_send_recv_threads" => {
                o.pg_send_recv_threads = v.parse().ok().filter(|n| *n > 0).ok_or_else(|| {
                    Error::Invalid(format!(
                        "backend option {k}={v:?}: expected a positive number"
                    ))
                })?
            }
            _ => {
                return Err(Error::Invalid(format!(
                    "unknown PROCESS_GROUP backend option {k:?} (known: num_send_recv_threads)"
                )))
            }
        }
    }
    Ok(o)
}

fn construct_tcp(a: OptionsArgs) -> Result<RpcBackendOptions> {
    let mut o = RpcBackendOptions {
        rpc_timeout: a.rpc_timeout,
        init_method: a.init_method,
        ..Default::default()
    };
    for (k, v) in &a.extra {
        let bad = || Error::Invalid(format!("backend option {k}={v:?} is not valid"));
        match k.as_str() {
            "num_streams" => o.tcp.streams = v.parse().map_err(|_| bad())?,
            "split_bytes" => o.tcp.split_bytes = v.parse().map_err(|_| bad())?,
            "max_message_bytes" => o.tcp.max_message_bytes = v.parse().map_err(|_| bad())?,
            "listen" => o.tcp.listen = Some(v.parse().map_err(|_| bad())?),
            "num_worker_threads" => {
                o.num_worker_threads = v.parse().ok().filter(|n| *n > 0).ok_or_else(bad)?
            }
            _ => {
                return Err(Error::Invalid(format!(
                    "unknown TCP backend option {k:?} (known: num_streams, split_bytes, max_message_bytes, listen, num_worker_threads)"
                )))
            }
        }
    }
    if o.tcp.streams == 0 || o.tcp.streams > crate::wire::MAX_PARTS as usize {
        return Err(Error::Invalid(format!(
            "num_streams must be in 1..={}",
            crate::wire::MAX_PARTS
        )));
    }
    Ok(o)
}

async fn init_tcp(cx: BackendContext) -> Result<Arc<dyn Transport>> {
    let mut opts = cx.options.tcp.clone();
    if opts.listen.is_none() {
        // Behind a job secret `MASTER_ADDR` names the agent's loopback
        // proxy; `RALLY_JOB_STORE_HOST` the store's own host.
        let toward = |var| std::env::var(var).ok().and_then(|h| route_ip(&h));
        opts.listen = toward("RALLY_JOB_STORE_HOST").or_else(|| toward("MASTER_ADDR"));
    }
    let secret = cx.options.secret.clone();
    let t = Tcp::start(cx.rank, cx.generation, opts, secret, cx.deliver)
        .await
        .map_err(|e| Error::Init {
            worker: cx.name.clone(),
            message: format!("listening: {e}"),
        })?;
    Ok(Arc::new(t))
}

async fn init_pg(cx: BackendContext) -> Result<Arc<dyn Transport>> {
    let err = |m: String| Error::Init {
        worker: cx.name.clone(),
        message: m,
    };
    let world = cx
        .world_size
        .ok_or_else(|| err("the PROCESS_GROUP backend needs a static group (world_size)".into()))?;
    let opts = rallypoint_collectives::Options {
        prefix: "rpc_backend_pg".into(),
        timeout: init_timeout(cx.options.rpc_timeout),
        // Its connections are this backend's: they prove RPC's secret.
        secret: Ok(cx.options.secret.clone()),
        ..Default::default()
    };
    let pg = rallypoint_collectives::ProcessGroup::new(
        cx.store.clone(),
        cx.rank as usize,
        world as usize,
        opts,
    )
    .await
    .map_err(|e| err(format!("forming the backend's process group: {e}")))?;
    Ok(Arc::new(crate::pg::PgTransport::start(
        pg,
        cx.deliver,
        cx.options.tcp.max_message_bytes,
        cx.options.pg_send_recv_threads,
    )))
}

pub(crate) fn route_ip(host: &str) -> Option<std::net::IpAddr> {
    rallypoint_collectives::route_ip(host)
}

/// The timeout for set-up steps: the RPC timeout, or no bound when it is zero.
pub(crate) fn init_timeout(rpc_timeout: Duration) -> Duration {
    if rpc_timeout.is_zero() {
        crate::transport::FOREVER
    } else {
        rpc_timeout
    }
}
