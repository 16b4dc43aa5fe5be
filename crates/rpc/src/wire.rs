//! What travels between workers: a small postcard envelope, and bulk bytes sent
//! raw beside it.
//!
//! Every message is an [`Envelope`]: a request (with a worker-local id) or the
//! response to one. Arguments and results are postcard too, nested in the
//! envelope as bytes, except for [`Payload`](crate::Payload)s inside them, whose
//! bytes go out of band: serialising a payload writes only its device, offset
//! and length, and the bytes themselves follow the envelope unencoded, so a
//! 256 MiB payload is written from the caller's buffer and read into the
//! callee's without passing through the encoder.
//!
//! The TCP backend frames each message with a 40-byte [`FrameHead`]; a message
//! whose bulk is large is cut into parts sent on several connections at once and
//! put back together by the receiver. Every decoder here rejects what it does
//! not understand with an error (never a panic), and the property tests at the
//! bottom feed them random bytes.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::types::Sig;
use crate::worker_info::WorkerInfo;

/// A job-wide unique id: the worker that made it and a counter there
/// (PyTorch's `GloballyUniqueId`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Gid {
    pub created_on: u32,
    pub local: u64,
}

pub type RRefId = Gid;
pub type ForkId = Gid;

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.created_on, self.local)
    }
}

/// What a fork carries on the wire. Every message lists the forks it carries
/// beside its arguments, so the receiver adopts (and, if it never decodes
/// them, releases) each one: a fork can never be lost with an undecodable or
/// unanswered message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForkData {
    pub owner: u32,
    pub rref: RRefId,
    pub fork: ForkId,
    pub parent: u32,
    pub type_name: String,
    pub what: String,
}

/// One RPC message.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub enum Envelope {
    /// A request; `args` is the postcard encoding of the arguments, and
    /// `forks` every RRef they carry.
    Request {
        id: u64,
        req: Request,
        args: Vec<u8>,
        forks: Vec<ForkData>,
    },
    /// The answer to request `id`: the encoded result, and every RRef it carries.
    Response {
        id: u64,
        result: Result<Vec<u8>, Failure>,
        forks: Vec<ForkData>,
    },
    /// A liveness probe from a worker waiting on this one (`answer`: reply
    /// with a heartbeat at once), or the reply. Neither counts as a call.
    Heartbeat { answer: bool },
}

/// What a request asks for.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub enum Request {
    /// Run function `func` and answer with its result (`rpc_sync`, `rpc_async`);
    /// `sig`: the argument and result types the caller expects.
    Call { func: String, sig: Sig },
    /// Run `func` and keep its result here as the value of `rref`, whose first
    /// user is the caller's `fork` (PyTorch's REMOTE_CALL; the answer is
    /// REMOTE_RET and confirms that user).
    Remote {
        func: String,
        rref: RRefId,
        fork: ForkId,
        sig: Sig,
    },
    /// Run method `method` on the value of `rref`, owned here.
    Method {
        rref: RRefId,
        method: String,
        sig: Sig,
    },
    /// Answer with the value of `rref` once it exists (RREF_FETCH_CALL).
    Fetch { rref: RRefId },
    /// User `fork` of `rref` is gone (RREF_USER_DELETE). Idempotent.
    UserDelete { rref: RRefId, fork: ForkId },
    /// A new user `fork` of `rref` exists (RREF_FORK_REQUEST, child to owner).
    /// Idempotent.
    ForkRequest { rref: RRefId, fork: ForkId },
    /// The owner knows child `fork`: its parent may let go (RREF_CHILD_ACCEPT).
    /// Idempotent.
    ChildAccept { fork: ForkId },
    /// A worker joined a dynamic group and listens at `addr`.
    Join {
        info: WorkerInfo,
        addr: String,
        devices: crate::device::DeviceInfo,
    },
    /// A worker left a dynamic group.
    Leave { id: u32 },
    /// Nothing: the round trip itself is the point (opens the connection).
    Ping,
}

impl Request {
    /// A short description for errors and leak reports.
    pub fn describe(&self) -> String {
        match self {
            Request::Call { func, .. } => format!("function {func:?}"),
            Request::Remote { func, .. } => format!("remote function {func:?}"),
            Request::Method { method, rref, .. } => format!("method {method:?} of {rref}"),
            Request::Fetch { rref } => format!("to_here of {rref}"),
            Request::UserDelete { rref, fork } => format!("user delete of {rref} ({fork})"),
            Request::ForkRequest { rref, fork } => format!("fork request of {rref} ({fork})"),
            Request::ChildAccept { fork } => format!("child accept ({fork})"),
            Request::Join { info, .. } => format!("join of {}", info.name),
            Request::Leave { id } => format!("leave of worker {id}"),
            Request::Ping => "ping".into(),
        }
    }

    /// RRef control messages are retried, so their handlers are idempotent.
    pub fn is_control(&self) -> bool {
        matches!(
            self,
            Request::UserDelete { .. } | Request::ForkRequest { .. } | Request::ChildAccept { .. }
        )
    }
}

/// Why a request failed on the callee.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Failure {
    pub message: String,
    /// The callee's function takes and returns other types than the caller
    /// expects: these (argument, result), by shape.
    pub types: Option<(String, String)>,
}

impl From<String> for Failure {
    fn from(message: String) -> Failure {
        Failure {
            message,
            types: None,
        }
    }
}

pub fn encode<T: Serialize>(v: &T) -> Result<Vec<u8>, String> {
    postcard::to_allocvec(v).map_err(|e| e.to_string())
}

/// Decodes a whole `T` from `b`: bytes left over are an error, not ignored
/// (postcard alone would read `(1i64, 2i64)` as the `i64` 1: a caller and a
/// function that disagree on the type must hear of it).
pub fn decode<'a, T: Deserialize<'a>>(b: &'a [u8]) -> Result<T, String> {
    let (v, rest) = postcard::take_from_bytes(b).map_err(|e| e.to_string())?;
    if !rest.is_empty() {
        return Err(format!(
            "{} byte(s) left over after a {}: the value sent is not of the type read",
            rest.len(),
            std::any::type_name::<T>()
        ));
    }
    Ok(v)
}

/// Largest envelope accepted (the bulk has its own limit).
pub const MAX_ENVELOPE: u32 = 64 << 20;
/// Refuses an envelope of `len` bytes over [`MAX_ENVELOPE`] before it is
/// sent (the receiver would refuse it and drop the connection): `what` is
/// "the arguments of ..." or "the result of ...".
pub fn check_envelope(len: usize, what: &str) -> Result<(), String> {
    if len as u64 <= u64::from(MAX_ENVELOPE) {
        return Ok(());
    }
    Err(format!(
        "{what} encode to {len} bytes, over the {} MiB limit of one message's envelope: send large data as a Payload (carried out of band, without this limit)",
        MAX_ENVELOPE >> 20
    ))
}

/// Most parts a message is cut into.
pub const MAX_PARTS: u8 = 16;

/// The TCP backend's frame header, little-endian:
///
/// | bytes | field |
/// |---|---|
/// | 0..2 | magic `b"RF"` |
/// | 2 | part index |
/// | 3 | number of parts (1..=16) |
/// | 4..8 | envelope length (only in part 0) |
/// | 8..16 | message id (sender-local) |
/// | 16..24 | bulk length of the whole message |
/// | 24..32 | offset of this part's bulk |
/// | 32..40 | length of this part's bulk |
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHead {
    pub part: u8,
    pub parts: u8,
    pub env_len: u32,
    pub msg: u64,
    pub bulk_total: u64,
    pub off: u64,
    pub len: u64,
}

pub const HEAD_LEN: usize = 40;

impl FrameHead {
    pub fn encode(&self) -> [u8; HEAD_LEN] {
        let mut b = [0u8; HEAD_LEN];
        b[0..2].copy_from_slice(b"RF");
        b[2] = self.part;
        b[3] = self.parts;
        b[4..8].copy_from_slice(&self.env_len.to_le_bytes());
        b[8..16].copy_from_slice(&self.msg.to_le_bytes());
        b[16..24].copy_from_slice(&self.bulk_total.to_le_bytes());
        b[24..32].copy_from_slice(&self.off.to_le_bytes());
        b[32..40].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decodes and checks a header against the receiver's bulk limit. Parts
    /// are cut at fixed places ([`part_range`]), so a header whose offset or
    /// length is not where its index says is refused: parts can never overlap.
    pub fn decode(b: &[u8; HEAD_LEN], max_bulk: u64) -> Result<FrameHead, String> {
        if &b[0..2] != b"RF" {
            return Err(format!("bad frame magic {:02x}{:02x}", b[0], b[1]));
        }
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        let h = FrameHead {
            part: b[2],
            parts: b[3],
            env_len: u32::from_le_bytes(b[4..8].try_into().unwrap()),
            msg: u64_at(8),
            bulk_total: u64_at(16),
            off: u64_at(24),
            len: u64_at(32),
        };
        if h.parts == 0 || h.parts > MAX_PARTS || h.part >= h.parts {
            return Err(format!("bad part {} of {}", h.part, h.parts));
        }
        if h.bulk_total > max_bulk {
            return Err(format!(
                "message of {} bulk bytes is over this worker's limit of {max_bulk}",
                h.bulk_total
            ));
        }
        if h.env_len > MAX_ENVELOPE || (h.part == 0) != (h.env_len > 0) {
            return Err(format!(
                "bad envelope length {} in part {}",
                h.env_len, h.part
            ));
        }
        let want = part_range(h.bulk_total, h.parts, h.part);
        if (h.off, h.len) != (want.start, want.end - want.start) {
            return Err(format!(
                "part {} of {} covers {}+{}, expected {}..{}",
                h.part, h.parts, h.off, h.len, want.start, want.end
            ));
        }
        Ok(h)
    }
}

/// Where part `part` of `parts` lies in a bulk of `total` bytes.
pub fn part_range(total: u64, parts: u8, part: u8) -> std::ops::Range<u64> {
    let chunk = total.div_ceil(parts as u64).max(1);
    let start = (chunk * part as u64).min(total);
    start..(start + chunk).min(total)
}

/// First bytes of every TCP connection: who is calling whom, in which group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    pub generation: u64,
    pub from: u32,
    pub to: u32,
    pub stream: u16,
}

pub const HELLO_LEN: usize = 24;
const HELLO_MAGIC: &[u8; 4] = b"RPCH";
const VERSION: u16 = 1;

impl Hello {
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..4].copy_from_slice(HELLO_MAGIC);
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        b[6..8].copy_from_slice(&self.stream.to_le_bytes());
        b[8..12].copy_from_slice(&self.from.to_le_bytes());
        b[12..16].copy_from_slice(&self.to.to_le_bytes());
        b[16..24].copy_from_slice(&self.generation.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; HELLO_LEN]) -> Result<Hello, String> {
        if &b[0..4] != HELLO_MAGIC {
            return Err("not a rallypoint RPC connection (bad magic)".into());
        }
        let v = u16::from_le_bytes([b[4], b[5]]);
        if v != VERSION {
            return Err(format!("wire version {v}, this worker speaks {VERSION}"));
        }
        Ok(Hello {
            stream: u16::from_le_bytes([b[6], b[7]]),
            from: u32::from_le_bytes(b[8..12].try_into().unwrap()),
            to: u32::from_le_bytes(b[12..16].try_into().unwrap()),
            generation: u64::from_le_bytes(b[16..24].try_into().unwrap()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// A value with anything after it is refused, whole values are read.
        #[test]
        fn trailing_bytes_are_refused(v in any::<(i64, String)>(), extra in proptest::collection::vec(any::<u8>(), 0..16)) {
            let mut b = encode(&v).unwrap();
            prop_assert_eq!(decode::<(i64, String)>(&b).unwrap(), v);
            b.extend_from_slice(&extra);
            prop_assert_eq!(decode::<(i64, String)>(&b).is_ok(), extra.is_empty());
        }

        #[test]
        fn random_bytes_never_panic_the_decoders(b in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode::<Envelope>(&b);
            if b.len() >= HEAD_LEN {
                let _ = FrameHead::decode(b[..HEAD_LEN].try_into().unwrap(), u64::MAX);
            }
            if b.len() >= HELLO_LEN {
                let _ = Hello::decode(b[..HELLO_LEN].try_into().unwrap());
            }
        }

        #[test]
        fn valid_heads_round_trip(total in 0u64..1 << 40, parts in 1u8..=MAX_PARTS, pick in any::<u8>(), env in 1u32..1000, msg in any::<u64>()) {
            let part = pick % parts;
            let r = part_range(total, parts, part);
            let h = FrameHead { part, parts, env_len: if part == 0 { env } else { 0 }, msg, bulk_total: total, off: r.start, len: r.end - r.start };
            prop_assert_eq!(FrameHead::decode(&h.encode(), u64::MAX), Ok(h));
            prop_assert!(FrameHead::decode(&h.encode(), total.saturating_sub(1)).is_err() || total == 0);
        }

        #[test]
        fn parts_tile_the_bulk(total in 0u64..1 << 30, parts in 1u8..=MAX_PARTS) {
            let mut at = 0;
            for p in 0..parts {
                let r = part_range(total, parts, p);
                prop_assert_eq!(r.start, at.min(total));
                at = r.end;
            }
            prop_assert_eq!(at, total);
        }

        #[test]
        fn corrupted_heads_are_refused_or_consistent(flip in 0usize..HEAD_LEN * 8) {
            let r = part_range(1 << 20, 4, 1);
            let h = FrameHead { part: 1, parts: 4, env_len: 0, msg: 9, bulk_total: 1 << 20, off: r.start, len: r.end - r.start };
            let mut b = h.encode();
            b[flip / 8] ^= 1 << (flip % 8);
            if let Ok(d) = FrameHead::decode(&b, 1 << 30) {
                // Whatever still decodes describes a part that fits its message.
                let want = part_range(d.bulk_total, d.parts, d.part);
                prop_assert_eq!(d.off, want.start);
                prop_assert!(d.off + d.len <= d.bulk_total);
            }
        }

        #[test]
        fn envelopes_round_trip(id in any::<u64>(), func in "[a-z_]{0,20}", args in proptest::collection::vec(any::<u8>(), 0..64)) {
            let sig = crate::types::Sig { args: id.rotate_left(7), ret: id ^ 5 };
            let e = Envelope::Request { id, req: Request::Call { func, sig }, args, forks: vec![] };
            prop_assert_eq!(decode::<Envelope>(&encode(&e).unwrap()).unwrap(), e);
        }
    }

    #[test]
    fn hello_round_trips_and_refuses_strangers() {
        let h = Hello {
            generation: 7,
            from: 1,
            to: 2,
            stream: 3,
        };
        assert_eq!(Hello::decode(&h.encode()), Ok(h));
        let mut b = h.encode();
        b[0] = b'X';
        assert!(Hello::decode(&b).unwrap_err().contains("bad magic"));
        let mut b = h.encode();
        b[4] = 9;
        assert!(Hello::decode(&b).unwrap_err().contains("wire version 9"));
    }
}
