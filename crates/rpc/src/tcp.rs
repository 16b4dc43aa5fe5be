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
//! A message is a [`FrameHead`], the envelope and its bulk. A message whose bulk
//! reaches `split_bytes` is cut into up to `streams` parts at fixed places
//! ([`part_range`]), each written on its own connection at once and put back
//! together by the receiver, which checks that every part is where its index
//! says. Each outgoing connection also watches for the peer's end (EOF or
//! reset), so a worker that dies fails the calls waiting on it at once.

use std::collections::HashMap;
use std::io::IoSlice;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use crate::transport::{BoxFuture, Deliver, Event, Outgoing, Transport};
use crate::wire::{part_range, FrameHead, Hello, HEAD_LEN, HELLO_LEN, MAX_PARTS};

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
}

impl Default for TcpOptions {
    fn default() -> Self {
        TcpOptions {
            streams: 4,
            split_bytes: 16 << 20,
            max_message_bytes: 8 << 30,
            listen: None,
        }
    }
}

type Writer = tokio::sync::Mutex<Option<OwnedWriteHalf>>;

struct Peer {
    addr: Mutex<Option<SocketAddr>>,
    streams: Vec<Writer>,
}

struct Partial {
    env: Vec<u8>,
    parts: Vec<Option<Vec<u8>>>,
    left: u8,
    total: u64,
}

struct Shared {
    me: u32,
    generation: u64,
    opts: TcpOptions,
    deliver: Deliver,
    peers: Mutex<HashMap<u32, Arc<Peer>>>,
    partials: Mutex<HashMap<(u32, u64), Partial>>,
    next_msg: AtomicU64,
    refused: AtomicU64,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

/// The TCP transport.
pub struct Tcp {
    sh: Arc<Shared>,
    addr: SocketAddr,
}

impl Tcp {
    /// Binds the listener and starts accepting.
    pub async fn start(
        me: u32,
        generation: u64,
        opts: TcpOptions,
        deliver: Deliver,
    ) -> std::io::Result<Tcp> {
        let ip = opts.listen.unwrap_or(std::net::Ipv4Addr::LOCALHOST.into());
        let listener = TcpListener::bind((ip, 0)).await?;
        let addr = listener.local_addr()?;
        let sh = Arc::new(Shared {
            me,
            generation,
            opts,
            deliver,
            peers: Mutex::default(),
            partials: Mutex::default(),
            next_msg: AtomicU64::new(1),
            refused: AtomicU64::new(0),
            tasks: Mutex::default(),
        });
        let accept = tokio::spawn(accept_loop(sh.clone(), listener));
        sh.tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(accept);
        Ok(Tcp { sh, addr })
    }

    /// Connections refused at the handshake so far.
    pub fn refused(&self) -> u64 {
        self.sh.refused.load(Ordering::Relaxed)
    }
}

fn spawn_tracked(sh: &Arc<Shared>, f: impl std::future::Future<Output = ()> + Send + 'static) {
    let h = tokio::spawn(f);
    let mut t = sh.tasks.lock().unwrap_or_else(|e| e.into_inner());
    t.retain(|h| !h.is_finished());
    t.push(h);
}

async fn accept_loop(sh: Arc<Shared>, listener: TcpListener) {
    loop {
        let Ok((s, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let sh2 = sh.clone();
        spawn_tracked(&sh, async move {
            match tokio::time::timeout(Duration::from_secs(10), handshake_in(&sh2, s)).await {
                Ok(Ok((from, rd))) => read_loop(sh2, from, rd).await,
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
) -> Result<(u32, BufReader<TcpStream>), String> {
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
            Ok((h.from, BufReader::with_capacity(64 << 10, s)))
        }
        Err(e) => {
            let mut m = vec![1u8];
            m.extend_from_slice(&(e.len() as u16).to_le_bytes());
            m.extend_from_slice(e.as_bytes());
            let _ = s.write_all(&m).await;
            Err(e)
        }
    }
}

async fn read_loop(sh: Arc<Shared>, from: u32, mut rd: BufReader<TcpStream>) {
    let reason = loop {
        match read_frame(&sh, from, &mut rd).await {
            Ok(true) => {}
            Ok(false) => {
                break "its connection closed (EOF): the process exited or was killed".to_owned()
            }
            Err(e) => break e,
        }
    };
    sh.partials
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .retain(|(f, _), _| *f != from);
    (sh.deliver)(Event::Gone { peer: from, reason });
}

/// Reads one frame; `Ok(false)` on a clean EOF between frames.
async fn read_frame(sh: &Shared, from: u32, rd: &mut BufReader<TcpStream>) -> Result<bool, String> {
    let mut hb = [0u8; HEAD_LEN];
    match rd.read_exact(&mut hb).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(false),
        Err(e) => return Err(format!("its connection failed: {e}")),
    }
    let h = FrameHead::decode(&hb, sh.opts.max_message_bytes)
        .map_err(|e| format!("it sent a bad frame: {e}"))?;
    let io = |e: std::io::Error| format!("its connection failed mid-message: {e}");
    let mut env = vec![0u8; h.env_len as usize];
    rd.read_exact(&mut env).await.map_err(io)?;
    let mut bulk = vec![0u8; h.len as usize];
    rd.read_exact(&mut bulk).await.map_err(io)?;
    if h.parts == 1 {
        (sh.deliver)(Event::Message {
            from,
            env,
            bulk: bulk.into(),
        });
        return Ok(true);
    }
    let done = {
        let mut ps = sh.partials.lock().unwrap_or_else(|e| e.into_inner());
        let p = ps.entry((from, h.msg)).or_insert_with(|| Partial {
            env: Vec::new(),
            parts: vec![None; h.parts as usize],
            left: h.parts,
            total: h.bulk_total,
        });
        if p.parts.len() != h.parts as usize
            || p.total != h.bulk_total
            || p.parts[h.part as usize].is_some()
        {
            return Err(format!(
                "it sent an inconsistent part {} of message {}",
                h.part, h.msg
            ));
        }
        if h.part == 0 {
            p.env = env;
        }
        p.parts[h.part as usize] = Some(bulk);
        p.left -= 1;
        if p.left == 0 {
            ps.remove(&(from, h.msg))
        } else {
            None
        }
    };
    if let Some(p) = done {
        let mut all = Vec::with_capacity(p.total as usize);
        for part in p.parts.into_iter().flatten() {
            all.extend_from_slice(&part);
        }
        (sh.deliver)(Event::Message {
            from,
            env: p.env,
            bulk: all.into(),
        });
    }
    Ok(true)
}

/// Opens stream `stream` to `to`: hello, verdict, and a watcher for its end.
async fn connect(
    sh: &Arc<Shared>,
    to: u32,
    addr: SocketAddr,
    stream: u16,
) -> Result<OwnedWriteHalf, String> {
    let mut s = tokio::time::timeout(Duration::from_secs(30), TcpStream::connect(addr))
        .await
        .map_err(|_| format!("connecting to {addr} timed out"))?
        .map_err(|e| format!("connecting to {addr}: {e}"))?;
    let _ = s.set_nodelay(true);
    let hello = Hello {
        generation: sh.generation,
        from: sh.me,
        to,
        stream,
    };
    s.write_all(&hello.encode())
        .await
        .map_err(|e| format!("greeting {addr}: {e}"))?;
    let mut v = [0u8; 1];
    s.read_exact(&mut v)
        .await
        .map_err(|e| format!("waiting for {addr} to accept: {e}"))?;
    if v[0] != 0 {
        let mut l = [0u8; 2];
        let _ = s.read_exact(&mut l).await;
        let mut m = vec![0u8; u16::from_le_bytes(l) as usize];
        let _ = s.read_exact(&mut m).await;
        return Err(format!(
            "{addr} refused the connection: {}",
            String::from_utf8_lossy(&m)
        ));
    }
    let (rd, wr) = s.into_split();
    let sh2 = sh.clone();
    spawn_tracked(sh, watch(sh2, to, rd));
    Ok(wr)
}

/// The peer never writes on our outgoing connection: a read that returns means
/// it closed or failed.
async fn watch(sh: Arc<Shared>, peer: u32, mut rd: OwnedReadHalf) {
    let mut b = [0u8; 1];
    let reason = match rd.read(&mut b).await {
        Ok(0) => "its connection closed (EOF): the process exited or was killed".to_owned(),
        Ok(_) => "it wrote on a connection it should only read".to_owned(),
        Err(e) => format!("its connection failed: {e}"),
    };
    (sh.deliver)(Event::Gone { peer, reason });
}

async fn write_vectored_all<W: AsyncWrite + Unpin>(
    w: &mut W,
    mut bufs: &mut [IoSlice<'_>],
) -> std::io::Result<()> {
    while !bufs.is_empty() {
        let n = w.write_vectored(bufs).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut bufs, n);
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
    fn peer(&self, to: u32) -> Result<Arc<Peer>, String> {
        self.peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&to)
            .cloned()
            .ok_or_else(|| format!("no address known for worker {to}"))
    }

    async fn write_part(
        self: &Arc<Self>,
        to: u32,
        peer: &Peer,
        stream: usize,
        head: FrameHead,
        env: &[u8],
        bulk: &[Bytes],
    ) -> Result<(), String> {
        let mut slot = peer.streams[stream].lock().await;
        // The writer is out of its slot while a frame is written: if the
        // caller gives up mid-frame (its timeout), the connection is dropped
        // rather than left with half a frame on it.
        let mut w = match slot.take() {
            Some(w) => w,
            None => {
                let addr = (*peer.addr.lock().unwrap_or_else(|e| e.into_inner()))
                    .ok_or_else(|| format!("worker {to} has left"))?;
                connect(self, to, addr, stream as u16).await?
            }
        };
        let hb = head.encode();
        let mut slices: Vec<IoSlice> = Vec::with_capacity(bulk.len() + 2);
        slices.push(IoSlice::new(&hb));
        if !env.is_empty() {
            slices.push(IoSlice::new(env));
        }
        slices.extend(bulk.iter().map(|b| IoSlice::new(b)));
        write_vectored_all(&mut w, &mut slices)
            .await
            .map_err(|e| format!("writing to worker {to}: {e}"))?;
        *slot = Some(w);
        Ok(())
    }
}

impl Transport for Tcp {
    fn address(&self) -> String {
        self.addr.to_string()
    }

    fn add_peer(&self, id: u32, addr: &str) {
        let addr = addr.parse().ok();
        let mut ps = self.sh.peers.lock().unwrap_or_else(|e| e.into_inner());
        let n = self.sh.opts.streams.clamp(1, MAX_PARTS as usize);
        let p = ps.entry(id).or_insert_with(|| {
            Arc::new(Peer {
                addr: Mutex::new(None),
                streams: (0..n).map(|_| tokio::sync::Mutex::new(None)).collect(),
            })
        });
        *p.addr.lock().unwrap_or_else(|e| e.into_inner()) = addr;
    }

    fn remove_peer(&self, id: u32) {
        let p = self
            .sh
            .peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id);
        if let Some(p) = p {
            *p.addr.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
    }

    fn send(&self, to: u32, msg: Outgoing) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async move {
            let sh = &self.sh;
            let peer = sh.peer(to)?;
            let total = msg.bulk_len();
            let id = sh.next_msg.fetch_add(1, Ordering::Relaxed);
            let n = peer.streams.len();
            let parts = if n > 1 && total >= sh.opts.split_bytes {
                n as u8
            } else {
                1
            };
            let head = |part: u8| {
                let r = part_range(total, parts, part);
                FrameHead {
                    part,
                    parts,
                    env_len: if part == 0 { msg.env.len() as u32 } else { 0 },
                    msg: id,
                    bulk_total: total,
                    off: r.start,
                    len: r.end - r.start,
                }
            };
            if parts == 1 {
                return sh
                    .write_part(to, &peer, 0, head(0), &msg.env, &msg.bulk)
                    .await;
            }
            let mut tasks = Vec::with_capacity(parts as usize);
            for part in 1..parts {
                let (sh, peer) = (sh.clone(), peer.clone());
                let h = head(part);
                let bulk = slice_bulk(&msg.bulk, h.off..h.off + h.len);
                tasks.push(tokio::spawn(async move {
                    sh.write_part(to, &peer, part as usize, h, &[], &bulk).await
                }));
            }
            let h0 = head(0);
            let first = slice_bulk(&msg.bulk, h0.off..h0.off + h0.len);
            let mut r = sh.write_part(to, &peer, 0, h0, &msg.env, &first).await;
            for t in tasks {
                let x = t.await.unwrap_or_else(|e| Err(e.to_string()));
                if r.is_ok() {
                    r = x;
                }
            }
            r
        })
    }

    fn shutdown(&self, _graceful: bool) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let tasks =
                std::mem::take(&mut *self.sh.tasks.lock().unwrap_or_else(|e| e.into_inner()));
            for t in &tasks {
                t.abort();
            }
            let peers: Vec<Arc<Peer>> = self
                .sh
                .peers
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .drain()
                .map(|(_, p)| p)
                .collect();
            for p in peers {
                for s in &p.streams {
                    if let Some(mut w) = s.lock().await.take() {
                        let _ = w.shutdown().await;
                    }
                }
            }
        })
    }
}
