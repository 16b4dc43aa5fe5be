//! Connections between ranks and the router that hands frames to operations.
//!
//! Each process group (with its subgroups) has one transport: a listener whose
//! address rank `r` publishes under `addr/r` in the group's store prefix, and at
//! most a few TCP connections per peer, opened lazily by whichever side first needs
//! to send, so an algorithm that talks to `log n` peers opens `log n` connections.
//! A connection carries frames both ways; when both sides open one at the same
//! moment both are kept. With one stream per peer a rank sends every frame to a
//! peer on the same connection (the first), so the peer reads them in order.
//!
//! One reader task per connection reads frames and hands each to the
//! [`Router`] (`router.rs`, synchronous): to the operation waiting for its key
//! `(group, source, sequence number, step)`, or into a mailbox until that
//! operation asks; an operation that cannot be leaked may instead post a
//! receive with a landing in its own buffer, and the reader reads the payload
//! straight into it (`landing.rs`). Frames are compared with the local call as they arrive, so a
//! rank that called a different collective is caught at its first frame,
//! whatever steps the two algorithms use. Frames are written whole
//! (`send::WholeFrame`), even when the operation writing one is cancelled.
//!
//! When the last connection with a peer ends (EOF, reset), after its reader
//! has delivered every frame it carried, the peer is checked by connecting
//! anew: a dead peer refuses (or another group's process, which took its port,
//! answers [`crate::frame::NOT_HERE`]), and is marked gone; every operation waiting on it
//! fails at once, and so does every later receive from it that is not already
//! in the mailbox. (A live peer can end a connection too: one it dropped
//! mid-handshake.) A bad frame marks its sender gone at once. A failed send
//! fails its op, but leaves marking the peer to the reader, so frames the peer
//! sent before it went are not lost. Nothing fails merely because a peer
//! exited after doing its part. Nor does a connect that fails while the peer's
//! own connection with us is up (both sides connected at once, and the
//! exiting peer's listener closed first): its reader names it gone, after its
//! frames. Connecting is the transport's own task, never
//! cut short by the op that asked for it. A receive that has waited a moment asks the peer
//! for its part ([`Header::Want`]), which opens a connection if there is none, so
//! a peer that died before ever connecting is noticed as a refused connection
//! rather than at the timeout. Aborts are described at [`Shared::abort`].
//!
//! Flow control (`flow.rs`) bounds the frames filed from each peer by credit:
//! a sender counts the bytes it sent that the peer's operations have not
//! taken, and past [`Config::receive_window`] sends only frames of operations
//! the peer asked for. The router decides; the flow and
//! want frames it queues go to each peer through one task per peer
//! (`send::control_loop`), in the order decided.
//!
//! This file holds the state they share ([`Shared`]) and starts the
//! transport; the rest is one concern per file:
//!
//! | file | what it owns |
//! |---|---|
//! | `conn.rs` | opening, accepting and checking connections (the job-secret handshake first, if any); liveness; probes |
//! | `reader.rs` | the reader task per connection; receives |
//! | `send.rs` | sending frames whole, within credit; the control frames' task |
//! | `abort.rs` | aborts (marked, passed down, recorded, told) and peers gone |
//! | `mismatch.rs` | calls recorded and compared; mismatches raised |
//! | `diverged.rs` | calls found diverged, held for the first mismatch |
//! | `abort/plan.rs`, `mismatch/plan.rs`, `diverged/finding.rs` | what each of those three decides, as pure functions with table tests |
//! | `router.rs` | which op a frame is for; each group's entry (`router/groups.rs`), whose hearer, links to internal and parent groups and telling watch it stores but never calls; no I/O |
//! | `flow.rs`, `landing.rs` | credit per peer; receives posted into ops' buffers |
//! | `faults.rs` | fault injection for tests |
//! | `lock_order.rs` | the order of [`Shared`]'s locks, checked in debug builds |

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rallypoint_auth::{JobSecret, RefusalCounts, Refusals};
use rallypoint_store::Store;
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::element::Pool;
use crate::error::Error;
use crate::frame::Header;

/// How long an accepted connection may take to say hello.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a closed peer waits for handshakes in progress (see `handshakes_settled`).
const SETTLE_MAX: Duration = Duration::from_millis(250);
/// How long an abort frame may take to reach a member.
const ABORT_DEADLINE: Duration = Duration::from_secs(2);

mod abort;
mod conn;
mod diverged;
mod faults;
mod flow;
mod landing;
mod lock_order;
mod mismatch;
mod reader;
mod router;
mod send;

use conn::accept_loop;
use flow::Outbound;
pub(crate) use landing::{Gate, Landing};
use lock_order::{Guard, Ordered};
use router::Router;
pub(crate) use router::{Clash, Fail, Key, Start};

/// What else hears a group's aborts, besides its operations waiting on
/// TCP: a group over shared memory marks them in its region, where ranks
/// sleeping on it wake (see [`Shared::add_hearer`]).
pub(crate) trait HearsAborts: Send + Sync {
    /// The group is aborted from its op `from_seq` on.
    fn aborted(&self, from_seq: u64);
    /// This rank was killed (fault injection).
    fn killed(&self);
}

/// A group's name and members (world ranks, in group-rank order).
#[derive(Clone)]
pub(crate) struct Members {
    pub name: String,
    pub ranks: Arc<[usize]>,
}

impl Members {
    /// The group rank of a world rank, for messages.
    pub fn group_rank(&self, world: usize) -> usize {
        self.ranks.iter().position(|&r| r == world).unwrap_or(world)
    }
}

/// Members named "test", for the router's tests.
#[cfg(test)]
impl From<Vec<usize>> for Members {
    fn from(ranks: Vec<usize>) -> Members {
        Members {
            name: "test".into(),
            ranks: ranks.into(),
        }
    }
}

pub(crate) struct Conn {
    id: u64,
    writer: Arc<tokio::sync::Mutex<OwnedWriteHalf>>,
}

#[derive(Default)]
struct Peer {
    conns: Vec<Arc<Conn>>,
}

/// An internal group of a group (see `two_level`): the group's abort aborts
/// it too, from the first step of the first op the abort fails.
///
/// **Step numbers follow from op numbers.** Op `s` of the group owns the
/// internal ops `s * width ..= s * width + width - 1` (its steps on this
/// internal group), whether it runs them or not: a flat op, or a broadcast's
/// unused second stage, leaves its numbers unused. So one rank's step can
/// only ever be taken for the same op's step on another rank: were the
/// numbers handed out in the order ops came, a rank that called a flat op
/// where the others called a two-level one would run its next op's steps
/// as the others' steps of this one, on their data (and, the calls being
/// alike, without a mismatch).
pub(crate) struct ChildLink {
    pub comm: u64,
    pub parent: u64,
    /// Internal ops per op of the group.
    width: u64,
    /// The first op of the group that the group's abort fails.
    aborted_from: Ordered<Option<u64>>,
}

impl ChildLink {
    pub fn new(comm: u64, parent: u64, width: u64) -> ChildLink {
        assert!(width > 0, "an op owns at least one internal op");
        ChildLink {
            comm,
            parent,
            width,
            aborted_from: Ordered::with_default(lock_order::CHILD_LINK),
        }
    }

    /// The first internal op that op `seq` of the group owns; `None` when
    /// the group's abort fails the op (then it runs no step).
    pub fn steps_of(&self, seq: u64) -> Option<u64> {
        if lock(&self.aborted_from).is_some_and(|f| seq >= f) {
            return None;
        }
        Some(seq.saturating_mul(self.width))
    }

    /// The op of the group that owns internal op `seq`.
    pub fn parent_seq(&self, seq: u64) -> u64 {
        seq / self.width
    }

    /// Notes the group's abort from its op `from`; returns the first
    /// internal op it fails (the first that op `from` owns: the steps of
    /// earlier ops, which the abort leaves to finish, are all below it).
    fn abort_from(&self, from: u64) -> u64 {
        let mut f = lock(&self.aborted_from);
        *f = Some(f.map_or(from, |f| f.min(from)));
        from.saturating_mul(self.width)
    }
}

/// Options fixed for a transport's life.
pub(crate) struct Config {
    pub name: String,
    pub rank: usize,
    pub world: usize,
    pub nonce: u64,
    pub layout: u64,
    pub streams: usize,
    pub probe_after: Duration,
    pub handshake_timeout: Duration,
    pub peer_timeout: Duration,
    /// The largest data payload (sizes the buffer pool).
    pub segment_bytes: usize,
    /// Bytes a peer may send this rank that its operations have not taken,
    /// before the peer sends only frames asked for (0: no bound).
    pub receive_window: u64,
    /// The job secret each connection proves, both ways, before its hello
    /// (`None`: none, the hello comes first as ever).
    pub secret: Option<JobSecret>,
}

/// The state a transport's tasks share.
///
/// **Lock order.** Its `std` mutexes are [`Ordered`]: a thread takes them
/// only in this order, and debug builds check it (`lock_order.rs`):
///
/// 1. `router`: frames, waiters, aborts, and each group's entry (members,
///    hearer, links, telling, calls found diverged).
/// 2. `outbound`: this rank's credit with each peer.
/// 3. `control`: the queues of control frames (the router's and the
///    credit's decisions are queued under their lock, so they go out in the
///    order decided).
/// 4. Leaves, each taken alone: `peers`, `addrs`, `unpublished`,
///    `connecting`, `hosts`, `store`, and each [`ChildLink`]'s abort.
///
/// The router stores each group's hearer ([`HearsAborts`]), its
/// [`ChildLink`]s and its telling watch, but calls none of them: the
/// transport clones them out under the `router` lock and uses them once it
/// is released, so a hearer is called with no lock held. The `tokio`
/// mutexes, a connection's writer and a peer's connecting gate, are apart
/// from this order: they are held across `.await`, and a `std` guard never
/// is (it is not `Send`, so a future holding one there could not be
/// spawned), so no `std` lock is held while one is waited for; and neither
/// is taken while the other is held (a connection is opened before its
/// writer is taken). A landing's gate (`landing.rs`) is per receive, held
/// only while bytes are copied into the op's buffer.
pub(crate) struct Shared {
    pub cfg: Config,
    /// The group's (prefixed) store; a group that changes members
    /// ([`crate::ProcessGroup::next_generation`]) swaps in each
    /// generation's.
    store: Ordered<Arc<dyn Store>>,
    pub local_addr: SocketAddr,
    pool: Arc<Pool>,
    addrs: Ordered<HashMap<usize, SocketAddr>>,
    peers: Ordered<HashMap<usize, Peer>>,
    connecting: Ordered<HashMap<usize, Arc<tokio::sync::Mutex<()>>>>,
    /// Frames, waiters, aborts, and each group's entry (see `router.rs`).
    router: Ordered<Router>,
    /// This rank's credit with each peer (flow control).
    outbound: Ordered<Outbound>,
    /// Wakes sends waiting for credit: credit or a want arrived, or a peer
    /// went.
    flow_changed: tokio::sync::Notify,
    /// Per peer, the queue of flow and want frames to send, in order.
    control: Ordered<HashMap<usize, tokio::sync::mpsc::UnboundedSender<Header>>>,
    /// Peers whose address was looked for and not found (yet).
    unpublished: Ordered<std::collections::HashSet<usize>>,
    /// The `host/<rank>` entries read so far (world rank to process id and
    /// host), from which each group decides on shared memory (see `shm`).
    pub hosts: Ordered<HashMap<usize, (u32, String)>>,
    refused: AtomicU64,
    /// Connections the job-secret handshake refused, by kind.
    refusals: Refusals,
    /// Connections established (opened or accepted), for
    /// [`crate::ProcessGroup::handshakes`].
    handshakes: AtomicU64,
    /// See [`Shared::landed_bytes`].
    landed_bytes: AtomicU64,
    next_conn: AtomicU64,
    /// Accepted connections still in their handshake (whose peer is not known yet).
    handshaking: AtomicUsize,
    handshakes_done: tokio::sync::Notify,
    cancel: CancellationToken,
    /// Fault injection (feature `faults`): see `Shared::kill`.
    faults: Faults,
    /// The runtime the group was formed on: its tasks (readers, aborts, `Work`)
    /// run there even when an operation is started from plain blocking code.
    pub rt: tokio::runtime::Handle,
}

/// How far the telling of an abort has come.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Telling {
    /// Writing the record to the store (origins only).
    Recording,
    Sending,
    Sent,
}

/// Where an abort comes from, which decides who records and tells it (see
/// [`Shared::abort`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Origin {
    /// The failure happened here: recorded in the store first, and told to
    /// every member if the record is the first.
    Here,
    /// Passed on: told by this member (not told back), or from the group's
    /// parent or an operation that failed on another's abort (`None`).
    Passed(Option<usize>),
    /// Calls found diverged, reported before their grace ended, as this
    /// rank leaves the group or an op's deadline passes (`diverged.rs`):
    /// told, marked provisional, to the members this rank is connected
    /// with, who hold it for the first mismatch; not recorded (a record
    /// would stop the first mismatch's, which wins over it, from being
    /// told to every member); passed to internal groups as provisional too,
    /// and not marked in shared memory (which would fail the members there
    /// for good).
    Leaving,
}

/// Test faults: a rank that dies the way a killed process does, or whose
/// connection is reset while it lives on.
struct Faults {
    dead: AtomicBool,
    /// Die on being about to send this data frame (counted from 0).
    #[cfg(feature = "faults")]
    kill_at: AtomicU64,
    #[cfg(feature = "faults")]
    frames: AtomicU64,
    /// Break the connection on sending this TCP frame (data or control,
    /// counted from 0), after this many of its bytes (see
    /// [`Shared::break_at_frame`]).
    #[cfg(feature = "faults")]
    break_at: AtomicU64,
    #[cfg(feature = "faults")]
    break_after: AtomicU64,
    #[cfg(feature = "faults")]
    tcp_frames: AtomicU64,
    #[cfg(feature = "faults")]
    broke: AtomicBool,
}

/// The owner's handle: dropping it stops the listener and every reader and closes
/// every connection.
pub(crate) struct Transport {
    pub shared: Arc<Shared>,
}

impl Drop for Transport {
    fn drop(&mut self) {
        self.shared.cancel.cancel();
    }
}

fn lock<T>(m: &Ordered<T>) -> Guard<'_, T> {
    m.lock()
}

impl Transport {
    /// Starts listening on `listener`; `store` is the group's (prefixed) store.
    pub fn start(
        cfg: Config,
        store: Arc<dyn Store>,
        listener: TcpListener,
    ) -> std::io::Result<Transport> {
        let local_addr = listener.local_addr()?;
        let window = cfg.receive_window;
        let shared = Arc::new(Shared {
            // What one peer can have in flight (the ring's case), within
            // 32 to 64 MiB; more than that, from several peers at once or a
            // larger window, is allocated afresh.
            pool: Pool::new(cfg.segment_bytes, window.clamp(32 << 20, 64 << 20) as usize),
            cfg,
            store: Ordered::new(lock_order::STORE, store),
            local_addr,
            addrs: Ordered::with_default(lock_order::ADDRS),
            peers: Ordered::with_default(lock_order::PEERS),
            connecting: Ordered::with_default(lock_order::CONNECTING),
            router: Ordered::new(lock_order::ROUTER, Router::new(window)),
            outbound: Ordered::new(lock_order::OUTBOUND, Outbound::new(window)),
            flow_changed: tokio::sync::Notify::new(),
            control: Ordered::with_default(lock_order::CONTROL),
            hosts: Ordered::with_default(lock_order::HOSTS),
            unpublished: Ordered::with_default(lock_order::UNPUBLISHED),
            refused: AtomicU64::new(0),
            refusals: Refusals::new(),
            handshakes: AtomicU64::new(0),
            landed_bytes: AtomicU64::new(0),
            next_conn: AtomicU64::new(0),
            handshaking: AtomicUsize::new(0),
            handshakes_done: tokio::sync::Notify::new(),
            rt: tokio::runtime::Handle::current(),
            cancel: CancellationToken::new(),
            faults: Faults {
                dead: AtomicBool::new(false),
                #[cfg(feature = "faults")]
                kill_at: AtomicU64::new(u64::MAX),
                #[cfg(feature = "faults")]
                frames: AtomicU64::new(0),
                #[cfg(feature = "faults")]
                break_at: AtomicU64::new(u64::MAX),
                #[cfg(feature = "faults")]
                break_after: AtomicU64::new(0),
                #[cfg(feature = "faults")]
                tcp_frames: AtomicU64::new(0),
                #[cfg(feature = "faults")]
                broke: AtomicBool::new(false),
            },
        });
        shared.rt.spawn(accept_loop(shared.clone(), listener));
        Ok(Transport { shared })
    }
}

impl Shared {
    /// Connections refused: at the hello, or by the job-secret handshake.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed) + self.refusals.snapshot().total()
    }

    /// Connections the job-secret handshake refused, by kind.
    pub fn secret_refusals(&self) -> RefusalCounts {
        self.refusals.snapshot()
    }

    /// The size of every per-group table here, for tests that check that
    /// dropped groups leave nothing behind.
    #[cfg(test)]
    pub fn group_tables(&self) -> Vec<(&'static str, usize)> {
        lock(&self.router).group_tables()
    }

    /// Group `comm`'s last handle and op are gone here. Its state is kept
    /// for a grace (four probes, at least a second): frames and wants for
    /// its last ops still on their way are compared with its calls, and a
    /// mismatch found then is raised and told as ever. Then it is retired.
    pub fn dropped(self: &Arc<Self>, comm: u64) {
        let grace = (self.cfg.probe_after * 4).max(Duration::from_secs(1));
        let me = self.clone();
        // On a runtime shutting down this is a no-op, and so is everything
        // else; a transport that stops takes every group with it.
        self.rt.spawn(async move {
            tokio::select! {
                _ = tokio::time::sleep(grace) => me.retire(comm),
                _ = me.cancel.cancelled() => {}
            }
        });
    }

    /// Forgets group `comm`, dropped here a grace ago: its entry (members,
    /// the region that heard its aborts, its links to internal groups) and
    /// its router tables (the credit of the frames filed for it goes back to
    /// their senders now), all under the router's lock. A failed group (aborted, or holding calls found
    /// diverged) keeps all: its abort may still be told, recorded, or asked
    /// for by a peer's frame, and a finding awaits its grace, to be
    /// reported even as this rank leaves (see `diverged.rs`). Failures are
    /// rare; `new_group` in a loop is not.
    pub fn retire(self: &Arc<Self>, comm: u64) {
        // Checked and retired under the router's lock, so that an abort or
        // a finding arriving meanwhile is not lost.
        let mut r = lock(&self.router);
        let held = r.groups().get(comm).is_some_and(|g| g.finding.is_some());
        if r.aborted(comm).is_some() || held {
            return;
        }
        r.retire(comm);
        self.queue_control(&mut r);
    }

    pub fn register_members(&self, comm: u64, m: Members) {
        lock(&self.router).set_members(comm, m);
    }

    pub fn members(&self, comm: u64) -> Option<Members> {
        lock(&self.router).groups().members(comm).cloned()
    }

    /// Group `comm`'s link to its group, if it is an internal group.
    fn parent_link(&self, comm: u64) -> Option<Arc<ChildLink>> {
        lock(&self.router).groups().get(comm)?.parent.clone()
    }

    /// The group's abort, if it is aborted (whatever the abort fails).
    pub fn aborted(&self, comm: u64) -> Option<Error> {
        lock(&self.router).aborted(comm).cloned()
    }

    /// The abort that fails collective `seq` of `comm` (`None`: a
    /// point-to-point message), if any.
    pub fn aborted_for(&self, comm: u64, seq: Option<u64>) -> Option<Error> {
        lock(&self.router).aborted_for(comm, seq)
    }

    /// Whether this rank is waiting for `peer` to publish its address.
    pub fn awaiting_address(&self, peer: usize) -> bool {
        lock(&self.unpublished).contains(&peer)
    }

    /// Whether any connection with `peer` exists.
    pub fn connected(&self, peer: usize) -> bool {
        lock(&self.peers)
            .get(&peer)
            .is_some_and(|p| !p.conns.is_empty())
    }

    /// Links internal group `child` to group `parent`'s aborts.
    pub fn add_child(&self, parent: u64, child: Arc<ChildLink>) {
        lock(&self.router).groups_mut().add_child(parent, child);
    }

    /// World rank `r`'s process id, from its host entry, if read.
    pub fn host_pid(&self, r: usize) -> Option<u32> {
        lock(&self.hosts).get(&r).map(|h| h.0)
    }

    /// Bytes received ahead of the operations that take them, from every peer.
    pub fn filed_bytes(&self) -> u64 {
        lock(&self.router).filed_bytes()
    }

    /// Runs `f` on the router, then queues the flow and want frames it
    /// decided, still under its lock, so they go out in the order decided.
    fn route<R>(self: &Arc<Self>, f: impl FnOnce(&mut Router) -> R) -> R {
        let mut r = lock(&self.router);
        let out = f(&mut r);
        self.queue_control(&mut r);
        out
    }

    /// The group's (prefixed) store: the current generation's.
    pub fn store(&self) -> Arc<dyn Store> {
        lock(&self.store).clone()
    }

    /// The next generation's store (see `group/reform.rs`): addresses,
    /// hosts, regions and abort records are looked up and written there
    /// from now on (an earlier generation's abort record too: its key is
    /// its own).
    pub fn set_store(&self, store: Arc<dyn Store>) {
        *lock(&self.store) = store;
    }

    /// Connections established with peers so far (opened or accepted).
    pub fn handshakes(&self) -> u64 {
        self.handshakes.load(Ordering::Relaxed)
    }

    /// The peers this rank has found gone (world ranks, sorted).
    pub fn gone_peers(&self) -> Vec<usize> {
        let mut v = lock(&self.router).gone_peers();
        v.sort_unstable();
        v
    }

    /// Records where `peer` listens and what its host entry says, as a
    /// generation's round published them: no store lookup for it later.
    /// `Err` with the address known before, if another (the peer's world
    /// rank names another process here).
    pub fn learn_peer(
        &self,
        peer: usize,
        addr: SocketAddr,
        host: (u32, String),
    ) -> Result<(), SocketAddr> {
        {
            let mut addrs = lock(&self.addrs);
            match addrs.get(&peer) {
                Some(a) if *a != addr => return Err(*a),
                Some(_) => {}
                None => {
                    addrs.insert(peer, addr);
                }
            }
        }
        lock(&self.hosts).insert(peer, host);
        Ok(())
    }
}
