//! The wire format between ranks.
//!
//! A connection starts with a handshake: the side that opens it sends a [`Hello`]
//! naming the group, its instance nonce (the group's generation: a fresh random
//! number per group, published by rank 0), the world size, both ranks and a hash
//! of the options that decide message layout; the accepting side answers with a
//! status byte ([`ACCEPTED`], [`REFUSED`], [`NOT_HERE`]), and a reason when it
//! refuses. A connection from another job, an earlier round or a rank with
//! other segment sizes is refused before any data moves. [`NOT_HERE`] says the
//! hello is another group's or instance's: to the side that opened the
//! connection, the member it dialled no longer listens at that address (it
//! exited and another process has the port), so that member is gone, not
//! broken.
//!
//! After the handshake both directions carry frames: a fixed 48-byte
//! little-endian [`Header`] followed by `len` payload bytes, sent raw. A data frame
//! carries the sender's description of the operation it belongs to ([`Desc`]), so
//! the receiver can tell a mismatched collective from a slow one, and a hash
//! of the sender's calls before it on the group ([`Desc::hist`]), so the
//! receiver can tell a mismatch at this op from calls that diverged earlier
//! (see `transport/router.rs`). A want frame
//! (header only) says the sender has waited for the receiver's part of a
//! collective, and carries the sender's call for the receiver to compare. An
//! abort frame carries a UTF-8 reason and the first collective it fails. A
//! flow frame (header only) returns credit for data frames taken, or says
//! the sender is out of credit (see `transport/flow.rs`). Decoders check every field and every length against a
//! bound before allocating; a bad frame ends the connection, never the process.

use std::fmt;

use crate::element::{DType, ReduceOp};

/// Bytes in a frame header.
pub const HEADER_LEN: usize = 48;
/// The largest data payload a frame may carry (the segment size is capped below it).
pub const MAX_PAYLOAD: u64 = 64 << 20;
/// The largest abort reason.
pub const MAX_REASON: u64 = 64 << 10;

/// The collective (or point-to-point message) a frame belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum OpKind {
    Barrier = 1,
    Broadcast,
    AllReduce,
    Reduce,
    AllGather,
    AllGatherV,
    Gather,
    Scatter,
    ReduceScatter,
    AllToAll,
    Send,
}

impl OpKind {
    pub(crate) const ALL: [OpKind; 11] = [
        OpKind::Barrier,
        OpKind::Broadcast,
        OpKind::AllReduce,
        OpKind::Reduce,
        OpKind::AllGather,
        OpKind::AllGatherV,
        OpKind::Gather,
        OpKind::Scatter,
        OpKind::ReduceScatter,
        OpKind::AllToAll,
        OpKind::Send,
    ];

    fn from_code(c: u8) -> Option<OpKind> {
        OpKind::ALL.get(usize::from(c).checked_sub(1)?).copied()
    }

    /// The name users know, as in `torch.distributed`.
    pub fn name(self) -> &'static str {
        match self {
            OpKind::Barrier => "barrier",
            OpKind::Broadcast => "broadcast",
            OpKind::AllReduce => "all_reduce",
            OpKind::Reduce => "reduce",
            OpKind::AllGather => "all_gather",
            OpKind::AllGatherV => "all_gather (varying sizes)",
            OpKind::Gather => "gather",
            OpKind::Scatter => "scatter",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::AllToAll => "all_to_all",
            OpKind::Send => "send/recv",
        }
    }

    fn has_root(self) -> bool {
        matches!(
            self,
            OpKind::Broadcast | OpKind::Reduce | OpKind::Gather | OpKind::Scatter
        )
    }
}

/// The algorithm a collective runs; part of the descriptor, so ranks that chose
/// differently (different options) are told so rather than left to hang.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Algo {
    /// Ops with a single algorithm.
    Direct = 1,
    /// Segmented, pipelined ring.
    Ring,
    /// Recursive doubling (with a fold for ranks past the largest power of two).
    RecursiveDoubling,
    /// Binomial tree.
    Tree,
    /// Dissemination (barrier).
    Dissemination,
    /// Segmented, pipelined chain (large broadcasts).
    Chain,
    /// Shared memory (every rank on one host; see `shm`).
    Shm,
}

impl Algo {
    const ALL: [Algo; 7] = [
        Algo::Direct,
        Algo::Ring,
        Algo::RecursiveDoubling,
        Algo::Tree,
        Algo::Dissemination,
        Algo::Chain,
        Algo::Shm,
    ];

    fn from_code(c: u8) -> Option<Algo> {
        Algo::ALL.get(usize::from(c).checked_sub(1)?).copied()
    }
}

/// What a rank is doing in a collective: compared across ranks to catch mismatches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Desc {
    pub op: OpKind,
    pub dtype: DType,
    pub reduce: Option<ReduceOp>,
    pub algo: Algo,
    /// The root rank of rooted ops; the tag of a point-to-point message.
    pub root: u32,
    /// Elements: of the buffer (all_reduce, broadcast, reduce), of each rank's
    /// part (all_gather, gather, scatter, reduce_scatter, all_to_all), of the
    /// whole result (all_gather with varying sizes), of the message (send).
    pub count: u64,
    /// A 24-bit hash of the calls before this one on the group (`HIST_NONE`:
    /// not tracked, as for messages; the steps of a two-level op carry their
    /// op's). Ranks whose histories differ have called different sequences
    /// of collectives before this one: a difference of this call from
    /// theirs is a consequence, not the first mismatch. Not shown in
    /// messages but those of [`crate::Error::Diverged`].
    pub hist: u32,
}

/// [`Desc::hist`] of a call whose history is not tracked.
pub const HIST_NONE: u32 = 0;
/// [`Desc::hist`] of a group's first collective.
pub const HIST_START: u32 = 1;
/// [`Desc::hist`] holds this many bits.
const HIST_BITS: u32 = 24;

/// The history after `call`, of calls whose history before it was
/// `before` (`call.hist` is not read): FNV-1a over the call's fields and
/// `before`, folded to [`HIST_BITS`], never [`HIST_NONE`]. Fixed, so ranks of
/// different builds agree. Not the algorithm: shared memory does not compare
/// it, so ranks of a two-level group that chose differently are not
/// misaligned.
pub fn hist_after(before: u32, call: &Desc) -> u32 {
    let mut b = [0u8; 20];
    b[0] = call.op as u8;
    b[1] = call.dtype as u8;
    b[2] = call.reduce.map_or(0, |r| r as u8);
    b[4..8].copy_from_slice(&call.root.to_le_bytes());
    b[8..16].copy_from_slice(&call.count.to_le_bytes());
    b[16..20].copy_from_slice(&before.to_le_bytes());
    let h = crate::hash::fnv1a(b);
    let folded = ((h >> 32) ^ h) as u32 & ((1 << HIST_BITS) - 1);
    folded.max(1)
}

impl Desc {
    /// Whether `other`, a call at the same place in the group's sequence,
    /// agrees with this one: the same call, after the same calls where both
    /// histories are tracked.
    pub fn agrees(&self, other: &Desc) -> bool {
        let call = |d: &Desc| Desc {
            hist: HIST_NONE,
            ..*d
        };
        call(self) == call(other) && !self.diverged_from(other)
    }

    /// Whether `self` and `other` are calls of one place in the group's
    /// sequence whose histories differ (both tracked).
    pub fn diverged_from(&self, other: &Desc) -> bool {
        self.hist != HIST_NONE && other.hist != HIST_NONE && self.hist != other.hist
    }
}

impl fmt::Display for Desc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}({} x {}", self.op.name(), self.dtype, self.count)?;
        if let Some(r) = self.reduce {
            write!(f, ", {r}")?;
        }
        if self.op.has_root() {
            write!(f, ", root {}", self.root)?;
        }
        if self.op == OpKind::Send {
            write!(f, ", tag {}", self.root)?;
        }
        write!(f, ", {:?})", self.algo)
    }
}

/// A frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Header {
    /// Payload bytes of one step of an operation.
    Data {
        comm: u64,
        /// The collective's sequence number in its group, or the message number
        /// of a (peer, tag) pair for point-to-point.
        seq: u64,
        /// The algorithm's step (and segment) the payload belongs to.
        step: u32,
        desc: Desc,
        len: u64,
    },
    /// The sender aborted group `comm`; the payload is the reason. `own`:
    /// the sender itself gave up the group ([`crate::ProcessGroup::abort`]),
    /// rather than passing on an operation's failure. `from`: the first
    /// collective it fails (a mismatch at op #7 leaves op #6 to finish); 0 for
    /// all. Point-to-point messages always fail. `provisional`: the reason is
    /// calls the sender found diverged and reports as it leaves the group,
    /// before the first mismatch's abort could reach it; the receiver holds
    /// it as if found there (`transport/diverged.rs`) rather than failing
    /// its operations at once.
    Abort {
        comm: u64,
        len: u64,
        own: bool,
        from: u64,
        provisional: bool,
    },
    /// The sender has waited a while for step `step` of collective `seq` from
    /// the receiver, which compares `desc` with its own call: two ranks that
    /// each wait for the other (two roots of one reduce) are a mismatch found
    /// this way, not a timeout. No payload.
    Want {
        comm: u64,
        seq: u64,
        step: u32,
        desc: Desc,
    },
    /// Flow control (`transport/flow.rs`): `credit`, bytes of the receiver's
    /// data frames the sender's operations have taken since its last; or
    /// `blocked`, the sender is out of credit with the receiver, which then
    /// acknowledges at once and asks (with wants) for the operations it runs
    /// or waits in. No payload.
    Flow { credit: u64, blocked: bool },
}

/// Why a header was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bad frame header: {0}")]
pub struct BadFrame(pub String);

const KIND_DATA: u8 = 1;
const KIND_ABORT: u8 = 2;
const KIND_WANT: u8 = 3;
const KIND_FLOW: u8 = 4;

impl Header {
    pub fn payload_len(&self) -> u64 {
        match *self {
            Header::Data { len, .. } | Header::Abort { len, .. } => len,
            Header::Want { .. } | Header::Flow { .. } => 0,
        }
    }

    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        match *self {
            Header::Data {
                comm,
                seq,
                step,
                desc,
                len,
            } => {
                encode_data(&mut b, KIND_DATA, comm, seq, step, desc, len);
            }
            Header::Want {
                comm,
                seq,
                step,
                desc,
            } => {
                encode_data(&mut b, KIND_WANT, comm, seq, step, desc, 0);
            }
            Header::Abort {
                comm,
                len,
                own,
                from,
                provisional,
            } => {
                b[0] = KIND_ABORT;
                b[1] = u8::from(own);
                b[2] = u8::from(provisional);
                b[8..16].copy_from_slice(&comm.to_le_bytes());
                b[16..24].copy_from_slice(&from.to_le_bytes());
                b[40..48].copy_from_slice(&len.to_le_bytes());
            }
            Header::Flow { credit, blocked } => {
                b[0] = KIND_FLOW;
                b[1] = u8::from(blocked);
                b[16..24].copy_from_slice(&credit.to_le_bytes());
            }
        }
        b
    }

    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Header, BadFrame> {
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let bad = |s: String| Err(BadFrame(s));
        let comm = u64_at(8);
        let len = u64_at(40);
        match b[0] {
            KIND_DATA | KIND_WANT => {
                let op =
                    OpKind::from_code(b[1]).ok_or_else(|| BadFrame(format!("op code {}", b[1])))?;
                let dtype = DType::from_code(b[2])
                    .ok_or_else(|| BadFrame(format!("type code {}", b[2])))?;
                let reduce = match b[3] {
                    0 => None,
                    c => Some(
                        ReduceOp::from_code(c)
                            .ok_or_else(|| BadFrame(format!("reduce code {c}")))?,
                    ),
                };
                let algo = Algo::from_code(b[4])
                    .ok_or_else(|| BadFrame(format!("algorithm code {}", b[4])))?;
                if len > MAX_PAYLOAD {
                    return bad(format!("payload of {len} bytes exceeds {MAX_PAYLOAD}"));
                }
                if len % dtype.size() as u64 != 0 {
                    return bad(format!(
                        "payload of {len} bytes is not whole {dtype} elements"
                    ));
                }
                let (seq, step) = (u64_at(16), u32_at(24));
                let desc = Desc {
                    op,
                    dtype,
                    reduce,
                    algo,
                    root: u32_at(28),
                    count: u64_at(32),
                    hist: u32::from_le_bytes([b[5], b[6], b[7], 0]),
                };
                if b[0] == KIND_WANT {
                    if len != 0 {
                        return bad(format!("a want frame with a payload of {len} bytes"));
                    }
                    return Ok(Header::Want {
                        comm,
                        seq,
                        step,
                        desc,
                    });
                }
                Ok(Header::Data {
                    comm,
                    seq,
                    step,
                    desc,
                    len,
                })
            }
            KIND_ABORT => {
                if b[1] > 1 || b[2] > 1 || b[3..8] != [0; 5] || b[24..40] != [0; 16] {
                    return bad("abort frame with data fields set".into());
                }
                if len > MAX_REASON {
                    return bad(format!("abort reason of {len} bytes exceeds {MAX_REASON}"));
                }
                Ok(Header::Abort {
                    comm,
                    len,
                    own: b[1] == 1,
                    from: u64_at(16),
                    provisional: b[2] == 1,
                })
            }
            KIND_FLOW => {
                if b[1] > 1 || b[2..16] != [0; 14] || b[24..48] != [0; 24] {
                    return bad("flow frame with other fields set".into());
                }
                Ok(Header::Flow {
                    credit: u64_at(16),
                    blocked: b[1] == 1,
                })
            }
            k => bad(format!("frame kind {k}")),
        }
    }
}

/// The fields data and want frames share.
fn encode_data(
    b: &mut [u8; HEADER_LEN],
    kind: u8,
    comm: u64,
    seq: u64,
    step: u32,
    desc: Desc,
    len: u64,
) {
    b[0] = kind;
    b[1] = desc.op as u8;
    b[2] = desc.dtype as u8;
    b[3] = desc.reduce.map_or(0, |r| r as u8);
    b[4] = desc.algo as u8;
    b[5..8].copy_from_slice(&desc.hist.to_le_bytes()[..3]);
    b[8..16].copy_from_slice(&comm.to_le_bytes());
    b[16..24].copy_from_slice(&seq.to_le_bytes());
    b[24..28].copy_from_slice(&step.to_le_bytes());
    b[28..32].copy_from_slice(&desc.root.to_le_bytes());
    b[32..40].copy_from_slice(&desc.count.to_le_bytes());
    b[40..48].copy_from_slice(&len.to_le_bytes());
}

/// The handshake's answer: the connection is taken.
pub const ACCEPTED: u8 = 0;
/// The handshake's answer: refused for any other reason (a member of this
/// group instance with other options, a hello that is not one or never
/// came); a reason follows.
pub const REFUSED: u8 = 1;
/// The handshake's answer: the hello is for another group or instance than
/// the one listening here; a reason follows.
pub const NOT_HERE: u8 = 2;

/// The handshake's first message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// The group instance (generation): random per group, from rank 0.
    pub nonce: u64,
    /// Hash of the options that shape messages (segment size, algorithm thresholds).
    pub layout: u64,
    pub world: u32,
    pub src: u32,
    pub dst: u32,
    /// The group's store prefix, for error messages.
    pub name: String,
}

const MAGIC: &[u8; 4] = b"RPCG";
/// 2: flow frames. 3: call histories in data and want frames. 4: provisional
/// aborts. 5: ring and chain segments sized by the buffer (the same
/// `segment_bytes` cuts buffers differently from 4).
const VERSION: u16 = 5;
/// Written in the sender's byte order: a peer of the other order reads 0x0201.
const BYTE_ORDER: u16 = 0x0102;
/// The fixed part of a hello; the name follows.
pub const HELLO_LEN: usize = 4 + 2 + 2 + 8 + 8 + 4 + 4 + 4 + 2;
/// Longest group name in a hello.
pub const MAX_NAME: usize = 1024;

impl Hello {
    pub fn encode(&self) -> Vec<u8> {
        let name = &self.name.as_bytes()[..self.name.len().min(MAX_NAME)];
        let mut b = Vec::with_capacity(HELLO_LEN + name.len());
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&BYTE_ORDER.to_ne_bytes());
        b.extend_from_slice(&self.nonce.to_le_bytes());
        b.extend_from_slice(&self.layout.to_le_bytes());
        b.extend_from_slice(&self.world.to_le_bytes());
        b.extend_from_slice(&self.src.to_le_bytes());
        b.extend_from_slice(&self.dst.to_le_bytes());
        b.extend_from_slice(&(name.len() as u16).to_le_bytes());
        b.extend_from_slice(name);
        b
    }

    /// Decodes the fixed part; returns the hello (name empty) and the name length.
    pub fn decode_fixed(b: &[u8; HELLO_LEN]) -> Result<(Hello, usize), BadFrame> {
        if &b[0..4] != MAGIC {
            return Err(BadFrame(format!(
                "not a rallypoint collectives peer (magic {:02x?})",
                &b[0..4]
            )));
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != VERSION {
            return Err(BadFrame(format!(
                "protocol version {version}, this build speaks {VERSION}"
            )));
        }
        if u16::from_ne_bytes([b[6], b[7]]) != BYTE_ORDER {
            return Err(BadFrame("peer has the other byte order".into()));
        }
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let name_len = usize::from(u16::from_le_bytes([b[36], b[37]]));
        if name_len > MAX_NAME {
            return Err(BadFrame(format!("group name of {name_len} bytes")));
        }
        Ok((
            Hello {
                nonce: u64_at(8),
                layout: u64_at(16),
                world: u32_at(24),
                src: u32_at(28),
                dst: u32_at(32),
                name: String::new(),
            },
            name_len,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn desc() -> impl Strategy<Value = Desc> {
        (
            prop::sample::select(OpKind::ALL.to_vec()),
            prop::sample::select(DType::ALL.to_vec()),
            prop::option::of(prop::sample::select(ReduceOp::ALL.to_vec())),
            prop::sample::select(Algo::ALL.to_vec()),
            any::<u32>(),
            any::<u64>(),
            0..1u32 << HIST_BITS,
        )
            .prop_map(|(op, dtype, reduce, algo, root, count, hist)| Desc {
                op,
                dtype,
                reduce,
                algo,
                root,
                count,
                hist,
            })
    }

    fn header() -> impl Strategy<Value = Header> {
        prop_oneof![
            (
                any::<u64>(),
                any::<u64>(),
                any::<u32>(),
                desc(),
                0..=MAX_PAYLOAD / 8
            )
                .prop_map(|(comm, seq, step, desc, words)| Header::Data {
                    comm,
                    seq,
                    step,
                    desc,
                    len: words * 8 / desc.dtype.size() as u64 * desc.dtype.size() as u64,
                }),
            (
                any::<u64>(),
                0..=MAX_REASON,
                any::<bool>(),
                any::<u64>(),
                any::<bool>()
            )
                .prop_map(|(comm, len, own, from, provisional)| Header::Abort {
                    comm,
                    len,
                    own,
                    from,
                    provisional,
                }),
            (any::<u64>(), any::<u64>(), any::<u32>(), desc()).prop_map(
                |(comm, seq, step, desc)| Header::Want {
                    comm,
                    seq,
                    step,
                    desc
                }
            ),
            (any::<u64>(), any::<bool>())
                .prop_map(|(credit, blocked)| Header::Flow { credit, blocked }),
        ]
    }

    proptest! {
        #[test]
        fn headers_round_trip(h in header()) {
            prop_assert_eq!(Header::decode(&h.encode()), Ok(h));
        }

        /// Arbitrary bytes never panic, and whatever decodes re-encodes to the same bytes
        /// and respects the bounds.
        #[test]
        fn arbitrary_headers_are_checked(b in prop::array::uniform32(any::<u8>()), rest in prop::array::uniform16(any::<u8>())) {
            let mut all = [0u8; HEADER_LEN];
            all[..32].copy_from_slice(&b);
            all[32..].copy_from_slice(&rest);
            if let Ok(h) = Header::decode(&all) {
                prop_assert_eq!(h.encode(), all);
                prop_assert!(h.payload_len() <= MAX_PAYLOAD);
            }
        }

        /// Flipping any byte of a valid header either is refused or decodes to a
        /// header that re-encodes to the flipped bytes: nothing is silently misread.
        #[test]
        fn corrupted_headers(h in header(), at in 0..HEADER_LEN, x in 1..=255u8) {
            let mut b = h.encode();
            b[at] ^= x;
            if let Ok(d) = Header::decode(&b) {
                prop_assert_eq!(d.encode(), b);
            }
        }

        #[test]
        fn hellos_round_trip(nonce: u64, layout: u64, world: u32, src: u32, dst: u32, name in "[a-z/0-9]{0,40}") {
            let h = Hello { nonce, layout, world, src, dst, name: name.clone() };
            let b = h.encode();
            let (mut d, n) = Hello::decode_fixed(b[..HELLO_LEN].try_into().unwrap()).unwrap();
            prop_assert_eq!(n, name.len());
            d.name = String::from_utf8(b[HELLO_LEN..].to_vec()).unwrap();
            prop_assert_eq!(d, h);
        }

        #[test]
        fn arbitrary_hellos_never_panic(b in prop::collection::vec(any::<u8>(), HELLO_LEN)) {
            if let Ok((_, n)) = Hello::decode_fixed(b[..].try_into().unwrap()) {
                prop_assert!(n <= MAX_NAME);
            }
        }
    }

    #[test]
    fn refusals_say_why() {
        let mut b = [0u8; HEADER_LEN];
        b[0] = 9;
        assert!(Header::decode(&b).unwrap_err().0.contains("kind 9"));
        let h = Header::Data {
            comm: 0,
            seq: 0,
            step: 0,
            desc: Desc {
                op: OpKind::AllReduce,
                dtype: DType::F32,
                reduce: Some(ReduceOp::Sum),
                algo: Algo::Ring,
                root: 0,
                count: 3,
                hist: HIST_NONE,
            },
            len: MAX_PAYLOAD + 4,
        };
        assert!(Header::decode(&h.encode())
            .unwrap_err()
            .0
            .contains("exceeds"));
        // An abort's flags are 0 or 1.
        let abort = Header::Abort {
            comm: 1,
            len: 0,
            own: true,
            from: 0,
            provisional: true,
        };
        for at in [1, 2] {
            let mut b = abort.encode();
            b[at] = 2;
            assert!(Header::decode(&b)
                .unwrap_err()
                .0
                .contains("abort frame with data fields set"));
        }
        let mut hello = [0u8; HELLO_LEN];
        hello[..4].copy_from_slice(b"GET ");
        assert!(Hello::decode_fixed(&hello)
            .unwrap_err()
            .0
            .contains("not a rallypoint"));
    }

    #[test]
    fn descriptions_read_well() {
        let d = Desc {
            op: OpKind::Broadcast,
            dtype: DType::BF16,
            reduce: None,
            algo: Algo::Tree,
            root: 2,
            count: 10,
            hist: 0x12_3456,
        };
        assert_eq!(d.to_string(), "broadcast(bf16 x 10, root 2, Tree)");
    }

    #[test]
    fn histories_are_fixed_24_bit_and_tell_orders_apart() {
        let d = |op, count| Desc {
            op,
            dtype: DType::F32,
            reduce: None,
            algo: Algo::Direct,
            root: 0,
            count,
            hist: HIST_NONE,
        };
        let (a, b) = (d(OpKind::Barrier, 0), d(OpKind::AllGather, 1));
        let ab = hist_after(hist_after(HIST_NONE, &a), &b);
        let ba = hist_after(hist_after(HIST_NONE, &b), &a);
        assert_ne!(ab, ba);
        assert!(ab < 1 << HIST_BITS && ab != HIST_NONE);
        assert_eq!(hist_after(7, &a), hist_after(7, &Desc { hist: 9, ..a }));
        assert_eq!(
            hist_after(7, &a),
            hist_after(
                7,
                &Desc {
                    algo: Algo::Shm,
                    ..a
                }
            )
        );
        // Fixed: a change of the function would split ranks of two builds.
        // Computed independently (Python, from the definition above).
        assert_eq!(ab, 0x008a_31b5, "{ab:#010x}");
        let (x, y) = (Desc { hist: ab, ..a }, Desc { hist: ba, ..a });
        assert!(x.diverged_from(&y) && !x.agrees(&y));
        let untracked = Desc {
            hist: HIST_NONE,
            ..a
        };
        assert!(!x.diverged_from(&untracked) && x.agrees(&untracked));
        assert!(!x.agrees(&Desc { count: 1, ..x }));
    }
}
