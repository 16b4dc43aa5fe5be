//! In-process RPC groups over real TCP (and the process-group backend).

mod harness;

mod calls;
mod devices;
mod faults;
mod groups;
mod rrefs;
mod secret;
mod shutdown;
