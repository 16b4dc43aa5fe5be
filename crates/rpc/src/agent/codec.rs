//! Encoding and decoding messages for one peer: arguments and results are
//! postcard, encoded inside a thread-local context that knows the peer, so
//! an [`RRef`](crate::RRef) inside is forked for it, and inside the
//! payloads' own context (`payload::encoding`), so a
//! [`Payload`](crate::Payload) inside is mapped through the device maps and
//! sent out of band.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use rallypoint_sync::RwLockExt;
use serde::de::DeserializeOwned;

use super::rrefs::Handle;
use super::{AgentInner, Value};
use crate::payload::{self, BulkOut};
use crate::wire::{self, ForkData, ForkId};

/// Set while encoding a message for worker `dest`.
pub(crate) struct SerCtx {
    agent: Arc<AgentInner>,
    dest: u32,
    forks: Vec<ForkId>,
    /// What the message carries of those forks (see [`ForkData`]).
    fork_data: Vec<ForkData>,
    /// The first error, kept here because postcard drops serde's messages.
    error: Option<String>,
}

impl SerCtx {
    pub(super) fn fail<T>(&mut self, e: String) -> std::result::Result<T, String> {
        self.error.get_or_insert(e.clone());
        Err(e)
    }

    pub(crate) fn fork(&mut self, h: &Arc<Handle>) -> std::result::Result<ForkData, String> {
        let d = match self.agent.rrefs.fork(&self.agent, h, self.dest) {
            Ok(d) => d,
            Err(e) => return self.fail(e),
        };
        self.forks.push(d.fork);
        self.fork_data.push(d.clone());
        Ok(d)
    }
}

/// Set while decoding a message: the handles its forks became on arrival.
pub(crate) struct DeCtx {
    adopted: HashMap<ForkId, Arc<Handle>>,
    error: Option<String>,
}

impl DeCtx {
    pub(crate) fn fail<T>(&mut self, e: String) -> std::result::Result<T, String> {
        self.error.get_or_insert(e.clone());
        Err(e)
    }

    /// The handle fork `d` became when its message arrived.
    pub(crate) fn take(&mut self, d: &ForkData) -> std::result::Result<Arc<Handle>, String> {
        match self.adopted.remove(&d.fork) {
            Some(h) => Ok(h),
            None => self.fail(format!(
                "RRef {} (fork {}) is not among the forks its message declared",
                d.rref, d.fork
            )),
        }
    }
}

thread_local! {
    static SER: RefCell<Option<SerCtx>> = const { RefCell::new(None) };
    static DE: RefCell<Option<DeCtx>> = const { RefCell::new(None) };
}

pub(crate) fn with_ser<R>(f: impl FnOnce(&mut SerCtx) -> R) -> Option<R> {
    SER.with(|c| c.borrow_mut().as_mut().map(f))
}

pub(crate) fn with_de<R>(f: impl FnOnce(&mut DeCtx) -> R) -> Option<R> {
    DE.with(|c| c.borrow_mut().as_mut().map(f))
}

/// Bytes plus bulk plus the forks they made (and carry).
pub(crate) struct Encoded {
    pub bytes: Vec<u8>,
    pub bulk: Vec<Bytes>,
    pub forks: Vec<ForkId>,
    pub fork_data: Vec<ForkData>,
}

impl AgentInner {
    pub(super) fn encode_for(
        self: &Arc<Self>,
        dest: u32,
        reply: bool,
        f: impl FnOnce() -> std::result::Result<Vec<u8>, String>,
    ) -> std::result::Result<Encoded, String> {
        let dest_name = self.name_of(dest);
        let map = if reply {
            self.reverse.read_locked().get(&dest_name).cloned()
        } else {
            self.maps.get(&dest_name).cloned()
        };
        let cx = SerCtx {
            agent: self.clone(),
            dest,
            forks: Vec::new(),
            fork_data: Vec::new(),
            error: None,
        };
        let out = BulkOut::new(map, self.me.name.clone(), dest_name);
        let prev = SER.with(|c| c.borrow_mut().replace(cx));
        let (r, out) = payload::encoding(out, f);
        let cx = SER
            .with(|c| std::mem::replace(&mut *c.borrow_mut(), prev))
            .expect("context set");
        match r {
            Ok(bytes) => Ok(Encoded {
                bytes,
                bulk: out.into_bulk(),
                forks: cx.forks,
                fork_data: cx.fork_data,
            }),
            Err(e) => {
                self.rrefs.cancel_children(self, &cx.forks);
                Err(cx.error.or(out.error).unwrap_or(e))
            }
        }
    }

    /// Decodes `bytes` with the handles its message's forks became; the
    /// ones it does not use are dropped (released) with the map.
    pub(super) fn decode_from<T: DeserializeOwned>(
        self: &Arc<Self>,
        bytes: &[u8],
        bulk: Bytes,
        adopted: HashMap<ForkId, Arc<Handle>>,
    ) -> std::result::Result<T, String> {
        let cx = DeCtx {
            adopted,
            error: None,
        };
        let prev = DE.with(|c| c.borrow_mut().replace(cx));
        let (r, bulk_error) = payload::decoding(bulk, || wire::decode::<T>(bytes));
        let cx = DE
            .with(|c| std::mem::replace(&mut *c.borrow_mut(), prev))
            .expect("context set");
        r.map_err(|e| cx.error.or(bulk_error).unwrap_or(e))
    }

    pub(super) fn encode_value(
        self: &Arc<Self>,
        to: u32,
        v: &dyn Value,
    ) -> std::result::Result<Encoded, String> {
        self.encode_for(to, true, || v.encode())
    }

    pub(super) fn empty() -> Encoded {
        Encoded {
            bytes: wire::encode(&()).expect("unit"),
            bulk: Vec::new(),
            forks: Vec::new(),
            fork_data: Vec::new(),
        }
    }
}
