//! Starts in-process groups: one agent per worker, on a shared memory store.

use std::sync::Arc;
use std::time::Duration;

use rallypoint_rpc::{
    init_rpc_with_store, BackendType, Functions, Payload, Result, Rpc, RpcBackendOptions,
};
use rallypoint_store::{MemoryStore, Store};

/// The functions every test worker serves.
pub fn functions() -> Functions {
    let f = Functions::new();
    f.register("add", |(a, b): (i64, i64)| a + b).unwrap();
    f.register("echo", |s: String| s).unwrap();
    f.register("nothing", |(): ()| ()).unwrap();
    f.register_fallible("fail", |m: String| {
        Err::<(), _>(format!("asked to fail: {m}"))
    })
    .unwrap();
    f.register_async("sleep_ms", |_rpc: Rpc, ms: u64| async move {
        tokio::time::sleep(Duration::from_millis(ms)).await;
        Ok::<u64, String>(ms)
    })
    .unwrap();
    f.register("vec", |(n, v): (usize, i64)| vec![v; n])
        .unwrap();
    f.register("counter", |start: i64| start).unwrap();
    f.register_method("incr", |v: &mut i64, by: i64| {
        Ok::<i64, String>({
            *v += by;
            *v
        })
    })
    .unwrap();
    // Takes an RRef made elsewhere and fetches its value (a fork to a third worker).
    f.register_async(
        "fetch",
        |_rpc: Rpc, r: rallypoint_rpc::RRef<i64>| async move {
            r.to_here().await.map_err(|e| e.to_string())
        },
    )
    .unwrap();
    // Keeps an RRef for a while (the parent must not be deleted meanwhile).
    f.register_async(
        "hold_then_fetch",
        |_rpc: Rpc, (r, ms): (rallypoint_rpc::RRef<i64>, u64)| async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            r.to_here().await.map_err(|e| e.to_string())
        },
    )
    .unwrap();
    // Calls another worker in turn.
    f.register_async(
        "relay_add",
        |rpc: Rpc, (to, a, b): (String, i64, i64)| async move {
            rpc.rpc_sync::<_, i64>(to.as_str(), "add", &(a, b))
                .await
                .map_err(|e| e.to_string())
        },
    )
    .unwrap();
    f.register("payload_info", |p: Payload| {
        (p.device.to_string(), p.data.len() as u64, checksum(&p.data))
    })
    .unwrap();
    f.register("payload_back", |p: Payload| p).unwrap();
    f
}

pub fn checksum(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf29ce484222325u64, |h, x| {
        (h ^ *x as u64).wrapping_mul(0x100000001b3)
    })
}

pub fn options() -> RpcBackendOptions {
    let mut o = RpcBackendOptions {
        functions: functions(),
        rpc_timeout: Duration::from_secs(30),
        ..Default::default()
    };
    o.tcp.listen = Some(std::net::Ipv4Addr::LOCALHOST.into());
    o
}

/// `n` workers named `w0`… of a static group.
pub async fn group(n: usize, backend: BackendType) -> Vec<Rpc> {
    group_with(n, backend, |_, _| {})
        .await
        .into_iter()
        .map(|r| r.expect("init_rpc"))
        .collect()
}

/// As [`group`], with each worker's options adjusted; each worker's result.
pub async fn group_with(
    n: usize,
    backend: BackendType,
    adjust: impl Fn(usize, &mut RpcBackendOptions),
) -> Vec<Result<Rpc>> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    group_on(store, n, backend, adjust).await
}

/// As [`group_with`], on `store`.
pub async fn group_on(
    store: Arc<dyn Store>,
    n: usize,
    backend: BackendType,
    adjust: impl Fn(usize, &mut RpcBackendOptions),
) -> Vec<Result<Rpc>> {
    let tasks: Vec<_> = (0..n)
        .map(|r| {
            let mut o = options();
            adjust(r, &mut o);
            let (store, backend) = (store.clone(), backend.clone());
            tokio::spawn(async move {
                init_rpc_with_store(
                    store,
                    &format!("w{r}"),
                    backend,
                    r as u32,
                    Some(n as u32),
                    o,
                )
                .await
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.expect("task"));
    }
    out
}

/// Graceful shutdown of every worker at once.
pub async fn shutdown_all(ws: Vec<Rpc>) -> Vec<rallypoint_rpc::ShutdownReport> {
    let tasks: Vec<_> = ws
        .into_iter()
        .map(|w| tokio::spawn(async move { w.shutdown(true, Some(Duration::from_secs(20))).await }))
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.expect("task").expect("graceful shutdown"));
    }
    out
}

/// Waits until `f` holds, polling; panics with `what` after 10 s.
pub async fn eventually(what: &str, f: impl Fn() -> bool) {
    let t0 = std::time::Instant::now();
    while !f() {
        assert!(t0.elapsed() < Duration::from_secs(10), "never: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Decides, for each message (from, to), whether it is sent (`false`: lost).
pub type Forward = Arc<dyn Fn(u32, u32) -> bool + Send + Sync>;

/// A third-party backend for tests: TCP underneath, every send seen (and
/// perhaps lost) by a [`Forward`].
pub struct Tap {
    inner: Arc<dyn rallypoint_rpc::transport::Transport>,
    me: u32,
    forward: Forward,
}

impl rallypoint_rpc::transport::Transport for Tap {
    fn address(&self) -> String {
        self.inner.address()
    }
    fn add_peer(&self, id: u32, addr: &str) {
        self.inner.add_peer(id, addr)
    }
    fn remove_peer(&self, id: u32) {
        self.inner.remove_peer(id)
    }
    fn send(
        &self,
        to: u32,
        msg: rallypoint_rpc::transport::Outgoing,
    ) -> rallypoint_rpc::transport::BoxFuture<'_, std::result::Result<(), String>> {
        if !(self.forward)(self.me, to) {
            return Box::pin(async { Ok(()) });
        }
        self.inner.send(to, msg)
    }
    fn shutdown(&self, graceful: bool) -> rallypoint_rpc::transport::BoxFuture<'_, ()> {
        self.inner.shutdown(graceful)
    }
}

/// Registers backend `name`: a [`Tap`] with `forward` over TCP on loopback.
pub fn register_tap(name: &str, forward: Forward) -> Result<BackendType> {
    rallypoint_rpc::register_backend(
        name,
        Arc::new(|a: rallypoint_rpc::registry::OptionsArgs| {
            Ok(RpcBackendOptions {
                rpc_timeout: a.rpc_timeout,
                init_method: a.init_method,
                ..Default::default()
            })
        }),
        Arc::new(move |cx: rallypoint_rpc::registry::BackendContext| {
            let forward = forward.clone();
            Box::pin(async move {
                let mut cx = cx;
                let me = cx.rank;
                cx.options.tcp.listen = Some(std::net::Ipv4Addr::LOCALHOST.into());
                let inner = rallypoint_rpc::init_backend(&BackendType::tcp(), cx).await?;
                Ok(Arc::new(Tap { inner, me, forward })
                    as Arc<dyn rallypoint_rpc::transport::Transport>)
            })
        }),
    )
}
