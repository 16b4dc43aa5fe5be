//! rallypoint-auth over real loopback TCP: listeners that run the handshake on their own
//! thread (std) or task (tokio) per connection, and clients good, wrong and hostile.

mod clients;
mod flood;
mod server;
