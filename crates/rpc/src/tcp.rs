//! The TCP backend (the default, in TensorPipe's place): direct connections
//! between workers, opened lazily, large payloads over several streams.
//!
//! Each worker listens on one port and publishes it. A worker sends on its own
//! outgoing connections to a peer and reads the peer's messages on the
//! connections the peer opened, so two workers never race to open the same
//! connection. A connection starts with a [`Hello`] naming the group's
//! generation and both workers; anything else (another job, an earlier group,
//! garbage) is refused with a reason and closed, and the listener goes on.
//!
//! A message is a [`FrameHead`], the envelope and its bulk. Stream 0 carries
//! the messages with little bulk (under 64 KiB): calls, answers, control
//! messages. The others carry bulk, so a call never queues behind a
//! transfer: a message with more bulk goes whole on one of them (in turn),
//! and one whose bulk reaches `split_bytes` is cut into one part per bulk
//! stream at fixed places ([`part_range`]), written on all of them at once.
//! The receiver reads every part straight into its place in one buffer (no
//! copy to put them together) and checks that each part is where its index
//! says. Messages on different streams may overtake each other: nothing in
//! the agent assumes an order between messages.
//!
//! With a job secret (`RpcBackendOptions::secret`, opt-in), every
//! connection proves it before its hello, both ways (`admission.rs`: what
//! it covers and what it costs).
//!
//! # Who owns a connection
//!
//! Each outgoing connection belongs to a `line::Line` (one per peer and
//! stream, started on first use): a caller writes its frame itself when the
//! line is idle, with non-blocking writes (no await); what the socket does
//! not take, and frames for a busy line, go to the line's writer task, in
//! order. So a caller that gives
//! up (its timeout, or a `select!` around the call) never leaves half a frame
//! on a connection, and never closes one: a frame not yet begun is skipped, a
//! frame begun is finished. The parts of one message are all written or none,
//! so the receiver is never left holding parts of a message that will not be
//! completed.
//!
//! # When a peer is gone
//!
//! A connection that ends (EOF or reset, on either direction) is not taken
//! for a dead peer: the writer reconnects. The peer is reported gone only
//! when reconnecting after such an end fails (refused, refused at the
//! handshake, or not done within the connect timeout), or when any connect
//! is refused (nothing listens at its address: the process exited or was
//! killed; or another process holds the port). A worker that
//! dies is still noticed at once (the kernel closes its sockets and its
//! listener together); a stopped or partitioned one is found by the agent's heartbeat, which
//! asks [`Transport::heard_from`]: when bytes last came from the peer, or
//! it last took bytes we sent after our socket buffer had filled.

use std::collections::HashMap;
use std::io::IoSlice;
use std::net::SocketAddr;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use rallypoint_auth::{JobSecret, RefusalCounts, Refusals};
use rallypoint_sync::MutexExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

mod admission;
mod buffers;
mod line;

use crate::transport::{BoxFuture, ConnectError, Deliver, Event, Outgoing, Transport};
use crate::wire::{part_range, FrameHead, Hello, HEAD_LEN, HELLO_LEN, MAX_PARTS};
use buffers::{Pieces, Pool};
use line::{Commit, Frame, Line, Submitted};

/// TCP backend settings.
#[derive(Debug, Clone)]
pub struct TcpOptions {
    /// Connections per peer for large messages.
    pub streams: usize,
    /// Bulk size from which a message is split over the streams.
    pub split_bytes: u64,
    /// Largest bulk accepted in one message.
    pub max_message_bytes: u64,
    /// Address to listen on and publish (default: loopback, or the address
    /// that routes to `MASTER_ADDR`).
    pub listen: Option<std::net::IpAddr>,
    /// With a job secret: how long a connecting peer has to prove it before
    /// its connection is refused (default [`rallypoint_auth::io::SERVER_DEADLINE`], 2 s).
    pub secret_deadline: Duration,
}

impl Default for TcpOptions {
    fn default() -> Self {
        TcpOptions {
            streams: 4,
            split_bytes: 16 << 20,
            max_message_bytes: 8 << 30,
            listen: None,
            secret_deadline: rallypoint_auth::io::SERVER_DEADLINE,
        }
    }
}

struct Peer {
    /// Shared with its lines' writers, which need only the address: when the
    /// peer is dropped (it left, or shutdown), its lines close and their
    /// writers end.
    addr: Arc<Mutex<Option<SocketAddr>>>,
    /// One line per stream, started on first use.
    lines: Vec<std::sync::OnceLock<Line>>,
}

impl Peer {
    fn line(&self, sh: &Arc<Shared>, to: u32, stream: usize) -> &Line {
        self.lines[stream].get_or_init(|| Line::start(sh, to, self.addr.clone(), stream as u16))
    }
}

/// Messages arriving in parts, by (sender, message id), and the last ones
/// given up: a part of a message given up (another of its streams ended) is
/// read and dropped, not taken for a new message (which could never
/// complete, and would hold a buffer of the message's whole size).
#[derive(Default)]
struct Partials {
    live: HashMap<(u32, u64), Partial>,
    given_up: std::collections::VecDeque<(u32, u64)>,
}

/// How many given-up messages are remembered.
const GIVEN_UP: usize = 1024;

/// A message arriving in parts: one buffer, each part read into its place.
struct Partial {
    env: Vec<u8>,
    buf: Arc<Pieces>,
    slots: Vec<Slot>,
    left: u8,
    total: u64,
}

/// Where a part stands. Only the reader that moved it from free to reading
/// (under the partials' lock) writes its place.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Slot {
    Free,
    Reading,
    Filled,
}

/// When each peer last showed it is alive below the message level: bytes
/// read from it, or bytes it took from us. Milliseconds since `base`, plus
/// one (zero: never).
struct Liveness {
    base: std::time::Instant,
    peers: Mutex<HashMap<u32, Arc<AtomicU64>>>,
}

impl Liveness {
    fn stamp(&self, peer: u32) -> Arc<AtomicU64> {
        self.peers.locked().entry(peer).or_default().clone()
    }

    fn mark(&self, s: &AtomicU64) {
        s.store(
            self.base.elapsed().as_millis() as u64 + 1,
            Ordering::Relaxed,
        );
    }

    fn last(&self, peer: u32) -> Option<std::time::Instant> {
        let v = self.peers.locked().get(&peer)?.load(Ordering::Relaxed);
        (v > 0).then(|| self.base + Duration::from_millis(v - 1))
    }
}

/// The runtime of the bulk streams (1 and up): their readers and writers
/// run on threads of their own, so that the caller's runtime, which runs
/// stream 0 (calls, answers, control messages) and the handlers, is never
/// busy copying a transfer when a small message arrives. Dropped without
/// blocking (it may be dropped inside the caller's runtime).
struct BulkRuntime(Option<tokio::runtime::Runtime>);

impl BulkRuntime {
    fn start() -> std::io::Result<BulkRuntime> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("rally-rpc-bulk")
            .enable_all()
            .build()?;
        Ok(BulkRuntime(Some(rt)))
    }

    fn handle(&self) -> Option<tokio::runtime::Handle> {
        self.0.as_ref().map(|rt| rt.handle().clone())
    }
}

impl Drop for BulkRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

struct Shared {
    me: u32,
    alive: Liveness,
    /// Receive buffers, reused (`buffers.rs`).
    buffers: Arc<Pool>,
    bulk: Mutex<BulkRuntime>,
    generation: u64,
    opts: TcpOptions,
    deliver: Deliver,
    peers: Mutex<HashMap<u32, Arc<Peer>>>,
    partials: Mutex<Partials>,
    next_msg: AtomicU64,
    refused: AtomicU64,
    /// The job secret every connection proves first, both ways; `None`:
    /// none (`admission.rs`).
    secret: Option<JobSecret>,
    /// Connections refused by the job-secret handshake, by reason.
    refusals: Refusals,
    tasks: Mutex<Vec<JoinHandle<()>>>,
    writers: Mutex<Vec<JoinHandle<()>>>,
}

/// The TCP transport.
pub struct Tcp {
    sh: Arc<Shared>,
    addr: SocketAddr,
}

impl Tcp {
    /// Binds the listener and starts accepting. With `secret`, every
    /// connection, accepted or dialled, proves it first.
    pub async fn start(
        me: u32,
        generation: u64,
        opts: TcpOptions,
        secret: Option<JobSecret>,
        deliver: Deliver,
    ) -> std::io::Result<Tcp> {
        let ip = opts.listen.unwrap_or(std::net::Ipv4Addr::LOCALHOST.into());
        let listener = TcpListener::bind((ip, 0)).await?;
        let addr = listener.local_addr()?;
        let bulk = BulkRuntime::start()?;
        let sh = Arc::new(Shared {
            me,
            bulk: Mutex::new(bulk),
            buffers: Arc::default(),
            alive: Liveness {
                base: std::time::Instant::now(),
                peers: Mutex::default(),
            },
            generation,
            opts,
            deliver,
            peers: Mutex::default(),
            partials: Mutex::default(),
            next_msg: AtomicU64::new(1),
            refused: AtomicU64::new(0),
            secret,
            refusals: Refusals::new(),
            tasks: Mutex::default(),
            writers: Mutex::default(),
        });
        let accept = tokio::spawn(accept_loop(sh.clone(), listener));
        sh.tasks.locked().push(accept);
        Ok(Tcp { sh, addr })
    }

    /// Connections refused at RPC's hello so far (an earlier group, another
    /// worker, bytes that are no hello).
    pub fn refused(&self) -> u64 {
        self.sh.refused.load(Ordering::Relaxed)
    }

    /// Connections refused by the job-secret handshake so far, by reason
    /// (all zero without a secret).
    pub fn refusals(&self) -> RefusalCounts {
        self.sh.refusals.snapshot()
    }
}

fn spawn_tracked(sh: &Arc<Shared>, f: impl std::future::Future<Output = ()> + Send + 'static) {
    track(sh, tokio::spawn(f));
}

fn track(sh: &Arc<Shared>, h: JoinHandle<()>) {
    let mut t = sh.tasks.locked();
    t.retain(|h| !h.is_finished());
    t.push(h);
}

async fn accept_loop(sh: Arc<Shared>, listener: TcpListener) {
    loop {
        let Ok((mut s, peer)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let sh2 = sh.clone();
        // Each connection in a task of its own, its job-secret handshake
        // too: a slow peer holds only its own connection.
        spawn_tracked(&sh, async move {
            if !admission::admit(&sh2, &mut s, peer).await {
                return;
            }
            match tokio::time::timeout(Duration::from_secs(10), handshake_in(&sh2, s)).await {
                Ok(Ok((from, 0, rd))) => read_loop(sh2, from, 0, rd).await,
                Ok(Ok((from, stream, rd))) => {
                    // A bulk stream: read on the bulk runtime.
                    let Some(bulk) = sh2.bulk_handle() else {
                        return;
                    };
                    let Ok(raw) = rd.into_inner().into_std() else {
                        return;
                    };
                    let sh3 = sh2.clone();
                    let h = bulk.spawn(async move {
                        if let Ok(s) = TcpStream::from_std(raw) {
                            let rd = BufReader::with_capacity(64 << 10, s);
                            read_loop(sh3, from, stream, rd).await;
                        }
                    });
                    track(&sh2, h);
                }
                Ok(Err(e)) => {
                    sh2.refused.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!("refused a connection: {e}");
                }
                Err(_) => {
                    sh2.refused.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!("refused a connection: no hello within 10 s");
                }
            }
        });
    }
}

/// Reads a hello and answers it: `0` accepted, or `1`, a length and why not.
async fn handshake_in(
    sh: &Shared,
    mut s: TcpStream,
) -> Result<(u32, u16, BufReader<TcpStream>), String> {
    let mut b = [0u8; HELLO_LEN];
    s.read_exact(&mut b)
        .await
        .map_err(|e| format!("reading the hello: {e}"))?;
    let verdict = Hello::decode(&b).and_then(|h| {
        if h.generation != sh.generation {
            Err(format!(
                "generation {:016x} is not this group's ({:016x}): another job or an earlier init_rpc",
                h.generation, sh.generation
            ))
        } else if h.to != sh.me {
            Err(format!("this is worker {}, not worker {}", sh.me, h.to))
        } else {
            Ok(h)
        }
    });
    match verdict {
        Ok(h) => {
            s.write_all(&[0]).await.map_err(|e| e.to_string())?;
            let _ = s.set_nodelay(true);
            // This connection only carries the peer's messages to us; we keep
            // it whole (not shut for writing), since the peer reads an end of
            // it as our end (see `watch`).
            Ok((h.from, h.stream, BufReader::with_capacity(64 << 10, s)))
        }
        Err(e) => {
            let _ = s.write_all(&admission::refusal_bytes(1, &e)).await;
            Err(e)
        }
    }
}

async fn read_loop(sh: Arc<Shared>, from: u32, stream: u16, mut rd: BufReader<TcpStream>) {
    let stamp = sh.alive.stamp(from);
    let reason = loop {
        match read_frame(&sh, from, &mut rd, &stamp).await {
            Ok(true) => {}
            Ok(false) => {
                break "its connection closed (EOF): the process exited or was killed".to_owned()
            }
            Err(e) => break e,
        }
    };
    // Part `i` of a message travels on stream `i + 1`: messages still
    // missing this stream's part will never be whole (their sender's call fails or
    // times out); those that have it may still complete on the others.
    if let Some(part) = (stream as usize).checked_sub(1) {
        let mut ps = sh.partials.locked();
        let gone: Vec<(u32, u64)> = ps
            .live
            .iter()
            .filter(|((f, _), p)| *f == from && p.slots.get(part) != Some(&Slot::Filled))
            .map(|(k, _)| *k)
            .collect();
        for k in gone {
            ps.live.remove(&k);
            ps.given_up.push_back(k);
            if ps.given_up.len() > GIVEN_UP {
                ps.given_up.pop_front();
            }
        }
    }
    // The peer's connection to us ended: whether the peer is gone is for our
    // own connection to it to find out.
    sh.probe(from, reason);
}

/// Messages with at least this much bulk go on the bulk streams (1 and up),
/// not on stream 0.
const BULK_BYTES: u64 = 64 << 10;

/// How much of a message's bulk is read at a time: between two pieces the
/// reader marks the peer alive and yields, so that the tasks of small
/// messages (stream 0, answers, handlers) are not kept waiting behind a
/// transfer.
const READ_CHUNK: usize = 256 << 10;

/// Reads one frame; `Ok(false)` on a clean EOF between frames.
async fn read_frame(
    sh: &Shared,
    from: u32,
    rd: &mut BufReader<TcpStream>,
    stamp: &AtomicU64,
) -> Result<bool, String> {
    let mut hb = [0u8; HEAD_LEN];
    match rd.read_exact(&mut hb).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(false),
        Err(e) => return Err(format!("its connection failed: {e}")),
    }
    sh.alive.mark(stamp);
    let h = FrameHead::decode(&hb, sh.opts.max_message_bytes)
        .map_err(|e| format!("it sent a bad frame: {e}"))?;
    let io = |e: std::io::Error| format!("its connection failed mid-message: {e}");
    let mut env = vec![0u8; h.env_len as usize];
    rd.read_exact(&mut env).await.map_err(io)?;
    if h.parts == 1 {
        let mut bulk = sh.buffers.take(h.len as usize);
        read_marked(sh, rd, &mut bulk, stamp).await.map_err(io)?;
        (sh.deliver)(Event::Message {
            from,
            env,
            bulk: bulk.freeze(),
        });
        return Ok(true);
    }
    // A part: take its place in the message's buffer, read into it, mark it
    // filled.
    let taken = {
        let mut ps = sh.partials.locked();
        if ps.given_up.contains(&(from, h.msg)) {
            None
        } else {
            Some(take_place(sh, &mut ps, from, &h)?)
        }
    };
    let Some((buf, place)) = taken else {
        // A part of a message given up: read past it.
        let mut scratch = vec![0u8; READ_CHUNK.min(h.len as usize)];
        let mut left = h.len as usize;
        while left > 0 {
            let n = left.min(scratch.len());
            rd.read_exact(&mut scratch[..n]).await.map_err(io)?;
            sh.alive.mark(stamp);
            left -= n;
        }
        return Ok(true);
    };
    // SAFETY: this part's slot went from free to reading in `take_place`,
    // under the lock, so no other reader has this range; the ranges of a message's
    // parts do not overlap (`part_range`), and it lies within the buffer
    // (checked above).
    let dst = unsafe { buf.piece(place) };
    let read = read_marked(sh, rd, dst, stamp).await;
    // Let go of the buffer before marking the part filled: the last part's
    // reader then owns it alone.
    drop(buf);
    read.map_err(io)?;
    let done = {
        let mut ps = sh.partials.locked();
        let Some(p) = ps.live.get_mut(&(from, h.msg)) else {
            // Given up (another stream of the message ended).
            return Ok(true);
        };
        if h.part == 0 {
            p.env = env;
        }
        p.slots[h.part as usize] = Slot::Filled;
        p.left -= 1;
        if p.left == 0 {
            ps.live.remove(&(from, h.msg))
        } else {
            None
        }
    };
    if let Some(p) = done {
        let Ok(buf) = Arc::try_unwrap(p.buf) else {
            return Err(format!("message {} is still being read", h.msg));
        };
        (sh.deliver)(Event::Message {
            from,
            env: p.env,
            bulk: buf.into_inner().freeze(),
        });
    }
    Ok(true)
}

/// Takes the place of part `h` in its message's buffer (making the message's
/// entry at its first part): the buffer, and the part's range in it.
fn take_place(
    sh: &Shared,
    ps: &mut Partials,
    from: u32,
    h: &FrameHead,
) -> Result<(Arc<Pieces>, Range<usize>), String> {
    let p = ps.live.entry((from, h.msg)).or_insert_with(|| Partial {
        env: Vec::new(),
        buf: Arc::new(Pieces::new(sh.buffers.take(h.bulk_total as usize))),
        slots: vec![Slot::Free; h.parts as usize],
        left: h.parts,
        total: h.bulk_total,
    });
    let r = part_range(h.bulk_total, h.parts, h.part);
    if p.slots.len() != h.parts as usize
        || p.total != h.bulk_total
        || p.slots[h.part as usize] != Slot::Free
        || r.end - r.start != h.len
        || r.end as usize > p.buf.len()
    {
        return Err(format!(
            "it sent an inconsistent part {} of message {}",
            h.part, h.msg
        ));
    }
    p.slots[h.part as usize] = Slot::Reading;
    Ok((p.buf.clone(), r.start as usize..r.end as usize))
}

/// Reads `buf` whole, in pieces, marking the peer alive after each.
async fn read_marked(
    sh: &Shared,
    rd: &mut BufReader<TcpStream>,
    buf: &mut [u8],
    stamp: &AtomicU64,
) -> std::io::Result<()> {
    let pieces = buf.len().div_ceil(READ_CHUNK);
    for piece in buf.chunks_mut(READ_CHUNK) {
        rd.read_exact(piece).await?;
        sh.alive.mark(stamp);
        if pieces > 1 {
            tokio::task::yield_now().await;
        }
    }
    Ok(())
}

/// Opens stream `stream` to `to`: hello, verdict, and a watcher for its end.
async fn connect(
    sh: &Arc<Shared>,
    to: u32,
    addr: SocketAddr,
    stream: u16,
) -> Result<OwnedWriteHalf, ConnectFailed> {
    // One bound for the whole handshake: a peer that accepts and never
    // answers holds nobody past it.
    let s = tokio::time::timeout(CONNECT_TIMEOUT, handshake_out(sh, to, addr, stream))
        .await
        .map_err(|_| ConnectFailed {
            refused: false,
            secret: false,
            why: format!(
                "connecting to {addr} did not complete within {} s",
                CONNECT_TIMEOUT.as_secs()
            ),
        })??;
    let (rd, wr) = s.into_split();
    let sh2 = sh.clone();
    spawn_tracked(sh, watch(sh2, to, rd));
    Ok(wr)
}

/// Why a connection could not be made. `refused`: nothing listens at the
/// peer's address, or what does refused the handshake (another process
/// holds the port): the peer is gone, not slow. `secret`: the job-secret
/// handshake failed (`admission::prove`).
#[derive(Debug)]
struct ConnectFailed {
    refused: bool,
    secret: bool,
    why: String,
}

impl std::fmt::Display for ConnectFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.why)
    }
}

/// How long a connection (connect, hello, verdict) may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// Connects and greets: the hello, then the peer's verdict.
async fn handshake_out(
    sh: &Shared,
    to: u32,
    addr: SocketAddr,
    stream: u16,
) -> Result<TcpStream, ConnectFailed> {
    let other = |why: String| ConnectFailed {
        refused: false,
        secret: false,
        why,
    };
    let mut s = TcpStream::connect(addr).await.map_err(|e| ConnectFailed {
        refused: e.kind() == std::io::ErrorKind::ConnectionRefused,
        secret: false,
        why: format!("connecting to {addr}: {e}"),
    })?;
    let _ = s.set_nodelay(true);
    admission::prove(sh.secret.as_ref(), &mut s, addr).await?;
    let hello = Hello {
        generation: sh.generation,
        from: sh.me,
        to,
        stream,
    };
    s.write_all(&hello.encode())
        .await
        .map_err(|e| other(format!("greeting {addr}: {e}")))?;
    let mut v = [0u8; 1];
    s.read_exact(&mut v)
        .await
        .map_err(|e| other(format!("waiting for {addr} to accept: {e}")))?;
    if v[0] != 0 {
        // `admission::SECRET_REQUIRED`: the peer admits only holders of the
        // job secret, and we have none.
        let secret = v[0] == admission::SECRET_REQUIRED;
        let mut l = [0u8; 2];
        let _ = s.read_exact(&mut l).await;
        let mut m = vec![0u8; u16::from_le_bytes(l) as usize];
        let _ = s.read_exact(&mut m).await;
        return Err(ConnectFailed {
            refused: true,
            secret,
            why: format!(
                "{addr} refused the connection: {}",
                String::from_utf8_lossy(&m)
            ),
        });
    }
    Ok(s)
}

/// The peer never writes on our outgoing connection: a read that returns means
/// it closed or failed.
async fn watch(sh: Arc<Shared>, peer: u32, mut rd: OwnedReadHalf) {
    let mut b = [0u8; 1];
    let reason = match rd.read(&mut b).await {
        Ok(0) => "its connection closed (EOF)".to_owned(),
        Ok(_) => "it wrote on a connection it should only read".to_owned(),
        Err(e) => format!("its connection failed: {e}"),
    };
    sh.probe(peer, reason);
}

/// Writes every buffer; on failure, says how many bytes were written.
/// `progress` is called when the peer took bytes: after a write that
/// followed one the socket did not take whole (the first write only fills
/// our own socket buffer, which a stopped peer does too).
async fn write_vectored_all(
    w: &OwnedWriteHalf,
    mut bufs: &mut [IoSlice<'_>],
    progress: &(dyn Fn() + Sync),
) -> Result<(), (std::io::Error, usize)> {
    let mut written = 0;
    while !bufs.is_empty() {
        let n = match rallypoint_collectives::nosigpipe::send_vectored(w.as_ref(), bufs).await {
            Ok(0) => return Err((std::io::ErrorKind::WriteZero.into(), written)),
            Ok(n) => n,
            Err(e) => return Err((e, written)),
        };
        if written > 0 {
            progress();
        }
        written += n;
        IoSlice::advance_slices(&mut bufs, n);
        if !bufs.is_empty() {
            // A long write lets the other tasks run between its pieces.
            tokio::task::yield_now().await;
        }
    }
    Ok(())
}

/// The pieces of `bulk` within `range`.
fn slice_bulk(bulk: &[Bytes], range: std::ops::Range<u64>) -> Vec<Bytes> {
    let mut out = Vec::new();
    let mut at = 0u64;
    for b in bulk {
        let (s, e) = (at, at + b.len() as u64);
        let (lo, hi) = (range.start.max(s), range.end.min(e));
        if lo < hi {
            out.push(b.slice((lo - s) as usize..(hi - s) as usize));
        }
        at = e;
    }
    out
}

impl Shared {
    /// The bulk runtime, unless shut down.
    fn bulk_handle(&self) -> Option<tokio::runtime::Handle> {
        self.bulk.locked().handle()
    }

    fn peer(&self, to: u32) -> Result<Arc<Peer>, String> {
        self.peers
            .locked()
            .get(&to)
            .cloned()
            .ok_or_else(|| format!("no address known for worker {to}"))
    }

    /// Asks `peer`'s first line to reconnect, reporting the peer gone if
    /// that fails (see the module docs).
    fn probe(self: &Arc<Self>, peer: u32, why: String) {
        match self.peer(peer) {
            Ok(p) => p.line(self, peer, 0).probe(why),
            // Not (or no longer) a peer: nothing to reconnect to.
            Err(_) => (self.deliver)(Event::Gone { peer, reason: why }),
        }
    }
}

impl Transport for Tcp {
    fn address(&self) -> String {
        self.addr.to_string()
    }

    fn add_peer(&self, id: u32, addr: &str) {
        let addr = addr.parse().ok();
        let mut ps = self.sh.peers.locked();
        let n = self.sh.opts.streams.clamp(1, MAX_PARTS as usize);
        let p = ps.entry(id).or_insert_with(|| {
            Arc::new(Peer {
                addr: Arc::default(),
                lines: (0..n).map(|_| std::sync::OnceLock::new()).collect(),
            })
        });
        *p.addr.locked() = addr;
    }

    fn remove_peer(&self, id: u32) {
        let p = self.sh.peers.locked().remove(&id);
        if let Some(p) = p {
            *p.addr.locked() = None;
        }
    }

    fn send(&self, to: u32, msg: Outgoing) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async move {
            let sh = &self.sh;
            let peer = sh.peer(to)?;
            let total = msg.bulk_len();
            let id = sh.next_msg.fetch_add(1, Ordering::Relaxed);
            let n = peer.lines.len();
            // Stream 0 carries small messages only; bulk goes on the others,
            // so a call never queues behind a transfer (see the module docs).
            let (parts, first) = if n == 1 || total < BULK_BYTES {
                (1, 0)
            } else if total >= sh.opts.split_bytes {
                ((n - 1) as u8, 1)
            } else {
                (1, 1 + (id % (n as u64 - 1)) as usize)
            };
            let env_len = msg.env.len() as u32;
            let head = |part: u8| {
                let r = part_range(total, parts, part);
                FrameHead {
                    part,
                    parts,
                    env_len: if part == 0 { env_len } else { 0 },
                    msg: id,
                    bulk_total: total,
                    off: r.start,
                    len: r.end - r.start,
                }
            };
            let commit = Arc::new(Commit::default());
            let env = Bytes::from(msg.env);
            let mut waits = Vec::with_capacity(parts as usize);
            for part in 0..parts {
                let h = head(part);
                let (done, wait) = oneshot::channel();
                let frame = Frame::new(
                    h,
                    if part == 0 { env.clone() } else { Bytes::new() },
                    slice_bulk(&msg.bulk, h.off..h.off + h.len),
                    commit.clone(),
                    done,
                );
                match peer.line(sh, to, first + part as usize).submit(frame) {
                    Submitted::Written => {}
                    Submitted::Queued => waits.push(wait),
                    Submitted::Closed => return Err(format!("worker {to} has left")),
                    Submitted::Failed(e) => return Err(format!("writing to worker {to}: {e}")),
                }
            }
            let mut r = Ok(());
            for w in waits {
                let x = w
                    .await
                    .unwrap_or_else(|_| Err(format!("the connection to worker {to} was closed")));
                if r.is_ok() {
                    r = x;
                }
            }
            r
        })
    }

    fn shutdown(&self, graceful: bool) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            // Closing the queues ends the writers once they have written what
            // was queued (and shut their connections); a graceful shutdown
            // gives them a bound to, the rest are stopped.
            self.sh.peers.locked().clear();
            let mut writers = std::mem::take(&mut *self.sh.writers.locked());
            if graceful {
                let deadline = tokio::time::Instant::now() + SHUTDOWN_FLUSH;
                for w in writers.iter_mut() {
                    let _ = tokio::time::timeout_at(deadline, w).await;
                }
            }
            // Stop every task and wait until it is gone: an aborted task runs
            // on until its next await, and the accept loop may track a new
            // reader meanwhile, so the listener or a reader could still answer
            // after this returned (a join that came just after a non-graceful
            // shutdown was answered, and the member it should have found gone
            // was kept: once in a CI run under load). Again until neither
            // list has any left (a send racing the shutdown may start a
            // writer, and its watch task, meanwhile). The current task, were
            // this ever to run inside one of them, is skipped; the wait is
            // bounded and says so when it ends unfinished.
            let me = tokio::task::try_id();
            let mut batch = writers;
            let all = async {
                loop {
                    batch.extend(std::mem::take(&mut *self.sh.tasks.locked()));
                    batch.retain(|t| Some(t.id()) != me);
                    if batch.is_empty() {
                        break;
                    }
                    for t in &batch {
                        t.abort();
                    }
                    // (A writer the graceful flush saw finish was polled to
                    // its end already: polling it again panics.)
                    for t in batch.drain(..).filter(|t| !t.is_finished()) {
                        let _ = t.await;
                    }
                    batch.extend(std::mem::take(&mut *self.sh.writers.locked()));
                }
            };
            if tokio::time::timeout(Duration::from_secs(1), all)
                .await
                .is_err()
            {
                tracing::warn!(
                    "RPC transport shutdown: tasks still running after 1 s; a connection may answer briefly"
                );
            }
            let bulk = std::mem::replace(&mut *self.sh.bulk.locked(), BulkRuntime(None));
            drop(bulk);
        })
    }

    fn heard_from(&self, peer: u32) -> Option<std::time::Instant> {
        self.sh.alive.last(peer)
    }

    fn connect_now(&self, to: u32) -> BoxFuture<'_, Result<(), ConnectError>> {
        Box::pin(async move {
            // Stream 0's own connection: the one a first call would open.
            let peer = self.sh.peer(to).map_err(ConnectError::Unreachable)?;
            match peer.line(&self.sh, to, 0).open().await {
                Ok(()) => Ok(()),
                Err(e) if e.secret => Err(ConnectError::Secret(e.why)),
                Err(e) => Err(ConnectError::Unreachable(e.why)),
            }
        })
    }

    fn refusals(&self) -> Option<RefusalCounts> {
        Some(self.refusals())
    }
}

/// How long a graceful shutdown lets the writers finish what is queued.
const SHUTDOWN_FLUSH: Duration = Duration::from_secs(5);
