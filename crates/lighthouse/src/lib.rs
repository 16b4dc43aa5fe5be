//! `rally lighthouse`: the quorum service of per-step fault tolerance, a
//! drop-in for torchft's `torchft_lighthouse`.
//!
//! Replica groups of a fault-tolerant job ask it, at every step, which
//! groups take part (a *quorum*); a group that died drops out of the step,
//! the others commit without it, and it rejoins later by healing from a
//! live one. It speaks torchft's gRPC `LighthouseService` (`Quorum`,
//! `Heartbeat`) and takes `torchft_lighthouse`'s flags, so torchft's own
//! managers use it with `TORCHFT_LIGHTHOUSE=http://HOST:PORT` and nothing
//! else changed.
//!
//! How it is built, bottom up:
//!
//! * [`quorum`]: torchft's quorum rules (`quorum_compute`: healthy
//!   replicas, the fast quorum, `min_replicas`, the majority guard against
//!   split brain, the join wait, `shrink_only`; a new id on a change of
//!   members or a commit failure) as a pure function, with two deviations
//!   the simulator found as livelocks in torchft's rules (its docs).
//! * [`machine`]: the service's decisions as a state machine, events in
//!   (a join, a heartbeat, a connection that ended, time passing) and
//!   actions out (issue a quorum, refuse a request, push an abort), with
//!   what torchft lacks: **liveness from the connection** (a killed
//!   member's reset drops it at once; a silent one goes at its keep-alive,
//!   1 s by default), **aborts pushed** to the survivors of a dropped
//!   member, a replica id held by one process, a new id after every abort,
//!   calls that ended dropped from the participants, and quorum ids that a
//!   restarted service never reuses (ids from the wall clock: see
//!   [`service`] for the assumption). Heartbeats from ids never seen are
//!   accepted, as torchft does (see [`machine`]). `tests/sim.rs` drives it
//!   through seeded schedules of kills, silences, stalls, restarts,
//!   impostors and calls given up, checking its invariants after every
//!   step.
//! * [`service`]: gRPC and HTTP/1.1 on one port (`/v1/watch`,
//!   `/v1/heal`, `/status`, `/metrics`), one session per TCP connection,
//!   one lock; with `--state etcd://` one leader per etcd prefix, the
//!   others standing by, each new quorum saved before it is answered
//!   ([`service::etcd`]).
//!
//! The guide is `docs/ft.md`.
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
