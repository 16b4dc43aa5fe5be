//! The extension's part in the interpreter's exit.
//!
//! The runtime's threads call into Python: an op's end completes its torch
//! future (`done`), and a store call runs the torch store's method. The
//! interpreter does not know those threads. Once it has begun to finalize, a
//! thread that takes the GIL is ended inside `PyGILState_Ensure` (a forced
//! unwind through our frames: SIGABRT, "terminate called without an active
//! exception"), and once it has finalized, `PyGILState_Ensure` dereferences
//! the freed interpreter (SIGSEGV). Both were seen at a normal exit, with and
//! without `destroy_process_group`.
//!
//! So every entry into Python from our threads takes a [`Pass`], and
//! `rallypoint.torch` registers [`shutdown`] with `atexit`, which runs while
//! the interpreter is whole (after `threading`'s non-daemon threads have
//! ended, before any module is torn down). `shutdown` closes the gate (no
//! pass is given after it), aborts every group that still has an op in
//! flight (so that no op waits for a peer that may never come, up to the
//! group's timeout), and waits, with the GIL released, until every op has
//! ended and every pass is back: a thread waiting for the GIL gets it then,
//! completes its future and leaves. After it, our threads never touch Python
//! again: an op that ends later drops its token without the GIL (pyo3 defers
//! the reference count), and a store call fails at once.
//!
//! A pass is held while a torch store method waits on the network with the
//! GIL released; `shutdown` waits for such calls up to a deadline
//! ([`EXIT_DEADLINE`]) and names what is left on stderr if any is.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use rallypoint_collectives::ProcessGroup;
use rallypoint_sync::{CondvarExt, MutexExt};

/// How long `shutdown` waits for ops and store calls to end.
pub const EXIT_DEADLINE: Duration = Duration::from_secs(10);

#[derive(Default)]
struct State {
    closing: bool,
    /// Threads of ours inside (or about to enter) Python.
    in_python: usize,
    /// Ops started and not yet ended, in every group.
    in_flight: usize,
    /// Every group formed, for `shutdown` to abort the busy ones.
    groups: Vec<Weak<Live>>,
}

struct Gate {
    state: Mutex<State>,
    changed: Condvar,
}

fn gate() -> &'static Gate {
    static GATE: Gate = Gate {
        state: Mutex::new(State {
            closing: false,
            in_python: 0,
            in_flight: 0,
            groups: Vec::new(),
        }),
        changed: Condvar::new(),
    };
    &GATE
}

fn state() -> MutexGuard<'static, State> {
    gate().state.locked()
}

/// Leave to enter Python from a thread of ours; `None` once the interpreter
/// is exiting.
pub struct Pass(());

impl Pass {
    pub fn take() -> Option<Pass> {
        let mut s = state();
        if s.closing {
            return None;
        }
        s.in_python += 1;
        Some(Pass(()))
    }
}

impl Drop for Pass {
    fn drop(&mut self) {
        state().in_python -= 1;
        gate().changed.notify_all();
    }
}

/// A group as the exit sees it: its handle and its ops in flight.
pub struct Live {
    pg: ProcessGroup,
    in_flight: Mutex<usize>,
}

impl Live {
    /// Registers a group just formed.
    pub fn new(pg: ProcessGroup) -> Arc<Live> {
        let live = Arc::new(Live {
            pg,
            in_flight: Mutex::new(0),
        });
        let mut s = state();
        s.groups.retain(|g| g.strong_count() > 0);
        s.groups.push(Arc::downgrade(&live));
        live
    }

    pub fn pg(&self) -> &ProcessGroup {
        &self.pg
    }

    /// Ops of this group started and not yet ended.
    pub fn in_flight(&self) -> usize {
        *self.in_flight.locked()
    }

    /// An op of this group begins; `None` once the interpreter is exiting.
    pub fn begin(self: &Arc<Live>) -> Option<InFlight> {
        let mut s = state();
        if s.closing {
            return None;
        }
        s.in_flight += 1;
        *self.in_flight.locked() += 1;
        Some(InFlight(Arc::clone(self)))
    }
}

/// An op in flight; its drop is the op's end.
pub struct InFlight(Arc<Live>);

impl Drop for InFlight {
    fn drop(&mut self) {
        *self.0.in_flight.locked() -= 1;
        state().in_flight -= 1;
        gate().changed.notify_all();
    }
}

/// What `shutdown` left behind: ops and Python calls still running at the
/// deadline.
#[derive(Debug, PartialEq, Eq)]
pub struct Left {
    pub in_flight: usize,
    pub in_python: usize,
}

/// Closes the gate, aborts every group with an op in flight, and waits until
/// every op has ended and every pass is back, or `deadline` has passed. The
/// caller must not hold the GIL (the threads it waits for need it).
pub fn shutdown(deadline: Duration) -> Left {
    let busy: Vec<Arc<Live>> = {
        let mut s = state();
        s.closing = true;
        s.groups
            .iter()
            .filter_map(Weak::upgrade)
            .filter(|g| *g.in_flight.locked() > 0)
            .collect()
    };
    for g in &busy {
        g.pg.abort("the process is exiting (the Python interpreter is shutting down)");
    }
    drop(busy);
    let end = Instant::now() + deadline;
    let mut s = state();
    while s.in_flight > 0 || s.in_python > 0 {
        let now = Instant::now();
        if now >= end {
            break;
        }
        s = gate().changed.wait_timeout_locked(s, end - now).0;
    }
    Left {
        in_flight: s.in_flight,
        in_python: s.in_python,
    }
}
