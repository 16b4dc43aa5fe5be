//! The store torch hands a backend, as the collectives crate's [`Store`].
//!
//! torch gives each backend a `PrefixStore` (group name, then device) over
//! whatever the job uses: a TCPStore (ours or torch's), a FileStore or a
//! HashStore. [`PyStore`] calls that Python object's methods, so every kind of
//! store works and no second rendezvous is needed. Each call runs on a
//! blocking thread and takes the GIL only for the call itself: torch's store
//! methods release the GIL while they wait on the network, so a store call
//! never holds up the training thread, and a training thread busy in Python
//! delays a store call by at most the interpreter's switch interval.
//!
//! The group calls the store while it sets up (the generation and the
//! addresses), at the first collective (which hosts share memory), and on
//! failure (the abort record, who never joined); never on the data path.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};
use rallypoint_store::{Result, Store, StoreError};
use rallypoint_sync::MutexExt;

use crate::life::Pass;

/// A torch `Store` object (any `torch.distributed.Store`).
pub struct PyStore {
    obj: Arc<Py<PyAny>>,
    timeout: Mutex<Duration>,
}

impl PyStore {
    pub fn new(py: Python<'_>, obj: Py<PyAny>) -> PyResult<PyStore> {
        let timeout: Duration = obj.getattr(py, "timeout")?.extract(py)?;
        Ok(PyStore {
            obj: Arc::new(obj),
            timeout: Mutex::new(timeout),
        })
    }

    /// Runs `f` with the GIL on a blocking thread; a Python exception becomes
    /// a store error naming the operation (a `DistStoreError` saying "Wait
    /// timeout" is a timeout).
    async fn call<R, F>(&self, op: &'static str, keys: &[&str], f: F) -> Result<R>
    where
        R: Send + 'static,
        F: for<'py> FnOnce(Python<'py>, &Bound<'py, PyAny>) -> PyResult<R> + Send + 'static,
    {
        let obj = Arc::clone(&self.obj);
        let waited = self.timeout();
        let owned: Vec<String> = keys.iter().map(|k| (*k).to_owned()).collect();
        let joined = tokio::task::spawn_blocking(move || {
            // No Python once the interpreter exits (see `life.rs`).
            let Some(_pass) = Pass::take() else {
                return Err("the process is exiting: no store call can start".to_owned());
            };
            Python::with_gil(|py| f(py, obj.bind(py)).map_err(|e| e.to_string()))
        })
        .await;
        match joined {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(msg)) if msg.contains("timeout") || msg.contains("Timeout") => {
                Err(StoreError::Timeout {
                    op,
                    keys: owned.clone(),
                    missing: owned,
                    waited,
                })
            }
            Ok(Err(msg)) => Err(python_error(op, msg)),
            Err(e) => Err(python_error(
                op,
                format!("the store call's thread failed: {e}"),
            )),
        }
    }
}

fn python_error(op: &'static str, msg: String) -> StoreError {
    StoreError::UnexpectedReply {
        op,
        addr: "torch's store".to_owned(),
        reply: msg,
    }
}

fn keys_list<'py>(py: Python<'py>, keys: &[String]) -> PyResult<Bound<'py, PyList>> {
    PyList::new(py, keys)
}

fn owned(keys: &[&str]) -> Vec<String> {
    keys.iter().map(|k| (*k).to_owned()).collect()
}

#[async_trait::async_trait]
impl Store for PyStore {
    async fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let (k, v) = (key.to_owned(), value.to_vec());
        self.call("set", &[key], move |py, s| {
            s.call_method1("set", (k, PyBytes::new(py, &v)))?;
            Ok(())
        })
        .await
    }

    async fn get_now(&self, key: &str) -> Result<Vec<u8>> {
        let k = key.to_owned();
        self.call("get", &[key], move |_, s| {
            if !s
                .call_method1("check", (vec![k.clone()],))?
                .extract::<bool>()?
            {
                return Ok(Vec::new());
            }
            s.call_method1("get", (k,))?.extract::<Vec<u8>>()
        })
        .await
    }

    async fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let k = key.to_owned();
        self.call("add", &[key], move |_, s| {
            s.call_method1("add", (k, delta))?.extract()
        })
        .await
    }

    async fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        let (k, e, d) = (key.to_owned(), expected.to_vec(), desired.to_vec());
        self.call("compare_set", &[key], move |py, s| {
            s.call_method1(
                "compare_set",
                (k, PyBytes::new(py, &e), PyBytes::new(py, &d)),
            )?
            .extract()
        })
        .await
    }

    async fn wait_timeout(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let ks = owned(keys);
        self.call("wait", keys, move |py, s| {
            s.call_method1("wait", (keys_list(py, &ks)?, timeout))?;
            Ok(())
        })
        .await
    }

    async fn check(&self, keys: &[&str]) -> Result<bool> {
        let ks = owned(keys);
        self.call("check", keys, move |py, s| {
            s.call_method1("check", (keys_list(py, &ks)?,))?.extract()
        })
        .await
    }

    async fn delete_key(&self, key: &str) -> Result<bool> {
        let k = key.to_owned();
        self.call("delete_key", &[key], move |_, s| {
            s.call_method1("delete_key", (k,))?.extract()
        })
        .await
    }

    async fn num_keys(&self) -> Result<i64> {
        self.call("num_keys", &[], |_, s| {
            s.call_method0("num_keys")?.extract()
        })
        .await
    }

    async fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>> {
        let ks = owned(keys);
        self.call("multi_get", keys, move |py, s| {
            s.call_method1("multi_get", (keys_list(py, &ks)?,))?
                .extract()
        })
        .await
    }

    async fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<()> {
        let ks: Vec<String> = pairs.iter().map(|(k, _)| (*k).to_owned()).collect();
        let vs: Vec<Vec<u8>> = pairs.iter().map(|(_, v)| v.to_vec()).collect();
        self.call("multi_set", &[], move |py, s| {
            let values: Vec<Bound<'_, PyBytes>> = vs.iter().map(|v| PyBytes::new(py, v)).collect();
            s.call_method1("multi_set", (keys_list(py, &ks)?, values))?;
            Ok(())
        })
        .await
    }

    async fn append(&self, key: &str, value: &[u8]) -> Result<()> {
        let (k, v) = (key.to_owned(), value.to_vec());
        self.call("append", &[key], move |py, s| {
            s.call_method1("append", (k, PyBytes::new(py, &v)))?;
            Ok(())
        })
        .await
    }

    async fn list_keys(&self) -> Result<Vec<String>> {
        self.call("list_keys", &[], |_, s| {
            s.call_method0("list_keys")?.extract()
        })
        .await
    }

    async fn queue_push(&self, key: &str, value: &[u8]) -> Result<()> {
        let (k, v) = (key.to_owned(), value.to_vec());
        self.call("queue_push", &[key], move |py, s| {
            s.call_method1("queue_push", (k, PyBytes::new(py, &v)))?;
            Ok(())
        })
        .await
    }

    async fn queue_pop(&self, key: &str, block: bool) -> Result<Vec<u8>> {
        let k = key.to_owned();
        self.call("queue_pop", &[key], move |_, s| {
            s.call_method1("queue_pop", (k, block))?.extract()
        })
        .await
    }

    async fn queue_len(&self, key: &str) -> Result<i64> {
        let k = key.to_owned();
        self.call("queue_len", &[key], move |_, s| {
            s.call_method1("queue_len", (k,))?.extract()
        })
        .await
    }

    fn timeout(&self) -> Duration {
        *self.timeout.locked()
    }

    fn set_timeout(&self, timeout: Duration) {
        *self.timeout.locked() = timeout;
    }
}
