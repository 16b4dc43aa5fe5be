//! Integration tests: every rank is a task in this process, talking over real
//! loopback TCP through the same code paths as separate processes.

mod bootstrap;
mod failures;
mod fake_peer;
mod flow;
mod generations;
mod harness;
mod hosts;
mod ops;
mod props;
mod scale;
mod secret;
#[cfg(feature = "faults")]
mod sim;
