//! Registered Rust functions as worker entrypoints.
//!
//! A worker of [`Entrypoint::Function`](super::Entrypoint::Function) re-executes the
//! current binary with the function's name in `RALLY_WORKER_FUNCTION`, its
//! per-rank arguments as `argv[1..]`, and a file for the return value in
//! `RALLY_WORKER_RESULT`. The binary must call [`dispatch`] first thing in `main`:
//! in a worker it runs the function and exits; otherwise it returns `None` and the
//! program goes on.
//!
//! ```no_run
//! use rallypoint_elastic::multiprocessing::functions::{dispatch, Registry};
//!
//! fn square(args: &[String]) -> Result<Vec<u8>, String> {
//!     let n: i64 = args[0].parse().map_err(|e| format!("{e}"))?;
//!     Ok((n * n).to_string().into_bytes())
//! }
//!
//! fn main() {
//!     let registry = Registry::new().register("square", square);
//!     if let Some(code) = dispatch(&registry) {
//!         std::process::exit(code);
//!     }
//!     // ... the launcher's own work ...
//! }
//! ```
//!
//! A function that returns `Err` records it in the error file and exits 1; one that
//! panics has the panic recorded by [`install_panic_hook`] and exits 101.

use std::collections::BTreeMap;
use std::path::PathBuf;

use crate::errors::{install_panic_hook, record};

/// Names the function a re-executed worker runs.
pub const FUNCTION_ENV: &str = "RALLY_WORKER_FUNCTION";
/// Where a function worker writes its return value.
pub const RESULT_ENV: &str = "RALLY_WORKER_RESULT";

/// A worker function: per-rank arguments in, return value out.
pub type WorkerFn = fn(&[String]) -> Result<Vec<u8>, String>;

/// The functions this binary can run as workers.
#[derive(Default, Clone)]
pub struct Registry {
    functions: BTreeMap<String, WorkerFn>,
}

impl Registry {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `f` under `name`. Registering one name twice is a programming error.
    pub fn register(mut self, name: &str, f: WorkerFn) -> Self {
        let previous = self.functions.insert(name.to_owned(), f);
        assert!(
            previous.is_none(),
            "worker function {name:?} registered twice"
        );
        self
    }

    pub fn get(&self, name: &str) -> Option<WorkerFn> {
        self.functions.get(name).copied()
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.functions.keys().map(String::as_str)
    }
}

/// In a function worker, runs the function and returns the exit code; otherwise
/// `None`.
pub fn dispatch(registry: &Registry) -> Option<i32> {
    let name = std::env::var(FUNCTION_ENV).ok()?;
    install_panic_hook();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = record(|| {
        let f = registry.get(&name).ok_or_else(|| {
            let known: Vec<&str> = registry.names().collect();
            format!("no worker function named {name:?} (registered: {known:?})")
        })?;
        let value = f(&args)?;
        if let Some(path) = std::env::var_os(RESULT_ENV).map(PathBuf::from) {
            std::fs::write(&path, value)
                .map_err(|e| format!("cannot write the return value to {}: {e}", path.display()))?;
        }
        Ok::<(), String>(())
    });
    Some(match result {
        Ok(()) => 0,
        Err(e) => {
            // One write, so that other workers' output cannot split it.
            let line = format!("worker function {name:?} failed: {e}\n");
            let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
            1
        }
    })
}
