//! Frames in: one reader task per connection reads frames and hands each
//! to the router (to its waiting receive, into a posted landing, or filed
//! until its op asks); and the receives ops make.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::io::{AsyncReadExt, BufReader};
use tokio::net::tcp::OwnedReadHalf;
use tokio::time::{sleep, sleep_until, Instant};

use super::flow::Release;
use super::landing::Landing;
use super::router::{Delivery, Fail, Frame, Key, Start};
use super::{lock, Origin, Shared, ABORT_DEADLINE};
use crate::element::{Buf, Pool};
use crate::error::Error;
use crate::frame::{Desc, Header, OpKind, HEADER_LEN};

impl Shared {
    /// Hands a data frame to its waiter or the mailbox, checking it against the
    /// local operation first.
    pub(super) fn deliver(
        self: &Arc<Self>,
        src: usize,
        header: Header,
        buf: Buf,
    ) -> Result<(), String> {
        let (key, desc) = data_key(src, &header);
        let d = self.route(|r| r.deliver(key, desc, buf));
        self.act(src, d)
    }

    /// The landing posted for a data frame from `src`, if its payload may be
    /// read straight into it.
    pub(super) fn land(self: &Arc<Self>, src: usize, header: &Header) -> Option<Landing> {
        let (key, desc) = data_key(src, header);
        if key.p2p {
            return None; // messages are never posted
        }
        lock(&self.router).land(key, desc, header.payload_len() as usize)
    }

    /// A payload taken by [`Shared::land`] was read (into its landing if
    /// `whole`).
    pub(super) fn landed(self: &Arc<Self>, src: usize, header: &Header, whole: bool) {
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
    pub(super) fn want(
        self: &Arc<Self>,
        src: usize,
        comm: u64,
        seq: u64,
        desc: Desc,
    ) -> Result<(), String> {
        let release = Release::of(comm, seq, &desc);
        lock(&self.outbound).release(src, release);
        self.flow_changed.notify_waiters();
        if release.p2p {
            return Ok(());
        }
        let d = lock(&self.router).want(comm, seq, src as u32, desc);
        self.act(src, d)
    }

    pub(super) fn act(self: &Arc<Self>, src: usize, d: Delivery) -> Result<(), String> {
        match d {
            Delivery::Taken | Delivery::Filed => {}
            // The sender does not know yet: tell it (once).
            Delivery::TellAbort => self.tell_aborts_to(src, None),
            Delivery::Clash(c) => self.raise(c),
            Delivery::Duplicate(why) => return Err(why),
        }
        Ok(())
    }

    /// Waits for the frame at `key` until `deadline`. `want`: the local call,
    /// for a collective.
    ///
    /// After [`Config::probe_after`](super::Config::probe_after) the peer is asked for it (a
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
                        // does not answer, or holds another job secret, fails
                        // only this receive.
                        if let Err(f @ (Fail::Unanswered { .. } | Fail::Secret { .. })) = asked {
                            lock(&me.router).fail_recv(key, f);
                        }
                    });
                }
            }
        }
    }
}

/// The reader's buffer, in bytes.
pub(super) const READ_BUFFER: usize = 8 << 10;

/// A data frame's key and description.
pub(super) fn data_key(src: usize, header: &Header) -> (Key, Desc) {
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
pub(super) async fn read_landing(
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
pub(super) enum End {
    Eof,
    Io(std::io::Error),
    /// The connection failed or closed part-way through the payload of the
    /// data frame at this key (see [`Shared::lose`]).
    Cut(Key, std::io::Error),
    Bad(String),
}

/// Whether a connection ended because the kernel gave up on the peer's host
/// (no answer for `peer_timeout`: see [`watch_liveness`](super::conn::watch_liveness)).
pub(super) fn host_silent(end: &End) -> bool {
    matches!(end, End::Io(e) | End::Cut(_, e) if e.kind() == std::io::ErrorKind::TimedOut)
}

pub(super) async fn read_loop(shared: Arc<Shared>, peer: usize, id: u64, rd: OwnedReadHalf) {
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

pub(super) async fn read_frames(
    shared: &Arc<Shared>,
    peer: usize,
    rd: &mut BufReader<OwnedReadHalf>,
) -> End {
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

#[cfg(test)]
mod tests {
    use super::super::Gate;
    use super::*;
    use tokio::io::AsyncBufReadExt;
    use tokio::io::AsyncWriteExt;
    use tokio::net::{TcpListener, TcpStream};

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
        // SAFETY: the buffer outlives the landing: the test ends it (or
        // revokes it) before the buffer is dropped.
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
        // SAFETY: the buffer outlives the landing: the test ends it (or
        // revokes it) before the buffer is dropped.
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
