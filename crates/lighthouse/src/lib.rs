//! `rally lighthouse`: the quorum service of per-step fault tolerance.
//!
//! (Module docs to be written as the parts land: the pure quorum rules in
//! `quorum`, the service's state machine in `machine`, the gRPC and HTTP
//! service in `service`.)
//!
//! # Layers
//!
//! The first row is the lowest layer; each module imports only from its own
//! row and the rows above it (`.ci/module-cycles` checks both):
//!
//! | layer | modules |
//! |---|---|
//! | torchft's wire types and gRPC service, generated | `proto` |
//! | torchft's quorum rules, pure | `quorum` |
//! | the service's decisions: events in, actions out | `machine` |
//! | the service: gRPC and HTTP on one port, sessions, ticks, pushes | `service` |

pub mod machine;
pub mod proto;
pub mod quorum;
pub mod service;
