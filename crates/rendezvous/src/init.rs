//! URL-based init (PyTorch's `torch/distributed/rendezvous.py`).
//!
//! [`rendezvous`] looks the URL's scheme up in a [`Schemes`] registry and returns a
//! one-shot [`UrlRendezvous`]: its first [`UrlRendezvous::next`] yields the store,
//! this process's rank and the world size; asking again is an error, as PyTorch's
//! handlers cannot re-rendezvous. Built in:
//!
//! | URL | store | rank / world size from |
//! |---|---|---|
//! | `file:///path?rank=R&world_size=N` | [`FileStore`] on `/path` | the query |
//! | `tcp://host:port?rank=R&world_size=N` | [`TcpStore`]; rank 0 hosts the server | the query |
//! | `env://` | [`TcpStore`] at `MASTER_ADDR:MASTER_PORT`; rank 0 hosts unless `TORCHELASTIC_USE_AGENT_STORE=True` | `RANK`, `WORLD_SIZE` (the query overrides) |
//!
//! Rank and world size may come from the URL or from the caller's arguments, not
//! both. A missing parameter or variable is an error that names it.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rallypoint_store::{FileStore, Store, TcpStore};
use rallypoint_sync::MutexExt;

pub use crate::url::Url;

/// Why URL-based init failed.
#[derive(Debug, thiserror::Error)]
pub enum InitError {
    #[error("{0}")]
    Url(String),
    #[error("no rendezvous handler for {scheme}:// (registered: {known})")]
    UnknownScheme { scheme: String, known: String },
    #[error("a rendezvous handler for {0}:// is already registered")]
    Duplicate(String),
    #[error("{what} is missing: {hint}")]
    Missing { what: String, hint: String },
    #[error("{what} = {value:?} is invalid: {expected}")]
    Invalid {
        what: String,
        value: String,
        expected: String,
    },
    #[error("{0} is given both in the URL and as an argument")]
    Conflict(&'static str),
    #[error("{0}")]
    Taken(String),
    #[error("the {0}:// rendezvous yields one result; it cannot re-rendezvous")]
    Exhausted(String),
    #[error("rendezvous store: {}", with_sources(.0))]
    Store(#[from] rallypoint_store::StoreError),
}

/// What the caller passes besides the URL.
#[derive(Debug, Clone)]
pub struct InitArgs {
    pub rank: Option<usize>,
    pub world_size: Option<usize>,
    pub timeout: Duration,
    /// The environment `env://` reads (default: this process's).
    pub env: Option<BTreeMap<String, String>>,
}

impl Default for InitArgs {
    fn default() -> Self {
        InitArgs {
            rank: None,
            world_size: None,
            timeout: rallypoint_store::DEFAULT_TIMEOUT,
            env: None,
        }
    }
}

/// The result of a URL rendezvous.
pub struct Rendezvoused {
    pub store: Arc<dyn Store>,
    pub rank: usize,
    pub world_size: usize,
}

/// What a scheme handler returns.
pub type SchemeFuture = Pin<Box<dyn Future<Output = Result<Rendezvoused, InitError>> + Send>>;
/// A scheme handler.
pub type SchemeHandler = fn(Url, InitArgs) -> SchemeFuture;

/// Scheme → handler.
pub struct Schemes {
    handlers: Mutex<BTreeMap<String, SchemeHandler>>,
}

impl Default for Schemes {
    fn default() -> Self {
        let s = Schemes {
            handlers: Mutex::new(BTreeMap::new()),
        };
        for (name, h) in [("file", file as SchemeHandler), ("tcp", tcp), ("env", env)] {
            s.register(name, h).expect("built-ins register once");
        }
        s
    }
}

impl Schemes {
    /// Registers a handler; a scheme registered twice is an error.
    pub fn register(&self, scheme: &str, handler: SchemeHandler) -> Result<(), InitError> {
        let mut h = self.handlers.locked();
        if h.contains_key(scheme) {
            return Err(InitError::Duplicate(scheme.to_owned()));
        }
        h.insert(scheme.to_owned(), handler);
        Ok(())
    }

    /// Starts a rendezvous for `url`.
    pub fn rendezvous(&self, url: &str, args: InitArgs) -> Result<UrlRendezvous, InitError> {
        let url = Url::parse(url).map_err(InitError::Url)?;
        let h = self.handlers.locked();
        let handler = *h.get(&url.scheme).ok_or_else(|| InitError::UnknownScheme {
            scheme: url.scheme.clone(),
            known: h
                .keys()
                .map(|k| format!("{k}://"))
                .collect::<Vec<_>>()
                .join(", "),
        })?;
        Ok(UrlRendezvous {
            scheme: url.scheme.clone(),
            pending: Some((handler, url, args)),
        })
    }
}

/// [`Schemes::rendezvous`] with the built-in schemes.
pub fn rendezvous(url: &str, args: InitArgs) -> Result<UrlRendezvous, InitError> {
    Schemes::default().rendezvous(url, args)
}

/// A one-shot rendezvous.
pub struct UrlRendezvous {
    scheme: String,
    pending: Option<(SchemeHandler, Url, InitArgs)>,
}

impl UrlRendezvous {
    /// The store, rank and world size, the first time; an error after that.
    pub async fn next(&mut self) -> Result<Rendezvoused, InitError> {
        let (handler, url, args) = self
            .pending
            .take()
            .ok_or_else(|| InitError::Exhausted(self.scheme.clone()))?;
        handler(url, args).await
    }
}

fn parse_usize(what: &str, v: &str) -> Result<usize, InitError> {
    v.trim().parse().map_err(|_| InitError::Invalid {
        what: what.to_owned(),
        value: v.to_owned(),
        expected: "a non-negative integer".into(),
    })
}

/// Rank and world size from the query, or the arguments, never both.
fn rank_and_size(url: &Url, args: &InitArgs) -> Result<(Option<usize>, Option<usize>), InitError> {
    let from_query = |k: &str| url.query.get(k).map(|v| parse_usize(k, v)).transpose();
    let rank = match (from_query("rank")?, args.rank) {
        (Some(_), Some(_)) => return Err(InitError::Conflict("rank")),
        (q, a) => q.or(a),
    };
    let size = match (from_query("world_size")?, args.world_size) {
        (Some(_), Some(_)) => return Err(InitError::Conflict("world_size")),
        (q, a) => q.or(a),
    };
    Ok((rank, size))
}

fn required(v: Option<usize>, what: &str, scheme: &str) -> Result<usize, InitError> {
    v.ok_or_else(|| InitError::Missing {
        what: format!("{what} parameter"),
        hint: format!("add ?{what}=... to the {scheme}:// URL or pass it as an argument"),
    })
}

fn check_rank(rank: usize, world_size: usize) -> Result<(), InitError> {
    if world_size == 0 || rank >= world_size {
        return Err(InitError::Invalid {
            what: "rank".into(),
            value: rank.to_string(),
            expected: format!("0..{world_size} (world_size {world_size})"),
        });
    }
    Ok(())
}

fn file(url: Url, args: InitArgs) -> SchemeFuture {
    Box::pin(async move {
        let (rank, size) = rank_and_size(&url, &args)?;
        let (rank, size) = (
            required(rank, "rank", "file")?,
            required(size, "world_size", "file")?,
        );
        check_rank(rank, size)?;
        let path = format!("{}{}", url.authority, url.path);
        if path.is_empty() {
            return Err(InitError::Missing {
                what: "file path".into(),
                hint: "use file:///absolute/path".into(),
            });
        }
        let store = FileStore::open(&path, size as i64).await?;
        store.set_timeout(args.timeout);
        Ok(Rendezvoused {
            store: Arc::new(store),
            rank,
            world_size: size,
        })
    })
}

/// An error with its causes: `a: b: c`.
fn with_sources(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(s) = next {
        out += &format!(": {s}");
        next = s.source();
    }
    out
}

/// Rank 0 hosts the store, unless `agent_store`. A rank 0 that finds the port
/// taken connects to it as a client instead: it is served already (by `rally
/// store serve`, or a launcher that did not set
/// `TORCHELASTIC_USE_AGENT_STORE=True`). PyTorch fails there with "address
/// already in use"; we say what we did, and fail, naming the port, only if
/// what listens there is not a store.
async fn tcp_store(
    host: String,
    port: u16,
    rank: usize,
    world_size: usize,
    agent_store: bool,
    timeout: Duration,
) -> Result<Rendezvoused, InitError> {
    check_rank(rank, world_size)?;
    let connect = |master: bool| {
        TcpStore::builder(host.clone(), port)
            .is_master(master)
            .world_size(world_size)
            .timeout(timeout)
            .connect()
    };
    let master = rank == 0 && !agent_store;
    let store = match connect(master).await {
        Err(rallypoint_store::StoreError::Listen { source, .. })
            if master && source.kind() == std::io::ErrorKind::AddrInUse =>
        {
            // A store answers its handshake at once; what does not within a
            // few seconds is not one (and must not cost the whole timeout).
            let quick = timeout.min(Duration::from_secs(5));
            let not_a_store = |why: String| {
                InitError::Taken(format!(
                    "rank 0 cannot host the store: {host}:{port} is in use, and what listens there is not a store ({why})"
                ))
            };
            let store = tokio::time::timeout(quick, connect(false))
                .await
                .map_err(|_| not_a_store(format!("no store handshake within {quick:?}")))?
                .map_err(|e| not_a_store(with_sources(&e)))?;
            tracing::warn!(
                "{host}:{port} is already served by a store (rally store serve, or a launcher's): rank 0 uses it as a client instead of hosting one; set TORCHELASTIC_USE_AGENT_STORE=True to say so"
            );
            store
        }
        r => r?,
    };
    Ok(Rendezvoused {
        store: Arc::new(store),
        rank,
        world_size,
    })
}

fn tcp(url: Url, args: InitArgs) -> SchemeFuture {
    Box::pin(async move {
        let (host, port) = url.host_port().map_err(InitError::Url)?;
        let port = port.ok_or_else(|| InitError::Missing {
            what: "port".into(),
            hint: "use tcp://host:port".into(),
        })?;
        let (rank, size) = rank_and_size(&url, &args)?;
        let (rank, size) = (
            required(rank, "rank", "tcp")?,
            required(size, "world_size", "tcp")?,
        );
        tcp_store(host, port, rank, size, false, args.timeout).await
    })
}

fn env(url: Url, args: InitArgs) -> SchemeFuture {
    Box::pin(async move {
        let vars: BTreeMap<String, String> = args
            .env
            .clone()
            .unwrap_or_else(|| std::env::vars().collect());
        let var = |name: &str| {
            vars.get(name).cloned().ok_or_else(|| InitError::Missing {
                what: format!("environment variable {name}"),
                hint: format!("env:// needs {name} set"),
            })
        };
        let (rank, size) = rank_and_size(&url, &args)?;
        let rank = match rank {
            Some(r) => r,
            None => parse_usize("RANK", &var("RANK")?)?,
        };
        let size = match size {
            Some(s) => s,
            None => parse_usize("WORLD_SIZE", &var("WORLD_SIZE")?)?,
        };
        let host = var("MASTER_ADDR")?;
        let port_s = var("MASTER_PORT")?;
        let port: u16 = port_s.trim().parse().map_err(|_| InitError::Invalid {
            what: "MASTER_PORT".into(),
            value: port_s.clone(),
            expected: "a port in 0..65535".into(),
        })?;
        let agent_store =
            vars.get("TORCHELASTIC_USE_AGENT_STORE").map(String::as_str) == Some("True");
        tcp_store(host, port, rank, size, agent_store, args.timeout).await
    })
}
