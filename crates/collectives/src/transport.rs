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
//! ([`WholeFrame`]), even when the operation writing one is cancelled.
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
//! ([`control_loop`]), in the order decided.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rallypoint_store::Store;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{sleep, sleep_until, timeout, timeout_at, Instant};
use tokio_util::sync::CancellationToken;

use crate::element::{Buf, Pool};
use crate::error::Error;
use crate::frame::{
    Desc, Header, Hello, OpKind, ACCEPTED, HEADER_LEN, HELLO_LEN, NOT_HERE, REFUSED,
};

/// How long an accepted connection may take to say hello.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a closed peer waits for handshakes in progress (see `handshakes_settled`).
const SETTLE_MAX: Duration = Duration::from_millis(250);
/// How long an abort frame may take to reach a member.
const ABORT_DEADLINE: Duration = Duration::from_secs(2);

mod diverged;
mod flow;
mod landing;
mod router;

use flow::{Go, Outbound, Release};
pub(crate) use landing::{Gate, Landing};
pub(crate) use router::{Clash, Fail, Frame, Key, Start};
use router::{Delivery, Router};

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
    aborted_from: Mutex<Option<u64>>,
}

impl ChildLink {
    pub fn new(comm: u64, parent: u64, width: u64) -> ChildLink {
        assert!(width > 0, "an op owns at least one internal op");
        ChildLink {
            comm,
            parent,
            width,
            aborted_from: Mutex::default(),
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
}

pub(crate) struct Shared {
    pub cfg: Config,
    store: Arc<dyn Store>,
    pub local_addr: SocketAddr,
    pool: Arc<Pool>,
    addrs: Mutex<HashMap<usize, SocketAddr>>,
    peers: Mutex<HashMap<usize, Peer>>,
    connecting: Mutex<HashMap<usize, Arc<tokio::sync::Mutex<()>>>>,
    router: Mutex<Router>,
    /// This rank's credit with each peer (flow control).
    outbound: Mutex<Outbound>,
    /// Wakes sends waiting for credit: credit or a want arrived, or a peer
    /// went.
    flow_changed: tokio::sync::Notify,
    /// Per peer, the queue of flow and want frames to send, in order.
    control: Mutex<HashMap<usize, tokio::sync::mpsc::UnboundedSender<Header>>>,
    members: Mutex<HashMap<u64, Members>>,
    /// Peers whose address was looked for and not found (yet).
    unpublished: Mutex<std::collections::HashSet<usize>>,
    /// Per aborted group: how far its telling has come.
    telling: Mutex<HashMap<u64, tokio::sync::watch::Receiver<Telling>>>,
    /// Per group whose calls were found diverged here (or told so by a
    /// member that left): see `diverged.rs`.
    diverged: Mutex<HashMap<u64, diverged::Held>>,
    /// Per group, what else hears its aborts and this rank's kill (its
    /// shared memory: an abort is marked in the region, waking its sleepers,
    /// and a kill marks this rank dead there).
    hearers: Mutex<HashMap<u64, std::sync::Weak<dyn HearsAborts>>>,
    /// Per group, its internal groups (see [`ChildLink`]).
    children: Mutex<HashMap<u64, Vec<Arc<ChildLink>>>>,
    /// Per internal group, its link to its group.
    parents: Mutex<HashMap<u64, Arc<ChildLink>>>,
    /// The `host/<rank>` entries read so far (world rank to process id and
    /// host), from which each group decides on shared memory (see `shm`).
    pub hosts: Mutex<HashMap<usize, (u32, String)>>,
    refused: AtomicU64,
    /// See [`Shared::landed_bytes`].
    landed_bytes: AtomicU64,
    next_conn: AtomicU64,
    /// Accepted connections still in their handshake (whose peer is not known yet).
    handshaking: AtomicUsize,
    handshakes_done: tokio::sync::Notify,
    cancel: CancellationToken,
    /// Fault injection (feature `faults`): see [`Shared::kill`].
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

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
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
            store,
            local_addr,
            addrs: Mutex::default(),
            peers: Mutex::default(),
            connecting: Mutex::default(),
            router: Mutex::new(Router::new(window)),
            outbound: Mutex::new(Outbound::new(window)),
            flow_changed: tokio::sync::Notify::new(),
            control: Mutex::default(),
            members: Mutex::default(),
            telling: Mutex::default(),
            diverged: Mutex::default(),
            hearers: Mutex::default(),
            children: Mutex::default(),
            parents: Mutex::default(),
            hosts: Mutex::default(),
            unpublished: Mutex::default(),
            refused: AtomicU64::new(0),
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
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// The size of every per-group table here, for tests that check that
    /// dropped groups leave nothing behind.
    #[cfg(test)]
    pub fn group_tables(&self) -> Vec<(&'static str, usize)> {
        let mut t = lock(&self.router).group_tables();
        t.extend([
            ("members", lock(&self.members).len()),
            ("telling", lock(&self.telling).len()),
            ("diverged", lock(&self.diverged).len()),
            ("hearers", lock(&self.hearers).len()),
            ("children", lock(&self.children).len()),
            ("parents", lock(&self.parents).len()),
        ]);
        t
    }

    /// Forgets group `comm`, whose last handle and op are gone here: its
    /// members, router entries, the region that heard its aborts, and its
    /// links to internal groups. A failed group (aborted, or holding calls
    /// found diverged) keeps all: its abort may still be told, recorded, or
    /// asked for by a peer's frame, and a finding awaits its grace, to be
    /// reported even as this rank leaves (see `diverged.rs`). Failures are
    /// rare; `new_group` in a loop is not.
    pub fn retire(&self, comm: u64) {
        {
            // Checked and retired under the router's lock, so that an abort
            // arriving meanwhile is not lost.
            let mut r = lock(&self.router);
            if r.aborted(comm).is_some() || lock(&self.diverged).contains_key(&comm) {
                return;
            }
            r.retire(comm);
        }
        lock(&self.members).remove(&comm);
        lock(&self.hearers).remove(&comm);
        lock(&self.children).remove(&comm);
        if let Some(link) = lock(&self.parents).remove(&comm) {
            if let Some(siblings) = lock(&self.children).get_mut(&link.parent) {
                siblings.retain(|l| l.comm != comm);
            }
        }
    }

    pub fn register_members(&self, comm: u64, m: Members) {
        lock(&self.router).set_members(comm, m.ranks.clone());
        lock(&self.members).insert(comm, m);
    }

    pub fn members(&self, comm: u64) -> Option<Members> {
        lock(&self.members).get(&comm).cloned()
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

    /// Records the local call of collective `seq`; a mismatch with what a peer
    /// already sent is returned as (peer world rank, its descriptor).
    pub fn begin_seq(self: &Arc<Self>, comm: u64, seq: u64, desc: Desc) -> Result<(), Clash> {
        self.route(|r| r.begin_seq(comm, seq, desc))
    }

    pub fn end_seq(&self, comm: u64, seq: u64) {
        lock(&self.outbound).ended(comm, seq);
        lock(&self.router).end_seq(comm, seq)
    }

    /// Waits for the frame at `key` until `deadline`. `want`: the local call,
    /// for a collective.
    ///
    /// After [`Config::probe_after`] the peer is asked for it (a
    /// [`Header::Want`] carrying our call; a connection to the peer for a
    /// point-to-point message): the ask opens a connection if there is none,
    /// so a peer that died before ever connecting is noticed by the refusal,
    /// and the peer compares our call with its own, so two ranks that each
    /// wait for the other (two roots of one reduce) are a mismatch at once,
    /// not a timeout.
    pub async fn recv(
        self: &Arc<Self>,
        key: Key,
        want: Option<Desc>,
        deadline: Instant,
    ) -> Result<Frame, Fail> {
        let start = self.start_recv(key, None);
        self.wait_recv(key, start, want, deadline).await
    }

    /// Starts a receive (see [`Shared::recv`]) without waiting, posting
    /// `landing` for its payload (see `landing.rs`).
    pub fn start_recv(self: &Arc<Self>, key: Key, landing: Option<Landing>) -> Start {
        self.route(|r| r.start_recv(key, landing))
    }

    /// Stops the receives of `keys` still waiting (their op ended).
    pub fn cancel_recvs(&self, keys: &[Key]) {
        let mut r = lock(&self.router);
        for &k in keys {
            r.cancel_recv(k);
        }
    }

    /// Waits for a receive begun with [`Shared::start_recv`].
    pub async fn wait_recv(
        self: &Arc<Self>,
        key: Key,
        start: Start,
        want: Option<Desc>,
        deadline: Instant,
    ) -> Result<Frame, Fail> {
        let src = key.src as usize;
        let mut rx = match start {
            Start::Ready(f) => return Ok(f),
            Start::Failed(f) => return Err(f),
            Start::Wait(rx) => rx,
        };
        let probe = sleep(self.cfg.probe_after);
        tokio::pin!(probe);
        let mut probed = false;
        loop {
            tokio::select! {
                r = &mut rx => {
                    return r.unwrap_or_else(|_| Err(Fail::Gone { rank: src, reason: "the transport shut down".into() }));
                }
                _ = sleep_until(deadline) => {
                    lock(&self.router).cancel_recv(key);
                    // A frame may have landed between the deadline and the lock.
                    return rx.try_recv().unwrap_or(Err(Fail::Timeout));
                }
                _ = &mut probe, if !probed => {
                    probed = true;
                    let me = self.clone();
                    self.rt.spawn(async move {
                        let asked = match want {
                            Some(desc) => {
                                let h = Header::Want { comm: key.comm, seq: key.seq, step: key.step, desc };
                                me.send_frame(src, &h, &[], 0, deadline).await
                            }
                            None if !me.connected(src) => me.conn(src, 0, deadline).await.map(drop),
                            None => Ok(()),
                        };
                        // A peer that is gone has failed us already; one that
                        // does not answer fails only this receive.
                        if let Err(f @ Fail::Unanswered { .. }) = asked {
                            lock(&me.router).fail_recv(key, f);
                        }
                    });
                }
            }
        }
    }

    /// Sends one data frame of group `comm` to world rank `dst`; an abort of
    /// the group ends the wait (connecting, or writing to a full socket).
    pub async fn send(
        self: &Arc<Self>,
        dst: usize,
        header: &Header,
        payload: &[u8],
        pick: usize,
        deadline: Instant,
    ) -> Result<(), Fail> {
        let Header::Data {
            comm, seq, desc, ..
        } = *header
        else {
            unreachable!("only data frames are sent this way")
        };
        let release = Release::of(comm, seq, &desc);
        let seq = (!release.p2p).then_some(seq);
        self.count_frame();
        let signal = {
            let mut r = lock(&self.router);
            if let Some(e) = r.aborted_for(comm, seq) {
                return Err(Fail::Aborted(e));
            }
            r.abort_signal(comm)
        };
        let send = async {
            self.clear_to_send(dst, release, payload.len() as u64, deadline)
                .await?;
            self.send_frame(dst, header, payload, pick, deadline).await
        };
        tokio::pin!(send);
        let mut signal = signal;
        loop {
            tokio::select! {
                r = &mut send => return r,
                _ = signal.cancelled() => {}
            }
            let mut r = lock(&self.router);
            if let Some(e) = r.aborted_for(comm, seq) {
                return Err(Fail::Aborted(e));
            }
            // An abort from a later op: this one goes on, woken again if the
            // abort widens.
            signal = r.abort_signal(comm);
        }
    }

    /// Waits until `dst` has credit for `len` more bytes, or has asked for
    /// `r`; the bytes are counted as sent.
    async fn clear_to_send(
        self: &Arc<Self>,
        dst: usize,
        r: Release,
        len: u64,
        deadline: Instant,
    ) -> Result<(), Fail> {
        loop {
            let changed = self.flow_changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            match lock(&self.outbound).send(dst, &r, len) {
                Go::Now => return Ok(()),
                Go::Wait { say: true } => {
                    tracing::debug!(peer = dst, "out of credit");
                    self.queue(
                        dst,
                        Header::Flow {
                            credit: 0,
                            blocked: true,
                        },
                    );
                }
                Go::Wait { say: false } => {}
            }
            if let Some(reason) = lock(&self.router).gone(dst) {
                return Err(Fail::Gone {
                    rank: dst,
                    reason: reason.clone(),
                });
            }
            tokio::select! {
                _ = changed => {}
                _ = sleep_until(deadline) => return Err(Fail::Timeout),
                _ = self.cancel.cancelled() => return Err(Fail::Gone {
                    rank: dst,
                    reason: "the transport shut down".into(),
                }),
            }
        }
    }

    /// Whether this rank is out of credit with `peer` (it has sent more than
    /// the window that the peer's operations have not taken), for timeout
    /// messages.
    pub fn held_by(&self, peer: usize, comm: u64, seq: u64, p2p: bool, tag: u32) -> bool {
        let r = Release {
            comm,
            p2p,
            tag: if p2p { tag } else { 0 },
            seq,
        };
        lock(&self.outbound).waits_for(peer, &r)
    }

    /// Links internal group `child` to group `parent`'s aborts.
    pub fn add_child(&self, parent: u64, child: Arc<ChildLink>) {
        lock(&self.parents).insert(child.comm, child.clone());
        lock(&self.children).entry(parent).or_default().push(child);
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

    /// Queues the flow and want frames the router decided (its lock held).
    fn queue_control(self: &Arc<Self>, r: &mut Router) {
        for (peer, h) in r.take_control() {
            self.queue(peer, h);
        }
    }

    /// Queues a flow or want frame for `peer`, after those queued before.
    fn queue(self: &Arc<Self>, peer: usize, h: Header) {
        let mut queues = lock(&self.control);
        let q = queues.entry(peer).or_insert_with(|| {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            self.rt.spawn(control_loop(self.clone(), peer, rx));
            tx
        });
        let _ = q.send(h);
    }

    /// Applies a flow frame from `peer`.
    fn flow(self: &Arc<Self>, peer: usize, credit: u64, blocked: bool) {
        if blocked {
            self.route(|r| r.peer_blocked(peer));
        } else {
            lock(&self.outbound).credit(peer, credit);
            self.flow_changed.notify_waiters();
        }
    }

    /// Sends one frame to world rank `dst`, whole (see [`WholeFrame`]).
    async fn send_frame(
        self: &Arc<Self>,
        dst: usize,
        header: &Header,
        payload: &[u8],
        pick: usize,
        deadline: Instant,
    ) -> Result<(), Fail> {
        if let Some(reason) = lock(&self.router).gone(dst) {
            return Err(Fail::Gone {
                rank: dst,
                reason: reason.clone(),
            });
        }
        // With one stream per peer every frame to `dst` takes the same
        // connection (the first; a second exists when both sides opened one
        // at once), so a peer reads them in the order sent: it compares our
        // frames of a mismatched op before it can use our frames of the next.
        let pick = if self.cfg.streams > 1 { pick } else { 0 };
        let conn = self.conn(dst, pick, deadline).await?;
        let head = header.encode();
        #[cfg(feature = "faults")]
        if let Some(after) = self.breaks_here() {
            break_conn(&conn, &head, payload, after).await;
            return Ok(());
        }
        let write = async {
            let mut frame = WholeFrame {
                w: Some(conn.writer.clone().lock_owned().await),
                parts: [&head, payload],
                written: 0,
                rt: &self.rt,
                finish_within: self.cfg.peer_timeout.max(ABORT_DEADLINE),
            };
            frame.write().await
        };
        match timeout_at(deadline, write).await {
            Err(_) => Err(Fail::Timeout),
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => {
                // This send fails, but the peer is marked gone by its reader,
                // after the frames it sent before it went (still unread in our
                // socket) have been delivered: a peer that did its part and
                // exited must not fail an op that has its frames.
                let reason = format!("sending to it failed: {e}");
                // Its host has not answered for `peer_timeout`: gone (see
                // `host_silent`).
                if e.kind() == std::io::ErrorKind::TimedOut {
                    return Err(Fail::Gone { rank: dst, reason });
                }
                // Dead, or alive with this connection broken (a reset): a
                // connection of its own tells which, so a live rank is not
                // named gone.
                let within =
                    deadline.min(Instant::now() + self.cfg.handshake_timeout + ABORT_DEADLINE);
                match self.open(dst, within).await {
                    Ok(s) => {
                        self.register(dst, s);
                        Err(Fail::Lost { rank: dst, reason })
                    }
                    Err(_) => Err(Fail::Gone { rank: dst, reason }),
                }
            }
        }
    }

    fn pick_conn(&self, dst: usize, pick: usize) -> Option<Arc<Conn>> {
        let peers = lock(&self.peers);
        let p = peers.get(&dst)?;
        (!p.conns.is_empty()).then(|| p.conns[pick % p.conns.len()].clone())
    }

    /// A connection to `dst`, opened if there is none.
    async fn conn(
        self: &Arc<Self>,
        dst: usize,
        pick: usize,
        deadline: Instant,
    ) -> Result<Arc<Conn>, Fail> {
        if let Some(c) = self.pick_conn(dst, pick) {
            return Ok(c);
        }
        if self.is_dead() {
            return Err(Fail::Aborted(Error::Invalid(
                "this rank was killed (fault injection)".into(),
            )));
        }
        // A connection that ended as soon as it opened (or the one found
        // open, ending meanwhile: a connection broken under a live peer)
        // proves nothing: open again, and a dead peer refuses (named gone
        // there); a few times at most. It was taken for proof of death: a
        // seeded break (seed 1313, 1 replay in about 90 under load) had the
        // rank that broke its connection name the live peer gone.
        for _ in 0..3 {
            // Connecting belongs to the transport, not to the op that asked:
            // an op cancelled or aborted mid-handshake must not drop a
            // connection the peer has already registered (the peer would
            // read a reset).
            let me = self.clone();
            let opening = self
                .rt
                .spawn(async move { me.open_streams(dst, deadline).await });
            match timeout_at(deadline, opening).await {
                Err(_) => return Err(Fail::Timeout),
                Ok(Err(_)) => {
                    return Err(Fail::Gone {
                        rank: dst,
                        reason: "the transport shut down".into(),
                    })
                }
                Ok(Ok(r)) => r?,
            }
            if let Some(c) = self.pick_conn(dst, pick) {
                return Ok(c);
            }
        }
        Err(Fail::Gone {
            rank: dst,
            reason: "its connections closed as they opened, three times".into(),
        })
    }

    /// Opens the connections to `dst` (one per stream), unless another task
    /// has meanwhile.
    async fn open_streams(self: Arc<Self>, dst: usize, deadline: Instant) -> Result<(), Fail> {
        let gate = lock(&self.connecting).entry(dst).or_default().clone();
        let _g = timeout_at(deadline, gate.lock())
            .await
            .map_err(|_| Fail::Timeout)?;
        if self.connected(dst) {
            return Ok(());
        }
        if let Some(reason) = lock(&self.router).gone(dst) {
            return Err(Fail::Gone {
                rank: dst,
                reason: reason.clone(),
            });
        }
        for _ in 0..self.cfg.streams.max(1) {
            match self.open(dst, deadline).await {
                Ok(stream) => self.register(dst, stream),
                Err(f) => {
                    if let Fail::Gone { reason, .. } = &f {
                        // The peer may have connected to us meanwhile (both
                        // sides connect at once): what it sent on its own
                        // connection is still to be read, and its reader
                        // names it gone when that ends (as `read_loop` does).
                        // An exiting peer's listener closes under our connect
                        // before its connections have been read.
                        self.handshakes_settled().await;
                        if self.connected(dst) {
                            return Ok(());
                        }
                        self.mark_gone(dst, reason);
                    }
                    return Err(f);
                }
            }
        }
        Ok(())
    }

    /// Where `peer` listens, if this rank has looked it up (a rank only ever
    /// reached over shared memory has not).
    pub(crate) fn known_addr(&self, peer: usize) -> Option<SocketAddr> {
        lock(&self.addrs).get(&peer).copied()
    }

    /// Whether `peer`'s address is known or in the store, without waiting.
    async fn published(&self, peer: usize) -> bool {
        if lock(&self.addrs).contains_key(&peer) {
            return true;
        }
        let key = format!("addr/{peer}");
        timeout(ABORT_DEADLINE, self.store.check(&[&key]))
            .await
            .is_ok_and(|r| r.unwrap_or(true))
    }

    /// Where `peer` listens, from the cache or the store.
    async fn addr(&self, peer: usize, deadline: Instant) -> Result<SocketAddr, Fail> {
        if let Some(a) = lock(&self.addrs).get(&peer) {
            return Ok(*a);
        }
        let key = format!("addr/{peer}");
        let left = deadline.saturating_duration_since(Instant::now());
        let fetched = async {
            self.store.wait_timeout(&[&key], left).await?;
            self.store.get_now(&key).await
        };
        // Until it is found (not merely until this wait ends: a timeout may
        // drop the wait, and its message reads this).
        lock(&self.unpublished).insert(peer);
        let raw = match fetched.await {
            Ok(v) => {
                lock(&self.unpublished).remove(&peer);
                v
            }
            Err(rallypoint_store::StoreError::Timeout { .. }) => return Err(Fail::Timeout),
            Err(e) => {
                return Err(Fail::Refused {
                    rank: peer,
                    reason: format!("reading its address from the store failed: {e}"),
                })
            }
        };
        let text = String::from_utf8_lossy(&raw);
        let addr: SocketAddr = text.parse().map_err(|_| Fail::Refused {
            rank: peer,
            reason: format!("its published address {text:?} is not host:port"),
        })?;
        lock(&self.addrs).insert(peer, addr);
        Ok(addr)
    }

    /// Connects to `dst` and says hello.
    async fn open(&self, dst: usize, deadline: Instant) -> Result<TcpStream, Fail> {
        let addr = self.addr(dst, deadline).await?;
        let gone = |e: std::io::Error| Fail::Gone {
            rank: dst,
            reason: format!("connecting to {addr} failed: {e}"),
        };
        let mut s = timeout_at(deadline, TcpStream::connect(addr))
            .await
            .map_err(|_| Fail::Timeout)?
            .map_err(gone)?;
        s.set_nodelay(true).map_err(gone)?;
        watch_liveness(&s, self.cfg.peer_timeout);
        let hello = Hello {
            nonce: self.cfg.nonce,
            layout: self.cfg.layout,
            world: self.cfg.world as u32,
            src: self.cfg.rank as u32,
            dst: dst as u32,
            name: self.cfg.name.clone(),
        };
        let shake = async {
            s.write_all(&hello.encode()).await?;
            let status = s.read_u8().await?;
            if status == ACCEPTED {
                return Ok(None);
            }
            let n = s.read_u16_le().await?;
            let mut why = vec![0; usize::from(n)];
            s.read_exact(&mut why).await?;
            let why = String::from_utf8_lossy(&why).into_owned();
            Ok::<_, std::io::Error>(Some((status, why)))
        };
        let answer_by = deadline.min(Instant::now() + self.cfg.handshake_timeout);
        match timeout_at(answer_by, shake).await {
            Err(_) if answer_by < deadline => Err(Fail::Unanswered {
                rank: dst,
                reason: format!(
                    "{addr} accepted a connection but did not answer its handshake within {:?}: the process is stopped or hung",
                    self.cfg.handshake_timeout
                ),
            }),
            Err(_) => Err(Fail::Timeout),
            Ok(Err(e)) => Err(gone(e)),
            // The address it published answers for another group or
            // instance: its listener closed (the process exited) and the port
            // went to another process.
            Ok(Ok(Some((NOT_HERE, why)))) => Err(Fail::Gone {
                rank: dst,
                reason: format!(
                    "it no longer listens at {addr}, another group's process does (it refused us: {why}): it exited, or the address is wrong"
                ),
            }),
            Ok(Ok(Some((_, why)))) => Err(Fail::Refused {
                rank: dst,
                reason: format!("it refused the connection: {why}"),
            }),
            Ok(Ok(None)) => Ok(s),
        }
    }

    /// Adds an established connection with `peer` and starts its reader.
    fn register(self: &Arc<Self>, peer: usize, stream: TcpStream) {
        if self.is_dead() {
            return;
        }
        lock(&self.unpublished).remove(&peer);
        let (rd, wr) = stream.into_split();
        let id = self.next_conn.fetch_add(1, Ordering::Relaxed);
        let conn = Arc::new(Conn {
            id,
            writer: Arc::new(tokio::sync::Mutex::new(wr)),
        });
        lock(&self.peers).entry(peer).or_default().conns.push(conn);
        self.rt.spawn(read_loop(self.clone(), peer, id, rd));
        self.tell_aborts_to(peer, None);
    }

    /// Whether this rank was killed (fault injection).
    pub fn is_dead(&self) -> bool {
        self.faults.dead.load(Ordering::Relaxed)
    }

    /// Counts a data frame (or a shared-memory stage) about to be sent, for
    /// [`Shared::kill_at_frame`].
    pub fn count_frame(self: &Arc<Self>) {
        #[cfg(feature = "faults")]
        if self.faults.frames.fetch_add(1, Ordering::Relaxed)
            >= self.faults.kill_at.load(Ordering::Relaxed)
        {
            self.kill();
        }
    }

    /// The group's (prefixed) store.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// `hearer` hears group `comm`'s aborts and this rank's kill from now
    /// on (and those already in place, at once).
    pub fn add_hearer<H: HearsAborts + 'static>(&self, comm: u64, hearer: &Arc<H>) {
        // Registered first, so a kill or an abort racing with this sees it.
        let weak: std::sync::Weak<dyn HearsAborts> = Arc::downgrade(hearer) as _;
        lock(&self.hearers).insert(comm, weak);
        if self.is_dead() {
            hearer.killed();
        }
        let from = lock(&self.router).aborted_from(comm);
        if let Some(from) = from {
            hearer.aborted(from);
        }
    }

    /// Why `peer` is gone, if it is known to be.
    pub fn gone_reason(&self, peer: usize) -> Option<String> {
        lock(&self.router).gone(peer).cloned()
    }

    /// Checks that `peer` is alive by connecting to it, in the background,
    /// unless a connection exists: a refused connect, or another group's
    /// process answering at its address, marks it gone (see
    /// [`Shared::gone_reason`]), unless the peer's own connection with us
    /// came up meanwhile.
    pub fn probe(self: &Arc<Self>, peer: usize, deadline: Instant) {
        if self.connected(peer) || self.gone_reason(peer).is_some() {
            return;
        }
        let me = self.clone();
        self.rt.spawn(async move {
            let _ = me.conn(peer, 0, deadline).await;
        });
    }

    /// Test fault: this rank dies as a SIGKILLed process does. Its listener
    /// and connections close with no goodbye and no abort (peers see EOF or a
    /// reset), nothing is written to the store, and its own operations fail.
    #[cfg(feature = "faults")]
    pub fn kill(self: &Arc<Self>) {
        if self.faults.dead.swap(true, Ordering::Relaxed) {
            return;
        }
        self.cancel.cancel();
        lock(&self.peers).clear();
        for h in lock(&self.hearers)
            .values()
            .filter_map(std::sync::Weak::upgrade)
        {
            h.killed();
        }
        let comms: Vec<u64> = lock(&self.members).keys().copied().collect();
        for comm in comms {
            let err = Error::Aborted {
                group: self.cfg.name.clone(),
                reason: "this rank was killed (fault injection)".into(),
                by: None,
            };
            self.abort(comm, err, Origin::Passed(None), 0);
        }
    }

    /// Test fault: [`Shared::kill`] when about to send the `n`-th data frame
    /// from now (0: the next).
    #[cfg(feature = "faults")]
    pub fn kill_at_frame(&self, n: u64) {
        let now = self.faults.frames.load(Ordering::Relaxed);
        self.faults.kill_at.store(now + n, Ordering::Relaxed);
    }

    #[cfg(feature = "faults")]
    pub fn killed(&self) -> bool {
        self.is_dead()
    }

    /// Test fault: when about to send the `n`-th TCP frame from now (data or
    /// control; 0: the next), writes its first `after` bytes (header and payload;
    /// all of them or more: the whole frame), then resets the connection,
    /// as a middlebox or a short outage can, while this rank lives on. The
    /// send reports success: what was written before a reset is lost
    /// without the writer knowing.
    #[cfg(feature = "faults")]
    pub fn break_at_frame(&self, n: u64, after: u64) {
        let now = self.faults.tcp_frames.load(Ordering::Relaxed);
        self.faults.break_after.store(after, Ordering::Relaxed);
        self.faults.break_at.store(now + n, Ordering::Relaxed);
    }

    /// Whether [`Shared::break_at_frame`] broke a connection.
    #[cfg(feature = "faults")]
    pub fn broke(&self) -> bool {
        self.faults.broke.load(Ordering::Relaxed)
    }

    /// [`Shared::break_at_frame`]'s turn: whether this frame breaks its
    /// connection, and if so, after how many bytes.
    #[cfg(feature = "faults")]
    fn breaks_here(&self) -> Option<usize> {
        if self.faults.tcp_frames.fetch_add(1, Ordering::Relaxed)
            == self.faults.break_at.load(Ordering::Relaxed)
        {
            self.faults.broke.store(true, Ordering::Relaxed);
            return Some(self.faults.break_after.load(Ordering::Relaxed) as usize);
        }
        None
    }

    /// The data frame at `key` was cut off by its connection breaking while
    /// its sender lived on: fails the receive for it (see [`Router::lose`]).
    fn lose(&self, key: Key, reason: &str) {
        tracing::debug!(rank = self.cfg.rank, ?key, "a frame was cut off: {reason}");
        lock(&self.router).lose(key, reason);
    }

    /// A connection with `peer` broke while it lived on, where no frame was
    /// part-way: fails what may have been lost (see [`Router::lose_peer`]).
    fn lose_peer(&self, peer: usize, reason: &str) {
        tracing::debug!(rank = self.cfg.rank, peer, "a connection broke: {reason}");
        lock(&self.router).lose_peer(peer, reason);
    }

    /// Marks `peer` gone and fails everything waiting on it.
    pub fn mark_gone(&self, peer: usize, reason: &str) {
        if lock(&self.router).mark_gone(peer, reason) {
            tracing::debug!(rank = self.cfg.rank, peer, "gone: {reason}");
        }
        self.flow_changed.notify_waiters();
    }

    /// Aborts group `comm` with `err` (the first abort wins): fails its
    /// waiters and wakes its sends, drops its mailbox, and tells the members
    /// this rank has a connection with (but not `sender`, which sent it).
    /// `from_seq`: the first collective it fails (see [`Router::abort`]).
    ///
    /// [`Origin::Here`]: this rank is where the failure happened (not
    /// passing on another's abort). The origin first records the reason in
    /// the store (`abort/<group>`), so a rank that later finds some member
    /// gone (one that exited on being told, say) reports the cause, not the
    /// bystander.
    ///
    /// The origin whose record is the store's first tells every member,
    /// opening connections as needed; other ranks tell only the members they
    /// have a connection with, so many ranks failing at once open O(n)
    /// connections, not n². A member not told learns when it next reaches an
    /// aborted rank: an aborted group answers every data frame and every new
    /// connection from a member with the abort.
    ///
    /// [`Origin::Leaving`]: calls found diverged, reported before their
    /// grace ended; told marked provisional and not recorded (see the
    /// variant).
    ///
    /// The telling runs in the background; [`Shared::told`] waits for it.
    pub fn abort(self: &Arc<Self>, comm: u64, err: Error, how: Origin, from_seq: u64) {
        let (origin, sender) = match how {
            Origin::Here => (true, None),
            Origin::Passed(s) => (false, s),
            Origin::Leaving => (false, None),
        };
        let Some(members) = self.members(comm) else {
            if how != Origin::Leaving {
                self.route(|r| r.abort(comm, err.clone(), from_seq));
                self.abort_children(comm, &err, how, from_seq);
            }
            return;
        };
        let (done, told) = tokio::sync::watch::channel(Telling::Recording);
        let err_for_children = err.clone();
        {
            let mut r = lock(&self.router);
            // A provisional report never replaces what is in place.
            if how == Origin::Leaving && r.aborted_for(comm, Some(from_seq)).is_some() {
                return;
            }
            let changed = r.abort(comm, err, from_seq);
            // The abort drops filed frames: their credit goes back, and a
            // peer out of credit may resume.
            self.queue_control(&mut r);
            if !changed {
                return;
            }
            if how == Origin::Leaving {
                r.mark_provisional(comm);
            }
            if let Some(f) = sender {
                r.note_told(comm, f);
            }
            // Under the router's lock: the watch of the abort that won is
            // the one `told` waits for.
            lock(&self.telling).insert(comm, told);
        }
        tracing::debug!(
            rank = self.cfg.rank,
            comm,
            from = from_seq,
            ?how,
            "aborted: {err_for_children}"
        );
        self.abort_children(comm, &err_for_children, how, from_seq);
        // A killed rank writes nothing, in the region as in the store.
        if self.is_dead() {
            return;
        }
        if let Some(h) = lock(&self.hearers)
            .get(&comm)
            .and_then(std::sync::Weak::upgrade)
            .filter(|_| how != Origin::Leaving)
        {
            h.aborted(from_seq);
        }
        let me = self.clone();
        // Aborts also run from destructors, possibly as the runtime shuts down;
        // spawning then is a no-op (and dropping `done` ends the waits).
        self.rt.spawn(async move {
            let everyone = origin && me.record_abort(comm, &members).await;
            let _ = done.send(Telling::Sending);
            let targets: Vec<usize> = members
                .ranks
                .iter()
                .copied()
                .filter(|&m| m != me.cfg.rank && (everyone || me.connected(m)))
                .collect();
            let mut tasks = tokio::task::JoinSet::new();
            for m in targets {
                let me = me.clone();
                tasks.spawn(async move { me.tell_abort(comm, m).await });
            }
            while tasks.join_next().await.is_some() {}
            let _ = done.send(Telling::Sent);
        });
    }

    /// Passes group `comm`'s abort (already in place here) on to its internal
    /// groups (told, like any passed-on abort, to the members this rank is
    /// connected to; each member also passes on its own). A provisional
    /// abort stays provisional: a member told holds it for the group (see
    /// `diverged.rs`).
    fn abort_children(self: &Arc<Self>, comm: u64, err: &Error, how: Origin, from_seq: u64) {
        let how = match how {
            Origin::Leaving => Origin::Leaving,
            _ => Origin::Passed(None),
        };
        let children = lock(&self.children).get(&comm).cloned();
        for c in children.iter().flatten() {
            let from = c.abort_from(from_seq);
            self.abort(c.comm, err.clone(), how, from);
        }
    }

    /// Waits (within [`ABORT_DEADLINE`]) until group `comm`'s abort has been
    /// recorded and told, for a rank that must not return its error (and
    /// perhaps exit) before.
    ///
    /// The record is always waited for (its write has its own deadline): a
    /// rank that exits before it leaves the others nothing to find.
    pub async fn told(&self, comm: u64) {
        let Some(mut told) = lock(&self.telling).get(&comm).cloned() else {
            return;
        };
        // Recording is bounded by `record_abort`'s own deadline; this wait
        // has one too, so that no failing op can outlive it by more.
        let _ = timeout(
            ABORT_DEADLINE * 2,
            told.wait_for(|t| *t != Telling::Recording),
        )
        .await;
        let _ = timeout(ABORT_DEADLINE, told.wait_for(|t| *t == Telling::Sent)).await;
    }

    /// The text an abort frame of `comm` carries: the reason alone, which the
    /// receiver wraps in its own [`Error::Aborted`].
    fn abort_reason(&self, comm: u64) -> Option<(String, bool, u64, bool)> {
        let (err, from, provisional) = {
            let r = lock(&self.router);
            (
                r.aborted(comm)?.clone(),
                r.aborted_from(comm)?,
                r.aborted_provisional(comm),
            )
        };
        let members = self.members(comm)?;
        let own = matches!(&err, Error::Aborted { by: Some(r), .. } if *r == members.group_rank(self.cfg.rank));
        let reason = match err {
            Error::Aborted { reason, .. } => reason.to_string(),
            e => e.to_string(),
        };
        Some((reason, own, from, provisional))
    }

    /// Writes the abort of `comm` to `peer`, once.
    async fn tell_abort(self: &Arc<Self>, comm: u64, peer: usize) {
        if self.is_dead() || !lock(&self.router).note_told(comm, peer) {
            return;
        }
        let told = self.try_tell_abort(comm, peer).await;
        tracing::debug!(rank = self.cfg.rank, comm, peer, told, "telling the abort");
        if !told {
            // Not written: its next contact with us tells it.
            lock(&self.router).unnote_told(comm, peer);
        }
    }

    async fn try_tell_abort(self: &Arc<Self>, comm: u64, peer: usize) -> bool {
        // The record first (an origin's), so that a peer that exits on being
        // told cannot leave a third rank with nothing to find.
        let recording = lock(&self.telling).get(&comm).cloned();
        if let Some(mut r) = recording {
            let _ = r.wait_for(|t| *t != Telling::Recording).await;
        }
        let Some((reason, own, from, provisional)) = self.abort_reason(comm) else {
            return false;
        };
        let h = Header::Abort {
            comm,
            len: reason.len().min(crate::frame::MAX_REASON as usize) as u64,
            own,
            from,
            provisional,
        };
        let bytes = &reason.as_bytes()[..h.payload_len() as usize];
        let deadline = Instant::now() + ABORT_DEADLINE;
        // A member that has not published its address never joined: there is
        // nothing to tell yet (when it connects, the abort is its answer).
        if !self.connected(peer) && !self.published(peer).await {
            return false;
        }
        self.send_frame(peer, &h, bytes, 0, deadline).await.is_ok()
    }

    /// Tells `peer` of every aborted group it is a member of (a new
    /// connection, or a data frame for an aborted group).
    fn tell_aborts_to(self: &Arc<Self>, peer: usize, only: Option<u64>) {
        let comms: Vec<u64> = {
            let r = lock(&self.router);
            r.aborted_groups()
                .into_iter()
                .filter(|&c| only.is_none_or(|o| o == c) && !r.was_told(c, peer))
                .collect()
        };
        for comm in comms {
            if self.members(comm).is_some_and(|m| m.ranks.contains(&peer)) {
                let me = self.clone();
                self.rt
                    .spawn(async move { me.tell_abort(comm, peer).await });
            }
        }
    }

    /// The key of group `comm`'s abort record in the store.
    fn record_key(comm: u64) -> String {
        format!("abort/{comm:016x}")
    }

    /// Records the abort of `comm` in the store (the first record wins),
    /// within [`ABORT_DEADLINE`]. Returns whether this rank must tell every
    /// member: its record is the first, or the store could not say.
    async fn record_abort(&self, comm: u64, members: &Members) -> bool {
        let Some((reason, ..)) = self.abort_reason(comm) else {
            return false;
        };
        let text = format!(
            "rank {} aborted it: {reason}",
            members.group_rank(self.cfg.rank)
        );
        let key = Self::record_key(comm);
        let write = self.store.compare_set(&key, b"", text.as_bytes());
        match timeout(ABORT_DEADLINE, write).await {
            Ok(Ok(now)) => {
                let first = now == text.as_bytes();
                tracing::debug!(rank = self.cfg.rank, comm, first, "recorded the abort");
                first
            }
            Ok(Err(e)) => {
                tracing::debug!("recording the abort in the store failed: {e}");
                true
            }
            Err(_) => {
                tracing::debug!("recording the abort in the store took over {ABORT_DEADLINE:?}");
                true
            }
        }
    }

    /// Group `comm`'s abort record in the store, if some rank wrote one
    /// (looked up within [`ABORT_DEADLINE`]).
    pub async fn abort_record(&self, comm: u64) -> Option<String> {
        let key = Self::record_key(comm);
        let got = timeout(ABORT_DEADLINE, async {
            if self.store.check(&[&key]).await.ok()? {
                self.store.get_now(&key).await.ok()
            } else {
                None
            }
        })
        .await
        .ok()??;
        Some(String::from_utf8_lossy(&got).into_owned())
    }

    /// Hands a data frame to its waiter or the mailbox, checking it against the
    /// local operation first.
    fn deliver(self: &Arc<Self>, src: usize, header: Header, buf: Buf) -> Result<(), String> {
        let (key, desc) = data_key(src, &header);
        let d = self.route(|r| r.deliver(key, desc, buf));
        self.act(src, d)
    }

    /// The landing posted for a data frame from `src`, if its payload may be
    /// read straight into it.
    fn land(self: &Arc<Self>, src: usize, header: &Header) -> Option<Landing> {
        let (key, desc) = data_key(src, header);
        if key.p2p {
            return None; // messages are never posted
        }
        lock(&self.router).land(key, desc, header.payload_len() as usize)
    }

    /// A payload taken by [`Shared::land`] was read (into its landing if
    /// `whole`).
    fn landed(self: &Arc<Self>, src: usize, header: &Header, whole: bool) {
        let (key, desc) = data_key(src, header);
        let len = header.payload_len();
        if whole {
            self.landed_bytes.fetch_add(len, Ordering::Relaxed);
        }
        self.route(|r| r.landed(key, desc, len as usize));
    }

    /// Payload bytes read straight into operations' buffers.
    pub fn landed_bytes(&self) -> u64 {
        self.landed_bytes.load(Ordering::Relaxed)
    }

    /// A peer waits for our part of collective `seq` (or, `desc.op` being
    /// [`OpKind::Send`], for message `seq` of tag `desc.root`): its frames
    /// go without credit, and a collective's call is compared with ours.
    fn want(self: &Arc<Self>, src: usize, comm: u64, seq: u64, desc: Desc) -> Result<(), String> {
        let release = Release::of(comm, seq, &desc);
        lock(&self.outbound).release(src, release);
        self.flow_changed.notify_waiters();
        if release.p2p {
            return Ok(());
        }
        let d = lock(&self.router).want(comm, seq, src as u32, desc);
        self.act(src, d)
    }

    fn act(self: &Arc<Self>, src: usize, d: Delivery) -> Result<(), String> {
        match d {
            Delivery::Taken | Delivery::Filed => {}
            // The sender does not know yet: tell it (once).
            Delivery::TellAbort => self.tell_aborts_to(src, None),
            Delivery::Clash(c) => self.raise(c),
            Delivery::Duplicate(why) => return Err(why),
        }
        Ok(())
    }

    /// Aborts the group of a mismatch, naming both sides, from its op on.
    ///
    /// A clash of calls whose histories differ ([`Clash::diverged`]) is not
    /// the first mismatch: it is held for a grace, for the first mismatch's
    /// abort (`diverged.rs`).
    pub fn raise(self: &Arc<Self>, mut c: Clash) {
        // A step of a two-level op: the mismatch is the group's, at its op
        // (its abort aborts the step's internal group). The step may have
        // ended here, and its op with it: a late frame must still fail the
        // group, not only the internal group.
        let link = lock(&self.parents).get(&c.comm).cloned();
        if let Some(l) = link {
            c.comm = l.parent;
            c.seq = l.parent_seq(c.seq);
            return self.raise(c);
        }
        if c.diverged {
            return self.hold(c);
        }
        let err = self.clash_error(&c);
        self.abort(c.comm, err, Origin::Here, c.seq);
    }

    /// The error a clash raises, naming both sides by group rank.
    fn clash_error(&self, c: &Clash) -> Error {
        let m = self.members(c.comm);
        let group = m
            .as_ref()
            .map_or_else(|| self.cfg.name.clone(), |m| m.name.clone());
        let grank = |w: usize| m.as_ref().map_or(w, |m| m.group_rank(w));
        let (seq, rank_a, desc_a, rank_b, desc_b) = (
            c.seq,
            grank(c.a.0.map_or(self.cfg.rank, |r| r as usize)),
            c.a.1.to_string(),
            grank(c.b.0 as usize),
            c.b.1.to_string(),
        );
        if c.diverged {
            // The calls may be alike: their histories tell them apart.
            let after = |d: &Desc| format!(" after calls {:06x}", d.hist);
            Error::Diverged {
                group,
                seq,
                rank_a,
                desc_a: desc_a + &after(&c.a.1),
                rank_b,
                desc_b: desc_b + &after(&c.b.1),
            }
        } else {
            Error::Mismatch {
                group,
                seq,
                rank_a,
                desc_a,
                rank_b,
                desc_b,
            }
        }
    }

    /// Two ranks' calls at one place of internal group `comm`'s shared
    /// memory are steps of different ops of its group: internal op `mine`
    /// here, `theirs` (called `desc`) on world rank `src`. So at the earlier
    /// of the two ops the ranks called different things, one of them an op
    /// that does not run in two levels (or it would own this place).
    ///
    /// The rank past that op knows both calls there: it raises the mismatch
    /// (at the group's op, naming both). The rank at it knows only its own,
    /// and leaves the naming to the other. Either way the step fails with an
    /// abort, which the group's (the mismatch) replaces once in place.
    /// `None` when `comm` is not an internal group.
    pub fn steps_apart(
        self: &Arc<Self>,
        comm: u64,
        mine: u64,
        src: u32,
        theirs: u64,
        desc: Desc,
    ) -> Option<Error> {
        let l = lock(&self.parents).get(&comm).cloned()?;
        let (pm, pt) = (l.parent_seq(mine), l.parent_seq(theirs));
        if pm == pt {
            return None;
        }
        let m = self.members(l.parent);
        let grank = |w: usize| m.as_ref().map_or(w, |m| m.group_rank(w));
        if pt < pm {
            let local = lock(&self.router).call(l.parent, pt);
            if let Some(local) = local {
                self.raise(Clash::new(l.parent, pt, (None, local), (src, desc)));
            }
        }
        Some(Error::Aborted {
            group: self.members(comm).map_or_else(String::new, |m| m.name),
            reason: format!(
                "rank {} called op #{pt} where this rank called op #{pm}: they called different ops at op #{}",
                grank(src as usize),
                pt.min(pm)
            )
            .into(),
            by: None,
        })
    }

    /// Removes a closed connection; returns whether it was the peer's last.
    fn remove_conn(&self, peer: usize, id: u64) -> bool {
        let mut peers = lock(&self.peers);
        let p = peers.entry(peer).or_default();
        p.conns.retain(|c| c.id != id);
        p.conns.is_empty()
    }

    /// Waits until no accepted connection is mid-handshake: one may be the
    /// peer's other connection, carrying frames. Bounded by [`SETTLE_MAX`], so a
    /// stranger idling on the port delays noticing a death by that at most.
    async fn handshakes_settled(&self) {
        let deadline = Instant::now() + SETTLE_MAX;
        loop {
            let done = self.handshakes_done.notified();
            if self.handshaking.load(Ordering::Acquire) == 0 || Instant::now() >= deadline {
                return;
            }
            let _ = timeout_at(deadline, done).await;
        }
    }
}

/// A frame being written. Frames are written whole: if the write is dropped
/// part-way (its op timed out or was cancelled), the rest is copied and
/// finished in the background, still holding the connection's writer, so the
/// peer never reads the next frame (say, the abort that follows) as the rest of
/// this one's payload.
struct WholeFrame<'a> {
    w: Option<tokio::sync::OwnedMutexGuard<OwnedWriteHalf>>,
    /// Header and payload.
    parts: [&'a [u8]; 2],
    written: usize,
    rt: &'a tokio::runtime::Handle,
    /// How long the background finish may take; then the connection's
    /// sending side is shut (the peer sees it end) rather than held forever.
    finish_within: Duration,
}

impl WholeFrame<'_> {
    /// Writes the frame, in one vectored write when the socket takes it.
    async fn write(&mut self) -> std::io::Result<()> {
        let total = self.parts[0].len() + self.parts[1].len();
        let w = self.w.as_mut().expect("a frame is written once");
        while self.written < total {
            let (h, p) = rest(self.parts, self.written);
            let n = w
                .write_vectored(&[std::io::IoSlice::new(h), std::io::IoSlice::new(p)])
                .await;
            let n = match n {
                Ok(0) => Err(std::io::ErrorKind::WriteZero.into()),
                r => r,
            };
            match n {
                Ok(n) => self.written += n,
                Err(e) => {
                    // The connection is broken: nothing to finish.
                    self.w = None;
                    return Err(e);
                }
            }
        }
        self.w = None;
        Ok(())
    }
}

/// What is left of a header and a payload after `written` bytes.
fn rest([h, p]: [&[u8]; 2], written: usize) -> (&[u8], &[u8]) {
    let from_head = written.min(h.len());
    (&h[from_head..], &p[written - from_head..])
}

impl Drop for WholeFrame<'_> {
    fn drop(&mut self) {
        let Some(mut w) = self.w.take() else { return };
        if self.written == 0 {
            return; // not begun: the connection is clean
        }
        let (h, p) = rest(self.parts, self.written);
        let rest = [h, p].concat();
        let within = self.finish_within;
        // On a runtime shutting down this is a no-op, and so is everything else.
        self.rt.spawn(async move {
            if !matches!(timeout(within, w.write_all(&rest)).await, Ok(Ok(()))) {
                let _ = w.shutdown().await;
            }
        });
    }
}

/// Makes the kernel fail a connection whose peer's host stops answering
/// within about `within`: keepalive probes while idle (answered by the peer's
/// kernel, so an idle stopped process is not taken for a dead host), and, on
/// Linux, `TCP_USER_TIMEOUT` for data left unacknowledged, which since Linux
/// 5.11 also covers a peer that takes nothing (its window stays shut): a
/// process stopped that long while we have data for it is taken for gone.
fn watch_liveness(s: &TcpStream, within: Duration) {
    if within.is_zero() {
        return;
    }
    let step = (within / 5).max(Duration::from_secs(1));
    let ka = socket2::TcpKeepalive::new()
        .with_time(step)
        .with_interval(step)
        .with_retries(4);
    let sock = socket2::SockRef::from(s);
    let set = sock.set_tcp_keepalive(&ka);
    #[cfg(any(target_os = "linux", target_os = "android"))]
    let set = set.and_then(|()| sock.set_tcp_user_timeout(Some(within)));
    if let Err(e) = set {
        tracing::debug!("setting keepalive on a connection failed: {e}");
    }
}

/// The reader's buffer, in bytes.
const READ_BUFFER: usize = 8 << 10;

/// A data frame's key and description.
fn data_key(src: usize, header: &Header) -> (Key, Desc) {
    let Header::Data {
        comm,
        seq,
        step,
        desc,
        ..
    } = *header
    else {
        unreachable!("only data frames are delivered")
    };
    let p2p = desc.op == OpKind::Send;
    let key = Key {
        comm,
        src: src as u32,
        p2p,
        tag: if p2p { desc.root } else { 0 },
        seq,
        step,
    };
    (key, desc)
}

/// Reads a payload into `l`, one non-blocking read at a time under its
/// gate; once the gate is revoked, reads the rest into scratch (false).
async fn read_landing(
    rd: &mut BufReader<OwnedReadHalf>,
    l: &Landing,
    pool: &Arc<Pool>,
) -> std::io::Result<bool> {
    use std::io::ErrorKind;
    use tokio::io::AsyncBufRead;
    let len = l.len();
    let (mut at, mut revoked) = (0, false);
    // What the reader's buffer holds already.
    let n = rd.buffer().len().min(len);
    if n > 0 {
        let buffered = &rd.buffer()[..n];
        revoked = l.write(0, |s| s[..n].copy_from_slice(buffered)).is_none();
        std::pin::Pin::new(&mut *rd).consume(n);
        at = n;
    }
    while at < len && !revoked {
        rd.get_ref().readable().await?;
        match l.write(at, |s| rd.get_ref().try_read(s)) {
            None => revoked = true,
            Some(Ok(0)) => return Err(ErrorKind::UnexpectedEof.into()),
            Some(Ok(k)) => at += k,
            Some(Err(e)) if e.kind() == ErrorKind::WouldBlock => {}
            Some(Err(e)) => return Err(e),
        }
    }
    if at < len {
        // Revoked: the op ended; the rest of the payload is nobody's.
        let mut b = pool.get(len - at);
        rd.read_exact(b.bytes_mut()).await?;
        return Ok(false);
    }
    Ok(true)
}

/// Why a reader stopped.
enum End {
    Eof,
    Io(std::io::Error),
    /// The connection failed or closed part-way through the payload of the
    /// data frame at this key (see [`Shared::lose`]).
    Cut(Key, std::io::Error),
    Bad(String),
}

/// Whether a connection ended because the kernel gave up on the peer's host
/// (no answer for `peer_timeout`: see [`watch_liveness`]).
fn host_silent(end: &End) -> bool {
    matches!(end, End::Io(e) | End::Cut(_, e) if e.kind() == std::io::ErrorKind::TimedOut)
}

async fn read_loop(shared: Arc<Shared>, peer: usize, id: u64, rd: OwnedReadHalf) {
    // Small: headers and small frames come in one read, while most of a large
    // payload bypasses the buffer (what is buffered is copied twice; at 64 KiB
    // that was a quarter of each segment when they were 256 KiB).
    let mut rd = BufReader::with_capacity(READ_BUFFER, rd);
    let end = tokio::select! {
        e = read_frames(&shared, peer, &mut rd) => e,
        _ = shared.cancel.cancelled() => return,
    };
    let reason = match &end {
        End::Eof => "its connection closed (EOF): the process exited or was killed".to_owned(),
        End::Io(e) | End::Cut(_, e) => format!("its connection failed: {e}"),
        End::Bad(why) => {
            tracing::warn!(peer, "dropping the connection: {why}");
            format!("it sent a bad frame ({why}); the connection was dropped")
        }
    };
    let last = shared.remove_conn(peer, id);
    if matches!(end, End::Bad(_)) {
        shared.mark_gone(peer, &reason);
        return;
    }
    // A connection that failed (rather than closed between frames) has lost
    // what the peer had written to it and we had not read: a frame cut off
    // part-way, a header, or whole frames. Nothing sends them again, so if
    // the sender lives on, the receives for them must fail at once rather
    // than wait for the op's timeout; if the sender died, its waiters are to
    // be told that.
    let cut = match &end {
        End::Cut(key, e) => Some((*key, e.to_string())),
        _ => None,
    };
    let lossy = matches!(end, End::Io(_) | End::Cut(..));
    // Two connections with a peer (both sides opened one at once) close in any
    // order when it exits, and each reader delivers its frames before it sees
    // the end: the peer is gone only when its last connection has closed,
    // counting one still in its handshake.
    if !last && !lossy {
        return;
    }
    tokio::select! {
        _ = shared.handshakes_settled() => {}
        _ = shared.cancel.cancelled() => return,
    }
    // Check by connecting anew before naming it gone: a live peer can
    // close a connection too (one it dropped mid-handshake when the op
    // that opened it was cancelled, or one we timed out), while a dead one
    // refuses at once. For a failed connection, always on a connection of
    // its own: another open one may be a killed rank's, about to end too.
    //
    // A connection the kernel timed out (`TCP_USER_TIMEOUT` or keep-alive,
    // both set to `peer_timeout` by `watch_liveness`) needs no check: the
    // peer's host has not answered for `peer_timeout`, which is what gone
    // means, and a check would wait for another connection to a host that
    // does not answer (`handshake_timeout` and more: survivors of a host cut
    // off named it after 9.2 s with a 3 s `peer_timeout`).
    let within = Instant::now() + shared.cfg.handshake_timeout + ABORT_DEADLINE;
    let alive = if host_silent(&end) {
        false
    } else if lossy {
        tokio::select! {
            r = shared.open(peer, within) => match r {
                Ok(s) => {
                    shared.register(peer, s);
                    true
                }
                Err(_) => false,
            },
            _ = shared.cancel.cancelled() => return,
        }
    } else {
        shared.connected(peer)
            || tokio::select! {
                r = shared.conn(peer, 0, within) => r.is_ok(),
                _ = shared.cancel.cancelled() => return,
            }
    };
    if !alive {
        if last {
            shared.mark_gone(peer, &reason);
        }
        return;
    }
    if let Some((key, why)) = cut {
        shared.lose(key, &why);
    }
    if lossy {
        shared.lose_peer(peer, &reason);
    }
}

/// Test fault: writes the first `after` bytes of a frame to `conn`, then
/// resets it (see [`Shared::break_at_frame`]).
#[cfg(feature = "faults")]
async fn break_conn(conn: &Conn, head: &[u8], payload: &[u8], after: usize) {
    use std::os::fd::AsRawFd;
    let mut w = conn.writer.lock().await;
    let n = after.min(head.len());
    let _ = w.write_all(&head[..n]).await;
    let m = (after - n).min(payload.len());
    let _ = w.write_all(&payload[..m]).await;
    // A `connect` to no address (`AF_UNSPEC`) disconnects a TCP socket,
    // with a reset (Linux `tcp_disconnect`); the descriptor stays ours, and
    // both halves then fail.
    let fd = w.as_ref().as_raw_fd();
    // SAFETY: a zeroed `sockaddr` with family `AF_UNSPEC` is a valid
    // argument of its stated length, and `fd` is this connection's socket,
    // open while `w` is held.
    unsafe {
        let mut a: libc::sockaddr = std::mem::zeroed();
        a.sa_family = libc::AF_UNSPEC as libc::sa_family_t;
        libc::connect(
            fd,
            &a,
            std::mem::size_of::<libc::sockaddr>() as libc::socklen_t,
        );
    }
}

async fn read_frames(shared: &Arc<Shared>, peer: usize, rd: &mut BufReader<OwnedReadHalf>) -> End {
    loop {
        let mut head = [0u8; HEADER_LEN];
        // A clean EOF is one between frames.
        match rd.read(&mut head[..1]).await {
            Ok(0) => return End::Eof,
            Ok(_) => {}
            Err(e) => return End::Io(e),
        }
        if let Err(e) = rd.read_exact(&mut head[1..]).await {
            return End::Io(e);
        }
        let h = match Header::decode(&head) {
            Ok(h) => h,
            Err(e) => return End::Bad(e.0),
        };
        let is_data = matches!(h, Header::Data { .. });
        if let Some(l) = is_data.then(|| shared.land(peer, &h)).flatten() {
            match read_landing(rd, &l, &shared.pool).await {
                Ok(whole) => shared.landed(peer, &h, whole),
                Err(e) => return End::Cut(data_key(peer, &h).0, e),
            }
            continue;
        }
        let mut buf = shared.pool.get(h.payload_len() as usize);
        if let Err(e) = rd.read_exact(buf.bytes_mut()).await {
            return if is_data {
                End::Cut(data_key(peer, &h).0, e)
            } else {
                End::Io(e)
            };
        }
        match h {
            Header::Want {
                comm, seq, desc, ..
            } => {
                if let Err(why) = shared.want(peer, comm, seq, desc) {
                    return End::Bad(why);
                }
            }
            Header::Abort {
                comm,
                own,
                from,
                provisional,
                ..
            } => {
                let why = String::from_utf8_lossy(buf.bytes()).into_owned();
                let group = shared
                    .members(comm)
                    .map_or_else(|| shared.cfg.name.clone(), |m| m.name);
                let grank = shared.members(comm).map_or(peer, |m| m.group_rank(peer));
                let err = Error::Aborted {
                    group,
                    reason: format!("rank {grank} aborted it: {why}").into(),
                    by: own.then_some(grank),
                };
                if provisional {
                    shared.hold_told(comm, err, from, peer);
                } else {
                    shared.abort(comm, err, Origin::Passed(Some(peer)), from);
                }
            }
            Header::Data { .. } => {
                if let Err(why) = shared.deliver(peer, h, buf) {
                    return End::Bad(why);
                }
            }
            Header::Flow { credit, blocked } => shared.flow(peer, credit, blocked),
        }
    }
}

/// What the control loop does after a frame failed to go out: wait this
/// long and send it again, or drop it (`None`). A peer that is gone, or that
/// refused the handshake (another job's, or a stale group's listener on its
/// address), will never take it, and an aborted group needs it no more;
/// anything else (no answer to the handshake in time, a connection that
/// broke, a deadline) may pass, so it is retried, backing off from 10 ms to
/// 1 s (`attempt` counts this frame's failures, from 0).
fn control_retry(f: &Fail, attempt: u32) -> Option<Duration> {
    match f {
        Fail::Gone { .. } | Fail::Refused { .. } | Fail::Aborted(_) => None,
        Fail::Unanswered { .. } | Fail::Lost { .. } | Fail::Timeout => Some(
            Duration::from_millis(10)
                .saturating_mul(1 << attempt.min(7))
                .min(Duration::from_secs(1)),
        ),
    }
}

/// Sends the flow and want frames queued for `peer`, in order. A frame is
/// dropped when it can never be taken ([`control_retry`]).
async fn control_loop(
    shared: Arc<Shared>,
    peer: usize,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Header>,
) {
    loop {
        let h = tokio::select! {
            h = rx.recv() => match h { Some(h) => h, None => return },
            _ = shared.cancel.cancelled() => return,
        };
        // A lost credit or want would leave a sender waiting for good:
        // retried until sent or the peer is gone.
        for attempt in 0.. {
            let deadline = Instant::now() + shared.cfg.handshake_timeout + ABORT_DEADLINE;
            let Err(f) = shared.send_frame(peer, &h, &[], 0, deadline).await else {
                break;
            };
            let Some(wait) = control_retry(&f, attempt) else {
                if let Fail::Refused { reason, .. } = &f {
                    tracing::warn!(
                        peer,
                        "a flow-control frame was dropped: the peer refused it: {reason}"
                    );
                }
                break;
            };
            tracing::debug!(peer, ?wait, "a flow-control frame was not sent; retrying");
            tokio::select! {
                _ = sleep(wait) => {}
                _ = shared.cancel.cancelled() => return,
            }
        }
    }
}

async fn accept_loop(shared: Arc<Shared>, listener: TcpListener) {
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = shared.cancel.cancelled() => return,
        };
        match accepted {
            Ok((s, from)) => {
                let shared = shared.clone();
                shared.rt.clone().spawn(async move {
                    let cancel = shared.cancel.clone();
                    tokio::select! {
                        _ = accept_one(shared, s, from) => {}
                        _ = cancel.cancelled() => {}
                    }
                });
            }
            Err(e) => {
                // Out of descriptors and the like: back off rather than spin.
                tracing::warn!("accept failed: {e}");
                sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

async fn accept_one(shared: Arc<Shared>, mut s: TcpStream, from: SocketAddr) {
    let _ = s.set_nodelay(true);
    watch_liveness(&s, shared.cfg.peer_timeout);
    // Counted until settled, or until dropped (the transport shut down
    // mid-handshake), so that nobody waits on it in vain.
    struct Handshaking<'a>(&'a Shared, bool);
    impl Handshaking<'_> {
        fn settle(&mut self) {
            if std::mem::take(&mut self.1) && self.0.handshaking.fetch_sub(1, Ordering::AcqRel) == 1
            {
                self.0.handshakes_done.notify_waiters();
            }
        }
    }
    impl Drop for Handshaking<'_> {
        fn drop(&mut self) {
            self.settle();
        }
    }
    shared.handshaking.fetch_add(1, Ordering::AcqRel);
    let mut shaking = Handshaking(&shared, true);
    let verdict = match timeout(HANDSHAKE_TIMEOUT, read_hello(&mut s)).await {
        Err(_) => Err((REFUSED, format!("no hello within {HANDSHAKE_TIMEOUT:?}"))),
        Ok(Err(e)) => Err((REFUSED, e)),
        Ok(Ok(h)) => check_hello(&shared.cfg, &h).map(|()| h.src as usize),
    };
    match verdict {
        Ok(src) => {
            if s.write_all(&[ACCEPTED]).await.is_ok() {
                shared.register(src, s);
            }
            shaking.settle();
        }
        Err((status, why)) => {
            shaking.settle();
            shared.refused.fetch_add(1, Ordering::Relaxed);
            if status == NOT_HERE {
                // Whoever had this port before us exited; its group's
                // survivors find it gone here. Not a fault of ours.
                tracing::debug!(%from, "refused a connection: {why}");
            } else {
                tracing::warn!(%from, "refused a connection: {why}");
            }
            let why = &why.as_bytes()[..why.len().min(4096)];
            let mut reply = vec![status];
            reply.extend_from_slice(&(why.len() as u16).to_le_bytes());
            reply.extend_from_slice(why);
            let _ = timeout(Duration::from_secs(1), s.write_all(&reply)).await;
        }
    }
}

async fn read_hello(s: &mut TcpStream) -> Result<Hello, String> {
    let mut fixed = [0u8; HELLO_LEN];
    s.read_exact(&mut fixed)
        .await
        .map_err(|e| format!("reading the hello: {e}"))?;
    let (mut h, n) = Hello::decode_fixed(&fixed).map_err(|e| e.0)?;
    let mut name = vec![0; n];
    s.read_exact(&mut name)
        .await
        .map_err(|e| format!("reading the hello: {e}"))?;
    h.name = String::from_utf8(name).map_err(|_| "the group name is not UTF-8".to_owned())?;
    Ok(h)
}

/// The status a refused hello is answered with, and why.
fn check_hello(cfg: &Config, h: &Hello) -> Result<(), (u8, String)> {
    // Another group's or instance's member dialled an address that is ours
    // now: the one it wanted is not here.
    if h.name != cfg.name {
        return Err((
            NOT_HERE,
            format!("it is for group {:?}; this is group {:?}", h.name, cfg.name),
        ));
    }
    if h.nonce != cfg.nonce {
        return Err((NOT_HERE, format!(
            "it is from another instance of group {:?} (generation {:016x}, ours {:016x}): an earlier round or another job",
            cfg.name, h.nonce, cfg.nonce
        )));
    }
    check_member(cfg, h).map_err(|why| (REFUSED, why))
}

/// A hello of this group instance that this member still cannot accept.
fn check_member(cfg: &Config, h: &Hello) -> Result<(), String> {
    if h.world as usize != cfg.world {
        return Err(format!(
            "it has world size {}, ours is {}",
            h.world, cfg.world
        ));
    }
    if h.dst as usize != cfg.rank {
        return Err(format!(
            "it is addressed to rank {}; this is rank {}",
            h.dst, cfg.rank
        ));
    }
    if h.src as usize >= cfg.world || h.src as usize == cfg.rank {
        return Err(format!("it claims to be rank {}", h.src));
    }
    if h.layout != cfg.layout {
        return Err(
            "its options differ (segment size or algorithm thresholds); every rank must use the same"
                .into(),
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncBufReadExt;

    #[test]
    fn control_frames_back_off_and_are_dropped_only_when_never_taken() {
        let ms = Duration::from_millis;
        let (rank, reason) = (1, String::from("x"));
        let aborted = Fail::Aborted(Error::Invalid("aborted".into()));
        for never in [
            Fail::Gone {
                rank,
                reason: reason.clone(),
            },
            Fail::Refused {
                rank,
                reason: reason.clone(),
            },
            aborted,
        ] {
            assert_eq!(control_retry(&never, 0), None);
        }
        for maybe in [
            Fail::Unanswered {
                rank,
                reason: reason.clone(),
            },
            Fail::Lost {
                rank,
                reason: reason.clone(),
            },
            Fail::Timeout,
        ] {
            let waits: Vec<_> = [0, 1, 2, 6, 7, 8, 1000]
                .iter()
                .map(|&a| control_retry(&maybe, a))
                .collect();
            assert_eq!(
                waits,
                [10, 20, 40, 640, 1000, 1000, 1000].map(|w| Some(ms(w)))
            );
        }
    }

    async fn pair() -> (TcpStream, BufReader<OwnedReadHalf>) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let tx = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (rx, _) = l.accept().await.unwrap();
        let (rd, wr) = rx.into_split();
        std::mem::forget(wr); // keep the connection open
        (tx, BufReader::with_capacity(READ_BUFFER, rd))
    }

    /// A payload lands whole, part of it already in the reader's buffer;
    /// the bytes after it are left for the next frame.
    #[tokio::test]
    async fn a_payload_lands_whole_from_the_buffer_and_the_socket() {
        let (mut tx, mut rd) = pair().await;
        let pool = Pool::new(1024, 1 << 20);
        let data: Vec<u8> = (0..1000u32).map(|i| i as u8).collect();
        tx.write_all(&data[..400]).await.unwrap();
        // Some of the first 400 bytes now sit in the reader's buffer.
        assert!(!rd.fill_buf().await.unwrap().is_empty());
        let mut buf = vec![0u8; 1000];
        let gate = Arc::new(Gate::default());
        let l = unsafe { Landing::new(buf.as_mut_ptr(), buf.len(), gate.clone()) };
        let writer = tokio::spawn(async move {
            tx.write_all(&data[400..]).await.unwrap();
            tx.write_all(b"next").await.unwrap();
            tx
        });
        assert!(read_landing(&mut rd, &l, &pool).await.unwrap());
        let _tx = writer.await.unwrap();
        gate.revoke();
        let want: Vec<u8> = (0..1000u32).map(|i| i as u8).collect();
        assert_eq!(buf, want);
        let mut next = [0u8; 4];
        rd.read_exact(&mut next).await.unwrap();
        assert_eq!(&next, b"next");
    }

    /// Once its op revoked the landing, a payload is read into scratch and
    /// the op's buffer is never written; the next frame is intact.
    #[tokio::test]
    async fn a_revoked_landing_is_drained_never_written() {
        let (mut tx, mut rd) = pair().await;
        let pool = Pool::new(1024, 1 << 20);
        let mut buf = vec![0u8; 1000];
        let gate = Arc::new(Gate::default());
        let l = unsafe { Landing::new(buf.as_mut_ptr(), buf.len(), gate.clone()) };
        gate.revoke();
        tx.write_all(&[7u8; 1000]).await.unwrap();
        tx.write_all(b"next").await.unwrap();
        assert!(!read_landing(&mut rd, &l, &pool).await.unwrap());
        assert!(buf.iter().all(|&b| b == 0), "a revoked landing was written");
        let mut next = [0u8; 4];
        rd.read_exact(&mut next).await.unwrap();
        assert_eq!(&next, b"next");
    }
}
