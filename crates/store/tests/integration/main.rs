//! Integration tests of the store crate: one binary, one module per area.

/// Roles: a test starts copies of this binary as child processes, with an
/// environment variable naming the role; such a process runs it here, before
/// the test harness starts, and exits (no role is a test, so none is ever
/// counted as one). A role that panics exits 101, as a failed test does.
#[ctor::ctor(unsafe)]
fn role() {
    if std::env::var_os(race::PORT).is_none() {
        return;
    }
    let code = match std::panic::catch_unwind(race::race_child) {
        Ok(()) => 0,
        Err(_) => 101,
    };
    std::process::exit(code);
}

mod client;
mod conformance;
mod protocol;
mod race;
mod secret;
mod support;
mod torch;
mod utils;
