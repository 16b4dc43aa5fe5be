//! `rallypoint._native.FtManager`: the replica group's manager
//! (`rallypoint_ft::Manager`) run inside a Python process, for a job
//! started without `rally run --ft` (group rank 0 starts it; see
//! `python/rallypoint/ft/`).
//!
//! Each manager has a tokio runtime of its own (one worker thread, named
//! `rally-ft-manager`) that serves the workers' connections, the store and
//! the lighthouse connection while Python runs the training loop. The
//! manager never calls into Python, so its threads need no pass at the
//! interpreter's exit (unlike the collectives' runtime, see `life.rs`).
//! Every call that waits (starting, shutting down) releases the GIL.

use std::net::SocketAddr;
use std::time::Duration;

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use rallypoint_ft::{Config, Manager, Status};
use tokio::sync::watch;

/// How long `shutdown` waits for the runtime's tasks to end.
const SHUTDOWN_LIMIT: Duration = Duration::from_secs(10);

/// A running manager and its runtime.
#[pyclass(module = "rallypoint._native", name = "FtManager")]
pub struct FtManager {
    running: Option<(tokio::runtime::Runtime, Manager)>,
    address: String,
    store_address: String,
    status: watch::Receiver<Status>,
}

#[pymethods]
impl FtManager {
    /// Starts a manager for replica group `replica_id` of `world_size`
    /// ranks, talking to the lighthouse at `lighthouse`
    /// (`http://host:port`); binds `bind` for the workers and the same IP,
    /// any port, for the store. `connect_timeout` is another name of
    /// `connect_timeout_s` (`rallypoint.ft` passes it by that name); it
    /// wins when both are given.
    #[new]
    #[pyo3(signature = (replica_id, lighthouse, world_size, bind="0.0.0.0:0", connect_timeout_s=60.0, heartbeat_ms=100, connect_timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        replica_id: String,
        lighthouse: String,
        world_size: usize,
        bind: &str,
        connect_timeout_s: f64,
        heartbeat_ms: u64,
        connect_timeout: Option<f64>,
    ) -> PyResult<FtManager> {
        let connect_timeout_s = connect_timeout.unwrap_or(connect_timeout_s);
        let bind: SocketAddr = bind.parse().map_err(|e| {
            PyValueError::new_err(format!("bind {bind:?} is not an IP:PORT address: {e}"))
        })?;
        if !(connect_timeout_s.is_finite() && connect_timeout_s > 0.0) {
            let e = format!(
                "connect_timeout_s must be a positive number of seconds, not {connect_timeout_s}"
            );
            return Err(PyValueError::new_err(e));
        }
        if heartbeat_ms == 0 {
            return Err(PyValueError::new_err("heartbeat_ms must be positive"));
        }
        let mut config = Config::new(&replica_id, &lighthouse, world_size);
        config.bind = bind;
        config.connect_timeout = Duration::from_secs_f64(connect_timeout_s);
        config.heartbeat_interval = Duration::from_millis(heartbeat_ms);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("rally-ft-manager")
            .enable_all()
            .build()
            .map_err(|e| PyRuntimeError::new_err(format!("starting the manager's runtime: {e}")))?;
        let manager = py
            .allow_threads(|| rt.block_on(Manager::start(config)))
            .map_err(|e| PyRuntimeError::new_err(format!("rally ft manager: {e}")))?;
        Ok(FtManager {
            address: manager.address().to_owned(),
            store_address: manager.store_address().to_owned(),
            status: manager.status(),
            running: Some((rt, manager)),
        })
    }

    /// The workers' endpoint, `host:port`.
    fn address(&self) -> String {
        self.address.clone()
    }

    /// The store of the cross-replica process groups, `host:port`.
    fn store_address(&self) -> String {
        self.store_address.clone()
    }

    /// The manager's status as a dict (`rallypoint_ft::Status`'s fields).
    fn status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let s = self.status.borrow().clone();
        let text = serde_json::to_string(&s)
            .map_err(|e| PyRuntimeError::new_err(format!("encoding the status: {e}")))?;
        py.import("json")?.call_method1("loads", (text,))
    }

    /// Fails every waiting call of the group with `reason` and drops the
    /// lighthouse connection (the next hello reconnects).
    fn workers_stopped(&self, reason: &str) -> PyResult<()> {
        let (_, m) = self.running.as_ref().ok_or_else(stopped)?;
        m.workers_stopped(reason);
        Ok(())
    }

    /// Stops the manager: its connections, the store and the runtime.
    /// Calling it again does nothing.
    fn shutdown(&mut self, py: Python<'_>) {
        if let Some((rt, m)) = self.running.take() {
            py.allow_threads(|| {
                rt.block_on(async {
                    let _ = tokio::time::timeout(SHUTDOWN_LIMIT, m.shutdown()).await;
                });
                rt.shutdown_timeout(SHUTDOWN_LIMIT);
            });
        }
    }
}

impl Drop for FtManager {
    fn drop(&mut self) {
        // Dropped without shutdown: the runtime's tasks end in the
        // background (dropping a runtime may not block here).
        if let Some((rt, m)) = self.running.take() {
            drop(m);
            rt.shutdown_background();
        }
    }
}

fn stopped() -> PyErr {
    PyRuntimeError::new_err("this FtManager was shut down")
}
