//! Bulk bytes tagged with a device, sent out of band.

use bytes::Bytes;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::agent::{with_de, with_ser};
use crate::device::Device;

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

#[derive(Serialize, Deserialize)]
enum Wire<'a> {
    OutOfBand { device: Device, off: u64, len: u64 },
    Inline { device: Device, data: &'a [u8] },
}

impl Serialize for Payload {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match with_ser(|cx| cx.push_bulk(self.device, self.data.clone())) {
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
                let data = with_de(|cx| cx.bulk_slice(off, len))
                    .ok_or_else(|| {
                        serde::de::Error::custom("an out-of-band payload outside an RPC message")
                    })?
                    .map_err(serde::de::Error::custom)?;
                Ok(Payload { device, data })
            }
        }
    }
}
