//! Between the machine's types and torchft's wire types, and the answer to a
//! `Quorum` call encoded once per issued quorum.
//!
//! torchft's protocol answers every member with the whole quorum, so a round
//! of n members writes n answers of n members each. The service encodes the
//! answer once when the quorum is issued ([`Issued`]) and every waiting call
//! writes the same bytes ([`Encoded`], a prost message that is its encoding),
//! instead of cloning and encoding n members n times.

use bytes::{Buf, BufMut, Bytes};
use prost::encoding::{skip_field, DecodeContext, WireType};
use prost::{DecodeError, Message};

use crate::machine::Remembered;
use crate::proto;
use crate::quorum::{Member, Quorum};

/// An issued quorum, with the `LighthouseQuorumResponse` that answers it.
#[derive(Debug)]
pub struct Issued {
    pub quorum: Quorum,
    pub answer: Encoded,
}

impl Issued {
    pub fn new(quorum: Quorum) -> Issued {
        let response = proto::LighthouseQuorumResponse {
            quorum: Some(to_proto(quorum.clone())),
        };
        let answer = Encoded(Bytes::from(response.encode_to_vec()));
        Issued { quorum, answer }
    }
}

/// A message already encoded: writing it copies its bytes. Only ever
/// written by the service; reading one skips every field.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Encoded(pub Bytes);

impl Message for Encoded {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        buf.put_slice(&self.0);
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        skip_field(wire_type, tag, buf, ctx)
    }

    fn encoded_len(&self) -> usize {
        self.0.len()
    }

    fn clear(&mut self) {
        self.0 = Bytes::new();
    }
}

/// torchft's `QuorumMember` as the machine's.
pub fn member(m: proto::QuorumMember) -> Member {
    Member {
        replica_id: m.replica_id,
        address: m.address,
        store_address: m.store_address,
        step: m.step,
        world_size: m.world_size,
        shrink_only: m.shrink_only,
        commit_failures: m.commit_failures,
        data: m.data,
    }
}

/// Our extension's remembered quorum as the machine's.
pub fn remembered(r: proto::LastQuorum) -> Remembered {
    Remembered {
        quorum_id: r.quorum_id,
        replica_ids: r.replica_ids,
    }
}

/// The machine's quorum as torchft's.
pub fn to_proto(q: Quorum) -> proto::Quorum {
    proto::Quorum {
        quorum_id: q.id,
        participants: q.participants.into_iter().map(member_to_proto).collect(),
        created: Some(prost_types::Timestamp::from(q.created)),
    }
}

fn member_to_proto(m: Member) -> proto::QuorumMember {
    proto::QuorumMember {
        replica_id: m.replica_id,
        address: m.address,
        store_address: m.store_address,
        step: m.step,
        world_size: m.world_size,
        shrink_only: m.shrink_only,
        commit_failures: m.commit_failures,
        data: m.data,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::SystemTime;

    #[test]
    fn the_encoded_answer_is_torchfts_response() {
        let m = Member {
            replica_id: "r:1".into(),
            address: "http://h:1".into(),
            store_address: "h:2".into(),
            step: 7,
            world_size: 2,
            shrink_only: true,
            commit_failures: 1,
            data: "{}".into(),
        };
        let q = Quorum {
            id: 42,
            participants: vec![m.clone()],
            created: SystemTime::UNIX_EPOCH,
        };
        let issued = Issued::new(q.clone());
        let mut framed = Vec::new();
        issued.answer.encode(&mut framed).unwrap();
        let back = proto::LighthouseQuorumResponse::decode(&framed[..]).unwrap();
        let got = back.quorum.unwrap();
        assert_eq!(got.quorum_id, 42);
        assert_eq!(member(got.participants[0].clone()), m);
        assert_eq!(got, to_proto(q));
    }
}
