//! torchft's wire types and its `torchft.LighthouseService` (server and
//! client), generated from the lighthouse's part of torchft's
//! `proto/torchft.proto` by `codegen/regen.sh` and committed, so that building
//! needs no protoc. Package and names are torchft's own: its managers call
//! `/torchft.LighthouseService/Quorum` and `/torchft.LighthouseService/Heartbeat`
//! on `rally lighthouse` as on `torchft_lighthouse`. Do not edit `torchft.rs`
//! by hand; change `codegen/proto/torchft.proto` and regenerate.

#[allow(clippy::all, clippy::pedantic, missing_docs)]
#[rustfmt::skip]
mod torchft;

pub use torchft::lighthouse_service_client::LighthouseServiceClient;
pub use torchft::lighthouse_service_server::{LighthouseService, LighthouseServiceServer};
pub use torchft::{
    LastQuorum, LighthouseHeartbeatRequest, LighthouseHeartbeatResponse, LighthouseQuorumRequest,
    LighthouseQuorumResponse, Quorum, QuorumMember,
};
