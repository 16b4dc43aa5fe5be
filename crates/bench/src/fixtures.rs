//! What several measurements share, below them all: where the repository and
//! its Python are, a store server for their workers, and raw TCP between two
//! processes (the ceiling a transport is compared with).

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};

/// The workspace's root, where the Python scripts and `.venv` are.
pub(crate) fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The Python of the comparisons with PyTorch: `RALLY_PYTHON`, else the
/// repository's `.venv`.
pub(crate) fn python() -> PathBuf {
    std::env::var_os("RALLY_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join(".venv/bin/python"))
}

/// One of our store servers on its own runtime, for a measurement's workers.
pub(crate) struct StoreServer {
    pub(crate) rt: tokio::runtime::Runtime,
    pub(crate) port: u16,
    /// The running server (its request counts, for measurements of them).
    pub(crate) handle: rallypoint_store::server::ServerHandle,
}

pub(crate) fn store_server() -> Result<StoreServer> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let server = rt.block_on(rallypoint_store::server::Server::bind(
        "127.0.0.1:0".parse()?,
        Default::default(),
    ))?;
    let port = server.local_addr().port();
    let handle = rt.block_on(async { server.spawn() });
    Ok(StoreServer { rt, port, handle })
}

/// Raw TCP from one process to another (`duplex`: both ways at once): the
/// slower receiver's bytes/s.
pub(crate) fn raw_pair(bytes: u64, duplex: bool) -> Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let port = listener.local_addr()?.port();
    drop(listener);
    let spawn = |role: &str| {
        Command::new(std::env::current_exe()?)
            .args([
                "coll-raw",
                role,
                &port.to_string(),
                &bytes.to_string(),
                if duplex { "duplex" } else { "simplex" },
            ])
            .stdout(Stdio::piped())
            .spawn()
            .context("starting a raw TCP process")
    };
    let a = spawn("listen")?;
    std::thread::sleep(Duration::from_millis(200));
    let b = spawn("connect")?;
    slowest_rate([a, b])
}

/// Waits for raw TCP processes; the slowest `RATE` their receivers
/// reported (bytes/s).
pub(crate) fn slowest_rate(children: [std::process::Child; 2]) -> Result<f64> {
    let mut rates = vec![];
    for c in children {
        let out = c.wait_with_output()?;
        if !out.status.success() {
            bail!("raw TCP process failed");
        }
        for l in String::from_utf8_lossy(&out.stdout).lines() {
            if let Some(v) = l.strip_prefix("RATE ") {
                rates.push(v.trim().parse::<f64>()?);
            }
        }
    }
    rates
        .into_iter()
        .reduce(f64::min)
        .context("no rate reported")
}
