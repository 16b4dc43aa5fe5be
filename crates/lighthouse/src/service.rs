//! The service of `rally lighthouse`: torchft's gRPC `LighthouseService` and
//! an HTTP/1.1 push and status endpoint on one port, driving the pure
//! [`machine::Lighthouse`](crate::machine::Lighthouse).
//!
//! How it works:
//!
//! * **One session per connection** (`conn`). The accept loop numbers each
//!   TCP connection; each request carries its number, which is the machine's
//!   `Session`. When a connection ends, the machine gets `Closed` and drops
//!   every replica that connection spoke for, at once: torchft's manager
//!   keeps one HTTP/2 channel for heartbeats and quorum calls, so a killed
//!   manager's reset drops it without waiting for its heartbeats to age out.
//! * **One lock** (`state`). The machine, the `Quorum` calls waiting on it
//!   and the watch board sit behind one mutex that no await ever holds: a
//!   request locks, hands its event to the machine with `Instant::now()`,
//!   carries out the returned actions, unlocks, and then awaits its answer
//!   on a oneshot channel. A ticker task sends `Tick` every `quorum_tick` and
//!   at the machine's `next_deadline` (a join wait ending, a heartbeat
//!   expiring).
//! * **gRPC** (`grpc`): `Quorum` joins and waits (bounded by the call's
//!   `grpc-timeout`) for an issued quorum that contains the requester; one
//!   that is not in an issued quorum keeps waiting, as in torchft.
//!   `Heartbeat` records life. A replica id held by another live connection
//!   is `ALREADY_EXISTS`; a malformed or oversized ([`MAX_MESSAGE`]) request
//!   is refused by its status, the connection and every other member
//!   unharmed.
//! * **State in etcd** (`etcd`, `lead`), with `--state
//!   etcd://HOST:PORT[/prefix]`: one lighthouse per prefix leads (an etcd
//!   lease on a leader key), the others stand by and refuse every call
//!   until the leader's lease expires; the leader saves each quorum with a
//!   new id before answering it, so a lighthouse that takes over goes on
//!   above it and re-issues the last quorum at once when its members
//!   return. The rules are in [`etcd`]'s docs.
//! * **Push** (`watch`, `http`): an `Abort` (a member of the current
//!   quorum dropped) is written on the watch board, which resolves the
//!   `/v1/watch` long-polls of that quorum at once, so survivors abort their
//!   generation instead of waiting out a process-group timeout. `/status`
//!   and `/metrics` read the machine's state and the service's counters.
//!
//! # Layers
//!
//! | layer | modules |
//! |---|---|
//! | the watch board and its answers, pure; wire types and the encoded answer; heal reports; etcd's keys and calls | `watch`, `wire`, `heals`, `etcd` |
//! | the machine behind its lock, waiters, counters, role | `state` |
//! | the gRPC handlers; the HTTP endpoints; the lead task | `grpc`, `http`, `lead` |
//! | the accept loop: sessions, routing, refusals | `conn` |
//!
//! Quorum ids start above [`Config::first_id`], the unix time in
//! milliseconds at start by default, so a restarted lighthouse never reuses
//! one. That rests on the wall clock: each id issued uses up one
//! millisecond of headroom, so the new service's ids are fresh as long as
//! its start reads later than the old one's start plus the ids the old one
//! issued (a new id per change of members, commit failure or abort: a few
//! per fault, against the thousands of milliseconds of any uptime). It
//! assumes the clock never steps back by more than that margin across a
//! restart (NTP's slewing is fine; a step back by hours is not), and that a
//! lighthouse restarted on another host has no such skew against the
//! first. A reused id with other members would leave torchft's managers on
//! their old configuration (they reconfigure only on a new id). There is no
//! margin beyond that: give `first_id` yourself (the library) where the
//! clock cannot be trusted, or use `--state etcd://`, whose saved id
//! replaces the clock's once anything was saved under the prefix.
//!
//! ```no_run
//! # async fn f() -> std::io::Result<()> {
//! use rallypoint_lighthouse::quorum::Knobs;
//! use rallypoint_lighthouse::service::{Config, Server};
//!
//! let server = Server::bind("127.0.0.1:0".parse().unwrap(), Config::new(Knobs::ours(2))).await?;
//! println!("listening on {}", server.local_addr()?);
//! server.run(std::future::pending()).await
//! # }
//! ```

mod conn;
pub mod etcd;
mod grpc;
mod heals;
mod http;
mod lead;
mod state;
mod watch;
mod wire;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinSet;

pub use conn::MAX_MESSAGE;
pub use grpc::{parse_grpc_timeout, unix_millis, DEFAULT_QUORUM_WAIT, MAX_REPLICA_ID};
pub use http::MAX_WATCH;

use crate::machine::Lighthouse;
use crate::quorum::Knobs;

/// How the service runs.
#[derive(Clone, Debug)]
pub struct Config {
    /// torchft's knobs (`--min_replicas`, `--join_timeout_ms`, ...).
    pub knobs: Knobs,
    /// Quorum ids start above this.
    pub first_id: i64,
    /// Largest gRPC message accepted, in bytes.
    pub max_message: usize,
    /// `--state etcd://...`: lead (or stand by) through this etcd.
    pub state: Option<etcd::Etcd>,
    /// The job secret a connection must prove before its first request
    /// (issue 49; `--job-secret-file`); the process's by default. torchft's
    /// own managers cannot prove it.
    pub secret: Option<rallypoint_auth::JobSecret>,
}

impl Config {
    /// These knobs, ids above the unix time in milliseconds now, a 1 MiB
    /// message cap.
    pub fn new(knobs: Knobs) -> Config {
        Config {
            knobs,
            first_id: unix_millis(),
            max_message: MAX_MESSAGE,
            state: None,
            secret: rallypoint_auth::process_secret(),
        }
    }
}

/// A bound lighthouse, not yet serving.
pub struct Server {
    listener: TcpListener,
    config: Config,
}

impl Server {
    /// Binds `addr`.
    pub async fn bind(addr: SocketAddr, config: Config) -> std::io::Result<Server> {
        Ok(Server::from_listener(
            TcpListener::bind(addr).await?,
            config,
        ))
    }

    /// Serves on an already bound listener.
    pub fn from_listener(listener: TcpListener, config: Config) -> Server {
        Server { listener, config }
    }

    /// The bound address.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Serves until `shutdown` resolves; then stops accepting and ends every
    /// connection and task it started. An accept error (out of file
    /// descriptors) is logged and retried after a pause, never fatal. With
    /// `--state`, it also ends (an error saying why) when it led and lost
    /// its lease; a clean stop gives its lease up, so a standby takes over
    /// at once.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> std::io::Result<()> {
        let Config {
            knobs,
            first_id,
            max_message,
            state,
            secret,
        } = self.config;
        let quorum_tick = knobs.quorum_tick;
        let keep_alive = knobs.heartbeat_timeout;
        let standby = state
            .as_ref()
            .map(|e| format!("(nobody yet: campaigning at {})", e.url));
        let shared = state::Shared::new(Lighthouse::new(knobs, first_id), standby);
        let mut conns = conn::Conns::new(shared.clone(), max_message, keep_alive);
        conns.secret = secret;
        let conns = Arc::new(conns);
        let mut tasks = JoinSet::new();
        tasks.spawn(shared.clone().ticker(quorum_tick));
        let mut lead = JoinSet::new();
        if let Some(etcd) = state.clone() {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
            let me = format!(
                "{} on {} (pid {})",
                self.listener.local_addr()?,
                host.trim(),
                std::process::id()
            );
            lead.spawn(lead::lead(etcd, shared.clone(), me));
        }
        let mut next_session = 0;
        let (close_tx, mut closes) = mpsc::unbounded_channel();
        let mut open = |stream, peer: SocketAddr, tasks: &mut JoinSet<()>| {
            next_session += 1;
            shared.opened(next_session, peer.ip());
            tracing::debug!(session = next_session, %peer, "session opened");
            let serve = conns
                .clone()
                .serve(next_session, stream, peer, close_tx.clone());
            tasks.spawn(serve);
        };
        tokio::pin!(shutdown);
        let mut stopped = None;
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                Some(why) = lead.join_next() => {
                    stopped = Some(why.unwrap_or_else(|e| format!("the lead task failed: {e}")));
                    break;
                }
                accepted = self.listener.accept() => match accepted {
                    Ok((stream, peer)) => open(stream, peer, &mut tasks),
                    Err(e) => {
                        tracing::warn!("accept failed: {e}; retrying in 100 ms");
                        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    }
                },
                Some(session) = closes.recv() => {
                    // The connections its client may have made before
                    // dropping it are known first (`conn::backlog`).
                    for (stream, peer) in conn::backlog(&self.listener) {
                        open(stream, peer, &mut tasks);
                    }
                    shared.closed(session);
                }
                // Reap finished connections so the set does not grow.
                Some(_) = tasks.join_next(), if tasks.len() > 1 => {}
            }
        }
        tasks.shutdown().await;
        lead.shutdown().await;
        if let Some(why) = stopped {
            return Err(std::io::Error::other(why));
        }
        if let (Some(etcd), state::Role::Leader { lease }) = (state, shared.role()) {
            etcd.resign(lease).await;
        }
        Ok(())
    }
}
