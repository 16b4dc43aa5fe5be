//! Which service a listener is, named in the HELLO so that a client that meant another one
//! is told so instead of being refused for a wrong secret.

use std::fmt;

use super::wire::is_valid_label;

/// A service label: 1 to 32 bytes of `a-z 0-9 . _ -`, checked when the constant is made.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Service(&'static str);

impl Service {
    /// The store server (`rally store serve`, the agent's job store).
    pub const STORE: Service = Service::new("store");
    /// The rendezvous.
    pub const RENDEZVOUS: Service = Service::new("rendezvous");
    /// The collectives' listeners.
    pub const COLLECTIVES: Service = Service::new("collectives");
    /// The RPC listeners.
    pub const RPC: Service = Service::new("rpc");
    /// The quorum service (`rally lighthouse`).
    pub const LIGHTHOUSE: Service = Service::new("lighthouse");

    /// A service named `label`. Panics (at compile time, in a `const`) on an invalid label.
    pub const fn new(label: &'static str) -> Service {
        assert!(
            is_valid_label(label.as_bytes()),
            "a service label is 1 to 32 bytes of a-z 0-9 . _ -"
        );
        Service(label)
    }

    /// Its label, as on the wire.
    pub const fn label(self) -> &'static str {
        self.0
    }
}

impl fmt::Display for Service {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}
