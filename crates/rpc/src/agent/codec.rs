//! Encoding and decoding messages for one peer: arguments and results are
//! postcard, encoded inside a thread-local context that knows the peer, so
//! an [`RRef`](crate::RRef) inside is forked for it and a
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
use crate::device::{Device, DeviceMap};
use crate::wire::{self, ForkData, ForkId};

/// Set while encoding a message for worker `dest`.
pub(crate) struct SerCtx {
    agent: Arc<AgentInner>,
    dest: u32,
    dest_name: String,
    /// The device map that applies (towards `dest`, or its inverse for replies).
    map: Option<DeviceMap>,
    bulk: Vec<Bytes>,
    off: u64,
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

    pub(crate) fn push_bulk(
        &mut self,
        device: Device,
        data: Bytes,
    ) -> std::result::Result<(Device, u64), String> {
        let mapped = match self.map.as_ref().and_then(|m| m.get(&device)) {
            Some(d) => *d,
            None if device == Device::Cpu => Device::Cpu,
            None => {
                let m = format!(
                    "a payload on {device} cannot be sent to worker {}: worker {} has no device map entry for {device} towards it (call set_device_map, or move the payload to cpu)",
                    self.dest_name, self.agent.me.name
                );
                return self.fail(m);
            }
        };
        let off = self.off;
        self.off += data.len() as u64;
        if !data.is_empty() {
            self.bulk.push(data);
        }
        Ok((mapped, off))
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
    bulk: Bytes,
    adopted: HashMap<ForkId, Arc<Handle>>,
    error: Option<String>,
}

impl DeCtx {
    pub(crate) fn fail<T>(&mut self, e: String) -> std::result::Result<T, String> {
        self.error.get_or_insert(e.clone());
        Err(e)
    }

    pub(crate) fn bulk_slice(&mut self, off: u64, len: u64) -> std::result::Result<Bytes, String> {
        let n = self.bulk.len();
        match off.checked_add(len).filter(|e| *e <= n as u64) {
            Some(end) => Ok(self.bulk.slice(off as usize..end as usize)),
            None => self.fail(format!(
                "payload {off}+{len} lies outside the message's {n} bulk bytes"
            )),
        }
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
            dest_name,
            map,
            bulk: Vec::new(),
            off: 0,
            forks: Vec::new(),
            fork_data: Vec::new(),
            error: None,
        };
        let prev = SER.with(|c| c.borrow_mut().replace(cx));
        let r = f();
        let cx = SER
            .with(|c| std::mem::replace(&mut *c.borrow_mut(), prev))
            .expect("context set");
        match r {
            Ok(bytes) => Ok(Encoded {
                bytes,
                bulk: cx.bulk,
                forks: cx.forks,
                fork_data: cx.fork_data,
            }),
            Err(e) => {
                self.rrefs.cancel_children(self, &cx.forks);
                Err(cx.error.unwrap_or(e))
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
            bulk,
            adopted,
            error: None,
        };
        let prev = DE.with(|c| c.borrow_mut().replace(cx));
        let r = wire::decode::<T>(bytes);
        let cx = DE
            .with(|c| std::mem::replace(&mut *c.borrow_mut(), prev))
            .expect("context set");
        r.map_err(|e| cx.error.clone().unwrap_or(e))
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
