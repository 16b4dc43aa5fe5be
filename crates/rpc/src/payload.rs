//! Bulk bytes tagged with a device, sent out of band.
//!
//! While the agent encodes a message for a peer it sets a [`BulkOut`] on the
//! thread ([`encoding`]): each payload serialized then maps its device
//! through the device map towards the peer and puts its bytes there, leaving
//! only the device, offset and length in the message. Decoding sets the
//! bytes that followed the message ([`decoding`]), and each payload takes its
//! slice. Outside those, a payload is encoded inline. The agent owns when
//! (`agent/codec.rs`); this module owns how, so it needs nothing above it.

use std::cell::RefCell;

use bytes::Bytes;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::device::{Device, DeviceMap};

/// Bytes on a device: what PyTorch users know as a tensor's storage.
///
/// Inside an RPC message its bytes are not encoded: the envelope carries the
/// device, offset and length, and the bytes follow it raw (a 256 MiB payload is
/// written from this buffer and arrives as a slice of the receiver's). The
/// device is translated by the sender's device map towards the destination
/// (replies by the inverse map); a CUDA payload with no map entry is refused,
/// as PyTorch refuses a CUDA tensor without `set_device_map`.
///
/// Outside an RPC message (plain postcard), a payload encodes its bytes inline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Payload {
    pub device: Device,
    pub data: Bytes,
}

impl Payload {
    pub fn cpu(data: impl Into<Bytes>) -> Payload {
        Payload {
            device: Device::Cpu,
            data: data.into(),
        }
    }

    pub fn on(device: Device, data: impl Into<Bytes>) -> Payload {
        Payload {
            device,
            data: data.into(),
        }
    }

    pub fn len(&self) -> usize {
        self.data.len()
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
}

/// Where the payloads of a message being encoded put their bytes.
pub(crate) struct BulkOut {
    /// The device map that applies (towards the peer, or its inverse for
    /// replies).
    map: Option<DeviceMap>,
    /// This worker's name and the peer's, for the error of a device with no
    /// map entry.
    me: String,
    to: String,
    bulk: Vec<Bytes>,
    off: u64,
    /// The first error, kept here because postcard drops serde's messages.
    pub error: Option<String>,
}

impl BulkOut {
    pub(crate) fn new(map: Option<DeviceMap>, me: String, to: String) -> BulkOut {
        BulkOut {
            map,
            me,
            to,
            bulk: Vec::new(),
            off: 0,
            error: None,
        }
    }

    /// The payloads' bytes, in the order of their offsets.
    pub(crate) fn into_bulk(self) -> Vec<Bytes> {
        self.bulk
    }

    fn push(&mut self, device: Device, data: Bytes) -> Result<(Device, u64), String> {
        let mapped = match self.map.as_ref().and_then(|m| m.get(&device)) {
            Some(d) => *d,
            None if device == Device::Cpu => Device::Cpu,
            None => {
                let e = format!(
                    "a payload on {device} cannot be sent to worker {}: worker {} has no device map entry for {device} towards it (call set_device_map, or move the payload to cpu)",
                    self.to, self.me
                );
                self.error.get_or_insert(e.clone());
                return Err(e);
            }
        };
        let off = self.off;
        self.off += data.len() as u64;
        if !data.is_empty() {
            self.bulk.push(data);
        }
        Ok((mapped, off))
    }
}

/// The bytes that followed a message being decoded.
struct BulkIn {
    bulk: Bytes,
    error: Option<String>,
}

impl BulkIn {
    fn slice(&mut self, off: u64, len: u64) -> Result<Bytes, String> {
        let n = self.bulk.len();
        match off.checked_add(len).filter(|e| *e <= n as u64) {
            Some(end) => Ok(self.bulk.slice(off as usize..end as usize)),
            None => {
                let e = format!("payload {off}+{len} lies outside the message's {n} bulk bytes");
                self.error.get_or_insert(e.clone());
                Err(e)
            }
        }
    }
}

thread_local! {
    static OUT: RefCell<Option<BulkOut>> = const { RefCell::new(None) };
    static IN: RefCell<Option<BulkIn>> = const { RefCell::new(None) };
}

/// Runs `f` (which encodes a message) with `out` set on this thread; returns
/// what `f` returned and `out` with the payloads' bytes.
pub(crate) fn encoding<R>(out: BulkOut, f: impl FnOnce() -> R) -> (R, BulkOut) {
    let prev = OUT.with(|c| c.borrow_mut().replace(out));
    let r = f();
    let out = OUT.with(|c| std::mem::replace(&mut *c.borrow_mut(), prev));
    (
        r,
        out.expect("set above, and nested encodings restore their own"),
    )
}

/// Runs `f` (which decodes a message) with `bulk` set on this thread;
/// returns what `f` returned and the first error of a payload, if any.
pub(crate) fn decoding<R>(bulk: Bytes, f: impl FnOnce() -> R) -> (R, Option<String>) {
    let prev = IN.with(|c| c.borrow_mut().replace(BulkIn { bulk, error: None }));
    let r = f();
    let bulk_in = IN.with(|c| std::mem::replace(&mut *c.borrow_mut(), prev));
    (r, bulk_in.and_then(|b| b.error))
}

#[derive(Serialize, Deserialize)]
enum Wire<'a> {
    OutOfBand { device: Device, off: u64, len: u64 },
    Inline { device: Device, data: &'a [u8] },
}

impl Serialize for Payload {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let pushed = OUT.with(|c| {
            c.borrow_mut()
                .as_mut()
                .map(|out| out.push(self.device, self.data.clone()))
        });
        match pushed {
            Some(Ok((device, off))) => Wire::OutOfBand {
                device,
                off,
                len: self.data.len() as u64,
            }
            .serialize(s),
            Some(Err(e)) => Err(serde::ser::Error::custom(e)),
            None => Wire::Inline {
                device: self.device,
                data: &self.data,
            }
            .serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for Payload {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match Wire::deserialize(d)? {
            Wire::Inline { device, data } => Ok(Payload {
                device,
                data: Bytes::copy_from_slice(data),
            }),
            Wire::OutOfBand { device, off, len } => {
                let data = IN
                    .with(|c| c.borrow_mut().as_mut().map(|b| b.slice(off, len)))
                    .ok_or_else(|| {
                        serde::de::Error::custom("an out-of-band payload outside an RPC message")
                    })?
                    .map_err(serde::de::Error::custom)?;
                Ok(Payload { device, data })
            }
        }
    }
}
