//! Integration tests of the store crate: one binary, one module per area.

mod client;
mod conformance;
mod protocol;
mod race;
mod support;
mod torch;
mod utils;
