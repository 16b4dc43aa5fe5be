//! `rallypoint._native`: the collectives crate as a Python extension module,
//! for the `rally` backend of `torch.distributed` (`python/rallypoint/torch.py`).
//!
//! It is used from Python, never from Rust (a `cdylib` alone, so it has no
//! doc tests: `crates/rally/tests/run/torch_backend.rs` runs it under real
//! torch). A training script picks the backend by name:
//!
//! ```python
//! import rallypoint.torch  # registers "rally"
//! import torch.distributed as dist
//!
//! dist.init_process_group("rally")  # env://, as with gloo
//! t = torch.ones(4)
//! dist.all_reduce(t)
//! ```
//!
//! It also carries `FtManager`, the replica group's manager of
//! `rallypoint.ft` (crate `rallypoint-ft`) for a job started without
//! `rally run --ft`, on a runtime of its own (see `ft.rs`).
//!
//! # How a call goes
//!
//! torch calls the Python backend's method (`allreduce`, ...) through its
//! `Backend` trampoline, holding the GIL. The method checks the tensors,
//! makes a `torch.futures.Future`, and calls one method of `Group` here
//! with the tensors' addresses and lengths, a dtype code and a token (the
//! future and the op's outputs). The method spawns the operation on this
//! module's runtime and returns at once; torch wraps the future in a `Work`.
//!
//! The operation runs on the runtime's threads, never holding the GIL, and
//! works in the tensors' memory in place (all_reduce, broadcast and the
//! contiguous all_gather receive straight into it). When it ends, the thread
//! takes the GIL once and calls the backend's completion function with the
//! token and the error, if any, which completes the future. `Work.wait()`
//! waits on that future with the GIL released.
//!
//! # Memory
//!
//! The Python side keeps every tensor an op reads or writes alive in the
//! token until the op ends, and the op's future is dropped before the
//! completion function runs (it releases the token), so the raw slices made
//! here never outlive their tensors. The tensors must not be touched until
//! the op's `Work` completes, as with every torch backend.
//!
//! # Exit
//!
//! The runtime's threads never enter Python once the interpreter has begun to
//! exit: `rallypoint.torch` registers [`shutdown`] with `atexit`, which aborts
//! the groups that still have ops in flight and waits for our threads to leave
//! Python (see `life.rs`).

mod ft;
mod life;
mod store;

use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use rallypoint_collectives::{bf16, f16, Element, Error, Options, ProcessGroup, ReduceOp};

use life::{InFlight, Live, Pass};
use store::PyStore;

/// The runtime every group's connections and operations run on: two worker
/// threads (reading connections while an op reduces), started at the first
/// group and alive for the process.
fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("rallypoint-torch")
            .enable_all()
            .build()
            .expect("starting the rallypoint runtime")
    })
}

/// A tensor's memory: its address and its length in elements.
#[derive(Clone, Copy)]
struct Raw {
    addr: usize,
    len: usize,
}

impl Raw {
    /// The memory as a slice of `T`.
    ///
    /// # Safety
    ///
    /// The memory must hold `len` elements of `T`, stay alive and be touched
    /// by nobody else for as long as the slice is used (see "Memory" above).
    unsafe fn slice<'a, T: Element>(self) -> PyResult<&'a mut [T]> {
        if self.len == 0 {
            return Ok(&mut []);
        }
        if self.addr == 0 || !self.addr.is_multiple_of(std::mem::align_of::<T>()) {
            return Err(PyValueError::new_err(format!(
                "rally: tensor memory at {:#x} is not aligned for its dtype",
                self.addr
            )));
        }
        // SAFETY: non-null and aligned (checked above); the caller vouches
        // for the length, the lifetime and exclusive use.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.addr as *mut T, self.len) })
    }
}

/// A buffer of the extension's own that an op borrows for its whole run
/// (the op is started before the task that frees it exists).
struct Scratch<T>(*mut [T]);

// SAFETY: it owns its elements, as a Box<[T]> does.
unsafe impl<T: Send> Send for Scratch<T> {}

impl<T> Scratch<T> {
    fn new(v: Vec<T>) -> Scratch<T> {
        Scratch(Box::into_raw(v.into_boxed_slice()))
    }

    /// # Safety
    ///
    /// One slice at a time, used only before [`Scratch::into_vec`].
    unsafe fn slice<'a>(&self) -> &'a mut [T] {
        // SAFETY: from Box::into_raw, alive until into_vec.
        unsafe { &mut *self.0 }
    }

    /// # Safety
    ///
    /// No slice of it may be in use.
    unsafe fn into_vec(self) -> Vec<T> {
        // SAFETY: from Box::into_raw, taken back once.
        unsafe { Box::from_raw(self.0) }.into_vec()
    }
}

fn raws(addrs: &[usize], len: usize) -> Vec<Raw> {
    addrs.iter().map(|&addr| Raw { addr, len }).collect()
}

/// Runs `$body` with `$T` the element type of dtype code `$code`: the crate's
/// `DType` codes (`bool` travels as `u8`, with its operators mapped by the
/// Python side).
macro_rules! with_dtype {
    ($code:expr, $T:ident => $body:expr) => {
        match $code {
            1 => {
                type $T = u8;
                $body
            }
            2 => {
                type $T = i8;
                $body
            }
            4 => {
                type $T = i16;
                $body
            }
            6 => {
                type $T = i32;
                $body
            }
            8 => {
                type $T = i64;
                $body
            }
            9 => {
                type $T = f16;
                $body
            }
            10 => {
                type $T = bf16;
                $body
            }
            11 => {
                type $T = f32;
                $body
            }
            12 => {
                type $T = f64;
                $body
            }
            other => Err(PyValueError::new_err(format!(
                "rally: unsupported dtype code {other}"
            ))),
        }
    };
}

fn reduce_op(code: u8) -> PyResult<ReduceOp> {
    ReduceOp::ALL
        .get(usize::from(code).wrapping_sub(1))
        .copied()
        .ok_or_else(|| PyValueError::new_err(format!("rally: unsupported reduce op code {code}")))
}

/// Which torch error class an error maps to (see `rallypoint/torch.py`).
fn kind(e: &Error) -> &'static str {
    match e {
        Error::PeerGone { .. } | Error::ConnectionLost { .. } => "gone",
        Error::Timeout { .. } => "timeout",
        Error::Mismatch { .. } | Error::Diverged { .. } | Error::MessageMismatch { .. } => {
            "mismatch"
        }
        Error::Invalid(_) => "invalid",
        Error::Aborted { .. } => "aborted",
        _ => "backend",
    }
}

/// One torch process group's collectives on this rank.
#[pyclass(frozen, module = "rallypoint._native")]
struct Group {
    live: Arc<Live>,
    /// `done(token, kind, message)`: completes an op's future.
    done: Arc<Py<PyAny>>,
    /// Numbers the all_to_all calls with uneven splits, which run as
    /// messages with tags above every tag torch lets users pick.
    uneven: AtomicU32,
}

impl Group {
    fn pg(&self, timeout: Option<f64>) -> ProcessGroup {
        let pg = self.live.pg();
        match timeout {
            Some(s) if s > 0.0 => pg.with_timeout(Duration::from_secs_f64(s)),
            _ => pg.clone(),
        }
    }

    /// Runs `op`; its end completes `token` through `done`. A call the
    /// caller will wait for at once (torch's `async_op=False`: `now`) runs on
    /// the calling thread, with the GIL released: no thread hands the op or
    /// its end to another, which is most of a small op's time. Any other op
    /// is spawned on the runtime (so is a call from the runtime's own
    /// threads: a future's callback).
    fn submit<F>(&self, py: Python<'_>, now: bool, token: PyObject, op: F) -> PyResult<()>
    where
        F: Future<Output = rallypoint_collectives::Result<()>> + Send + 'static,
    {
        let Some(flight) = self.live.begin() else {
            return Err(exiting());
        };
        if now && tokio::runtime::Handle::try_current().is_err() {
            let r = py.allow_threads(|| runtime().block_on(op));
            drop(flight);
            finish(py, &self.done, token, r);
            return Ok(());
        }
        let done = Arc::clone(&self.done);
        runtime().spawn(async move {
            let r = op.await;
            end(flight, &done, token, r);
        });
        Ok(())
    }
}

/// A group's store and options from `Group`'s arguments.
fn group_args(
    py: Python<'_>,
    store: Py<PyAny>,
    timeout: f64,
    name: String,
    advertise: Option<String>,
) -> PyResult<(Arc<PyStore>, Options)> {
    let advertise = advertise
        .map(|a| {
            a.parse::<std::net::IpAddr>().map_err(|_| {
                PyValueError::new_err(format!("rally: advertise {a:?} is not an IP address"))
            })
        })
        .transpose()?;
    let store = Arc::new(PyStore::new(py, store)?);
    let opts = Options {
        prefix: name,
        timeout: Duration::from_secs_f64(timeout.max(0.001)),
        advertise,
        ..Options::default()
    };
    Ok((store, opts))
}

impl Group {
    fn formed(pg: ProcessGroup, done: Py<PyAny>) -> Group {
        Group {
            live: Live::new(pg),
            done: Arc::new(done),
            uneven: AtomicU32::new(0),
        }
    }
}

/// The error of a call made while the interpreter exits.
fn exiting() -> PyErr {
    PyRuntimeError::new_err("rally: the process is exiting; no new operation can start")
}

/// An op spawned on the runtime has ended: it completes its future, unless the
/// interpreter is exiting (see `life.rs`). The op counts as in flight until
/// its pass is taken, so that the exit waits for its future to complete.
fn end(flight: InFlight, done: &Py<PyAny>, token: PyObject, r: rallypoint_collectives::Result<()>) {
    let pass = Pass::take();
    drop(flight);
    match pass {
        Some(_pass) => Python::with_gil(|py| finish(py, done, token, r)),
        // Without the GIL: pyo3 defers the reference count, and the exit
        // never runs it, which is what an exiting process wants.
        None => drop(token),
    }
}

/// Completes an op: `done(token, kind, message)`.
fn finish(
    py: Python<'_>,
    done: &Py<PyAny>,
    token: PyObject,
    r: rallypoint_collectives::Result<()>,
) {
    let (k, msg) = match &r {
        Ok(()) => (None, None),
        Err(e) => (Some(kind(e)), Some(e.to_string())),
    };
    if let Err(e) = done.call1(py, (token, k, msg)) {
        e.print(py);
    }
}

// The methods mirror torch's calls, one Python argument each.
#[allow(clippy::too_many_arguments)]
#[pymethods]
impl Group {
    /// Forms the group through `store` (a torch Store), blocking with the GIL
    /// released. `done` completes ops (see [`Group::submit`]). `advertise`:
    /// the IP address to listen on and publish (default: the collectives'
    /// rule, the route to `MASTER_ADDR`).
    #[new]
    #[pyo3(signature = (store, rank, size, timeout, name, done, advertise=None))]
    fn new(
        py: Python<'_>,
        store: Py<PyAny>,
        rank: usize,
        size: usize,
        timeout: f64,
        name: String,
        done: Py<PyAny>,
        advertise: Option<String>,
    ) -> PyResult<Group> {
        let (store, opts) = group_args(py, store, timeout, name, advertise)?;
        let pg = py
            .allow_threads(|| runtime().block_on(ProcessGroup::new(store, rank, size, opts)))
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
        Ok(Group::formed(pg, done))
    }

    /// The next generation of a group whose members change (see
    /// `ProcessGroup::next_generation`): over `prev`'s connections to the
    /// members that survive, when `prev` is this process's last generation.
    #[staticmethod]
    #[pyo3(signature = (prev, store, rank, size, timeout, name, done, advertise=None))]
    fn next_generation(
        py: Python<'_>,
        prev: Option<Py<Group>>,
        store: Py<PyAny>,
        rank: usize,
        size: usize,
        timeout: f64,
        name: String,
        done: Py<PyAny>,
        advertise: Option<String>,
    ) -> PyResult<Group> {
        let (store, mut opts) = group_args(py, store, timeout, name, advertise)?;
        // A generation's process lives on after a failure (the next
        // generation replaces it): its failing ops do not wait to tell a
        // member that cannot be told (cut off, stalled).
        opts.tell_before_failing = false;
        let prev = prev.map(|p| p.get().live.pg().clone());
        let pg = py
            .allow_threads(|| {
                runtime().block_on(ProcessGroup::next_generation(
                    prev.as_ref(),
                    store,
                    rank,
                    size,
                    opts,
                ))
            })
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
        Ok(Group::formed(pg, done))
    }

    /// Connections this rank's transport has established, over every
    /// generation that shared it.
    fn handshakes(&self) -> u64 {
        self.live.pg().handshakes()
    }

    #[pyo3(signature = (token, addr, len, dtype, op, timeout=None, now=false))]
    fn all_reduce(
        &self,
        py: Python<'_>,
        token: PyObject,
        addr: usize,
        len: usize,
        dtype: u8,
        op: u8,
        timeout: Option<f64>,
        now: bool,
    ) -> PyResult<()> {
        let (pg, op, raw) = (self.pg(timeout), reduce_op(op)?, Raw { addr, len });
        with_dtype!(dtype, T => {
            // SAFETY: see "Memory"; the spawned future runs to its end.
            let buf = unsafe { raw.slice::<T>()? };
            // SAFETY: as above.
            self.submit(py, now, token, unsafe { pg.start_all_reduce(buf, op) })
        })
    }

    #[pyo3(signature = (token, addr, len, dtype, root, timeout=None, now=false))]
    fn broadcast(
        &self,
        py: Python<'_>,
        token: PyObject,
        addr: usize,
        len: usize,
        dtype: u8,
        root: usize,
        timeout: Option<f64>,
        now: bool,
    ) -> PyResult<()> {
        let (pg, raw) = (self.pg(timeout), Raw { addr, len });
        with_dtype!(dtype, T => {
            // SAFETY: as in all_reduce.
            let buf = unsafe { raw.slice::<T>()? };
            // SAFETY: as above.
            self.submit(py, now, token, unsafe { pg.start_broadcast(buf, root) })
        })
    }

    #[pyo3(signature = (token, addr, len, dtype, root, op, timeout=None, now=false))]
    fn reduce(
        &self,
        py: Python<'_>,
        token: PyObject,
        addr: usize,
        len: usize,
        dtype: u8,
        root: usize,
        op: u8,
        timeout: Option<f64>,
        now: bool,
    ) -> PyResult<()> {
        let (pg, op, raw) = (self.pg(timeout), reduce_op(op)?, Raw { addr, len });
        with_dtype!(dtype, T => {
            // SAFETY: as in all_reduce.
            let buf = unsafe { raw.slice::<T>()? };
            self.submit(py, now, token, pg.start_reduce(buf, root, op))
        })
    }

    /// all_gather of `len` elements per rank into one tensor (`out`, `len` ×
    /// size elements) or, with `outs`, into one tensor per rank.
    #[pyo3(signature = (token, addr, len, dtype, out=None, outs=None, timeout=None, now=false))]
    fn all_gather(
        &self,
        py: Python<'_>,
        token: PyObject,
        addr: usize,
        len: usize,
        dtype: u8,
        out: Option<usize>,
        outs: Option<Vec<usize>>,
        timeout: Option<f64>,
        now: bool,
    ) -> PyResult<()> {
        let (pg, input) = (self.pg(timeout), Raw { addr, len });
        let n = pg.size();
        with_dtype!(dtype, T => {
            // SAFETY: as in all_reduce, for the input and every output.
            let input = unsafe { input.slice::<T>()? };
            if let Some(out) = out {
                // SAFETY: as above.
                let out = unsafe { Raw { addr: out, len: len * n }.slice::<T>()? };
                // SAFETY: as above.
                return self.submit(py, now, token, unsafe { pg.start_all_gather(input, out) });
            }
            let outs = outs.ok_or_else(|| PyValueError::new_err("rally: all_gather needs out or outs"))?;
            let outs: Vec<&mut [T]> = raws(&outs, len)
                .into_iter()
                // SAFETY: as above.
                .map(|r| unsafe { r.slice::<T>() })
                .collect::<PyResult<_>>()?;
            // The gathered parts land in one buffer, whose op starts now.
            let all = Scratch::new(vec![T::default(); len * n]);
            // SAFETY: the op's future is the buffer's only user, and is done
            // before `into_vec` (below).
            let op = unsafe { pg.start_all_gather(input, all.slice()) };
            self.submit(py, now, token, async move {
                let r = op.await;
                // SAFETY: the op's future is done.
                let all = unsafe { all.into_vec() };
                r?;
                for (o, part) in outs.into_iter().zip(all.chunks(len.max(1))) {
                    o.copy_from_slice(part);
                }
                Ok(())
            })
        })
    }

    /// gather of `len` elements per rank; `outs` (one tensor per rank) at the root.
    #[pyo3(signature = (token, addr, len, dtype, root, outs=None, timeout=None, now=false))]
    fn gather(
        &self,
        py: Python<'_>,
        token: PyObject,
        addr: usize,
        len: usize,
        dtype: u8,
        root: usize,
        outs: Option<Vec<usize>>,
        timeout: Option<f64>,
        now: bool,
    ) -> PyResult<()> {
        let pg = self.pg(timeout);
        with_dtype!(dtype, T => {
            // SAFETY: as in all_reduce.
            let input = unsafe { Raw { addr, len }.slice::<T>()? };
            let outs: Vec<&mut [T]> = raws(outs.as_deref().unwrap_or(&[]), len)
                .into_iter()
                // SAFETY: as above.
                .map(|r| unsafe { r.slice::<T>() })
                .collect::<PyResult<_>>()?;
            let op = pg.start_gather(input, root);
            self.submit(py, now, token, async move {
                if let Some(all) = op.await? {
                    for (o, part) in outs.into_iter().zip(all.chunks(len.max(1))) {
                        o.copy_from_slice(part);
                    }
                }
                Ok(())
            })
        })
    }

    /// scatter of `len` elements to each rank; `ins` (one tensor per rank) at the root.
    #[pyo3(signature = (token, addr, len, dtype, root, ins=None, timeout=None, now=false))]
    fn scatter(
        &self,
        py: Python<'_>,
        token: PyObject,
        addr: usize,
        len: usize,
        dtype: u8,
        root: usize,
        ins: Option<Vec<usize>>,
        timeout: Option<f64>,
        now: bool,
    ) -> PyResult<()> {
        let pg = self.pg(timeout);
        with_dtype!(dtype, T => {
            // SAFETY: as in all_reduce.
            let out = unsafe { Raw { addr, len }.slice::<T>()? };
            let ins: Option<Vec<&mut [T]>> = match ins {
                Some(ins) => Some(
                    raws(&ins, len)
                        .into_iter()
                        // SAFETY: as above.
                .map(|r| unsafe { r.slice::<T>() })
                        .collect::<PyResult<_>>()?,
                ),
                None => None,
            };
            // The root's parts, copied into one buffer the op borrows.
            let all = ins.map(|ins| Scratch::new(ins.concat()));
            // SAFETY: as in all_gather.
            let op = pg.start_scatter(all.as_ref().map(|a| &*unsafe { a.slice() }), out, root);
            self.submit(py, now, token, async move {
                let r = op.await;
                // SAFETY: the op's future is done.
                drop(all.map(|a| unsafe { a.into_vec() }));
                r
            })
        })
    }

    /// reduce_scatter of `len` × size elements in `addr` into `len` in `out`.
    #[pyo3(signature = (token, addr, out, len, dtype, op, timeout=None, now=false))]
    fn reduce_scatter(
        &self,
        py: Python<'_>,
        token: PyObject,
        addr: usize,
        out: usize,
        len: usize,
        dtype: u8,
        op: u8,
        timeout: Option<f64>,
        now: bool,
    ) -> PyResult<()> {
        let (pg, op) = (self.pg(timeout), reduce_op(op)?);
        let n = pg.size();
        with_dtype!(dtype, T => {
            // SAFETY: as in all_reduce.
            let input = unsafe { Raw { addr, len: len * n }.slice::<T>()? };
            // SAFETY: as above.
            let out = unsafe { Raw { addr: out, len }.slice::<T>()? };
            self.submit(py, now, token, pg.start_reduce_scatter(input, out, op))
        })
    }

    /// all_to_all: `in_splits[p]` elements of `addr` go to rank p, and
    /// `out_splits[p]` elements from rank p land in `out`. Even splits run as
    /// one collective; uneven ones as one message each way per pair.
    #[pyo3(signature = (token, addr, in_splits, out, out_splits, dtype, timeout=None, now=false))]
    fn all_to_all(
        &self,
        py: Python<'_>,
        token: PyObject,
        addr: usize,
        in_splits: Vec<usize>,
        out: usize,
        out_splits: Vec<usize>,
        dtype: u8,
        timeout: Option<f64>,
        now: bool,
    ) -> PyResult<()> {
        let pg = self.pg(timeout);
        let (n, me) = (pg.size(), pg.rank());
        if in_splits.len() != n || out_splits.len() != n {
            return Err(PyValueError::new_err(format!(
                "rally: all_to_all needs {n} input and output splits, got {} and {}",
                in_splits.len(),
                out_splits.len()
            )));
        }
        let (in_total, out_total) = (in_splits.iter().sum(), out_splits.iter().sum());
        let even = in_splits
            .iter()
            .chain(&out_splits)
            .all(|&s| s == in_splits[0]);
        let tag = 0x8000_0000
            | (self.uneven.fetch_add(u32::from(!even), Ordering::Relaxed) & 0x7fff_ffff);
        with_dtype!(dtype, T => {
            // SAFETY: as in all_reduce.
            let input = unsafe { Raw { addr, len: in_total }.slice::<T>()? };
            // SAFETY: as above.
            let output = unsafe { Raw { addr: out, len: out_total }.slice::<T>()? };
            if even {
                return self.submit(py, now, token, pg.start_all_to_all(input, output));
            }
            let (ins, outs) = (split(input, &in_splits), split(output, &out_splits));
            // One message each way per pair, numbered now.
            let mut tasks = tokio::task::JoinSet::new();
            let _in_runtime = runtime().enter();
            for (p, (i, o)) in ins.into_iter().zip(outs).enumerate() {
                if p == me {
                    o.copy_from_slice(i);
                    continue;
                }
                tasks.spawn(pg.start_send(i, p, tag));
                tasks.spawn(pg.start_recv(o, p, tag));
            }
            self.submit(py, now, token, async move {
                let mut first = Ok(());
                while let Some(r) = tasks.join_next().await {
                    let r = r.unwrap_or_else(|e| Err(Error::Invalid(format!("all_to_all task: {e}"))));
                    if first.is_ok() {
                        first = r;
                    }
                }
                first
            })
        })
    }

    #[pyo3(signature = (token, addr, len, dtype, dst, tag))]
    fn send(
        &self,
        py: Python<'_>,
        token: PyObject,
        addr: usize,
        len: usize,
        dtype: u8,
        dst: usize,
        tag: u32,
    ) -> PyResult<()> {
        let pg = self.live.pg().clone();
        with_dtype!(dtype, T => {
            // SAFETY: as in all_reduce.
            let data = unsafe { Raw { addr, len }.slice::<T>()? };
            // A message never runs on the caller: its peer may wait for this
            // rank's next call (isend then recv).
            self.submit(py, false, token, pg.start_send(&*data, dst, tag))
        })
    }

    #[pyo3(signature = (token, addr, len, dtype, src, tag))]
    fn recv(
        &self,
        py: Python<'_>,
        token: PyObject,
        addr: usize,
        len: usize,
        dtype: u8,
        src: usize,
        tag: u32,
    ) -> PyResult<()> {
        let pg = self.live.pg().clone();
        with_dtype!(dtype, T => {
            // SAFETY: as in all_reduce.
            let out = unsafe { Raw { addr, len }.slice::<T>()? };
            self.submit(py, false, token, pg.start_recv(out, src, tag))
        })
    }

    /// Aborts the group: every op in flight and every later one fails at
    /// once, here and on every member (each is told), with an error naming
    /// this rank and `reason`. Idempotent; the first reason stays.
    fn abort(&self, py: Python<'_>, reason: &str) {
        let pg = self.live.pg().clone();
        py.allow_threads(|| {
            let _in_runtime = runtime().enter();
            pg.abort(reason);
        });
    }

    /// The error the group's ops fail with once it is aborted (here or by a
    /// member), or `None`.
    fn aborted(&self) -> Option<String> {
        self.live.pg().aborted().map(|e| e.to_string())
    }

    /// Ops started on this group and not yet ended.
    fn in_flight(&self) -> usize {
        self.live.in_flight()
    }

    /// The address this rank listens on for its peers (`ip:port`).
    fn local_addr(&self) -> String {
        self.live.pg().local_addr().to_string()
    }

    /// This rank and the group's size.
    fn rank(&self) -> usize {
        self.live.pg().rank()
    }

    fn size(&self) -> usize {
        self.live.pg().size()
    }

    #[pyo3(signature = (token, timeout=None, now=false))]
    fn barrier(
        &self,
        py: Python<'_>,
        token: PyObject,
        timeout: Option<f64>,
        now: bool,
    ) -> PyResult<()> {
        let pg = self.pg(timeout);
        self.submit(py, now, token, pg.start_barrier())
    }
}

/// `buf` cut into consecutive parts of `sizes` elements.
fn split<'a, T>(mut buf: &'a mut [T], sizes: &[usize]) -> Vec<&'a mut [T]> {
    sizes
        .iter()
        .map(|&s| {
            let (head, tail) = std::mem::take(&mut buf).split_at_mut(s);
            buf = tail;
            head
        })
        .collect()
}

/// Called by `atexit` (registered by `rallypoint.torch`): after it, no thread
/// of ours enters Python. See `life.rs`.
#[pyfunction]
fn shutdown(py: Python<'_>) {
    let left = py.allow_threads(|| life::shutdown(life::EXIT_DEADLINE));
    if left.in_flight > 0 || left.in_python > 0 {
        eprintln!(
            "rally: exiting with {} operation(s) still running and {} store call(s) still in \
             Python after {} s; they are abandoned",
            left.in_flight,
            left.in_python,
            life::EXIT_DEADLINE.as_secs()
        );
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Group>()?;
    m.add_class::<ft::FtManager>()?;
    m.add_function(wrap_pyfunction!(shutdown, m)?)?;
    Ok(())
}
